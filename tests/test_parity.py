"""kvlab's decoder reproduces Hugging Face transformers' logits on the same weights."""

from __future__ import annotations

import pytest
import torch
from conftest import FAMILIES

from kvlab import load_model
from kvlab.cache import build_cache
from kvlab.models import resolve_checkpoint

TOLERANCE = 1e-4  # fp32, max abs logit difference


def kvlab_logits(model, ids: torch.Tensor, chunk: int | None = None) -> torch.Tensor:
    """Logits (B, T, V) of kvlab with a full cache, the prompt fed in chunks if given."""
    cache = build_cache("full", model.cache_spec())
    cache.allocate(ids.shape[0], ids.shape[1])
    chunk = chunk or ids.shape[1]
    outs = []
    with torch.inference_mode():
        for start in range(0, ids.shape[1], chunk):
            piece = ids[:, start : start + chunk]
            positions = (start + torch.arange(piece.shape[1])).expand_as(piece)
            outs.append(model(piece, positions, cache))
    return torch.cat(outs, dim=1)


@pytest.mark.parametrize("family", FAMILIES)
def test_logits_match_transformers(family, tiny_checkpoints):
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(tiny_checkpoints[family], dtype=torch.float32).eval()
    model, _ = load_model(str(tiny_checkpoints[family]), backend="native")  # Mistral's
    # window (4096) is past these 40 tokens: kvlab's decoder, not transformers' class
    ids = torch.randint(0, 256, (2, 40), generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        reference = hf(ids).logits
    assert (kvlab_logits(model, ids) - reference).abs().max() <= TOLERANCE
    assert (kvlab_logits(model, ids, chunk=7) - reference).abs().max() <= TOLERANCE


@pytest.mark.slow
def test_default_model_matches_transformers(smollm2):
    from transformers import AutoModelForCausalLM

    model, tokenizer = smollm2
    hf = AutoModelForCausalLM.from_pretrained(
        resolve_checkpoint("smollm2-135m"), dtype=torch.float32
    ).eval()
    text = "The KV cache makes decoding fast, but it grows with every token of the context."
    ids = tokenizer(text, return_tensors="pt").input_ids
    with torch.inference_mode():
        reference = hf(ids).logits
    assert (kvlab_logits(model, ids) - reference).abs().max() <= TOLERANCE
