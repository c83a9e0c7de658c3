"""One request's state while it is served (nano-vllm's ``Sequence``): its tokens, how many
of them its cache row holds, where it is in its life, and its clock readings."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field


class Status(enum.Enum):
    WAITING = "waiting"  # arrived, not admitted (or preempted: to be recomputed)
    PREFILL = "prefill"  # admitted: its tokens are being fed, a chunk per step
    READY = "ready"  # fed: waits for the rest of its group to join the running batch
    RUNNING = "running"  # in the running batch: one token per step
    FINISHED = "finished"


@dataclass(frozen=True)
class Request:
    """One request: its index, arrival time (seconds from the trace's start), prompt token
    ids (the shared prefix included) and how many tokens to generate."""

    index: int
    arrival_s: float
    prompt: tuple[int, ...]
    max_new_tokens: int


@dataclass
class RequestTimes:
    """One request's clock readings: arrival, admission (its first prefill step) and the
    time each of its output tokens was produced."""

    arrival_s: float
    admitted_s: float | None = None
    token_s: list[float] = field(default_factory=list)

    @property
    def finished_s(self) -> float:
        return self.token_s[-1]


@dataclass
class Sequence:
    """``tokens``: prompt then output; ``computed``: how many of them the cache row holds
    (a preempted sequence drops to 0 and feeds prompt + output again); ``cached``: prompt
    tokens it found stored already (prefix caching) at its last admission."""

    request: Request
    tokens: list[int] = field(default_factory=list)
    output: list[int] = field(default_factory=list)
    computed: int = 0
    cached: int = 0
    status: Status = Status.WAITING
    times: RequestTimes = field(init=False)

    def __post_init__(self) -> None:
        self.tokens = list(self.request.prompt)
        self.times = RequestTimes(self.request.arrival_s)

    @property
    def index(self) -> int:
        return self.request.index

    @property
    def to_feed(self) -> int:
        """Tokens not yet in the cache (the whole sequence after a preemption)."""
        return len(self.tokens) - self.computed

    def emit(self, token: int, clock_s: float) -> None:
        self.tokens.append(token)
        self.output.append(token)
        self.times.token_s.append(clock_s)

    def done(self, eos_ids: frozenset[int]) -> bool:
        """Out of budget, or (when ``eos_ids`` is not empty) ended by an EOS token."""
        if len(self.output) >= self.request.max_new_tokens:
            return True
        return bool(self.output) and self.output[-1] in eos_ids
