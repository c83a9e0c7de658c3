"""Contracts every registered cache strategy must keep (kvpress-style: one parametrized
suite over the registry). Exact strategies are checked against recomputation from scratch."""

from __future__ import annotations

import pytest
import torch

from kvlab.cache import build_cache, registered
from kvlab.engine import Engine, GenerationConfig

STRATEGIES = sorted(registered())
EXACT = {"full", "nocache"}  # identical logits to recomputing attention from scratch
TOLERANCE = 1e-4


def prompts(vocab: int, lengths=(11, 5, 17)) -> list[list[int]]:
    gen = torch.Generator().manual_seed(3)
    return [torch.randint(0, vocab, (n,), generator=gen).tolist() for n in lengths]


def step_logits(model, name: str, prompt: list[int], steps: int, chunk: int = 0):
    """Greedy-continue ``prompt`` and return the logits of every step (prefill included)."""
    engine = Engine(model, build_cache(name, model.cache_spec()))
    run = engine.stream([prompt], GenerationConfig(steps, stop_on_eos=False, prefill_chunk=chunk))
    seen = []
    original_emit = run._emit

    def recording_emit(logits):
        seen.append(logits.clone())
        return original_emit(logits)

    run._emit = recording_emit
    for _ in run:
        pass
    return torch.cat(seen), run.tokens[0]


def from_scratch(model, tokens: list[int]) -> torch.Tensor:
    """Logits at the last position of ``tokens`` by a full causal pass, no cache reused."""
    ids = torch.tensor([tokens])
    cache = build_cache("nocache", model.cache_spec())
    with torch.inference_mode():
        return model(ids, torch.arange(len(tokens))[None], cache)[:, -1]


@pytest.mark.parametrize("name", sorted(EXACT & set(STRATEGIES)))
def test_exact_strategy_equals_recomputation(name, tiny_llama):
    prompt = prompts(tiny_llama.config.vocab_size)[0]
    logits, generated = step_logits(tiny_llama, name, prompt, steps=12)
    for i in range(len(generated)):
        reference = from_scratch(tiny_llama, prompt + generated[:i])
        assert (logits[i] - reference[0]).abs().max() <= TOLERANCE


@pytest.mark.parametrize("name", STRATEGIES)
def test_chunked_prefill_equals_one_pass(name, tiny_llama):
    prompt = prompts(tiny_llama.config.vocab_size)[2]
    one_pass, tokens = step_logits(tiny_llama, name, prompt, steps=6)
    for chunk in (1, 4):
        chunked, chunked_tokens = step_logits(tiny_llama, name, prompt, steps=6, chunk=chunk)
        assert chunked_tokens == tokens
        assert (chunked - one_pass).abs().max() <= TOLERANCE


@pytest.mark.parametrize("name", STRATEGIES)
def test_batch_of_different_lengths_equals_separate_runs(name, tiny_llama):
    batch = prompts(tiny_llama.config.vocab_size)
    cfg = GenerationConfig(8, stop_on_eos=False)
    engine = Engine(tiny_llama, build_cache(name, tiny_llama.cache_spec()))
    together = engine.generate(batch, cfg).tokens
    alone = [engine.generate([p], cfg).tokens[0] for p in batch]
    assert together == alone


@pytest.mark.parametrize("name", STRATEGIES)
def test_memory_report_counts_held_tensors(name, tiny_llama):
    cache = build_cache(name, tiny_llama.cache_spec())
    engine = Engine(tiny_llama, cache)
    run = engine.stream(prompts(tiny_llama.config.vocab_size), GenerationConfig(4, stop_on_eos=False))
    iterator = iter(run)
    next(iterator)  # after prefill: every sequence is still in the cache
    report = cache.memory()
    assert report.held_bytes == sum(t.numel() * t.element_size() for t in cache.tensors())
    assert 0 <= report.used_bytes <= report.held_bytes
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
        prompts(tiny_llama.config.vocab_size)[:1], GenerationConfig(5, stop_on_eos=False))
    per_token = 2 * spec.num_layers * spec.num_kv_heads * spec.head_dim * 4  # fp32 K and V
    assert run.stats.kv_peak.bytes_per_token == per_token
    assert run.stats.kv_peak.tokens == 11 + 5 - 1  # the last sampled token is never fed


def test_unknown_strategy_lists_known(tiny_llama):
    with pytest.raises(ValueError, match="known: .*full"):
        build_cache("nope", tiny_llama.cache_spec())


@pytest.mark.slow
def test_full_and_nocache_agree_over_128_greedy_steps(smollm2):
    model, tokenizer = smollm2
    prompt = tokenizer("The history of the Roman Empire began")["input_ids"]
    full, full_tokens = step_logits(model, "full", prompt, steps=128)
    none, none_tokens = step_logits(model, "nocache", prompt, steps=128)
    assert full_tokens == none_tokens
    assert (full - none).abs().max() <= 1e-3  # fp32 on a real model, 128 steps of context
