"""``merged_heads``: KV heads merged post hoc into shared heads (GQA, Ainslie et al., arXiv
2305.13245). Groups of ``factor`` KV heads become one head, by mean pooling of K and V (the
paper's MHA→GQA conversion) or by keeping each group's first head; every query head of a
group attends to the shared head. Everything else is ``keep_all``'s over a store of the
merged heads: ``factor=1`` is exactly ``full``; ``factor`` = number of KV heads is MQA.
Training-free: the paper uptrains after merging, kvlab measures without.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from kvlab.cache.policies.keep_all import KeepAll
from kvlab.kernels.cached_attention import merge_matches_torch

MERGES = ("mean", "first")


@dataclass
class MergedHeadsOptions:
    factor: int = 1
    merge: str = "mean"

    def __post_init__(self) -> None:
        if self.factor < 1:
            raise ValueError(f"cache.options.factor={self.factor} must be >= 1")
        if self.merge not in MERGES:
            raise ValueError(f"cache.options.merge={self.merge!r} is invalid; allowed: {MERGES}")


class MergedHeads(KeepAll):
    name = "merged_heads"
    stores = ("contiguous",)

    @classmethod
    def store_spec(cls, spec, options):
        if spec.num_kv_heads % options.factor:
            raise ValueError(
                f"cache.options.factor={options.factor} must divide the model's "
                f"{spec.num_kv_heads} KV heads"
            )
        return dataclasses.replace(spec, num_kv_heads=spec.num_kv_heads // options.factor)

    @classmethod
    def details(cls, report, spec, model_spec) -> dict[str, int]:
        """What the same tokens take as multi-head attention and as the model's GQA."""
        kept = spec.num_kv_heads
        return {
            "mha_bytes": report.held_bytes * model_spec.num_heads // kept,
            "model_gqa_bytes": report.held_bytes * model_spec.num_kv_heads // kept,
        }

    def attends_as_keep_all(self) -> bool:
        """``factor=1`` merges nothing: its steps are keep_all's, in C where the fused layer
        runs them."""
        return self.options.factor == 1

    def fused_attentions(self, step, store, layers):
        """Merged heads in the fused layer's C call too, the merge before the write, where C
        merges to torch's bits here (probed once per dtype and factor); else in torch."""
        factor, first = self.options.factor, self.options.merge == "first"
        if factor == 1 or not (step.in_place and step.decode):
            return super().fused_attentions(step, store, layers)
        if not merge_matches_torch(self.spec.dtype, factor, first):
            return [None] * len(layers)
        group = self.spec.num_heads // self.spec.num_kv_heads
        where, merge = step.where, (factor, first)
        return store.fused_attentions(where, layers, step.origin, step.end, group, merge=merge)

    def attend(self, step, store, layer, q, k, v, k_raw):
        return super().attend(step, store, layer, q, self._merge(k), self._merge(v), k_raw)

    def _merge(self, x):
        batch, heads, steps, dim = x.shape
        factor = self.options.factor
        grouped = x.view(batch, heads // factor, factor, steps, dim)  # (B, H_kv/f, f, T, D)
        return grouped.mean(dim=2) if self.options.merge == "mean" else grouped[:, :, 0]
