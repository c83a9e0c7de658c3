"""Learned attention sinks (gpt-oss's ``s_aux``): one logit per query head in the softmax,
of value 0. Every attention path — the C decode kernel, the torch reference, the GPU
backends on CPU tensors, and the prefill attention (CPU flash kernel and the extra-key
form) — equals the definition: a softmax over the scores and the sink, the sink's column
dropped."""

from __future__ import annotations

import pytest
import torch
from test_attention_backends import BACKENDS, ring_and_paged
from test_decode_runtime import CASES, D, G, H, contiguous_segment, rand, stored_case

from kvlab.cache.base import sdpa
from kvlab.kernels import decode_attention, reference_attention
from kvlab.kernels.attention import use_backend
from kvlab.kernels.attention.sinks import attention_sinks, sink_logits

SINKS = torch.randn(H * G, generator=torch.Generator().manual_seed(1)) * 2 + 5  # vs ~300 keys


def by_definition(q, keys, values, visible, sinks, scale):
    """softmax([q.k * scale over the visible keys, sink]) @ [values, 0], q (..., T, D) over
    keys (..., L, D), ``visible`` broadcast to (..., T, L), sinks broadcast to (..., T)."""
    scores = (q.float() @ keys.float().transpose(-1, -2)) * scale
    scores = scores.masked_fill(~visible, float("-inf"))
    sink = sinks.float()[..., None].expand(*scores.shape[:-1], 1)
    probs = torch.cat([scores, sink], dim=-1).softmax(dim=-1)[..., :-1]
    return probs @ values.float()


def attend(backend, segments, sinks=SINKS):
    with use_backend(backend), attention_sinks(sinks):
        return decode_attention(segments, D**-0.5, torch.float32)


@pytest.mark.parametrize("case", CASES)
def test_the_c_kernel_adds_the_sinks_for_every_format(case):
    keys, values = stored_case(case)
    segment = contiguous_segment(keys, values, [0, 5], [300, 123])
    sinks = sink_logits(SINKS, *segment.q.shape[:3])
    want = reference_attention([segment], D**-0.5, sinks)
    torch.testing.assert_close(attend("c", [segment]), want, atol=1e-5, rtol=0)
    assert (want - reference_attention([segment], D**-0.5)).abs().max() > 1e-2  # it matters


def test_the_reference_is_the_definition():
    """Over a contiguous fp32 store, the reference with sinks is the softmax with one more
    column."""
    keys, values = stored_case("fp32")
    segment = contiguous_segment(keys, values, [0, 5], [300, 123])
    slots = torch.arange(300)
    visible = (slots >= segment.lo[:, None]) & (slots < segment.hi[:, None])  # (B, L)
    want = by_definition(
        segment.q, keys.data, values.data, visible[:, None, None], SINKS.view(1, H, G), D**-0.5
    )
    got = reference_attention([segment], D**-0.5, sink_logits(SINKS, *segment.q.shape[:3]))
    torch.testing.assert_close(got, want, atol=1e-5, rtol=0)


@pytest.mark.parametrize("backend", ["c", *BACKENDS])
def test_rings_tables_several_segments_and_per_head_rows(backend):
    ring, paged = ring_and_paged("fp32")
    for segments in ([ring], [paged], [ring, paged]):
        sinks = sink_logits(SINKS, *ring.q.shape[:3])
        want = reference_attention(segments, D**-0.5, sinks)
        torch.testing.assert_close(attend(backend, segments), want, atol=1e-5, rtol=0)
    per_head = attend(backend, [ring.per_head()]).view(want.shape)
    torch.testing.assert_close(per_head, attend(backend, [ring]), atol=1e-5, rtol=0)


@pytest.mark.parametrize("backend", ["c", "reference", *BACKENDS])
def test_a_row_that_sees_no_token_gives_zeros(backend):
    keys, values = stored_case("fp32")
    segment = contiguous_segment(keys, values, [0, 7], [300, 7])
    assert attend(backend, [segment])[1].abs().max() == 0


@pytest.mark.parametrize("narrow_values", [False, True])  # the CPU flash kernel; extra key
@pytest.mark.parametrize("form", ["causal", "mask", "decode"])
def test_the_prefill_attention_adds_the_sinks(form, narrow_values):
    """``sdpa`` under sinks, grouped heads: causal, a boolean mask, one query per row. Values
    narrower than the keys (MLA) take the extra-key form, the others the flash kernel's
    log-sum-exp."""
    batch, kv_heads, steps = 2, H, 1 if form == "decode" else 7
    length = steps if form == "causal" else 11
    q = rand(batch, H * G, steps, D)
    k = rand(batch, kv_heads, length, D)
    v = rand(batch, kv_heads, length, D // 2 if narrow_values else D)
    mask = None
    visible = torch.ones(steps, length, dtype=torch.bool)
    if form == "causal":
        visible = visible.tril()
    else:
        mask = torch.rand(batch, 1, steps, length, generator=torch.Generator().manual_seed(2))
        mask = mask > 0.3
        mask[..., 0] = True
        visible = mask
    with attention_sinks(SINKS):
        got = sdpa(q, k, v, mask=mask, causal=form == "causal")
    keys, values = k.repeat_interleave(G, dim=1), v.repeat_interleave(G, dim=1)
    want = by_definition(q, keys, values, visible, SINKS.view(1, -1, 1), D**-0.5)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
