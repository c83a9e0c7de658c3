"""A compact decoder for the Llama family (Llama 2/3, Mistral, Qwen2/2.5, Qwen3, SmolLM).

Pre-norm transformer with RMSNorm, RoPE, grouped-query attention and a SwiGLU MLP
(Touvron et al., arXiv 2302.13971 / 2307.09288). q/k/v and gate/up are fused into one
matmul each. Attention owns no cache: every layer hands q, k, v to the cache strategy.
"""

from __future__ import annotations

import hashlib
from collections import Counter
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from kvlab.cache.base import CacheSpec, KVCache, Step, StepInfo
from kvlab.kernels.layer.activation import fused_swiglu
from kvlab.kernels.layer.norm import fused_rms_norm
from kvlab.models.config import DecoderConfig
from kvlab.models.fused_layer import FusedDecode, FusedStep, fused_plan, fused_step, weights_changed
from kvlab.models.packed import PackedPart, StepPart
from kvlab.models.rope import RotaryTables, inverse_frequencies


class RMSNorm(nn.Module):
    """Root-mean-square norm (Zhang & Sennrich, arXiv 1910.07467), computed in fp32."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        fused = fused_rms_norm(x, self.weight, self.eps)  # eager on the CPU: one C call
        if fused is not None:
            return fused
        normed = F.rms_norm(x.float(), (x.shape[-1],), eps=self.eps).to(x.dtype)
        return self.weight * normed


class Attention(nn.Module):
    """GQA projections + RoPE; the attention itself is the cache strategy's job."""

    def __init__(self, cfg: DecoderConfig, layer: int):
        super().__init__()
        self.layer = layer
        self.heads, self.kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        qkv_out = (cfg.num_heads + 2 * cfg.num_kv_heads) * cfg.head_dim
        self.qkv_proj = nn.Linear(cfg.hidden_size, qkv_out, bias=cfg.qkv_bias)
        self.o_proj = nn.Linear(cfg.num_heads * cfg.head_dim, cfg.hidden_size, bias=cfg.o_bias)
        self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None

    def forward(
        self, x: torch.Tensor, rope: RotaryTables, cache: KVCache, step: Step
    ) -> torch.Tensor:
        batch, steps, _ = x.shape
        out = cache.attend(step, self.layer, *self.project(x, rope))  # (B, H, T, D)
        return self.o_proj(out.transpose(1, 2).reshape(batch, steps, self.heads * self.head_dim))

    def project(self, x: torch.Tensor, rope: RotaryTables) -> tuple[torch.Tensor, ...]:
        """q (B, H, T, D), k, v (B, H_kv, T, D) of x (B, T, hidden), q and k rotated, and
        k before RoPE (for strategies that re-position keys)."""
        batch, steps, _ = x.shape
        heads, kv_heads, dim = self.heads, self.kv_heads, self.head_dim
        qk, v = self.qkv_proj(x).split([(heads + kv_heads) * dim, kv_heads * dim], dim=-1)
        qk = qk.view(batch, steps, heads + kv_heads, dim)  # (B, T, H + H_kv, D)
        if self.q_norm is not None and self.k_norm is not None:
            q, k = qk.split([heads, kv_heads], dim=2)
            qk = torch.cat((self.q_norm(q), self.k_norm(k)), dim=2)  # (B, T, H + H_kv, D)
        q, k = rope.rotate(qk).transpose(1, 2).split([heads, kv_heads], dim=1)  # (B, H|H_kv, T, D)
        k_raw = qk[:, :, heads:].transpose(1, 2)  # (B, H_kv, T, D), before RoPE
        v = v.view(batch, steps, kv_heads, dim).transpose(1, 2)  # (B, H_kv, T, D)
        return q, k, v, k_raw

    def packed(self, x: torch.Tensor, rope: RotaryTables, parts: list[PackedPart]) -> torch.Tensor:
        """x (1, N, hidden): the real tokens of every part, one after another; each part's
        attention is its cache's, over that part's rows laid out as its step planned them."""
        projected = self.project(x, rope)  # (1, H|H_kv, N, D) each
        outs = [
            part.tokens(part.cache.attend(part.step, self.layer, *map(part.rows, projected)))
            for part in parts
        ]
        return self.o_proj(torch.cat(outs)[None])  # (1, N, hidden)


class MLP(nn.Module):
    """SwiGLU feed-forward (Shazeer, arXiv 2002.05202) with gate and up fused."""

    def __init__(self, cfg: DecoderConfig):
        super().__init__()
        self.inner = cfg.intermediate_size
        self.gate_up_proj = nn.Linear(cfg.hidden_size, 2 * self.inner, bias=cfg.mlp_bias)
        self.down_proj = nn.Linear(self.inner, cfg.hidden_size, bias=cfg.mlp_bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(fused_swiglu(self.gate_up_proj(x), self.inner))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: DecoderConfig, layer: int):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg, layer)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)
        self.fused: FusedDecode | None = None  # the one-token decode step in C, planned on use
        self.decode_paths: Counter[str] = Counter()  # its decode steps by the path they took

    def forward(
        self, x: torch.Tensor, rope: RotaryTables, cache: KVCache, step: Step
    ) -> torch.Tensor:
        if not torch.compiler.is_compiling() and x.shape[1] == 1:
            fused = fused_plan(self)
            if fused is not None and fused.takes(x, rope.cos):
                y = fused(x, rope, cache, step)
                self.decode_paths[fused.last_path] += 1
                return y
            self.decode_paths["op_by_op"] += 1
        x = x + self.self_attn(self.input_layernorm(x), rope, cache, step)
        return x + self.mlp(self.post_attention_layernorm(x))

    def packed(self, x: torch.Tensor, rope: RotaryTables, parts: list[PackedPart]) -> torch.Tensor:
        """The layer over a packed step (:meth:`Decoder.packed_logits`), op by op."""
        x = x + self.self_attn.packed(self.input_layernorm(x), rope, parts)
        return x + self.mlp(self.post_attention_layernorm(x))

    def _apply(self, fn, recurse=True):  # .to(), .float(), ...: the weights may move
        weights_changed()
        return super()._apply(fn, recurse)


def fits_one_call(x: torch.Tensor) -> bool:
    """Whether a step of x (B, T, hidden) may run its layers in one C call
    (:class:`FusedStep`): one token a row, eager, on the CPU."""
    return x.shape[1] == 1 and x.device.type == "cpu" and not torch.compiler.is_compiling()


def logit_rows(x: torch.Tensor, logit_index: torch.Tensor | None) -> torch.Tensor:
    """The positions of x (B, T, hidden) the vocabulary is projected at: all (None), one a
    row (``logit_index`` (B,): (B, hidden)), or the marked ones row by row (a boolean
    (B, T): (N, hidden))."""
    if logit_index is None:
        return x
    if logit_index.dtype == torch.bool:
        return x[logit_index]
    return x[torch.arange(x.shape[0], device=x.device), logit_index]


class CachedDecoder(nn.Module):
    """What the engine calls on a model, whatever runs its layers (kvlab's :class:`Decoder`,
    or transformers' class in :mod:`kvlab.models.hf_backend`): ``forward`` plans the step on
    the cache, runs :meth:`logits`, ends the step; ``cache_spec``; ``fingerprint``. A
    subclass has ``config`` (the shapes), ``embed_tokens``, ``inv_freq``, ``huge_pages``."""

    def config_digest(self) -> bytes:
        raise NotImplementedError

    def cache_spec(self) -> CacheSpec:
        """Shapes, dtype and device a cache strategy needs to serve this model."""
        c, weight = self.config, self.embed_tokens.weight
        return CacheSpec(
            c.num_layers,
            c.num_heads,
            c.num_kv_heads,
            c.head_dim,
            weight.dtype,
            weight.device,
            self.fingerprint(),
            self.huge_pages,
            getattr(c, "layer_windows", ()),
        )

    def fingerprint(self) -> str:
        """Identity of this model for what is fitted to it: its config and a sample of its
        embeddings at bf16 precision (the same for the model at any dtype or weight
        quantization, which leaves embeddings alone; different for other weights)."""
        if getattr(self, "_fingerprint", None) is None:
            digest = hashlib.sha256(self.config_digest())
            sample = self.embed_tokens.weight[:8].detach().to("cpu", torch.bfloat16).float()
            digest.update(sample.numpy().tobytes())
            self._fingerprint = digest.hexdigest()[:16]
        return self._fingerprint

    def forward(
        self,
        ids: torch.Tensor,
        positions: torch.Tensor,
        cache: KVCache,
        num_new: list[int] | None = None,
        logit_index: torch.Tensor | None = None,
        layers: Callable | None = None,
        context_end: list[bool] | None = None,
    ) -> torch.Tensor:
        """ids, positions (B, T); ``num_new[b]`` real tokens in row b (default: all T);
        ``context_end[b]``: row b's context ends in this step (see :class:`StepInfo`).

        Returns logits (B, T, V), or (B, V) at ``logit_index[b]`` of each row when given,
        so prefill does not pay for the vocabulary projection of every prompt token; a
        boolean ``logit_index`` (B, T) marks the positions to project: (N, V), row by row
        (scoring projects real tokens only, not padding).
        The cache plans the step's metadata once (``plan``), the step goes down to every
        layer as an argument, and the cache commits it (``end``); ``layers`` run it —
        :meth:`logits`, or a compiled version of it (the engine's compiled decode step).
        """
        batch, steps = ids.shape
        rope, step = self.plan_step(cache, ids, positions, num_new or [steps] * batch, context_end)
        logits = (layers or self.logits)(ids, rope, cache, step, logit_index)
        cache.end(step)
        return logits

    def plan_step(
        self, cache: KVCache, ids, positions, num_new: list[int], context_end=None
    ) -> tuple[RotaryTables, Step]:
        """RoPE's tables for a step feeding ``ids`` at ``positions`` (built once, for every
        layer) and ``cache``'s plan of it (whatever step object the cache returns)."""
        rope = RotaryTables(self.inv_freq, positions, self.embed_tokens.weight.dtype)
        return rope, cache.plan(StepInfo(positions, num_new, rope, ids, context_end))

    def forward_parts(self, parts: list[StepPart]) -> list[torch.Tensor]:
        """One step over several caches' parts (:mod:`kvlab.models.packed`): each part's
        logits as :meth:`forward` returns them. Every part is planned before any layer
        runs, so a part that does not fit (``NoRoom``) stops the step before anything was
        computed, and the step is planned again once a request was preempted (planning
        the same tokens again places them where the first planning did)."""
        if len(parts) == 1:
            p = parts[0]
            return [self(p.ids, p.positions, p.cache, p.num_new, p.logit_index, None,
                         p.context_end)]  # fmt: skip
        planned = [
            self.plan_step(p.cache, p.ids, p.positions, p.num_new, p.context_end) for p in parts
        ]
        logits = self.packed_logits(parts, planned)
        for p, (_, step) in zip(parts, planned, strict=True):
            p.cache.end(step)
        return logits

    def packed_logits(
        self, parts: list[StepPart], planned: list[tuple[RotaryTables, Step]]
    ) -> list[torch.Tensor]:
        """The layers of a step of several parts, each planned with its RoPE tables; by
        default each part's layers in turn (:meth:`logits`), a model that packs them
        overrides it."""
        return [
            self.logits(p.ids, rope, p.cache, step, p.logit_index)
            for p, (rope, step) in zip(parts, planned, strict=True)
        ]


class Decoder(CachedDecoder):
    """The whole model: ``forward(ids, positions, cache, ...)`` → logits."""

    backend = "native"  # kvlab's decoder (``model.backend``; hf: models.hf_backend)

    def __init__(self, cfg: DecoderConfig):
        super().__init__()
        self.config = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        self.register_buffer("inv_freq", inverse_frequencies(cfg), persistent=False)
        self.huge_pages = False  # weights on huge pages, its caches too (kernels.huge_pages)
        self.huge_page_bytes = 0
        self.fused_step: FusedStep | None = None  # a decode step's layers in one C call
        self.step_in_one_call = True  # False: layer by layer (for benchmarks side by side)
        self.kernel_plan = None  # the kernels its layers run (kvlab.kernels.plan), set on load
        self.one_call_steps = 0  # decode steps whose layers ran in one C call (FusedStep)

    def decode_paths(self) -> Counter[str]:
        """The layer steps of every decode step so far, by the path each took: ``one_call``
        (the step's layers in one C call), ``c_attention`` (the layer's C call with the
        cache's attention inside), ``cache_attends`` (the layer's C calls, the cache's
        attention in Python between them), ``op_by_op`` (torch ops, the reference). A
        compiled step counts in none."""
        paths = Counter({"one_call": self.one_call_steps * len(self.layers)})
        for layer in self.layers:
            paths.update(layer.decode_paths)
        return +paths

    def config_digest(self) -> bytes:
        return repr(sorted(vars(self.config).items())).encode()

    def logits(
        self,
        ids: torch.Tensor,
        rope: RotaryTables,
        cache: KVCache,
        step: Step,
        logit_index: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """The layers of one step whose metadata the cache has planned: no host state,
        no Python loop over rows, so it compiles to one graph per shape."""
        x = self.embed_tokens(ids)  # (B, T, hidden)
        in_one_call = None
        if self.step_in_one_call and fits_one_call(x):
            whole = fused_step(self, fused_plan)
            in_one_call = None if whole is None else whole(x, rope, cache, step)
        if in_one_call is not None:
            x = in_one_call
            self.one_call_steps += 1
        else:
            for layer in self.layers:
                x = layer(x, rope, cache, step)
        return self.lm_head(self.norm(logit_rows(x, logit_index))).float()

    def packed_logits(
        self, parts: list[StepPart], planned: list[tuple[RotaryTables, Step]]
    ) -> list[torch.Tensor]:
        """The step's real tokens of every part in one (1, N) sequence through the dense
        layers (RoPE's tables for them built once), each part's attention through its own
        cache; each part's logits."""
        packed, offset = [], 0
        for p, (_, step) in zip(parts, planned, strict=True):
            packed.append(PackedPart.of(p, step, offset))
            offset += packed[-1].count
        ids = torch.cat([pp.take(p.ids) for pp, p in zip(packed, parts, strict=True)])
        where = torch.cat([pp.take(p.positions) for pp, p in zip(packed, parts, strict=True)])
        rope = RotaryTables(self.inv_freq, where[None], self.embed_tokens.weight.dtype)
        x = self.embed_tokens(ids[None])  # (1, N, hidden)
        for layer in self.layers:
            x = layer.packed(x, rope, packed)
        picks = [pp.logit_positions(p.logit_index) for pp, p in zip(packed, parts, strict=True)]
        logits = self.lm_head(self.norm(x[0, torch.cat(picks)])).float()
        split = logits.split([len(pick) for pick in picks])
        return [
            pp.shaped(part_logits, p.logit_index)
            for pp, p, part_logits in zip(packed, parts, split, strict=True)
        ]
