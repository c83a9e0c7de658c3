"""The engine's one loop serving requests as they come (``kvlab serve``): the continuous
batching of :mod:`kvlab.serving.server` with the requests arriving from clients instead of
a trace, talking to the callers through a queue in and a callback out. ``kvlab serve``
runs the loop on the main thread (:meth:`OnlineEngine.run`), where the model was loaded,
and the HTTP server beside it; :meth:`OnlineEngine.start` runs it on a thread of its own
(tests, a server embedded in another program). Why the main thread: libgomp keeps one
OpenMP team per thread that has run a parallel region, and while the threads of all teams
outnumber the cores, each team's workers spin only briefly at a barrier before sleeping —
so a loop on a second thread, beside the main thread's idle team, leaves the cores idle
between its many small parallel regions.

Between steps the loop lets in new requests, drops the ones whose client went away (their
rows freed at once, :meth:`Scheduler.cancel`) and answers prompt scoring (``echo`` with
``logprobs``); after each step each request's callback gets the tokens it emitted (with
their log-probabilities where asked) and, when it ends, why.

The callbacks run on the engine's thread: they must hand the event over (an asyncio
server posts it to its loop) and return."""

from __future__ import annotations

import dataclasses
import itertools
import queue
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from kvlab.cache.base import KVCache
from kvlab.config import ServingConfig
from kvlab.engine.clock import WallClock
from kvlab.engine.sampling import SamplingConfig
from kvlab.engine.sequence import Request, Sequence, Status
from kvlab.serving.prometheus import ServerMetrics
from kvlab.serving.server import serving_loop
from kvlab.speculative.config import SpecConfig


@dataclass
class TokenLogprob:
    """A token's log-probability under the model and the ``top`` most likely tokens'."""

    token: int
    logprob: float
    top: list[tuple[int, float]]


@dataclass
class Event:
    """What a request's callback receives: ``tokens`` it emitted in a step (``logprobs``
    beside them where it asked), and on its last event ``finish`` ("stop": an EOS token;
    "length": ``max_new_tokens``; "error", with ``error``)."""

    tokens: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] | None = None
    finish: str | None = None
    error: str | None = None


@dataclass(eq=False)
class Handle:
    """A submitted request: its sequence in the loop and where its events go."""

    seq: Sequence
    on_event: Callable[[Event], None]
    logprobs: int | None = None  # top log-probabilities per generated token (None: none)
    pending: list[torch.Tensor] = field(default_factory=list)  # this step's log-softmaxes


def top_logprobs(row: torch.Tensor, token: int, top: int) -> TokenLogprob:
    """``token``'s log-probability in the log-softmax ``row`` (V,) and the ``top`` best."""
    values, ids = row.topk(top)
    best = list(zip(ids.tolist(), values.tolist(), strict=True))
    return TokenLogprob(token, row[token].item(), best)


class OnlineEngine:
    """``model`` served with ``new_cache``'s strategy under ``serving``'s budget, chunk and
    caps, rows of up to ``capacity`` tokens; requests end at their own EOS ids, else at
    ``eos_ids``; ``spec``: prompt-lookup speculation of the running batch; ``metrics``:
    the server's Prometheus families, kept on the engine's thread. :meth:`run` runs the
    loop on the calling thread, :meth:`start` on a thread of its own; :meth:`submit`,
    :meth:`cancel`, :meth:`score` and :meth:`stop` may be called from any thread."""

    def __init__(
        self,
        model: Any,
        new_cache: Callable[[], KVCache],
        serving: ServingConfig,
        capacity: int,
        eos_ids: frozenset[int] = frozenset(),
        spec: SpecConfig | None = None,
        metrics: ServerMetrics | None = None,
    ):
        self.model, self.new_cache, self.serving = model, new_cache, serving
        self.capacity, self.eos_ids, self.spec = capacity, eos_ids, spec or SpecConfig()
        self.metrics = metrics  # told after every step and every request's end
        self.inbox: queue.Queue = queue.Queue()
        self.handles: dict[int, Handle] = {}
        self.counter = itertools.count()
        self.thread: threading.Thread | None = None  # the loop's, once running
        self._looping = False
        self.steps = 0
        self._build()
        self.idle_free_bytes = self.sched.free_bytes()  # what one request may take at most

    def _build(self) -> None:
        """A fresh cache, scheduler and loop (at start, and after a step failed)."""
        self.clock = WallClock(self.model.embed_tokens.weight.device)
        self.loop = serving_loop(self.model, self.new_cache(), self.serving, self.capacity,
                                 self.clock, self.eos_ids, SamplingConfig(), self.spec,
                                 self._note_logits)  # fmt: skip
        self.sched, self.runner = self.loop.sched, self.loop.runner

    # ---- any thread ----------------------------------------------------------------------
    def request_bytes(self, tokens: int) -> int:
        """Bytes of the budget a request of ``tokens`` tokens reserves."""
        return self.sched.cache.request_bytes(tokens)

    def submit(
        self,
        prompt: list[int],
        max_new_tokens: int,
        on_event: Callable[[Event], None],
        sampling: SamplingConfig | None = None,
        eos_ids: frozenset[int] | None = None,
        logprobs: int | None = None,
    ) -> Handle:
        """Queue a request; its events go to ``on_event`` (on the engine's thread)."""
        request = Request(next(self.counter), 0.0, tuple(prompt), max_new_tokens, sampling, eos_ids)
        handle = Handle(Sequence(request), on_event, logprobs)
        self.inbox.put(("add", handle))
        return handle

    def cancel(self, handle: Handle) -> None:
        """Drop a request (its client went away); its row is freed before the next step."""
        self.inbox.put(("cancel", handle))

    def score(self, prompt: list[int], top: int, on_done: Callable[[Any], None]) -> None:
        """``on_done`` gets the log-probability of each prompt token after the first given
        those before it (a list of :class:`TokenLogprob`, one causal pass over a fresh
        cache of the run's strategy), or an exception."""
        self.inbox.put(("score", (prompt, top, on_done)))

    def start(self) -> None:
        """Run the loop on a thread of its own."""
        self.thread = threading.Thread(target=self.run, name="kvlab-engine", daemon=True)
        self._looping = True  # from now on, not from when the thread first runs
        self.thread.start()

    def stop(self, wait: bool = True) -> None:
        """End the loop (requests still running end with an error event); ``wait``: until
        it has ended (never on the loop's own thread)."""
        self.inbox.put(("stop", None))
        if wait and self.thread not in (None, threading.current_thread()):
            self.thread.join(timeout=30)

    @property
    def alive(self) -> bool:
        """Whether the loop is running (it may be idle, waiting for requests)."""
        return self._looping

    def run(self) -> None:
        """Run the loop on the calling thread until :meth:`stop`; an exception out of it
        (``KeyboardInterrupt``) ends every request still running with an error event."""
        self.thread, self._looping = threading.current_thread(), True
        try:
            self._run()
        finally:
            self._looping = False
            self._fail_all("the server is shutting down")

    def kv_bytes_in_use(self) -> int:
        """Bytes of the budget requests hold now (0 when none runs; a budget that is not
        whole blocks leaves a remainder no request can take, never counted)."""
        return self.idle_free_bytes - self.sched.free_bytes()

    # ---- the engine's thread -------------------------------------------------------------
    def _run(self) -> None:
        while True:
            if not self._drain(block=self.loop.finished):
                return
            if self.loop.finished:
                continue
            for handle in self.handles.values():
                handle.pending.clear()
            try:
                emitted = self.loop.step()
            except Exception as exc:  # nothing a step raises may take the server down
                self._fail_all(f"{type(exc).__name__}: {exc}")
                self._build()
                continue
            self.steps += 1
            self._deliver(emitted)
            if self.metrics is not None:
                self.metrics.step(self)

    def _drain(self, block: bool) -> bool:
        """Take what the inbox holds (waiting for one item when ``block``); False once
        asked to stop."""
        while True:
            try:
                kind, item = self.inbox.get(block=block)
            except queue.Empty:
                return True
            block = False
            if kind == "stop":
                return False
            if kind == "add":
                item.seq.request = dataclasses.replace(item.seq.request, arrival_s=self.clock.now())
                item.seq.times.arrival_s = item.seq.request.arrival_s
                self.handles[item.seq.index] = item
                self.loop.add([item.seq])
            elif kind == "cancel":
                self._cancel(item)
            elif kind == "score":
                self._score(*item)

    def _cancel(self, handle: Handle) -> None:
        if self.handles.pop(handle.seq.index, None) is None:
            return  # already finished
        if handle.seq in self.loop.arrivals:
            self.loop.arrivals.remove(handle.seq)
        else:
            self.sched.cancel(handle.seq)
        self._ended(handle.seq, "abort")

    @torch.inference_mode()
    def _score(self, prompt: list[int], top: int, on_done: Callable[[Any], None]) -> None:
        try:
            device = self.model.embed_tokens.weight.device
            cache = self.new_cache()
            cache.allocate(1, len(prompt))
            ids = torch.tensor([prompt], device=device)
            positions = torch.arange(len(prompt), device=device)[None]
            logits = self.model(ids, positions, cache)[0, :-1].float().log_softmax(-1)
            on_done([top_logprobs(row, t, top) for row, t in zip(logits, prompt[1:], strict=True)])
        except Exception as exc:  # the caller answers with the error, the loop goes on
            on_done(exc)

    def _note_logits(self, logits: torch.Tensor, indices: list[int]) -> None:
        """The runner's hook: keep the log-softmax of the rows whose request wants
        log-probabilities, in order (a speculative step shows one row per kept token)."""
        for row, index in enumerate(indices):
            handle = self.handles.get(index)
            if handle is not None and handle.logprobs is not None:
                handle.pending.append(logits[row].float().log_softmax(-1))

    def _deliver(self, emitted: dict[int, list[int]]) -> None:
        for index, tokens in emitted.items():
            handle = self.handles.get(index)
            if handle is None:
                continue
            event = Event(tokens)
            if handle.logprobs is not None:
                rows = handle.pending[: len(tokens)]  # a step's end may cut the kept drafts
                event.logprobs = [
                    top_logprobs(row, t, handle.logprobs)
                    for row, t in zip(rows, tokens, strict=True)
                ]
            if handle.seq.status is Status.FINISHED:
                seq = handle.seq
                event.finish = "length" if len(seq.output) >= seq.request.max_new_tokens else "stop"
                self.handles.pop(index)
                self._ended(seq, event.finish)
            handle.on_event(event)

    def _ended(self, seq: Sequence, reason: str) -> None:
        self.runner.forget(seq)
        if self.metrics is not None:
            self.metrics.finished(seq.times, len(seq.request.prompt), reason)

    def _fail_all(self, why: str) -> None:
        for handle in list(self.handles.values()):
            handle.on_event(Event(finish="error", error=why))
        self.handles.clear()
        self.loop.arrivals.clear()
