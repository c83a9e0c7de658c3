"""Quantizers that calibrate on text through GPTQModel (GPTQ, AWQ): the options they share,
the cache of the checkpoints they write, and the spawned process that runs GPTQModel.

GPTQModel quantizes the model's own checkpoint on calibration windows and writes a
checkpoint (:mod:`kvlab.quant.int4_checkpoint` reads it back into kvlab's layers). It runs
in a separate process: GPTQModel leaves worker threads and global settings behind that
slow every later measurement of the sweep's process. Needs the
``gptq`` extra for quantizing only: ``pip install 'kvlab[gptq]'``.
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

from kvlab.paths import cache_dir
from kvlab.quant.base import QuantOptions
from kvlab.quant.rtn import ACTIVATIONS, COMPUTE_DTYPES

# options that do not change the weights (not in a checkpoint's cache key)
UNFITTED = ("checkpoint", "compute_dtype", "skip", "activations")


@dataclass
class CalibratedOptions(QuantOptions):
    """int4 in groups of ``group_size`` input channels (must divide every layer's input
    size), calibrated on ``samples`` windows of ``seqlen`` tokens of ``calibration``
    (``wikitext2-valid`` or a text file; never test text). ``checkpoint``: a checkpoint
    of this format to load instead of quantizing. ``activations``: ``int8`` quantizes each
    token's activations too, a scale a weight group, and multiplies the codes in int8 (W4A8,
    as :mod:`kvlab.quant.rtn`'s option)."""

    bits: int = 4
    group_size: int = 64
    symmetric: bool = True
    samples: int = 128
    seqlen: int = 512
    calibration: str = "wikitext2-valid"
    seed: int = 0
    checkpoint: str | None = None
    compute_dtype: str = "bfloat16"
    activations: str = "none"

    def checks(self) -> list[tuple[str, bool, str]]:
        """(field, valid, what is allowed) of every option; subclasses add theirs."""
        return [
            ("bits", self.bits == 4, "4 (kvlab's layer is int4)"),
            ("group_size", self.group_size in (32, 64, 128, 256), "32, 64, 128, 256"),
            ("samples", self.samples >= 1, "an integer >= 1"),
            ("seqlen", self.seqlen >= 16, "an integer >= 16"),
            ("compute_dtype", self.compute_dtype in COMPUTE_DTYPES, ", ".join(COMPUTE_DTYPES)),
            ("activations", self.activations in ACTIVATIONS, ", ".join(ACTIVATIONS)),
        ]

    def __post_init__(self) -> None:
        for name, ok, allowed in self.checks():
            if not ok:
                value = getattr(self, name)
                raise ValueError(f"quant.options.{name}={value!r} is invalid; allowed: {allowed}")

    def gptqmodel_config(self) -> Any:
        """GPTQModel's quantize config for these options (in the worker process)."""
        raise NotImplementedError

    def gptqmodel_backend(self) -> Any:
        """The packing backend GPTQModel should use on the CPU (None: its own choice)."""
        return None


def quantized_checkpoint(source: Path, method: str, options: CalibratedOptions) -> Path:
    """The ``method`` checkpoint of ``source`` for ``options``, made by GPTQModel on first
    use and cached under ``$KVLAB_CACHE/<method>`` with a manifest of what made it."""
    out, recipe = checkpoint_key(source, method, options)
    if (out / f"kvlab_{method}.json").exists():
        return out
    partial = out.with_name(out.name + ".partial")
    run_gptqmodel(source, method, options, partial)
    manifest = {"source": str(source), "recipe": recipe, "gptqmodel": _gptqmodel_version()}
    (partial / f"kvlab_{method}.json").write_text(json.dumps(manifest, indent=2))
    partial.replace(out)
    return out


def checkpoint_key(
    source: Path, method: str, options: CalibratedOptions
) -> tuple[Path, dict[str, Any]]:
    """Where the ``method`` checkpoint of ``source`` for ``options`` is cached, and the
    recipe its key covers: the options that change the result and the identity of the
    calibration text (so the same file name with other text is never reused)."""
    from kvlab.data import calibration_text_id

    recipe = {k: v for k, v in asdict(options).items() if k not in UNFITTED}
    recipe["calibration_text"] = calibration_text_id(options.calibration)
    key = hashlib.sha256(json.dumps([str(source.resolve()), recipe], sort_keys=True).encode())
    return cache_dir() / method / f"{source.name}-{key.hexdigest()[:12]}", recipe


def calibration_samples(source: Path, options: CalibratedOptions) -> list[dict[str, list[int]]]:
    """``samples`` random windows of ``seqlen`` tokens of the calibration text (seeded), as
    the GPTQ paper draws them."""
    from kvlab.data import calibration_windows

    windows = calibration_windows(
        source, options.calibration, options.samples, options.seqlen, options.seed, "quant.options"
    )
    return [{"input_ids": ids, "attention_mask": [1] * len(ids)} for ids in windows]


def run_gptqmodel(source: Path, method: str, options: CalibratedOptions, out: Path) -> None:
    """GPTQModel's quantize + save of ``source`` into ``out``, in a spawned process."""
    if importlib.util.find_spec("gptqmodel") is None:
        raise ModuleNotFoundError(f"quant={method} needs GPTQModel: pip install 'kvlab[gptq]'")
    context = multiprocessing.get_context("spawn")
    worker = context.Process(
        target=_quantize_in_worker, args=(str(source), method, asdict(options), str(out))
    )
    worker.start()
    worker.join()
    if worker.exitcode != 0:
        raise RuntimeError(
            f"GPTQModel ({method}) failed on {source} (exit code {worker.exitcode}); "
            "see its log above"
        )


def _quantize_in_worker(source: str, method: str, options: dict[str, Any], out: str) -> None:
    from kvlab.quiet import quiet_third_party

    quiet_third_party()
    os.environ.setdefault("GPTQMODEL_CPU_WORKERS", str(os.cpu_count() or 1))
    from gptqmodel import GPTQModel

    from kvlab.quant import quant_options

    opts = quant_options(method, options)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    model = GPTQModel.load(source, opts.gptqmodel_config(), device=device)
    backend = opts.gptqmodel_backend() if device == "cpu" else None
    quantize_args = {"backend": backend} if backend is not None else {}
    model.quantize(calibration_samples(Path(source), opts), batch_size=1, **quantize_args)
    model.save(out)


def _gptqmodel_version() -> str:
    from importlib import metadata

    return metadata.version("gptqmodel")
