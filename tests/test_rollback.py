"""Rolling rows back (``KVCache.truncate``, speculative decoding's rejection): after a
rollback a cache behaves as if the dropped tokens had never been fed. Exact settings are
checked against recomputation from scratch, lossy ones against the same run that never
fed the dropped tokens (identical arithmetic, so identical logits and bytes)."""

from __future__ import annotations

import pytest
import torch

from kvlab.cache import build_cache, registered
from kvlab.cache.composed import compositions
from kvlab.engine import Engine

TOLERANCE = 1e-4
GEN = torch.Generator().manual_seed(11)

# Settings under which a strategy keeps everything exactly, and lossy ones, as each declares
# them (KVCache.tests); KIVI's lossy rollback is one token (its ring of residual +
# group_size slots holds the rest).
TESTS = {name: cls.tests for name, cls in registered().items()}
EXACT = {n: t.exact for n, t in TESTS.items() if t.rollback_exact}
LOSSY = {n: t.rollback_lossy for n, t in TESTS.items() if t.rollback_lossy is not None}
BACK = {n: t.rollback_back for n, t in TESTS.items()}
REFUSED = {n for n, t in TESTS.items() if t.rollback_exact is False}


def test_the_built_in_strategies_roll_back_or_refuse_as_declared():
    assert {"full", "gqa_shared", "paged", "quest", "sliding", "int8", "int4", "int2"} <= set(EXACT)
    assert {"evict", "compressed"} <= REFUSED
    assert set(compositions()) <= set(EXACT) | REFUSED


@pytest.mark.parametrize("name", sorted(REFUSED))
def test_a_strategy_that_cannot_roll_back_exactly_refuses(name, tiny_llama):
    seqs = [random_tokens(11)]
    engine = started(tiny_llama, name, TESTS[name].lossy, seqs)
    with pytest.raises(ValueError, match="roll back"):
        engine.cache.truncate([9])


def random_tokens(count: int) -> list[int]:
    return torch.randint(0, 256, (count,), generator=GEN).tolist()


def prompts() -> list[list[int]]:
    """Row 2 starts with row 0's prompt, so a paged store shares their first blocks."""
    first = random_tokens(11)
    return [first, random_tokens(5), first + random_tokens(6)]


def feed(engine: Engine, seqs: list[list[int]], tokens: list[list[int]]) -> list[torch.Tensor]:
    """Decode ``tokens[b][i]`` into row b at step i; the logits of every step."""
    out = []
    for step in range(len(tokens[0])):
        for seq, row in zip(seqs, tokens, strict=True):
            seq.append(row[step])
        out.append(engine.decode_step(seqs))
    return out


def started(model, name: str, options: dict, seqs: list[list[int]]) -> Engine:
    engine = Engine(model, build_cache(name, model.cache_spec(), options))
    engine.cache.allocate(len(seqs), 64)
    engine.prefill(seqs, max(map(len, seqs)))
    return engine


@pytest.mark.parametrize("name", sorted(EXACT))
def test_rollback_equals_recomputing_the_kept_tokens(name, tiny_llama):
    """Rows rolled back by different amounts (row 0 into the blocks it shares with row 2)
    then decode as a fresh full cache prefilled with what they kept."""
    seqs = prompts()
    engine = started(tiny_llama, name, EXACT[name], seqs)
    feed(engine, seqs, [random_tokens(6) for _ in seqs])
    kept = [7, len(seqs[1]), len(seqs[2]) - 3]
    engine.cache.truncate(kept)
    seqs = [s[:n] for s, n in zip(seqs, kept, strict=True)]
    assert engine.cache.lengths == kept
    after = [random_tokens(4) for _ in seqs]
    fresh_seqs = [list(s) for s in seqs]
    fresh = started(tiny_llama, "full", {}, fresh_seqs)
    for got, want in zip(feed(engine, seqs, after), feed(fresh, fresh_seqs, after), strict=True):
        torch.testing.assert_close(got, want, atol=TOLERANCE, rtol=0)


@pytest.mark.parametrize("name", sorted(LOSSY))
def test_lossy_rollback_equals_never_feeding_the_dropped_tokens(name, tiny_llama):
    """Decode 5, roll back r, decode 4 = decode 5 - r, decode 4: same logits and bytes."""
    back, options = BACK[name], LOSSY[name]
    drafts, after = [random_tokens(5) for _ in range(3)], [random_tokens(4) for _ in range(3)]
    rolled_seqs = prompts()
    plain_seqs = [list(s) for s in rolled_seqs]
    rolled = started(tiny_llama, name, options, rolled_seqs)
    feed(rolled, rolled_seqs, drafts)
    rolled.cache.truncate([len(s) - back for s in rolled_seqs])
    rolled_seqs = [s[:-back] for s in rolled_seqs]
    plain = started(tiny_llama, name, options, plain_seqs)
    feed(plain, plain_seqs, [d[:-back] for d in drafts])
    got, want = feed(rolled, rolled_seqs, after), feed(plain, plain_seqs, after)
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=0)
    assert rolled.cache.memory().used_bytes == plain.cache.memory().used_bytes


def test_kivi_rollback_re_exposes_encoded_groups_while_the_ring_holds_them(tiny_llama):
    """Residual 6, groups of 4 (ring of 10): 22 tokens hold [0, 16) as codes; back to 20,
    group [12, 16) is exact again from the ring (as a run that stopped at 20 holds it);
    back to 17, group [8, 12) never passed through the ring (the prefill encoded it)."""
    options = dict(group_size=4, residual=6)
    prompt, drafts, after = random_tokens(17), random_tokens(5), random_tokens(4)
    rolled_seqs, plain_seqs = [list(prompt)], [list(prompt)]
    rolled = started(tiny_llama, "int4", options, rolled_seqs)
    feed(rolled, rolled_seqs, [drafts])
    with pytest.raises(ValueError, match=r"from 22 to 17 tokens: tokens 8\.\.16 .* >= 12"):
        rolled.cache.truncate([17])
    rolled.cache.truncate([20])
    plain = started(tiny_llama, "int4", options, plain_seqs)
    feed(plain, plain_seqs, [drafts[:3]])
    rolled_seqs = [rolled_seqs[0][:20]]
    got, want = feed(rolled, rolled_seqs, [after]), feed(plain, plain_seqs, [after])
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=0)


def test_a_window_margin_changes_no_logit(tiny_llama):
    """The margin's slots hold tokens out of the window, never attended: a wrapped ring
    with a margin decodes what one without it does (the decode reads the window's slots
    in the ring's cycle as a segment of their own)."""
    seqs = prompts()
    tokens = [random_tokens(9) for _ in seqs]
    plain = started(tiny_llama, "sliding", dict(sinks=2, window=6), [list(s) for s in seqs])
    margin = started(tiny_llama, "sliding", dict(sinks=2, window=6, rollback=3), seqs)
    want = feed(plain, [list(s) for s in seqs], tokens)
    for got, expected in zip(feed(margin, seqs, tokens), want, strict=True):
        torch.testing.assert_close(got, expected, atol=1e-5, rtol=0)


def test_paged_rollback_returns_blocks_to_the_pool(tiny_llama):
    seqs = [random_tokens(10)]
    engine = started(tiny_llama, "paged", dict(block_size=4, prefix_sharing=False), seqs)
    free = len(engine.cache.store.pool.free)
    engine.cache.truncate([3])
    assert len(engine.cache.store.pool.free) == free + 2  # blocks [4, 8) and [8, 10) back
    assert engine.cache.store.tables == [engine.cache.store.tables[0][:1]]


def test_a_rollback_that_cannot_be_exact_is_refused_with_the_reason(tiny_llama):
    seqs = [random_tokens(11)]
    sliding = started(tiny_llama, "sliding", dict(sinks=2, window=6), seqs)
    with pytest.raises(ValueError, match="has dropped tokens the shorter row would see"):
        sliding.cache.truncate([9])
    evict = started(tiny_llama, "evict", dict(ratio=0.5, window=2, kernel=3), [list(seqs[0])])
    with pytest.raises(ValueError, match="cannot roll back a ragged store"):
        evict.cache.truncate([9])
    compressed = started(tiny_llama, "compressed", {}, [list(seqs[0])])
    with pytest.raises(ValueError, match="cache=compressed cannot roll back"):
        compressed.cache.truncate([9])
    full = started(tiny_llama, "full", {}, [list(seqs[0])])
    with pytest.raises(ValueError, match=r"truncate\(lengths=\[12\]\) is invalid"):
        full.cache.truncate([12])


@pytest.mark.parametrize("start", range(17, 25))  # every alignment of a group of 4
def test_kivi_with_a_rollback_margin_takes_a_whole_rejected_step_back(start, tiny_llama):
    """What ``speculation_refusal`` promises: with ``rollback`` = 3 (ring of residual +
    group + 3 slots) a 4-token verification step — closing a group from the ring, or not —
    taken back by 3 tokens equals the run that fed its first token alone."""
    options = dict(group_size=4, residual=6, rollback=3)
    strategy = build_cache("int4", tiny_llama.cache_spec(), options)
    assert type(strategy).speculation_refusal(strategy.options, 64, 3) is None
    prompt, step, after = random_tokens(start), random_tokens(4), random_tokens(3)
    rolled_seqs, plain_seqs = [list(prompt)], [list(prompt)]
    rolled = started(tiny_llama, "int4", options, rolled_seqs)
    rolled.verify([rolled_seqs[0] + step[:1]], [step[1:]])
    rolled.cache.truncate([start + 1])
    plain = started(tiny_llama, "int4", options, plain_seqs)
    plain.decode_step([plain_seqs[0] + step[:1]])
    rolled_seqs[0].append(step[0])
    plain_seqs[0].append(step[0])
    got, want = feed(rolled, rolled_seqs, [after]), feed(plain, plain_seqs, [after])
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=0)
    assert rolled.cache.memory().used_bytes == plain.cache.memory().used_bytes
