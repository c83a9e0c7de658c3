"""The engine loop's decode step with speculation: every running row drafts (the loop's
draft: prompt lookup or a draft model; :func:`propose`), the model verifies all drafts in
the step's one forward (:meth:`Engine.verify`, or its part of a packed step), each row keeps
what the rule accepts (:mod:`.accept`), and its cache row — and the draft's — is rolled
back to it (``KVCache.truncate``; :func:`settle`). A step in which no row drafts is a plain
decode step. Its time, drafting included, is the step's."""

from __future__ import annotations

from typing import Any

import torch


def propose(loop: Any) -> dict[int, list[int]]:
    """Each running request's drafts (by request index), within what is left to generate
    and what its cache row has room for."""
    running, k = loop.sched.running, loop.spec.num_speculative_tokens
    room = loop.room - max(len(s.tokens) for s in running)  # after the newest token
    limits = [min(k, s.request.max_new_tokens - len(s.output) - 1, room) for s in running]
    drafts = loop.draft.propose(running, limits, loop.room)
    return dict(zip([s.index for s in running], drafts, strict=True))


def settle(
    loop: Any,
    logits: torch.Tensor,
    running: list,
    drafts: list[list[int]],
    drafting_s: float,
    seconds: float,
    t: float,
) -> dict[int, list[int]]:
    """After the verification forward of ``seconds``, ended at clock time ``t`` (``logits``
    (B, 1 + most drafts, V) after each ``running`` request's last token and each of its
    ``drafts``): each keeps what the rule accepts, its cache row (and the draft's) rolled
    back to it; the tokens each request emitted."""
    stats = loop.stats
    emitted = loop.runner.accept(logits, running, drafts)
    kept = [len(s.tokens) + len(e) - 1 for s, e in zip(running, emitted, strict=True)]
    loop.engine.cache.truncate(kept)
    loop.draft.accepted(running, kept)
    stats.draft_s.append(drafting_s)
    stats.verify_s.append(seconds)
    stats.drafted += sum(map(len, drafts))
    stats.accepted += sum(len(e) - 1 for e in emitted)
    return loop.commit_decode(emitted, drafting_s + seconds, t)
