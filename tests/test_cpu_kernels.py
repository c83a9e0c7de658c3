"""oneDNN-prepacked bf16 linears change speed only: outputs equal plain ``F.linear``."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from kvlab import load_model
from kvlab.cache import build_cache
from kvlab.engine.metrics import weight_bytes
from kvlab.models.cpu_kernels import PrepackedLinear, prepack_linears, prepack_supported

needs_onednn_bf16 = pytest.mark.skipif(
    not prepack_supported(torch.zeros(1, dtype=torch.bfloat16)), reason="no oneDNN bf16 here"
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


def test_fp32_is_left_alone(tiny_llama):
    assert prepack_linears(tiny_llama) == 0
