"""Weights moved onto huge pages keep their values, ties and views, and every decode step
reads the moved copy (the fused plans taken before the move are dropped)."""

from __future__ import annotations

import dataclasses
from dataclasses import replace

import pytest
import torch
from torch import nn

from kvlab import load_model
from kvlab.cache import build_cache
from kvlab.config import ModelConfig, QuantConfig
from kvlab.kernels import huge_pages
from kvlab.run import load_run_model
from tests.test_cache_contract import LOSSY, STRATEGIES, prompts, step_logits

needs_thp = pytest.mark.skipif(not huge_pages.supported(), reason="no transparent huge pages")


@needs_thp
def test_a_move_keeps_values_ties_and_views():
    model = nn.Sequential(nn.Linear(64, 48), nn.Linear(48, 64))
    model[1].weight = nn.Parameter(model[0].weight.detach().t())  # a view of another storage
    model.register_buffer("rows", model[0].weight.detach()[3:5, 7:])
    model.tied = nn.Linear(64, 48)
    model.tied.weight = model[0].weight
    before = {name: t.clone() for name, t in model.state_dict().items()}
    arena = huge_pages.move_to_huge_pages(model)
    after = model.state_dict()
    assert before.keys() == after.keys()
    assert all(torch.equal(before[name], after[name]) for name in before)
    start, end = arena.data_ptr(), arena.data_ptr() + arena.numel()
    assert all(start <= t.data_ptr() < end for t in after.values())
    assert model.tied.weight is model[0].weight
    weight = model[0].weight
    assert model[1].weight.untyped_storage().data_ptr() == weight.untyped_storage().data_ptr()
    assert model.rows.data_ptr() == weight.data_ptr() + (3 * 64 + 7) * weight.element_size()
    assert arena.data_ptr() % huge_pages.HUGE_PAGE == 0
    assert 0 <= huge_pages.huge_bytes(arena) <= arena.numel()


@needs_thp
def test_a_second_move_takes_only_the_bytes_still_used():
    model = nn.Sequential(nn.Linear(256, 512), nn.Linear(512, 256))
    huge_pages.move_to_huge_pages(model)
    model[1] = nn.Linear(512, 128)  # replaced after the move (a quantizer's swap)
    model.register_buffer("rows", model[0].weight.detach()[:7])  # a view in the old mapping
    before = {name: t.clone() for name, t in model.state_dict().items()}
    arena = huge_pages.move_to_huge_pages(model)  # reads none of the old mapping's slack
    after = model.state_dict()
    assert all(torch.equal(before[name], after[name]) for name in before)
    used = sum(t.numel() * t.element_size() for t in model.parameters())  # rows: a view
    assert used <= arena.numel() <= used + 8 * huge_pages.ALIGN
    assert model.rows.data_ptr() == model[0].weight.data_ptr()


@needs_thp
def test_huge_bytes_count_one_mapping_not_its_neighbours():
    arenas = [huge_pages.empty(4 << 20).fill_(1) for _ in range(3)]  # touched: backed
    assert all(0 <= huge_pages.huge_bytes(a) <= a.numel() for a in arenas)


def _decode_logits(model, ids: torch.Tensor) -> torch.Tensor:
    """Logits of ``ids`` fed one token a step (every step a decode step)."""
    cache = build_cache("full", model.cache_spec())
    cache.allocate(ids.shape[0], ids.shape[1])
    with torch.inference_mode():
        steps = [
            model(ids[:, t : t + 1], torch.full_like(ids[:, :1], t), cache)
            for t in range(ids.shape[1])
        ]
    return torch.cat(steps, dim=1)


@needs_thp
def test_decode_steps_read_the_moved_weights(tiny_checkpoints):
    source = str(tiny_checkpoints["smollm"])
    moved, _ = load_model(source)
    reference, _ = load_model(source)
    ids = torch.randint(0, 256, (2, 6), generator=torch.Generator().manual_seed(0))
    _decode_logits(moved, ids)  # plans taken, pointing at the weights where they were
    huge_pages.move_to_huge_pages(moved)
    with torch.no_grad():  # changed in place after the move: only the moved copy has it
        for model in (moved, reference):
            for layer in model.layers:
                layer.mlp.down_proj.weight.mul_(-0.5)
    torch.testing.assert_close(_decode_logits(moved, ids), _decode_logits(reference, ids))


def test_a_run_model_moves_its_weights_only_when_asked(tiny_checkpoints):
    cfg = ModelConfig(source=str(tiny_checkpoints["llama"]), dtype="float32", device="cpu")
    plain, _ = load_run_model(dataclasses.replace(cfg, huge_pages=False), QuantConfig(), "cpu")
    assert plain.huge_page_bytes == 0
    moved, _ = load_run_model(cfg, QuantConfig(), torch.device("cpu"))
    ids = torch.randint(0, 256, (1, 5), generator=torch.Generator().manual_seed(1))
    torch.testing.assert_close(_decode_logits(moved, ids), _decode_logits(plain, ids),
                               rtol=0, atol=0)  # fmt: skip


@needs_thp
def test_zeros_are_zero_views_of_one_mapping_each_on_a_cache_line_faulted_in():
    """Faulted in when made: a step that first writes a fresh huge page would pay its
    fault (milliseconds where a hypervisor hands pages back lazily)."""
    layout = [((3, 5, 7), torch.float32), ((9,), torch.bfloat16), ((1024, 1024), torch.int32)]
    parts = huge_pages.zeros(layout, "cpu")
    assert [(tuple(p.shape), p.dtype) for p in parts] == layout
    assert all(p.is_contiguous() and not p.any() for p in parts)
    assert len({p.untyped_storage().data_ptr() for p in parts}) == 1
    assert all(p.data_ptr() % huge_pages.ALIGN == 0 for p in parts)
    assert huge_pages.resident_bytes(parts[0]) >= sum(p.nbytes for p in parts)  # faulted in
    small = huge_pages.zeros([((4,), torch.float32)], "cpu")[0]  # under a page: torch's own
    assert small.untyped_storage().nbytes() == 16 and not small.any()


@needs_thp
@pytest.mark.parametrize("name", STRATEGIES)
def test_a_cache_on_huge_pages_decodes_as_one_on_torchs_memory(name, tiny_llama, monkeypatch):
    monkeypatch.setattr(huge_pages, "MIN_BYTES", 0)  # the tiny model's caches are small
    prompt = prompts(tiny_llama.config.vocab_size)[0]
    runs = []
    for huge in (False, True):  # the attribute cache_spec reads (a patched method would stay)
        monkeypatch.setattr(tiny_llama, "huge_pages", huge)
        runs.append(step_logits(tiny_llama, name, prompt, steps=8, options=LOSSY[name]))
    (plain, plain_tokens), (huge, huge_tokens) = runs
    assert huge_tokens == plain_tokens
    torch.testing.assert_close(huge, plain, rtol=0, atol=0)


@needs_thp
def test_a_store_on_huge_pages_holds_its_layers_in_one_mapping(tiny_llama, monkeypatch):
    monkeypatch.setattr(huge_pages, "MIN_BYTES", 0)
    for name in ("full", "int4", "paged"):
        cache = build_cache(name, replace(tiny_llama.cache_spec(), huge_pages=True), LOSSY[name])
        cache.allocate(2, 64)
        store = cache.store
        parts = [p for layer in store.keys + store.values for p in layer]
        assert len({p.untyped_storage().data_ptr() for p in parts}) == 1, name
        assert not any(p.any() for p in parts), name
