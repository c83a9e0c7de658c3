"""The memory model against the seeds' figures (derived from the shipped configs, never
hard-coded) and against kvlab's own measured KV bytes on the default model."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from kvlab.analysis.memory import (
    GIB,
    Architecture,
    kv_bytes,
    load_config,
    max_batch,
    nominal_weight_bytes,
    parameter_count,
    reference_configs,
    weight_bytes,
)
from kvlab.cache import build_cache, registered
from kvlab.engine import Engine, GenerationConfig

MILLION_TOKENS = 2**20  # the seeds' "1M-token context"


def arch(name: str) -> Architecture:
    return Architecture.from_config(load_config(name))


def test_llama2_13b_holds_819200_fp16_bytes_per_token():
    a = arch("llama-2-13b")
    assert sum(kv_bytes(a, "full", context=1, dtype=torch.float16).values()) == 819_200
    at_4k = sum(kv_bytes(a, "full", context=4096, dtype=torch.float16).values())
    assert at_4k / GIB == pytest.approx(3.125)  # "about 3.1 GiB at 4K tokens"


def test_7b_weights_at_each_width_are_28_14_7_and_3_5_gb():
    assert [nominal_weight_bytes(7e9, bits) / 1e9 for bits in (32, 16, 8, 4)] == [28, 14, 7, 3.5]
    assert parameter_count(arch("llama-2-7b")) == 6_738_415_616  # what "7B" rounds


def test_deepseek_kv_at_one_million_tokens_matches_the_reports():
    v4_pro = sum(kv_bytes(arch("deepseek-v4-pro"), "native", context=MILLION_TOKENS).values())
    v32 = sum(kv_bytes(arch("deepseek-v3.2"), "native", context=MILLION_TOKENS).values())
    assert round(v4_pro / GIB, 2) == 9.62
    assert round(v32 / GIB, 1) == 83.9
    assert 0.1 <= v4_pro / v32 <= 0.12  # "V4-Pro needs about 10% of V3.2's KV cache"


def test_reference_parameter_counts_are_the_published_sizes():
    published = {"llama-2-13b": 13.0e9, "llama-3-8b": 8.03e9, "mistral-7b": 7.24e9,
                 "qwen2.5-7b": 7.62e9, "deepseek-v3.2": 671e9}  # fmt: skip
    for name, size in published.items():
        assert parameter_count(arch(name)) == pytest.approx(size, rel=0.01), name


def test_every_reference_config_loads():
    for name in reference_configs():
        assert sum(kv_bytes(arch(name), "full" if arch(name).kind == "gqa" else "native").values())


def test_quantized_weights_shrink_by_their_bits():
    from kvlab.quant import quant_options

    a = arch("llama-2-7b")
    full = weight_bytes(a, "none", dtype=torch.float16)
    assert full == 2 * parameter_count(a)
    linear_share = 1 - 2 * 32000 * 4096 / parameter_count(a)  # embeddings and head stay fp16
    for quant, options, bits in [("rtn", {"bits": 8}, 8), ("rtn", {"group_size": 64}, 4.5),
                                 ("bnb", {"mode": "nf4"}, 4.5)]:  # fmt: skip
        expected = 1 - linear_share * (1 - bits / 16)
        got = weight_bytes(a, quant, quant_options(quant, options), torch.float16) / full
        assert got == pytest.approx(expected, rel=0.01), (quant, options)


def test_max_batch_is_what_fits_beside_the_weights():
    a = arch("llama-2-13b")
    per_seq = sum(kv_bytes(a, "full", context=4096).values())
    weights = weight_bytes(a, "none")
    budget = weights + 5 * per_seq + per_seq // 2
    assert max_batch(a, "full", None, 4096, budget, weights) == 5
    assert max_batch(a, "nocache", None, 4096, budget, weights) is None


# Each strategy's bytes by hand for the tiny model (2 layers, 2 KV heads of 16 dims, fp32),
# written from the layouts the strategies document, not from their code: the memory model
# (planned_bytes) and what a generation really holds must both equal them.
L, H, D, F32 = 2, 2, 16, 4
HAND_OPTIONS = {name: cls.tests.memory_options for name, cls in registered().items()}
HAND_FORMULAS = {"full", "nocache", "gqa_shared", "int8", "int4", "int2", "sliding", "paged",
                 "quest", "evict", "compressed"}  # fmt: skip


def hand_bytes(name: str, batch: int, tokens: int) -> int:
    rows = lambda n, width=D, size=F32: batch * H * n * width * size  # noqa: E731
    if name == "nocache":
        return 0
    if name in ("full", "gqa_shared"):
        heads = H // (2 if name == "gqa_shared" else 1)
        return 2 * L * batch * heads * tokens * D * F32
    if name.startswith("int"):  # codes + scales per group of 4 + an exact ring of 6 + 4 + 1
        bits, slots = int(name[3:]), -(-tokens // 4) * 4 + 4
        words = rows(slots, D * bits // 32)
        key_scales = 2 * rows(slots // 4) if name != "int2" else 2 * rows(slots, D // 4)
        value_scales = 2 * rows(slots, D // 4)
        return L * (2 * words + key_scales + value_scales + 2 * rows(6 + 4 + 1))
    if name == "sliding":  # sinks + window + a trash slot, and the position of each slot
        slots = min(2 + 6, tokens) + 1
        return L * 2 * rows(slots) + batch * slots * 8
    if name in ("paged", "quest"):  # blocks for every row at full length + one per row +
        per_row = -(-tokens // 4)  # trash, table; quest: a key min and max per block and head
        blocks = batch * per_row + batch + 1
        bounds = L * blocks * H * 2 * D * F32 if name == "quest" else 0
        return L * 2 * blocks * H * 4 * D * F32 + batch * per_row * 8 + bounds
    if name == "evict":  # every token kept: 23 per head in blocks of 16, table + count
        blocks = -(-tokens // 16)
        return L * 2 * rows(blocks * 16) + L * batch * H * (blocks + 1) * 8
    assert name == "compressed"  # window (1 sink + 3) + CSA (ratio 2) and HCA (ratio 4)
    window = L * 2 * rows(1 + 3 + 1) + batch * (1 + 3 + 1) * 8
    csa = 2 * rows(tokens // 2 + 1) + 2 * rows(4 + 1)  # entries + trash, raw span 4 + trash
    hca = 2 * rows(tokens // 4 + 1) + 2 * rows(4 + 1)
    return window + csa + hca


def test_the_hand_formulas_are_of_registered_strategies():
    assert set(HAND_FORMULAS) <= set(registered())


@pytest.mark.parametrize("name", sorted(HAND_OPTIONS))
def test_planned_and_held_bytes_equal_the_hand_formula(name, tiny_llama):
    """Every strategy's memory model equals what it holds; the built-ins' also equal a hand
    formula (a strategy added later is checked against its tensors alone)."""
    spec, options = tiny_llama.cache_spec(), HAND_OPTIONS[name]
    batch = [[5] * 11, [7] * 17, [9] * 3]
    tokens = max(map(len, batch)) + 6  # what the engine allocates: longest prompt + new
    cache = build_cache(name, spec, options)
    held = Engine(tiny_llama, cache).generate(batch, GenerationConfig(6, stop_on_eos=False))
    planned = sum(type(cache).planned_bytes(spec, cache.options, 3, tokens).values())
    if name in HAND_FORMULAS:
        assert planned == hand_bytes(name, 3, tokens)
    assert held.stats.kv_peak.held_bytes == (0 if not cache.stores_past else planned)


def test_memory_command_prints_both_tables():
    out = subprocess.run(
        [sys.executable, "-m", "kvlab.cli", "memory", "llama-2-13b", "--budget-gib", "80"],
        capture_output=True, text=True, check=True,
    ).stdout  # fmt: skip
    assert "819200.00" in out and "max_batch" in out and "weight_gib" in out


@pytest.mark.parametrize(
    ("quant", "options"),
    [
        ("none", {}),
        ("rtn", {"bits": 8}),
        ("rtn", {"group_size": 32}),
        ("bnb", {"mode": "nf4"}),
        ("bnb", {"mode": "int8"}),
    ],  # fmt: skip
)
def test_model_agrees_with_measured_weight_bytes_on_the_default_model(quant, options):
    """The weight line of each quantizer against the bytes the quantized model holds."""
    from kvlab import load_model
    from kvlab.engine.metrics import weight_bytes as measured_bytes
    from kvlab.quant import quant_options, quantize_

    if quant == "bnb":
        pytest.importorskip("bitsandbytes")
    model, _ = load_model("smollm2-135m", cpu_prepack=False)
    quantize_(model, quant, options)
    planned = weight_bytes(
        arch("smollm2-135m"), quant, quant_options(quant, options), torch.float32
    )
    assert planned == pytest.approx(measured_bytes(model), rel=0.001)
