"""The CUDA lane (skipped without CUDA; ``scripts/gpu_check.sh`` runs it on a GPU machine):
every strategy exact on the GPU, the decode attention's torch path against the CPU kernel,
a compiled decode step (CUDA graphs) equal to eager, quantized layers built on the GPU,
continuous batching (serving) equal to each request alone, and
the roofline measured on the GPU rather than its host."""

from __future__ import annotations

import pytest
import torch

from kvlab.cache import build_cache
from kvlab.engine import Engine, GenerationConfig

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]
CUDA = torch.device("cuda")


@pytest.fixture(scope="module")
def tiny_cuda(tiny_checkpoints):
    from kvlab import load_model

    model, _ = load_model(str(tiny_checkpoints["llama"]), device="cuda")
    return model


def settings():
    from test_cache_contract import EXACT, LOSSY

    return EXACT, LOSSY


@pytest.mark.parametrize("setting", ["exact", "lossy"])
def test_every_strategy_runs_on_cuda_like_on_the_cpu(tiny_cuda, tiny_llama, setting):
    """Exact settings equal recomputation; lossy ones decode the CPU's tokens."""
    exact, lossy = settings()
    options = exact if setting == "exact" else lossy
    prompts = [list(range(3, 14)), list(range(20, 25))]
    cfg = GenerationConfig(8, stop_on_eos=False, prefill_chunk=4)
    reference = Engine(tiny_cuda, build_cache("nocache", tiny_cuda.cache_spec())).generate(
        prompts, cfg
    )
    for name, opts in options.items():
        on_gpu = Engine(tiny_cuda, build_cache(name, tiny_cuda.cache_spec(), opts))
        tokens = on_gpu.generate(prompts, cfg).tokens
        if setting == "exact":
            assert tokens == reference.tokens, name
        else:
            on_cpu = Engine(tiny_llama, build_cache(name, tiny_llama.cache_spec(), opts))
            assert tokens == on_cpu.generate(prompts, cfg).tokens, name


def on_cuda(segment):
    from kvlab.kernels import Segment, Stored

    def move(stored: Stored) -> Stored:
        to = lambda t: None if t is None else t.cuda()  # noqa: E731
        return Stored(to(stored.data), stored.format, stored.bits, stored.group,
                      to(stored.scale), to(stored.zero))  # fmt: skip

    s = segment
    return Segment(s.q.cuda(), move(s.keys), move(s.values), s.table.cuda(), s.lo.cuda(),
                   s.hi.cuda(), s.ring)  # fmt: skip


def test_decode_attention_on_cuda_takes_flex_and_triton_and_equals_the_cpu_kernel():
    """Every stored format on CUDA through its own backend (no reference copy), alone and
    beside an exact paged segment, equals the C kernel on the same data."""
    from test_attention_backends import ring_and_paged
    from test_decode_runtime import CASES, contiguous_segment, stored_case

    from kvlab.kernels import decode_attention
    from kvlab.kernels.attention import segment_backends

    for case in CASES:
        keys, values = stored_case(case, 60)
        cpu = contiguous_segment(keys, values, [100, 0], [150, 40], ring=60)
        _, paged = ring_and_paged("fp32")
        paged.q = cpu.q
        for segments in ([cpu], [cpu, paged]):
            gpu = [on_cuda(s) for s in segments]
            want = "flex" if keys.format == "fp" else "triton"
            assert segment_backends(gpu)[0] == want, case
            expected = decode_attention(segments, 64**-0.5, torch.float32)
            got = decode_attention(gpu, 64**-0.5, torch.float32).cpu()
            torch.testing.assert_close(got, expected, atol=1e-2, rtol=1e-2)  # bf16, TF32


@pytest.mark.parametrize("name", ["full", "int4", "paged", "sliding"])
def test_compiled_decode_on_cuda_equals_eager(tiny_cuda, name):
    from test_decode_runtime import SETTINGS

    prompt = list(range(3, 14))
    cfg = GenerationConfig(32, stop_on_eos=False)
    eager = Engine(tiny_cuda, build_cache(name, tiny_cuda.cache_spec(), SETTINGS[name]))
    static = build_cache(name, tiny_cuda.cache_spec(), SETTINGS[name], static=True)
    compiled = Engine(tiny_cuda, static, compile=True)
    assert compiled.generate([prompt], cfg).tokens == eager.generate([prompt], cfg).tokens


def test_gptq_layers_are_built_on_the_gpu(tmp_path):
    from conftest import tiny_hf_model
    from test_quant import _gptq_checkpoint

    from kvlab import load_model
    from kvlab.quant.rtn import Int4Linear

    _gptq_checkpoint(tiny_hf_model("llama"), tmp_path)
    model, _ = load_model(str(tmp_path), device="cuda")
    layers = [m for m in model.modules() if isinstance(m, Int4Linear)]
    assert layers and all(m.packed.device.type == "cuda" for m in layers)


def test_bnb_int8_quantizes_a_weight_already_on_the_gpu(tiny_cuda):
    pytest.importorskip("bitsandbytes")
    import copy

    from kvlab.quant import quantize_

    model = copy.deepcopy(tiny_cuda)
    quantize_(model, "bnb", {"mode": "int8"})
    weight = model.layers[0].mlp.down_proj.weight
    assert weight.dtype == torch.int8 and weight.device.type == "cuda"


def test_roofline_peaks_are_the_gpus():
    from kvlab.analysis.roofline import measure_peaks

    peaks = measure_peaks(matmul_size=1024, bandwidth_bytes=256 * 2**20, repeats=2, device="cuda")
    assert torch.cuda.get_device_name() in peaks.machine
    assert peaks.bandwidth > 2e11  # any datacenter GPU streams > 200 GB/s; a host CPU does not


@pytest.mark.parametrize("name", ["full", "int4", "paged"])
def test_serving_on_cuda_gives_each_request_what_it_generates_alone(tiny_cuda, name):
    """Continuous batching on the GPU: joins, retirements and the KV budget change nothing
    but timing."""
    from test_cache_contract import LOSSY

    from kvlab.config import ServingConfig
    from kvlab.engine.clock import FakeClock
    from kvlab.engine.sequence import Request
    from kvlab.serving.server import serve

    gen = torch.Generator().manual_seed(5)
    requests = [
        Request(i, 0.5 * i, tuple(torch.randint(0, 256, (n,), generator=gen).tolist()), out)
        for i, (n, out) in enumerate([(11, 6), (5, 3), (17, 5), (9, 7)])
    ]
    spec, options = tiny_cuda.cache_spec(), LOSSY[name]
    result = serve(tiny_cuda, build_cache(name, spec, options), requests,
                   ServingConfig(kv_budget_bytes=2**22, chunk=4), FakeClock())  # fmt: skip
    alone = Engine(tiny_cuda, build_cache(name, spec, options))
    for seq, request in zip(result.seqs, requests, strict=True):
        cfg = GenerationConfig(request.max_new_tokens, stop_on_eos=False, prefill_chunk=4)
        assert seq.output == alone.generate([list(request.prompt)], cfg).tokens[0]
