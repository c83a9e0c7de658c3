"""The fused decode layer (``decode_layer.c``) against the op-by-op layer it replaces: the
same logits, bit for bit, over a generation of several rows on every family whose layers
it serves (biases, tied heads, scaled RoPE), in fp32 and bf16; and the layers it must not
serve take the op-by-op path."""

from __future__ import annotations

import copy as copy_module
import ctypes
import pickle

import pytest
import torch
import torch.nn.functional as F
from test_cache_contract import codec_settings
from torch import nn

from kvlab import load_model
from kvlab.cache import build_cache, registered
from kvlab.engine import Engine, GenerationConfig
from kvlab.kernels import build, kernel_available
from kvlab.kernels.attention import backend_c, cached
from kvlab.kernels.layer import activation as act
from kvlab.kernels.linear import DecodeLinear
from kvlab.models import fused_layer, llama
from kvlab.quant import quantize_
from kvlab.quant.rtn import Int4Linear, Int8Linear

needs_kernel = pytest.mark.skipif(not kernel_available(), reason="no C compiler for the kernel")
PROMPTS = [[5, 17, 3, 99, 42, 7], [8, 1, 200], [64, 65, 66, 67, 68]]


def with_decode_linears(
    path, dtype: torch.dtype, bits: int | str | None = None, compute: str = "input"
) -> nn.Module:
    """The tiny checkpoint at ``path`` in ``dtype``, every linear on a kvlab kernel: int8,
    int8 with int8 activations (``bits`` "w8a8": a scale every 32 channels; "w8a8-row": one
    a row), int4 (asymmetric groups of 32) weights or
    those with int8 activations (``bits`` "w4a8"), either with a GPTQ act-order
    permutation of their inputs ("int4-act-order", "w4a8-act-order"), computing in
    ``compute``, else fp."""
    model, _ = load_model(str(path), dtype=dtype, cpu_prepack=False)
    act_order = isinstance(bits, str) and bits.endswith("-act-order")
    bits = bits.removesuffix("-act-order") if act_order else bits
    bits = 4 if bits == "int4" else bits
    if bits is not None:
        options = {"bits": bits, "compute_dtype": compute}
        if bits in ("w8a8", "w8a8-row"):
            options |= {"bits": 8, "activations": "int8"}
        if bits == "w8a8-row":
            options |= {"activation_group": "row"}
        if bits == "w4a8":
            options |= {"bits": 4, "activations": "int8"}
        if options["bits"] == 4:
            options |= {"group_size": 32, "symmetric": False}
        quantize_(model, "rtn", options)  # kvlab's int4 blocks: the plan's default
        generator = torch.Generator().manual_seed(0)
        for layer in model.modules():
            if type(layer) is Int8Linear:
                layer.decode_kernel = layer.few_rows_kernel = "kvlab"
            if type(layer) is Int4Linear and act_order:  # groups over permuted inputs
                layer.input_perm = torch.randperm(layer.in_features, generator=generator)
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is nn.Linear:
                setattr(parent, name, DecodeLinear(child))
    return model


def decode_logits(model, steps: int = 6, cache: str = "full", prompts=PROMPTS, **options):
    seen = []
    engine = Engine(model, build_cache(cache, model.cache_spec(), options))
    gen = GenerationConfig(steps, stop_on_eos=False)
    engine.generate(prompts, gen, on_logits=lambda logits, rows: seen.append(logits.clone()))
    return seen


@needs_kernel
@pytest.mark.parametrize(
    "family", ["llama", "llama3_scaled", "llama2_linear", "qwen2", "qwen3", "smollm"]
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize(
    "bits",
    [None, 8, "w8a8", "w8a8-row", 4, "w4a8", "int4-act-order", "w4a8-act-order"],
    ids=["fp", "int8", "w8a8", "w8a8-row", "int4", "w4a8", "int4-act-order", "w4a8-act-order"],
)
def test_fused_layer_kernel_gives_the_op_by_op_logits(
    family, dtype, bits, tiny_checkpoints, monkeypatch
):
    compute = "bfloat16" if dtype == torch.bfloat16 else "input"  # scales in the model dtype
    model = with_decode_linears(tiny_checkpoints[family], dtype, bits, compute)
    with torch.inference_mode():
        fused = decode_logits(model)
        assert all(layer.fused is not None and layer.fused.applies for layer in model.layers)
        monkeypatch.setattr(llama, "fused_plan", lambda layer: None)
        reference = decode_logits(model)
    assert len(fused) == len(reference) == 6
    for got, want in zip(fused, reference, strict=True):
        assert torch.equal(got, want)


@needs_kernel
@pytest.mark.parametrize(
    "bits", [8, "w8a8", 4, "w4a8", "int4-act-order"],
    ids=["int8", "w8a8", "int4", "w4a8", "int4-act-order"],
)  # fmt: skip
def test_an_fp32_models_layers_computing_in_bf16_take_the_fused_path(
    bits, tiny_checkpoints, monkeypatch
):
    """Quantized layers of an fp32 model that compute in bf16 (the presets' default
    ``compute_dtype``) take the fused path (qwen2: biases, added in fp32 after the bf16
    product): C rounds x to bf16 and widens the product as the layer's own ``.to`` calls
    do, so the logits are the op-by-op layers' bit for bit."""
    model = with_decode_linears(tiny_checkpoints["qwen2"], torch.float32, bits, "bfloat16")
    with torch.inference_mode():
        fused = decode_logits(model)
        assert all(layer.fused is not None and layer.fused.applies for layer in model.layers)
        assert any(lin.compute_bf16 for layer in model.layers for lin in layer.fused.linears)
        monkeypatch.setattr(llama, "fused_plan", lambda layer: None)
        reference = decode_logits(model)
    assert all(torch.equal(a, b) for a, b in zip(fused, reference, strict=True))


def test_the_silu_table_gives_torchs_silu_in_the_shapes_the_one_call_layer_serves():
    """A bf16 layer's one C call looks its SwiGLU activation up in ``silu_table``: every bf16
    value, laid out as the gate halves of gate/up rows (B, 1, 2 * inner) of the shapes torch
    runs serial (inner a multiple of ONE_CALL_SPAN, B * inner under its grain size), gets
    the bits torch's ``F.silu`` gives there (``fused_swiglu``'s test: at every size)."""
    table, values = act.silu_table(), act.every_bf16()
    for inner in (act.ONE_CALL_SPAN, 1536, 8192):
        rows = (act.TORCH_SERIAL_ELEMENTS - 1) // inner
        for start in range(0, 65536, rows * inner):
            part = values[start : start + rows * inner]
            part = torch.cat([part, values[: (-part.numel()) % inner]]).view(-1, 1, inner)
            gate_up = torch.cat([part, torch.ones_like(part)], dim=-1)
            gate = gate_up.split(inner, dim=-1)[0]
            looked_up = table[gate.reshape(-1).view(torch.int16).long() & 0xFFFF]
            assert torch.equal(
                F.silu(gate).reshape(-1).view(torch.int16), looked_up.view(torch.int16)
            )


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_fused_swiglu_is_torchs_silu_times_up_bit_for_bit(dtype):
    """A layer run op by op takes its SwiGLU activation from ``fused_swiglu``: every bf16
    value as a gate, and rows below and past the count the C shares among its threads (a
    decode batch, a prefill chunk), give torch's ``F.silu(gate) * up`` bit for bit; rows
    torch would not run through whole vectors (inner 96), and a tensor autograd tracks,
    take torch's ops (gradients flow)."""
    if dtype == torch.float32 and act.fp32_activation() is None:
        pytest.skip("no vector exp of torch's at a width this build has")
    generator = torch.Generator().manual_seed(0)
    every = act.every_bf16().view(-1, 128).to(dtype)
    shapes = [(every.shape[0], 1, 128), (3, 1, 1536), (64, 1, 1536), (1, 700, 1536), (1, 9, 96)]
    for rows, steps, inner in shapes:
        gate_up = torch.randn(rows, steps, 2 * inner, generator=generator).to(dtype) * 4
        if inner == 128:
            gate_up[:, 0, :inner] = every
        gate, up = gate_up.split(inner, dim=-1)
        want, got = F.silu(gate) * up, act.fused_swiglu(gate_up, inner)
        bits = torch.int16 if dtype == torch.bfloat16 else torch.int32
        assert got.shape == want.shape and got.dtype == dtype
        assert torch.equal(got.view(bits), want.view(bits)), (rows, steps, inner)
    tracked = torch.randn(2, 2 * 128, dtype=dtype, requires_grad=True)
    act.fused_swiglu(tracked, 128).sum().backward()
    assert tracked.grad is not None and tracked.grad.abs().sum() > 0


@needs_kernel
def test_the_fp32_activation_in_c_is_torchs_bit_for_bit_or_not_taken():
    """An fp32 layer's one C call computes its SwiGLU activation with the vector exp torch's
    own silu calls (``fp32_activation``): where the probe took it, it gives torch's bits
    over other rows than the probe's (long and short, gates from a normal and from the
    exp's far ends); a close but different exp (glibc's vector expf, <= 1 ulp) is refused
    by the probe. Without one (a torch dispatching to no vector width the build has, or no
    such export) the layers keep the activation in torch between two calls; the probe
    itself never refuses torch's own exp."""
    activation = act.fp32_activation()
    if activation is None:
        assert act.torch_vector_exp() is None
        pytest.skip("no vector exp of torch's at a width this build has")
    width, swiglu = activation.width, act.kernel(
        "kvlab_swiglu", *[ctypes.c_void_p, ctypes.c_int, ctypes.c_int64, ctypes.c_int64],
        ctypes.c_void_p, ctypes.c_void_p,
    )  # fmt: skip
    generator = torch.Generator().manual_seed(1)
    for rows, inner, spread in ((1, 1536, 3.0), (5, 2 * width, 40.0), (2, 8192, 0.01)):
        gate_up = torch.randn(rows, 2 * inner, generator=generator) * spread
        gate_up[0, :4] = torch.tensor([-87.0, -103.0, 88.5, 1e-38])
        want = torch.empty(rows, inner)
        torch.mul(F.silu(gate_up[:, :inner].clone()), gate_up[:, inner:], out=want)
        got = torch.empty(rows, inner)
        swiglu(gate_up.data_ptr(), 0, rows, inner, ctypes.addressof(activation), got.data_ptr())
        assert torch.equal(got.view(torch.int32), want.view(torch.int32)), (rows, inner)
    glibc = {16: "_ZGVeN16v_expf", 8: "_ZGVdN8v_expf"}[width]
    near = ctypes.cast(getattr(ctypes.CDLL("libmvec.so.1"), glibc), ctypes.c_void_p).value
    assert not act._swiglu_matches_torch(act.Activation(exp=near, width=width),
                                                 width)  # fmt: skip


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize(
    ("cache", "options"),
    [("full", {}), ("paged", {"block_size": 4}), ("int4", {"group_size": 4, "residual": 2}),
     ("sliding", {"sinks": 1, "window": 4}), ("quest", {"block_size": 2, "token_budget": 6})],
    ids=["full", "paged", "int4", "sliding", "quest"],
)  # fmt: skip
def test_a_decode_step_runs_its_layers_in_one_c_call(
    dtype, cache, options, tiny_checkpoints, monkeypatch
):
    """Where every layer takes the one-call path, a decode step runs them all in one C call
    (``FusedStep``), the cache's attentions made for all layers at once
    (``decode_attentions``: the contiguous, paged, staged and ring stores; Quest's block
    bounds and selection in C, over 2 to 5 blocks of 2 tokens, 2 chosen): the op-by-op
    logits bit for bit, no layer called on its own; an fp32 model without the activation in
    C (two calls a layer) runs them one by one, with the same logits."""
    if dtype == torch.float32 and act.fp32_activation() is None:
        pytest.skip("no vector exp of torch's at a width this build has")
    model = with_decode_linears(tiny_checkpoints["llama"], dtype)
    steps, one_by_one = [], []
    whole, single = fused_layer.FusedStep.__call__, fused_layer.FusedDecode.__call__
    monkeypatch.setattr(fused_layer.FusedStep, "__call__",
                        lambda self, *a: steps.append(whole(self, *a)) or steps[-1])  # fmt: skip
    monkeypatch.setattr(fused_layer.FusedDecode, "__call__",
                        lambda self, *a: one_by_one.append(1) or single(self, *a))  # fmt: skip
    with torch.inference_mode():
        fused = decode_logits(model, cache=cache, **options)
        assert len(steps) == 5 and all(y is not None for y in steps) and not one_by_one
        with monkeypatch.context() as patch:
            patch.setattr(llama, "fused_plan", lambda layer: None)
            reference = decode_logits(model, cache=cache, **options)
        if dtype == torch.float32:
            monkeypatch.setattr(fused_layer, "fp32_activation", lambda: None)
            model = with_decode_linears(tiny_checkpoints["llama"], dtype)
            two_calls = decode_logits(model, cache=cache, **options)
            assert len(steps) == 5 and one_by_one  # no step in one call: layer by layer
            assert all(torch.equal(a, b) for a, b in zip(two_calls, reference, strict=True))
    assert all(torch.equal(a, b) for a, b in zip(fused, reference, strict=True))


def _step_inputs(batch: int, width: int = 1):
    """A step's bounds (one job: a table ``width`` blocks wide, rows [0, 5)) and the rows'
    blocks and slots, new tensors each call, as a store makes them each step."""
    table = torch.arange(batch * width).view(batch, width)
    bounds = [(table, torch.zeros(batch, dtype=torch.int64), torch.full((batch,), 5))]
    return bounds, torch.arange(batch).view(batch, 1), torch.full((batch, 1), 5)


@needs_kernel
def test_a_steps_cached_attentions_are_reused_only_while_they_hold(monkeypatch):
    """``LayerAttentions.fused_exact`` answers a step as it answered the last one, without a
    call a layer, while the same layers hand over the same key and value tensors, still
    where they were, for the same batch and table widths (the new step's blocks and slots
    in the answer); a tensor replaced or its storage, a batch of another size or a wider
    table builds them again, the C structs then pointing at the new tensors, also where a
    new tensor sits at an old one's address with other strides."""
    attentions = cached.LayerAttentions()
    calls = []
    fused = cached.LayerAttentions.fused
    monkeypatch.setattr(
        cached.LayerAttentions, "fused",
        lambda self, *a, **k: calls.append(a[0]) or fused(self, *a, **k),
    )  # fmt: skip
    parts = [(torch.randn(2, 2, 16, 8), torch.randn(2, 2, 16, 8)) for _ in range(2)]
    first = attentions.fused_exact([0, 1], parts, 2, *_step_inputs(2))
    assert calls == [0, 1] and all(found is not None for found in first)
    bounds, blocks, slots = _step_inputs(2)
    again = attentions.fused_exact([0, 1], parts, 2, bounds, blocks, slots)
    assert calls == [0, 1]
    assert [a[0] for a in again] == [a[0] for a in first]
    assert all(a[1] is blocks and a[2] is slots for a in again)
    parts[1] = (parts[1][0].clone(), parts[1][1])  # the store moved layer 1's keys
    moved = attentions.fused_exact([0, 1], parts, 2, *_step_inputs(2))
    assert calls == [0, 1, 0, 1]
    assert attentions.layers[1].layouts[0][0] == parts[1][0].data_ptr()
    assert moved[0][0] == first[0][0] and moved[1][0] != first[1][0]
    parts[0][0].set_(parts[0][0].clone())  # the same tensor object, its storage replaced
    attentions.fused_exact([0, 1], parts, 2, *_step_inputs(2))
    assert calls[4:] == [0, 1]
    assert attentions.layers[0].layouts[0][0] == parts[0][0].data_ptr()
    attentions.fused_exact([0, 1], parts, 2, *_step_inputs(1))  # one row
    attentions.fused_exact([0, 1], parts, 2, *_step_inputs(2))
    wider = attentions.fused_exact([0, 1], parts, 2, *_step_inputs(2, width=2))
    assert calls[6:] == [0, 1, 0, 1, 0, 1] and all(found is not None for found in wider)
    kept = attentions.layers[1]
    parts[1] = tuple(t.view(2, 2, 8, 16)[..., :8] for t in parts[1])  # same address, strides
    assert all(found is not None for found in attentions.fused_exact(
        [0, 1], parts, 2, *_step_inputs(2, width=2)))  # fmt: skip
    assert attentions.layers[1] is not kept
    assert attentions.layers[1].layouts[0][2] == parts[1][0].stride()


@needs_kernel
def test_a_wide_activation_runs_in_one_call_at_every_row_count(tmp_path, monkeypatch):
    """A bf16 layer whose SwiGLU is wide (inner 1536: 32 rows are past the count torch and
    the C run serial) still decodes 32 rows in one call: the op-by-op layer takes its
    activation from the same C, so the logits are the op-by-op layer's bit for bit."""
    import transformers as tf

    config = tf.LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=1536,
                            num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                            max_position_embeddings=512)  # fmt: skip
    torch.manual_seed(0)
    tf.LlamaForCausalLM(config).save_pretrained(tmp_path)
    model = with_decode_linears(tmp_path, torch.bfloat16)
    prompts = [[(7 * row + i) % 256 for i in range(3 + row % 4)] for row in range(32)]
    with torch.inference_mode():
        fused = decode_logits(model, steps=3, prompts=prompts)
        assert model.one_call_steps > 0
        monkeypatch.setattr(llama, "fused_plan", lambda layer: None)
        reference = decode_logits(model, steps=3, prompts=prompts)
    assert all(torch.equal(a, b) for a, b in zip(fused, reference, strict=True))


@needs_kernel
def test_a_step_stays_layer_by_layer_where_one_layer_does_not_take_its_rows(
    tiny_checkpoints, monkeypatch
):
    """The step in one call serves the batch sizes every layer's kernels take: where one
    layer's start at two rows (an int8 kernel chosen for a few rows only), a one-row step
    runs its layers one by one, with the op-by-op logits."""
    model = with_decode_linears(tiny_checkpoints["llama"], torch.bfloat16)
    steps = []
    whole = fused_layer.FusedStep.__call__
    monkeypatch.setattr(fused_layer.FusedStep, "__call__",
                        lambda self, *a: steps.append(whole(self, *a)) or steps[-1])  # fmt: skip
    with torch.inference_mode():
        decode_logits(model, steps=2, prompts=PROMPTS[:1])
        assert steps and all(y is not None for y in steps)
        last = model.layers[-1].fused.rows[1]
        model.layers[-1].fused.rows = (2, last)
        model.fused_step, steps[:] = None, []
        fused = decode_logits(model, prompts=PROMPTS[:1])
        assert steps and all(y is None for y in steps)
        monkeypatch.setattr(llama, "fused_plan", lambda layer: None)
        reference = decode_logits(model, prompts=PROMPTS[:1])
    assert all(torch.equal(a, b) for a, b in zip(fused, reference, strict=True))


@needs_kernel
def test_fused_layer_kernel_serves_only_layers_it_can(tiny_checkpoints):
    """Layers not on kvlab's kernels and quantized layers computing in fp32 in a bf16 model
    keep the op-by-op path (q/k norms, Qwen3's, no longer: normed in C); a plan is taken
    again once a layer's weights change."""
    plain, _ = load_model(str(tiny_checkpoints["llama"]), cpu_prepack=False)
    fp32_int8 = with_decode_linears(tiny_checkpoints["llama"], torch.bfloat16, 8)
    for layer in fp32_int8.modules():
        if type(layer) is Int8Linear:
            layer.compute_dtype, layer.scale = torch.float32, layer.scale.float()
    model = with_decode_linears(tiny_checkpoints["llama"], torch.float32)
    with torch.inference_mode():
        for unserved in (plain, fp32_int8):
            decode_logits(unserved, steps=2)
            assert not any(layer.fused.applies for layer in unserved.layers)
        decode_logits(model, steps=2)
        before = model.layers[0].fused
        model.layers[0].mlp.down_proj = DecodeLinear(nn.Linear(128, 64))
        assert fused_layer.fused_plan(model.layers[0]) is not before
        model.layers[0].mlp.down_proj = nn.Linear(128, 64)
        assert fused_layer.fused_plan(model.layers[0]) is None


@needs_kernel
def test_a_copied_model_plans_its_own_fused_layers(tiny_checkpoints):
    """Plans hold pointers into their model's weights: a deep copy or a pickle of a model
    that has decoded carries none, and decodes with plans of its own weights."""
    model = with_decode_linears(tiny_checkpoints["llama"], torch.float32)
    with torch.inference_mode():
        want = decode_logits(model, steps=3)
        for copy in (copy_module.deepcopy(model), pickle.loads(pickle.dumps(model))):
            assert all(layer.fused is None for layer in copy.layers)
            got = decode_logits(copy, steps=3)
            assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))
            ours = {layer.fused.linears[0].weight for layer in model.layers}
            assert not ours & {layer.fused.linears[0].weight for layer in copy.layers}


@needs_kernel
def test_a_layer_that_decoded_in_inference_mode_decodes_outside_it(tiny_checkpoints, monkeypatch):
    """A layer keeps its step buffers per batch size and torch writes the activation into
    one in place (fp32 where C has no exp of torch's: two calls a layer): buffers first
    made in inference mode (the engine's) serve a later one-token step of the model called
    under ``no_grad``, where an inference tensor would refuse the write, with the same
    logits."""
    monkeypatch.setattr(fused_layer, "fp32_activation", lambda: None)
    model = with_decode_linears(tiny_checkpoints["llama"], torch.float32)
    prompt = torch.tensor([PROMPTS[0]])

    def next_token_logits(mode) -> torch.Tensor:
        cache = build_cache("full", model.cache_spec())
        cache.allocate(1, prompt.shape[1] + 1)
        with mode:
            model(prompt, torch.arange(prompt.shape[1])[None], cache)
            return model(torch.tensor([[7]]), torch.tensor([[prompt.shape[1]]]), cache)

    want = next_token_logits(torch.inference_mode())
    assert all(layer.fused.buffers for layer in model.layers)  # the fused path ran
    assert torch.equal(next_token_logits(torch.no_grad()), want)


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize(
    ("cache", "options", "in_c"),
    [("full", {}, True), ("paged", {"block_size": 4}, True),
     ("int4", {"group_size": 4, "residual": 2}, True),
     ("int8", {"group_size": 4, "residual": 0, "key_axis": "token"}, True),
     ("paged", {"kv_bits": 4, "kv_group_size": 8}, True), ("full", {"rotate": "hadamard"}, True),
     ("full", {"kv_bits": 8, "kv_format": "e4m3", "kv_group_size": 8}, True),
     ("full", {"kv_bits": 4, "kv_format": "nvfp4", "kv_group_size": 16}, True),
     ("full", {"kv_bits": 4, "kv_format": "nf4", "kv_group_size": 8}, True),
     ("full", {"kv_bits": 4, "kv_format": "nf4", "kv_group_size": 8, "rotate": "hadamard"},
      True),
     ("int4", {"group_size": 4, "residual": 2, "rotate": "hadamard"}, True),
     ("sliding", {"sinks": 1, "window": 4, "kv_bits": 2, "kv_group_size": 8}, True),
     ("quest", {}, True), ("gqa_shared", {"factor": 1}, True),
     ("gqa_shared", {"factor": 2}, True), ("gqa_shared", {"factor": 2, "merge": "first"}, True),
     ("evict", {"scorer": "snapkv", "ratio": 0.5, "window": 2, "kernel": 3}, True),
     ("evict", {"scorer": "snapkv", "ratio": 0.5, "window": 2, "kernel": 3,
                "budget": "adaptive"}, True),
     ("evict", {"scorer": "knorm", "ratio": 0.4, "when": "decode", "interval": 2}, False),
     ("evict", {"scorer": "knorm", "ratio": 0.5, "kv_bits": 8, "kv_group_size": 8}, False)],
)  # fmt: skip
def test_fused_layer_kernel_attends_in_c_where_the_cache_hands_it_over(
    dtype, cache, options, in_c, tiny_checkpoints, monkeypatch
):
    """``full``, ``paged`` and KIVI's ``int4``/``int8`` (keep_all over the contiguous, the
    paged or the staged store) hand their writes and attention to the layer's C call
    (paged: blocks of 4, so a step crosses into new blocks; KIVI: groups of 4 with a short
    residual, so decode steps read codes and close groups), as do ``gqa_shared`` (its
    heads merged in C before the write: their mean or the first of each group) and
    ``evict`` compressed at prefill (the ragged store: each head after its own kept tokens,
    uniform or adaptive budgets), ``quest`` (its block bounds and selection in C) and every
    per-token format over the contiguous, paged and ring stores (the step's rows encoded in
    C to the codec's bytes), rotated or not (keys, values and queries turned in C before,
    the output after); eviction while decoding and evicted tokens held as codes attend
    through the cache. Either way the
    logits are the op-by-op layer's, bit for bit, also when a second generation of another
    batch size re-plans the cache."""
    model = with_decode_linears(tiny_checkpoints["llama"], dtype)
    runs = (PROMPTS, PROMPTS[:2])
    taken = fused_equals_op_by_op(model, 4, cache, options, runs, monkeypatch)
    assert bool(taken) == in_c


@needs_kernel
def test_merged_heads_attend_in_torch_where_c_would_not_merge_to_torchs_bits(
    tiny_checkpoints, monkeypatch
):
    """``gqa_shared`` merges heads in C only where the probe found C's merge equal to its
    own in torch, bit for bit (``merge_matches_torch``: true on every CPU build here);
    refused, its steps attend through the cache, with the same logits."""
    from kvlab.cache import composed

    for dtype in (torch.float32, torch.bfloat16):
        for factor in (2, 3):
            for first in (False, True):
                assert cached.merge_matches_torch(dtype, factor, first)
    monkeypatch.setattr(composed, "merge_matches_torch", lambda *a: False)
    model = with_decode_linears(tiny_checkpoints["llama"], torch.bfloat16)
    taken = fused_equals_op_by_op(model, 4, "gqa_shared", {"factor": 2}, (PROMPTS,),
                                  monkeypatch)  # fmt: skip
    assert not taken


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_evicted_heads_take_new_tokens_across_their_blocks_in_c(dtype, tiny_checkpoints,
                                                                monkeypatch):  # fmt: skip
    """After an adaptive eviction (every head keeps its own number of tokens), decode steps
    in the fused layer's C call write each head's token after its own, into the next of its
    blocks once one fills (16 slots a block: prompts of 13-20 tokens and 8 steps cross
    them), and attend each head over exactly its tokens: the op-by-op logits bit for bit,
    the step's layers in C."""
    model = with_decode_linears(tiny_checkpoints["llama"], dtype)
    prompts = [list(range(3, 23)), list(range(40, 53)), list(range(60, 77))]
    options = {"scorer": "snapkv", "ratio": 0.25, "window": 2, "kernel": 3, "budget": "adaptive"}
    taken = fused_equals_op_by_op(model, 8, "evict", options, (prompts,), monkeypatch)
    assert len(taken) == 7 * model.config.num_layers


@needs_kernel
@pytest.mark.parametrize(("cache", "options"), [("paged", {"block_size": 4}), ("full", {})])
def test_fused_layer_kernel_takes_its_chunks_from_the_span(
    cache, options, tiny_checkpoints, monkeypatch
):
    """The fused layer's jobs take their chunk from their table's span each step
    (CachedAttention.work_floats; chunk_tokens here made to take chunks of 8 slots once a
    span has one), and C splits them and sizes their partials as that says: the op-by-op
    layers' logits bit for bit over several chunks a job."""
    monkeypatch.setattr(backend_c, "LONG_CHUNKS", (8,))
    monkeypatch.setattr(backend_c, "MIN_CHUNKS", 1)
    chosen = []
    original = cached.chunk_tokens
    monkeypatch.setattr(
        cached, "chunk_tokens", lambda *a: chosen.append(original(*a)) or chosen[-1]
    )
    model = with_decode_linears(tiny_checkpoints["llama"], torch.float32)
    taken = fused_equals_op_by_op(model, 6, cache, options, (PROMPTS[1:2],), monkeypatch)
    assert taken and 8 in chosen


def counting_fused_layers(monkeypatch) -> list:
    """The layers whose decode steps the fused layer's C call serves from now on, one entry
    a layer step (the list grows as they run)."""
    taken = []
    original = fused_layer.FusedDecode._with_cached_attention
    whole_step = fused_layer.FusedStep.__call__

    def counted(self, *args):
        taken.append(self.layer)
        return original(self, *args)

    def counted_step(self, *args):  # a step's layers in one call (bf16)
        y = whole_step(self, *args)
        taken.extend([] if y is None else [plan.layer for plan in self.plans])
        return y

    monkeypatch.setattr(fused_layer.FusedDecode, "_with_cached_attention", counted)
    monkeypatch.setattr(fused_layer.FusedStep, "__call__", counted_step)
    return taken


def fused_equals_op_by_op(model, steps: int, cache: str, options: dict, runs, monkeypatch):
    """Asserts that generations of ``steps`` tokens from each of ``runs`` (lists of prompts)
    give the op-by-op layers' logits bit for bit; returns the layers of each decode step
    the cache handed to the fused layer's C call."""
    taken = counting_fused_layers(monkeypatch)
    with torch.inference_mode():
        fused = [decode_logits(model, steps, cache, prompts, **options) for prompts in runs]
        with monkeypatch.context() as patch:
            patch.setattr(llama, "fused_plan", lambda layer: None)
            reference = [decode_logits(model, steps, cache, prompts, **options) for prompts in
                         runs]  # fmt: skip
    for got, want in zip(sum(fused, []), sum(reference, []), strict=True):
        assert torch.equal(got, want)
    return taken


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize(
    ("cache", "options", "in_c"),
    [("compressed", {"csa_ratio": 2, "hca_ratio": 3, "window": 4, "sinks": 1, "top_k": 2},
      "all"),
     ("compressed", {"schedule": ["csa", "window"], "csa_ratio": 2, "window": 3, "top_k": 0},
      "all"),
     ("compressed", {"csa_ratio": 2, "hca_ratio": 3, "window": 4, "gate": "keynorm"}, "some"),
     ("sliding", {"window": 4, "sinks": 1}, "all"),
     ("compressed", {"csa_ratio": 2, "hca_ratio": 3, "window": 4, "gate": "attention"}, "none"),
     ("compressed", {"csa_ratio": 2, "hca_ratio": 3, "window": 4, "proportional": True},
      "none"),
     ("sliding", {"window": 4, "sinks": 1, "positions": "cache"}, "none")],
)  # fmt: skip
def test_fused_layer_kernel_attends_over_windows_and_pooled_entries_in_c(
    dtype, cache, options, in_c, tiny_checkpoints, monkeypatch
):
    """The window policy and DeepSeek-V4's pooling layers hand their decode steps to the
    layer's C call: the ring's write and read, the raw buffers' writes, the pooling of the
    windows a step closes (uniform gate), the entries and CSA's top-k (ratio 2 over up to
    14 tokens: 7 entries, 2 chosen per KV head) (``in_c``: which layer steps take the C
    call; "some": the keynorm gate's pooling steps go through the cache; "none": the
    attention gate buffers queries, proportional attention weighs entries, cache
    positions rotate queries). The logits are the op-by-op layer's, bit for bit, over 8
    decode steps and a second generation of another batch size."""
    model = with_decode_linears(tiny_checkpoints["llama"], dtype)
    runs = ([PROMPTS[0]], [PROMPTS[0], PROMPTS[2][:4]])  # rows of even lengths pool together
    taken = fused_equals_op_by_op(model, 8, cache, options, runs, monkeypatch)
    every = len(model.layers) * 2 * 7  # layer steps of both generations' decode steps
    assert {"all": len(taken) == every, "some": 0 < len(taken) < every,
            "none": not taken}[in_c]  # fmt: skip


@needs_kernel
def test_pooling_layers_in_c_follow_their_rows_as_requests_leave_and_join(
    tiny_checkpoints, monkeypatch
):
    """Serving moves a cache's tensors as requests leave and join, while the batch can keep
    its size: compressed's layers in the fused C call (whose descriptions are kept while
    their tensors' addresses stay) give every request the tokens the op-by-op layers give
    it, and the C call did serve them."""
    from kvlab.config import ServingConfig
    from kvlab.engine.clock import FakeClock
    from kvlab.serving.server import serve
    from tests.test_scheduler import row_bytes, trace

    model = with_decode_linears(tiny_checkpoints["llama"], torch.float32)
    options = {"csa_ratio": 2, "hca_ratio": 3, "window": 4, "sinks": 1, "top_k": 2}
    requests = trace(model.config.vocab_size, outputs=(9, 6, 8, 7, 9), gap=0.2)
    capacity = max(len(r.prompt) + r.max_new_tokens for r in requests)
    budget = 3 * row_bytes(model, "compressed", options, capacity)
    config = ServingConfig(kv_budget_bytes=budget, chunk=4)

    def served() -> list[list[int]]:
        cache = build_cache("compressed", model.cache_spec(), options)
        result = serve(model, cache, requests, config, FakeClock())
        assert max(n for _, _, n in result.timeline) >= 2  # requests did run together
        return [seq.output for seq in result.seqs]

    taken = counting_fused_layers(monkeypatch)
    with torch.inference_mode():
        fused = served()
        with monkeypatch.context() as patch:
            patch.setattr(llama, "fused_plan", lambda layer: None)
            assert served() == fused
    assert taken


@needs_kernel
def test_fused_layer_kernel_leaves_the_attention_to_a_pinned_backend(tiny_checkpoints, monkeypatch):
    """A backend pinned with ``use_backend`` (the reference, the GPU ones on CPU tensors)
    serves the attention: the fused layer does not take it into its C call."""
    from kvlab.kernels import attention

    model = with_decode_linears(tiny_checkpoints["llama"], torch.float32)
    taken = []
    monkeypatch.setattr(fused_layer.FusedDecode, "_with_cached_attention",
                        lambda self, *args: taken.append(args))  # fmt: skip
    with torch.inference_mode(), attention.use_backend("reference"):
        decode_logits(model, 2)
    assert not taken


@needs_kernel
@pytest.mark.slow
def test_the_default_model_as_qwen3_decodes_fused_with_its_op_by_op_logits(
    smollm2, tmp_path, monkeypatch
):
    """SmolLM2's weights as a Qwen3 checkpoint (q/k norms of ones): every layer takes the
    fused path and gives the op-by-op layers' logits."""
    from kvlab.models.loading import as_qwen3

    model, _ = load_model(str(as_qwen3("smollm2-135m", tmp_path / "qwen3")))
    assert model.config.qk_norm
    with torch.inference_mode():
        fused = decode_logits(model, steps=4)
        assert all(layer.fused is not None and layer.fused.applies for layer in model.layers)
        monkeypatch.setattr(llama, "fused_plan", lambda layer: None)
        reference = decode_logits(model, steps=4)
    for got, want in zip(fused, reference, strict=True):
        assert (got - want).abs().max() <= 1e-5


STORING = sorted(name for name, cls in registered().items() if cls.stores_past)


@needs_kernel
@pytest.mark.parametrize("name", STORING)
def test_every_strategy_decodes_on_the_fused_path(name, tiny_llama):
    """Observed, not assumed by type: under every registered strategy (its lossy setting,
    as it declares it), every decode layer step of a batched generation ran the cache's
    writes and attention in the fused layer's C call (a whole step in one call, or the
    layer's own)."""
    cls = registered()[name]
    before = tiny_llama.decode_paths()
    cache = build_cache(name, tiny_llama.cache_spec(), cls.tests.lossy)
    with torch.inference_mode():
        Engine(tiny_llama, cache).generate(PROMPTS, GenerationConfig(6, stop_on_eos=False))
    taken = tiny_llama.decode_paths() - before
    assert taken and set(taken) <= {"one_call", "c_attention"}, dict(taken)


@needs_kernel
def test_a_researchers_policy_is_timed_on_the_fused_path_unless_it_attends_itself(tiny_llama):
    """A policy that extends keep_all and plans its decode steps as data (here: every query
    reads only the newest 4 tokens of its row, a window as [lo, hi)) decodes in the fused
    layer's C call, with the logits its torch form gives; one that overrides ``attend``
    itself is served by its own attend, observed, with the same logits."""
    from kvlab.cache import base, composed
    from kvlab.cache.policies.keep_all import KeepAll
    from kvlab.cache.stores.contiguous import ContiguousStore

    class Newest(KeepAll):
        name = "newest"

        def plan(self, info, lengths, store, static):
            step = super().plan(info, lengths, store, static)
            if step.reads is not None:
                step.reads.lo = (step.end - 4).clamp(min=0)
            return step

    class Itself(Newest):
        def attend(self, step, store, layer, q, k, v, k_raw):
            return super().attend(step, store, layer, q, k, v, k_raw)

    logits = {}
    try:
        for name, policy in (("newest", Newest), ("newest_itself", Itself)):
            composed.preset(name, policy, ContiguousStore)
            before = tiny_llama.decode_paths()
            logits[name] = decode_logits(tiny_llama, cache=name)
            logits[name, "paths"] = set(tiny_llama.decode_paths() - before)
    finally:
        for name in ("newest", "newest_itself"):
            base._REGISTRY.pop(name, None)
            composed._COMPOSITIONS.pop(name, None)
    assert logits["newest", "paths"] <= {"one_call", "c_attention"}
    assert logits["newest_itself", "paths"] == {"cache_attends"}
    for got, want in zip(logits["newest"], logits["newest_itself"], strict=True):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    full = decode_logits(tiny_llama)
    assert not torch.allclose(full[-1], logits["newest"][-1])  # it did read fewer tokens


@needs_kernel
@pytest.mark.parametrize("name", sorted(codec_settings()))
def test_every_registered_kv_format_decodes_on_the_fused_path(name, tiny_llama, monkeypatch):
    """Every per-token format a codec file registers (the contract tests' codec grid, read
    from the registry), over the contiguous store: every decode layer step of a batched
    generation ran in the fused layer's C call (its rows encoded there), observed, with the
    op-by-op layers' logits bit for bit."""
    options = codec_settings()[name]
    before = tiny_llama.decode_paths()
    fused = decode_logits(tiny_llama, 4, "full", **options)
    taken = tiny_llama.decode_paths() - before
    assert taken and set(taken) <= {"one_call", "c_attention"}, dict(taken)
    monkeypatch.setattr(llama, "fused_plan", lambda layer: None)
    reference = decode_logits(tiny_llama, 4, "full", **options)
    assert all(torch.equal(a, b) for a, b in zip(fused, reference, strict=True))


def test_the_c_weight_kinds_are_the_python_ones():
    """decode_layer.c's Linear kinds and the fused layer's, one declaration each side."""
    import re
    from pathlib import Path

    source = Path(build.__file__).parent / "layer" / "decode_layer.c"
    found = re.search(r"enum \{ FP = 0, ([^}]*) \};", source.read_text())
    c = dict(re.findall(r"(\w+) = (\d+)", "FP = 0, " + found.group(1)))
    assert {name: int(n) for name, n in c.items()} == {
        name: getattr(fused_layer._Linear, name) for name in c
    }
