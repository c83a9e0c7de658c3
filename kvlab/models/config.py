"""Decoder hyper-parameters read from a Hugging Face ``config.json`` (Llama family).

One frozen dataclass covers Llama 2/3, Mistral, Qwen2/2.5, Qwen3 and SmolLM: the families
differ only in biases, q/k norms and RoPE scaling, which are fields here.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")


@dataclass(frozen=True)
class DecoderConfig:
    """Shape and numerics of one decoder; built from a HF config with :meth:`from_hf`."""

    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] = field(default_factory=dict)
    tie_word_embeddings: bool = False
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False
    sliding_window: int | None = None
    eos_token_ids: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if self.model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(
                f"model_type={self.model_type!r} is not supported; "
                f"supported: {', '.join(SUPPORTED_MODEL_TYPES)}"
            )
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_attention_heads={self.num_heads} must be a multiple of "
                f"num_key_value_heads={self.num_kv_heads}"
            )
        rope_type = self.rope_scaling.get("rope_type", "default")
        if rope_type not in SUPPORTED_ROPE_TYPES:
            raise ValueError(
                f"rope_type={rope_type!r} is not supported; supported: {SUPPORTED_ROPE_TYPES}"
            )

    @property
    def group_size(self) -> int:
        """Query heads per KV head."""
        return self.num_heads // self.num_kv_heads

    @staticmethod
    def sliding_window_of(hf: dict[str, Any]) -> int | None:
        """The trained sliding window as transformers applies it: every layer of Mistral
        when ``sliding_window`` is set; Qwen2's layers from ``max_window_layers`` on when
        ``use_sliding_window``; or the layers ``layer_types`` marks sliding."""
        window = hf.get("sliding_window")
        if not window:
            return None
        types = hf.get("layer_types")
        if types is not None:
            return window if "sliding_attention" in types else None
        model_type = hf.get("model_type", "")
        if model_type == "qwen2":
            layers = hf.get("num_hidden_layers", 0)
            slides = hf.get("use_sliding_window", False) and hf.get("max_window_layers", 0) < layers
            return window if slides else None
        return window if hf.get("use_sliding_window", model_type == "mistral") else None

    @classmethod
    def from_hf(cls, hf: dict[str, Any]) -> DecoderConfig:
        """Build from a parsed ``config.json`` (transformers 4.x and 5.x spellings)."""
        model_type = hf.get("model_type", "")
        heads = hf["num_attention_heads"]
        bias = bool(hf.get("attention_bias", False))
        rope_params = dict(hf.get("rope_parameters") or hf.get("rope_scaling") or {})
        if "type" in rope_params and "rope_type" not in rope_params:
            rope_params["rope_type"] = rope_params.pop("type")
        theta = rope_params.pop("rope_theta", hf.get("rope_theta", 10000.0))
        eos = hf.get("eos_token_id")
        return cls(
            model_type=model_type,
            vocab_size=hf["vocab_size"],
            hidden_size=hf["hidden_size"],
            intermediate_size=hf["intermediate_size"],
            num_layers=hf["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=hf.get("num_key_value_heads") or heads,
            head_dim=hf.get("head_dim") or hf["hidden_size"] // heads,
            rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
            max_position_embeddings=hf.get("max_position_embeddings", 4096),
            rope_theta=float(theta),
            rope_scaling=rope_params,
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            qkv_bias=True if model_type == "qwen2" else bias,
            o_bias=False if model_type in ("qwen2", "mistral") else bias,
            mlp_bias=bool(hf.get("mlp_bias", False)),
            qk_norm=model_type == "qwen3",
            sliding_window=cls.sliding_window_of(hf),
            eos_token_ids=tuple(eos if isinstance(eos, list) else [eos] if eos is not None else []),
        )
