"""Weight quantizers: one file each, registered by name (see ``base.py``)."""

from kvlab.quant import awq, bnb, gptq, rtn  # noqa: F401  (registers the quantizers)
from kvlab.quant.base import (
    QuantOptions,
    held_tensors,
    quant_options,
    quantize_,
    register_quantizer,
    registered_quantizers,
)

__all__ = [
    "QuantOptions",
    "held_tensors",
    "quant_options",
    "quantize_",
    "register_quantizer",
    "registered_quantizers",
]
