"""``turbo3`` / ``turbo4``: TurboQuant's MSE quantizer for K/V (Zandieh, Daliri, Hadian and
Mirrokni, "TurboQuant: Online Vector Quantization with Near-optimal Distortion Rate", arXiv
2504.19874, 2025; vLLM's ``turboquant`` presets, llama.cpp's rotated KV). A row turned by a
random rotation (here the Hadamard rotation, ``rotate=hadamard``) has coordinates that all
follow one known law, that of a coordinate of a uniformly random unit vector of R^g (density
proportional to (1 - t^2)^((g - 3) / 2) on [-1, 1], g the group's channels), so one scalar
codebook serves every channel: the Lloyd-Max centroids of that law at 3 or 4 bits, times the
group's norm. It is a codebook (:mod:`.codebook`), which the decode kernel reads in place:
this file is the table and the scale rule. (The paper's 1-bit QJL residual, which makes
inner products unbiased, is not applied.)

    kvlab cache=full cache.options.kv_bits=3 cache.options.kv_format=turbo3 \\
        cache.options.rotate=hadamard cache.options.kv_group_size=64
"""

from __future__ import annotations

import functools

import torch

from kvlab.cache.codecs.codebook import CodebookCodec
from kvlab.cache.codecs.formats import TokenFormat, register_format

GRID = 1 << 16  # points the law is integrated on
ROUNDS = 200  # Lloyd iterations


@functools.cache
def lloyd_max(bits: int, group: int) -> torch.Tensor:
    """The 2^bits Lloyd-Max centroids (the mean-squared-error optimal scalar quantizer) of a
    coordinate of a uniform unit vector of R^group, ascending: Lloyd's iteration on a fine
    grid (each boundary the midpoint of its centroids, each centroid its cell's mean), from
    the law's quantiles."""
    if group < 2:
        raise ValueError(f"cache.options.kv_group_size={group}: TurboQuant needs groups of >= 2")
    t = torch.linspace(-1, 1, GRID + 2, dtype=torch.float64)[1:-1]
    weight = (1 - t * t).pow((group - 3) / 2)
    weight = weight / weight.sum()
    cumulative = weight.cumsum(0)
    levels = 1 << bits
    quantiles = (torch.arange(levels, dtype=torch.float64) + 0.5) / levels
    centroids = t[torch.searchsorted(cumulative, quantiles).clamp(max=GRID - 1)]
    for _ in range(ROUNDS):
        cell = torch.bucketize(t, (centroids[1:] + centroids[:-1]) / 2)
        mass = torch.zeros(levels, dtype=torch.float64).index_add_(0, cell, weight)
        moment = torch.zeros(levels, dtype=torch.float64).index_add_(0, cell, weight * t)
        centroids = torch.where(mass > 0, moment / mass.clamp(min=1e-300), centroids)
    return centroids.float()


for _bits in (3, 4):
    register_format(TokenFormat(
        f"turbo{_bits}", (_bits,),
        lambda o, dim: CodebookCodec(lloyd_max(o.kv_bits, o.kv_group_size), o.kv_group_size,
                                     dim, "norm"),
        lambda o: (f"TurboQuant {o.kv_bits}-bit keys and values (Lloyd-Max codebook of "
                   f"rotated coordinates, a norm per {o.kv_group_size})"),
        rotation="hadamard",
    ))  # fmt: skip
