"""One request's state while it is served (nano-vllm's ``Sequence``): its tokens, how many
of them its cache row holds, where it is in its life, and its clock readings."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from kvlab.engine.sampling import SamplingConfig


class Status(enum.Enum):
    WAITING = "waiting"  # arrived, not admitted (or preempted: to be recomputed)
    PREFILL = "prefill"  # admitted: its tokens are being fed, a chunk per step
    READY = "ready"  # fed: waits for the rest of its group to join the running batch
    RUNNING = "running"  # in the running batch: one token per step
    FINISHED = "finished"  # done, or cancelled (a client went away)


@dataclass(frozen=True)
class Request:
    """One request: its index, arrival time (seconds from the trace's start), prompt token
    ids (the shared prefix included) and how many tokens to generate; a server's request
    may bring its own ``sampling`` (None: the run's) and the tokens that end it
    (``eos_ids``; None: the run's EOS ids, an empty set: none, vLLM's ``ignore_eos``)."""

    index: int
    arrival_s: float
    prompt: tuple[int, ...]
    max_new_tokens: int
    sampling: SamplingConfig | None = None
    eos_ids: frozenset[int] | None = None


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
        """Out of budget, or ended by an EOS token: the request's own (``Request.eos_ids``),
        else ``eos_ids`` (the run's)."""
        if len(self.output) >= self.request.max_new_tokens:
            return True
        ends = eos_ids if self.request.eos_ids is None else self.request.eos_ids
        return bool(self.output) and self.output[-1] in ends
