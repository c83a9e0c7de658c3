"""The engine loop's decode step with speculation: every running row drafts (the loop's
draft: prompt lookup or a draft model), the model verifies all drafts in one multi-token
step, each row keeps what the rule accepts (:mod:`.accept`), and its cache row — and the
draft's — is rolled back to it (``KVCache.truncate``). A step in which no row drafts is a
plain decode step. Its time, drafting included, is the step's."""

from __future__ import annotations

from typing import Any

import torch

from kvlab.engine.timing import now


def speculative_decode(loop: Any) -> dict[int, list[int]]:
    """One speculative step of ``loop``'s running batch (an
    :class:`~kvlab.engine.loop.EngineLoop`); the tokens each request emitted."""
    running = loop.sched.running
    if not running:
        return {}
    began = now(loop.engine.device)
    proposed = dict(zip([s.index for s in running], draft_tokens(loop), strict=True))
    drafting_s = now(loop.engine.device) - began
    (logits, drafts), seconds = loop.forward(lambda: verify(loop, proposed))
    running, stats = loop.sched.running, loop.stats  # a preemption may have left fewer
    emitted = loop.runner.accept(logits, running, drafts)
    kept = [len(s.tokens) + len(e) - 1 for s, e in zip(running, emitted, strict=True)]
    loop.engine.cache.truncate(kept)
    loop.draft.accepted(running, kept)
    stats.draft_s.append(drafting_s)
    stats.verify_s.append(seconds)
    stats.drafted += sum(map(len, drafts))
    stats.accepted += sum(len(e) - 1 for e in emitted)
    return loop.commit_decode(emitted, drafting_s + seconds)


def draft_tokens(loop: Any) -> list[list[int]]:
    """Each running row's drafts, within what is left to generate and what its cache row
    has room for."""
    running, k = loop.sched.running, loop.spec.num_speculative_tokens
    room = loop.room - max(len(s.tokens) for s in running)  # after the newest token
    limits = [min(k, s.request.max_new_tokens - len(s.output) - 1, room) for s in running]
    return loop.draft.propose(running, limits, loop.room)


def verify(loop: Any, proposed: dict[int, list[int]]) -> tuple[torch.Tensor, list[list[int]]]:
    """The running rows' drafts and the model's logits (B, 1 + most drafts, V) after each
    row's last token and after each of its drafts."""
    seqs = [s.tokens for s in loop.sched.running]
    drafts = [proposed[s.index] for s in loop.sched.running]
    if not any(drafts):
        return loop.engine.decode_step(seqs)[:, None], drafts
    return loop.engine.verify(seqs, drafts), drafts
