"""Contracts every registered cache strategy must keep (kvpress-style: one parametrized
suite over the registry). Exact strategies are checked against recomputation from scratch."""

from __future__ import annotations

import pytest
import torch

from kvlab.cache import build_cache, registered
from kvlab.cache.base import cache_options
from kvlab.cache.codecs import CodecOptions, KiviOptions, token_formats
from kvlab.cache.composed import compositions, preset
from kvlab.cache.evict.scorers import scorers
from kvlab.cache.policies.keep_all import KeepAll
from kvlab.cache.stores.paged import PagedOptions, PagedStore
from kvlab.cache.stores.ring import RingStore
from kvlab.engine import Engine, GenerationConfig

# Every registered strategy on the tiny model (head_dim 16): its lossy setting, and a
# setting in which it keeps everything exactly (a quantizer whose full-precision residual
# covers the whole sequence), as the strategy declares them (KVCache.tests).
LOSSY = {name: cls.tests.lossy for name, cls in registered().items()}
EXACT = {name: cls.tests.exact for name, cls in registered().items()}
STRATEGIES = sorted(registered())
TOLERANCE = 1e-4


# The composition grid the registry declares: every (policy, store) preset in every token
# codec (KIVI's presets, whose codec is their own, are the int rows above), and eviction
# over quantized storage (not yet a composed preset).
def codec_settings(head_dim: int = 16) -> dict[str, dict]:
    """Exact, and every registered per-token format at each of its widths (a scale every 8
    channels where the format lets a group be chosen; its rotation where it needs one)
    that holds heads of ``head_dim`` channels."""
    settings = {"exact": {}}
    for name, kind in sorted(token_formats().items()):
        for bits in kind.bits:
            options = dict(kv_bits=bits, kv_format=name, kv_group_size=kind.block or 8)
            options |= {"rotate": kind.rotation} if kind.rotation else {}
            try:
                CodecOptions(**options).codec(head_dim)
            except ValueError:  # a format of larger blocks than this head (mxfp4's 32)
                continue
            settings[f"{name}{bits}" if len(kind.bits) > 1 else name] = options
    return settings


CODECS = codec_settings()


def composes(name: str, options: dict) -> bool:
    """Whether strategy ``name`` takes ``options`` (a policy refuses what contradicts it,
    a rotation where its entries are pooled from unrotated keys; tested apart)."""
    try:
        cache_options(name, options)
    except ValueError:
        return False
    return True


GRID = [
    pytest.param(name, {**LOSSY[name], **codec}, id=f"{name}-{codec_name}")
    for name, (_, _, codec_options) in sorted(compositions().items())
    if codec_options is CodecOptions
    for codec_name, codec in CODECS.items()
    if composes(name, {**LOSSY[name], **codec})
]
# every registered scorer through the eviction policy (lossy: what it keeps matters)
SCORED = [
    pytest.param("evict", {**LOSSY["evict"], "scorer": scorer}, id=f"evict-{scorer}")
    for scorer in sorted(scorers())
]
COMPOSED = [
    *GRID,
    *SCORED,
    pytest.param(
        "evict",
        dict(scorer="knorm", ratio=0.5, budget="adaptive", kv_bits=4, kv_group_size=8),
        id="evict-int4",
    ),
]


def test_the_grid_holds_every_store_a_policy_names():
    pairs = {(policy, store.kind) for policy, store, _ in compositions().values()}
    assert pairs == {
        (policy, kind) for policy, _, _ in compositions().values() for kind in policy.stores
    }


def test_a_choice_that_does_not_compose_is_refused_with_what_is_allowed():
    with pytest.raises(ValueError, match=r"store 'ring'; allowed: \('contiguous', 'paged'\)"):
        preset("keep_all_ring", KeepAll, RingStore)
    with pytest.raises(ValueError, match=r"store 'paged' cannot stage; allowed: \['contiguous'\]"):
        preset("kivi_paged", KeepAll, PagedStore, (PagedOptions,), codec=KiviOptions)
    assert "keep_all_ring" not in registered() and "kivi_paged" not in registered()


def prompts(vocab: int, lengths=(11, 5, 17)) -> list[list[int]]:
    gen = torch.Generator().manual_seed(3)
    return [torch.randint(0, vocab, (n,), generator=gen).tolist() for n in lengths]


def step_logits(model, name, prompt, steps, chunk=0, options=None):
    """Greedy-continue ``prompt`` and return the logits of every step (prefill included)."""
    engine = Engine(model, build_cache(name, model.cache_spec(), options))
    cfg, seen = GenerationConfig(steps, stop_on_eos=False, prefill_chunk=chunk), []
    run = engine.generate([prompt], cfg, on_logits=lambda logits, rows: seen.append(logits.clone()))
    return torch.cat(seen), run.tokens[0]


def from_scratch(model, tokens: list[int]) -> torch.Tensor:
    """Logits at the last position of ``tokens`` by a full causal pass, no cache reused."""
    ids = torch.tensor([tokens])
    cache = build_cache("nocache", model.cache_spec())
    with torch.inference_mode():
        return model(ids, torch.arange(len(tokens))[None], cache)[:, -1]


@pytest.mark.parametrize("name", STRATEGIES)
def test_exact_setting_equals_recomputation(name, tiny_llama):
    prompt = prompts(tiny_llama.config.vocab_size)[0]
    logits, generated = step_logits(tiny_llama, name, prompt, steps=12, options=EXACT[name])
    for i in range(len(generated)):
        reference = from_scratch(tiny_llama, prompt + generated[:i])
        assert (logits[i] - reference[0]).abs().max() <= TOLERANCE


@pytest.mark.parametrize("scorer", sorted(scorers()))
def test_every_scorer_evicting_nothing_equals_recomputation(scorer, tiny_llama):
    prompt = prompts(tiny_llama.config.vocab_size)[0]
    options = {**EXACT["evict"], "scorer": scorer}
    logits, generated = step_logits(tiny_llama, "evict", prompt, steps=6, options=options)
    for i in range(len(generated)):
        reference = from_scratch(tiny_llama, prompt + generated[:i])
        assert (logits[i] - reference[0]).abs().max() <= TOLERANCE


@pytest.mark.parametrize("name", STRATEGIES)
def test_chunked_prefill_equals_one_pass(name, tiny_llama):
    """Exact settings: prefill in one pass, in chunks, or token by token gives one answer.
    (A lossy cache attends exactly within a chunk and lossily to earlier chunks, as KIVI.)"""
    prompt = prompts(tiny_llama.config.vocab_size)[2]
    opts = EXACT[name]
    one_pass, tokens = step_logits(tiny_llama, name, prompt, steps=6, options=opts)
    for chunk in (1, 4):
        chunked, chunked_tokens = step_logits(tiny_llama, name, prompt, 6, chunk, opts)
        assert chunked_tokens == tokens
        assert (chunked - one_pass).abs().max() <= TOLERANCE


def recorded(engine, batch, cfg):
    """(tokens per row, logits per row and step) of one generation."""
    rows = [[] for _ in batch]

    def record(logits, prompts):
        for row, index in enumerate(prompts):
            rows[index].append(logits[row].clone())

    run = engine.generate(batch, cfg, on_logits=record)
    return run.tokens, [torch.stack(r) for r in rows]


@pytest.mark.parametrize("setting", [LOSSY, EXACT], ids=["lossy", "exact"])
@pytest.mark.parametrize("name", STRATEGIES)
def test_batch_of_different_lengths_equals_separate_runs(name, setting, tiny_llama):
    """Rows of different lengths, finishing at different steps (an EOS ends one early, so
    every strategy frees a row mid-batch): the same tokens and logits as each row alone."""
    batch = prompts(tiny_llama.config.vocab_size)
    spec, options = tiny_llama.cache_spec(), setting[name]
    free_running = Engine(tiny_llama, build_cache(name, spec, options))
    first = free_running.generate(batch[:1], GenerationConfig(8, stop_on_eos=False)).tokens[0]
    engine = Engine(tiny_llama, build_cache(name, spec, options), eos_ids=[first[2]])
    cfg = GenerationConfig(8)
    tokens, logits = recorded(engine, batch, cfg)
    assert len(tokens[0]) <= 3 < max(map(len, tokens))  # row 0 left the batch early
    for row, prompt in enumerate(batch):
        alone_tokens, alone_logits = recorded(engine, [prompt], cfg)
        assert tokens[row] == alone_tokens[0]
        assert (logits[row] - alone_logits[0]).abs().max() <= TOLERANCE


@pytest.mark.parametrize(("name", "options"), COMPOSED)
def test_composed_storage_batches_like_separate_runs(name, options, tiny_llama):
    batch = prompts(tiny_llama.config.vocab_size)
    cfg = GenerationConfig(8, stop_on_eos=False)
    engine = Engine(tiny_llama, build_cache(name, tiny_llama.cache_spec(), options))
    together = engine.generate(batch, cfg).tokens
    assert together == [engine.generate([p], cfg).tokens[0] for p in batch]


@pytest.mark.parametrize("codec", CODECS)
def test_one_policy_gives_the_same_logits_on_every_store(codec, tiny_llama):
    """keep_all over the contiguous store (``full``) and the paged store (``paged``), in one
    codec: where the K/V live does not change a number."""
    prompt, options = prompts(tiny_llama.config.vocab_size)[2], CODECS[codec]
    contiguous, tokens = step_logits(tiny_llama, "full", prompt, 8, options=options)
    paged, paged_tokens = step_logits(
        tiny_llama, "paged", prompt, 8, options=dict(block_size=4, **options)
    )
    assert paged_tokens == tokens
    assert (paged - contiguous).abs().max() <= 1e-5


@pytest.mark.parametrize(("name", "options"), [(n, LOSSY[n]) for n in STRATEGIES] + COMPOSED)
def test_memory_report_is_consistent(name, options, tiny_llama):
    cache = build_cache(name, tiny_llama.cache_spec(), options)
    engine = Engine(tiny_llama, cache)
    run = engine.stream(
        prompts(tiny_llama.config.vocab_size), GenerationConfig(4, stop_on_eos=False)
    )
    iterator = iter(run)
    next(iterator)  # after prefill: every sequence is still in the cache
    report = cache.memory()  # held bytes against hand formulas: test_memory_model.py
    assert 0 < report.used_bytes <= report.held_bytes or not cache.stores_past
    assert report.tokens == (sum(cache.lengths) if cache.stores_past else 0)


def test_full_cache_frees_finished_rows(tiny_llama):
    cache = build_cache("full", tiny_llama.cache_spec())
    cache.allocate(3, 32)
    before = cache.memory().held_bytes
    cache.free([1])
    assert cache.memory().held_bytes == before * 2 // 3
    assert len(cache.lengths) == 2


def test_full_cache_bytes_per_token(tiny_llama):
    spec = tiny_llama.cache_spec()
    run = Engine(tiny_llama, build_cache("full", spec)).generate(
        prompts(tiny_llama.config.vocab_size)[:1], GenerationConfig(5, stop_on_eos=False)
    )
    per_token = 2 * spec.num_layers * spec.num_kv_heads * spec.head_dim * 4  # fp32 K and V
    assert run.stats.kv_peak.bytes_per_token == per_token
    assert run.stats.kv_peak.tokens == 11 + 5 - 1  # the last sampled token is never fed


def test_unknown_strategy_lists_known(tiny_llama):
    with pytest.raises(ValueError, match="known: .*full"):
        build_cache("nope", tiny_llama.cache_spec())


@pytest.mark.slow
def test_full_and_nocache_agree_over_64_greedy_steps(smollm2):
    model, tokenizer = smollm2
    prompt = tokenizer("The history of the Roman Empire began")["input_ids"]
    full, full_tokens = step_logits(model, "full", prompt, steps=64)
    none, none_tokens = step_logits(model, "nocache", prompt, steps=64)
    assert full_tokens == none_tokens
    assert (full - none).abs().max() <= 1e-3  # fp32 on a real model, 64 steps of context


# The default model (head_dim 64): each strategy in a setting where it keeps everything.
DEFAULT_MODEL_EXACT = {name: cls.tests.default_exact for name, cls in registered().items()}


@pytest.mark.slow
@pytest.mark.parametrize("name", STRATEGIES)
def test_exact_settings_match_full_on_the_default_model(name, smollm2):
    model, tokenizer = smollm2
    prompt = tokenizer(
        "The tower is 324 metres tall, about the same height as an 81-storey "
        "building, and the tallest structure in Paris."
    )["input_ids"]
    reference, tokens = step_logits(model, "full", prompt, steps=8)
    logits, same_tokens = step_logits(model, name, prompt, 8, 5, DEFAULT_MODEL_EXACT[name])
    assert same_tokens == tokens
    assert (logits - reference).abs().max() <= 1e-4  # measured 2.6e-5 (chunks of 5 vs one pass)
