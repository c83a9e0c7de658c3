"""AWQ (``quant=awq``): the AWQ GEMM reader against the format's formula, and a tiny model
quantized by GPTQModel's AWQ whose kvlab layers equal the library's own dequantized
weights, whose folded norms are the checkpoint's, and which loads the same way as
``model.source=`` (the directory the library wrote)."""

from __future__ import annotations

import pytest
import torch
from conftest import tiny_hf_model_with_vocab
from test_quant import _logits, _pack_int32

from kvlab import load_model
from kvlab.quant import quantize_
from kvlab.quant.int4_checkpoint import (
    AWQ_COLUMN_ORDER,
    awq_int4_parts,
    checkpoint_parts,
    read_int4_checkpoint,
)
from kvlab.quant.rtn import Int4Linear

GROUP = 32
OPTIONS = {"group_size": GROUP, "samples": 4, "seqlen": 64}


def _pack_awq(codes: torch.Tensor) -> torch.Tensor:
    """Reference AWQ GEMM packer: (R, N) codes → (R, N/8) int32, nibble i of each word
    holding natural column AWQ_COLUMN_ORDER[i] of its eight."""
    interleaved = codes.view(codes.shape[0], -1, 8)[..., list(AWQ_COLUMN_ORDER)]
    return _pack_int32(interleaved.flatten(1), 1)


def test_awq_reader_matches_the_awq_formula():
    """w[n, k] = scale[k // group, n] * (q[k, n] - zero[k // group, n])."""
    gen = torch.Generator().manual_seed(0)
    in_features, out_features = 64, 24
    groups = in_features // GROUP
    q = torch.randint(0, 16, (in_features, out_features), generator=gen)
    zeros = torch.randint(0, 16, (groups, out_features), generator=gen)
    scales = torch.rand(groups, out_features, generator=gen) * 0.1 + 0.01
    tensors = {"qweight": _pack_awq(q), "qzeros": _pack_awq(zeros), "scales": scales.half()}
    codes, scale, offset, perm = awq_int4_parts(tensors)
    assert perm is None and torch.equal(codes, q.T.to(torch.uint8))
    group_of = torch.arange(in_features) // GROUP
    expected = (scales.half().float()[group_of] * (q - zeros[group_of]).float()).T
    got = (codes.float() - 8) * scale.repeat_interleave(GROUP, 0).T
    got += offset.repeat_interleave(GROUP, 0).T
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-6)


@pytest.fixture(scope="module")
def awq_run(tmp_path_factory, smollm2):
    """(source dir, kvlab model quantized with quant=awq, the AWQ checkpoint it loaded)."""
    pytest.importorskip("gptqmodel")
    root = tmp_path_factory.mktemp("awq")
    source = root / "tiny"
    # every projection with a multiple of 64 outputs: GPTQModel's AWQ clip search batches
    # output channels by 64
    model = tiny_hf_model_with_vocab(smollm2[1], hidden_size=128, intermediate_size=256)
    model.save_pretrained(source)
    smollm2[1].save_pretrained(source)
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("KVLAB_CACHE", str(root / "cache"))
        model, _ = load_model(str(source), cpu_prepack=False)
        quantize_(model, "awq", OPTIONS | {"compute_dtype": "input"})
    (checkpoint,) = (root / "cache" / "awq").iterdir()
    assert (checkpoint / "kvlab_awq.json").exists()
    return source, model, checkpoint


def test_awq_layers_equal_the_librarys_dequantized_weights(awq_run):
    """Every kvlab int4 layer multiplies by GPTQModel's own dequantization of the
    checkpoint (``dequantize_gemm``), fused layers by their parts side by side."""
    from gptqmodel.quantization.awq.utils.packing_utils import dequantize_gemm

    _, model, checkpoint = awq_run
    tensors, _ = read_int4_checkpoint(checkpoint)
    layers = [(n, m) for n, m in model.named_modules() if type(m) is Int4Linear]
    assert len(layers) == 8  # qkv, o, gate_up, down in each of 2 layers
    x = torch.randn(5, 256, generator=torch.Generator().manual_seed(1))
    for name, layer in layers:
        weights = [
            dequantize_gemm(
                tensors[f"{part}.qweight"], tensors[f"{part}.qzeros"],
                tensors[f"{part}.scales"].float(), 4, GROUP,
            )  # (K, N)
            for part in checkpoint_parts(name)
        ]  # fmt: skip
        library = torch.cat(weights, dim=1)
        inputs = x[:, : layer.in_features]
        torch.testing.assert_close(layer(inputs), inputs @ library, rtol=1e-5, atol=1e-5)


def test_awq_norms_are_the_checkpoints(awq_run):
    """AWQ divided the norms before the layers it scaled; kvlab takes them from the
    checkpoint (the model's own norms would undo the scales)."""
    source, model, checkpoint = awq_run
    tensors, _ = read_int4_checkpoint(checkpoint)
    original, _ = load_model(str(source), cpu_prepack=False)
    norms = [n for n, _ in model.named_parameters() if n.endswith("layernorm.weight")]
    assert len(norms) == 4
    for name in norms:
        loaded = model.get_parameter(name)
        torch.testing.assert_close(loaded, tensors[name].float(), rtol=0, atol=0)
    kept = [n for n in norms if torch.equal(model.get_parameter(n), original.get_parameter(n))]
    assert len(kept) < len(norms), "AWQ folded no scale into any norm"


def test_the_awq_checkpoint_loads_as_the_model_source(awq_run):
    """model.source=<the directory GPTQModel wrote> gives the quant=awq model's logits."""
    _, model, checkpoint = awq_run
    direct, _ = load_model(str(checkpoint), cpu_prepack=False)
    assert sum(type(m) is Int4Linear for m in direct.modules()) == 8
    ids = torch.randint(0, 1000, (1, 16), generator=torch.Generator().manual_seed(0))
    # model.source builds the layers in bf16 compute (the default); quant=awq above in fp32
    reference = _logits(model, ids)
    error = ((_logits(direct, ids) - reference).norm() / reference.norm()).item()
    assert error < 0.02
