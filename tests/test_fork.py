"""Copying rows (``KVCache.fork``, lm-eval's endings that share a context): a forked row
continues exactly as a row that was fed the same tokens itself, in every strategy that
can copy rows (lossy settings, so the quantizer's ring, the window's ring and the pooled
entries are all mid-stream); the others refuse with the reason."""

from __future__ import annotations

import pytest
import torch
from test_cache_contract import LOSSY, TOLERANCE, prompts

from kvlab.cache import CacheSpec, build_cache, registered

# A strategy forks where it says it can (KVCache.forks: its store copies rows); the others
# refuse (paged, quest, evict: shared pool blocks; packed per-head runs).
SPEC = CacheSpec(2, 4, 2, 16, torch.float32, torch.device("cpu"))
STORING = sorted(n for n, c in registered().items() if c.stores_past)
FORKS = {n for n in STORING if build_cache(n, SPEC, LOSSY[n]).forks}
REFUSED = set(STORING) - FORKS


def test_the_built_in_strategies_fork_or_refuse_as_their_stores_hold_rows():
    assert {"full", "sliding", "gqa_shared", "compressed", "int8", "int4", "int2"} <= FORKS
    assert {"paged", "quest", "evict"} <= REFUSED


def _fed(model, cache, then: list[list[int]]) -> torch.Tensor:
    """Feed each row's ``then`` tokens (a multi-token step), then one decode step; the
    logits of both steps (B, T + 1, V)."""
    with torch.inference_mode():
        ids = torch.tensor(then)
        starts = torch.tensor(cache.lengths)[:, None]
        steps = model(ids, starts + torch.arange(ids.shape[1]), cache)
        last = ids[:, -1:]
        decode = model(last, starts + ids.shape[1], cache)
    return torch.cat((steps, decode), dim=1)


def _prefilled(model, name, contexts):
    cache = build_cache(name, model.cache_spec(), LOSSY[name])
    cache.allocate(len(contexts), 40)
    with torch.inference_mode():
        width = max(map(len, contexts))
        ids = torch.tensor([c + [0] * (width - len(c)) for c in contexts])
        model(ids, torch.arange(width).expand_as(ids), cache, [len(c) for c in contexts])
    return cache


@pytest.mark.parametrize("name", sorted(FORKS))
def test_a_forked_row_continues_as_a_row_fed_itself(name, tiny_llama):
    contexts = prompts(tiny_llama.config.vocab_size, lengths=(17, 9))
    then = prompts(tiny_llama.config.vocab_size, lengths=(3, 3, 3))
    source = _prefilled(tiny_llama, name, contexts)
    assert source.forks
    forked = source.fork([1, 0, 1])
    direct = _prefilled(tiny_llama, name, [contexts[1], contexts[0], contexts[1]])
    got, want = _fed(tiny_llama, forked, then), _fed(tiny_llama, direct, then)
    assert (got - want).abs().max() <= TOLERANCE
    # the source is unchanged: it continues as a cache that was never forked
    again = _fed(tiny_llama, source, then[:2])
    fresh = _fed(tiny_llama, _prefilled(tiny_llama, name, contexts), then[:2])
    assert (again - fresh).abs().max() == 0


@pytest.mark.parametrize("name", sorted(REFUSED))
def test_a_strategy_that_cannot_copy_rows_says_so(name, tiny_llama):
    cache = _prefilled(tiny_llama, name, prompts(tiny_llama.config.vocab_size, (5, 7)))
    assert not cache.forks
    with pytest.raises(ValueError, match=f"cache={name} cannot copy its rows"):
        cache.fork([0, 0])
