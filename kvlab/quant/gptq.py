"""GPTQ (Frantar et al., arXiv 2210.17323) through GPTQModel, the maintained successor of
auto-gptq: GPTQModel quantizes the model's checkpoint on calibration text and writes the
GPTQ checkpoint format (int32-packed ``qweight``/``qzeros``, fp16 ``scales``, ``g_idx``);
kvlab reads that format back into its own model as :class:`~kvlab.quant.rtn.Int4Linear`
layers (:mod:`kvlab.quant.int4_checkpoint`), so every KV strategy runs on it. Needs the
``gptq`` extra for quantizing only: ``pip install 'kvlab[gptq]'``; a GPTQ checkpoint made
elsewhere loads without it.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from torch import nn

from kvlab.quant.base import register_quantizer
from kvlab.quant.calibrated import CalibratedOptions, quantized_checkpoint
from kvlab.quant.int4_checkpoint import swap_in_int4_layers


@dataclass
class GptqOptions(CalibratedOptions):
    """GPTQ int4 (see :class:`CalibratedOptions`): ``desc_act`` (act-order),
    ``damp_percent`` of the Hessian diagonal."""

    desc_act: bool = False
    damp_percent: float = 0.05

    def checks(self) -> list[tuple[str, bool, str]]:
        return super().checks() + [
            ("damp_percent", 0 < self.damp_percent < 1, "0 < damp_percent < 1"),
        ]

    def gptqmodel_config(self) -> Any:
        from gptqmodel import QuantizeConfig

        return QuantizeConfig(
            bits=self.bits, group_size=self.group_size, desc_act=self.desc_act,
            sym=self.symmetric, damp_percent=self.damp_percent,
        )  # fmt: skip


@register_quantizer("gptq", GptqOptions)
def apply_gptq(model: nn.Module, options: GptqOptions) -> int:
    """Quantize the model's checkpoint with GPTQModel (once; cached) or take
    ``options.checkpoint``, and load its int4 layers into ``model``."""
    directory = Path(options.checkpoint).expanduser() if options.checkpoint else None
    if directory is None:
        directory = quantized_checkpoint(Path(model.checkpoint_dir), "gptq", options)
    return swap_in_int4_layers(model, directory, options)
