"""``gqa_shared``: merged KV heads against an explicit reference, and its memory report."""

from __future__ import annotations

import pytest
import torch

from kvlab.cache import build_cache
from kvlab.engine import Engine, GenerationConfig


def test_mean_merge_equals_attention_over_averaged_heads(tiny_llama):
    spec = tiny_llama.cache_spec()  # 4 query heads, 2 KV heads
    cache = build_cache("gqa_shared", spec, dict(factor=2))
    cache.allocate(1, 8)
    q = torch.randn(1, 4, 3, 16)
    k, v = torch.randn(1, 2, 3, 16), torch.randn(1, 2, 3, 16)
    from kvlab.cache.base import StepInfo

    step = cache.plan(StepInfo(torch.arange(3)[None], [3], None))
    out = cache.attend(step, 0, q, k, v, k)
    k_shared, v_shared = k.mean(1, keepdim=True), v.mean(1, keepdim=True)  # (1, 1, 3, 16)
    reference = torch.nn.functional.scaled_dot_product_attention(
        q, k_shared.expand(1, 4, 3, 16), v_shared.expand(1, 4, 3, 16), is_causal=True
    )
    assert torch.allclose(out, reference, atol=1e-6)


@pytest.mark.parametrize("merge", ["mean", "first"])
def test_memory_shrinks_by_the_factor_and_reports_mha(merge, tiny_llama):
    cfg = GenerationConfig(4, stop_on_eos=False)
    prompt = [[5, 6, 7, 8, 9]]
    full = Engine(tiny_llama, build_cache("full", tiny_llama.cache_spec())).generate(prompt, cfg)
    merged = Engine(
        tiny_llama, build_cache("gqa_shared", tiny_llama.cache_spec(), dict(factor=2, merge=merge))
    ).generate(prompt, cfg)
    report = merged.stats.kv_peak
    assert report.held_bytes * 2 == full.stats.kv_peak.held_bytes
    assert report.details["model_gqa_bytes"] == full.stats.kv_peak.held_bytes
    assert report.details["mha_bytes"] == full.stats.kv_peak.held_bytes * 2  # 4 heads vs 2


def test_factor_must_divide_kv_heads(tiny_llama):
    with pytest.raises(ValueError, match="factor=3 must divide the model's 2 KV heads"):
        build_cache("gqa_shared", tiny_llama.cache_spec(), dict(factor=3))
