"""Continuous batching under a KV budget (kvlab.engine.scheduler, kvlab.serving.server) on
the tiny model: every strategy serves a trace with the outputs each request gets alone; the
scheduler's order is asserted on a trace where it is known; metrics on a fake clock are
computed by hand."""

from __future__ import annotations

import pytest
import torch

from kvlab.cache import build_cache, registered
from kvlab.cache.base import strategy
from kvlab.config import ServingConfig
from kvlab.engine import Engine, GenerationConfig
from kvlab.engine.clock import FakeClock
from kvlab.engine.sequence import Request
from kvlab.serving.server import serve
from tests.test_cache_contract import LOSSY

SERVING = sorted(n for n, cls in registered().items() if cls.stores_past and cls.serves)
COMPOSED = [("paged", dict(block_size=4, kv_bits=4, kv_group_size=8))]


def trace(vocab: int, lengths=(11, 5, 17, 9, 13), outputs=(6, 3, 5, 7, 2), gap=0.5):
    gen = torch.Generator().manual_seed(5)
    return [
        Request(i, i * gap, tuple(torch.randint(0, vocab, (n,), generator=gen).tolist()), out)
        for i, (n, out) in enumerate(zip(lengths, outputs, strict=True))
    ]


def row_bytes(model, name, options, capacity: int) -> int:
    cache = build_cache(name, model.cache_spec(), options)
    cache.serve(2**24, capacity)
    return cache.request_bytes(capacity)


@pytest.mark.parametrize(
    ("name", "options"), [(n, LOSSY[n]) for n in SERVING] + COMPOSED, ids=lambda x: str(x)
)
def test_every_request_gets_what_it_generates_alone(name, options, tiny_llama):
    """Batching, chunked prefill, joining and leaving change nothing but timing (greedy)."""
    check_serving_equals_alone(tiny_llama, name, options)


def check_serving_equals_alone(model, name: str, options: dict) -> None:
    """A trace served under a budget of a few rows gives every request what it generates
    alone, and requests did run together."""
    requests = trace(model.config.vocab_size)
    capacity = max(len(r.prompt) + r.max_new_tokens for r in requests)
    budget = 3 * row_bytes(model, name, options, capacity)  # a few at a time
    cache = build_cache(name, model.cache_spec(), options)
    result = serve(
        model, cache, requests, ServingConfig(kv_budget_bytes=budget, chunk=4), FakeClock()
    )
    alone = Engine(model, build_cache(name, model.cache_spec(), options))
    for seq, request in zip(result.seqs, requests, strict=True):
        cfg = GenerationConfig(request.max_new_tokens, stop_on_eos=False, prefill_chunk=4)
        assert seq.output == alone.generate([list(request.prompt)], cfg).tokens[0], seq.index
    assert max(n for _, _, n in result.timeline) >= 2  # requests did run together


def test_admission_retirement_order_and_metrics_on_a_fake_clock(tiny_llama):
    """``full`` with room for two rows, admitting as many as fit together; three requests
    at t=0 of 2, 3 and 1 tokens; every forward takes 1 s. By hand: step 0 prefills 0 and 1
    (their first tokens at t=1) and they join; step 1 decodes them (t=2), 0 is done; step 2
    admits 2, whose prompt is fed in the forward that decodes 1's last token (both at
    t=3)."""
    vocab = tiny_llama.config.vocab_size
    requests = [Request(i, 0.0, tuple(range(1 + i, 5 + i)), out) for i, out in enumerate((2, 3, 1))]
    budget = 2 * row_bytes(tiny_llama, "full", {}, 7)
    cache = build_cache("full", tiny_llama.cache_spec())
    result = serve(
        tiny_llama,
        cache,
        requests,
        ServingConfig(kv_budget_bytes=budget, max_joining=0),
        FakeClock(1.0),
    )
    assert [(e.step, e.kind, e.index) for e in result.events] == [
        (0, "admit", 0), (0, "admit", 1), (0, "join", 0), (0, "join", 1),
        (1, "retire", 0), (2, "admit", 2), (2, "retire", 1), (2, "retire", 2),
    ]  # fmt: skip
    assert [s.times.token_s for s in result.seqs] == [[1, 2], [1, 2, 3], [3]]
    assert all(0 <= t < vocab for s in result.seqs for t in s.output)
    m = result.metrics()
    assert m["mean_ttft_ms"] == pytest.approx(1e3 * 5 / 3)  # 1, 1, 3
    assert m["median_ttft_ms"] == pytest.approx(1e3)
    assert m["mean_itl_ms"] == pytest.approx(1e3)  # gaps 1 | 1, 1
    assert m["mean_tpot_ms"] == pytest.approx(1e3)  # 1 and 1 (one-token request: none)
    assert m["mean_e2el_ms"] == pytest.approx(1e3 * 8 / 3)  # 2, 3, 3
    assert m["duration_s"] == 3 and m["output_throughput"] == pytest.approx(2.0)
    assert m["request_throughput"] == pytest.approx(1.0)
    assert m["max_concurrency"] == 2
    assert m["mean_concurrency"] == pytest.approx(2.0)  # 0 and 1, then 1 and 2 (from t=2)
    assert m["kv_bytes_peak"] == budget and m["preemptions"] == 0
    assert m["decode_batch_mean"] == 1.5 and m["steps_with_prefill"] == 2  # steps 0 and 2
    assert result.profile.prefill_tokens == 12 and result.profile.decode_rows == 3


def test_paged_preempts_the_latest_request_and_recomputes_it(tiny_llama):
    """Two requests of 7 prompt + 8 output tokens in blocks of 4, a pool of 5 blocks: both
    are admitted by their prompts' blocks (2 each, both in the first step), decode outgrows
    the pool, the later one is preempted, waits for the first to finish, and is recomputed — with
    the tokens it generates alone."""
    options = dict(block_size=4)
    requests = trace(tiny_llama.config.vocab_size, lengths=(7, 7), outputs=(8, 8), gap=0)
    spawned = build_cache("paged", tiny_llama.cache_spec(), options)
    budget = 6 * spawned.store.block_bytes()  # 5 blocks + the trash block
    cache = build_cache("paged", tiny_llama.cache_spec(), options)
    result = serve(tiny_llama, cache, requests, ServingConfig(kv_budget_bytes=budget), FakeClock())
    assert cache.store.pool.num_blocks == 5
    # step 0: 0 and 1 are prefilled in one packed step (2 blocks each) and join; 1: both
    # decode position 7 (in their second blocks); 2: both need a block at position 8, one is
    # free: 1 is preempted; 0 ends at step 7; 1 comes back (prompt + its 2 tokens: 3
    # blocks) and ends 5 steps later
    assert [(e.step, e.kind, e.index) for e in result.events] == [
        (0, "admit", 0), (0, "admit", 1), (0, "join", 0), (0, "join", 1), (2, "preempt", 1),
        (7, "retire", 0), (8, "admit", 1), (8, "join", 1), (13, "retire", 1),
    ]  # fmt: skip
    assert result.preemptions == 1
    alone = Engine(tiny_llama, build_cache("paged", tiny_llama.cache_spec(), options))
    for seq, request in zip(result.seqs, requests, strict=True):
        cfg = GenerationConfig(8, stop_on_eos=False)
        assert seq.output == alone.generate([list(request.prompt)], cfg).tokens[0]


def test_a_budget_that_cannot_hold_one_request_fails_before_any_work(tiny_llama, monkeypatch):
    calls = []
    monkeypatch.setattr(type(tiny_llama), "logits", lambda *a, **k: calls.append(1))
    requests = trace(tiny_llama.config.vocab_size)
    need = row_bytes(tiny_llama, "full", {}, 17 + 5)
    cache = build_cache("full", tiny_llama.cache_spec())
    with pytest.raises(
        ValueError, match=r"kv_budget_bytes=.*cannot hold request 0 .*rows of up to 22.*budget >="
    ):
        serve(tiny_llama, cache, requests, ServingConfig(kv_budget_bytes=need - 1), FakeClock())
    assert not calls


def test_paged_block_bytes_are_the_pools(tiny_llama):
    for options in (dict(block_size=4), dict(block_size=4, kv_bits=4, kv_group_size=8)):
        cache = build_cache("paged", tiny_llama.cache_spec(), options)
        cache.serve(2**20, 32)
        assert cache.store._pool_block_bytes() == cache.store.block_bytes()


def test_paged_reuses_a_stored_prefix_and_feeds_only_the_rest(tiny_llama):
    """Requests sharing a 12-token system prompt, arriving one after another: later ones
    find its full blocks stored (prefix caching), feed only the rest, and generate what
    they generate alone."""
    vocab = tiny_llama.config.vocab_size
    prefix = tuple(range(3, 15))
    requests = [
        Request(r.index, 10.0 * r.index, prefix + r.prompt, r.max_new_tokens) for r in trace(vocab)
    ]
    cache = build_cache("paged", tiny_llama.cache_spec(), dict(block_size=4))
    result = serve(
        tiny_llama, cache, requests, ServingConfig(kv_budget_bytes=2**20, chunk=8), FakeClock()
    )
    assert [s.cached for s in result.seqs] == [0, 12, 12, 12, 12]
    assert result.metrics()["prefix_cache_hit_rate"] == pytest.approx(
        48 / sum(len(r.prompt) for r in requests)
    )
    alone = Engine(tiny_llama, build_cache("paged", tiny_llama.cache_spec(), dict(block_size=4)))
    for seq, request in zip(result.seqs, requests, strict=True):
        cfg = GenerationConfig(request.max_new_tokens, stop_on_eos=False)
        assert seq.output == alone.generate([list(request.prompt)], cfg).tokens[0]


def pooled(name: str) -> bool:
    """The strategy's store is a shared pool (admits by blocks), not a per-row reservation."""
    store = getattr(strategy(name), "Store", None)
    return store is not None and store.pooled


@pytest.mark.parametrize("name", [n for n in SERVING if not pooled(n)])
def test_a_contiguous_row_holds_what_the_memory_model_reserves_for_it(name, tiny_llama):
    """Admission's arithmetic is the tensors': rows that joined hold exactly their
    ``request_bytes`` each (the memory model's line for one row at the capacity)."""
    options = LOSSY[name]
    cache = build_cache(name, tiny_llama.cache_spec(), options)
    cache.serve(2**24, 40)
    for rows in (2, 1):
        group = cache.spawn()
        group.allocate(rows, 40)
        cache.join(group)
    assert cache.memory().held_bytes == 3 * cache.request_bytes(40)
    assert cache.free_bytes() == 2**24 - 3 * cache.request_bytes(40)
    cache.free([1])
    assert cache.memory().held_bytes == 2 * cache.request_bytes(40)


def test_serving_refuses_a_cache_that_keeps_nothing(tiny_llama):
    from kvlab.engine import SamplingConfig
    from kvlab.serving.study import measure_serving

    def factory():
        return build_cache("nocache", tiny_llama.cache_spec())

    with pytest.raises(ValueError, match="stores the past.*cache=nocache"):
        measure_serving(
            tiny_llama, None, factory, ServingConfig(kv_budget_gib=1), SamplingConfig(),
            frozenset(), False, None,
        )  # fmt: skip


@pytest.mark.parametrize(
    ("name", "options"), [("full", {}), ("paged", dict(block_size=4)), ("int8", LOSSY["int8"])]
)
def test_speculation_in_serving_gives_each_request_what_it_generates_alone(
    name, options, tiny_llama
):
    """Prompt lookup in the running batch (rows verified together, joining and leaving
    between steps): greedy outputs equal each request's alone; drafts were verified."""
    from kvlab.speculative import SpecConfig
    from tests.test_speculative import repetitive_prompts

    prompts = repetitive_prompts(tiny_llama.config.vocab_size)
    requests = [Request(i, 0.3 * i, tuple(p), 16 + 2 * i) for i, p in enumerate(prompts)]
    options = dict(options, rollback=3) if name == "int8" else options
    cache = build_cache(name, tiny_llama.cache_spec(), options)
    cfg = ServingConfig(kv_budget_bytes=2**22, chunk=8, max_joining=0)
    spec = SpecConfig("ngram", 3)
    result = serve(tiny_llama, cache, requests, cfg, FakeClock(), spec=spec)
    alone = Engine(tiny_llama, build_cache(name, tiny_llama.cache_spec(), options))
    for seq, request in zip(result.seqs, requests, strict=True):
        gen = GenerationConfig(request.max_new_tokens, stop_on_eos=False)
        assert seq.output == alone.generate([list(request.prompt)], gen).tokens[0], seq.index
    metrics = result.metrics()
    assert metrics["spec/drafted"] > 0 and metrics["spec/tokens_per_step"] > 1
    assert max(n for _, _, n in result.timeline) >= 2  # requests did run together
