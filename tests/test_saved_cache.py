"""Saved cache rows (kvlab.cache.saved): rows written to a file and loaded into a fresh
cache continue exactly as the saved cache's rows do, for every strategy whose rows fork
(windowed models' per-group caches too); a file for another model, strategy or options, a
strategy that cannot save, a folder that cannot be written and a file that is not a saved
cache are refused with the reason; a write that fails leaves no file behind."""

from __future__ import annotations

import pytest
import torch

from kvlab.cache import build_cache, registered
from kvlab.cache.saved import load_rows, save_rows
from tests.test_cache_contract import LOSSY

STORING = sorted(
    name for name, cls in registered().items() if cls.stores_past and name not in ("paged",)
)


def prefilled(model, name: str, options: dict):
    """A cache of three rows holding prompts of 9, 6 and 12 tokens."""
    gen = torch.Generator().manual_seed(1)
    cache = build_cache(name, model.cache_spec(), options)
    cache.allocate(3, 40)
    ids = torch.randint(0, model.config.vocab_size, (3, 12), generator=gen)
    with torch.inference_mode():
        model(ids, torch.arange(12).expand(3, 12), cache, [9, 6, 12])
    return cache


def continued(model, cache, lengths: list[int]) -> list[torch.Tensor]:
    """Logits of three decode steps of the same tokens after each row's stored tokens."""
    out = []
    with torch.inference_mode():
        for step in range(3):
            ids = torch.full((len(lengths), 1), 7 + step)
            where = torch.tensor(lengths)[:, None] + step
            out.append(model(ids, where, cache))
    return out


@pytest.mark.parametrize("name", STORING)
def test_loaded_rows_continue_as_the_saved_rows(name, tiny_llama, tmp_path):
    cache = prefilled(tiny_llama, name, LOSSY[name])
    if not cache.forks:
        with pytest.raises(ValueError, match="cannot save rows"):
            save_rows(cache, [0], tmp_path / "rows.safetensors")
        return
    path = save_rows(cache, [2, 0], tmp_path / "rows.safetensors")
    loaded = load_rows(path, build_cache(name, tiny_llama.cache_spec(), LOSSY[name]))
    assert loaded.lengths == [12, 9]
    want = continued(tiny_llama, cache.fork([2, 0]), [12, 9])
    for got, expected in zip(continued(tiny_llama, loaded, [12, 9]), want, strict=True):
        assert torch.equal(got, expected)


def test_a_windowed_models_caches_save_and_load(tmp_path):
    """Gemma 3's trained window beside a global layer: one cache per group of layers,
    each group's rows saved and loaded."""
    from tests.test_hf_backend import HF_FAMILIES, load, tiny_causal_lm

    tiny_causal_lm("gemma3_text", HF_FAMILIES["gemma3_text"]).save_pretrained(tmp_path / "g")
    model = load(tmp_path / "g")
    cache = prefilled(model, "full", {})
    assert len(cache.caches) > 1
    path = save_rows(cache, [1], tmp_path / "w.safetensors")
    loaded = load_rows(path, build_cache("full", model.cache_spec()))
    want = continued(model, cache.fork([1]), [6])
    for got, expected in zip(continued(model, loaded, [6]), want, strict=True):
        assert torch.equal(got, expected)


def test_a_file_for_another_model_strategy_or_options_is_refused(
    tiny_llama, tiny_checkpoints, tmp_path
):
    from kvlab import load_model

    options = LOSSY["int4"]
    path = save_rows(prefilled(tiny_llama, "int4", options), [0], tmp_path / "rows.safetensors")
    spec = tiny_llama.cache_spec()
    with pytest.raises(ValueError, match="strategy='int4'"):
        load_rows(path, build_cache("int8", spec, LOSSY["int8"]))
    with pytest.raises(ValueError, match="options="):
        load_rows(path, build_cache("int4", spec, {**options, "residual": 2 * options["residual"]}))
    other, _ = load_model(str(tiny_checkpoints["qwen2"]))
    with pytest.raises(ValueError, match="model_id="):
        load_rows(path, build_cache("int4", other.cache_spec(), options))
    (tmp_path / "junk.safetensors").write_bytes(b"not a cache")
    with pytest.raises(ValueError, match="not a kvlab cache file"):
        load_rows(tmp_path / "junk.safetensors", build_cache("int4", spec, options))
    with pytest.raises(ValueError, match="does not exist"):
        load_rows(tmp_path / "missing.safetensors", build_cache("int4", spec, options))


def test_what_cannot_be_saved_is_refused_before_anything_is_written(tiny_llama, tmp_path):
    with pytest.raises(ValueError, match="cannot save rows of cache=paged"):
        save_rows(prefilled(tiny_llama, "paged", {}), [0], tmp_path / "p.safetensors")
    cache = prefilled(tiny_llama, "full", {})
    with pytest.raises(ValueError, match="not a writable folder"):
        save_rows(cache, [0], tmp_path / "no" / "such" / "folder.safetensors")
    with pytest.raises(ValueError, match="rows=\\[3\\]"):
        save_rows(cache, [3], tmp_path / "f.safetensors")
    assert not list(tmp_path.iterdir())


def test_a_write_that_fails_leaves_no_file(tiny_llama, tmp_path, monkeypatch):
    """A run killed while writing: nothing at the path, no partial file beside it; an
    older file at the path stays whole."""
    import safetensors.torch

    cache = prefilled(tiny_llama, "full", {})
    path = save_rows(cache, [0], tmp_path / "rows.safetensors")
    before = path.read_bytes()

    def dies(tensors, filename, metadata=None):
        with open(filename, "wb") as f:
            f.write(b"half")
        raise KeyboardInterrupt

    monkeypatch.setattr(safetensors.torch, "save_file", dies)
    with pytest.raises(KeyboardInterrupt):
        save_rows(cache, [1, 2], path)
    with pytest.raises(KeyboardInterrupt):
        save_rows(cache, [1], tmp_path / "new.safetensors")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["rows.safetensors"]
    assert path.read_bytes() == before
