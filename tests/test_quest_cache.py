"""``quest`` (Tang et al., ICML 2024): its bound never undershoots q·k, a decode step attends
exactly the blocks the bound ranks first (against a dense reference computed from the
keys themselves), a budget that covers the sequence is ``paged``, and bad budgets fail."""

from __future__ import annotations

import pytest
import torch

from kvlab.cache import build_cache
from kvlab.cache.policies.quest import upper_bounds
from kvlab.engine import Engine, GenerationConfig

GEN = torch.Generator().manual_seed(5)


def test_the_bound_is_at_least_every_score_in_its_block():
    queries = torch.randn(2, 3, 4, 16, generator=GEN)  # (B, H_kv, G, D)
    keys = torch.randn(2, 5, 3, 8, 16, generator=GEN)  # (B, P, H_kv, block, D)
    low, high = keys.amin(dim=3), keys.amax(dim=3)
    bound = upper_bounds(queries, low, high)  # (B, H_kv, P)
    best = torch.einsum("bhgd,bphtd->bhgpt", queries, keys).amax(-1).sum(2)  # (B, H_kv, P)
    assert (bound >= best - 1e-5).all()  # each head's bound >= its best score in the block
    single = keys[:, :, :, :1]  # a block of one token: the bound is the score itself
    one = upper_bounds(queries, single.amin(3), single.amax(3))
    torch.testing.assert_close(one, torch.einsum("bhgd,bphd->bhp", queries, single[:, :, :, 0]))


def reference_decode(q, keys, values, block: int, budget: int) -> torch.Tensor:
    """One decode query per row over dense keys/values (B, H_kv, L, D) of L tokens (the
    step's own included): each KV head reads its top (budget // block - 1) full blocks by
    the bound, and the newest block."""
    batch, kv_heads, length, dim = keys.shape
    grouped = q.reshape(batch, kv_heads, -1, dim)  # (B, H_kv, G, D)
    current = (length - 1) // block
    full = keys[:, :, : current * block].reshape(batch, kv_heads, current, block, dim)
    low, high = full.amin(3).transpose(1, 2), full.amax(3).transpose(1, 2)  # (B, P, H_kv, D)
    picks = min(budget // block - 1, current)
    chosen = upper_bounds(grouped, low, high).topk(picks, dim=-1).indices  # (B, H_kv, k)
    seen = torch.zeros(batch, kv_heads, length, dtype=torch.bool)
    seen[..., current * block :] = True
    for b in range(batch):
        for h in range(kv_heads):
            for c in chosen[b, h].tolist():
                seen[b, h, c * block : (c + 1) * block] = True
    mask = seen.repeat_interleave(grouped.shape[2], dim=1)[:, :, None]  # (B, H, 1, L)
    group = grouped.shape[2]
    return torch.nn.functional.scaled_dot_product_attention(
        q,
        keys.repeat_interleave(group, 1),
        values.repeat_interleave(group, 1),
        attn_mask=mask,
    )


@pytest.mark.parametrize(("block", "budget"), [(2, 6), (4, 8), (3, 9)])
def test_decode_attends_the_top_blocks_by_the_bound(tiny_llama, block, budget, layers_op_by_op):
    options = dict(block_size=block, token_budget=budget)
    cache = build_cache("quest", tiny_llama.cache_spec(), options)
    history: dict[int, list] = {}
    checked = []
    attend = cache.attend

    def checking(step, layer, q, k, v, k_raw):
        out = attend(step, layer, q, k, v, k_raw)
        seen = history.setdefault(layer, [])
        seen.append((k, v))
        if step.decode:
            keys = torch.cat([h[0] for h in seen], dim=2)
            values = torch.cat([h[1] for h in seen], dim=2)
            expected = reference_decode(q, keys, values, block, budget)
            torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
            checked.append(keys.shape[2])
        return out

    cache.attend = checking
    prompt = torch.randint(0, 256, (19,), generator=GEN).tolist()
    Engine(tiny_llama, cache).generate([prompt], GenerationConfig(6, stop_on_eos=False))
    assert max(checked) == 19 + 5  # every decode step of every layer was checked


def test_a_budget_over_the_sequence_is_paged(tiny_llama):
    prompt = torch.randint(0, 256, (21,), generator=GEN).tolist()
    cfg = GenerationConfig(8, stop_on_eos=False)
    runs = {}
    for name, options in [("paged", {}), ("quest", dict(token_budget=64))]:
        cache = build_cache(name, tiny_llama.cache_spec(), dict(block_size=4, **options))
        runs[name] = Engine(tiny_llama, cache).generate([prompt], cfg)
    assert runs["quest"].tokens == runs["paged"].tokens


def test_a_small_budget_holds_what_paged_holds_plus_the_bounds(tiny_llama):
    """Quest keeps every token (what it reads is the decode test above): its bytes are
    paged's plus a key min and max per block and KV head."""
    spec = tiny_llama.cache_spec()
    prompt = torch.randint(0, 256, (40,), generator=GEN).tolist()
    cfg = GenerationConfig(4, stop_on_eos=False)
    paged = Engine(tiny_llama, build_cache("paged", spec, dict(block_size=4)))
    paged = paged.generate([prompt], cfg)
    quest = Engine(tiny_llama, build_cache("quest", spec, dict(block_size=4, token_budget=8)))
    held = quest.generate([prompt], cfg).stats.kv_peak
    bounds = spec.num_layers * 2 * spec.num_kv_heads * spec.head_dim * 4  # per block, fp32
    blocks = paged.stats.kv_peak.details["blocks_total"] + 1
    assert held.held_bytes == paged.stats.kv_peak.held_bytes + bounds * blocks


@pytest.mark.parametrize(
    ("options", "message"),
    [
        (dict(block_size=16, token_budget=8), "token_budget=8 must be >= block_size=16"),
        (dict(token_budget=64, nonexistent=1), "nonexistent"),
    ],
)
def test_bad_budgets_fail_with_the_field(tiny_llama, options, message):
    with pytest.raises((ValueError, TypeError), match=message):
        build_cache("quest", tiny_llama.cache_spec(), options)
