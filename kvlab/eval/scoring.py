"""Log-likelihood of continuations given contexts, with the cache strategy in the loop:
the contexts are prefilled into the cache (in chunks when asked), then the continuations
are fed as one more step that attends to what the cache kept. With an exact strategy this
equals one causal pass over context + continuation (the lm-eval ``hf`` backend's way).

:func:`scored_batches` scores many requests: each distinct context is prefilled once and
every continuation of it continues a copy of its rows (:meth:`KVCache.fork`), so the four
endings of a HellaSwag item cost one context prefill, not four."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence

import torch

from kvlab.cache.base import KVCache
from kvlab.engine.generate import Engine
from kvlab.models.llama import Decoder

Tokens = Sequence[int]
Score = tuple[float, bool]  # (sum of log p(continuation | context), greedy would produce it)
WINDOW_BATCHES = 4  # contexts prefilled before their continuations are sorted and scored
WINDOW_TOKENS = 2**15  # and at most this many tokens of cache (rows x capacity) at once


@torch.inference_mode()
def continuation_logprobs(
    model: Decoder, cache: KVCache, contexts: Sequence[Tokens], continuations: Sequence[Tokens],
    chunk: int = 0,
) -> list[Score]:  # fmt: skip
    """Per pair: (sum of log p(continuation | context), whether greedy decoding would have
    produced the continuation). Contexts and continuations must be non-empty."""
    _check(contexts, continuations)
    if not cache.stores_past:  # nothing kept between calls: one pass over everything
        return _scores(_one_pass(model, cache, contexts, continuations), len(contexts))
    first = _prefill(model, cache, contexts, max(map(len, continuations)), chunk)
    starts = [len(c) for c in contexts]
    scores = _scores(_predictions(model, cache, first, starts, continuations), len(contexts))
    cache.free(list(range(len(contexts))))
    return scores


@torch.inference_mode()
def scored_batches(
    model: Decoder, new_cache: Callable[[], KVCache], contexts: Sequence[Tokens],
    continuations: Sequence[Tokens], batch_size: int, chunk: int = 0, max_tokens: int = 0,
) -> Iterator[tuple[list[int], list[Score]]]:  # fmt: skip
    """Score every pair, a batch at a time: (the pairs' indices, their scores). A batch
    holds at most ``batch_size`` rows and, when ``max_tokens`` > 0, at most ``max_tokens``
    padded tokens. Each distinct context is prefilled once, its continuations continue
    copies of its rows; the continuations of a window of ``WINDOW_BATCHES`` batches of
    contexts are sorted together, longest first (less padding). A cache that cannot copy
    rows re-prefills the context per pair (batches of similar total length, longest
    first)."""
    _check(contexts, continuations)
    probe = new_cache()
    if not (probe.stores_past and probe.forks):
        total = lambda i: len(contexts[i]) + len(continuations[i])  # noqa: E731
        order = sorted(range(len(contexts)), key=lambda i: -total(i))
        for batch in length_batches(order, total, batch_size, max_tokens):
            pairs = [contexts[i] for i in batch], [continuations[i] for i in batch]
            yield batch, continuation_logprobs(model, new_cache(), *pairs, chunk=chunk)
        return
    groups: dict[tuple[int, ...], list[int]] = {}
    for i, context in enumerate(contexts):
        groups.setdefault(tuple(context), []).append(i)
    widest = max(map(len, continuations))
    rows = WINDOW_BATCHES * batch_size  # a window's continuations are sorted together
    distinct = sorted(groups, key=len, reverse=True)
    for window in length_batches(distinct, lambda c: len(c) + widest, rows, WINDOW_TOKENS):
        members = [(row, i) for row, context in enumerate(window) for i in groups[context]]
        members.sort(key=lambda member: -len(continuations[member[1]]))
        yield from _continue_window(
            model, new_cache(), window, members, continuations, (batch_size, max_tokens), chunk
        )


def _continue_window(model, cache, window, members, continuations, limits, chunk):
    """Prefill the ``window``'s contexts once (batches of ``limits``, joined into one
    cache), then score ``members`` ((context row, pair index), longest continuation
    first) in batches of copies of those rows."""
    capacity = _capacity(len(window[0]), len(continuations[members[0][1]]), chunk)
    cache.allocate(0, capacity)
    firsts = []
    for shared in length_batches(window, len, *limits):
        part = cache.spawn()
        part.allocate(len(shared), capacity)
        firsts.append(Engine(model, part).prefill(shared, chunk or len(shared[0])))
        cache.join(part)
    first = torch.cat(firsts)  # (C, V)
    width_of = lambda member: len(continuations[member[1]])  # noqa: E731
    for batch in length_batches(members, width_of, *limits):
        rows, pairs = [row for row, _ in batch], [i for _, i in batch]
        wanted = [continuations[i] for i in pairs]
        starts = [len(window[row]) for row in rows]
        pieces = _predictions(model, cache.fork(rows), first[rows], starts, wanted)
        yield pairs, _scores(pieces, len(batch))
    cache.free(list(range(len(window))))


def _prefill(model, cache, contexts, width: int, chunk: int) -> torch.Tensor:
    """Allocate rows for the contexts and continuations of up to ``width`` tokens, prefill
    the contexts (in chunks of ``chunk``; 0: one step); logits (B, V) at each last token."""
    longest = max(map(len, contexts))
    cache.allocate(len(contexts), _capacity(longest, width, chunk))
    return Engine(model, cache).prefill(contexts, chunk or longest)


def _capacity(longest_context: int, width: int, chunk: int) -> int:
    """Tokens a row needs: its context in whole chunks of ``chunk`` (0: one step; rows
    write whole chunks) and a continuation of up to ``width`` tokens but its last."""
    step = chunk or longest_context
    return -(-longest_context // step) * step + max(width - 1, 1)


def length_batches(
    items: Sequence, length: Callable, size: int, max_tokens: int = 0
) -> Iterator[list]:
    """Consecutive batches of ``items`` (sorted longest first) of at most ``size`` items
    and, when ``max_tokens`` > 0, at most ``max_tokens`` tokens once padded to the first
    (longest) item of the batch; an item longer than ``max_tokens`` goes alone."""
    batch: list = []
    for item in items:
        if batch and (len(batch) == size or 0 < max_tokens < length(batch[0]) * (len(batch) + 1)):
            yield batch
            batch = []
        batch.append(item)
    if batch:
        yield batch


def _check(contexts: Sequence[Tokens], continuations: Sequence[Tokens]) -> None:
    if any(not c for c in contexts) or any(not c for c in continuations):
        raise ValueError("every context and continuation needs at least one token")


Piece = tuple[torch.Tensor, torch.Tensor, torch.Tensor]  # logits (M, V), targets, rows (M,)


def _scores(pieces: list[Piece], batch: int) -> list[Score]:
    """Per row of the batch: the summed log-probabilities of its targets and whether each
    was the argmax, over ``pieces`` of predictions (a row's may lie in several pieces)."""
    device = pieces[0][0].device
    total = torch.zeros(batch, dtype=torch.float64, device=device)
    missed = torch.zeros(batch, dtype=torch.long, device=device)
    for logits, targets, rows in pieces:
        chosen = logits.gather(-1, targets[:, None])[:, 0]
        total.index_add_(0, rows, (chosen - logits.logsumexp(-1)).double())
        missed.index_add_(0, rows, (logits.argmax(-1) != targets).long())
    return [(t, m == 0) for t, m in zip(total.tolist(), missed.tolist(), strict=True)]


def _one_pass(model, cache, contexts, continuations) -> list[Piece]:
    """Context + continuation (but its last token) as one causal pass; the logits of the
    positions that predict continuation tokens, row by row."""
    engine = Engine(model, cache)
    seqs = [list(c) + list(x[:-1]) for c, x in zip(contexts, continuations, strict=True)]
    ids = engine.padded(seqs)  # (B, T)
    columns = torch.arange(ids.shape[1], device=engine.device)
    positions = columns.expand_as(ids)
    first = torch.tensor([len(c) - 1 for c in contexts], device=engine.device)[:, None]
    ends = torch.tensor([len(s) for s in seqs], device=engine.device)[:, None]
    marked = (columns >= first) & (columns < ends)
    cache.allocate(len(seqs), ids.shape[1])
    logits = model(ids, positions, cache, [len(s) for s in seqs], marked)  # (N, V)
    return [(logits, *_targets(continuations, engine.device))]


def _predictions(model, cache, first, starts, continuations) -> list[Piece]:
    """``first`` (B, V) predicts each continuation's first token; the continuations but
    their last token (nothing it predicts is scored, so a pair of n tokens takes n - 1
    positions, as the ``hf`` backend's window) are fed as one step from ``starts``, and
    only their real positions are projected to the vocabulary."""
    device = first.device
    heads = torch.tensor([x[0] for x in continuations], device=device)
    pieces = [(first, heads, torch.arange(len(continuations), device=device))]
    fed = [list(x[:-1]) for x in continuations]  # the tokens that predict the next ones
    if max(map(len, fed)) == 0:
        return pieces
    engine = Engine(model, cache)
    ids = engine.padded([f or [0] for f in fed])  # (B, width - 1)
    columns = torch.arange(ids.shape[1], device=device)
    positions = torch.tensor(starts, device=device)[:, None] + columns  # (B, Tc - 1)
    marked = columns < torch.tensor([len(f) for f in fed], device=device)[:, None]
    rest = model(ids, positions, cache, [len(f) for f in fed], marked)  # (N, V)
    return [*pieces, (rest, *_targets([x[1:] for x in continuations], device))]


def _targets(tokens: Sequence[Tokens], device) -> tuple[torch.Tensor, torch.Tensor]:
    """Every row's tokens in a row, and the row each came from."""
    flat = torch.tensor([t for row in tokens for t in row], device=device)
    rows = torch.tensor([b for b, row in enumerate(tokens) for _ in row], device=device)
    return flat, rows
