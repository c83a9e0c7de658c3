"""Learned attention sinks: one logit per query head that joins every softmax's denominator
with a zero value, so a head may attend to nothing (gpt-oss's ``s_aux``, OpenAI 2025,
arXiv 2508.10925; the learned form of the sink tokens of Xiao et al., arXiv 2309.17453).

For an attention output ``O`` over the real keys with log-sum-exp ``L``, the output with a
sink ``s`` is ``O * Z / (Z + e^s) = O * sigmoid(L - s)``: the sink changes no key's weight
relative to another, only the total. So it applies wherever a log-sum-exp is known: the C
decode kernel's merge of its partials, the GPU backends' merge of their segments (the sink
is one more part, output 0 and log-sum-exp ``s``), the torch reference (one more column),
and the prefill attention (:func:`sdpa_with_sinks`).

The model's attention bridge sets a layer's sinks for the duration of its cache's
``attend`` (:func:`attention_sinks`); the attention primitives read them
(:func:`current_sinks`), so every strategy whose attention goes through them — every
registered one — serves a model with sinks unchanged."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from contextvars import ContextVar

import torch
import torch.nn.functional as F

_current: ContextVar[torch.Tensor | None] = ContextVar("attention_sinks", default=None)


@contextlib.contextmanager
def attention_sinks(sinks: torch.Tensor | None) -> Iterator[None]:
    """Within the block, attention adds ``sinks`` (H,) — one logit per query head — to its
    softmax's denominator (None: no sinks)."""
    if sinks is not None and torch.compiler.is_compiling():
        raise RuntimeError("attention sinks run in eager steps only (model.backend=hf)")
    token = _current.set(None if sinks is None else sinks.detach().float())
    try:
        yield
    finally:
        _current.reset(token)


def current_sinks() -> torch.Tensor | None:
    """The sinks (H,) fp32 the attention running now adds, or None. A compiled step has
    none (:func:`attention_sinks` refuses one), and its trace reads no context variable."""
    if torch.compiler.is_compiling():
        return None
    return _current.get()


def sink_logits(sinks: torch.Tensor, batch: int, heads: int, group: int) -> torch.Tensor:
    """Sinks (H,) laid out as a decode output's (B, H_kv, G) query heads, query head
    ``h * G + g`` at (h, g); also the per-head layout (B * H_kv, 1, G) a policy with per-head
    tables builds (``Segment.per_head``), told apart by the head count (for one KV head the
    two coincide)."""
    total = sinks.numel()
    if heads * group == total:
        return sinks.view(1, heads, group).expand(batch, heads, group)
    kv_heads = total // group
    if heads != 1 or kv_heads * group != total or batch % kv_heads:
        raise ValueError(
            f"attention sinks of {total} query heads do not fit a decode of {heads} KV heads "
            f"x {group} query heads each"
        )
    return sinks.view(kv_heads, 1, group).repeat(batch // kv_heads, 1, 1)


def with_sinks(out: torch.Tensor, lse: torch.Tensor, sinks: torch.Tensor) -> torch.Tensor:
    """Attention ``out`` (..., D) with log-sum-exp ``lse`` (...) over the real keys, as the
    output with ``sinks`` (broadcast to ``lse``) in the softmax. A row that sees no key
    (log-sum-exp -inf) stays 0."""
    factor = torch.sigmoid(lse.float() - sinks)
    return (out.float() * factor.nan_to_num(0.0)[..., None]).to(out.dtype)


def sdpa_with_sinks(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | None,
    causal: bool,
    scale: float | None,
    sinks: torch.Tensor,
) -> torch.Tensor:
    """Scaled dot-product attention of q (B, H, T, D) over k, v (B, H_kv, L, D) with
    ``sinks`` (H,): on the CPU, torch's flash kernel, which returns its log-sum-exp; on
    other devices, one more key whose score is the sink and whose value is zero (an
    additive mask carries the score)."""
    heads, kv_heads = q.shape[1], k.shape[1]
    if kv_heads != heads:  # neither form takes grouped heads
        k = k.repeat_interleave(heads // kv_heads, dim=1)
        v = v.repeat_interleave(heads // kv_heads, dim=1)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    bias = None
    if mask is not None:  # True = attend, as an additive mask in q's dtype
        bias = torch.zeros(mask.shape, dtype=q.dtype, device=q.device)
        bias = bias.masked_fill(~mask, float("-inf"))
    if q.device.type == "cpu" and v.shape[-1] == q.shape[-1]:
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            q, k, v, 0.0, causal, attn_mask=bias, scale=scale
        )
        return with_sinks(out, lse, sinks.view(1, -1, 1))
    batch, _, steps, _ = q.shape
    length = k.shape[2]
    if bias is None:
        bias = torch.zeros(steps, length, dtype=q.dtype, device=q.device)
        if causal:
            bias = bias.masked_fill(
                torch.ones(steps, length, dtype=torch.bool, device=q.device).triu(1),
                float("-inf"),
            )
    bias = bias.expand(batch, heads, steps, length)
    column = sinks.to(q.dtype).view(1, heads, 1, 1).expand(batch, heads, steps, 1)
    bias = torch.cat([bias, column], dim=-1)
    k = F.pad(k, (0, 0, 0, 1))
    v = F.pad(v, (0, 0, 0, 1))
    return F.scaled_dot_product_attention(q, k, v, attn_mask=bias, scale=scale)
