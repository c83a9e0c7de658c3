"""The memory model: weight and KV-cache bytes of any model config under any kvlab cache
strategy and weight quantizer, per token, per sequence and per batch, up to 1M tokens, and
the largest batch a memory budget holds (the cache competes with batch size, Kwon et al.,
arXiv 2309.06180). GQA models use each strategy's own ``planned_bytes`` line; DeepSeek's
MLA (arXiv 2412.19437, with the V3.2 indexer keys) and V4's CSA/HCA caches are modelled
from their architectures."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from kvlab.cache import registered
from kvlab.cache.base import CacheSpec
from kvlab.cache.layered import window_options

REFERENCE_DIR = Path(__file__).with_name("reference_configs")
GIB = 2**30


def reference_configs() -> list[str]:
    return sorted(p.name for p in REFERENCE_DIR.iterdir() if (p / "config.json").exists())


def load_config(source: str) -> dict[str, Any]:
    """config.json of a reference name, a file, a checkpoint directory, a registered kvlab
    model or a hub id (where the network allows)."""
    if (REFERENCE_DIR / source / "config.json").exists():
        return json.loads((REFERENCE_DIR / source / "config.json").read_text())
    path = Path(source).expanduser()
    if path.is_file():
        return json.loads(path.read_text())
    from kvlab.models.loading import read_hf_config

    return read_hf_config(source)


@dataclass(frozen=True)
class Architecture:
    """What the memory model needs of a config. ``kind``: gqa | mla | compressed. An MLA
    model's ``kv_heads`` x ``head_dim`` are the decompressed keys and values as kvlab's
    strategies store them (``model.backend=hf``: one head per query head, the keys' width
    and the values' padded to it); ``latent_dim`` is what MLA's own cache holds."""

    kind: str
    layers: int
    kv_heads: int
    head_dim: int
    heads: int = 0
    hidden: int = 0
    vocab: int = 0
    intermediate: int = 0
    tied: bool = False
    qkv_bias: bool = False
    latent_dim: int = 0  # MLA: kv_lora_rank + qk_rope_head_dim per token and layer
    index_dim: int = 0  # DSA / CSA indexer key per token (per compressed entry for CSA)
    ratios: tuple[int, ...] = ()  # V4: per-layer compression ratio (0: window only)
    window: int = 0
    layer_windows: tuple[int | None, ...] = ()  # GQA: each layer's trained window, if any
    extra: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def from_config(cls, cfg: dict[str, Any]) -> Architecture:
        layers = cfg["num_hidden_layers"]
        if "compress_ratios" in cfg:
            ratios = tuple(cfg["compress_ratios"][:layers])
            index_dim, window = cfg.get("index_head_dim", 0), cfg.get("sliding_window", 0)
            return cls("compressed", layers, 1, cfg["head_dim"], index_dim=index_dim,
                       ratios=ratios, window=window)  # fmt: skip
        heads, hidden = cfg["num_attention_heads"], cfg["hidden_size"]
        common = dict(heads=heads, hidden=hidden, vocab=cfg["vocab_size"],
                      intermediate=cfg.get("intermediate_size", 0),
                      tied=cfg.get("tie_word_embeddings", False))  # fmt: skip
        if "kv_lora_rank" in cfg:
            latent = cfg["kv_lora_rank"] + cfg["qk_rope_head_dim"]
            stored = max(cfg["qk_nope_head_dim"] + cfg["qk_rope_head_dim"], cfg["v_head_dim"])
            return cls("mla", layers, heads, stored, latent_dim=latent,
                       index_dim=cfg.get("index_head_dim", 0), extra=cfg, **common)  # fmt: skip
        head_dim = cfg.get("head_dim") or hidden // heads
        kv_heads = cfg.get("num_key_value_heads") or heads
        qkv_bias = cfg.get("attention_bias", cfg.get("model_type") == "qwen2")
        return cls("gqa", layers, kv_heads, head_dim, qkv_bias=qkv_bias,
                   layer_windows=layer_windows_of(cfg), **common)  # fmt: skip


def layer_windows_of(cfg: dict[str, Any]) -> tuple[int | None, ...]:
    """Each layer's trained sliding window as transformers reads it from ``cfg`` (the model
    keeps a ring of it, :mod:`kvlab.cache.layered`); () where no layer has one or the model
    type is unknown to transformers."""
    from transformers import AutoConfig

    from kvlab.models.hf_backend import layer_windows

    fields = {k: v for k, v in cfg.items() if k != "model_type"}
    try:
        return layer_windows(AutoConfig.for_model(cfg.get("model_type", ""), **fields))
    except (ValueError, KeyError, TypeError, AttributeError):
        return ()


# ---- weights -------------------------------------------------------------------------------
def linear_shapes(arch: Architecture) -> list[tuple[str, int, int]]:
    """(name, out_features, in_features) of every linear layer but the output head."""
    if arch.kind == "gqa":
        h, heads, kv, dim, inter = (
            arch.hidden,
            arch.heads,
            arch.kv_heads,
            arch.head_dim,
            arch.intermediate,
        )
        layer = [("qkv_proj", (heads + 2 * kv) * dim, h), ("o_proj", h, heads * dim),
                 ("gate_up_proj", 2 * inter, h), ("down_proj", h, inter)]  # fmt: skip
        return [shape for _ in range(arch.layers) for shape in layer]
    if arch.kind == "mla":
        return _mla_linear_shapes(arch)
    raise ValueError(
        f"the memory model has no weight layout for {arch.kind!r} models (V4: no MoE fields)"
    )


def _mla_linear_shapes(arch: Architecture) -> list[tuple[str, int, int]]:
    """DeepSeek-V3/V3.2 (MLA attention, DeepSeekMoE, the V3.2 lightning indexer)."""
    c, h, heads = arch.extra, arch.hidden, arch.heads
    rope, nope, v, ql, kvl = (
        c[k]
        for k in (
            "qk_rope_head_dim",
            "qk_nope_head_dim",
            "v_head_dim",
            "q_lora_rank",
            "kv_lora_rank",
        )
    )
    attention = [("q_a_proj", ql, h), ("q_b_proj", heads * (nope + rope), ql),
                 ("kv_a_proj", kvl + rope, h), ("kv_b_proj", heads * (nope + v), kvl),
                 ("o_proj", h, heads * v)]  # fmt: skip
    if arch.index_dim:
        ih = c.get("index_n_heads", 0)
        attention += [("indexer.wq_b", ih * arch.index_dim, ql), ("indexer.wk", arch.index_dim, h),
                      ("indexer.weights_proj", ih, h)]  # fmt: skip
    dense = [
        ("mlp.gate_up", 2 * c["intermediate_size"], h),
        ("mlp.down", h, c["intermediate_size"]),
    ]
    experts = c["n_routed_experts"] + c.get("n_shared_experts", 0)
    moe_i = c["moe_intermediate_size"]
    moe = [("experts.gate_up", 2 * moe_i, h), ("experts.down", h, moe_i)] * experts + [
        ("router", c["n_routed_experts"], h)
    ]
    shapes = []
    for i in range(arch.layers):
        shapes += attention + (dense if i < c.get("first_k_dense_replace", 0) else moe)
    return shapes


def other_parameters(arch: Architecture) -> int:
    """Embeddings, output head and norms: what weight quantizers leave alone."""
    norms = arch.layers * 2 * arch.hidden + arch.hidden
    return arch.vocab * arch.hidden * (1 if arch.tied else 2) + norms


def parameter_count(arch: Architecture) -> int:
    biases = arch.layers * (arch.heads + 2 * arch.kv_heads) * arch.head_dim if arch.qkv_bias else 0
    return sum(n * k for _, n, k in linear_shapes(arch)) + other_parameters(arch) + biases


def quantized_linear_bytes(
    out_f: int, in_f: int, quant: str, options: Any, dtype_bytes: int
) -> int:
    """Bytes one linear layer's weight takes under ``quant`` as kvlab stores it."""
    n = out_f * in_f
    if quant == "none":
        return n * dtype_bytes
    if quant == "rtn" and options.bits == 8:
        return n + out_f * 2  # int8 codes + a bf16 scale per output channel
    if quant in ("rtn", "gptq", "awq"):
        return n // 2 + (in_f // options.group_size) * out_f * 4  # codes + bf16 scale, offset
    if quant == "bnb" and options.mode == "int8":
        return n + out_f * 4  # int8 + fp32 row scales (SCB)
    if quant == "bnb":
        blocks = -(-n // options.blocksize)
        absmax = blocks + 4 * -(-blocks // 256) + 256 * 4 if options.double_quant else 4 * blocks
        return n // 2 + absmax + 16 * 4  # packed codes + block statistics + code book
    raise ValueError(f"quant={quant!r} has no memory-model line")


def weight_bytes(
    arch: Architecture,
    quant: str = "none",
    options: Any = None,
    dtype: torch.dtype = torch.bfloat16,
) -> int:
    """Bytes of the weights: linear layers under ``quant``, the rest at ``dtype``."""
    from kvlab.quant import quant_options

    options = options if options is not None else quant_options(quant)
    size = dtype.itemsize
    linears = sum(
        quantized_linear_bytes(n, k, quant, options, size) for _, n, k in linear_shapes(arch)
    )
    return linears + (parameter_count(arch) - sum(n * k for _, n, k in linear_shapes(arch))) * size


def nominal_weight_bytes(parameters: float, bits: float) -> int:
    """The seeds' count: parameters x bits / 8 (no scales), e.g. 7e9 at 4 bits = 3.5 GB."""
    return int(parameters * bits / 8)


# ---- KV cache ------------------------------------------------------------------------------
def kv_bytes(
    arch: Architecture, cache: str = "full", options: dict[str, Any] | None = None,
    context: int = 4096, batch: int = 1, dtype: torch.dtype = torch.bfloat16,
) -> dict[str, int]:  # fmt: skip
    """Bytes per component a cache holds for ``batch`` sequences of ``context`` tokens:
    ``native`` is the model's own cache (MLA's latent, V4's compressed entries); a kvlab
    strategy over an MLA model holds its decompressed keys and values (``model.backend=hf``)."""
    if arch.kind == "gqa" or (arch.kind == "mla" and cache != "native"):
        strategy = registered()[cache]
        checked = strategy.Options(**(options or {}))
        windows = arch.layer_windows if strategy.stores_past else ()
        groups: dict[int | None, int] = {}
        for window in windows or (None,) * arch.layers:
            groups[window] = groups.get(window, 0) + 1
        out: dict[str, int] = {}
        for window, layers in groups.items():
            spec = CacheSpec(
                layers, arch.heads, arch.kv_heads, arch.head_dim, dtype, torch.device("meta")
            )
            if window is None:
                part = strategy.planned_bytes(spec, checked, batch, context)
            else:  # a ring of the window in the run's codec (cache/layered.py)
                ring = registered()["sliding"]
                ring_options = ring.Options(**window_options(checked, window))
                part = {f"window={window}": sum(
                    ring.planned_bytes(spec, ring_options, batch, context).values())}  # fmt: skip
            out |= part
        return out
    if cache not in ("full", "native"):
        raise ValueError(
            f"cache={cache!r}: kvlab models only the native cache of {arch.kind} models; "
            "allowed: native"
        )
    size = dtype.itemsize * batch
    if arch.kind == "mla":  # the latent (kv_lora_rank + rope) and, in V3.2, the indexer key
        return {"latent": arch.layers * context * arch.latent_dim * size,
                "indexer_keys": arch.layers * context * arch.index_dim * size}  # fmt: skip
    return _compressed_kv_bytes(arch, context, size)


def tier_block_bytes(
    arch: Architecture, options: dict[str, Any] | None = None,
    dtype: torch.dtype = torch.bfloat16,
) -> dict[str, int]:  # fmt: skip
    """Bytes of one block of ``cache=tiered`` with ``options`` in each tier: ``fast`` in the
    pool's codec, ``slow`` in the slow tier's (its own ``slow_kv_bits``, else the pool's),
    from the codecs' parts alone: layers x K and V x KV heads x block x a token's bytes."""
    checked = registered()["tiered"].Options(**(options or {}))
    fast = checked.codec(arch.head_dim)
    slow_options = checked.slow_codec_options()
    slow = fast if slow_options is None else slow_options.codec(arch.head_dim)
    per = 2 * arch.layers * arch.kv_heads * checked.block_size
    return {tier: per * codec.bytes_per_token(arch.head_dim, dtype)
            for tier, codec in (("fast", fast), ("slow", slow))}  # fmt: skip


def _compressed_kv_bytes(arch: Architecture, context: int, size: int) -> dict[str, int]:
    """DeepSeek-V4: per layer a sliding window of recent entries; CSA (ratio 4) one entry and
    one indexer key per 4 tokens; HCA one entry per 128 (pending tokens sit in the window)."""
    window = len(arch.ratios) * min(arch.window, context) * arch.head_dim * size
    entries = sum(context // r for r in arch.ratios if r) * arch.head_dim * size
    index_keys = (
        sum(context // r for r in arch.ratios if r and r < arch.window) * arch.index_dim * size
    )
    return {"sliding_window": window, "compressed": entries, "indexer_keys": index_keys}


def max_batch(
    arch: Architecture, cache: str, options: dict[str, Any] | None, context: int,
    budget_bytes: int, weights: int, dtype: torch.dtype = torch.bfloat16,
) -> int | None:  # fmt: skip
    """The most sequences of ``context`` tokens that fit ``budget_bytes`` beside the weights
    (every strategy's allocation is per sequence, so the cache grows linearly with batch)."""
    per_sequence = sum(kv_bytes(arch, cache, options, context, 1, dtype).values())
    if not per_sequence:
        return None  # keeps nothing between steps: the cache does not bound the batch
    return max(0, (budget_bytes - weights) // per_sequence)


# ---- the table `kvlab memory` prints -----------------------------------------------------
def memory_rows(
    source: str, context: int, batch: int, caches: list[str], quants: list[str],
    dtype: torch.dtype = torch.bfloat16, budget_gib: float | None = None,
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:  # fmt: skip
    """(weight rows per quantizer, KV rows per cache strategy) for ``source``."""
    arch = Architecture.from_config(load_config(source))
    if arch.kind == "mla":  # MLA's own latent beside the strategies over what hf stores
        caches = ["native", *(c for c in caches if c != "native")]
    elif arch.kind != "gqa":
        caches = ["native"]
    weight_rows = []
    for quant in quants:
        try:
            size = weight_bytes(arch, quant, dtype=dtype)
        except ValueError as exc:
            size, note = None, str(exc)
        else:
            note = ""
        weight_rows.append(
            {"quant": quant, "weight_bytes": size, "weight_gib": size and size / GIB, "note": note}
        )
    weights = next((r["weight_bytes"] for r in weight_rows if r["weight_bytes"]), 0)
    kv_rows = []
    for cache in caches:
        per_seq = sum(kv_bytes(arch, cache, None, context, 1, dtype).values())
        batch_bytes = sum(kv_bytes(arch, cache, None, context, batch, dtype).values())
        row = {"cache": cache, "kv_bytes_per_token": per_seq / context,
               "kv_gib_per_seq": per_seq / GIB, "kv_gib_batch": batch_bytes / GIB}  # fmt: skip
        if budget_gib:
            row["max_batch"] = max_batch(
                arch, cache, None, context, int(budget_gib * GIB), weights, dtype
            )
        kv_rows.append(row)
    return weight_rows, kv_rows
