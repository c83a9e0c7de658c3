"""Weight quantizers: one file each, registered by name (see ``base.py``); every module of
this folder is imported, so a new quantizer is its file alone."""

from kvlab.quant.base import (
    QuantOptions,
    held_tensors,
    quant_options,
    quantize_,
    register_quantizer,
    registered_quantizers,
)
from kvlab.registry import import_folder

import_folder(__name__)  # every quantizer file registers itself

__all__ = [
    "QuantOptions",
    "held_tensors",
    "quant_options",
    "quantize_",
    "register_quantizer",
    "registered_quantizers",
]
