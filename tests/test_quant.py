"""Contract of every registered weight quantizer on a tiny random model: layers swapped,
logits close to full precision within a per-method bound, linear-layer bytes smaller by
the expected factor; exact packing round-trips; the GPTQ reader against hand-made GPTQ
tensors (act-order included); option errors."""

from __future__ import annotations

import sys

import pytest
import torch
import torch.nn.functional as F

from kvlab import load_model
from kvlab.cache import build_cache
from kvlab.quant import held_tensors, quant_options, quantize_, registered_quantizers
from kvlab.quant.int4_checkpoint import gptq_int4_parts, unpack_int32
from kvlab.quant.packing import pack, unpack
from kvlab.quant.rtn import Int4Linear, dequantize_int4, quantize_int4

# name -> (options, bound on the logits' relative error, least shrink of the linear bytes)
CASES = {  # bounds about 1.5x what each measures here (shrinks: just below)
    "none": ({}, 0.0, 1.0),
    "rtn-int8": ({"bits": 8}, 0.01, 3.8),
    "rtn-int8-w8a8": ({"bits": 8, "activations": "int8"}, 0.012, 3.8),
    "rtn-int8-w8a8-row": (
        {"bits": 8, "activations": "int8", "activation_group": "row"},
        0.012,
        3.8,
    ),
    "rtn-int4-g32-asym": ({"bits": 4, "group_size": 32, "symmetric": False}, 0.13, 6.2),
    "rtn-int4-g32-asym-w4a8": (
        {"bits": 4, "group_size": 32, "symmetric": False, "activations": "int8"},
        0.13,
        6.2,
    ),
    "rtn-int4-g64-sym": ({"bits": 4, "group_size": 64}, 0.16, 7.0),
    "bnb-int8": ({"mode": "int8"}, 0.01, 3.9),
    "bnb-nf4": ({"mode": "nf4"}, 0.16, 6.9),
    "bnb-fp4-double": ({"mode": "fp4", "double_quant": True}, 0.2, 6.2),
}
QUANTIZER_OF_CASE = {case: case.split("-")[0] for case in CASES}
LINEARS_OF_TINY_LLAMA = 2 * 4  # qkv, o, gate_up, down per layer; lm_head skipped


def test_every_quantizer_is_covered():
    covered = set(QUANTIZER_OF_CASE.values()) | {"gptq", "awq"}  # own tests (and test_awq)
    assert covered == set(registered_quantizers())


def _logits(model, ids):
    positions = torch.arange(ids.shape[1]).expand_as(ids)
    with torch.inference_mode():
        return model(ids, positions, build_cache("nocache", model.cache_spec()))


def _linear_bytes(model, names):
    seen, total = set(), 0
    for name in names:
        for tensor in held_tensors(model.get_submodule(name)):
            if tensor.data_ptr() not in seen:
                seen.add(tensor.data_ptr())
                total += tensor.numel() * tensor.element_size()
    return total


@pytest.mark.parametrize("case", sorted(CASES))
def test_quantizer_contract(case, tiny_checkpoints):
    options, bound, shrink = CASES[case]
    if QUANTIZER_OF_CASE[case] == "bnb":
        pytest.importorskip("bitsandbytes")
    model, _ = load_model(str(tiny_checkpoints["llama"]), cpu_prepack=False)
    names = [n for n, m in model.named_modules() if type(m) is torch.nn.Linear and n != "lm_head"]
    ids = torch.randint(0, 256, (2, 24), generator=torch.Generator().manual_seed(0))
    reference, bytes_before = _logits(model, ids), _linear_bytes(model, names)
    swapped = quantize_(model, QUANTIZER_OF_CASE[case], options)
    logits = _logits(model, ids)
    error = ((logits - reference).norm() / reference.norm()).item()
    assert swapped == (0 if case == "none" else LINEARS_OF_TINY_LLAMA)
    assert error <= bound, f"{case}: relative logit error {error:.4f} > {bound}"
    assert bytes_before / _linear_bytes(model, names) >= shrink
    assert type(model.lm_head) is torch.nn.Linear  # skipped by default


def test_int4_packing_round_trips_and_both_layouts_compute_the_same():
    torch.manual_seed(0)
    weight, x = torch.randn(96, 128), torch.randn(5, 128)
    for symmetric in (True, False):
        codes, scale, offset = quantize_int4(weight, 32, symmetric)
        assert torch.equal(unpack(pack(codes, 4), 4), codes)
        dense = dequantize_int4(codes, scale, offset, 32)
        assert (dense - weight).abs().max() <= scale.max() * 0.5 + 1e-6  # round-to-nearest
        for cpu_kernel in (True, False):
            layer = Int4Linear(codes, scale, offset, None, torch.float32, cpu_kernel=cpu_kernel)
            torch.testing.assert_close(layer(x), F.linear(x, dense), rtol=1e-4, atol=1e-4)


def _pack_int32(codes: torch.Tensor, dim: int) -> torch.Tensor:
    """Reference GPTQ packer: eight 4-bit codes per int32 along ``dim``, low bits first."""
    moved = codes.to(torch.int64).movedim(dim, -1)
    grouped = moved.reshape(*moved.shape[:-1], -1, 8)
    words = sum(grouped[..., i] << (4 * i) for i in range(8))
    words = torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)
    return words.movedim(-1, dim)


@pytest.mark.parametrize("act_order", [False, True])
def test_gptq_reader_matches_the_gptq_formula(act_order):
    """A hand-made GPTQ (v1) layer: w[n, k] = scale[g_idx[k], n] * (q[k, n] - (qzeros + 1))."""
    torch.manual_seed(0)
    in_features, out_features, group = 128, 64, 32
    q = torch.randint(0, 16, (in_features, out_features))
    zeros = torch.randint(1, 16, (in_features // group, out_features))
    scales = torch.rand(in_features // group, out_features) * 0.1
    g_idx = torch.arange(in_features) // group
    if act_order:
        g_idx = g_idx[torch.randperm(in_features)]
    assert torch.equal(unpack_int32(_pack_int32(q, 0), 0), q.to(torch.uint8))
    tensors = {
        "qweight": _pack_int32(q, 0),
        "qzeros": _pack_int32(zeros - 1, 1),
        "scales": scales.half(),
        "g_idx": g_idx.int(),
    }
    codes, scale, offset, perm = gptq_int4_parts(tensors, zero_offset=1)
    assert (perm is not None) == act_order
    layer = Int4Linear(codes, scale, offset, None, torch.float32, perm, cpu_kernel=False)
    expected = (scales.half().float()[g_idx] * (q - zeros[g_idx]).float()).T  # (N, K)
    x = torch.randn(3, in_features)
    torch.testing.assert_close(layer(x), F.linear(x, expected), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize(
    ("name", "options", "field"),
    [
        ("rtn", {"bits": 3}, "bits"),
        ("rtn", {"bits": 8, "group_size": 32}, "group_size"),
        ("rtn", {"bits": 4, "group_size": 48}, "group_size"),
        ("rtn", {"bits": 4, "activations": "int4"}, "activations"),
        ("rtn", {"bits": 8, "activations": "fp8"}, "activations"),
        ("rtn", {"bits": 8, "activations": "int8", "activation_group": 30}, "activation_group"),
        (
            "rtn",
            {"bits": 8, "activations": "int8", "activation_group": "token"},
            "activation_group",
        ),  # fmt: skip
        ("rtn", {"bits": 8, "activation_group": 32}, "activation_group"),
        (
            "rtn",
            {"bits": 4, "group_size": 32, "activations": "int8", "activation_group": 64},
            "activation_group",
        ),  # fmt: skip
        ("bnb", {"mode": "int4"}, "mode"),
        ("gptq", {"group_size": 100}, "group_size"),
        ("gptq", {"bits": 3}, "bits"),
        ("gptq", {"activations": "int4"}, "activations"),
        ("awq", {"group_size": 48}, "group_size"),
        ("awq", {"seqlen": 8}, "seqlen"),
        ("qat", {}, "quant.name"),
    ],
)
def test_bad_options_name_the_field(name, options, field):
    with pytest.raises(ValueError, match=field):
        quant_options(name, options)


def test_group_size_must_divide_the_layer(tiny_checkpoints):
    model, _ = load_model(str(tiny_checkpoints["llama"]), cpu_prepack=False)
    with pytest.raises(ValueError, match="does not divide the 64 input features"):
        quantize_(model, "rtn", {"bits": 4, "group_size": 256})


def test_activation_group_must_divide_the_layer(tiny_checkpoints):
    model, _ = load_model(str(tiny_checkpoints["llama"]), cpu_prepack=False)
    options = {"bits": 8, "activations": "int8", "activation_group": 128}
    with pytest.raises(ValueError, match="activation_group=128 does not divide the 64 input"):
        quantize_(model, "rtn", options)


def test_w8a8_scales_activations_per_group_of_32_by_default(tiny_checkpoints):
    """W8A8's layers take an activation scale every 32 channels unless asked for a row's
    (``row``) or another group; W4A8's stay on their weight groups."""
    groups = {}
    for group in (None, "row", 16):
        model, _ = load_model(str(tiny_checkpoints["llama"]), cpu_prepack=False)
        quantize_(model, "rtn", {"bits": 8, "activations": "int8", "activation_group": group})
        groups[group] = {m.activation_group for m in model.modules() if hasattr(m, "qweight")}
    assert groups == {None: {32}, "row": {None}, 16: {16}}


def test_missing_backend_names_its_extra(tiny_checkpoints, monkeypatch):
    monkeypatch.setitem(sys.modules, "bitsandbytes", None)  # import fails as if not installed
    model, _ = load_model(str(tiny_checkpoints["llama"]), cpu_prepack=False)
    with pytest.raises(ModuleNotFoundError, match=r"kvlab\[bnb\]"):
        quantize_(model, "bnb", {"mode": "nf4"})


def test_gptq_quantizes_through_gptqmodel_and_loads_into_kvlab(tmp_path, monkeypatch, smollm2):
    """GPTQModel quantizes a tiny random Llama (the default model's tokenizer, a few
    calibration windows of WikiText-2 valid); kvlab loads the checkpoint, caches it, and
    its logits stay close to full precision."""
    pytest.importorskip("gptqmodel")
    from conftest import tiny_hf_model_with_vocab

    monkeypatch.setenv("KVLAB_CACHE", str(tmp_path / "cache"))
    source = tmp_path / "tiny"
    tiny_hf_model_with_vocab(smollm2[1]).save_pretrained(source)
    smollm2[1].save_pretrained(source)
    options = {"group_size": 32, "samples": 4, "seqlen": 64}
    model, _ = load_model(str(source), cpu_prepack=False)
    ids = torch.randint(0, 1000, (1, 24), generator=torch.Generator().manual_seed(0))
    reference = _logits(model, ids)
    assert quantize_(model, "gptq", options) == LINEARS_OF_TINY_LLAMA
    assert all(
        type(model.get_submodule(n)) is Int4Linear
        for n in ("layers.0.self_attn.qkv_proj", "layers.1.mlp.down_proj")
    )
    error = ((_logits(model, ids) - reference).norm() / reference.norm()).item()
    assert error < 0.2
    (made,) = (tmp_path / "cache" / "gptq").iterdir()
    assert (made / "kvlab_gptq.json").exists()
    again, _ = load_model(str(source), cpu_prepack=False)
    quantize_(again, "gptq", options)  # from the cache: GPTQModel is not run twice
    assert list((tmp_path / "cache" / "gptq").iterdir()) == [made]
    torch.testing.assert_close(_logits(again, ids), _logits(model, ids))


def test_gptq_cache_key_covers_the_calibration_text(tmp_path, monkeypatch):
    """Two calibration files of the same name but other text never share a GPTQ checkpoint,
    and the recipe records which text was read."""
    from kvlab.quant.calibrated import checkpoint_key
    from kvlab.quant.gptq import GptqOptions

    monkeypatch.setenv("KVLAB_CACHE", str(tmp_path / "cache"))
    text = tmp_path / "calibration.txt"
    text.write_text("one line\nanother line\n")
    options = GptqOptions(calibration=str(text))
    first, recipe = checkpoint_key(tmp_path, "gptq", options)
    text.write_text("one line\nanother, different line\n")
    second, _ = checkpoint_key(tmp_path, "gptq", options)
    assert first != second
    assert len(recipe["calibration_text"]) == 16


def _gptq_checkpoint(hf_model, directory, group: int = 32) -> dict[str, torch.Tensor]:
    """Write ``hf_model`` as a GPTQ (v1) checkpoint with a GPTQ quantization_config, as
    GPTQModel/AutoGPTQ write one; returns the dequantized weights it stands for."""
    import json

    from safetensors.torch import save_file

    tensors, dense = {}, {}
    for name, param in hf_model.state_dict().items():
        layer = name.removesuffix(".weight")
        linear = name.endswith("_proj.weight")
        if not linear:
            tensors[name] = param.contiguous()
            continue
        weight = param.float().T  # (K, N)
        grouped = weight.reshape(-1, group, weight.shape[1])  # (G, group, N)
        low, high = grouped.amin(1), grouped.amax(1)
        scales = ((high - low) / 15).clamp(min=1e-8).half()  # (G, N)
        zeros = (-low / scales.float()).round().clamp(0, 15).long()  # (G, N)
        q = (grouped / scales.float()[:, None] + zeros[:, None]).round().clamp(0, 15).long()
        q = q.reshape(weight.shape)  # (K, N)
        g_idx = torch.arange(weight.shape[0]) // group
        tensors[f"{layer}.qweight"], tensors[f"{layer}.g_idx"] = _pack_int32(q, 0), g_idx.int()
        tensors[f"{layer}.qzeros"], tensors[f"{layer}.scales"] = _pack_int32(zeros - 1, 1), scales
        dense[name] = (scales.float()[g_idx] * (q - zeros[g_idx]).float()).T
    save_file({k: v.contiguous() for k, v in tensors.items()}, directory / "model.safetensors")
    config = hf_model.config.to_dict() | {"quantization_config": {
        "quant_method": "gptq", "bits": 4, "group_size": group, "desc_act": False,
        "sym": False, "checkpoint_format": "gptq"}}  # fmt: skip
    (directory / "config.json").write_text(json.dumps(config))
    return dense


def test_a_gptq_checkpoint_loads_as_the_model_source(tmp_path):
    """model.source=<GPTQ checkpoint dir> loads straight into kvlab's int4 layers (no base
    model, no quant.options.checkpoint): its logits are the dequantized model's."""
    from conftest import tiny_hf_model

    hf = tiny_hf_model("llama")
    dense = _gptq_checkpoint(hf, tmp_path)
    model, _ = load_model(str(tmp_path))
    assert sum(type(m) is Int4Linear for m in model.modules()) == LINEARS_OF_TINY_LLAMA
    hf.load_state_dict(hf.state_dict() | dense)  # the weights the checkpoint stands for
    ids = torch.randint(0, 256, (1, 12), generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        expected = hf(ids).logits
    error = ((_logits(model, ids) - expected).norm() / expected.norm()).item()
    assert error < 0.02  # bf16 compute in the int4 kernel


def test_a_gptq_checkpoint_takes_int8_activations(tmp_path, tiny_checkpoints):
    """quant.options.activations=int8 on a GPTQ checkpoint gives W4A8 layers (its int4 codes
    times each token's activations quantized a weight group at a time): the logits stay
    within the activations' rounding of the weight-only layers' and differ from them."""
    from conftest import tiny_hf_model

    _gptq_checkpoint(tiny_hf_model("llama"), tmp_path)
    ids = torch.randint(0, 256, (2, 24), generator=torch.Generator().manual_seed(0))
    logits = {}
    for activations in ("none", "int8"):
        model, _ = load_model(str(tiny_checkpoints["llama"]), cpu_prepack=False)
        options = {"checkpoint": str(tmp_path), "group_size": 32, "activations": activations}
        assert quantize_(model, "gptq", options) == LINEARS_OF_TINY_LLAMA
        layers = [m for m in model.modules() if type(m) is Int4Linear]
        assert {m.int8_activations for m in layers} == {activations == "int8"}
        logits[activations] = _logits(model, ids)
    weight_only, w4a8 = logits["none"], logits["int8"]
    error = ((w4a8 - weight_only).norm() / weight_only.norm()).item()
    assert 0 < error < 0.03  # 0.017 here
