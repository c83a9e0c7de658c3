"""What an eviction cache can roll back (speculative decoding's rejected drafts): the
tokens that came after a row's compression — decode and later steps append every head's
tokens in order, so they are each head's newest — never tokens a compression chose among,
and nothing under decode-time compression, which chooses among every token."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

DECODE_TIME = "decode-time compression chooses among every token, rejected ones included"


class Sealed:
    """``rows[b]``: tokens row b held when its context was compressed (0: not yet)."""

    def __init__(self, batch_size: int):
        self.rows = [0] * batch_size

    def row_state(self) -> list:
        return [(vars(self), "rows", None)]

    def note(self, step: Any) -> None:
        """After a step: rows whose context ended in it were compressed at its end."""
        if any(step.seal):  # host lengths once per compression
            ends = step.end.tolist()
            self.rows = [e if s else n for e, s, n in zip(ends, step.seal, self.rows, strict=True)]

    def check(self, lengths: Sequence[int], kept: Sequence[int], decode_time: bool) -> None:
        """Refuse a rollback into what a compression chose among (or any, decode-time)."""
        if decode_time or any(n < s for n, s in zip(kept, self.rows, strict=True)):
            why = DECODE_TIME if decode_time else f"rows were compressed at {self.rows}"
            raise ValueError(
                f"cannot roll back a ragged store from {list(lengths)} to {list(kept)} tokens: "
                f"what each head kept was chosen with the tokens to drop present ({why}); "
                "allowed: a rollback to lengths no shorter than the compression's"
            )
