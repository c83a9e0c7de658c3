"""``spec``: which draft proposes tokens and how many (``conf/spec/<method>.yaml``)."""

from __future__ import annotations

from dataclasses import dataclass

METHODS = ("none", "ngram")


@dataclass
class SpecConfig:
    """``method``: ``none`` (plain decoding) or ``ngram`` (prompt lookup: the continuation
    of the latest earlier occurrence of the context's last ``max_ngram`` .. ``min_ngram``
    tokens, HF's ``prompt_lookup_num_tokens`` and vLLM's ``ngram`` proposer);
    ``num_speculative_tokens``: the most tokens a row drafts per step (k)."""

    method: str = "none"
    num_speculative_tokens: int = 4
    max_ngram: int = 3
    min_ngram: int = 1

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

    @property
    def enabled(self) -> bool:
        return self.method != "none"
