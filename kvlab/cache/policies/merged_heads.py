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
from kvlab.cache.rows import merge_heads

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

    def plan(self, info, lengths, store, static):
        """keep_all's plan; a decode step's keys and values are merged before the write
        (``reads.merge``: in C too, in the fused decode layer, where C merges to torch's
        bits)."""
        step = super().plan(info, lengths, store, static)
        if step.reads is not None and self.options.factor > 1:
            step.reads.merge = (self.options.factor, self.options.merge == "first")
        return step

    def attend_steps(self, step, store, layer, q, k, v, k_raw):
        merge = (self.options.factor, self.options.merge == "first")
        k, v = merge_heads(k, *merge), merge_heads(v, *merge)
        return super().attend_steps(step, store, layer, q, k, v, k_raw)
