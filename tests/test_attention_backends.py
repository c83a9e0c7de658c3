"""The CUDA decode backends run on CPU tensors against the reference: FlexAttention (eager)
for segments in the model dtype, the Triton kernel (Triton's interpreter, which conftest
selects where there is no GPU) for every format, and both together as ``gpu`` picks them
— over single segments, rings, paged tables, several segments and per-head rows, and
through the engine for every strategy and every composed store × codec."""

from __future__ import annotations

import pytest
import torch
from test_cache_contract import COMPOSED, LOSSY, prompts, recorded
from test_decode_runtime import CASES, GEN, SETTINGS, D, G, H, contiguous_segment, rand, stored_case
from torch.utils._python_dispatch import TorchDispatchMode

from kvlab.cache import build_cache
from kvlab.engine import Engine, GenerationConfig
from kvlab.kernels import Segment, Stored, attention, decode_attention, reference_attention
from kvlab.kernels.attention import segment_backends, use_backend
from kvlab.kernels.attention.backend_flex import block_mask
from kvlab.kernels.attention.backend_triton import triton_interpreted

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


class BytesWritten(TorchDispatchMode):
    """Bytes every torch op writes: new tensors (not views of their inputs) and, for
    in-place ops, the largest tensor they take as input (what ``index_copy_`` or
    ``copy_`` writes into the destination). The C kernel writes only tensors allocated by
    torch ops, so its buffers count too."""

    def __init__(self):
        super().__init__()
        self.total = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        tensors = [a for a in (*args, *(kwargs or {}).values()) if isinstance(a, torch.Tensor)]
        if func._schema.is_mutable:
            self.total += max((t.nbytes for t in tensors[1:]), default=0)
            return out
        inputs = {t.untyped_storage().data_ptr() for t in tensors}
        for t in out if isinstance(out, (tuple, list)) else [out]:
            if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in inputs:
                self.total += t.nbytes
        return out


def decode_step_bytes(model, name: str, length: int, backend: str) -> int:
    """Bytes the cache's attend writes, all layers, on the third decode step after a
    ``length``-token prompt."""
    cache = build_cache(name, model.cache_spec(), SETTINGS[name])
    attend, written = cache.attend, []

    def counted(step, *args):
        if not step.decode:
            return attend(step, *args)
        with BytesWritten() as mode:
            out = attend(step, *args)
        written.append(mode.total)
        return out

    cache.attend = counted
    prompt = [3 + i % 200 for i in range(length)]
    with use_backend(backend):
        Engine(model, cache).generate([prompt], GenerationConfig(3, stop_on_eos=False))
    return sum(written[-model.cache_spec().num_layers :])


def fp32_history_bytes(model, tokens: int) -> int:
    spec = model.cache_spec()
    return 2 * tokens * spec.num_layers * spec.num_kv_heads * spec.head_dim * 4


@pytest.mark.parametrize("name", sorted(set(SETTINGS) - {"nocache"}))
def test_a_decode_step_writes_no_copy_of_the_history(tiny_llama, name, layers_op_by_op):
    """400 more tokens of history add almost nothing to what a decode step writes on the
    CPU path: no dequantized copy, no re-copy of the cache (the C kernel's partials grow by
    one chunk per 256 tokens). Quest gathers and scores its page summaries each step (min
    and max: 2 / block_size of the keys, and a score per page and query head): at most
    1.5x their bytes. (Triton's interpreter copies its arguments, so it is not measured
    here.)"""
    growth = decode_step_bytes(tiny_llama, name, 440, "c")
    growth -= decode_step_bytes(tiny_llama, name, 40, "c")
    history = fp32_history_bytes(tiny_llama, 400)
    summaries = history / SETTINGS[name]["block_size"] if name == "quest" else 0
    assert growth <= history / 100 + 1.5 * summaries


@pytest.mark.parametrize("name", ["full", "int4"])
def test_the_byte_count_sees_a_dequantized_history(tiny_llama, name, layers_op_by_op):
    """The reference path copies every slot to fp32: the bound above fails it."""
    growth = decode_step_bytes(tiny_llama, name, 440, "reference")
    growth -= decode_step_bytes(tiny_llama, name, 40, "reference")
    assert growth >= fp32_history_bytes(tiny_llama, 400) / 2


@needs_triton
@pytest.mark.slow
def test_a_compiled_step_on_the_gpu_backends_equals_eager(tiny_llama):
    """On CPU tensors the flex and Triton calls stay outside the graph (a graph break):
    a compiled step still gives the eager tokens and logits."""
    options = SETTINGS["int4"]  # a KIVI history (Triton) beside its exact ring (flex)
    prompt, cfg = list(range(3, 14)), GenerationConfig(8, stop_on_eos=False)

    def run(static: bool):
        seen = []
        engine = Engine(tiny_llama, build_cache("int4", tiny_llama.cache_spec(), options,
                                                static=static), compile=static)  # fmt: skip
        with use_backend("gpu"):
            tokens = engine.generate([prompt], cfg, on_logits=lambda x, _: seen.append(x.clone()))
        return tokens.tokens[0], torch.stack(seen)

    eager, compiled = run(False), run(True)
    assert compiled[0] == eager[0]
    torch.testing.assert_close(compiled[1], eager[1], atol=1e-5, rtol=0)


@pytest.mark.parametrize("backend", ["c", "gpu"])
@pytest.mark.parametrize("case", ["fp32", "codes4"])
def test_a_query_row_per_token_sees_its_row_up_to_itself(backend, case):
    """``Segment.per_token`` (a short step read in place): three query tokens a row,
    token t of row b bounded by start[b] + t + 1, clamped into the segment's own range
    (row 1's segment ends before its step: every token sees all of it); each backend
    equals the reference over the bounds written out by hand."""
    if backend == "gpu" and case != "fp32" and not triton_interpreted():
        pytest.skip("triton is not installed, or TRITON_INTERPRET=1 was not set")
    keys, values = stored_case(case, 60 if case == "codes4" else 300)
    lo, hi, start, steps = [0, 5], [50, 30], torch.tensor([47, 40]), 3
    q = rand(len(lo) * steps, H, G, D)
    segment = contiguous_segment(keys, values, lo, hi, q=q).per_token(start, steps)
    by_hand = [(lo[b], min(hi[b], int(start[b]) + t + 1)) for b in range(2) for t in range(3)]
    assert segment.lo.tolist() == [min(a, z) for a, z in by_hand]
    assert segment.hi.tolist() == [z for _, z in by_hand]
    assert segment.table.tolist() == [[0]] * 3 + [[1]] * 3
    out = attend(backend, [segment])
    torch.testing.assert_close(out, reference_attention([segment], D**-0.5), atol=1e-5, rtol=0)
