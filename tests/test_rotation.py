"""``rotate: hadamard``: K and V rotated per head before encoding, the query with them and
the output back. With exact storage every strategy computes what it does unrotated; with
codes, rotation spreads an outlier channel so per-group scales lose less; compositions
where rotation would change the computation are refused with the reason."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from kvlab.cache import build_cache
from kvlab.cache.codecs.rotation import hadamard
from kvlab.cache.codecs.token import TokenCodec
from kvlab.engine import Engine, GenerationConfig

PROMPTS = [list(range(3, 30)), list(range(40, 52))]
EXACT = {
    "full": {},
    "paged": dict(block_size=4),
    "sliding": dict(sinks=2, window=8),
    "gqa_shared": dict(factor=2),
    "quest": dict(block_size=4, token_budget=64),
    "evict": dict(scorer="snapkv", ratio=0.5),
    "int4": dict(group_size=4, residual=64),
}


def logits_of(model, name, options):
    seen = []
    engine = Engine(model, build_cache(name, model.cache_spec(), options))
    cfg = GenerationConfig(6, stop_on_eos=False, prefill_chunk=8)
    engine.generate(PROMPTS, cfg, on_logits=lambda logits, rows: seen.append(logits.clone()))
    return torch.cat(seen)


@pytest.mark.parametrize(("name", "options"), sorted(EXACT.items()))
def test_rotated_exact_storage_attends_as_unrotated(name, options, tiny_llama):
    plain = logits_of(tiny_llama, name, options)
    rotated = logits_of(tiny_llama, name, options | {"rotate": "hadamard"})
    torch.testing.assert_close(rotated, plain, atol=1e-5, rtol=0)


def test_rotation_spreads_an_outlier_channel_before_per_group_codes():
    """Keys with one channel 50x the others: int4 codes in groups of 32 channels lose far
    less of them rotated (and rotated back) than as they are."""
    gen = torch.Generator().manual_seed(0)
    keys = torch.randn(1, 2, 16, 64, generator=gen)  # (B, H_kv, T, D)
    keys[..., 5] *= 50
    codec, h = TokenCodec(4, 32, 64), hadamard(64, torch.float32, torch.device("cpu"))
    plain = (codec.round_trip(keys) - keys).norm()
    rotated = (codec.round_trip(keys @ h) @ h.T - keys).norm()
    assert rotated < 0.5 * plain
    torch.testing.assert_close(h @ h.T, torch.eye(64), atol=1e-6, rtol=0)


def test_rotated_codes_run_in_every_codec(tiny_llama):
    """Token codes, fp8 and KIVI take the option; their outputs stay finite and close."""
    plain = logits_of(tiny_llama, "full", {})
    for name, options in (
        ("full", dict(kv_bits=4, kv_group_size=16)),
        ("full", dict(kv_bits=8, kv_format="e4m3", kv_group_size=16)),
        ("int4", dict(group_size=4, residual=0)),
    ):
        rotated = logits_of(tiny_llama, name, options | {"rotate": "hadamard"})
        assert rotated.isfinite().all() and (rotated - plain).abs().mean() < 0.5, name


@pytest.mark.parametrize(
    ("name", "options", "message"),
    [
        ("compressed", {}, "rotate='hadamard' with cache=compressed: its entries are pooled"),
        ("sliding", dict(positions="cache"), "positions='cache' with rollback=0, rotate='hadam"),
        ("full", dict(rotate="givens"), r"rotate='givens' is invalid; allowed: \('none'"),
    ],
)
def test_rotation_that_would_change_the_computation_is_refused(name, options, message, tiny_llama):
    options = {"rotate": "hadamard"} | options
    with pytest.raises(ValueError, match=message):
        build_cache(name, tiny_llama.cache_spec(), options)


def test_a_head_dim_that_is_not_a_power_of_two_is_refused(tiny_llama):
    spec = dataclasses.replace(tiny_llama.cache_spec(), head_dim=48)
    with pytest.raises(ValueError, match="power-of-two head_dim, and this model's is 48"):
        build_cache("full", spec, dict(rotate="hadamard"))
