"""Decode attention — one query token per sequence over the segments a cache hands over
(:mod:`.segments`) — computed by a backend chosen from the tensors' device:

- ``c``: on the CPU, the C kernel of ``decode_attention.c`` (:mod:`.backend_c`);
- ``gpu``: on CUDA, FlexAttention for segments held in the model dtype
  (:mod:`.backend_flex`) and Triton for codes
  (:mod:`.backend_triton`), each segment in place, merged by log-sum-exp;
- ``reference``: torch ops over a dequantized copy (:func:`reference_attention`), where
  nothing else serves — a correctness reference, not a fast path.

:func:`use_backend` pins one (``flex`` and ``triton`` alone, too): the suite runs the
CUDA backends on CPU tensors that way (FlexAttention eagerly, Triton interpreted), and a
researcher can compare backends on one machine.
"""

from __future__ import annotations

import contextlib

import torch

from kvlab.kernels.attention.backend_c import c_attention, c_kernel_applies, kernel_available
from kvlab.kernels.attention.backend_flex import flex_applies, flex_partial
from kvlab.kernels.attention.backend_triton import triton_applies, triton_partial
from kvlab.kernels.attention.segments import (
    Segment,
    Stored,
    merge_segments,
    per_head_index,
    reference_attention,
    unpack_nibbles,
)
from kvlab.kernels.attention.sinks import current_sinks, sink_logits

BACKENDS = ("auto", "c", "gpu", "flex", "triton", "reference")
_pinned = ["auto"]

__all__ = [
    "BACKENDS", "Segment", "Stored", "c_kernel_allowed", "decode_attention", "kernel_available",
    "per_head_index",
    "reference_attention", "segment_backends", "unpack_nibbles", "use_backend",
]  # fmt: skip


@contextlib.contextmanager
def use_backend(name: str):
    """Within the block, decode attention runs on backend ``name`` (one of BACKENDS)."""
    if name not in BACKENDS:
        raise ValueError(f"attention backend={name!r}: expected one of {', '.join(BACKENDS)}")
    previous = _pinned[0]
    _pinned[0] = name
    try:
        yield
    finally:
        _pinned[0] = previous


def c_kernel_allowed() -> bool:
    """Whether decode attention may run kvlab's C kernel on CPU tensors: no other backend is
    pinned (:func:`use_backend`). The fused decode layer asks before it takes a cache's
    attention into its own C call."""
    return _pinned[0] in ("auto", "c")


def decode_attention(segments: list[Segment], scale: float, out_dtype: torch.dtype):
    """Attention output (B, H_kv, G, D) in ``out_dtype`` of every segment's queries over its
    visible tokens, one softmax across all segments, the layer's attention sinks in it where
    it has them (:mod:`.sinks`)."""
    backends = segment_backends(segments)
    sinks = current_sinks()
    if sinks is not None:
        sinks = sink_logits(sinks, *segments[0].q.shape[:3])
    if backends[0] == "c":
        return c_attention(segments, scale, out_dtype, sinks)
    if backends[0] == "reference":
        return reference_attention(segments, scale, sinks).to(out_dtype)
    if segments[0].q.is_cuda:
        return _per_segment(segments, backends, scale, sinks).to(out_dtype)
    return _per_segment_untraced(segments, backends, scale, sinks).to(out_dtype)


def _per_segment(
    segments: list[Segment], backends: list[str], scale: float, sinks: torch.Tensor | None
) -> torch.Tensor:
    """Each segment by its backend, merged by log-sum-exp: (B, H_kv, G, D) in fp32; sinks
    (B, H_kv, G) merge in as one more part, of output 0."""
    partial = {"flex": flex_partial, "triton": triton_partial}
    parts = [partial[name](s, scale) for name, s in zip(backends, segments, strict=True)]
    if sinks is not None:
        parts.append((torch.zeros_like(parts[0][0]), sinks.to(parts[0][1].device)))
    return merge_segments(parts)


# On CPU tensors FlexAttention runs eagerly and Triton interpreted; neither can be traced
# (inductor's CPU flex returns no log-sum-exp; dynamo cannot guard numpy views), so a
# compiled step breaks its graph there.
_per_segment_untraced = torch.compiler.disable(_per_segment)


def segment_backends(segments: list[Segment]) -> list[str]:
    """The backend of each segment: ``c`` or ``reference`` for all of them, or ``flex`` /
    ``triton`` per segment. A pinned backend that cannot serve a segment is an error."""
    pinned = _pinned[0]
    if pinned == "auto":
        pinned = "gpu" if segments[0].q.is_cuda else "c"
    if pinned == "c":
        return ["c" if all(c_kernel_applies(s) for s in segments) else "reference"] * len(segments)
    if pinned == "reference":
        return ["reference"] * len(segments)
    names = [_gpu_backend(s, pinned) for s in segments]
    return names if "reference" not in names else ["reference"] * len(segments)


def _gpu_backend(s: Segment, pinned: str) -> str:
    if pinned in ("gpu", "flex") and flex_applies(s):
        return "flex"
    if pinned in ("gpu", "triton") and triton_applies(s):
        return "triton"
    if pinned == "gpu":
        return "reference"
    raise ValueError(
        f"attention backend={pinned!r} cannot serve keys {s.keys.format!r} / values "
        f"{s.values.format!r} on {s.q.device.type} (is triton installed?); "
        f"use backend='gpu' to let each segment pick"
    )
