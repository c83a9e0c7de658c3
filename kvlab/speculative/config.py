"""``spec``: which draft proposes tokens and how many (``conf/spec/<method>.yaml``)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

METHODS = ("none", "ngram", "self", "layerskip", "model")


@dataclass
class SpecConfig:
    """``method``: ``none`` (plain decoding); ``ngram`` (prompt lookup: the continuation
    of the latest earlier occurrence of the context's last ``max_ngram`` .. ``min_ngram``
    tokens, HF's ``prompt_lookup_num_tokens`` and vLLM's ``ngram`` proposer); ``self`` (the
    run's model made cheap: weights through ``quant`` with ``quant_options``, QuantSpec's
    idea); ``layerskip`` (the run's model exiting after its first ``layers`` layers, no
    training); ``model`` (the checkpoint ``model``). A model draft keeps its own KV cache,
    strategy ``cache`` with ``cache_options``, and drafts greedily.
    ``num_speculative_tokens``: the most tokens a row drafts per step (k)."""

    method: str = "none"
    num_speculative_tokens: int = 4
    max_ngram: int = 3
    min_ngram: int = 1
    quant: str = "none"
    quant_options: dict[str, Any] = field(default_factory=dict)
    layers: int = 0
    model: str = ""
    cache: str = "full"
    cache_options: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ValueError(f"spec.method={self.method!r} is invalid; allowed: {METHODS}")
        if self.num_speculative_tokens < 1:
            raise ValueError(
                f"spec.num_speculative_tokens={self.num_speculative_tokens} must be >= 1"
            )
        if not 1 <= self.min_ngram <= self.max_ngram:
            raise ValueError(
                f"spec.min_ngram={self.min_ngram}, spec.max_ngram={self.max_ngram} are "
                "invalid; allowed: 1 <= min_ngram <= max_ngram"
            )
        if (self.method == "layerskip") != (self.layers > 0):
            raise ValueError(
                f"spec.layers={self.layers} with spec.method={self.method!r} is invalid; "
                "allowed: layers >= 1 (the exit layer) with layerskip, 0 otherwise"
            )
        self._check_draft_choices()
        if self.quant != "none" and self.method not in ("self", "model"):
            raise ValueError(
                f"spec.quant={self.quant!r} with spec.method={self.method!r} is invalid; "
                "allowed: a weight quantizer with method=self or model, none otherwise (an "
                "early exit shares the model's weights)"
            )
        if (self.method == "model") != bool(self.model):
            raise ValueError(
                f"spec.model={self.model!r} with spec.method={self.method!r} is invalid; "
                "allowed: a checkpoint (directory, GGUF file or known name) with method=model, "
                "'' otherwise"
            )

    def _check_draft_choices(self) -> None:
        """The draft's quantizer and cache strategy exist and take their options (each
        registry names the bad field, value and what is allowed)."""
        from kvlab.cache.base import cache_options
        from kvlab.quant import quant_options

        for key, check, name, options in (
            ("spec.quant", quant_options, self.quant, self.quant_options),
            ("spec.cache", cache_options, self.cache, self.cache_options),
        ):
            try:
                check(name, options)
            except ValueError as exc:
                raise ValueError(f"{key}={name!r} (the draft's): {exc}") from None

    @property
    def enabled(self) -> bool:
        return self.method != "none"

    @property
    def drafts_with_a_model(self) -> bool:
        return self.method in ("self", "layerskip", "model")
