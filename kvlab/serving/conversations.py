"""Multi-turn conversations served under a KV budget (``workload.serving.conversation``):
several conversations, each a document and a few questions about it (SCBench's shared
context, arXiv 2412.10319), interleaved on the engine's one loop. A turn's prompt is the
conversation so far — document, earlier questions and the answers the model gave, its
question — and it arrives ``think_s`` after the previous answer ended, so whether its
prefix is still stored (the pool, a slow tier) or must be recomputed is what the budget,
the store and its tiers decide. Reported per turn: TTFT, prompt tokens found stored and
recomputed; per tier: blocks found, bytes written and read back."""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field
from typing import Any

from kvlab.cache.base import KVCache
from kvlab.config import ConversationConfig, ServingConfig
from kvlab.engine.sampling import SamplingConfig
from kvlab.engine.sequence import Request, Sequence, Status
from kvlab.serving.metrics import serving_metrics
from kvlab.serving.server import check_serves, serving_loop


@dataclass
class Conversation:
    """A document, the questions asked about it in turn, and when the first is asked."""

    document: list[int]
    questions: list[list[int]]
    start_s: float


@dataclass
class Turn:
    conversation: int
    turn: int
    seq: Sequence


@dataclass
class ConversationsResult:
    turns: list[Turn] = field(default_factory=list)
    tiers: dict[str, int] = field(default_factory=dict)  # the store's tier lines
    preemptions: int = 0

    def metrics(self) -> dict[str, Any]:
        """vLLM's serving metrics over every turn, then per turn index: TTFT p50 and mean
        (ms), prompt tokens, those found stored and those recomputed; and the tiers'."""
        out: dict[str, Any] = serving_metrics([t.seq.times for t in self.turns])
        out["preemptions"] = self.preemptions
        for index in sorted({t.turn for t in self.turns}):
            seqs = [t.seq for t in self.turns if t.turn == index]
            ttft = [1e3 * (s.times.token_s[0] - s.times.arrival_s) for s in seqs]
            prompt = sum(len(s.request.prompt) for s in seqs)
            found = sum(s.cached for s in seqs)
            out |= {
                f"turn{index + 1}/ttft_p50_ms": statistics.median(ttft),
                f"turn{index + 1}/ttft_mean_ms": statistics.fmean(ttft),
                f"turn{index + 1}/prompt_tokens": prompt,
                f"turn{index + 1}/reused_tokens": found,
                f"turn{index + 1}/recomputed_tokens": prompt - found,
            }
        later = [t.seq for t in self.turns if t.turn > 0]
        if later:
            ttft = [1e3 * (s.times.token_s[0] - s.times.arrival_s) for s in later]
            out["later_turns/ttft_p50_ms"] = statistics.median(ttft)
            out["later_turns/ttft_mean_ms"] = statistics.fmean(ttft)
        return out | {f"tier/{k}": v for k, v in self.tiers.items()}


def build_conversations(tokenizer: Any, text: str, cfg: ServingConfig) -> list[Conversation]:
    """``cfg.num_requests`` conversations over consecutive windows of ``text``: each its
    own document, then its questions; started all at once (rate 0) or ``1 / rate`` apart."""
    from kvlab.workload import text_windows

    c = cfg.conversation
    count = cfg.num_requests
    needed = c.document_len + c.turns * c.question_len
    windows = text_windows(tokenizer, text, needed, count)
    out = []
    for i, ids in enumerate(windows):
        questions = [
            ids[c.document_len + t * c.question_len : c.document_len + (t + 1) * c.question_len]
            for t in range(c.turns)
        ]
        start = i / cfg.rate if cfg.rate else 0.0
        out.append(Conversation(ids[: c.document_len], questions, start))
    return out


def serve_conversations(
    model: Any,
    cache: KVCache,
    conversations: list[Conversation],
    cfg: ServingConfig,
    clock: Any,
    eos_ids: frozenset[int] = frozenset(),
    sampling: SamplingConfig | None = None,
) -> ConversationsResult:
    """Every turn of ``conversations`` served on ``cache`` (a fresh instance, made to serve
    here) under ``cfg``'s budget, each answer ``cfg.conversation.answer_len`` tokens (or up
    to an EOS id of ``eos_ids``), the next turn arriving ``think_s`` after it ended."""
    check_serves(cache)
    talk: ConversationConfig = cfg.conversation
    capacity = max(len(c.document) for c in conversations) + talk.turns * (
        talk.question_len + talk.answer_len
    )
    loop = serving_loop(model, cache, cfg, capacity, clock, eos_ids, sampling)
    result, open_turns = ConversationsResult(), []

    def ask(conversation: int, turn: int, history: list[int], at: float) -> None:
        c = conversations[conversation]
        prompt = tuple(history + c.questions[turn])
        request = Request(len(result.turns), at, prompt, talk.answer_len)
        seq = Sequence(request)
        result.turns.append(Turn(conversation, turn, seq))
        open_turns.append(result.turns[-1])
        loop.add([seq])

    for i, c in enumerate(conversations):
        if talk.turns:
            ask(i, 0, list(c.document), c.start_s)
    while not loop.finished:
        loop.step()
        for turn in [t for t in open_turns if t.seq.status is Status.FINISHED]:
            open_turns.remove(turn)
            if turn.turn + 1 < talk.turns:
                history = list(turn.seq.request.prompt) + turn.seq.output
                ask(turn.conversation, turn.turn + 1, history, clock.now() + talk.think_s)
    result.preemptions = loop.sched.preemptions
    result.tiers = tier_traffic(cache)
    return result


def tier_traffic(cache: KVCache) -> dict[str, int]:
    """Blocks a block store's prompts found in its pool and in its slow tier, and the bytes
    that went to the slow tier and came back (empty for a store of rows)."""
    store = getattr(cache, "store", None)
    pool = getattr(store, "pool", None)
    if pool is None:
        return {}
    lines = getattr(store, "tier_lines", None)
    return {"fast_hit_blocks": pool.hits} | (lines() if lines is not None else {})
