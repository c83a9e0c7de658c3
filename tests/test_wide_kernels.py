"""Linear kernels for steps of many rows (prefill): every candidate gives ``F.linear``'s
outputs up to rounding, a named kernel is honoured where it applies, and a loaded model's
wide steps run the kernel its plan names."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from kvlab import load_model
from kvlab.cache import build_cache
from kvlab.kernels import linear as kernels_linear
from kvlab.kernels.plan import (
    KernelSettings,
    capability,
    default_plan,
    make_plan,
    onednn_bf16_reorder_works,
    onednn_linear_works,
    wide_candidates,
)


def applicable_wide_kernels(dtype: torch.dtype) -> list[str]:
    return wide_candidates(str(dtype).removeprefix("torch."), capability())


TOLERANCE = {
    torch.float32: dict(rtol=1e-5, atol=1e-5),
    torch.bfloat16: dict(rtol=1.6e-2, atol=1e-2),
}
needs_onednn_fp32 = pytest.mark.skipif(
    not onednn_linear_works(torch.float32), reason="this torch has no oneDNN matmul"
)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bias", [False, True])
def test_every_wide_kernel_gives_the_linear_outputs(dtype, bias):
    torch.manual_seed(0)
    linear = nn.Linear(96, 200, bias=bias).to(dtype)
    inputs = [torch.randn(40, 96), torch.randn(2, 33, 96), torch.randn(3, 40, 192)[..., ::2]]
    for kernel in applicable_wide_kernels(dtype):
        packed = None
        if kernel == "packed":  # the weight in oneDNN's blocked layout, as a layer holds it
            packed = torch.ops.mkldnn._reorder_linear_weight(linear.weight.detach(), 1)
        for x in (x.to(dtype) for x in inputs):
            out = kernels_linear.wide_linear(x, linear.weight, linear.bias, kernel, packed)
            expected = F.linear(x, linear.weight, linear.bias)
            torch.testing.assert_close(out, expected, **TOLERANCE[dtype])


@needs_onednn_fp32
def test_onednn_applies_to_fp32_on_every_cpu_kind():
    """oneDNN's fp32 matmul needs no AVX-512: it is a candidate on the AVX2 machines too."""
    assert applicable_wide_kernels(torch.float32) == ["plain", "onednn"]


def test_the_default_wide_kernel_is_onednn_for_fp32_packed_for_bf16_where_they_run():
    plan = default_plan()
    fp32 = "onednn" if onednn_linear_works(torch.float32) else "plain"
    bf16 = "packed" if onednn_bf16_reorder_works() else "plain"
    assert plan.weights(torch.float32).wide == fp32
    assert plan.weights(torch.bfloat16).wide == bf16
    assert plan.weights(torch.int8).wide == "plain"
    assert make_plan(KernelSettings(wide_linear="plain")).weights(torch.float32).wide == "plain"
    with pytest.raises(ValueError, match=r"engine.wide_linear='mkl'.*auto, plain, onednn"):
        KernelSettings(wide_linear="mkl")


@needs_onednn_fp32
def test_a_wide_step_runs_the_chosen_kernel_with_the_plain_logits(tiny_checkpoints, monkeypatch):
    """A forced oneDNN choice reaches every linear of a 40-token step (counted calls, each
    more rows than a decode width) and the logits stay the plain model's."""
    checkpoint = str(tiny_checkpoints["smollm"])
    onednn = make_plan(KernelSettings(wide_linear="onednn"))
    model, _ = load_model(checkpoint, torch.float32, plan=onednn)
    plain, _ = load_model(checkpoint, torch.float32, cpu_prepack=False)
    calls = []
    inner = kernels_linear.wide_linear

    def counted(x, weight, bias, kernel, packed=None):
        calls.append((x.numel() // x.shape[-1], kernel))
        return inner(x, weight, bias, kernel, packed)

    monkeypatch.setattr(kernels_linear, "wide_linear", counted)
    ids = torch.randint(0, 256, (2, 40), generator=torch.Generator().manual_seed(0))
    positions = torch.arange(40).expand_as(ids)
    with torch.inference_mode():
        outs = [m(ids, positions, build_cache("nocache", m.cache_spec())) for m in (model, plain)]
    layers = model.config.num_layers
    assert calls == [(80, "onednn")] * (4 * layers + 1)  # qkv, o, gate_up, down; the head
    torch.testing.assert_close(*outs, rtol=1e-5, atol=1e-5)


@pytest.mark.skipif(not onednn_bf16_reorder_works(), reason="oneDNN does not reorder bf16 here")
def test_a_bf16_model_multiplies_many_rows_by_its_prepacked_weights(tiny_checkpoints):
    """Where oneDNN reorders bf16, a bf16 model's layers keep a prepacked copy of each
    weight for steps of many rows (the plain weight stays for the decode kernels, ties stay
    tied), ``weight_bytes`` counts the copies (and ``prepacked_copy_bytes`` names them, as
    the decode roof leaves them out: a step reads one copy), and a 40-token step's logits
    are the plain layers' up to bf16 rounding."""
    from kvlab.engine.metrics import prepacked_copy_bytes, weight_bytes
    from kvlab.kernels.linear import DecodeLinear

    checkpoint = str(tiny_checkpoints["smollm"])
    model, _ = load_model(checkpoint, torch.bfloat16)
    plain, _ = load_model(checkpoint, torch.bfloat16, cpu_prepack=False)
    layers = [m for m in model.modules() if isinstance(m, DecodeLinear)]
    assert layers and all(m.packed_weight is not None for m in layers)
    assert model.lm_head.weight is model.embed_tokens.weight
    copies = sum(m.packed_weight.numel() * m.packed_weight.element_size() for m in layers)
    assert weight_bytes(model) == weight_bytes(plain) + copies
    assert prepacked_copy_bytes(model) == copies and prepacked_copy_bytes(plain) == 0
    ids = torch.randint(0, 256, (2, 40), generator=torch.Generator().manual_seed(0))
    positions = torch.arange(40).expand_as(ids)
    with torch.inference_mode():
        outs = [m(ids, positions, build_cache("nocache", m.cache_spec())) for m in (model, plain)]
    torch.testing.assert_close(*outs, **TOLERANCE[torch.bfloat16])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("in_features", [192, 200])
@pytest.mark.parametrize("rows", [1, 40])
def test_every_int8_wide_kernel_gives_the_dequantized_product(dtype, in_features, rows):
    """Int8 weights with a scale per output channel: each candidate against the dequantized
    weight in fp32, in the activations' dtype (bf16: its output rounding); 200 channels:
    PyTorch's kernel would crash there (K % 32), the widened product runs instead."""
    generator = torch.Generator().manual_seed(0)
    codes = torch.randint(-127, 128, (99, in_features), dtype=torch.int8, generator=generator)
    scale = (torch.rand(99, generator=generator) / 100).to(dtype)
    x = torch.randn(rows, in_features, generator=generator).to(dtype)
    want = x.float() @ (codes.float() * scale.float()[:, None]).T
    tolerance = 1e-5 if dtype == torch.float32 else 1e-2
    assert len(applicable_wide_kernels(torch.int8)) == 1 + onednn_linear_works(torch.float32)
    for kernel in applicable_wide_kernels(torch.int8):
        got = kernels_linear.int8_wide_linear(x, codes, scale, kernel)
        assert got.dtype == dtype
        torch.testing.assert_close(got.float(), want, atol=tolerance, rtol=tolerance)


def test_int8_layers_run_the_wide_kernel_chosen_for_many_rows_only(monkeypatch):
    from kvlab.quant import rtn

    layer = rtn.Int8Linear(nn.Linear(64, 48))
    assert layer.wide_kernel == default_plan().weights(torch.int8).wide
    calls = []
    inner = rtn.int8_wide_linear
    monkeypatch.setattr(rtn, "int8_wide_linear", lambda *a: calls.append(len(a[0])) or inner(*a))
    for rows in (1, 32, 33, 80):
        layer(torch.randn(rows, 64))
    kernels = {1: layer.decode_kernel, 32: layer.few_rows_kernel}  # decode widths' choice
    assert calls == [rows for rows, kernel in kernels.items() if kernel == "plain"] + [33, 80]
