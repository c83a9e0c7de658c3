"""AWQ, activation-aware weight quantization (Lin et al., MLSys 2024), through GPTQModel's
AWQ path (AutoAWQ is archived): per input channel, a scale searched on calibration
activations protects the salient weights before int4 rounding in groups, and a clipping
range per group is searched the same way. The scales are folded into the norm before
each quantized layer (and into the layer that feeds ``o_proj`` / ``down_proj``), so the
model's arithmetic is unchanged before rounding. GPTQModel writes the AWQ GEMM checkpoint
format; kvlab reads it into its own :class:`~kvlab.quant.rtn.Int4Linear` layers with the
checkpoint's norms (:mod:`kvlab.quant.int4_checkpoint`). Needs the ``gptq`` extra for
quantizing only; an AWQ checkpoint made elsewhere loads without it (``model.source=``).
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
class AwqOptions(CalibratedOptions):
    """AWQ int4 (see :class:`CalibratedOptions`); asymmetric (a zero point per group) by
    default, as AWQ's GEMM checkpoints are."""

    symmetric: bool = False

    def gptqmodel_config(self) -> Any:
        from gptqmodel.quantization.config import AWQConfig

        return AWQConfig(bits=self.bits, group_size=self.group_size, sym=self.symmetric)

    def gptqmodel_backend(self) -> Any:
        from gptqmodel.utils.backend import BACKEND

        return BACKEND.AWQ_TORCH  # its default packing kernel needs CUDA


@register_quantizer("awq", AwqOptions)
def apply_awq(model: nn.Module, options: AwqOptions) -> int:
    """Quantize the model's checkpoint with GPTQModel's AWQ (once; cached) or take
    ``options.checkpoint``, and load its int4 layers and folded norms into ``model``."""
    directory = Path(options.checkpoint).expanduser() if options.checkpoint else None
    if directory is None:
        directory = quantized_checkpoint(Path(model.checkpoint_dir), "awq", options)
    return swap_in_int4_layers(model, directory, options)
