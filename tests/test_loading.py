"""Model sources: registered names, checkpoint directories, GGUF files; clear errors."""

from __future__ import annotations

import pytest
import torch

from kvlab import load_model
from kvlab.models import REGISTERED_MODELS, resolve_checkpoint
from kvlab.models.loading import _registered_gguf


def test_unknown_name_lists_registered_models():
    with pytest.raises(ValueError, match="smollm2-135m"):
        resolve_checkpoint("no-such-model")


def test_directory_without_config_is_refused(tmp_path):
    with pytest.raises(FileNotFoundError, match="config.json"):
        resolve_checkpoint(str(tmp_path))


def test_checkpoint_without_safetensors_is_refused(tiny_checkpoints, tmp_path):
    (tmp_path / "config.json").write_text((tiny_checkpoints["llama"] / "config.json").read_text())
    with pytest.raises(FileNotFoundError, match="safetensors"):
        load_model(str(tmp_path))


def test_tied_embeddings_share_one_tensor(tiny_checkpoints):
    model, _ = load_model(str(tiny_checkpoints["smollm"]))
    assert model.lm_head.weight is model.embed_tokens.weight


def test_dtype_is_applied(tiny_checkpoints):
    model, _ = load_model(str(tiny_checkpoints["qwen2"]), dtype=torch.bfloat16)
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}


def test_default_model_is_the_documented_architecture(smollm2):
    model, tokenizer = smollm2
    c = model.config
    assert (c.num_layers, c.hidden_size, c.num_heads, c.num_kv_heads) == (30, 576, 9, 3)
    assert tokenizer.chat_template  # the instruct model's chat template came along
    assert REGISTERED_MODELS["smollm2-135m"].max_context == c.max_position_embeddings


@pytest.mark.slow
def test_gguf_file_converts_once_into_safetensors(tmp_path, monkeypatch):
    monkeypatch.setenv("KVLAB_CACHE", str(tmp_path))
    gguf = _registered_gguf("smollm2-135m")
    model, tokenizer = load_model(str(gguf))
    converted = tmp_path / "models" / gguf.stem
    assert (converted / "model.safetensors").exists()
    assert not list(converted.glob("*.bin"))  # no pickle anywhere
    assert tokenizer("hello")["input_ids"]
    assert resolve_checkpoint(str(gguf)) == converted  # the second time: no conversion
