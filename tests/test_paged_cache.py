"""``paged``: block accounting, prefix sharing, copy-on-write and pool exhaustion, with
outputs equal to running each sequence alone on a ``full`` cache."""

from __future__ import annotations

import pytest
import torch

from kvlab.cache import NoRoom, build_cache
from kvlab.engine import Engine, GenerationConfig

CFG = GenerationConfig(6, stop_on_eos=False)
PREFIX = [11, 12, 13, 14, 15, 16, 17, 18, 19, 20]  # 10 tokens: 2 full blocks of 4 + 2


def alone(model, prompts):
    engine = Engine(model, build_cache("full", model.cache_spec()))
    return [engine.generate([p], CFG).tokens[0] for p in prompts]


def paged(model, **options):
    cache = build_cache("paged", model.cache_spec(), dict(block_size=4, **options))
    return cache, Engine(model, cache)


def test_common_prefix_shares_full_blocks(tiny_llama):
    prompts = [PREFIX + [30, 31], PREFIX + [40], PREFIX[:9]]
    cache, engine = paged(tiny_llama)
    run = engine.stream(prompts, CFG)
    first = next(iter(run))
    report = cache.memory()
    block_bytes = report.details["in_use_bytes"] // report.details["blocks_in_use"]
    assert report.details["shared_saved_bytes"] == 4 * block_bytes  # rows 2, 3 reuse 2 blocks
    assert [cache.store.tables[r][:2] for r in range(3)] == [cache.store.tables[0][:2]] * 3
    for _ in run:
        pass
    assert all(first[i] == run.tokens[i][0] for i in range(3))
    assert run.tokens == alone(tiny_llama, prompts)


def test_identical_prompts_share_then_copy_on_write(tiny_llama):
    prompts = [PREFIX, PREFIX]
    cache, engine = paged(tiny_llama)
    run = engine.stream(prompts, CFG)
    iterator = iter(run)
    next(iterator)  # after prefill: every block shared, the partial one too
    assert cache.store.tables[0] == cache.store.tables[1]
    next(iterator)  # the first decode writes into the shared partial block: copied first
    assert cache.store.tables[0][:2] == cache.store.tables[1][:2]
    assert cache.store.tables[0][2] != cache.store.tables[1][2]
    for _ in iterator:
        pass
    assert run.tokens == alone(tiny_llama, prompts)


def test_finished_sequences_return_their_blocks(tiny_llama):
    cache, engine = paged(tiny_llama, prefix_sharing=False)
    engine.generate([PREFIX, PREFIX[:3]], CFG)
    assert (
        cache.store.pool.in_use == [] and len(cache.store.pool.free) == cache.store.pool.num_blocks
    )


def test_prefix_is_reused_by_a_later_generation(tiny_llama):
    cache, engine = paged(tiny_llama)
    engine.generate([PREFIX + [50]], CFG)
    run = engine.stream([PREFIX + [60]], CFG)
    next(iter(run))
    assert cache.store.tables[0][:2] == [0, 1]  # the first generation's blocks, found by hash


def test_waste_is_below_one_block_per_sequence(tiny_llama):
    prompts = [PREFIX[:n] for n in (3, 5, 9, 10)]
    cache, engine = paged(tiny_llama, prefix_sharing=False)
    run = engine.stream(prompts, GenerationConfig(2, stop_on_eos=False))
    next(iter(run))
    report = cache.memory()
    slot_bytes = report.details["in_use_bytes"] // (report.details["blocks_in_use"] * 4)
    assert report.details["waste_bytes"] == slot_bytes * sum(-n % 4 for n in (3, 5, 9, 10))


def test_exhausted_pool_fails_clearly(tiny_llama):
    _, engine = paged(tiny_llama, num_blocks=3, prefix_sharing=False)
    with pytest.raises(NoRoom, match="needs 1 free blocks of 4 tokens, 0 of 3 are free"):
        engine.generate([PREFIX, PREFIX[:5]], CFG)


def test_full_pool_preempts_and_recomputes(tiny_llama):
    prompts = [PREFIX, PREFIX[::-1]]  # 10 tokens each: 3 blocks; 15 tokens at the end: 4
    cache, engine = paged(tiny_llama, num_blocks=6, prefix_sharing=False)
    run = engine.generate(prompts, CFG)
    assert run.stats.preemptions == 1
    assert run.tokens == alone(tiny_llama, prompts)
    assert cache.store.pool.in_use == []


def test_auto_sized_pool_grows_with_a_larger_batch(tiny_llama):
    cache, engine = paged(tiny_llama)
    engine.generate([PREFIX[:3]], CFG)  # a small first batch sizes the pool small
    assert engine.generate([PREFIX, PREFIX[::-1]], CFG).tokens == alone(
        tiny_llama, [PREFIX, PREFIX[::-1]]
    )


def test_sequences_finishing_at_different_times_free_their_blocks(tiny_llama):
    first = alone(tiny_llama, [PREFIX])[0]
    eos = first[2]  # the first sequence stops after three tokens
    cache = build_cache("paged", tiny_llama.cache_spec(), dict(block_size=4))
    engine = Engine(tiny_llama, cache, eos_ids=[eos])
    other = PREFIX[::-1]
    run = engine.generate([PREFIX, other], GenerationConfig(6))
    assert run.tokens[0] == first[:3]
    assert run.stats.step_rows[0] == 2 and run.stats.step_rows[-1] == 1
    assert run.tokens[1] == engine.generate([other], GenerationConfig(6)).tokens[0]
    assert cache.store.pool.in_use == []


def test_recomputation_after_preemption_is_prefill_time_not_decode(tiny_llama):
    """A preempted sequence's re-prefill is counted as prefill work (never an ITL sample),
    and the KV peak is taken after every prefill round too."""
    from kvlab.engine.metrics import generation_metrics

    prompts = [PREFIX, PREFIX[::-1]]
    cache, engine = paged(tiny_llama, num_blocks=6, prefix_sharing=False)
    run = engine.generate(prompts, CFG)
    stats, metrics = run.stats, generation_metrics(run.stats)
    assert stats.preemptions == 1 and len(stats.reprefill_s) == 1
    assert metrics["reprefills"] == 1 and metrics["reprefill_ms"] > 0
    # decode steps emitted every token but those the prefill rounds sampled: one per
    # prompt in the first round, one for the recomputed sequence
    assert sum(stats.step_rows) == sum(len(t) for t in run.tokens) - len(prompts) - 1
    assert stats.kv_peak.tokens >= len(PREFIX) + len(PREFIX)  # both prompts were held at once


@pytest.mark.parametrize("name", ["paged", "tiered"])
def test_blocks_of_a_step_planned_but_never_run_are_not_shared(name, tiny_llama):
    """A packed step plans every part before any layer runs; when a part does not fit, the
    latest request is preempted and its planned blocks are freed unwritten. Their prefix
    keys go with them: a later prompt recomputes those tokens instead of sharing garbage."""
    cache = build_cache(name, tiny_llama.cache_spec(), dict(block_size=4))
    cache.serve(2**22, 32)
    ids = torch.tensor([PREFIX + [21, 22]])
    group = cache.spawn()
    group.allocate(1, 32)
    tiny_llama.plan_step(group, ids, torch.arange(12)[None], [12])  # planned, never run
    group.free([0])
    again = cache.spawn()
    again.allocate(1, 32)
    assert again.reuse_prefix(0, ids[0].tolist()) == 0
    with torch.inference_mode():  # run once: its blocks are shared from then on
        tiny_llama(ids, torch.arange(12)[None], again)
    again.free([0])
    third = cache.spawn()
    third.allocate(1, 32)
    assert third.reuse_prefix(0, ids[0].tolist()) == 8
