"""``tiered`` (kvlab.cache.stores.tiered): cached blocks the pool reuses go to a slow tier
and come back bit for bit (exact codecs), or as their codec's own round trip (lossy slow
codecs); a prompt served from blocks that went to the slow tier and back gives the logits
and tokens of one whose blocks never left; the replacement policies keep their capacity
(ARC resists a scan that flushes LRU); a tier that cannot be made is refused with the
reason before anything runs."""

from __future__ import annotations

import os

import pytest
import torch

from kvlab.cache import build_cache
from kvlab.cache.codecs import CodecOptions
from kvlab.cache.tiers import replacements
from kvlab.config import ConversationConfig, ServingConfig
from kvlab.engine import Engine, GenerationConfig
from kvlab.engine.clock import FakeClock
from kvlab.engine.sequence import Request
from kvlab.serving.conversations import Conversation, serve_conversations
from kvlab.serving.server import serve

CAPACITY = 64


def tokens(n: int, seed: int, vocab: int) -> list[int]:
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def pool_bytes(model, blocks: int) -> int:
    """The budget of a pool of ``blocks`` blocks of 4 tokens (the trash block beside)."""
    probe = build_cache("paged", model.cache_spec(), dict(block_size=4))
    probe.serve(2**24, CAPACITY)
    return (blocks + 1) * probe.store.block_bytes()


def served(model, name: str, blocks: int, **options):
    """A cache of ``name`` serving a pool of ``blocks`` blocks of 4 tokens."""
    cache = build_cache(name, model.cache_spec(), dict(block_size=4, **options))
    cache.serve(pool_bytes(model, blocks), CAPACITY)
    return cache


def run_prompt(model, cache, ids: list[int]):
    """``ids`` in a row of its own (prefix blocks reused where found): the logits of its last
    token, how many tokens were found stored, and the row's block table. The row is freed
    (its blocks stay cached)."""
    group = cache.spawn()
    group.allocate(1, CAPACITY)
    found = group.reuse_prefix(0, ids)
    rest = torch.tensor([ids[found:]])
    with torch.inference_mode():
        logits = model(rest, torch.arange(found, len(ids))[None], group)[0, -1]
    table = list(group.store.tables[0])
    group.free([0])
    return logits, found, table


def block_kv(cache, block: int) -> list[torch.Tensor]:
    store = cache.store
    return [part[block].clone() for layer in store.keys + store.values for part in layer]


def a_then_b_then_a(model, cache):
    """Prompt A (18 tokens), then B (48 tokens: the whole pool, so A's cached blocks are
    reused for B and go to the slow tier), then A again."""
    vocab = model.config.vocab_size
    a, b = tokens(18, 1, vocab), tokens(48, 2, vocab)
    first, found, table = run_prompt(model, cache, a)
    assert found == 0
    kv = [block_kv(cache, block) for block in table[:4]]
    run_prompt(model, cache, b)
    again, found, table = run_prompt(model, cache, a)
    return first, again, found, kv, [block_kv(cache, block) for block in table[:4]]


@pytest.mark.parametrize("medium", ["ram", "file"])
def test_blocks_back_from_the_slow_tier_are_the_blocks_that_left(medium, tiny_llama, tmp_path):
    cache = served(tiny_llama, "tiered", 12, slow_tier=medium, slow_path=str(tmp_path))
    first, again, found, kv, back = a_then_b_then_a(tiny_llama, cache)
    assert found == 16  # A's four full blocks, found in the slow tier
    traffic = cache.store.tier.traffic
    assert traffic.hits == 4 and traffic.written_blocks >= 4
    for left, returned in zip(kv, back, strict=True):
        assert all(torch.equal(x, y) for x, y in zip(left, returned, strict=True))
    # the same prompts on a pool large enough that A's blocks never leave it
    never_left = served(tiny_llama, "paged", 40)
    _, reference, found_fast, _, _ = a_then_b_then_a(tiny_llama, never_left)
    assert found_fast == 16 and never_left.store.pool.hits == 4
    assert (again - reference).abs().max() <= 1e-6
    assert (again - first).abs().max() <= 1e-5  # and recomputation from scratch
    assert os.listdir(tmp_path) == []  # a file tier leaves no file behind


def test_without_a_slow_tier_the_same_pool_recomputes(tiny_llama):
    cache = served(tiny_llama, "paged", 12)
    _, _, found, _, _ = a_then_b_then_a(tiny_llama, cache)
    assert found == 0


def test_a_lossy_slow_tier_returns_its_codecs_round_trip(tiny_llama):
    cache = served(tiny_llama, "tiered", 12, slow_kv_bits=4, slow_kv_group_size=8)
    _, _, found, kv, back = a_then_b_then_a(tiny_llama, cache)
    assert found == 16
    codec = CodecOptions(kv_bits=4, kv_group_size=8).codec(tiny_llama.cache_spec().head_dim)
    for left, returned in zip(kv, back, strict=True):
        for x, y in zip(left, returned, strict=True):
            assert torch.equal(codec.round_trip(x), y)
            assert not torch.equal(x, y)  # the codes did lose something


def test_a_lossy_slow_tier_moves_fewer_bytes(tiny_llama):
    exact = served(tiny_llama, "tiered", 12)
    int4 = served(tiny_llama, "tiered", 12, slow_kv_bits=4, slow_kv_group_size=8)
    a_then_b_then_a(tiny_llama, exact)
    a_then_b_then_a(tiny_llama, int4)
    moved = [c.store.tier.traffic for c in (exact, int4)]
    assert moved[0].written_blocks == moved[1].written_blocks
    assert moved[1].written_bytes * 2 < moved[0].written_bytes  # fp32 -> int4 codes
    details = int4.store.details()
    assert details["slow_held_bytes"] == len(int4.store.tier) * int4.store.record_bytes()


def shared_document_trace(vocab: int) -> list[Request]:
    """Two documents, each asked two questions, the second round after the other document
    filled the pool: its blocks must come back from the slow tier to be reused."""
    docs = [tokens(24, 10 + d, vocab) for d in range(2)]
    order = [0, 1, 0, 1]
    return [
        Request(i, 10.0 * i, tuple(docs[d] + tokens(5, 20 + i, vocab)), 3)
        for i, d in enumerate(order)
    ]


def test_serving_reuses_documents_from_the_slow_tier_with_the_same_tokens(tiny_llama):
    requests = shared_document_trace(tiny_llama.config.vocab_size)
    found = {}
    for name in ("paged", "tiered"):
        cache = build_cache(name, tiny_llama.cache_spec(), dict(block_size=4))
        budget = ServingConfig(kv_budget_bytes=pool_bytes(tiny_llama, 10), chunk=8)
        result = serve(tiny_llama, cache, requests, budget, FakeClock())
        found[name] = [s.cached for s in result.seqs]
        alone = Engine(tiny_llama, build_cache("full", tiny_llama.cache_spec()))
        for seq, request in zip(result.seqs, requests, strict=True):
            cfg = GenerationConfig(request.max_new_tokens, stop_on_eos=False)
            assert seq.output == alone.generate([list(request.prompt)], cfg).tokens[0]
    assert found["tiered"] == [0, 0, 24, 24]
    assert found["paged"][2:] < found["tiered"][2:]


@pytest.mark.parametrize("name", sorted(replacements()))
def test_a_replacement_policy_keeps_its_capacity(name):
    policy = replacements()[name](4)
    resident: set = set()
    gen = torch.Generator().manual_seed(0)
    for key in torch.randint(0, 12, (200,), generator=gen).tolist():
        if key in policy:
            policy.hit(key)
            continue
        dropped = policy.admit(key)
        assert set(dropped) <= resident
        resident = (resident - set(dropped)) | {key}
        assert len(policy) == len(resident) <= 4
        assert all(k in policy for k in resident)


def scan(policy) -> set:
    """Two keys used three times each, then a scan of ten keys used once: which survive."""
    for key in ("a", "b", "a", "b", "a", "b"):
        policy.hit(key) if key in policy else policy.admit(key)
    for key in range(10):
        policy.admit(key)
    return {k for k in ("a", "b") if k in policy}


def test_lru_is_flushed_by_a_scan_that_arc_resists():
    assert scan(replacements()["arc"](4)) == {"a", "b"}
    assert scan(replacements()["lru"](4)) == set()


@pytest.mark.parametrize(
    ("options", "message"),
    [
        (dict(slow_gib=1e-9), "slow_gib=1e-09 holds no block"),
        (dict(slow_tier="tape"), "slow_tier='tape' is unknown; allowed: ram, file"),
        (dict(slow_eviction="fifo"), "slow_eviction='fifo' is unknown; allowed: arc, lru"),
        (dict(slow_kv_bits=3), "slow_kv_bits=3 is invalid"),
        (dict(slow_tier="file", slow_path="/no/such/folder"), "is not a folder"),
    ],
)
def test_a_tier_that_cannot_be_made_is_refused_when_the_cache_is_built(
    options, message, tiny_llama
):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        build_cache("tiered", tiny_llama.cache_spec(), options)


def test_a_file_tier_in_a_folder_it_cannot_write_is_refused(tiny_llama, tmp_path, monkeypatch):
    real = os.access
    monkeypatch.setattr(
        os, "access", lambda p, mode: False if str(p) == str(tmp_path) else real(p, mode)
    )
    with pytest.raises(ValueError, match="is not writable"):
        build_cache(
            "tiered", tiny_llama.cache_spec(), dict(slow_tier="file", slow_path=str(tmp_path))
        )


def conversations(vocab: int, count: int = 3, turns: int = 3) -> list[Conversation]:
    return [
        Conversation(
            tokens(20, 30 + c, vocab),
            [tokens(3, 40 + 10 * c + t, vocab) for t in range(turns)],
            2.0 * c,
        )  # fmt: skip
        for c in range(count)
    ]


def test_conversations_turn_by_turn_under_a_budget(tiny_llama):
    """Every turn's prompt is the conversation so far and its answer is what the model
    generates alone for it; a turn arrives think_s after the previous answer; under a pool
    of one conversation, the tiered store finds the earlier turns of each conversation in
    its slow tier where the paged store alone recomputes them."""
    vocab = tiny_llama.config.vocab_size
    talk = ConversationConfig(turns=3, document_len=20, question_len=3, answer_len=4, think_s=5)
    cfg = ServingConfig(kv_budget_bytes=pool_bytes(tiny_llama, 12), chunk=8, conversation=talk)
    alone = Engine(tiny_llama, build_cache("full", tiny_llama.cache_spec()))
    reused = {}
    for name in ("paged", "tiered"):
        cache = build_cache(name, tiny_llama.cache_spec(), dict(block_size=4))
        convs = conversations(vocab)
        result = serve_conversations(tiny_llama, cache, convs, cfg, FakeClock())
        assert len(result.turns) == 9
        for t in result.turns:
            seq, c = t.seq, convs[t.conversation]
            if t.turn == 0:
                assert list(seq.request.prompt) == c.document + c.questions[0]
                assert seq.times.arrival_s == c.start_s
            else:
                key = (t.conversation, t.turn - 1)
                before = next(p.seq for p in result.turns if (p.conversation, p.turn) == key)
                assert list(seq.request.prompt) == [*before.tokens, *c.questions[t.turn]]
                assert seq.times.arrival_s == before.times.finished_s + 5
            want = alone.generate(
                [list(seq.request.prompt)], GenerationConfig(4, stop_on_eos=False)
            )
            assert seq.output == want.tokens[0], (name, t.conversation, t.turn)
        metrics = result.metrics()
        reused[name] = metrics["turn2/reused_tokens"] + metrics["turn3/reused_tokens"]
    assert result.tiers["slow_hit_blocks"] > 0
    assert reused["tiered"] > reused["paged"]


@pytest.mark.parametrize("name", ["paged", "tiered"])
def test_preemption_swaps_or_recomputes_as_asked(name, tiny_llama):
    """Two requests outgrow a pool of 5 blocks and the later one is preempted: with
    ``preemption=swap`` its full blocks come back at its next admission (a tiered store
    from its slow tier after the first request took their room), with ``recompute`` it
    starts over; both generate what they generate alone."""
    requests = [Request(i, 0.0, tuple(tokens(7, 60 + i, tiny_llama.config.vocab_size)), 8)
                for i in range(2)]  # fmt: skip
    alone = Engine(tiny_llama, build_cache("full", tiny_llama.cache_spec()))
    found = {}
    for preemption in ("swap", "recompute"):
        cfg = ServingConfig(kv_budget_bytes=pool_bytes(tiny_llama, 5), preemption=preemption)
        cache = build_cache(name, tiny_llama.cache_spec(), dict(block_size=4))
        result = serve(tiny_llama, cache, requests, cfg, FakeClock())
        assert result.preemptions == 1
        found[preemption] = result.seqs[1].cached
        for seq, request in zip(result.seqs, requests, strict=True):
            want = alone.generate([list(request.prompt)], GenerationConfig(8, stop_on_eos=False))
            assert seq.output == want.tokens[0]
    assert found["recompute"] == 0
    assert found["swap"] == (8 if name == "tiered" else 0)  # prompt + 2 tokens: 2 full blocks


def test_an_unknown_preemption_is_refused():
    with pytest.raises(ValueError, match="workload.serving.preemption.*swap, recompute"):
        ServingConfig(kv_budget_gib=1, preemption="evict")


@pytest.mark.parametrize(
    "options",
    [
        {},
        dict(slow_kv_bits=8, slow_kv_group_size=8),
        dict(slow_kv_bits=4, slow_kv_group_size=16),
        dict(kv_bits=8, kv_group_size=8, slow_kv_bits=2, slow_kv_group_size=8),
    ],  # fmt: skip
    ids=str,
)
def test_the_memory_model_predicts_each_tiers_block_bytes(options, tiny_checkpoints):
    """The memory model's bytes of a block in the pool and in the slow tier, from the
    codecs' parts, against the tensors a tiered cache holds (within 5%)."""
    from kvlab import load_model
    from kvlab.analysis.memory import Architecture, load_config, tier_block_bytes

    path = tiny_checkpoints["llama"]
    model, _ = load_model(str(path))
    arch = Architecture.from_config(load_config(str(path / "config.json")))
    cache = build_cache("tiered", model.cache_spec(), options)
    cache.serve(2**22, 32)
    predicted = tier_block_bytes(arch, options, model.cache_spec().dtype)
    assert predicted["fast"] == pytest.approx(cache.store._pool_block_bytes(), rel=0.05)
    assert predicted["slow"] == pytest.approx(cache.store.tier.record_bytes, rel=0.05)
