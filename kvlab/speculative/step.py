"""The engine loop's decode step with speculation: every running row drafts, the model
verifies all drafts in one multi-token step, each row keeps what the rule accepts
(:mod:`.accept`) and its cache row is rolled back to it (``KVCache.truncate``). A step in
which no row drafts is a plain decode step."""

from __future__ import annotations

from typing import Any

import torch

from kvlab.speculative.ngram import propose


def speculative_decode(loop: Any) -> dict[int, list[int]]:
    """One speculative step of ``loop``'s running batch (an
    :class:`~kvlab.engine.loop.EngineLoop`); the tokens each request emitted."""
    if not loop.sched.running:
        return {}
    (logits, drafts), seconds = loop.forward(lambda: verify(loop))
    running, stats = loop.sched.running, loop.stats
    emitted = loop.runner.accept(logits, running, drafts)
    loop.engine.cache.truncate(
        [len(s.tokens) + len(e) - 1 for s, e in zip(running, emitted, strict=True)]
    )
    t = loop.clock.mark()
    stats.step_s.append(seconds)
    stats.step_rows.append(len(running))
    stats.drafted += sum(map(len, drafts))
    stats.accepted += sum(len(e) - 1 for e in emitted)
    out = {}
    for seq, tokens in zip(running, emitted, strict=True):
        out[seq.index] = []
        for token in tokens:
            if not seq.done(loop.sched.eos_ids):
                seq.emit(token, t)
                out[seq.index].append(token)
        seq.computed = len(seq.tokens) - 1  # its newest token is fed by the next step
    stats.step_tokens.append(sum(map(len, out.values())))
    return out


def verify(loop: Any) -> tuple[torch.Tensor, list[list[int]]]:
    """Each running row's drafts, within what is left to generate and what its cache row
    has room for, and the model's logits (B, 1 + most drafts, V) after its last token and
    after each draft."""
    running, spec = loop.sched.running, loop.spec
    room = loop.room - max(len(s.tokens) for s in running)  # after the newest token
    drafts = []
    for seq in running:
        left = seq.request.max_new_tokens - len(seq.output) - 1
        limit = min(spec.num_speculative_tokens, left, room)
        drafts.append(propose(seq.tokens, limit, spec.max_ngram, spec.min_ngram))
    seqs = [s.tokens for s in running]
    if not any(drafts):
        return loop.engine.decode_step(seqs)[:, None], drafts
    return loop.engine.verify(seqs, drafts), drafts
