"""A decoder layer's one-token decode step through ``decode_layer.c``: norm, QKV product,
q/k norms where the family has them, RoPE, then the cache's write and attention, output
product, residual, norm, gate/up product, SwiGLU, down product and residual, in place of
the op-by-op layer's forty-odd torch ops and wrapper calls a layer; the values are the same
(the C code rounds as those ops round, see the C file).

The cache hands each layer's write and attention over as data (``KVCache.decode_attentions``:
the policy's planned reads over its store, and its stage where it computes between the
projection and the attention), so every policy that plans its decode steps decodes here,
the built-ins and a researcher's alike. The SwiGLU activation runs in C
(:mod:`kvlab.kernels.layer.activation`) where torch's silu of the layer's shape runs whole
vectors: bf16 looked up in torch's own silu of every bf16 value, fp32 through the vector
exp torch's silu calls, taken from libtorch where a probe finds it gives torch's bits; the
op-by-op layer takes the same C there; else the activation runs in torch between two
calls. A step whose layers all make one call
runs them all in one call (:class:`FusedStep`): the cache hands every layer's attention
over first.

It serves layers whose four linears run a kvlab matrix-vector kernel at this row count
(:class:`~kvlab.kernels.linear.DecodeLinear`, fp32 or bf16; ``Int8Linear`` and
``Int4Linear`` where the plan names kvlab's int8 / int4 kernel), with or without q/k norms
(Qwen3: each query and key head normed in C before RoPE), on CPU tensors in eager mode;
everything else (compiled steps, prefill, other weight formats, other devices) takes the
op-by-op path.
"""

from __future__ import annotations

import ctypes
import operator

import torch
from torch import nn

from kvlab.kernels.attention import c_kernel_allowed
from kvlab.kernels.attention.backend_c import index_applies
from kvlab.kernels.build import FLOAT, INT, INT64, POINTER, kernel, library
from kvlab.kernels.layer.activation import (
    ONE_CALL_SPAN,
    bf16_activation,
    fp32_activation,
    fused_swiglu,
)
from kvlab.kernels.linear import MAX_ROWS, DecodeLinear, in_order, is_bf16
from kvlab.quant.rtn import Int4Linear, Int8Linear

_GENERATION = [0]  # bumped whenever a layer's weights may have moved (see weights_changed)


def weights_changed(*_) -> None:
    """Drop every layer's fused plan: its pointers are taken again on its next step. Called
    when any module, parameter or buffer is assigned anywhere (a quantizer's swap; torch's
    global registration hooks) and when a layer is moved or cast (``DecoderLayer._apply``)."""
    _GENERATION[0] += 1


torch.nn.modules.module.register_module_module_registration_hook(weights_changed)
torch.nn.modules.module.register_module_parameter_registration_hook(weights_changed)
torch.nn.modules.module.register_module_buffer_registration_hook(weights_changed)


class _Linear(ctypes.Structure):
    _fields_ = [
        ("weight", ctypes.c_void_p), ("weight_bf16", ctypes.c_int32),
        ("bias_bf16", ctypes.c_int32), ("bias", ctypes.c_void_p),
        ("out_features", ctypes.c_int64), ("in_features", ctypes.c_int64),
        ("kind", ctypes.c_int32), ("scale_bf16", ctypes.c_int32), ("scale", ctypes.c_void_p),
        ("group", ctypes.c_int64), ("input_perm", ctypes.c_void_p),
        ("compute_bf16", ctypes.c_int32), ("in_order", ctypes.c_int32),
    ]  # fmt: skip
    FP, INT8, INT4, W8A8, W4A8 = 0, 1, 2, 3, 4


class _LayerPlan(ctypes.Structure):  # decode_layer.c's LayerPlan
    _fields_ = [
        ("norms", ctypes.c_void_p * 2), ("eps", ctypes.c_float * 2),
        ("qkv_proj", ctypes.c_void_p), ("o_proj", ctypes.c_void_p),
        ("gate_up_proj", ctypes.c_void_p), ("heads", ctypes.c_int64),
        ("kv_heads", ctypes.c_int64), ("dim", ctypes.c_int64),
        ("down_proj", ctypes.c_void_p), ("inner", ctypes.c_int64),
        ("qk_norms", ctypes.c_void_p * 2), ("qk_eps", ctypes.c_float),
    ]  # fmt: skip


def _linear(layer: nn.Module, dtype: torch.dtype) -> _Linear:
    """``layer`` as decode_layer.c's Linear, in a model of ``dtype``."""
    bias = layer.bias
    compute = getattr(layer, "compute_dtype", None) or dtype
    fields = dict(
        bias_bf16=is_bf16(bias), bias=None if bias is None else bias.data_ptr(),
        out_features=layer.out_features, in_features=layer.in_features,
        compute_bf16=int(compute != dtype),
    )  # fmt: skip
    if type(layer) is DecodeLinear:
        return _Linear(weight=layer.weight.data_ptr(), weight_bf16=is_bf16(layer.weight),
                       in_order=layer.in_order, **fields)  # fmt: skip
    if type(layer) is Int4Linear:
        scale_offset = layer.scale_offset
        kind = _Linear.W4A8 if layer.int8_activations else _Linear.INT4
        perm = layer.input_perm  # GPTQ's act-order: int64 indices, contiguous
        return _Linear(weight=layer.packed.data_ptr(), kind=kind,
                       scale_bf16=is_bf16(scale_offset), scale=scale_offset.data_ptr(),
                       group=layer.group_size,
                       input_perm=None if perm is None else perm.data_ptr(), **fields)  # fmt: skip
    scale, kind = layer.scale, _Linear.W8A8 if layer.int8_activations else _Linear.INT8
    group = layer.activation_group or layer.in_features  # W8A8 with a scale a row: the row
    return _Linear(weight=layer.qweight.data_ptr(), kind=kind, scale_bf16=is_bf16(scale),
                   scale=scale.data_ptr(), group=group, in_order=in_order(layer.order),
                   **fields)  # fmt: skip


def kernel_rows(layer: nn.Module, dtype: torch.dtype) -> tuple[int, int] | None:
    """The row counts (first, last) for which ``layer`` runs a kvlab kernel the fused layer
    can call, with ``dtype`` activations: a :class:`DecodeLinear`'s; an ``Int4Linear``'s in
    kvlab's layout (with GPTQ's act-order permutation too) and an ``Int8Linear``'s where
    kvlab's int8 kernel was chosen or its activations are int8 too (``gemv_w8a8.c``),
    computing in ``dtype`` (or in bf16 in an fp32 model, as the quantization presets
    compute by default: C rounds x to bf16 and widens the product); else None."""
    if type(layer) is DecodeLinear:
        return layer.kernel_rows
    if type(layer) not in (Int4Linear, Int8Linear):
        return None
    compute = layer.compute_dtype or dtype
    if compute != dtype and (compute, dtype) != (torch.bfloat16, torch.float32):
        return None
    if type(layer) is Int4Linear:
        perm = layer.input_perm
        fits = layer.layout == "kvlab" and (perm is None or (index_applies(perm) and perm.is_cpu))
        return (1, MAX_ROWS) if fits and layer.scale_offset.dtype == compute else None
    if layer.scale.dtype != compute or layer.qweight.device.type != "cpu":
        return None
    if layer.int8_activations:  # gemv_w8a8.c, whatever the plan names for int8 weights
        return 1, MAX_ROWS
    one, few = layer.decode_kernel == "kvlab", layer.few_rows_kernel == "kvlab"
    return ((1 if one else 2), (MAX_ROWS if few else 1)) if one or few else None


def fused_plan(layer) -> FusedDecode | None:
    """``layer``'s plan, made on first use and again after :func:`weights_changed`; None
    where the layer cannot take the fused path."""
    plan = layer.fused
    if plan is None or plan.generation != _GENERATION[0]:
        plan = FusedDecode(layer)
        layer.fused = plan
    return plan if plan.applies else None


def _unplanned() -> None:
    return None


class FusedDecode:
    """The pointers and shapes one layer's fused decode step reads. A copied or pickled
    model gets no plan (its own weights are elsewhere): it plans again on first use."""

    def __reduce__(self):
        return _unplanned, ()

    def __init__(self, layer):
        self.generation = _GENERATION[0]
        self.last_path = ""  # the path __call__ took last (DecoderLayer.decode_paths)
        attn, mlp = layer.self_attn, layer.mlp
        linears = (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)
        norms = (layer.input_layernorm, layer.post_attention_layernorm)
        qk_norms = [n for n in (attn.q_norm, attn.k_norm) if n is not None]  # Qwen3's
        dtype = norms[0].weight.dtype
        rows = [kernel_rows(lin, dtype) for lin in linears]
        self.applies = (
            library() is not None
            and len(qk_norms) in (0, 2)
            and len({n.eps for n in qk_norms}) <= 1
            and None not in rows
            and dtype in (torch.float32, torch.bfloat16)
            and all(n.weight.dtype == dtype and n.weight.device.type == "cpu"
                    for n in (*norms, *qk_norms))
        )  # fmt: skip
        if not self.applies:
            return
        self.dtype, self.bf16 = dtype, int(dtype == torch.bfloat16)
        self.rows = (max(first for first, _ in rows), min(last for _, last in rows))
        self.layer, self.norms = attn.layer, [n.weight for n in norms]
        self.eps = [n.eps for n in norms]
        self.qk_norms = [n.weight for n in qk_norms]  # kept alive: C reads them
        self.qk_eps = qk_norms[0].eps if qk_norms else 0.0
        qk_at = [n.data_ptr() for n in self.qk_norms] or [None, None]
        self.heads, self.kv_heads, self.dim = attn.heads, attn.kv_heads, attn.head_dim
        self.hidden, self.inner = attn.o_proj.out_features, mlp.inner
        self.linears = [_linear(lin, dtype) for lin in linears]  # kept alive: C reads them
        # the tensors they point into, kept alive too: a weight swapped without a hook
        # (``param.data = ...``) leaves a stale plan, never a dangling pointer
        self.held = [t for lin in linears for t in (*lin.parameters(), *lin.buffers())]
        self.addresses = [ctypes.addressof(lin) for lin in self.linears]
        self.attention_in = kernel("kvlab_layer_attention_in", POINTER, INT, INT64, POINTER,
                                   FLOAT, POINTER, POINTER, POINTER, FLOAT, POINTER, POINTER,
                                   INT64, INT64, INT64, POINTER, POINTER, POINTER)  # fmt: skip
        self.mlp_in = kernel("kvlab_layer_mlp_in", POINTER, POINTER, INT, INT64, POINTER,
                             POINTER, FLOAT, POINTER, POINTER, POINTER, POINTER)  # fmt: skip
        self.out = kernel("kvlab_layer_out", POINTER, POINTER, INT, INT64, POINTER, POINTER,
                          POINTER)  # fmt: skip
        self.decode_in = kernel("kvlab_layer_decode_in", POINTER, INT, INT64, POINTER, POINTER,
                                POINTER, POINTER, POINTER, POINTER, *[POINTER] * 6)  # fmt: skip
        norms = (ctypes.c_void_p * 2)(*(n.data_ptr() for n in self.norms))
        self.plan = _LayerPlan(norms, (ctypes.c_float * 2)(*self.eps), *self.addresses[:3],
                               self.heads, self.kv_heads, self.dim, self.addresses[3],
                               self.inner, (ctypes.c_void_p * 2)(*qk_at),
                               self.qk_eps)  # fmt: skip
        self.plan_address = ctypes.addressof(self.plan)
        self.buffers: dict[int, _StepBuffers] = {}  # per batch size (_step_buffers)
        # the activation in C too where torch's silu runs whole vectors (bf16 from a table,
        # fp32 through torch's own vector exp where the probe found it): then the op-by-op
        # layer takes the same C (fused_swiglu), so one call serves every row count
        self.one_call = False
        activation = bf16_activation() if self.bf16 else fp32_activation()
        span = ONE_CALL_SPAN if self.bf16 else 2 * (activation.width if activation else 0)
        if activation is not None and self.inner % span == 0:
            self.one_call = True
            self.activation_at = ctypes.addressof(activation)
            self.decode = kernel("kvlab_layer_decode", POINTER, INT, INT64, POINTER, POINTER,
                                 POINTER, POINTER, POINTER, POINTER, *[POINTER] * 9)  # fmt: skip

    def takes(self, x: torch.Tensor, cos: torch.Tensor) -> bool:
        """Whether this step's x (B, 1, hidden) and rotary table fit the fused path."""
        first, last = self.rows
        return (
            x.dtype == self.dtype
            and x.device.type == "cpu"
            and first <= x.shape[0] <= last
            and x.is_contiguous()
            and cos.dtype == self.dtype
            and cos.is_contiguous()
        )

    def __call__(self, x: torch.Tensor, rope, cache, step) -> torch.Tensor:
        """The layer's output (B, 1, hidden) for x (B, 1, hidden); ``last_path`` says how:
        ``c_attention`` (the cache's attention in the C call) or ``cache_attends``."""
        cached = cache.decode_attentions(step, [self.layer])[0] if c_kernel_allowed() else None
        if cached is not None and cached[3] == self.dtype:
            self.last_path = "c_attention"
            return self._with_cached_attention(x, rope, *cached[:3])
        self.last_path = "cache_attends"
        batch, dtype, bf16, hidden = x.shape[0], self.dtype, self.bf16, self.hidden
        heads, kv_heads, dim = self.heads, self.kv_heads, self.dim
        qkv = torch.empty(batch, 1, (heads + 2 * kv_heads) * dim, dtype=dtype)
        rotated = torch.empty(batch, 1, heads + kv_heads, dim, dtype=dtype)
        scratch = torch.empty(2 * batch * hidden, dtype=dtype)
        q_norm, k_norm = self.plan.qk_norms
        self.attention_in(
            x.data_ptr(), bf16, batch, self.norms[0].data_ptr(), self.eps[0],
            self.addresses[0], q_norm, k_norm, self.qk_eps, rope.cos.data_ptr(),
            rope.sin.data_ptr(), heads, kv_heads, dim, scratch.data_ptr(), qkv.data_ptr(),
            rotated.data_ptr(),
        )  # fmt: skip
        q, k = rotated.transpose(1, 2).split_with_sizes([heads, kv_heads], 1)  # (B, H|H_kv, 1, D)
        k_raw = qkv[..., heads * dim : (heads + kv_heads) * dim].view(batch, 1, kv_heads, dim)
        v = qkv[..., (heads + kv_heads) * dim :].view(batch, 1, kv_heads, dim)
        out = cache.attend(step, self.layer, q, k, v.transpose(1, 2), k_raw.transpose(1, 2))
        attention = out.transpose(1, 2).reshape(batch, heads * dim).contiguous()  # (B, H * D)
        mid = torch.empty(batch, 1, hidden, dtype=dtype)
        gate_up = torch.empty(batch, 2 * self.inner, dtype=dtype)
        self.mlp_in(
            attention.data_ptr(), x.data_ptr(), bf16, batch, self.addresses[1],
            self.norms[1].data_ptr(), self.eps[1], self.addresses[2], mid.data_ptr(),
            gate_up.data_ptr(), scratch.data_ptr(),
        )  # fmt: skip
        activation = fused_swiglu(gate_up, self.inner)  # (B, inner)
        y = torch.empty(batch, 1, hidden, dtype=dtype)
        self.out(activation.data_ptr(), mid.data_ptr(), bf16, batch, self.addresses[3],
                 scratch.data_ptr(), y.data_ptr())  # fmt: skip
        return y

    def _with_cached_attention(self, x, rope, attention: int, blocks, slots: torch.Tensor):
        """The layer's output where the cache hands its writes and attention over as C
        (``KVCache.decode_attentions``): one call in all where the activation runs in C
        (``one_call``), else one call up to the activation, the activation in torch and one
        call more; no cache or attention Python in between."""
        batch = x.shape[0]
        step = self._step_buffers(batch)
        if self.one_call:
            y = torch.empty(batch, 1, self.hidden, dtype=self.dtype)
            self.decode(
                x.data_ptr(), self.bf16, batch, self.plan_address, rope.cos.data_ptr(),
                rope.sin.data_ptr(), attention, blocks.data_ptr(), slots.data_ptr(),
                *step.decode_in, self.activation_at, step.activation_at, y.data_ptr(),
            )  # fmt: skip
            return y
        self.decode_in(
            x.data_ptr(), self.bf16, batch, self.plan_address, rope.cos.data_ptr(),
            rope.sin.data_ptr(), attention, blocks.data_ptr(), slots.data_ptr(), *step.decode_in,
        )  # fmt: skip
        activation = fused_swiglu(step.gate_up, self.inner)
        y = torch.empty(batch, 1, self.hidden, dtype=self.dtype)
        self.out(activation.data_ptr(), step.mid_at, self.bf16, batch, self.addresses[3],
                 step.scratch_at, y.data_ptr())  # fmt: skip
        return y

    def _step_buffers(self, batch: int) -> _StepBuffers:
        """The layer's own buffers for a step of ``batch`` rows, made once, and their
        addresses: only C reads them within the step, and the activation in torch between
        the calls, so a step never sees an earlier step's (the output is a new tensor)."""
        if batch not in self.buffers:
            heads, kv, dim, hidden = self.heads, self.kv_heads, self.dim, self.hidden
            self.buffers[batch] = _StepBuffers(
                batch, self.dtype, (heads + 2 * kv) * dim, (heads + kv) * dim, heads * dim,
                hidden, self.inner,
            )  # fmt: skip
        return self.buffers[batch]


class FusedStep:
    """A model's decode step through all its layers in one C call
    (``kvlab_layers_decode``) where every layer takes the one-call path
    (:meth:`FusedDecode._with_cached_attention`): its Python a layer (the module call, the
    plan, the C call's arguments and output) paid once a step. The cache hands every
    layer's writes and attention over first, all at once (``KVCache.decode_attentions``);
    the values are the per-layer calls', the same C code in the same order. Made per model
    on first use and again when a layer's plan changes (:func:`fused_plan`); a copied or
    pickled model makes its own."""

    def __reduce__(self):
        return _unplanned, ()

    def __init__(self, plans: list[FusedDecode]):
        self.plans = plans
        first = plans[0]
        shape = (first.dtype, first.heads, first.kv_heads, first.dim, first.hidden, first.inner)
        self.applies = all(
            p.one_call and (p.dtype, p.heads, p.kv_heads, p.dim, p.hidden, p.inner) == shape
            for p in plans
        )
        if not self.applies:
            return
        # the batch sizes every layer takes in one call (their kernels' rows may differ)
        self.rows = (max(p.rows[0] for p in plans), min(p.rows[1] for p in plans))
        self.table = (ctypes.c_void_p * (4 * len(plans)))()
        self.plan_addresses = [p.plan_address for p in plans]
        self.layers = [p.layer for p in plans]
        self.between: dict[int, torch.Tensor] = {}
        self.decode = kernel("kvlab_layers_decode", POINTER, INT, INT64, INT64, POINTER,
                             *[POINTER] * 12)  # fmt: skip

    def holds(self, plans: list[FusedDecode]) -> bool:
        """Whether it was made for these plans, layer by layer."""
        return len(plans) == len(self.plans) and all(map(operator.is_, plans, self.plans))

    def __call__(self, x: torch.Tensor, rope, cache, step) -> torch.Tensor | None:
        """The last layer's output (B, 1, hidden) for the first one's input x, or None where
        a layer cannot take the one-call path this step (the caller runs them one by one)."""
        batch, first = x.shape[0], self.plans[0]
        fits = self.rows[0] <= batch <= self.rows[1] and first.takes(x, rope.cos)
        if not fits or not c_kernel_allowed():
            return None
        attentions = cache.decode_attentions(step, self.layers)
        dtype = first.dtype
        if any(a is None or a[3] != dtype for a in attentions):
            return None
        layers = zip(self.plan_addresses, attentions, strict=True)
        self.table[:] = [
            field
            for at, (attention, blocks, slots, _) in layers
            for field in (at, attention, blocks.data_ptr(), slots.data_ptr())
        ]
        buffers = first._step_buffers(batch)
        if batch not in self.between:
            self.between[batch] = torch.empty(2 * batch * first.hidden, dtype=dtype)
        y = torch.empty(batch, 1, first.hidden, dtype=dtype)
        self.decode(
            x.data_ptr(), first.bf16, batch, len(self.plans), self.table, rope.cos.data_ptr(),
            rope.sin.data_ptr(), *buffers.decode_in, first.activation_at, buffers.activation_at,
            self.between[batch].data_ptr(), y.data_ptr(),
        )  # fmt: skip
        return y


def fused_step(model, plan_of=fused_plan) -> FusedStep | None:
    """``model``'s :class:`FusedStep`, made on first use and again when a layer's plan
    (``plan_of(layer)``) changes; None where a layer has no plan or the step does not apply."""
    plans = [plan_of(layer) for layer in model.layers]
    if None in plans:
        return None
    made = model.fused_step
    if made is None or not made.holds(plans):
        made = FusedStep(plans)
        model.fused_step = made
    return made if made.applies else None


class _StepBuffers:
    """One layer's scratch for a decode step of ``batch`` rows: qkv, rotated heads,
    attention output, mid, gate/up and scratch in the order ``kvlab_layer_decode_in`` takes
    them (their addresses: :attr:`decode_in`), and the activation ``kvlab_layer_out`` reads."""

    def __init__(self, batch, dtype, qkv, rotated, attention, hidden, inner):
        sizes = (qkv, rotated, attention, hidden, 2 * inner, 2 * hidden)
        self.tensors = [torch.empty(batch, n, dtype=dtype) for n in sizes]
        self.gate_up = self.tensors[4]
        self.activation = torch.empty(batch, inner, dtype=dtype)
        self.decode_in = tuple(t.data_ptr() for t in self.tensors)
        self.activation_at = self.activation.data_ptr()
        self.mid_at, self.scratch_at = self.decode_in[3], self.decode_in[5]
