"""bitsandbytes weight quantization applied to kvlab's own model: LLM.int8 (Dettmers et
al., arXiv 2208.07339; outlier columns above ``threshold`` kept in 16-bit) and 4-bit NF4 /
FP4 with optional double quantization (QLoRA, Dettmers et al., arXiv 2305.14314).

The layers are bitsandbytes' own (``Linear8bitLt``, ``Linear4bit``, CPU-capable since
0.47); kvlab only swaps them in and counts the quantization state they keep beside the
weight. Needs the ``bnb`` extra: ``pip install 'kvlab[bnb]'``.
"""

from __future__ import annotations

import functools
import importlib
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from types import ModuleType

import torch
from torch import nn

from kvlab.quant.base import QuantOptions, register_quantizer, replace_linears

MODES = ("int8", "nf4", "fp4")
COMPUTE_DTYPES = ("input", "bfloat16", "float16", "float32")


@dataclass
class BnbOptions(QuantOptions):
    """``mode`` int8 | nf4 | fp4; ``threshold``: LLM.int8 outlier threshold (0 = none);
    ``double_quant``: quantize the 4-bit absmax statistics too; ``blocksize``: 4-bit block;
    ``compute_dtype``: of the 4-bit matmul (``input``: the activations' dtype)."""

    mode: str = "nf4"
    threshold: float = 6.0
    double_quant: bool = False
    blocksize: int = 64
    compute_dtype: str = "input"

    def __post_init__(self) -> None:
        checks = (
            ("mode", self.mode in MODES, ", ".join(MODES)),
            ("threshold", self.threshold >= 0, ">= 0 (0 = no outlier decomposition)"),
            ("blocksize", self.blocksize in (32, 64, 128, 256, 512), "32, 64, 128, 256, 512"),
            ("compute_dtype", self.compute_dtype in COMPUTE_DTYPES, ", ".join(COMPUTE_DTYPES)),
        )
        for field_name, ok, allowed in checks:
            if not ok:
                value = getattr(self, field_name)
                raise ValueError(
                    f"quant.options.{field_name}={value!r} is invalid; allowed: {allowed}"
                )


def import_bitsandbytes() -> ModuleType:
    """bitsandbytes, or an error naming the extra that installs it."""
    try:
        return importlib.import_module("bitsandbytes")
    except ImportError as exc:
        raise ModuleNotFoundError("quant=bnb needs bitsandbytes: pip install 'kvlab[bnb]'") from exc


def _state_tensors(state: object) -> Iterator[torch.Tensor]:
    """Tensors of a bitsandbytes QuantState, its nested (double-quant) state included."""
    for value in vars(state).values():
        if isinstance(value, torch.Tensor):
            yield value
        elif type(value).__name__ == "QuantState":
            yield from _state_tensors(value)


def _int8_layer(bnb: ModuleType, linear: nn.Linear, options: BnbOptions) -> nn.Module:
    layer = _layer_classes(bnb)[0](
        linear.in_features, linear.out_features, bias=linear.bias is not None,
        has_fp16_weights=False, threshold=options.threshold, device="meta",
    )  # fmt: skip
    layer.weight = bnb.nn.Int8Params(  # from a CPU copy: moving it quantizes it
        linear.weight.detach().float().cpu(), requires_grad=False, has_fp16_weights=False
    )
    layer.bias = linear.bias
    return layer.to(linear.weight.device)  # quantizes the weight (row-wise absmax, SCB)


def _four_bit_layer(bnb: ModuleType, linear: nn.Linear, options: BnbOptions) -> nn.Module:
    wanted = options.compute_dtype
    dtype = linear.weight.dtype if wanted == "input" else getattr(torch, wanted)
    layer = _layer_classes(bnb)[1](
        linear.in_features, linear.out_features, bias=linear.bias is not None,
        compute_dtype=dtype, compress_statistics=options.double_quant,
        quant_type=options.mode, device="meta",
    )  # fmt: skip
    layer.weight = bnb.nn.Params4bit(  # from a CPU copy: moving it quantizes it
        linear.weight.detach().cpu(), requires_grad=False, blocksize=options.blocksize,
        compress_statistics=options.double_quant, quant_type=options.mode,
    )  # fmt: skip
    layer.bias = linear.bias
    return layer.to(linear.weight.device)  # quantizes the weight into packed codes + absmax


@functools.cache
def _layer_classes(bnb: ModuleType) -> tuple[type, type]:
    """bitsandbytes' layers, taught to name the state they hold outside their parameters
    (the int8 row scales SCB; the 4-bit absmax, code book and nested statistics)."""

    class Linear8bitHeld(bnb.nn.Linear8bitLt):
        def held_tensors(self) -> Iterator[torch.Tensor]:
            scb = getattr(self.weight, "SCB", None)
            return iter(() if scb is None else (scb,))

    class Linear4bitHeld(bnb.nn.Linear4bit):
        def held_tensors(self) -> Iterator[torch.Tensor]:
            state = getattr(self.weight, "quant_state", None)
            return _state_tensors(state) if state is not None else iter(())

    return Linear8bitHeld, Linear4bitHeld


@register_quantizer("bnb", BnbOptions)
def apply_bnb(model: nn.Module, options: BnbOptions) -> int:
    """Swap every eligible linear layer for bitsandbytes' int8 or 4-bit layer."""
    bnb = import_bitsandbytes()
    # LLM.int8 warns on every matmul that inputs are cast to fp16: once is enough to know.
    warnings.filterwarnings("ignore", message=".*inputs will be cast from.*")
    make = _int8_layer if options.mode == "int8" else _four_bit_layer
    return replace_linears(model, options, lambda name, linear: make(bnb, linear, options))
