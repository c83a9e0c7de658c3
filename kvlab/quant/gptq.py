"""GPTQ (Frantar et al., arXiv 2210.17323) through GPTQModel, the maintained successor of
auto-gptq: GPTQModel quantizes the model's checkpoint on calibration text and writes the
GPTQ checkpoint format (int32-packed ``qweight``/``qzeros``, fp16 ``scales``, ``g_idx``);
kvlab reads that format back into its own model as :class:`~kvlab.quant.rtn.Int4Linear`
layers, so every KV strategy runs on it. Needs the ``gptq`` extra for quantizing only:
``pip install 'kvlab[gptq]'``; a GPTQ checkpoint made elsewhere loads without it.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import multiprocessing
import os
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from torch import nn

from kvlab.paths import cache_dir
from kvlab.quant.base import QuantOptions, linear_layers, register_quantizer
from kvlab.quant.rtn import COMPUTE_DTYPES, Int4Linear, resolve_compute_dtype

GPTQ_TENSORS = ("qweight", "qzeros", "scales", "g_idx")
# kvlab fuses projections; a fused layer reads its parts from the checkpoint in this order
FUSED_PARTS = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}


@dataclass
class GptqOptions(QuantOptions):
    """GPTQ int4 (``group_size`` input channels per scale; must divide every layer's input
    size), ``desc_act`` (act-order), ``damp_percent`` of the Hessian diagonal; calibration
    on ``samples`` windows of ``seqlen`` tokens of ``calibration`` (``wikitext2-valid`` or a
    text file; never test text). ``checkpoint``: a GPTQ checkpoint to load instead."""

    bits: int = 4
    group_size: int = 64
    symmetric: bool = True
    desc_act: bool = False
    damp_percent: float = 0.05
    samples: int = 128
    seqlen: int = 512
    calibration: str = "wikitext2-valid"
    seed: int = 0
    checkpoint: str | None = None
    compute_dtype: str = "bfloat16"

    def __post_init__(self) -> None:
        checks = (
            ("bits", self.bits == 4, "4 (kvlab's GPTQ layer is int4)"),
            ("group_size", self.group_size in (32, 64, 128, 256), "32, 64, 128, 256"),
            ("damp_percent", 0 < self.damp_percent < 1, "0 < damp_percent < 1"),
            ("samples", self.samples >= 1, "an integer >= 1"),
            ("seqlen", self.seqlen >= 16, "an integer >= 16"),
            ("compute_dtype", self.compute_dtype in COMPUTE_DTYPES, ", ".join(COMPUTE_DTYPES)),
        )
        for name, ok, allowed in checks:
            if not ok:
                value = getattr(self, name)
                raise ValueError(f"quant.options.{name}={value!r} is invalid; allowed: {allowed}")


def unpack_int32(packed: torch.Tensor, dim: int) -> torch.Tensor:
    """Eight 4-bit codes per int32, low bits first, spread along ``dim`` (uint8 0..15)."""
    shifts = torch.arange(0, 32, 4, dtype=torch.int32)
    codes = (packed.unsqueeze(dim + 1) >> shifts.view(-1, *[1] * (packed.dim() - dim - 1))) & 15
    return codes.flatten(dim, dim + 1).to(torch.uint8)


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


def read_gptq_checkpoint(directory: Path) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """All tensors (names without the ``model.`` prefix) and the quantization config."""
    config_file = directory / "quantize_config.json"
    if config_file.exists():
        qcfg = json.loads(config_file.read_text())
    else:
        qcfg = json.loads((directory / "config.json").read_text()).get("quantization_config", {})
    if qcfg.get("quant_method", "gptq") != "gptq" or qcfg.get("bits") != 4:
        raise ValueError(f"{directory}: not a 4-bit GPTQ checkpoint (quantization config {qcfg})")
    tensors: dict[str, torch.Tensor] = {}
    for file in sorted(directory.glob("*.safetensors")):
        with safe_open(file, framework="pt") as f:
            tensors.update({k.removeprefix("model."): f.get_tensor(k) for k in f.keys()})
    return tensors, qcfg


def gptq_layer(
    tensors: dict[str, torch.Tensor],
    name: str,
    qcfg: dict[str, Any],
    dtype: torch.dtype | None,
    device: torch.device,
) -> Int4Linear:
    """kvlab layer ``name`` (fused ones from their parts) as an Int4Linear on ``device``
    (built there, so it takes the kernel layout of that device)."""
    parts = checkpoint_parts(name)
    v1 = qcfg.get("checkpoint_format", qcfg.get("format", "gptq")) == "gptq"
    pieces = [
        gptq_int4_parts({t: tensors[f"{p}.{t}"] for t in GPTQ_TENSORS}, int(v1)) for p in parts
    ]
    perm = pieces[0][3]
    if any(not _same_perm(piece[3], perm) for piece in pieces[1:]):
        raise ValueError(f"{name}: fused GPTQ parts {parts} have different act-orders")
    codes = torch.cat([piece[0] for piece in pieces], dim=0).to(device)  # (N, K)
    scale = torch.cat([piece[1] for piece in pieces], dim=1).to(device)  # (G, N)
    offset = torch.cat([piece[2] for piece in pieces], dim=1).to(device)  # (G, N)
    biases = [tensors.get(f"{p}.bias") for p in parts]
    bias = torch.cat(biases).to(device) if all(b is not None for b in biases) else None
    perm = None if perm is None else perm.to(device)
    return Int4Linear(codes, scale, offset, bias, dtype, perm)


def _same_perm(a: torch.Tensor | None, b: torch.Tensor | None) -> bool:
    return (a is None and b is None) or (a is not None and b is not None and torch.equal(a, b))


def checkpoint_parts(name: str) -> list[str]:
    """Checkpoint layer names behind kvlab layer ``name`` (a fused layer has several)."""
    parent, _, leaf = name.rpartition(".")
    return [f"{parent}.{part}" for part in FUSED_PARTS.get(leaf, (leaf,))]


def swap_in_gptq_layers(
    model: nn.Module, directory: Path, options: GptqOptions, device: torch.device | None = None
) -> int:
    """Replace every linear layer the checkpoint quantized (and ``options`` does not skip),
    building the int4 layers on ``device`` (default: where each layer's weight is)."""
    tensors, qcfg = read_gptq_checkpoint(directory)
    dtype = resolve_compute_dtype(options.compute_dtype)
    swapped = 0
    for name, linear in linear_layers(model, options):
        if f"{checkpoint_parts(name)[0]}.qweight" not in tensors:
            continue  # left in full precision by the checkpoint (the output head)
        layer = gptq_layer(tensors, name, qcfg, dtype, device or linear.weight.device)
        if (layer.out_features, layer.in_features) != (linear.out_features, linear.in_features):
            raise ValueError(
                f"quant.options.checkpoint={str(directory)!r}: {name} is "
                f"{layer.out_features}x{layer.in_features} there but "
                f"{linear.out_features}x{linear.in_features} in the model; allowed: a GPTQ "
                "checkpoint of this model"
            )
        parent, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent), child, layer)
        swapped += 1
    return swapped


@register_quantizer("gptq", GptqOptions)
def apply_gptq(model: nn.Module, options: GptqOptions) -> int:
    """Quantize the model's checkpoint with GPTQModel (once; cached) or take
    ``options.checkpoint``, and load its int4 layers into ``model``."""
    directory = Path(options.checkpoint).expanduser() if options.checkpoint else None
    if directory is None:
        directory = quantized_checkpoint(Path(model.checkpoint_dir), options)
    return swap_in_gptq_layers(model, directory, options)


def quantized_checkpoint(source: Path, options: GptqOptions) -> Path:
    """The GPTQ checkpoint of ``source`` for ``options``, made by GPTQModel on first use and
    cached under ``$KVLAB_CACHE/gptq`` with a manifest of what made it."""
    out, recipe = checkpoint_key(source, options)
    if (out / "kvlab_gptq.json").exists():
        return out
    partial = out.with_name(out.name + ".partial")
    run_gptqmodel(source, options, partial)
    manifest = {"source": str(source), "recipe": recipe, "gptqmodel": _gptqmodel_version()}
    (partial / "kvlab_gptq.json").write_text(json.dumps(manifest, indent=2))
    partial.replace(out)
    return out


def checkpoint_key(source: Path, options: GptqOptions) -> tuple[Path, dict[str, Any]]:
    """Where the GPTQ checkpoint of ``source`` for ``options`` is cached, and the recipe its
    key covers: the options that change the result and the identity of the calibration
    text (so the same file name with other text is never reused)."""
    from kvlab.data import calibration_text_id

    unfitted = ("checkpoint", "compute_dtype", "skip")
    recipe = {k: v for k, v in asdict(options).items() if k not in unfitted}
    recipe["calibration_text"] = calibration_text_id(options.calibration)
    key = hashlib.sha256(json.dumps([str(source.resolve()), recipe], sort_keys=True).encode())
    return cache_dir() / "gptq" / f"{source.name}-{key.hexdigest()[:12]}", recipe


def calibration_samples(source: Path, options: GptqOptions) -> list[dict[str, list[int]]]:
    """``samples`` random windows of ``seqlen`` tokens of the calibration text (seeded), as
    the GPTQ paper draws them."""
    from kvlab.data import calibration_windows

    windows = calibration_windows(
        source, options.calibration, options.samples, options.seqlen, options.seed, "quant.options"
    )
    return [{"input_ids": ids, "attention_mask": [1] * len(ids)} for ids in windows]


def run_gptqmodel(source: Path, options: GptqOptions, out: Path) -> None:
    """GPTQModel's quantize + save of ``source`` into ``out`` (the GPTQ format), in a
    separate process: GPTQModel leaves worker threads and global settings behind that
    slowed every later measurement of the sweep's process (ITL 18.9 ms -> 33.6 ms)."""
    if importlib.util.find_spec("gptqmodel") is None:
        raise ModuleNotFoundError("quant=gptq needs GPTQModel: pip install 'kvlab[gptq]'")
    context = multiprocessing.get_context("spawn")
    worker = context.Process(
        target=_quantize_in_worker, args=(str(source), asdict(options), str(out))
    )
    worker.start()
    worker.join()
    if worker.exitcode != 0:
        raise RuntimeError(
            f"GPTQModel failed on {source} (exit code {worker.exitcode}); see its log above"
        )


def _quantize_in_worker(source: str, options: dict[str, Any], out: str) -> None:
    from kvlab.quiet import quiet_third_party

    quiet_third_party()
    os.environ.setdefault("GPTQMODEL_CPU_WORKERS", str(os.cpu_count() or 1))
    from gptqmodel import GPTQModel, QuantizeConfig

    opts = GptqOptions(**options)
    qcfg = QuantizeConfig(
        bits=opts.bits, group_size=opts.group_size, desc_act=opts.desc_act,
        sym=opts.symmetric, damp_percent=opts.damp_percent,
    )  # fmt: skip
    device = "cuda" if torch.cuda.is_available() else "cpu"
    model = GPTQModel.load(source, qcfg, device=device)
    model.quantize(calibration_samples(Path(source), opts), batch_size=1)
    model.save(out)


def _gptqmodel_version() -> str:
    from importlib import metadata

    return metadata.version("gptqmodel")
