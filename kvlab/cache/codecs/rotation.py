"""``rotate: hadamard``: keys and values multiplied per head by a normalized Hadamard matrix
before they are encoded, queries by the same matrix, and the attention output by its
transpose (QuaRot, Ashkboos et al., arXiv 2404.00456; llama.cpp rotates its KV the same
way): H is orthonormal, so q·k and Σ p v are unchanged in exact arithmetic, while an
outlier channel is spread over every channel before a codec with per-group scales sees it.
Keys are rotated after RoPE. :func:`rotate_rows` turns rows by it, in C on the CPU (the
fused decode layer's own function, so both paths give the same bits), else by a matmul."""

from __future__ import annotations

import torch

ROTATIONS = ("none", "hadamard")


def check_rotation(rotate: str) -> None:
    if rotate not in ROTATIONS:
        raise ValueError(f"cache.options.rotate={rotate!r} is invalid; allowed: {ROTATIONS}")


def hadamard(dim: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """The (dim, dim) Sylvester Hadamard matrix over sqrt(dim): orthonormal and symmetric."""
    if dim < 1 or dim & (dim - 1):
        raise ValueError(
            f"cache.options.rotate='hadamard' needs a power-of-two head_dim, and this "
            f"model's is {dim}; allowed: rotate=none"
        )
    matrix = torch.ones(1, 1, dtype=torch.float64)
    while matrix.shape[0] < dim:
        matrix = torch.cat([torch.cat([matrix, matrix], 1), torch.cat([matrix, -matrix], 1)])
    return (matrix / dim**0.5).to(dtype=dtype, device=device)


def rotate_rows(x: torch.Tensor, matrix: torch.Tensor) -> torch.Tensor:
    """x (..., D) times ``matrix`` (D, D) in x's dtype: through ``kvlab_rotate_rows`` (each
    product summed in fp32, in order) for fp32 or bf16 CPU tensors in eager mode, else
    ``x @ matrix``."""
    from kvlab.kernels.build import INT, INT64, POINTER, kernel, library

    usable = (
        x.device.type == "cpu"
        and x.dtype in (torch.float32, torch.bfloat16)
        and not torch.compiler.is_compiling()
        and library() is not None
    )
    if not usable:
        return x @ matrix
    rows = x.contiguous()
    table = matrix.float().contiguous()
    out = torch.empty_like(rows)
    dim = x.shape[-1]
    kernel("kvlab_rotate_rows", POINTER, INT, INT64, INT64, POINTER, POINTER)(
        rows.data_ptr(), int(x.dtype == torch.bfloat16), rows.numel() // dim, dim,
        table.data_ptr(), out.data_ptr(),
    )  # fmt: skip
    return out
