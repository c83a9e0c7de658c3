"""``gqa_shared``: KV heads merged post hoc into shared heads (GQA, Ainslie et al., arXiv
2305.13245). Groups of ``factor`` KV heads become one head, by mean pooling of K and V (the
paper's MHA→GQA conversion) or by keeping each group's first head; every query head of a
group attends to the shared head. ``factor=1`` is exactly ``full``; ``factor`` = number of
KV heads is MQA. Training-free: the paper uptrains after merging, kvlab measures without.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from kvlab.cache.base import MemoryReport, register
from kvlab.cache.presets import FullCache

MERGES = ("mean", "first")


@dataclass
class GQASharedOptions(FullCache.Options):
    factor: int = 1
    merge: str = "mean"

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.factor < 1:
            raise ValueError(f"cache.options.factor={self.factor} must be >= 1")
        if self.merge not in MERGES:
            raise ValueError(f"cache.options.merge={self.merge!r} is invalid; allowed: {MERGES}")


@register("gqa_shared")
class GQASharedCache(FullCache):
    """A full cache over merged KV heads."""

    Options = GQASharedOptions

    def __init__(self, spec, options=None, static=False):
        options = options if options is not None else self.Options()
        if spec.num_kv_heads % options.factor:
            raise ValueError(
                f"cache.options.factor={options.factor} must divide the model's "
                f"{spec.num_kv_heads} KV heads"
            )
        super().__init__(
            dataclasses.replace(spec, num_kv_heads=spec.num_kv_heads // options.factor),
            options,
            static,
        )
        self.model_spec = spec

    @classmethod
    def planned_bytes(cls, spec, options, batch_size, max_tokens):
        merged = dataclasses.replace(spec, num_kv_heads=spec.num_kv_heads // options.factor)
        return super().planned_bytes(merged, options, batch_size, max_tokens)

    def attend(self, step, layer, q, k, v, k_raw):
        return super().attend(step, layer, q, self._merge(k), self._merge(v), k_raw)

    def _merge(self, x):
        batch, heads, steps, dim = x.shape
        factor = self.options.factor
        grouped = x.view(batch, heads // factor, factor, steps, dim)  # (B, H_kv/f, f, T, D)
        return grouped.mean(dim=2) if self.options.merge == "mean" else grouped[:, :, 0]

    def memory(self) -> MemoryReport:
        """Also: what the same tokens take as multi-head attention and as the model's GQA."""
        report = super().memory()
        kept, model = self.spec.num_kv_heads, self.model_spec
        details = {
            "mha_bytes": report.held_bytes * model.num_heads // kept,
            "model_gqa_bytes": report.held_bytes * model.num_kv_heads // kept,
        }
        return dataclasses.replace(report, details=details)
