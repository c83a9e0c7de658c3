"""oneDNN-prepacked bf16 linears change speed only: outputs equal plain ``F.linear``. They
exist only where oneDNN can reorder bf16 (AVX-512 BW/VL/DQ or AVX-NE-CONVERT: Intel Xeons
here); on an AVX2-only CPU (AMD EPYC here) the plain layout must be kept, and bf16 must run."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

from kvlab import load_model
from kvlab.cache import build_cache
from kvlab.engine.metrics import weight_bytes
from kvlab.kernels import kernel_available
from kvlab.models.cpu_kernels import (
    PrepackedLinear,
    cpu_vendor,
    onednn_bf16_reorder_works,
    prepack_supported,
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
    plain, _ = load_model(str(tiny_checkpoints["smollm"]), torch.bfloat16, cpu_prepack=False)
    packed, _ = load_model(str(tiny_checkpoints["smollm"]), torch.bfloat16)
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


def test_fp32_gets_the_decode_kernel_off_intel_and_stays_plain_on_intel(tiny_checkpoints):
    from kvlab.kernels.linear import DecodeLinear

    model, _ = load_model(str(tiny_checkpoints["smollm"]))
    kernels = {type(m) for m in model.modules() if isinstance(m, nn.Linear | DecodeLinear)}
    if cpu_vendor() == "GenuineIntel" or not kernel_available():
        assert kernels == {nn.Linear}
    else:
        assert kernels == {DecodeLinear}
        assert model.lm_head.weight is model.embed_tokens.weight  # the tie survives


@pytest.mark.skipif(not kernel_available(), reason="no C compiler for kvlab's kernels")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 3, 5, 8, 9, 16, 21, 32, 33])
def test_decode_linear_equals_linear(dtype, rows):
    """kvlab's matrix-vector kernel (decode rows, in blocks of up to 8 of every size, with
    a channel tail: 200 = 12 x 16 + 8) and F.linear (more rows) agree."""
    from kvlab.kernels.linear import DecodeLinear

    torch.manual_seed(0)
    linear = nn.Linear(200, 96, bias=True).to(dtype)
    x = torch.randn(rows, 1, 200).to(dtype)
    tolerance = 1e-5 if dtype == torch.float32 else 3e-2  # bf16 output rounding
    torch.testing.assert_close(
        DecodeLinear(linear)(x).float(), linear(x).float(), atol=tolerance, rtol=tolerance
    )


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
    expected = 4 * 2 + 1 if prepack_supported(torch.zeros(1, dtype=torch.bfloat16)) else 0
    assert sum(isinstance(m, PrepackedLinear) for m in model.modules()) == expected  # Intel
    ids = torch.randint(0, 256, (1, 5), generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        logits = model(ids, torch.arange(5)[None], build_cache("nocache", model.cache_spec()))
    assert torch.isfinite(logits).all()
