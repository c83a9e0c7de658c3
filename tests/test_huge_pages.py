"""Weights moved onto huge pages keep their values, ties and views, and every decode step
reads the moved copy (the fused plans taken before the move are dropped)."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch import nn

from kvlab import load_model
from kvlab.cache import build_cache
from kvlab.config import ModelConfig, QuantConfig
from kvlab.kernels import huge_pages
from kvlab.run import load_run_model

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
    assert 0 <= huge_pages.huge_bytes(arena) <= arena.numel() + huge_pages.HUGE_PAGE


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
