"""The inference engine: prefill (one pass or chunks), then token-by-token decode over any
cache strategy, for a batch of prompts of different lengths, streamed and timed per phase.

The forward steps are gpt-fast's (a model call per token, no framework in between); the
requests' life — admission, preemption on a full cache, retirement, sampling — is the one
engine loop's (:mod:`.loop`), which serving runs too, here in rounds with every request
arriving at once. The engine knows the cache only through its contract.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from kvlab.cache.base import KVCache
from kvlab.engine.clock import WallClock
from kvlab.engine.loop import EngineLoop, GenerationStats, Rounds
from kvlab.engine.runner import LogitsHook, ModelRunner, decode_logits
from kvlab.engine.sampling import SamplingConfig
from kvlab.engine.scheduler import Scheduler
from kvlab.engine.sequence import Request
from kvlab.engine.sequence import Sequence as Seq
from kvlab.models.llama import Decoder
from kvlab.models.packed import StepPart
from kvlab.speculative.config import SpecConfig
from kvlab.speculative.ngram import PromptLookup


@dataclass(frozen=True)
class GenerationConfig:
    """What to generate: up to ``max_new_tokens`` per prompt, stopping at EOS if asked."""

    max_new_tokens: int = 64
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    stop_on_eos: bool = True
    prefill_chunk: int = 0  # 0: the whole prompt in one pass
    spec: SpecConfig = field(default_factory=SpecConfig)  # speculative decoding

    def __post_init__(self) -> None:
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens={self.max_new_tokens} must be >= 1")
        if self.prefill_chunk < 0:
            raise ValueError(f"prefill_chunk={self.prefill_chunk} must be >= 0 (0 = one pass)")


class Generation:
    """A running generation: iterate to get ``{prompt index: token}`` for each token as it
    comes (a speculative step yields one such dict per token position it emitted);
    ``tokens`` and ``stats`` hold the results once it is exhausted.

    The prompts are requests that all arrive at t = 0, served by the engine loop
    (:class:`~kvlab.engine.loop.EngineLoop`) in rounds (:class:`~kvlab.engine.loop.Rounds`):
    every waiting request is prefilled together (one pass, or chunks), then decoded until
    it finishes; a request preempted by a full cache waits for the next round and is
    recomputed."""

    def __init__(
        self,
        engine: Engine,
        prompts: Sequence[Sequence[int]],
        cfg: GenerationConfig,
        contexts: Sequence[int] | None = None,
        on_logits: LogitsHook | None = None,
    ):
        check_prompts(prompts, contexts)
        window = engine.model.config.sliding_window
        longest = max(map(len, prompts)) + cfg.max_new_tokens
        if window and longest > window:
            raise ValueError(
                f"prompt + max_new_tokens = {longest} tokens exceeds the {window}-token "
                "sliding window the model was trained with, which kvlab's decoder does not "
                f"apply; allowed: a total <= {window}"
            )
        draft = speculation_draft(engine, cfg.spec, longest) if cfg.spec.enabled else None
        requests = [Request(i, 0.0, tuple(p), cfg.max_new_tokens) for i, p in enumerate(prompts)]
        self.seqs = [Seq(r) for r in requests]
        eos = engine.eos_ids if cfg.stop_on_eos else frozenset()
        rounds = Rounds(cfg.prefill_chunk, cfg.max_new_tokens, contexts and list(contexts))
        self.loop = EngineLoop(
            engine,
            rounds,
            Scheduler(engine.cache, eos),
            ModelRunner(engine.model, cfg.sampling, on_logits),
            WallClock(engine.device),
            cfg.spec,
            draft,
        )
        self.loop.stats.prompt_tokens = sum(len(p) for p in prompts)
        self.loop.add(self.seqs)

    @property
    def tokens(self) -> list[list[int]]:
        """The tokens generated for each prompt."""
        return [s.output for s in self.seqs]

    @property
    def stats(self) -> GenerationStats:
        return self.loop.stats

    def __iter__(self) -> Iterator[dict[int, int]]:
        while not self.loop.finished:
            emitted = self.loop.step()
            for position in range(max(map(len, emitted.values()), default=0)):
                yield {i: out[position] for i, out in emitted.items() if position < len(out)}


def check_rollback(
    strategy: type[KVCache] | KVCache, options, longest: int, spec: SpecConfig,
    field: str = "cache",
) -> None:  # fmt: skip
    """Refuse, before anything runs, speculation over a strategy (the run's ``cache``, or
    the draft's ``spec.cache``; a built cache, which may hold one per group of layers) whose
    rows of up to ``longest`` tokens cannot roll back the drafts a step rejects."""
    k = spec.num_speculative_tokens
    reason = strategy.speculation_refusal(options, longest, k)
    if reason:
        raise ValueError(
            f"spec.method={spec.method!r} rolls cache rows back by up to {k} rejected drafts "
            f"(spec.num_speculative_tokens) and {field}={strategy.name} cannot: {reason}; "
            "allowed: spec.method=none, or a strategy that rolls back (full, paged, quest, "
            "gqa_shared; int8/int4/int2 and sliding with cache.options.rollback >= k)"
        )


def speculation_draft(engine: Engine, spec: SpecConfig, longest: int) -> Any:
    """What drafts for ``spec`` (the engine's model draft, or prompt lookup), once the
    engine's cache and the draft's are known to roll back rows of ``longest`` tokens."""
    check_rollback(engine.cache, engine.cache.options, longest, spec)
    draft = engine.draft
    if spec.method == "ngram" and draft is None:
        draft = PromptLookup(spec.max_ngram, spec.min_ngram)
    if draft is None:
        raise ValueError(
            f"spec.method={spec.method!r} drafts with a model: build the engine with one "
            "(Engine(..., draft=ModelDraft(model, cache)), kvlab.speculative.drafts)"
        )
    draft.start(longest, spec)
    return draft


def check_prompts(prompts: Sequence[Sequence[int]], contexts: Sequence[int] | None) -> None:
    """Refuse empty prompts and contexts that are not one per prompt within it."""
    if not prompts or any(len(p) == 0 for p in prompts):
        raise ValueError("prompts must be a non-empty list of non-empty token lists")
    if contexts is not None and (
        len(contexts) != len(prompts)
        or any(not 0 < c <= len(p) for c, p in zip(contexts, prompts, strict=True))
    ):
        raise ValueError(
            f"contexts={list(contexts)} is invalid; allowed: one length per prompt, "
            "1 <= context <= the prompt's length"
        )


class Engine:
    """Runs a :class:`Decoder` with one cache strategy instance. ``compile=True`` runs
    every decode step under ``torch.compile`` (inductor on the CPU, CUDA graphs through
    ``mode="reduce-overhead"`` on a GPU) and needs a cache built ``static=True`` (fixed
    shapes from step to step: one graph). ``draft``: what proposes tokens for speculative
    decoding when it is a model (:class:`~kvlab.speculative.drafts.ModelDraft`)."""

    def __init__(
        self,
        model: Decoder,
        cache: KVCache,
        eos_ids: Sequence[int] = (),
        compile: bool = False,
        draft: Any = None,
    ):
        if compile and not cache.static:
            raise ValueError(
                f"engine.compile=True needs a static cache; build it with static=True "
                f"(build_cache({cache.name!r}, spec, options, static=True))"
            )
        self.model, self.cache = model, cache
        self.device = model.embed_tokens.weight.device
        self.eos_ids = frozenset(eos_ids or model.config.eos_token_ids)
        self.compiled, self.draft = compile, draft
        self._decode_layers = compiled_layers(model) if compile else None

    def stream(
        self,
        prompts: Sequence[Sequence[int]],
        cfg: GenerationConfig,
        contexts: Sequence[int] | None = None,
        on_logits: LogitsHook | None = None,
    ) -> Generation:
        """A generation to iterate over, step by step (tokens as they come). ``contexts``:
        how many of each prompt's first tokens are its context (default: all); the rest (a
        question) is prefilled after it, so eviction compresses the context alone
        (kvpress's protocol). ``on_logits(logits, prompts)``: called before each sampling
        with the next-token logits (R, V) and the prompt index of each of the R rows."""
        return Generation(self, prompts, cfg, contexts, on_logits)

    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        cfg: GenerationConfig,
        contexts: Sequence[int] | None = None,
        on_logits: LogitsHook | None = None,
    ) -> Generation:
        """Run a generation to the end; read ``.tokens`` and ``.stats`` (``on_logits``: as
        :meth:`stream`)."""
        run = self.stream(prompts, cfg, contexts, on_logits)
        for _ in run:
            pass
        return run

    @torch.inference_mode()
    def prefill(
        self, seqs: Sequence[Sequence[int]], chunk: int, contexts: Sequence[int] | None = None
    ) -> torch.Tensor:
        """Feed the prompts (in chunks of ``chunk`` tokens, a step ending where each
        context ends); logits (B, V) at each last token."""
        if not self.cache.stores_past:
            return self._forward_whole(seqs)
        lengths = torch.tensor([len(s) for s in seqs], device=self.device)
        ids = self.padded(seqs)  # (B, T)
        cuts = list(contexts or [])  # a given context ends a step; a prompt's end need not
        contexts = cuts or [len(s) for s in seqs]
        last = torch.empty(len(seqs), self.model.config.vocab_size, device=self.device)
        for begin, stop in prefill_spans(ids.shape[1], chunk, cuts):
            piece = ids[:, begin:stop]  # (B, C)
            num_new = [min(max(len(s) - begin, 0), piece.shape[1]) for s in seqs]
            positions = begin + torch.arange(piece.shape[1], device=self.device)
            index = (torch.tensor(num_new, device=self.device) - 1).clamp(min=0)
            ends = [begin < c <= stop for c in contexts]
            logits = self.model(
                piece, positions.expand_as(piece), self.cache, num_new, index, context_end=ends
            )
            ends_here = (lengths > begin) & (lengths <= begin + piece.shape[1])
            last[ends_here] = logits[ends_here]
        return last

    @torch.inference_mode()
    def verify(self, seqs: Sequence[Sequence[int]], drafts: Sequence[Sequence[int]]):
        """One step feeding each sequence's last token (not yet stored) and its drafts;
        logits (B, 1 + most drafts, V): after the last token and after each draft."""
        p = self.verify_part(seqs, drafts)
        return self.model(p.ids, p.positions, self.cache, p.num_new)

    def verify_part(
        self, seqs: Sequence[Sequence[int]], drafts: Sequence[Sequence[int]]
    ) -> StepPart:
        """The running cache's part of a step that feeds each sequence's last token (not
        yet stored) and its drafts (none: a decode step); ids and positions go to the
        device in one copy."""
        width = 1 + max(map(len, drafts), default=0)
        rows = [[s[-1], *d] + [0] * (width - 1 - len(d)) for s, d in zip(seqs, drafts, strict=True)]
        host = torch.tensor([[*r, len(s) - 1] for r, s in zip(rows, seqs, strict=True)])
        table = host.to(self.device)
        positions = table[:, -1:] + torch.arange(width, device=self.device)
        return StepPart(self.cache, table[:, :width], positions, [1 + len(d) for d in drafts])

    @torch.inference_mode()
    def forward_parts(self, parts: list[StepPart]) -> list[torch.Tensor]:
        """One forward over several caches' parts (packed: :mod:`kvlab.models.packed`);
        each part's logits."""
        return self.model.forward_parts(parts)

    @torch.inference_mode()
    def decode_step(self, seqs: Sequence[Sequence[int]]) -> torch.Tensor:
        """One token per sequence; logits (B, V) for the next one. Its ids and positions go
        to the device in one copy; the layers run compiled when the engine compiles."""
        if not self.cache.stores_past:
            return self._forward_whole(seqs)
        return decode_logits(self.model, self.cache, seqs, self._decode_layers)

    def _forward_whole(self, seqs: Sequence[Sequence[int]]) -> torch.Tensor:
        """Recompute every token of every sequence (the no-cache baseline)."""
        ids = self.padded(seqs)  # (B, T)
        positions = torch.arange(ids.shape[1], device=self.device).expand_as(ids)
        index = torch.tensor([len(s) - 1 for s in seqs], device=self.device)
        self.cache.allocate(len(seqs), ids.shape[1])
        return self.model(ids, positions, self.cache, [len(s) for s in seqs], index)

    def padded(self, seqs: Sequence[Sequence[int]]) -> torch.Tensor:
        """Right-padded ids (B, T_max); the padding id is never attended by a real token."""
        width = max(map(len, seqs))
        rows = [list(s) + [0] * (width - len(s)) for s in seqs]
        return torch.tensor(rows, device=self.device)


def prefill_spans(width: int, chunk: int, contexts: Sequence[int]) -> list[tuple[int, int]]:
    """[begin, stop) of each prefill step over ``width`` columns: chunks of ``chunk``, cut
    where a row's context ends too, so a context never shares a step with what follows."""
    cuts = {*range(0, width, chunk), *(c for c in contexts if c < width), width}
    ordered = sorted(cuts)
    return list(zip(ordered[:-1], ordered[1:], strict=True))


RECOMPILE_LIMIT = 64  # graphs of Decoder.logits one process keeps (torch's default: 8)


def compiled_layers(model: Decoder):
    """``model.logits`` under ``torch.compile``: inductor on the CPU, and CUDA graphs
    (``reduce-overhead``) on a GPU, where a decode step is launch-bound. Every engine's
    model and batch shape is a graph of the one ``Decoder.logits`` code object, and past
    torch's limit of 8 dynamo silently runs the rest eagerly (a sweep, a benchmark over
    weight formats and depths, the compile-choice probe): the limit is raised."""
    limit = torch._dynamo.config.recompile_limit
    torch._dynamo.config.recompile_limit = max(limit, RECOMPILE_LIMIT)
    mode = "reduce-overhead" if model.embed_tokens.weight.device.type == "cuda" else None
    return torch.compile(model.logits, mode=mode, dynamic=False)
