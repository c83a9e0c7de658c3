"""``model.backend=hf``: a decoder that kvlab's own (:mod:`kvlab.models.llama`) does not know
runs as transformers' own model class inside kvlab's engine.

kvlab registers an attention function with transformers' ``AttentionInterface``
(``attn_implementation="kvlab"``); every forward step carries the cache and the step it
planned down to it as a keyword argument, which transformers passes to each layer's
attention call, and the function hands the layer's query, keys and values (after the
model's own q/k norms and RoPE) to ``cache.attend`` — the contract the native decoder keeps.
So every cache strategy serves the model unchanged: its stores, codecs, rollback, byte
accounting, and the engine's loop, serving and evals. transformers' own cache stays off
(``use_cache=False``) and its masks are never built (a registered attention function with no
mask function of its name gets ``attention_mask=None``): the strategy's positions are the
mask. Linear layers are the model's ``nn.Linear``, so weight quantizers and the kernel plan
apply to them as to the native decoder's.

Served here: decoder-only models whose layers attend with softmax attention, over the
whole context or a trained sliding window — Llama, Qwen2/3 and Qwen3-MoE, Phi-3, SmolLM3 (its
layers without RoPE included), Mistral, Gemma 3 (a window's layers keep a ring of it:
:mod:`kvlab.cache.layered`), DeepSeek-V3's MLA (its decompressed keys and values stored,
values zero-padded to the keys' width), gpt-oss (its learned attention sinks, ``s_aux``, set
for each layer's attention: :mod:`kvlab.kernels.attention.sinks`). Refused before any
weight loads, with the reason: recurrent, chunked or shared-KV layers, logit soft-capping;
and the strategies that re-rotate keys (``KVCache.rerotates_keys``) where the model's RoPE
is not the plain rotation of whole heads that they invert.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from kvlab.cache.base import KVCache, Step
from kvlab.kernels.attention.sinks import attention_sinks
from kvlab.models.llama import CachedDecoder, logit_rows
from kvlab.models.rope import RotaryTables

ATTENTION = "kvlab"


@dataclass
class HFDecoderFacts:
    """What the engine reads of a model's config (the native ``DecoderConfig``'s names)."""

    model_type: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int  # as stored: MLA's decompressed keys have one head per query head
    head_dim: int  # the stored width: max of the keys' and the values' widths
    value_dim: int
    max_position_embeddings: int
    plain_rope: bool  # RoPE is the half-split rotation of whole heads at ``inv_freq``
    eos_token_ids: tuple[int, ...] = ()
    layer_windows: tuple[int | None, ...] = ()  # each layer's trained window (None: none)
    sliding_window: int | None = None  # the engine's whole-model window: the cache applies
    # each layer's own (layer_windows)


def _eos_ids(config: Any) -> tuple[int, ...]:
    eos = getattr(config, "eos_token_id", None)
    if eos is None:
        return ()
    return tuple(eos) if isinstance(eos, list | tuple) else (int(eos),)


def hf_refusal(config: Any) -> str | None:
    """Why this backend cannot serve a model of ``config`` (a transformers config), or None."""
    from transformers.cache_utils import get_layer_types_and_kwargs

    model_type = getattr(config, "model_type", "?")
    if getattr(config, "is_encoder_decoder", False):
        return f"model_type={model_type!r} is an encoder-decoder; allowed: decoder-only models"
    try:
        layer_types, _ = get_layer_types_and_kwargs(config)
    except (AttributeError, TypeError, ValueError) as exc:
        return f"model_type={model_type!r}: its layer types cannot be read ({exc})"
    other = sorted(set(layer_types) - {"full_attention", "sliding_attention"})
    if other:
        return (
            f"model_type={model_type!r} has layers of type {other} (recurrent, chunked or "
            "shared-KV layers), which the hf backend does not serve yet; allowed: models "
            "whose layers are full_attention or sliding_attention"
        )
    for field, why in (
        ("attn_logit_softcapping", "attention logit soft-capping"),
        ("final_logit_softcapping", "final logit soft-capping"),
        ("use_bidirectional_attention", "bidirectional attention"),
    ):
        if getattr(config, field, None):
            return f"model_type={model_type!r} uses {why} ({field}), which kvlab's attention lacks"
    return None


def strategy_refusal(facts: HFDecoderFacts, name: str, options: Any) -> str | None:
    """Why cache strategy ``name`` with ``options`` cannot serve this model, or None: a
    strategy that re-rotates keys by RoPE's frequencies (``KVCache.rerotates_keys``) needs
    the plain rotation of whole heads, which it inverts."""
    from kvlab.cache import registered

    if facts.plain_rope or not registered()[name].rerotates_keys(options):
        return None
    return (
        f"cache={name} re-rotates keys by RoPE's frequencies, and model_type="
        f"{facts.model_type!r} rotates them otherwise (partial, interleaved or scaled RoPE, or "
        "layers without RoPE); allowed: a strategy that stores keys as the model rotates them"
    )


def _head_dims(config: Any) -> tuple[int, int]:
    """(key width, value width) of one attention head as the layers hand them over."""
    if getattr(config, "kv_lora_rank", None):  # MLA: decompressed per head
        key = config.qk_nope_head_dim + config.qk_rope_head_dim
        return key, config.v_head_dim
    head = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    return head, head


def _plain_rope(config: Any, key_dim: int) -> bool:
    """Whether every layer rotates its whole keys by the half-split RoPE of fixed frequencies
    (what the strategies that re-rotate keys invert), read from the config alone."""
    if getattr(config, "kv_lora_rank", None) or getattr(config, "rope_interleave", False):
        return False
    if any(flag == 0 for flag in getattr(config, "no_rope_layers", None) or []):
        return False
    params = getattr(config, "rope_parameters", None) or {}
    if any(isinstance(value, dict) for value in params.values()):
        return False  # one RoPE per layer type (Gemma 3's local and global tables)
    if params.get("rope_type", "default") not in ("default", "linear", "llama3"):
        return False  # scaled by length (dynamic), or with an attention factor (yarn, longrope)
    factor = params.get("partial_rotary_factor", getattr(config, "partial_rotary_factor", 1.0))
    return factor in (None, 1.0) and key_dim % 2 == 0


def layer_windows(config: Any) -> tuple[int | None, ...]:
    """Each layer's trained sliding window, as transformers' own caches read it; () where
    no layer has one."""
    from transformers.cache_utils import get_layer_types_and_kwargs

    _, kwargs = get_layer_types_and_kwargs(config)
    windows = tuple(k.get("sliding_window") for k in kwargs)
    return windows if any(w is not None for w in windows) else ()


def facts_of(config: Any) -> HFDecoderFacts:
    """What kvlab needs of a transformers config: shapes as the attention hands them over."""
    key_dim, value_dim = _head_dims(config)
    mla = bool(getattr(config, "kv_lora_rank", None))
    return HFDecoderFacts(
        model_type=config.model_type,
        vocab_size=config.vocab_size,
        hidden_size=config.hidden_size,
        num_layers=config.num_hidden_layers,
        num_heads=config.num_attention_heads,
        num_kv_heads=config.num_attention_heads if mla else config.num_key_value_heads,
        head_dim=max(key_dim, value_dim),
        value_dim=value_dim,
        max_position_embeddings=config.max_position_embeddings,
        plain_rope=_plain_rope(config, key_dim),
        eos_token_ids=_eos_ids(config),
        layer_windows=layer_windows(config),
    )


def refusal(checkpoint: Path, cache_name: str, cache_options: Any) -> str | None:
    """Why the hf backend cannot run ``checkpoint`` under this strategy, from its config
    alone (before any weight loads), or None."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(checkpoint)
    reason = hf_refusal(config)
    if reason is None:
        reason = strategy_refusal(facts_of(config), cache_name, cache_options)
    return None if reason is None else f"model.backend=hf: {reason}"


def kvlab_attention(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float,
    dropout: float = 0.0,
    kvlab: tuple[KVCache, Step, RotaryTables | None] | None = None,
    s_aux: torch.Tensor | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers' attention call, answered by the step's cache: q (B, H, T, Dk), k
    (B, H_kv, T, Dk), v (B, H_kv, T, Dv) after the model's norms and RoPE; returns
    (B, T, H, Dv). kvlab's attention scales scores by ``Dk ** -0.5``, so the query takes the
    model's own ``scaling`` relative to that (1 for most models: no multiply). ``s_aux``:
    the layer's learned attention sinks (H,) (gpt-oss), in every softmax of the call."""
    if kvlab is None:
        raise RuntimeError(
            "attn_implementation='kvlab' runs inside kvlab's engine only (no cache was passed)"
        )
    cache, step, unrotate = kvlab
    key_dim, value_dim = key.shape[-1], value.shape[-1]
    factor = scaling * key_dim**0.5
    if abs(factor - 1.0) > 1e-12:
        query = query * factor
    if value_dim < key_dim:  # MLA: values narrower than keys, stored at the keys' width
        value = nn.functional.pad(value, (0, key_dim - value_dim))
    k_raw = key if unrotate is None else unrotate.rotate_heads_first(key)
    with attention_sinks(s_aux):
        out = cache.attend(step, module.layer_idx, query, key, value, k_raw)
    return out[..., :value_dim].transpose(1, 2).contiguous(), None


def register_attention() -> None:
    from transformers import AttentionInterface

    AttentionInterface.register(ATTENTION, kvlab_attention)


class HFDecoder(CachedDecoder):
    """A transformers causal LM behind the native decoder's interface: ``forward(ids,
    positions, cache, ...)`` → logits, ``cache_spec()``, ``embed_tokens``, ``config``. Holds
    the model's transformer (``model``) and its head (``lm_head``) as its own children, so
    module names (``lm_head``, which quantizers skip) read as the native decoder's."""

    backend = "hf"

    def __init__(self, causal_lm: nn.Module, facts: HFDecoderFacts):
        super().__init__()
        self.model = causal_lm.model
        self.lm_head = causal_lm.lm_head
        self.config = facts
        self.hf_config = causal_lm.config
        self.embed_tokens = self.model.get_input_embeddings()
        rotary = getattr(self.model, "rotary_emb", None)
        inv_freq = rotary.inv_freq.float().clone() if facts.plain_rope else torch.zeros(1)
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        self.layers = self.model.layers
        self.huge_pages = False
        self.huge_page_bytes = 0
        self.kernel_plan = None

    def config_digest(self) -> bytes:
        return self.hf_config.to_json_string(use_diff=False).encode()

    def decode_paths(self):
        from collections import Counter

        return Counter()  # transformers' layers: the op-by-op path, counted by none

    def logits(
        self,
        ids: torch.Tensor,
        rope: RotaryTables,
        cache: KVCache,
        step: Step,
        logit_index: torch.Tensor | None = None,
    ) -> torch.Tensor:
        unrotate = None
        if self.config.plain_rope:  # keys before RoPE, for strategies that re-rotate them
            unrotate = RotaryTables(self.inv_freq, -step.info.positions, rope.dtype)
        x = self.model(
            input_ids=ids,
            position_ids=step.info.positions,
            use_cache=False,
            kvlab=(cache, step, unrotate),
        ).last_hidden_state
        return self.lm_head(logit_rows(x, logit_index)).float()


def load_hf_model(checkpoint: Path, dtype: torch.dtype, device: str | torch.device) -> HFDecoder:
    """transformers' model class for ``checkpoint`` with kvlab's attention; refuses what it
    cannot serve."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(checkpoint)
    reason = hf_refusal(config)
    if reason:
        raise ValueError(f"model.backend=hf: {reason}")
    register_attention()
    causal_lm = AutoModelForCausalLM.from_pretrained(
        checkpoint, dtype=dtype, attn_implementation=ATTENTION
    )
    causal_lm = causal_lm.to(device).eval().requires_grad_(False)
    facts = facts_of(config)
    rotary = getattr(causal_lm.model, "rotary_emb", None)
    if facts.plain_rope and (  # the tables the model built must be the ones its config says
        rotary is None
        or getattr(rotary, "attention_scaling", 1.0) != 1.0
        or rotary.inv_freq.numel() * 2 != facts.head_dim
    ):
        raise ValueError(
            f"model.backend=hf: model_type={facts.model_type!r} builds RoPE tables its config "
            "does not describe (a scale, or a width other than its heads'), which kvlab cannot "
            "tell strategies that re-rotate keys; allowed: models whose config describes them"
        )
    model = HFDecoder(causal_lm, facts)
    model.checkpoint_dir = checkpoint
    return model
