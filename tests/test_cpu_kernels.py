"""CPU linear kernels change speed only: every candidate's outputs equal plain ``F.linear``.
oneDNN prepacking exists only where oneDNN can reorder bf16 (AVX-512 BW/VL/DQ or
AVX-NE-CONVERT); a loaded model runs exactly the kernels its kernel plan names, on every CPU
kind (the plan itself: test_kernel_plan.py)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

from kvlab import load_model
from kvlab.cache import build_cache
from kvlab.engine.metrics import weight_bytes
from kvlab.kernels import kernel_available
from kvlab.kernels.linear import PrepackedLinear
from kvlab.kernels.plan import (
    KernelSettings,
    LinearKernels,
    capability,
    decode_candidates,
    default_plan,
    make_plan,
    onednn_bf16_reorder_works,
    prepack_linears,
)

needs_onednn_bf16 = pytest.mark.skipif(
    not onednn_bf16_reorder_works(),
    reason=f"oneDNN bf16 reorder needs AVX-512 BW/VL/DQ or AVX-NE-CONVERT; this CPU: "
    f"{torch.backends.cpu.get_cpu_capability()}",
)


@needs_onednn_bf16
@pytest.mark.parametrize("bias", [False, True])
def test_prepacked_linear_equals_linear(bias):
    torch.manual_seed(0)
    linear = nn.Linear(96, 200, bias=bias).to(torch.bfloat16)
    packed = PrepackedLinear(linear)
    for shape in [(1, 96), (3, 1, 96), (2, 17, 96)]:
        x = torch.randn(shape, dtype=torch.bfloat16)
        assert torch.equal(packed(x), linear(x))


@needs_onednn_bf16
def test_prepacked_model_gives_identical_logits(tiny_checkpoints):
    onednn = make_plan(KernelSettings(linear="onednn"))
    plain, _ = load_model(str(tiny_checkpoints["smollm"]), torch.bfloat16, cpu_prepack=False)
    packed, _ = load_model(str(tiny_checkpoints["smollm"]), torch.bfloat16, plan=onednn)
    assert (
        sum(isinstance(m, PrepackedLinear) for m in packed.modules()) == 4 * 2 + 1
    )  # qkv, o, gate_up, down per layer + head
    ids = torch.randint(0, 256, (2, 9), generator=torch.Generator().manual_seed(0))
    positions = torch.arange(9).expand_as(ids)
    with torch.inference_mode():
        outs = [m(ids, positions, build_cache("nocache", m.cache_spec())) for m in (plain, packed)]
    assert torch.equal(*outs)
    # the tied head's packed copy is real memory: counted once more than the plain model
    head = packed.lm_head.packed_weight
    assert weight_bytes(packed) == weight_bytes(plain) + head.numel() * head.element_size()


@needs_onednn_bf16
@pytest.mark.slow
def test_a_compiled_step_runs_the_prepacked_layers(tiny_checkpoints):
    """inductor's own lowering of oneDNN's linear wants the packed weight as a graph
    constant and failed on a module buffer; the layer is an opaque op to it now."""
    from kvlab.engine import Engine, GenerationConfig

    onednn = make_plan(KernelSettings(linear="onednn"))
    model, _ = load_model(str(tiny_checkpoints["smollm"]), torch.bfloat16, plan=onednn)
    assert any(isinstance(m, PrepackedLinear) for m in model.modules())
    cfg = GenerationConfig(6, stop_on_eos=False)
    spec = model.cache_spec()
    eager = Engine(model, build_cache("full", spec)).generate([list(range(3, 12))], cfg)
    torch._dynamo.reset()
    compiled = Engine(model, build_cache("full", spec, static=True), compile=True)
    assert compiled.generate([list(range(3, 12))], cfg).tokens == eager.tokens


KERNEL_TYPES = {"plain": nn.Linear, "onednn": PrepackedLinear}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_loaded_model_runs_the_kernels_its_plan_names(tiny_checkpoints, dtype):
    """Whatever this CPU is, the model's linears are the kind its plan names (the defaults
    by capability: kvlab's kernel at decode widths wherever it builds), and result.json
    records the plan whole."""
    from kvlab.kernels.linear import DecodeLinear

    model, _ = load_model(str(tiny_checkpoints["smollm"]), dtype)
    assert model.kernel_plan == default_plan()
    kernels = model.kernel_plan.weights(dtype)
    assert kernels.one_row in decode_candidates(str(dtype).removeprefix("torch."), capability())
    assert kernels.one_row == ("kvlab" if kernel_available() else "plain")
    linear_types = nn.Linear | PrepackedLinear | DecodeLinear  # what each candidate installs
    found = {type(m) for m in model.modules() if isinstance(m, linear_types)}
    if kernels.one_row == "onednn" or (kernels.kvlab_rows, kernels.wide) == (None, "plain"):
        assert found == {KERNEL_TYPES[kernels.one_row]}
    else:  # kvlab's kernel for the widths it takes, the wide kernel for the others
        assert found == {DecodeLinear}
        decode_linears = [m for m in model.modules() if type(m) is DecodeLinear]
        assert {(m.kernel_rows, m.wide) for m in decode_linears} == {
            (kernels.kvlab_rows, kernels.wide)
        }
    if kernels.one_row != "onednn":
        assert model.lm_head.weight is model.embed_tokens.weight  # the tie survives


@pytest.mark.skipif(not kernel_available(), reason="no C compiler for kvlab's kernels")
@pytest.mark.parametrize("one_row, few_rows", [("plain", "kvlab"), ("kvlab", "plain")])
def test_each_width_runs_the_kernel_its_plan_names(monkeypatch, one_row, few_rows):
    """Where a plan names kvlab's kernel for one width only, it takes that width (counted
    calls) and F.linear the other, with the same outputs."""
    from kvlab.kernels import linear as kernels_linear

    plan = default_plan()
    kernels = LinearKernels(one_row, few_rows, "plain", "rows")
    plan = type(plan)({**plan.linear, "float32": kernels}, plan.capability)
    model = nn.Sequential(nn.Linear(64, 48))
    assert prepack_linears(model, plan) == 1
    calls = []
    kernel = kernels_linear._small_linear_impl
    monkeypatch.setattr(
        kernels_linear, "_small_linear_impl", lambda *a: calls.append(len(a[0])) or kernel(*a)
    )
    reference = nn.Linear(64, 48)
    reference.load_state_dict(model[0].state_dict())
    for rows in (1, 5):
        x = torch.randn(rows, 64)
        torch.testing.assert_close(model(x), reference(x), atol=1e-5, rtol=1e-5)
    assert calls == ([1] if one_row == "kvlab" else [5])


def test_a_named_kernel_that_does_not_apply_falls_back_and_a_bad_name_fails():
    plan = make_plan(KernelSettings(linear="onednn"))
    assert plan.weights(torch.float32).one_row == "plain"  # oneDNN packs bf16 only
    with pytest.raises(ValueError, match="engine.linear='mkl'.*auto, plain, onednn, kvlab"):
        KernelSettings(linear="mkl")


@pytest.mark.skipif(not kernel_available(), reason="no C compiler for kvlab's kernels")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 6, 8, 9, 16, 21, 32, 33])
@pytest.mark.parametrize("out_features", [96, 99])
@pytest.mark.parametrize("strided", [False, True])
def test_decode_linear_equals_linear(dtype, rows, out_features, strided):
    """kvlab's matrix-vector kernel and F.linear (more than 32 rows) agree: tiles of 4 (or 2)
    weight rows against chunks of every size up to 6 (AVX-512) or 5 (AVX2) rows of x, 99
    leaving weight rows alone, a channel tail (200 = 12 x 16 + 8), rows of x 300 elements
    apart; one bf16 row takes weight rows four at a time."""
    from kvlab.kernels.linear import DecodeLinear

    torch.manual_seed(0)
    linear = nn.Linear(200, out_features, bias=True).to(dtype)
    x = torch.randn(rows, 1, 300 if strided else 200).to(dtype)[..., :200]
    tolerance = 1e-5 if dtype == torch.float32 else 3e-2  # bf16 output rounding
    torch.testing.assert_close(
        DecodeLinear(linear)(x).float(), linear(x).float(), atol=tolerance, rtol=tolerance
    )


@pytest.mark.skipif(not kernel_available(), reason="no C compiler for kvlab's kernels")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 6, 9, 13])
@pytest.mark.parametrize("out_features", [96, 99])
@pytest.mark.parametrize("bias", [False, True])
def test_int8_linear_equals_the_dequantized_linear(dtype, rows, out_features, bias):
    """kvlab's int8 kernel (weight rows four at a time, 99 leaving three alone, against
    chunks of every size up to 6 rows of x (AVX-512) or 2 (AVX2); channels in 32s, 16s and a
    scalar tail: 200 = 6 x 32 + 8) against the dequantized weight in fp32, in the
    activations' dtype."""
    from kvlab.kernels.linear import int8_linear

    generator = torch.Generator().manual_seed(rows * out_features)
    codes = torch.randint(-127, 128, (out_features, 200), dtype=torch.int8, generator=generator)
    scale = (torch.rand(out_features, generator=generator) / 100).to(dtype)
    offset = torch.randn(out_features, generator=generator).to(dtype) if bias else None
    x = torch.randn(rows, 200, generator=generator).to(dtype)
    want = x.float() @ (codes.float() * scale.float()[:, None]).T
    want = want + offset.float() if bias else want
    got = int8_linear(x, codes, scale, offset)
    assert got.dtype == dtype
    tolerance = 1e-5 if dtype == torch.float32 else 1e-2  # bf16 output rounding
    torch.testing.assert_close(got.float(), want, atol=tolerance, rtol=tolerance)


@pytest.mark.skipif(not kernel_available(), reason="no C compiler for kvlab's kernels")
@pytest.mark.parametrize("in_features", [576, 200, 7])
@pytest.mark.parametrize("order", ["rows", "tiles"])
def test_int8_kernel_sums_one_bf16_row_to_fp32_accuracy(in_features, order):
    """One bf16 row through the int8 kernel, the sums kept in fp32 (y fp32, no rounding to
    bf16 to hide them): within fp32 summation error of the float64 product of the same
    codes and scales, on every walk (rows: on AVX512-BF16 CPUs each code split into two
    exact bf16 terms for vdpbf16ps; a wrong split is off by ~128x a code), codes of both
    signs and the extremes +-127 and -128, 64, 32 and scalar channel tails."""
    from kvlab.kernels.build import kernel
    from kvlab.kernels.linear import _GEMV_INT8_ARGS, in_order

    generator = torch.Generator().manual_seed(in_features)
    codes = torch.randint(-128, 128, (99, in_features), dtype=torch.int8, generator=generator)
    codes[0, :3] = torch.tensor([127, -127, -128], dtype=torch.int8)[:in_features]
    scale = (torch.rand(99, generator=generator) / 100).to(torch.bfloat16)
    x = torch.randn(1, in_features, generator=generator).to(torch.bfloat16)
    want = x.double() @ (codes.double() * scale.double()[:, None]).T
    got = torch.empty(1, 99)
    kernel("kvlab_gemv_int8", *_GEMV_INT8_ARGS)(
        x.data_ptr(), 1, in_features, codes.data_ptr(), scale.data_ptr(), 1, None, 0,
        got.data_ptr(), 0, 1, 99, in_features, in_order(order),
    )  # fmt: skip
    bound = 1e-5 * (x.double().abs() @ (codes.double().abs() * scale.double()[:, None]).T)
    assert ((got.double() - want).abs() <= bound + 1e-7).all()


@pytest.mark.skipif(not kernel_available(), reason="no C compiler for kvlab's kernels")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 2, 5, 32])
@pytest.mark.parametrize("out_features", [96, 99])
@pytest.mark.parametrize("in_features", [200, 576, 7])
@pytest.mark.parametrize("order", ["rows", "tiles"])
def test_w8a8_kernel_gives_its_reference_bit_for_bit(dtype, rows, out_features, in_features, order):
    """gemv_w8a8.c (int8 activations: vpdpbusd over 64 channels with a masked tail on
    AVX512-VNNI, vpmaddubsw over 32 and a scalar tail on AVX2; weight rows four at a time, 99
    leaving three alone, or, for one row in the int8 weights' ``rows`` order, one after
    another in blocks of 16, 99 leaving three; a row of zeros) equals its torch reference
    exactly, and the reference is the float product up to the activations' rounding (half a
    step of each row's scale per channel)."""
    _check_w8a8_kernel(dtype, rows, out_features, in_features, order)


def _check_w8a8_kernel(dtype, rows, out_features, in_features, order="rows"):
    from kvlab.kernels.linear.w8a8 import quantize_rows, w8a8_linear, w8a8_reference

    generator = torch.Generator().manual_seed(rows * out_features + in_features)
    codes = torch.randint(-127, 128, (out_features, in_features), dtype=torch.int8,
                          generator=generator)  # fmt: skip
    scale = (torch.rand(out_features, generator=generator) / 100).to(dtype)
    x = (3 * torch.randn(rows, in_features, generator=generator)).to(dtype)
    x[-1] = 0 if rows > 1 else x[-1]
    got = w8a8_linear(x, codes, scale, order=order)
    assert got.dtype == dtype and torch.equal(got, w8a8_reference(x, codes, scale))
    weight = codes.float() * scale.float()[:, None]
    _, steps = quantize_rows(x)
    bound = (steps[:, None] / 2) @ weight.abs().sum(dim=1, keepdim=True).T  # (M, N)
    error = (got.float() - x.float() @ weight.T).abs()
    assert (error <= bound * 1.01 + 1e-2 * got.float().abs() + 1e-6).all()
    if rows > 1:
        assert torch.equal(got[-1], torch.zeros_like(got[-1]))


@pytest.mark.skipif(not kernel_available(), reason="no C compiler for kvlab's kernels")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 2, 5, 32])
@pytest.mark.parametrize(
    ("out_features", "in_features", "group"),
    [(96, 576, 32), (99, 1536, 32), (32, 200, 8), (33, 100, 4), (48, 256, 64), (16, 640, 128)],
)
@pytest.mark.parametrize("order", ["rows", "tiles"])
def test_w8a8_kernel_with_a_scale_a_group_gives_the_exact_product(
    dtype, rows, out_features, in_features, group, order
):
    """gemv_w8a8.c with an activation scale every ``group`` channels (a 64-channel load
    spanning two groups of 32, a masked tail of 8 or 36 channels, the AVX2 and scalar
    paths' lanes of four channels) gives the float64 product of the reference's quantized
    activations up to fp32 rounding (and bf16's output rounding), in both walks over the
    weight rows; so does the reference; a row of zeros gives zeros. The prefill product over
    the dequantized weight (bf16 codes times bf16 activations where the layer computes in
    bf16) stays within the activations' own rounding of it."""
    from kvlab.kernels.linear.w8a8 import (
        quantize_groups,
        w8a8_dequantized,
        w8a8_linear,
        w8a8_reference,
    )

    generator = torch.Generator().manual_seed(rows * out_features + in_features + group)
    codes = torch.randint(-127, 128, (out_features, in_features), dtype=torch.int8,
                          generator=generator)  # fmt: skip
    scale = (torch.rand(out_features, generator=generator) / 100).to(dtype)
    spread = 1 + 8 * torch.rand(in_features, generator=generator)  # groups of other ranges
    x = (torch.randn(rows, in_features, generator=generator) * spread).to(dtype)
    x[-1] = 0 if rows > 1 else x[-1]
    got = w8a8_linear(x, codes, scale, group, order)
    xq, steps = quantize_groups(x, group)
    terms = _stepped_group_dots(xq, steps, codes, group)
    exact = terms.sum(-1) * scale.double()
    magnitude = terms.abs().sum(-1) * scale.double().abs()
    rounding = 0.0 if dtype == torch.float32 else 2.0**-8 * exact.abs()  # bf16's half ulp
    assert got.dtype == dtype
    assert ((got.double() - exact).abs() <= 1e-6 * magnitude + rounding + 1e-9).all()
    want = w8a8_reference(x, codes, scale, group)
    assert ((want.double() - exact).abs() <= 2.0**-24 * exact.abs() + rounding + 1e-12).all()
    if rows > 1:
        assert torch.equal(got[-1], torch.zeros_like(got[-1]))
    prefill = w8a8_dequantized(x, codes, scale, group).double()
    values = (xq.double().abs() * steps.double().repeat_interleave(group, dim=1)) @ (
        codes.double().abs() * scale.double().abs()[:, None]
    ).T  # the sum of the products' magnitudes
    bf16_values = 0.0 if dtype == torch.float32 else 2.0**-8 * values  # x's values in bf16
    assert ((prefill - exact).abs() <= 1e-6 * magnitude + 2 * rounding + bf16_values).all()


def _stepped_group_dots(xq, steps, codes, group):
    """(M, N, K / group) float64: each group's exact integer dot of the activations' codes
    xq (M, K) and the weight codes (N, K), times the group's step (M, K / group)."""
    rows, groups = steps.shape
    xq, codes = xq.double().view(rows, groups, group), codes.double().view(-1, groups, group)
    return torch.einsum("mgk,ngk->mng", xq, codes) * steps.double()[:, None, :]


def _w4a8_exact(x, codes, scale, offset, group_size):
    """W4A8's product in float64 from the same quantized activations as the reference, and
    the sum of its terms' magnitudes (what fp32 rounding errors scale with)."""
    from kvlab.kernels.linear.w8a8 import quantize_groups

    xq, steps = quantize_groups(x, group_size)
    rows, groups = steps.shape
    sums = x.double().view(rows, groups, group_size).sum(-1)
    codes_term = _stepped_group_dots(xq, steps, codes, group_size) * scale.double().T[None]
    shift_term = sums[:, None, :] * (offset.double() - 8 * scale.double()).T[None]
    terms = codes_term + shift_term
    return terms.sum(-1), (codes_term.abs() + shift_term.abs()).sum(-1)


@pytest.mark.skipif(not kernel_available(), reason="no C compiler for kvlab's kernels")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 2, 5, 32])
@pytest.mark.parametrize(
    ("out_features", "in_features", "group_size"),
    [(96, 576, 32), (32, 64, 32), (48, 256, 64), (16, 512, 128), (64, 1536, 256)],
)
def test_w4a8_kernel_gives_its_reference(dtype, rows, out_features, in_features, group_size):
    """gemv_w4a8.c (int4 codes times int8 activations quantized per weight group: vpdpbusd
    on AVX512-VNNI, vpmaddubsw on AVX2) gives the exact product of the reference's
    quantized activations up to fp32 rounding (and bf16's output rounding), so it quantizes
    them to the reference's codes; a row of zeros gives the offsets' term alone, zero. And
    the reference is the float product up to the activations' rounding: half a step of each
    group's scale per channel, on the codes' term only."""
    from kvlab.kernels.linear.w4a8 import w4a8_linear, w4a8_reference
    from kvlab.kernels.linear.w8a8 import quantize_groups
    from kvlab.quant.packing import block_int4
    from kvlab.quant.rtn import dequantize_int4, quantize_int4

    generator = torch.Generator().manual_seed(rows * out_features + in_features)
    weight = torch.randn(out_features, in_features, generator=generator)
    codes, scale, offset = quantize_int4(weight, group_size, symmetric=False)
    scale, offset = scale.to(dtype), offset.to(dtype)
    x = (3 * torch.randn(rows, in_features, generator=generator)).to(dtype)
    x[-1] = 0 if rows > 1 else x[-1]
    got = w4a8_linear(x, *block_int4(codes, scale, offset), group_size)
    assert got.dtype == dtype
    exact, magnitude = _w4a8_exact(x, codes, scale, offset, group_size)
    rounding = 0.0 if dtype == torch.float32 else 2.0**-8 * exact.abs()  # bf16's half ulp
    assert ((got.double() - exact).abs() <= 1e-6 * magnitude + rounding + 1e-9).all()
    want = w4a8_reference(x, codes, scale, offset, group_size)
    assert ((want.double() - exact).abs() <= 1e-6 * magnitude + rounding + 1e-9).all()
    if rows > 1:
        assert torch.equal(got[-1], torch.zeros_like(got[-1]))
    _, steps = quantize_groups(x, group_size)
    codes_part = (codes.float() * scale.float().repeat_interleave(group_size, 0).T).abs()
    per_group = codes_part.view(out_features, -1, group_size).sum(-1)  # (N, K/G)
    bound = (steps.double() / 2) @ per_group.double().T
    weights = dequantize_int4(codes, scale.float(), offset.float(), group_size).double()
    error = (want.double() - x.double() @ weights.T).abs()
    assert (error <= bound * 1.01 + 1e-6 * magnitude + rounding + 1e-6).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_w4a8_prefill_product_over_the_dequantized_weight_is_the_references(dtype):
    """Prefill rows (more than the kernel takes) multiply the quantized activations by the
    dequantized weight in one product in the layer's dtype, the offsets' term moved onto x's
    own group sums: the reference's exact product up to fp32 rounding, or in bf16 up to the
    rounding of the weight and the quantized activations to bf16; the layer runs it."""
    from kvlab.kernels.linear.w4a8 import w4a8_dequantized
    from kvlab.quant.rtn import Int4Linear, dequantize_int4, quantize_int4

    generator = torch.Generator().manual_seed(3)
    weight = torch.randn(48, 256, generator=generator)
    codes, scale, offset = quantize_int4(weight, 64, symmetric=False)
    x = (3 * torch.randn(40, 256, generator=generator)).to(dtype)
    scale, offset = scale.to(dtype), offset.to(dtype)
    dequantized = dequantize_int4(codes, scale, offset, 64)
    got = w4a8_dequantized(x, dequantized, scale, offset, 64)
    exact, magnitude = _w4a8_exact(x, codes, scale, offset, 64)
    tolerance = 1e-6 if dtype == torch.float32 else 2.0**-7
    assert got.dtype == dtype
    assert ((got.double() - exact).abs() <= tolerance * magnitude + 1e-9).all()
    layer = Int4Linear(codes, scale, offset, None, dtype, int8_activations=True)
    assert torch.equal(layer(x), got)


@pytest.mark.skipif(not kernel_available(), reason="no C compiler for kvlab's kernels")
@pytest.mark.parametrize("x_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_prefill_activation_quantization_in_c_is_torchs(x_dtype, dtype, monkeypatch):
    """``kvlab_fake_quantize_groups`` (one pass over x, rows across threads) gives torch's
    quantized activations bit for bit, in fp32 or rounded to bf16, and each group's sum of
    x less theirs up to fp32 summation order; a row of zeros stays zeros."""
    from kvlab.kernels.linear import w8a8

    generator = torch.Generator().manual_seed(5)
    x = (3 * torch.randn(37, 384, generator=generator)).to(x_dtype)
    x[7] = 0
    got, correction = w8a8.fake_quantized(x, 64, dtype)
    monkeypatch.setattr(w8a8, "_fake_quantize_serves", lambda x, dtype: False)
    want, want_correction = w8a8.fake_quantized(x, 64, dtype)
    assert got.dtype == dtype and torch.equal(got, want) and not got[7].any()
    torch.testing.assert_close(correction, want_correction, rtol=0, atol=1e-4)


def test_int8_products_are_exact_on_every_cpu():
    """W8A8's integer products (its per-token reference and prefill) are exact whatever the
    CPU: codes of +-127 in every pair, which saturate oneDNN's int8 matmul without VNNI
    (there it is probed inexact and not taken), and a product over more channels than one
    exact float span."""
    from kvlab.kernels.linear import w8a8

    generator = torch.Generator().manual_seed(3)
    xq = torch.randint(-127, 128, (40, 2500), dtype=torch.int8, generator=generator)
    codes = torch.randint(-127, 128, (24, 2500), dtype=torch.int8, generator=generator)
    xq[:4], codes[:2], codes[2:4] = 127, 127, -127
    want = (xq.double() @ codes.double().T).to(torch.int32)
    assert torch.equal(w8a8._int_products(xq, codes), want)
    assert torch.equal(w8a8._float_products(xq, codes), want)


def test_w8a8_reference_without_an_int8_matmul_gives_the_same_products(monkeypatch):
    """Where torch's int8 matmul refuses the shapes (CUDA's, under 17 rows), the reference
    multiplies in fp32 spans, exactly: the same outputs."""
    from kvlab.kernels.linear import w8a8

    generator = torch.Generator().manual_seed(0)
    codes = torch.randint(-127, 128, (64, 1536), dtype=torch.int8, generator=generator)
    scale = torch.rand(64, generator=generator) / 100
    x = 3 * torch.randn(3, 1536, generator=generator)
    want = w8a8.w8a8_reference(x, codes, scale)

    def refuse(*args):
        raise RuntimeError("_int_mm: shapes not supported")

    monkeypatch.setattr(torch, "_int_mm", refuse)
    assert torch.equal(w8a8.w8a8_reference(x, codes, scale), want)


@pytest.mark.skipif(not kernel_available(), reason="no C compiler for kvlab's kernels")
@pytest.mark.parametrize(("x_dtype", "scale_dtype"), [(torch.float32, torch.float32),
                                                      (torch.bfloat16, torch.bfloat16),
                                                      (torch.float32, torch.bfloat16)])  # fmt: skip
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 9])
@pytest.mark.parametrize(
    ("out_features", "in_features", "group"),
    [(96, 256, 32), (48, 192, 64), (32, 128, 128), (16, 16, 8)],
)
@pytest.mark.parametrize("symmetric", [True, False])
def test_int4_linear_kernel_equals_the_dequantized_linear(
    x_dtype, scale_dtype, rows, out_features, in_features, group, symmetric
):
    """kvlab's int4 kernel (blocks of 16 outputs; chunks of every size up to 4 rows of x on
    AVX-512, 2 on AVX2; vdpbf16ps for bf16 rows where the CPU has AVX512-BF16) against the
    dequantized weight in fp32, in the rows' dtype; the blocks unpack to the codes."""
    from kvlab.kernels.linear import int4_linear
    from kvlab.quant.packing import block_int4, unblock_int4
    from kvlab.quant.rtn import dequantize_int4, quantize_int4

    generator = torch.Generator().manual_seed(rows * out_features + group)
    weight = torch.randn(out_features, in_features, generator=generator)
    codes, scale, offset = quantize_int4(weight, group, symmetric)
    scale, offset = scale.to(scale_dtype), offset.to(scale_dtype)
    blocks, scale_offset = block_int4(codes, scale, offset)
    unblocked = unblock_int4(blocks, scale_offset)
    assert all(torch.equal(a, b) for a, b in zip(unblocked, (codes, scale, offset), strict=True))
    x = torch.randn(rows, in_features, generator=generator).to(x_dtype)
    want = x.float() @ dequantize_int4(codes, scale.float(), offset.float(), group).T
    got = int4_linear(x, blocks, scale_offset, group)
    assert got.dtype == x_dtype
    # fp32: the offset term (offset - 8 scale) * sum x cancels part of scale * sum code x
    tolerance = 1e-4 if x_dtype == torch.float32 else 1e-2  # bf16: output rounding
    torch.testing.assert_close(got.float(), want, atol=tolerance, rtol=tolerance)


def test_int4_layers_take_the_layout_their_plan_names():
    """kvlab's blocks where the plan names its kernel (the default wherever it builds), else
    PyTorch's layout; both compute the same decode rows and prefill rows."""
    from kvlab.quant import rtn

    kernels = default_plan().weights("int4")
    codes, scale, offset = rtn.quantize_int4(torch.randn(64, 128), 32, False)
    want = {"kvlab": "kvlab", "plain": "aten"}[kernels.one_row]
    assert rtn.Int4Linear(codes, scale, offset, None).layout == want
    layers = {
        kernel: rtn.Int4Linear(codes, scale, offset, None, kernels=LinearKernels(kernel, kernel))
        for kernel in ("kvlab", "plain")
    }
    if not kernel_available():
        return
    assert (layers["kvlab"].layout, layers["plain"].layout) == ("kvlab", "aten")
    dense = rtn.dequantize_int4(codes, scale, offset, 32)
    for rows in (1, 3, 40):  # decode rows through the kernels, prefill rows dequantized
        x = torch.randn(rows, 1, 128)
        want = x @ dense.T
        for layer in layers.values():  # bf16 compute: within 2% of the output's scale
            assert (layer(x) - want).abs().max() <= 2e-2 * want.abs().max()


def test_int8_layers_run_the_kernel_their_plan_names():
    from kvlab.quant.rtn import Int8Linear

    kernels = default_plan().weights(torch.int8)
    assert kernels.one_row == ("kvlab" if kernel_available() else "plain")
    layer = Int8Linear(nn.Linear(64, 32))
    assert (layer.decode_kernel, layer.order) == (kernels.one_row, kernels.order)
    x = torch.randn(2, 1, 64)
    plain = Int8Linear(nn.Linear(64, 32), kernels=LinearKernels())
    plain.load_state_dict(layer.state_dict())
    assert plain.decode_kernel == "plain"
    torch.testing.assert_close(layer(x), plain(x), atol=2e-2, rtol=2e-2)  # bf16 compute


def test_the_probe_agrees_with_the_cpu_flags():
    """AVX-512 BW/VL/DQ is what oneDNN's bf16 reorder needs (or AVX-NE-CONVERT, which the
    flags below may not show): a CPU without AVX-512 and without avx_ne_convert gets no
    prepacking, and a bf16 model still loads and runs there."""
    cpuinfo = Path("/proc/cpuinfo")
    if not cpuinfo.exists():
        pytest.skip("no /proc/cpuinfo to read the CPU flags from")
    flags = set(cpuinfo.read_text().split())
    avx512 = {"avx512bw", "avx512vl", "avx512dq"} <= flags
    if not avx512 and "avx_ne_convert" not in flags:
        assert not onednn_bf16_reorder_works()
    if avx512:
        assert onednn_bf16_reorder_works()


def test_bf16_model_runs_on_any_cpu(tiny_checkpoints):
    model, _ = load_model(str(tiny_checkpoints["smollm"]), torch.bfloat16)
    expected = 4 * 2 + 1 if default_plan().weights(torch.bfloat16).one_row == "onednn" else 0
    assert sum(isinstance(m, PrepackedLinear) for m in model.modules()) == expected
    ids = torch.randint(0, 256, (1, 5), generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        logits = model(ids, torch.arange(5)[None], build_cache("nocache", model.cache_spec()))
    assert torch.isfinite(logits).all()


@pytest.mark.skipif(not kernel_available(), reason="no C compiler for kvlab's kernels")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_rms_norm_equals_the_torch_ops(dtype):
    """One C call for the model's RMSNorm: bit-identical to the op-by-op version (the
    rounding after the norm and after the weight kept) where the sum of squares is exact
    in any order (multiples of 1/8 up to 4: torch sums in an order that depends on the
    CPU's vector width); otherwise equal up to that order: fp32 within 2e-6, bf16 within
    one bf16 step. Rows may be strided (a view of a wider tensor)."""
    import torch.nn.functional as F

    from kvlab.kernels.layer.norm import fused_rms_norm

    generator = torch.Generator().manual_seed(0)
    weight = torch.randn(576, generator=generator).to(dtype)
    exact = torch.randint(-32, 33, (2, 5, 700), generator=generator) / 8
    noisy = torch.randn(2, 5, 700, generator=generator) * 3
    for wide, tolerance in ((exact, 0.0), (noisy, 2e-6 if dtype == torch.float32 else 2**-8)):
        x = wide.to(dtype)[..., :576]  # rows 700 elements apart
        want = weight * F.rms_norm(x.float(), (576,), eps=1e-5).to(dtype)
        got = fused_rms_norm(x, weight, 1e-5)
        assert got is not None and got.shape == x.shape and got.dtype == dtype
        torch.testing.assert_close(got, want, atol=0, rtol=tolerance)
    assert (
        fused_rms_norm(x, weight.float() if dtype == torch.bfloat16 else weight.double(), 1e-5)
        is None
    )
