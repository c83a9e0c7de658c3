"""The decode runtime: the C decode kernel against its torch reference for every stored
format, attention over KIVI codes against dequantize-then-attend written here, paged decode
reading only its table's blocks, no host round trip inside ``attend``, and a compiled decode
step equal to eager with one graph for 64 steps, for every strategy."""

from __future__ import annotations

import contextlib
import copy
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from kvlab.cache import build_cache, registered
from kvlab.cache.codecs import Fp4Codec, Fp8Codec
from kvlab.cache.codecs.codebook import NF4, CodebookCodec
from kvlab.cache.codecs.fp8 import FORMATS as FP8_FORMATS
from kvlab.engine import Engine, GenerationConfig
from kvlab.kernels import Segment, Stored, decode_attention, kernel_available, reference_attention
from kvlab.kernels.attention.backend_c import CHUNK, chunk_tokens
from kvlab.kernels.attention.backend_c import c_kernel_applies as _kernel_applies
from kvlab.kernels.codes.int_codes import BITS, ChannelCodes, TokenCodes

needs_kernel = pytest.mark.skipif(not kernel_available(), reason="no C compiler for the kernel")
GEN = torch.Generator().manual_seed(0)
B, H, G, D = 2, 3, 3, 64


def rand(*shape, dtype=torch.float32):
    return torch.randn(*shape, generator=GEN).to(dtype)


def contiguous_segment(keys: Stored, values: Stored, lo, hi, q=None, ring=0) -> Segment:
    q = rand(B, H, G, D) if q is None else q
    table = torch.arange(B)[:, None]
    return Segment(q, keys, values, table, torch.tensor(lo), torch.tensor(hi), ring)


def stored_case(name: str, seq: int = 300):
    k, v = rand(B, H, seq, D), rand(B, H, seq, D)
    if name in ("fp32", "bf16"):
        dtype = torch.float32 if name == "fp32" else torch.bfloat16
        return Stored(k.to(dtype)), Stored(v.to(dtype))
    if name.startswith("fp8"):  # e4m3 keys, e5m2 values; bf16 scales in one case
        scale_dtype = torch.bfloat16 if name.endswith("bf16") else torch.float32
        k_codec, v_codec = Fp8Codec("e4m3", 16, D), Fp8Codec("e5m2", 32, D)
        k_parts = [p.to(scale_dtype) if p.is_floating_point() else p for p in k_codec.encode(k)]
        v_parts = [p.to(scale_dtype) if p.is_floating_point() else p for p in v_codec.encode(v)]
        return k_codec.stored(k_parts), v_codec.stored(v_parts)
    if name == "fp4":  # mxfp4 keys, nvfp4 values
        k_codec, v_codec = Fp4Codec("mxfp4", D), Fp4Codec("nvfp4", D, tensor_scale=0.5)
        return k_codec.stored(k_codec.encode(k)), v_codec.stored(v_codec.encode(v))
    if name.startswith("codebook"):  # 3-bit keys over a norm, NF4 values over absmax
        bits = int(name[-1])
        k_codec = CodebookCodec(torch.linspace(-0.3, 0.3, 1 << bits), D, D, "norm")
        v_codec = CodebookCodec(NF4, 32, D)
        return k_codec.stored(k_codec.encode(k)), v_codec.stored(v_codec.encode(v))
    bits = int(name[-1])
    k_words, k_scale, k_zero = ChannelCodes(bits, 30).encode(k)  # 30-token groups
    v_words, v_scale, v_zero = TokenCodes(bits, 32).encode(v)
    keys = Stored(k_words, "channel_codes", bits, 30, k_scale, k_zero)
    return keys, Stored(v_words, "token_codes", bits, 32, v_scale, v_zero)


CASES = ["fp32", "bf16", *(f"codes{b}" for b in BITS), "fp8", "fp8-bf16", "fp4", "codebook1",
         "codebook2", "codebook3"]  # fmt: skip


@needs_kernel
@pytest.mark.parametrize("case", CASES)
def test_kernel_equals_reference_over_a_contiguous_store(case):
    keys, values = stored_case(case)
    segment = contiguous_segment(keys, values, [0, 5], [300, 123])
    assert _kernel_applies(segment)  # the C kernel, not the fallback, computes `out`
    out = decode_attention([segment], D**-0.5, torch.float32)
    torch.testing.assert_close(out, reference_attention([segment], D**-0.5), atol=1e-5, rtol=0)


def test_long_spans_take_longer_chunks_while_every_thread_has_work():
    """chunk_tokens: 4 chunks a (row, head) and 4 work items a thread at the least."""
    assert [chunk_tokens(span, 3, threads=2) for span in (300, 2047, 2048, 4095, 4096)] == [
        CHUNK, CHUNK, 512, 512, 1024
    ]  # fmt: skip
    assert chunk_tokens(4096, 3, threads=16) == CHUNK  # 12 chunks of 1024 or 24 of 512: few
    assert chunk_tokens(4096, 8 * 3, threads=16) == 1024
    assert chunk_tokens(4096, 3, threads=4) == 512


@needs_kernel
@pytest.mark.parametrize("case", ["fp32", "codes4"])
def test_long_spans_attend_as_the_reference(case):
    """Over 2048 slots and more (chunks of 512 on up to 3 threads, :func:`chunk_tokens`):
    rows that end mid-chunk, a chunk boundary inside a key scale group of 30 tokens, and a
    row that starts past the first chunk attend as the reference does."""
    keys, values = stored_case(case, 2130)  # 71 key groups of 30
    segment = contiguous_segment(keys, values, [0, 700], [2130, 1500])
    assert _kernel_applies(segment)
    out = decode_attention([segment], D**-0.5, torch.float32)
    torch.testing.assert_close(out, reference_attention([segment], D**-0.5), atol=1e-5, rtol=0)


@needs_kernel
@pytest.mark.parametrize(("bits", "group"), [(8, 8), (4, 4), (8, 64)])
def test_token_codes_whose_groups_split_or_span_a_plane(bits, group):
    """Value codes whose group is narrower than a plane of one word's codes (per-channel
    scales) or as wide as the head: the kernel equals the reference either way."""
    keys, _ = stored_case("fp32", 100)
    words, scale, zero = TokenCodes(bits, group).encode(rand(B, H, 100, D))
    values = Stored(words, "token_codes", bits, group, scale, zero)
    segment = contiguous_segment(keys, values, [0, 3], [100, 57])
    assert _kernel_applies(segment)
    out = decode_attention([segment], D**-0.5, torch.float32)
    torch.testing.assert_close(out, reference_attention([segment], D**-0.5), atol=1e-5, rtol=0)


@needs_kernel
@pytest.mark.parametrize("variant", ["e4m3", "e5m2"])
def test_the_kernel_decodes_every_finite_fp8_code_exactly(variant):
    """Each of the 256 bytes (the NaN and infinity codes, never written, replaced by 0) as
    the one value row attended: the output is that row as torch's float8 conversion reads
    it (subnormals included), which checks the kernel's fp16-based decode."""
    codec, fp8 = Fp8Codec(variant, 32, D), FP8_FORMATS[variant]
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(1, 1, 4, D)
    codes = torch.where(codes.view(fp8).float().isfinite(), codes, 0)
    codes = codes.expand(B, H, 4, D).contiguous()
    scale = torch.full((B, H, 4, D // 32), 0.75)
    values = codec.stored([codes, scale])
    keys = Stored(rand(B, H, 4, D))
    for t in range(4):
        segment = contiguous_segment(keys, values, [t, t], [t + 1, t + 1])
        assert _kernel_applies(segment)
        out = decode_attention([segment], D**-0.5, torch.float32)  # (B, H, G, D)
        want = (codes[:, :, t].view(fp8).float() * 0.75)[:, :, None].expand_as(out)
        torch.testing.assert_close(out, want, atol=0, rtol=0)


@pytest.mark.slow
@needs_kernel
def test_the_kernels_build_without_vector_extensions(tmp_path):
    """A CPU without AVX2 gets the kernels' scalar paths (and attention_codes.c's stubs):
    every source compiles, warning-free, with AVX2, FMA and AVX-512 turned off."""
    from kvlab.kernels.build import SOURCES, _compiler, _flags

    if os.uname().machine != "x86_64":
        pytest.skip("the flags name x86 extensions")
    for source in SOURCES:
        command = [_compiler(), *_flags(source), "-mno-avx2", "-mno-fma", "-mno-avx512f"]
        command += ["-Wall", "-Werror", "-c", str(source), "-o", str(tmp_path / "out.o")]
        done = subprocess.run(command, capture_output=True, text=True)
        assert done.returncode == 0, f"{source.name}: {done.stderr[-2000:]}"


@pytest.mark.slow
@needs_kernel
def test_the_avx2_build_equals_the_reference_too(tmp_path):
    """On an AVX-512 CPU the kernel's AVX2 paths never run: build the kernels without
    AVX-512 (a compiler wrapper adding -mno-avx512f; the build is keyed by the compiler)
    and run this file's kernel tests, the linear kernels' (both one-row orders) and the fused
    layer's in a process that loads that build."""
    from kvlab.kernels.build import _compiler, cpu_identity

    if " avx512f" not in cpu_identity():
        pytest.skip("this CPU builds and tests the AVX2 paths already")
    wrapper = tmp_path / "cc"
    wrapper.write_text(f'#!/bin/sh\nexec {_compiler()} "$@" -mno-avx512f\n')
    wrapper.chmod(0o755)
    linears = [
        f"{Path(__file__).with_name('test_cpu_kernels.py')}::{test}"
        for test in (
            "test_decode_linear_equals_linear",
            "test_int8_linear_equals_the_dequantized_linear",
            "test_int4_linear_kernel_equals_the_dequantized_linear",
            "test_w8a8_kernel_gives_its_reference_bit_for_bit",
            "test_w8a8_kernel_with_a_scale_a_group_gives_the_exact_product",
        )
    ]
    linears += [
        str(Path(__file__).with_name(f"test_{name}.py")) for name in ("fused_layer", "gemv_order")
    ]
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", __file__, *linears]
    command += ["-k", "kernel and not avx2_build"]
    done = subprocess.run(
        command, env=os.environ | {"CC": str(wrapper)}, capture_output=True, text=True,
        timeout=900,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:]
    assert " passed" in done.stdout


@needs_kernel
@pytest.mark.parametrize("key_axis", ["channel", "token"])
@pytest.mark.parametrize("bits", BITS)
@pytest.mark.parametrize(
    ("group", "dim", "value_group", "scale_dtype"),
    [(1, 64, 32, torch.float32), (2, 128, 32, torch.bfloat16), (4, 64, 64, torch.bfloat16),
     (5, 64, 16, torch.float32), (9, 128, 128, torch.float32), (3, 32, 16, torch.float32)],
)  # fmt: skip
def test_kernel_reads_codes_without_dequantizing_as_the_reference(key_axis, bits, group, dim,
                                                             value_group, scale_dtype):  # fmt: skip
    """attention_codes.c folds channel-code key scales into the query, token-code key
    scales into the codes in registers and value scales into the weights. Its cases: query
    groups in one pass of registers (1-4) or several (5, 9), words repeated across a vector
    (W < lanes) or read in place, token groups a whole number of vectors or not (then rows
    are dequantized as before), bf16 scales, channel key groups of 30 tokens that split the
    runs into 30 (on AVX-512, 8- and 4-bit codes of 64 or 128 channels: a block of sixteen
    rows scored across lanes, then fourteen in blocks of four and two past them), and bounds
    3..10 and 0..299 inside groups."""

    def encoded(codec, x):
        return [p.to(scale_dtype) if p.is_floating_point() else p for p in codec.encode(x)]

    key_codec = ChannelCodes(bits, 30) if key_axis == "channel" else TokenCodes(bits, value_group)
    k_parts = encoded(key_codec, rand(B, H, 300, dim))
    v_parts = encoded(TokenCodes(bits, value_group), rand(B, H, 300, dim))
    keys = Stored(k_parts[0], f"{key_axis}_codes", bits, key_codec.group, *k_parts[1:])
    values = Stored(v_parts[0], "token_codes", bits, value_group, *v_parts[1:])
    segment = contiguous_segment(keys, values, [0, 3], [299, 10], q=rand(B, H, group, dim))
    assert _kernel_applies(segment)
    out = decode_attention([segment], dim**-0.5, torch.float32)
    want = reference_attention([segment], dim**-0.5)
    torch.testing.assert_close(out, want, atol=1e-5, rtol=0)


@needs_kernel
@pytest.mark.parametrize("group", [1, 2, 4, 5])
@pytest.mark.parametrize("dim", [64, 128, 96])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kernel_equals_reference_for_every_group_and_head_dim(group, dim, dtype):
    """The vector paths specialise on the query group (1-4 in registers) and the head dim
    (64 and 128 row by row; 96 takes the general path); 301 and 7 tokens leave a tail of
    rows past the last block of four or eight."""
    keys = Stored(rand(B, H, 301, dim, dtype=dtype))
    values = Stored(rand(B, H, 301, dim, dtype=dtype))
    segment = contiguous_segment(keys, values, [0, 3], [301, 10], q=rand(B, H, group, dim))
    out = decode_attention([segment], dim**-0.5, torch.float32)
    want = reference_attention([segment], dim**-0.5)
    torch.testing.assert_close(out, want, atol=1e-5, rtol=0)


@needs_kernel
@pytest.mark.parametrize("group", [1, 2, 3, 4, 5, 9])
@pytest.mark.parametrize("dim", [64, 128])
def test_bf16_keys_against_a_bf16_query_equal_the_reference(group, dim):
    """A bf16 model's query holds bf16 values: against bf16 keys of 64 channels the
    kernel takes their products by vdpbf16ps where the CPU has AVX512-BF16 (groups 1-4 at
    once, wider ones four query heads at a time), exact products summed in fp32 in another
    order; 301 tokens leave a tail past the last block of four rows."""
    keys = Stored(rand(B, H, 301, dim, dtype=torch.bfloat16))
    values = Stored(rand(B, H, 301, dim, dtype=torch.bfloat16))
    q = rand(B, H, group, dim, dtype=torch.bfloat16).float()
    segment = contiguous_segment(keys, values, [0, 3], [301, 10], q=q)
    out = decode_attention([segment], dim**-0.5, torch.float32)
    want = reference_attention([segment], dim**-0.5)
    torch.testing.assert_close(out, want, atol=1e-5, rtol=0)


@needs_kernel
@pytest.mark.parametrize("group", [9, 12])
def test_kernel_equals_reference_for_query_groups_wider_than_a_vector(group):
    """MQA (gqa_shared factor=3 on the default model) puts 9 query heads on one KV head."""
    keys, values = stored_case("fp32")
    segment = contiguous_segment(keys, values, [0, 7], [300, 64], q=rand(B, H, group, D))
    out = decode_attention([segment], D**-0.5, torch.float32)
    torch.testing.assert_close(out, reference_attention([segment], D**-0.5), atol=1e-5, rtol=0)


@needs_kernel
@pytest.mark.parametrize("case", ["fp32", "codes4", "fp4"])
def test_per_head_segments_attend_as_the_original(case):
    """Every (row, KV head) as a row of its own (compressed's per-head top-k tables) reads
    the same tokens: same output, whether or not the kernel runs."""
    keys, values = stored_case(case, 60)  # 60: whole groups of 30 channel-code tokens
    ring = contiguous_segment(keys, values, [100, 0], [150, 40], ring=60)
    split = ring.per_head()
    assert split.q.shape == (B * H, 1, G, D)
    expected = reference_attention([ring], D**-0.5)
    for segments in ([split], [split, split]):  # a token read twice: the same softmax
        reference = reference_attention(segments, D**-0.5).view(B, H, G, D)
        out = decode_attention(segments, D**-0.5, torch.float32).view(B, H, G, D)
        torch.testing.assert_close(reference, expected, atol=1e-5, rtol=0)
        torch.testing.assert_close(out, expected, atol=1e-5, rtol=0)


@needs_kernel
def test_kernel_equals_reference_through_rings_tables_and_segments():
    keys, values = stored_case("fp32", 64)
    ring = contiguous_segment(keys, values, [100, 0], [150, 40], ring=64)
    pool_k, pool_v = rand(41, H, 16, D), rand(41, H, 16, D)
    table = torch.randperm(40, generator=GEN)[:30].view(2, 15)
    paged = Segment(ring.q, Stored(pool_k), Stored(pool_v), table, torch.tensor([0, 3]),
                    torch.tensor([240, 17]))  # fmt: skip
    for segments in ([ring], [paged], [ring, paged]):
        out = decode_attention(segments, D**-0.5, torch.bfloat16)
        reference = reference_attention(segments, D**-0.5)
        torch.testing.assert_close(out.float(), reference, atol=1e-2, rtol=1e-2)  # bf16 out
        out = decode_attention(segments, D**-0.5, torch.float32)
        torch.testing.assert_close(out, reference, atol=1e-5, rtol=0)


# ---- KIVI: attention over codes = dequantize-then-attend -----------------------------


def kivi_dequantized(x: torch.Tensor, bits: int, group: int, residual: int, axis: str):
    """A plain KIVI reference written here: tokens [0, nq) quantized (keys per channel over
    groups of ``group`` tokens, or per token; the caller quantizes values per token), the
    rest exact; x (B, H, T, D) -> the values attention sees."""
    length = x.shape[2]
    quantized = max(0, length - residual) // group * group
    head, tail = x[:, :, :quantized].float(), x[:, :, quantized:]
    levels = 2**bits - 1
    if axis == "channel":  # groups of tokens share a scale per channel
        groups = head.unflatten(2, (-1, group))  # (B, H, n, G, D)
        low, high = groups.amin(3, keepdim=True), groups.amax(3, keepdim=True)
    else:  # each token, groups of channels
        groups = head.unflatten(3, (-1, group))  # (B, H, T, D/G, G)
        low, high = groups.amin(4, keepdim=True), groups.amax(4, keepdim=True)
    scale = (high - low) / levels
    codes = ((groups - low) / torch.where(scale > 0, scale, 1)).round().clamp(0, levels)
    dequantized = (codes * scale + low).flatten(*((2, 3) if axis == "channel" else (3, 4)))
    return torch.cat([dequantized.to(x.dtype), tail], dim=2)


@pytest.mark.parametrize("bits", BITS)
@pytest.mark.parametrize("axis", ["channel", "token"])
@pytest.mark.parametrize("residual", [6, 0])
def test_kivi_decode_equals_dequantize_then_attend(tiny_llama, bits, axis, residual,
                                                   layers_op_by_op):  # fmt: skip
    """Residual 6 with groups of 4 (residual % group != 0), and no residual (a decode token
    that completes a group is encoded in its own step): decode over codes + exact ring
    gives the attention of dequantize-then-attend, every layer, every step."""
    options = dict(bits=bits, group_size=4, residual=residual, key_axis=axis)
    cache = build_cache(f"int{bits}", tiny_llama.cache_spec(), options)
    seen: dict[int, list] = {}
    attend = cache.attend

    def checking_attend(step, layer, q, k, v, k_raw):
        out = attend(step, layer, q, k, v, k_raw)
        history = seen.setdefault(layer, [])
        history.append((k, v))
        keys = torch.cat([h[0] for h in history], dim=2)
        values = torch.cat([h[1] for h in history], dim=2)
        if q.shape[2] == 1:  # a decode step: check it against the reference
            before = keys.shape[2] - 1  # the codes cover what was stored before the step
            coded_k = kivi_dequantized(keys[:, :, :before], bits, 4, residual, axis)
            coded_v = kivi_dequantized(values[:, :, :before], bits, 4, residual, "token")
            ref_k = torch.cat([coded_k, keys[:, :, before:]], dim=2)
            ref_v = torch.cat([coded_v, values[:, :, before:]], dim=2)
            expected = torch.nn.functional.scaled_dot_product_attention(
                q, ref_k, ref_v, enable_gqa=True
            )
            torch.testing.assert_close(out, expected, atol=1e-5, rtol=0)
        return out

    cache.attend = checking_attend
    prompt = torch.randint(0, 256, (13,), generator=GEN).tolist()
    Engine(tiny_llama, cache).generate([prompt], GenerationConfig(14, stop_on_eos=False))
    assert len(seen[0]) == 14  # the prefill and 13 decode steps were checked


# ---- paged reads only its table's blocks -----------------------------------------------


def test_paged_decode_reads_only_the_blocks_in_its_tables(tiny_llama):
    cache = build_cache("paged", tiny_llama.cache_spec(), dict(block_size=4, num_blocks=40))
    engine = Engine(tiny_llama, cache)
    prompts = [list(range(3, 14)), list(range(20, 25))]
    reference = engine.generate(prompts, GenerationConfig(6, stop_on_eos=False)).tokens
    run = engine.stream(prompts, GenerationConfig(6, stop_on_eos=False))
    steps = iter(run)
    next(steps)  # prefill
    in_tables = {b for table in cache.store.tables for b in table}
    poison = torch.tensor([b not in in_tables for b in range(cache.store.pool.num_blocks + 1)])
    for layer in cache.store.keys + cache.store.values:
        for component in layer:
            component[poison] = float("nan") if component.is_floating_point() else -1
    for _ in steps:
        pass
    assert run.tokens == reference  # NaN anywhere else would have reached the logits


# ---- no host round trip inside attend --------------------------------------------------


@contextlib.contextmanager
def no_host_sync():
    """Tensor methods that bring a value to the host fail while active."""
    names = ("item", "tolist", "__bool__", "__int__", "__float__", "numpy")
    saved = {name: getattr(torch.Tensor, name) for name in names}

    def refuse(self, *args, **kwargs):
        raise AssertionError("a host round trip inside attend")

    for name in names:
        setattr(torch.Tensor, name, refuse)
    try:
        yield
    finally:
        for name, method in saved.items():
            setattr(torch.Tensor, name, method)


SETTINGS = {name: cls.tests.runtime_options for name, cls in registered().items()}


@pytest.mark.parametrize("name", sorted(SETTINGS))
def test_attend_makes_no_host_round_trip(tiny_llama, name, layers_op_by_op):
    cache = build_cache(name, tiny_llama.cache_spec(), SETTINGS[name])
    attend = cache.attend

    # multi-token steps of a store that repacks on the host (evict's ragged store: a pool
    # sized from the kept counts, a new allocation) may; its decode steps never do
    repacks = getattr(getattr(cache, "store", None), "repacks_on_host", False)

    def guarded(step, *args):
        if repacks and not step.decode:
            return attend(step, *args)
        with no_host_sync():
            return attend(step, *args)

    cache.attend = guarded
    prompts = [list(range(3, 14)), list(range(20, 25))]
    cfg = GenerationConfig(6, stop_on_eos=False, prefill_chunk=4)
    Engine(tiny_llama, cache).generate(prompts, cfg)


# ---- compiled decode ---------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(SETTINGS))
def test_compiled_decode_equals_eager_in_one_graph(tiny_llama, name):
    """Tokens and every step's logits within 1e-5 (fp32), and 64 decode steps with no
    recompilation (dynamo counts one graph)."""
    graphs = compiled_against_eager(tiny_llama, name, SETTINGS[name])
    assert graphs == (0 if name == "nocache" else 1)  # nocache recomputes: nothing compiled


@pytest.mark.slow
@pytest.mark.parametrize("kv_format", ["e4m3", "nvfp4"])
def test_compiled_decode_over_fp_codes_equals_eager(tiny_llama, kv_format):
    """Eager steps write fp codes through the C encoder, compiled ones through the torch
    ops (inductor fuses them): the same bytes, so the same tokens and logits."""
    options = dict(kv_bits=8 if kv_format == "e4m3" else 4, kv_format=kv_format)
    assert compiled_against_eager(tiny_llama, "full", options | dict(kv_group_size=16)) == 1


@pytest.mark.slow
def test_compiled_decode_with_int8_activations_equals_eager(tiny_llama):
    """W8A8 layers with a scale a row: eager decode steps multiply through gemv_w8a8.c,
    compiled ones through its torch reference (torch's int8 matmul under inductor): the same
    numbers. (With a scale a group the two agree up to fp32 summation order only, which
    moves activations across rounding boundaries over a generation: not compared here.)"""
    from kvlab.quant import quantize_

    model = copy.deepcopy(tiny_llama)
    options = {"bits": 8, "activations": "int8", "activation_group": "row"}
    quantize_(model, "rtn", options | {"compute_dtype": "input"})
    assert compiled_against_eager(model, "full", {}) == 1


def compiled_against_eager(model, name: str, options: dict) -> int:
    """Generate 65 tokens eagerly and compiled (a static cache), assert equal tokens and
    logits within 1e-5; the number of graphs dynamo compiled."""
    import torch._dynamo.utils as dynamo_utils

    prompt = list(range(3, 14))
    cfg = GenerationConfig(65, stop_on_eos=False)

    def logits_of(engine):
        seen = []
        run = engine.generate(
            [prompt], cfg, on_logits=lambda logits, _: seen.append(logits.clone())
        )
        return run.tokens[0], torch.stack(seen)

    spec = model.cache_spec()
    eager = logits_of(Engine(model, build_cache(name, spec, options)))
    torch._dynamo.reset()
    dynamo_utils.counters.clear()
    static = build_cache(name, spec, options, static=True)
    compiled = logits_of(Engine(model, static, compile=True))
    assert compiled[0] == eager[0]
    torch.testing.assert_close(compiled[1], eager[1], atol=1e-5, rtol=0)
    return dynamo_utils.counters["stats"]["unique_graphs"]


def test_loading_the_kernels_keeps_subnormals():
    """The library is compiled with fast-math but never linked with it: linking would add
    crtfastmath.o and flush subnormals to zero in the whole process."""
    from kvlab.kernels.build import library

    library()
    tiny = torch.tensor([1e-40]) * torch.tensor([1.0])
    assert tiny.item() != 0.0


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("dim", [64, 17])
def test_indexer_kernel_chooses_the_entries_torch_top_k_chooses(dtype, dim):
    """indexer.c's top-k (compressed attention's CSA indexer) keeps, for every (row, KV
    head), the set torch's masked top-k keeps over fp32 scores of the same values, in entry
    order; rows that see fewer entries than k keep all they see, a row that sees none
    keeps nothing."""
    from kvlab.kernels.attention.indexer import top_k_table

    batch, heads, group, slots, top_k = 4, 3, 3, 200, 16
    queries = rand(batch, heads, group, dim, dtype=dtype)
    keys = rand(batch, heads, slots, dim, dtype=dtype)
    seen = torch.tensor([200, 150, 9, 0])
    base = (torch.arange(batch * heads) * slots)[:, None]
    table = top_k_table(queries, keys, seen, base, top_k)
    scores = queries.float().sum(dim=2, keepdim=True) @ keys.float().transpose(-1, -2)
    hidden = torch.arange(slots)[None, None] >= seen[:, None, None]
    want = scores.squeeze(2).masked_fill(hidden, float("-inf")).topk(top_k, dim=-1).indices
    for pair in range(batch * heads):
        count = min(int(seen[pair // heads]), top_k)
        got = table[pair, :count] - base[pair]
        assert torch.equal(got, got.sort().values)  # entry order
        assert set(got.tolist()) == set(want.flatten(0, 1)[pair, :count].tolist())


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_indexer_kernel_breaks_ties_to_the_lowest_entries(dtype):
    """Scores of a few integer values (negative, zero and positive, many equal; a radix
    select over their bits finds the k-th highest): the kernel keeps every entry above the
    k-th highest score and the lowest-numbered of those equal to it, in entry order."""
    from kvlab.kernels.attention.indexer import top_k_table

    batch, heads, group, slots, dim, top_k = 2, 3, 2, 300, 16, 37
    queries = torch.zeros(batch, heads, group, dim, dtype=dtype)
    queries[:, :, 0, 0] = 1.0  # the summed query picks channel 0 of each key
    keys = torch.randint(-3, 4, (batch, heads, slots, dim), generator=GEN).to(dtype)
    seen = torch.tensor([300, 41])
    base = (torch.arange(batch * heads) * slots)[:, None]
    table = top_k_table(queries, keys, seen, base, top_k)
    scores = keys[..., 0].float().flatten(0, 1)
    for pair in range(batch * heads):
        n = int(seen[pair // heads])
        ranked = sorted(range(n), key=lambda j: (-float(scores[pair, j]), j))[:top_k]
        assert (table[pair] - base[pair]).tolist() == sorted(ranked)


def test_the_c_formats_are_the_python_ones():
    """attention_job.h's FMT_* enum and segments.FORMATS name the same numbers (fp is 0,
    or 1 for bf16 data), so a format is declared once on each side and checked here."""
    import re

    from kvlab.kernels.attention import segments
    from kvlab.kernels.attention.segments import FORMATS

    header = Path(segments.__file__).with_name("attention_job.h").read_text()
    c = {name.lower(): int(n) for name, n in re.findall(r"FMT_(\w+) = (\d+)", header)}
    assert c.pop("f32") == FORMATS["fp"] and c.pop("bf16") == FORMATS["fp"] + 1
    assert c == {name: n for name, n in FORMATS.items() if name != "fp"}
