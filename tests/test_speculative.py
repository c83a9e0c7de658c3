"""Speculative decoding with prompt-lookup drafts: the drafts themselves, greedy output
equal to plain decoding over every strategy that rolls back (exact settings: to the plain
run; lossy: to the same strategy without speculation; KIVI codes with a ring margin of k),
the sampling rule's algebra, the statistics, and refusals before anything runs."""

from __future__ import annotations

import pytest
import torch

from kvlab.cache import build_cache
from kvlab.engine import Engine, GenerationConfig, SamplingConfig
from kvlab.engine.metrics import generation_metrics
from kvlab.engine.sampling import probabilities
from kvlab.speculative import SpecConfig
from kvlab.speculative.accept import accepted, residual
from kvlab.speculative.ngram import propose

NGRAM = SpecConfig("ngram", num_speculative_tokens=3, max_ngram=3, min_ngram=1)
# Settings of the strategies that roll back (test_cache_contract's exact and lossy ones)
EXACT = {
    "full": {},
    "paged": dict(block_size=3),
    "quest": dict(block_size=4, token_budget=256),
    "int4": dict(group_size=4, residual=256),
    "sliding": dict(sinks=2, window=256),
    "gqa_shared": dict(factor=1),
}
LOSSY = {
    "int8": dict(group_size=4, residual=8, rollback=3),
    "paged": dict(block_size=4, kv_bits=4, kv_group_size=8),
    "full": dict(kv_bits=8, kv_format="e4m3", kv_group_size=8),
    "gqa_shared": dict(factor=2),
    "sliding": dict(sinks=2, window=6, rollback=3),  # the ring wraps: a margin of k slots
    "evict": dict(scorer="snapkv", ratio=0.5, window=2, kernel=3),  # compressed at prefill
}


def test_prompt_lookup_takes_the_longest_suffix_and_its_latest_occurrence():
    assert propose([1, 2, 3, 4, 1, 2], 3, 3, 1) == [3, 4, 1]  # [1, 2] once before: 3, 4, 1
    assert propose([5, 6, 7, 5, 6, 8, 5, 6], 2, 2, 1) == [8, 5]  # latest of two [5, 6]
    assert propose([9, 1, 2, 7, 2, 1, 2], 2, 3, 1) == [7, 2]  # [1, 2] beats [2]
    assert propose([1, 2, 3], 4, 3, 1) == []  # 3 never occurred before
    assert propose([1, 2, 1], 0, 3, 1) == []  # no room for a draft
    assert propose([4, 4, 4, 4], 5, 2, 2) == [4]  # the continuation ends with the tokens


def repetitive_prompts(vocab: int) -> list[list[int]]:
    """Prompts that quote themselves (prompt lookup's home) and one that does not."""
    gen = torch.Generator().manual_seed(11)
    passage = torch.randint(0, vocab, (9,), generator=gen).tolist()
    other = torch.randint(0, vocab, (7,), generator=gen).tolist()
    return [passage + passage[:5], other + passage + other[:3], passage[2:] + passage]


GREEDY = SamplingConfig()


def run(model, name, options, prompts, spec=None, new=12, sampling=GREEDY):
    engine = Engine(model, build_cache(name, model.cache_spec(), options))
    cfg = GenerationConfig(new, sampling, stop_on_eos=False, spec=spec or SpecConfig())
    return engine.generate(prompts, cfg)


@pytest.mark.parametrize(("name", "options"), sorted(EXACT.items()))
def test_greedy_speculation_gives_plain_greedy_text_on_exact_strategies(name, options, tiny_llama):
    prompts = repetitive_prompts(tiny_llama.config.vocab_size)
    plain = run(tiny_llama, "full", {}, prompts).tokens
    for batch in ([prompts[0]], prompts):
        speculative = run(tiny_llama, name, options, batch, NGRAM)
        assert speculative.tokens == plain[: len(batch)]
        assert speculative.stats.drafted > 0


@pytest.mark.parametrize(("name", "options"), sorted(LOSSY.items()), ids=sorted(LOSSY))
def test_greedy_speculation_keeps_a_lossy_strategys_own_text(name, options, tiny_llama):
    prompts = repetitive_prompts(tiny_llama.config.vocab_size)
    plain = run(tiny_llama, name, options, prompts).tokens
    assert run(tiny_llama, name, options, prompts, NGRAM).tokens == plain


def test_speculation_drafts_accepts_and_reports_per_token_latency(tiny_llama):
    prompts = repetitive_prompts(tiny_llama.config.vocab_size)[:1]
    result = run(tiny_llama, "full", {}, prompts, NGRAM, new=24)
    stats = result.stats
    assert 0 < stats.accepted <= stats.drafted
    assert sum(stats.step_tokens) == 24 - 1  # the first token comes from the prefill
    assert len(stats.step_s) < 23  # some steps emitted several tokens
    metrics = generation_metrics(stats)
    assert metrics["spec/acceptance_rate"] == stats.accepted / stats.drafted
    assert metrics["spec/tokens_per_step"] == pytest.approx(23 / len(stats.step_s))
    assert metrics["spec/mean_accepted"] == stats.accepted / len(stats.step_s)
    assert len(stats.draft_s) == len(stats.verify_s) == len(stats.step_s)
    assert metrics["spec/draft_ms"] + metrics["spec/verify_ms"] == pytest.approx(
        1e3 * sum(stats.step_s) / len(stats.step_s)
    )
    per_token = [s / n for s, n in zip(stats.step_s, stats.step_tokens, strict=True)]
    assert metrics["itl_ms"] == pytest.approx([s * 1e3 for s in per_token])


def test_the_rejection_rule_emits_the_models_distribution():
    """Draft d kept with probability p(d), else a token from p without d: in all, p."""
    gen = torch.Generator().manual_seed(0)
    p = torch.rand(50, generator=gen).softmax(dim=0)
    for draft in (0, int(p.argmax()), 17):
        emitted = p[draft] * torch.nn.functional.one_hot(torch.tensor(draft), 50)
        emitted = emitted + (1 - p[draft]) * residual(p, draft)
        torch.testing.assert_close(emitted, p, atol=1e-7, rtol=0)
        assert residual(p, draft)[draft] == 0


def test_the_first_token_under_speculation_has_the_models_distribution(tiny_llama):
    """On the tiny model's own next-token distribution (temperature and top-k applied):
    P(emit t) = P(draft kept) 1[t = d] + P(rejected) residual(t), exactly p, for a draft
    the model likes, one it does not, and one top-k filtered out."""
    ids = torch.tensor([repetitive_prompts(tiny_llama.config.vocab_size)[0]])
    cache = build_cache("full", tiny_llama.cache_spec())
    cache.allocate(1, ids.shape[1])
    positions = torch.arange(ids.shape[1])[None]
    with torch.inference_mode():
        logits = tiny_llama(ids, positions, cache)[0, -1:]  # (1, V)
    for cfg in (SamplingConfig(temperature=0.7), SamplingConfig(temperature=1.0, top_k=20)):
        p = probabilities(logits, cfg)[0].double()
        p = p / p.sum()  # a distribution in double precision
        order = p.argsort(descending=True).tolist()
        for draft in (order[0], order[5], order[-1]):
            emitted = p[draft] * torch.nn.functional.one_hot(torch.tensor(draft), len(p))
            emitted = emitted + (1 - p[draft]) * residual(p, draft)
            torch.testing.assert_close(emitted, p, atol=1e-12, rtol=0)


def test_sampled_speculation_follows_the_rule_and_greedy_limit(tiny_llama):
    logits = torch.tensor([[0.0, 9.0, 0.0], [9.0, 0.0, 0.0], [0.0, 0.0, 9.0]])
    gen = torch.Generator().manual_seed(0)
    greedy = SamplingConfig()
    assert accepted(logits, [1, 0], greedy, gen) == [1, 0, 2]
    assert accepted(logits, [1, 2], greedy, gen) == [1, 0]
    one_hot = SamplingConfig(temperature=1.0, top_k=1, seed=3)  # sampling that is greedy
    prompts = repetitive_prompts(tiny_llama.config.vocab_size)
    plain = run(tiny_llama, "full", {}, prompts).tokens
    assert run(tiny_llama, "paged", {}, prompts, NGRAM, sampling=one_hot).tokens == plain
    warm = SamplingConfig(temperature=0.8, seed=3)
    sampled = run(tiny_llama, "full", {}, prompts, NGRAM, sampling=warm)
    assert [len(t) for t in sampled.tokens] == [12, 12, 12]
    assert all(0 <= t < tiny_llama.config.vocab_size for row in sampled.tokens for t in row)


@pytest.mark.parametrize(
    ("name", "options", "message"),
    [
        ("evict", dict(when="decode", ratio=0.5), "cache=evict cannot: decode-time compression"),
        ("compressed", {}, "cache=compressed cannot: an entry pools"),
        ("nocache", {}, "cache=nocache cannot: cache=nocache keeps no exact history"),
        ("sliding", dict(sinks=2, window=6), "rolled back by 3 .* rows here reach 31 tokens"),
        ("sliding", dict(sinks=2, window=6, rollback=2), "allowed: cache.options.rollback >= 3"),
        ("int8", dict(group_size=4, residual=8), "allowed: cache.options.rollback >= 3 and"),
        ("int8", dict(group_size=4, residual=3, rollback=3), "cache.options.residual > 3"),
        ("quest", dict(block_size=2, token_budget=6), "quest selects blocks for one-token"),
    ],
)
def test_a_cache_that_cannot_roll_back_is_refused_before_running(
    name, options, message, tiny_llama
):
    prompts = repetitive_prompts(tiny_llama.config.vocab_size)
    with pytest.raises(ValueError, match=message):
        run(tiny_llama, name, options, prompts, NGRAM)


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        (dict(method="medusa"), r"spec.method='medusa' is invalid; allowed: \('none', 'ngram'"),
        (dict(method="layerskip"), "spec.layers=0 with spec.method='layerskip' is invalid"),
        (dict(method="ngram", layers=4), "allowed: layers >= 1 .* with layerskip, 0 otherwise"),
        (dict(method="model"), "spec.model='' with spec.method='model' is invalid"),
        (dict(num_speculative_tokens=0), "spec.num_speculative_tokens=0 must be >= 1"),
        (dict(min_ngram=3, max_ngram=2), "spec.min_ngram=3, spec.max_ngram=2 are invalid"),
    ],
)
def test_bad_speculation_options_name_the_field(fields, message):
    with pytest.raises(ValueError, match=message):
        SpecConfig(**fields)
