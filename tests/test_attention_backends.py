"""The CUDA decode backends run on CPU tensors against the reference: FlexAttention (eager)
for segments in the model dtype, the Triton kernel (Triton's interpreter, which conftest
selects where there is no GPU) for every format, and both together as ``gpu`` picks them
— over single segments, rings, paged tables, several segments and per-head rows, and
through the engine for every strategy and every composed store × codec."""

from __future__ import annotations

import pytest
import torch
from test_cache_contract import COMPOSED, LOSSY, prompts, recorded
from test_decode_runtime import CASES, GEN, D, H, contiguous_segment, rand, stored_case

from kvlab.cache import build_cache
from kvlab.engine import Engine, GenerationConfig
from kvlab.kernels import Segment, Stored, attention, decode_attention, reference_attention
from kvlab.kernels.attention import segment_backends, use_backend
from kvlab.kernels.attention_flex import block_mask
from kvlab.kernels.attention_triton import triton_interpreted

needs_triton = pytest.mark.skipif(
    not triton_interpreted(),
    reason="triton is not installed, or TRITON_INTERPRET=1 was not set before its import",
)
FP_CASES = ["fp32", "bf16"]


def attend(backend: str, segments: list[Segment], dtype=torch.float32) -> torch.Tensor:
    with use_backend(backend):
        return decode_attention(segments, D**-0.5, dtype)


def tolerance(keys: Stored, backend: str) -> float:
    """FlexAttention computes in the stored dtype (bf16 queries over a bf16 cache);
    Triton and the reference in fp32."""
    return 1e-2 if backend == "flex" and keys.data.dtype == torch.bfloat16 else 1e-5


@pytest.mark.parametrize("case", FP_CASES)
def test_flex_equals_the_reference_over_a_contiguous_store(case):
    keys, values = stored_case(case)
    segment = contiguous_segment(keys, values, [0, 5], [300, 123])
    out = attend("flex", [segment])
    want = reference_attention([segment], D**-0.5)
    torch.testing.assert_close(out, want, atol=tolerance(keys, "flex"), rtol=0)


@needs_triton
@pytest.mark.parametrize("case", CASES)
def test_triton_equals_the_reference_for_every_format(case):
    keys, values = stored_case(case)
    segment = contiguous_segment(keys, values, [0, 5], [300, 123])
    out = attend("triton", [segment])
    torch.testing.assert_close(out, reference_attention([segment], D**-0.5), atol=1e-5, rtol=0)


def ring_and_paged(case: str) -> tuple[Segment, Segment]:
    """A wrapped ring (rows at different depths) and a paged pool read through a random
    table (bounds that start and end mid-block) sharing one query."""
    keys, values = stored_case(case, 64)
    ring = contiguous_segment(keys, values, [100, 0], [150, 40], ring=64)
    dtype = keys.data.dtype if keys.format == "fp" else torch.float32
    pool_k, pool_v = rand(41, H, 16, D, dtype=dtype), rand(41, H, 16, D, dtype=dtype)
    table = torch.randperm(40, generator=GEN)[:30].view(2, 15)
    paged = Segment(ring.q, Stored(pool_k), Stored(pool_v), table, torch.tensor([0, 3]),
                    torch.tensor([240, 17]))  # fmt: skip
    return ring, paged


BACKENDS = ["flex", pytest.param("triton", marks=needs_triton)]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("case", FP_CASES)
def test_rings_tables_and_several_segments(backend, case):
    ring, paged = ring_and_paged(case)
    for segments in ([ring], [paged], [ring, paged]):
        want = reference_attention(segments, D**-0.5)
        out = attend(backend, segments)
        torch.testing.assert_close(out, want, atol=tolerance(ring.keys, backend), rtol=0)
        assert attend(backend, segments, torch.bfloat16).dtype == torch.bfloat16


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("case", FP_CASES)
def test_per_head_rows_attend_as_the_original(backend, case):
    """Every (row, KV head) as a row of its own (compressed's and eviction's per-head
    tables) reads the same tokens."""
    keys, values = stored_case(case, 60)
    ring = contiguous_segment(keys, values, [100, 0], [150, 40], ring=60)
    expected = reference_attention([ring], D**-0.5)
    out = attend(backend, [ring.per_head()]).view(expected.shape)
    torch.testing.assert_close(out, expected, atol=tolerance(keys, backend), rtol=0)


@needs_triton
@pytest.mark.parametrize("case", ["codes4", "fp8", "fp4"])
def test_gpu_takes_flex_for_exact_segments_and_triton_for_codes(case):
    """A quantized history beside an exact paged segment (a KIVI-style split): one
    softmax over both, each read by its own backend, merged by log-sum-exp."""
    keys, values = stored_case(case, 60)  # whole groups of 30 channel-code tokens
    history = contiguous_segment(keys, values, [100, 0], [150, 40], ring=60)
    _, exact = ring_and_paged("fp32")
    segments = [history, Segment(history.q, exact.keys, exact.values, exact.table,
                                 exact.lo, exact.hi)]  # fmt: skip
    with use_backend("gpu"):
        assert segment_backends(segments) == ["triton", "flex"]
    out = attend("gpu", segments)
    torch.testing.assert_close(out, reference_attention(segments, D**-0.5), atol=1e-5, rtol=0)


def test_rows_that_see_no_token_give_zeros():
    keys, values = stored_case("fp32")
    segment = contiguous_segment(keys, values, [0, 7], [300, 7])  # row 1: an empty range
    out = attend("gpu", [segment])
    assert out[1].abs().max() == 0
    torch.testing.assert_close(out, reference_attention([segment], D**-0.5), atol=1e-5, rtol=0)


def test_a_step_builds_its_mask_once_and_a_new_table_gets_a_new_one():
    _, paged = ring_and_paged("fp32")
    assert block_mask(paged) is block_mask(paged)  # every layer of a step: the same mask
    same_values = Segment(paged.q, paged.keys, paged.values, paged.table.clone(), paged.lo,
                          paged.hi)  # fmt: skip
    assert block_mask(same_values) is block_mask(paged)
    before = block_mask(paged)
    paged.table[0, 0] = 40  # the store moved a block in place
    assert block_mask(paged) is not before
    torch.testing.assert_close(
        attend("flex", [paged]), reference_attention([paged], D**-0.5), atol=1e-5, rtol=0
    )


def test_a_backend_that_cannot_serve_a_segment_says_so():
    keys, values = stored_case("codes4")
    segment = contiguous_segment(keys, values, [0, 5], [300, 123])
    with pytest.raises(ValueError, match="backend='flex' cannot serve keys 'channel_codes'"):
        attend("flex", [segment])
    with pytest.raises(ValueError, match="backend='cuda': expected one of auto, c, gpu"):
        attend("cuda", [segment])


def refuse_the_reference(segments, scale):
    raise AssertionError(f"fell back to the reference: {[s.keys.format for s in segments]}")


def engine_logits(model, name: str, options: dict, backend: str):
    batch = prompts(model.config.vocab_size, lengths=(11, 5))
    engine = Engine(model, build_cache(name, model.cache_spec(), options))
    with use_backend(backend):
        return recorded(engine, batch, GenerationConfig(5, stop_on_eos=False))


def engine_cases():
    """Every strategy's lossy setting and every composed store × codec."""
    named = [pytest.param(name, LOSSY[name], id=name) for name in sorted(LOSSY)]
    return named + [p for p in COMPOSED if "exact" not in p.id]


@needs_triton
@pytest.mark.slow
@pytest.mark.parametrize(("name", "options"), engine_cases())
def test_every_strategy_decodes_alike_on_the_gpu_backends(tiny_llama, name, options, monkeypatch):
    """The engine with ``gpu`` (FlexAttention and Triton, as on CUDA) gives the C
    kernel's tokens and logits (fp32, 1e-5), and never falls back to the reference."""
    tokens, logits = engine_logits(tiny_llama, name, options, "c")
    monkeypatch.setattr(attention, "reference_attention", refuse_the_reference)
    gpu_tokens, gpu_logits = engine_logits(tiny_llama, name, options, "gpu")
    assert gpu_tokens == tokens
    for got, want in zip(gpu_logits, logits, strict=True):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
