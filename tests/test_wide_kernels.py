"""Linear kernels for steps of many rows (prefill): every candidate gives ``F.linear``'s
outputs up to rounding, the choice is timed once per CPU and cached, a forced name is
honoured where it applies, and a loaded model's wide steps run the kernel chosen."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from kvlab import load_model
from kvlab.cache import build_cache
from kvlab.kernels import linear as kernels_linear
from kvlab.models import wide_kernels
from kvlab.models.wide_kernels import applicable_wide_kernels, onednn_linear_works, wide_kernel

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
        for x in (x.to(dtype) for x in inputs):
            out = kernels_linear.wide_linear(x, linear.weight, linear.bias, kernel)
            expected = F.linear(x, linear.weight, linear.bias)
            torch.testing.assert_close(out, expected, **TOLERANCE[dtype])


@needs_onednn_fp32
def test_onednn_applies_to_fp32_on_every_cpu_kind():
    """oneDNN's fp32 matmul needs no AVX-512: it is a candidate on the AVX2 machines too."""
    assert applicable_wide_kernels(torch.float32) == ["plain", "onednn"]


def test_the_wide_choice_is_timed_once_cached_and_needs_its_margin(tmp_path, monkeypatch):
    timings = iter([{"plain": 10.0, "onednn": 9.7}, {"plain": 10.0, "onednn": 5.0}])
    calls = []

    def fake_timing(kernels, dtype):
        calls.append(dtype)
        return next(timings)

    monkeypatch.setenv("KVLAB_CACHE", str(tmp_path))
    monkeypatch.delenv("KVLAB_CPU_WIDE_LINEAR", raising=False)
    monkeypatch.setattr(wide_kernels, "applicable_wide_kernels", lambda d: ["plain", "onednn"])
    monkeypatch.setattr(wide_kernels, "_time_wide_kernels", fake_timing)
    wide_kernel.cache_clear()
    try:
        first = wide_kernel(torch.float32)
        assert first["kernel"] == "plain"  # 3% faster: under MARGIN
        assert first["wide_ms"] == {"plain": 10.0, "onednn": 9.7}
        wide_kernel.cache_clear()
        assert wide_kernel(torch.float32) == first and calls == [torch.float32]  # cached
        assert wide_kernel(torch.bfloat16)["kernel"] == "onednn"  # its own timing: 2x
        assert calls == [torch.float32, torch.bfloat16]
    finally:
        wide_kernel.cache_clear()


def test_a_forced_wide_kernel_falls_back_where_it_does_not_apply_and_a_bad_name_fails(
    monkeypatch,
):
    monkeypatch.setenv("KVLAB_CPU_WIDE_LINEAR", "onednn")
    monkeypatch.setattr(wide_kernels, "applicable_wide_kernels", lambda dtype: ["plain"])
    wide_kernel.cache_clear()
    try:
        choice = wide_kernel(torch.float32)
        assert choice["kernel"] == "plain" and choice["forced"]
        monkeypatch.setenv("KVLAB_CPU_WIDE_LINEAR", "mkl")
        wide_kernel.cache_clear()
        with pytest.raises(ValueError, match=r"KVLAB_CPU_WIDE_LINEAR='mkl'.*plain, onednn"):
            wide_kernel(torch.float32)
    finally:
        wide_kernel.cache_clear()


@needs_onednn_fp32
def test_a_wide_step_runs_the_chosen_kernel_with_the_plain_logits(tiny_checkpoints, monkeypatch):
    """A forced oneDNN choice reaches every linear of a 40-token step (counted calls, each
    more rows than a decode width) and the logits stay the plain model's."""
    checkpoint = str(tiny_checkpoints["smollm"])
    monkeypatch.setenv("KVLAB_CPU_WIDE_LINEAR", "onednn")
    wide_kernel.cache_clear()
    try:
        model, _ = load_model(checkpoint, torch.float32)
    finally:
        wide_kernel.cache_clear()
    plain, _ = load_model(checkpoint, torch.float32, cpu_prepack=False)
    calls = []
    inner = kernels_linear.wide_linear

    def counted(x, weight, bias, kernel):
        calls.append((x.numel() // x.shape[-1], kernel))
        return inner(x, weight, bias, kernel)

    monkeypatch.setattr(kernels_linear, "wide_linear", counted)
    ids = torch.randint(0, 256, (2, 40), generator=torch.Generator().manual_seed(0))
    positions = torch.arange(40).expand_as(ids)
    with torch.inference_mode():
        outs = [m(ids, positions, build_cache("nocache", m.cache_spec())) for m in (model, plain)]
    layers = model.config.num_layers
    assert calls == [(80, "onednn")] * (4 * layers + 1)  # qkv, o, gate_up, down; the head
    torch.testing.assert_close(*outs, rtol=1e-5, atol=1e-5)


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
    assert layer.wide_kernel == wide_kernel(torch.int8)["kernel"]
    calls = []
    inner = rtn.int8_wide_linear
    monkeypatch.setattr(rtn, "int8_wide_linear", lambda *a: calls.append(len(a[0])) or inner(*a))
    for rows in (1, 32, 33, 80):
        layer(torch.randn(rows, 64))
    kernels = {1: layer.decode_kernel, 32: layer.few_rows_kernel}  # decode widths' choice
    assert calls == [rows for rows, kernel in kernels.items() if kernel == "plain"] + [33, 80]
