"""Hand-written kernels where eager torch and inductor leave speed on the table (decode
attention over stored and quantized K/V on the CPU), each with a torch reference path."""

from kvlab.kernels.attention import (
    Segment,
    Stored,
    decode_attention,
    kernel_available,
    reference_attention,
)

__all__ = ["Segment", "Stored", "decode_attention", "kernel_available", "reference_attention"]
