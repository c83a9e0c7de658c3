"""Int4 checkpoints that other tools write, read into kvlab's :class:`Int4Linear` layers.

Two formats, both int32-packed with a scale and an integer zero point per group of input
channels:

- **GPTQ** (GPTQModel, AutoGPTQ): ``qweight`` (K/8, N) packed along the input dimension,
  ``qzeros`` (G, N/8), ``scales`` (G, N), ``g_idx`` (K,) the group of each input channel
  (act-order checkpoints permute it); ``w = scale[g_idx[k]] * (q - zero[g_idx[k]])``, the
  v1 format storing ``zero - 1``.
- **AWQ GEMM** (Lin et al., MLSys 2024; GPTQModel's and AutoAWQ's ``gemm`` version):
  ``qweight`` (K, N/8) packed along the output dimension with eight columns interleaved
  in the order 0 2 4 6 1 3 5 7, ``qzeros`` (G, N/8) the same way, ``scales`` (G, N);
  ``w = scale[k // group] * (q - zero[k // group])``. AWQ folds its activation-aware
  scales into the norms before the layers it quantized, so those norms come from the
  checkpoint too.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from torch import nn

from kvlab.kernels.plan import LinearKernels, plan_of
from kvlab.quant.base import QuantOptions, linear_layers
from kvlab.quant.rtn import Int4Linear, resolve_compute_dtype

PACKED_TENSORS = {
    "gptq": ("qweight", "qzeros", "scales", "g_idx"),
    "awq": ("qweight", "qzeros", "scales"),
}
# kvlab fuses projections; a fused layer reads its parts from the checkpoint in this order
FUSED_PARTS = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}
AWQ_COLUMN_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # natural column of each nibble of an int32


def unpack_int32(packed: torch.Tensor, dim: int) -> torch.Tensor:
    """Eight 4-bit codes per int32, low bits first, spread along ``dim`` (uint8 0..15)."""
    shifts = torch.arange(0, 32, 4, dtype=torch.int32)
    codes = (packed.unsqueeze(dim + 1) >> shifts.view(-1, *[1] * (packed.dim() - dim - 1))) & 15
    return codes.flatten(dim, dim + 1).to(torch.uint8)


def unpack_awq_columns(packed: torch.Tensor) -> torch.Tensor:
    """AWQ's (R, N/8) int32 → (R, N) uint8 codes in natural column order."""
    nibbles = unpack_int32(packed, 1).view(packed.shape[0], -1, 8)  # nibble i: column order[i]
    natural = torch.empty_like(nibbles)
    natural[..., list(AWQ_COLUMN_ORDER)] = nibbles
    return natural.flatten(1)


def gptq_int4_parts(
    tensors: dict[str, torch.Tensor], zero_offset: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """One GPTQ layer as (codes (N, K), scale (G, N), offset (G, N), input_perm) in
    Int4Linear's form ``w = (codes - 8) * scale + offset``, from GPTQ's
    ``w = scale[g_idx[k]] * (q - zero[g_idx[k]])``; ``zero_offset`` 1 for the v1 format."""
    codes = unpack_int32(tensors["qweight"], 0).T  # (N, K)
    zeros = unpack_int32(tensors["qzeros"], 1).float() + zero_offset  # (G, N)
    scale = tensors["scales"].float()  # (G, N)
    g_idx = tensors["g_idx"].long()
    groups, in_features = scale.shape[0], codes.shape[1]
    perm = torch.argsort(g_idx, stable=True)
    if not torch.equal(g_idx[perm], torch.arange(in_features) // (in_features // groups)):
        raise ValueError("GPTQ g_idx does not form equal groups; kvlab cannot load this layer")
    trivial = torch.equal(perm, torch.arange(in_features))
    codes = codes if trivial else codes[:, perm]
    return codes.contiguous(), scale, scale * (8 - zeros), None if trivial else perm


def awq_int4_parts(
    tensors: dict[str, torch.Tensor],
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, None]:
    """One AWQ GEMM layer in Int4Linear's form (codes (N, K), scale (G, N), offset (G, N),
    no input permutation) from ``w = scale[k // group] * (q - zero[k // group])``."""
    codes = unpack_awq_columns(tensors["qweight"]).T  # (N, K)
    zeros = unpack_awq_columns(tensors["qzeros"]).float()  # (G, N)
    scale = tensors["scales"].float()  # (G, N)
    return codes.contiguous(), scale, scale * (8 - zeros), None


def read_int4_checkpoint(directory: Path) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """All tensors (names without the ``model.`` prefix) and the quantization config of a
    4-bit GPTQ or AWQ (GEMM) checkpoint."""
    config_file = directory / "quantize_config.json"
    if config_file.exists():
        qcfg = json.loads(config_file.read_text())
    else:
        qcfg = json.loads((directory / "config.json").read_text()).get("quantization_config", {})
    method, version = quant_method(qcfg), str(qcfg.get("version", "gemm")).lower()
    if method not in PACKED_TENSORS or qcfg.get("bits", qcfg.get("w_bit")) != 4:
        raise ValueError(f"{directory}: not a 4-bit GPTQ or AWQ checkpoint (config {qcfg})")
    if method == "awq" and version != "gemm":
        raise ValueError(f"{directory}: AWQ version {version!r}; kvlab reads the 'gemm' layout")
    tensors: dict[str, torch.Tensor] = {}
    for file in sorted(directory.glob("*.safetensors")):
        with safe_open(file, framework="pt") as f:
            tensors.update({k.removeprefix("model."): f.get_tensor(k) for k in f.keys()})
    return tensors, qcfg


def quant_method(qcfg: dict[str, Any]) -> str:
    """``gptq`` or ``awq`` (or whatever else the checkpoint's config names)."""
    return str(qcfg.get("quant_method", qcfg.get("method", "gptq"))).lower()


def int4_layer(
    tensors: dict[str, torch.Tensor],
    name: str,
    qcfg: dict[str, Any],
    dtype: torch.dtype | None,
    device: torch.device,
    int8_activations: bool = False,
    kernels: LinearKernels | None = None,
) -> Int4Linear:
    """kvlab layer ``name`` (fused ones from their parts) as an Int4Linear on ``device``
    (built there, so it takes the kernel layout of that device); ``int8_activations``: W4A8
    (see :class:`Int4Linear`)."""
    parts, method = checkpoint_parts(name), quant_method(qcfg)
    v1 = qcfg.get("checkpoint_format", qcfg.get("format", "gptq")) == "gptq"

    def unpacked(part: str) -> tuple:
        packed = {t: tensors[f"{part}.{t}"] for t in PACKED_TENSORS[method]}
        return awq_int4_parts(packed) if method == "awq" else gptq_int4_parts(packed, int(v1))

    pieces = [unpacked(part) for part in parts]
    perm = pieces[0][3]
    if any(not _same_perm(piece[3], perm) for piece in pieces[1:]):
        raise ValueError(f"{name}: fused GPTQ parts {parts} have different act-orders")
    codes = torch.cat([piece[0] for piece in pieces], dim=0).to(device)  # (N, K)
    scale = torch.cat([piece[1] for piece in pieces], dim=1).to(device)  # (G, N)
    offset = torch.cat([piece[2] for piece in pieces], dim=1).to(device)  # (G, N)
    biases = [tensors.get(f"{p}.bias") for p in parts]
    bias = torch.cat(biases).to(device) if all(b is not None for b in biases) else None
    perm = None if perm is None else perm.to(device)
    return Int4Linear(codes, scale, offset, bias, dtype, perm, True, int8_activations, kernels)


def _same_perm(a: torch.Tensor | None, b: torch.Tensor | None) -> bool:
    return (a is None and b is None) or (a is not None and b is not None and torch.equal(a, b))


def checkpoint_parts(name: str) -> list[str]:
    """Checkpoint layer names behind kvlab layer ``name`` (a fused layer has several)."""
    parent, _, leaf = name.rpartition(".")
    return [f"{parent}.{part}" for part in FUSED_PARTS.get(leaf, (leaf,))]


def swap_in_int4_layers(
    model: nn.Module, directory: Path, options: QuantOptions, device: torch.device | None = None
) -> int:
    """Replace every linear layer the checkpoint quantized (and ``options`` does not skip),
    building the int4 layers on ``device`` (default: where each layer's weight is); an AWQ
    checkpoint's norms (its scales folded in) replace the model's."""
    tensors, qcfg = read_int4_checkpoint(directory)
    dtype = resolve_compute_dtype(getattr(options, "compute_dtype", "bfloat16"))
    int8_activations = getattr(options, "activations", "none") == "int8"
    kernels, swapped = plan_of(model).weights("int4"), 0
    for name, linear in linear_layers(model, options):
        if f"{checkpoint_parts(name)[0]}.qweight" not in tensors:
            continue  # left in full precision by the checkpoint (the output head)
        where = device or linear.weight.device
        layer = int4_layer(tensors, name, qcfg, dtype, where, int8_activations, kernels)
        if (layer.out_features, layer.in_features) != (linear.out_features, linear.in_features):
            raise ValueError(
                f"quant.options.checkpoint={str(directory)!r}: {name} is "
                f"{layer.out_features}x{layer.in_features} there but "
                f"{linear.out_features}x{linear.in_features} in the model; allowed: an int4 "
                "checkpoint of this model"
            )
        parent, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent), child, layer)
        swapped += 1
    if quant_method(qcfg) == "awq":
        load_norms(model, tensors)
    return swapped


def load_norms(model: nn.Module, tensors: dict[str, torch.Tensor]) -> None:
    """Copy the checkpoint's norm weights into ``model`` (AWQ divided them by the scales it
    multiplied into the next layer's input channels)."""
    for name, parameter in model.named_parameters():
        if name.endswith("norm.weight") and name in tensors:
            parameter.data.copy_(tensors[name].to(parameter.dtype))
