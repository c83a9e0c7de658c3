"""Rotary position embedding (RoFormer, arXiv 2104.09864) with the scaling variants of the
Llama family: none, linear position interpolation (arXiv 2306.15595) and Llama 3.1's
frequency-dependent scaling. Numerics follow Hugging Face transformers (fp32 angles).
"""

from __future__ import annotations

import math

import torch

from kvlab.models.config import DecoderConfig


def inverse_frequencies(cfg: DecoderConfig) -> torch.Tensor:
    """Per-pair rotation frequencies, shape (head_dim // 2,), fp32."""
    dim = cfg.head_dim
    exponents = torch.arange(0, dim, 2, dtype=torch.int64).float() / dim
    inv_freq = 1.0 / (cfg.rope_theta**exponents)
    scaling = cfg.rope_scaling
    rope_type = scaling.get("rope_type", "default")
    if rope_type == "linear":
        return inv_freq / scaling["factor"]
    if rope_type == "llama3":
        return _llama3_scaled(inv_freq, scaling)
    return inv_freq


def _llama3_scaled(inv_freq: torch.Tensor, p: dict) -> torch.Tensor:
    """Llama 3.1: keep high frequencies, divide low ones by ``factor``, blend in between."""
    factor, low, high = p["factor"], p["low_freq_factor"], p["high_freq_factor"]
    old_len = p["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < old_len / high) * ~(wavelen > old_len / low)
    return torch.where(is_medium, blended, scaled)


class RotaryTables:
    """cos/sin for one forward step, shared by every layer; ``rotate`` applies them.

    HF's ``x * cos + rotate_half(x) * sin`` with ``rotate_half(x) = cat(-x2, x1)`` is computed
    as ``x * cos + roll(x, D/2) * sin_signed`` where ``sin_signed = cat(-sin1, sin2)``:
    the same products, four ops instead of seven.
    """

    def __init__(self, inv_freq: torch.Tensor, positions: torch.Tensor, dtype: torch.dtype):
        self.inv_freq, self.dtype = inv_freq, dtype  # strategies re-rotate with these
        freqs = positions[..., None].float() * inv_freq  # (B, T, D/2)
        self.cos = torch.cat((freqs, freqs), dim=-1).cos().to(dtype)[:, :, None]  # (B, T, 1, D)
        sin = freqs.sin()
        self.sin = torch.cat((-sin, sin), dim=-1).to(dtype)[:, :, None]  # (B, T, 1, D)

    def rotate(self, x: torch.Tensor) -> torch.Tensor:
        """Rotate x of shape (B, T, H, D) by this step's positions."""
        return x * self.cos + x.roll(x.shape[-1] // 2, dims=-1) * self.sin

    def rotate_heads_first(self, x: torch.Tensor) -> torch.Tensor:
        """Rotate x of shape (B, H, T, D), the layout caches keep keys in."""
        return self.rotate(x.transpose(1, 2)).transpose(1, 2)
