"""Shared fixtures: tiny random checkpoints of every supported family (built and saved by
Hugging Face transformers) and the embedded default model.

The suite never writes the user's kvlab cache (``$KVLAB_CACHE``, ``~/.cache/kvlab``): what it
builds (the converted default model, the kernels, calibrations) goes to a cache of its own,
``$KVLAB_TEST_CACHE`` or ``kvlab-tests-<uid>`` in the temporary directory, kept between runs,
set here before kvlab is imported, so subprocesses (the ``kvlab`` command) inherit it."""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

if shutil.which("nvidia-smi") is None:  # no GPU: Triton kernels run interpreted, on CPU tensors
    os.environ.setdefault("TRITON_INTERPRET", "1")  # read as Triton is first imported
os.environ["KVLAB_CACHE"] = os.environ.get("KVLAB_TEST_CACHE") or str(
    Path(tempfile.gettempdir()) / f"kvlab-tests-{os.getuid()}"
)

import pytest
import torch

TINY = dict(  # the shape of every tiny random model transformers builds for the tests
    vocab_size=256,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
    rms_norm_eps=1e-5,
)
FAMILIES = ("llama", "llama3_scaled", "llama2_linear", "mistral", "qwen2", "qwen3", "smollm")


def tiny_hf_model(family: str):
    """A small random HF model of ``family`` (fp32, eval mode)."""
    import transformers as tf

    common = dict(TINY)
    rope = {"rope_type": "default", "rope_theta": 10000.0}
    if family == "llama3_scaled":
        rope = {
            "rope_type": "llama3",
            "rope_theta": 500000.0,
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        }
    if family == "llama2_linear":
        rope = {"rope_type": "linear", "rope_theta": 10000.0, "factor": 2.0}
    builders = {
        "llama": lambda: tf.LlamaConfig(**common, rope_parameters=rope),
        "llama3_scaled": lambda: tf.LlamaConfig(**common, rope_parameters=rope),
        "llama2_linear": lambda: tf.LlamaConfig(
            **common, rope_parameters=rope, attention_bias=True, mlp_bias=True
        ),
        "mistral": lambda: tf.MistralConfig(**common, sliding_window=4096, rope_parameters=rope),
        "qwen2": lambda: tf.Qwen2Config(**common, rope_parameters=rope),
        "qwen3": lambda: tf.Qwen3Config(**common, head_dim=32, rope_parameters=rope),
        "smollm": lambda: tf.LlamaConfig(**common, tie_word_embeddings=True, rope_parameters=rope),
    }
    torch.manual_seed(0)
    model = tf.AutoModelForCausalLM.from_config(builders[family](), dtype=torch.float32)
    with torch.no_grad():  # random, non-trivial norms and biases so every weight matters
        for name, param in model.named_parameters():
            if "norm" in name or name.endswith("bias"):
                param.add_(torch.randn_like(param) * 0.1)
    return model.eval()


def tiny_hf_model_with_vocab(tokenizer, hidden_size: int = 64, intermediate_size: int = 128):
    """A tiny random Llama sized to ``tokenizer``'s vocabulary (for code that tokenizes)."""
    import transformers as tf

    torch.manual_seed(0)
    config = tf.LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=hidden_size, intermediate_size=intermediate_size,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=512,
    )  # fmt: skip
    return tf.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()


@pytest.fixture(scope="session")
def tiny_checkpoints(tmp_path_factory) -> dict[str, Path]:
    """family → a saved safetensors checkpoint directory."""
    root = tmp_path_factory.mktemp("tiny")
    out = {}
    for family in FAMILIES:
        tiny_hf_model(family).save_pretrained(root / family)
        out[family] = root / family
    return out


@pytest.fixture(scope="session")
def tiny_llama(tiny_checkpoints):
    """A kvlab model on the tiny random Llama checkpoint."""
    from kvlab import load_model

    model, _ = load_model(str(tiny_checkpoints["llama"]))
    return model


@pytest.fixture
def layers_op_by_op(monkeypatch):
    """Decoder layers run op by op, so every decode step goes through ``cache.attend`` (for
    tests that hook it): the fused layer would take a cache's writes and attention into
    its own C call, which test_fused_layer.py checks against ``attend`` bit for bit."""
    from kvlab.models import llama

    monkeypatch.setattr(llama, "fused_plan", lambda layer: None)


@pytest.fixture(scope="session")
def smollm2():
    """The embedded default model (fp32, CPU) and its tokenizer."""
    from kvlab import load_model

    return load_model("smollm2-135m")
