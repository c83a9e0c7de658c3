"""``sliding`` against a from-scratch reference: full recomputation of every step with the
StreamingLLM mask (sinks + the last ``window`` tokens), however the prompt is fed."""

from __future__ import annotations

import pytest
import torch

from kvlab.cache import build_cache
from kvlab.cache.base import KVCache
from kvlab.engine import Engine, GenerationConfig
from kvlab.engine.generate import Generation

SINKS, WINDOW = 2, 5


class BandRecompute(KVCache):
    """Test reference: keeps nothing; the engine re-feeds the sequence and every query
    attends to the sinks and to the WINDOW most recent positions (itself included)."""

    name = "band_recompute"
    stores_past = False

    def attend(self, step, layer, q, k, v, k_raw):
        pos = torch.arange(q.shape[2])
        visible = (pos[None] <= pos[:, None]) & (
            (pos[None] < SINKS) | (pos[None] > pos[:, None] - WINDOW)
        )
        return torch.nn.functional.scaled_dot_product_attention(
            q,
            k.repeat_interleave(q.shape[1] // k.shape[1], 1),
            v.repeat_interleave(q.shape[1] // v.shape[1], 1),
            attn_mask=visible,
        )

    def end(self, step):
        return None  # keeps nothing

    def tensors(self):
        return []

    def used_bytes(self):
        return 0


def continuation(model, cache, prompt, chunk=0, steps=10) -> Generation:
    return Engine(model, cache).generate(
        [prompt], GenerationConfig(steps, stop_on_eos=False, prefill_chunk=chunk)
    )


@pytest.mark.parametrize("chunk", [0, 1, 3, 7])
def test_sliding_equals_band_recomputation(chunk, tiny_llama):
    prompt = list(range(3, 19))  # 16 tokens: the window cuts inside the prompt already
    reference = continuation(tiny_llama, BandRecompute(tiny_llama.cache_spec()), prompt)
    sliding = build_cache("sliding", tiny_llama.cache_spec(), dict(sinks=SINKS, window=WINDOW))
    assert continuation(tiny_llama, sliding, prompt, chunk).tokens == reference.tokens


def test_memory_is_bounded_by_sinks_plus_window(tiny_llama):
    held = []
    for steps in (4, 40):
        cache = build_cache("sliding", tiny_llama.cache_spec(), dict(sinks=SINKS, window=WINDOW))
        run = continuation(tiny_llama, cache, list(range(3, 19)), steps=steps)
        held.append(run.stats.kv_peak.held_bytes)
    assert held[0] == held[1]
    # by hand: 2 layers x (K, V) x 2 KV heads x (sinks + window + 1 trash slot) x 16 dims x
    # 4 bytes, and one int64 position per slot
    slots = SINKS + WINDOW + 1
    assert held[1] == 2 * 2 * 2 * slots * 16 * 4 + slots * 8


def test_sinks_are_kept(tiny_llama):
    cache = build_cache("sliding", tiny_llama.cache_spec(), dict(sinks=SINKS, window=WINDOW))
    cache.allocate(1, 64)
    engine = Engine(tiny_llama, cache)
    engine.prefill([list(range(3, 23))], chunk=20)
    held = sorted(p for p in cache.store.slot_pos[0].tolist() if p >= 0)
    assert held == [0, 1, *range(20 - WINDOW, 20)]


class CachePositionsRecompute(BandRecompute):
    """Test reference for StreamingLLM's positions within the cache, query by query: the
    visible keys (sinks, then the window in order) get positions 0, 1, ... from their raw,
    un-rotated form, and the query takes the next position."""

    def attend(self, step, layer, q, k, v, k_raw):
        from kvlab.models.rope import RotaryTables

        rope = step.info.rope
        group = q.shape[1] // k.shape[1]
        q_raw = RotaryTables(rope.inv_freq, -step.info.positions, q.dtype)
        q_raw = q_raw.rotate_heads_first(q)
        outs = []
        for i in range(q.shape[2]):
            seen = [j for j in range(i + 1) if j < SINKS or j > i - WINDOW]
            at = torch.arange(len(seen))[None]  # positions within the cache
            keys = RotaryTables(rope.inv_freq, at, q.dtype).rotate_heads_first(k_raw[:, :, seen])
            query = RotaryTables(rope.inv_freq, at[:, -1:], q.dtype).rotate_heads_first(
                q_raw[:, :, i : i + 1]
            )
            outs.append(
                torch.nn.functional.scaled_dot_product_attention(
                    query,
                    keys.repeat_interleave(group, 1),
                    v[:, :, seen].repeat_interleave(group, 1),
                )
            )
        return torch.cat(outs, dim=2)


@pytest.mark.parametrize("chunk", [0, 1, 4])
def test_cache_positions_equal_streamingllm_reference(chunk, tiny_llama):
    prompt = list(range(3, 19))
    reference = continuation(tiny_llama, CachePositionsRecompute(tiny_llama.cache_spec()), prompt)
    options = dict(sinks=SINKS, window=WINDOW, positions="cache")
    sliding = build_cache("sliding", tiny_llama.cache_spec(), options)
    assert continuation(tiny_llama, sliding, prompt, chunk).tokens == reference.tokens


def one_pass_logits(model, cache, ids):
    cache.allocate(1, ids.shape[1])
    with torch.inference_mode():
        return model(ids, torch.arange(ids.shape[1])[None], cache)


def test_cache_positions_logits_match_and_differ_from_original(tiny_llama):
    ids = torch.tensor([list(range(3, 19))])
    spec = tiny_llama.cache_spec()
    options = dict(sinks=SINKS, window=WINDOW, positions="cache")
    cache_mode = one_pass_logits(tiny_llama, build_cache("sliding", spec, options), ids)
    reference = one_pass_logits(tiny_llama, CachePositionsRecompute(spec), ids)
    original = one_pass_logits(tiny_llama, BandRecompute(spec), ids)
    assert (cache_mode - reference).abs().max() <= 1e-4
    assert (original - reference).abs().max() > 1e-3  # the two schemes really differ


@pytest.mark.parametrize("chunk", [0, 3])
def test_a_mixed_length_batch_equals_the_per_query_band_reference(chunk, tiny_llama):
    """Rows of 16, 9 and 4 tokens (the window cuts two of them inside the prompt), fed in
    one pass or in chunks, decode what per-query band recomputation gives each row."""
    batch = [list(range(3, 19)), list(range(40, 49)), list(range(60, 64))]
    cfg = GenerationConfig(8, stop_on_eos=False, prefill_chunk=chunk)
    reference = Engine(tiny_llama, BandRecompute(tiny_llama.cache_spec())).generate(batch, cfg)
    sliding = build_cache("sliding", tiny_llama.cache_spec(), dict(sinks=SINKS, window=WINDOW))
    assert Engine(tiny_llama, sliding).generate(batch, cfg).tokens == reference.tokens


@pytest.mark.parametrize(
    "options",
    [dict(window=6), dict(window=6, sinks=2), dict(window=5, sinks=1, rollback=3)],
    ids=["window", "sinks", "rollback"],
)
def test_a_decode_plan_from_the_host_equals_the_tensor_plan(options, tiny_llama):
    """Window.plan of a one-token step, worked out on the host, gives the tensors of the
    tensor-op plan: rows holding nothing, within the sinks, within the window, past it
    (the ring wrapped), and a padding row with no token."""
    from kvlab.cache.base import StepInfo

    cache = build_cache("sliding", tiny_llama.cache_spec(), options)
    cache.allocate(6, 64)
    lengths, num_new = [0, 1, 4, 9, 23, 17], [1, 1, 1, 1, 1, 0]
    info = StepInfo(torch.tensor(lengths)[:, None], num_new, rope=None)
    host = cache.policy._one_token_plan(info, lengths, cache.store)
    tensors = cache.policy._tensor_plan(info, lengths, cache.store)
    pairs = [(host.where.slots, tensors.where.slots), (host.where.rows, tensors.where.rows),
             (host.where.positions, tensors.where.positions)]  # fmt: skip
    for name in ("start", "end", "positions", "kept", "filled", "origin"):
        pairs.append((getattr(host, name), getattr(tensors, name)))
    for found, expected in pairs:
        assert found.dtype == expected.dtype and torch.equal(found, expected)
    assert host.mask is tensors.mask is None and host.to_cache is tensors.to_cache is None
