"""Hand-written kernels where eager torch and inductor leave speed on the table, each with a
torch reference path, laid out by what they are:

- ``attention/``: decode attention over the segments a cache hands over (the C, FlexAttention
  and Triton backends, one ``load_rows`` per stored format in C), the fused layer's cached
  attention and pooling descriptions, Quest's block selection, DeepSeek-V4's indexer;
- ``linear/``: matrix-vector kernels per weight format (fp32/bf16, int8, int4, W8A8, W4A8);
- ``codes/``: the K/V write path's quantization codes;
- ``layer/``: the fused decode layer (one C call a layer) and RMSNorm;
- ``include/``: SIMD, bf16 and timer headers every part shares;
- ``plan.py`` / ``autotune.py``: which kernels a run uses (see docs/kernels.md);
  ``build.py``: compiling and loading the library; ``huge_pages.py``: 2 MiB pages."""

from kvlab.kernels.attention import (
    Segment,
    Stored,
    decode_attention,
    kernel_available,
    reference_attention,
)

__all__ = ["Segment", "Stored", "decode_attention", "kernel_available", "reference_attention"]
