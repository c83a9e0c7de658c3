"""The kernel timers (kvlab/kernels/include/timers.h) that ``scripts/bench_step_builds.py --timers``
reads to split a decode step: a build with ``-DKVLAB_TIMERS`` counts every decode
attention and CSA indexer call and computes what the plain build computes; kvlab's own
build times nothing."""

from __future__ import annotations

import ctypes
from pathlib import Path

import pytest
import torch

from kvlab.kernels import build, timers
from kvlab.kernels.attention.backend_c import c_attention
from kvlab.kernels.attention.indexer import top_k_table
from kvlab.kernels.attention.segments import Segment, Stored

pytestmark = pytest.mark.skipif(build.library() is None, reason="no C kernels on this machine")
# what is timed, under kvlab/kernels
SOURCES = ("attention/decode_attention.c", "attention/attention_codes.c", "attention/indexer.c",
           "timers.c")  # fmt: skip


def read_timers(library) -> tuple[list[float], list[int]]:
    assert timers.has_timers(library)  # zeros must come from the timers, not from none
    return timers.read(library)


def segment() -> Segment:
    torch.manual_seed(0)
    k, v, q = torch.randn(1, 2, 300, 64), torch.randn(1, 2, 300, 64), torch.randn(1, 2, 3, 64)
    table = torch.zeros(1, 1, dtype=torch.int64)
    return Segment(q, Stored(k), Stored(v), table, torch.tensor([0]), torch.tensor([300]))


def run_kernels() -> tuple[torch.Tensor, torch.Tensor]:
    """Three attention calls and two indexer calls; their last outputs."""
    s = segment()
    for _ in range(3):
        out = c_attention([s], 0.125, torch.float32)
    keys, seen, base = s.keys.data, torch.tensor([300]), torch.tensor([0, 300])
    for _ in range(2):
        table = top_k_table(s.q, keys, seen, base, 64)
    return out, table


def test_kvlab_s_own_build_times_nothing():
    library = build.library()
    library.kvlab_timers_reset()
    run_kernels()
    assert read_timers(library) == ([0.0] * len(timers.NAMES), [0] * len(timers.NAMES))


@pytest.mark.slow
def test_a_timed_build_counts_each_call_and_computes_the_same(tmp_path, monkeypatch):
    plain = run_kernels()
    folder = Path(build.__file__).parent
    monkeypatch.setattr(build, "SOURCES", [folder / name for name in SOURCES])
    monkeypatch.setattr(build, "FLAGS", [*build.FLAGS, "-DKVLAB_TIMERS"])
    build._compile(build._compiler(), tmp_path / "timed.so")
    timed = ctypes.CDLL(str(tmp_path / "timed.so"))
    monkeypatch.setattr(build, "library", lambda: timed)
    build.kernel.cache_clear()
    try:
        timed.kvlab_timers_reset()
        out, table = run_kernels()
        seconds, calls = read_timers(timed)
    finally:
        build.kernel.cache_clear()
    assert calls == [3, 2, 0, 0]  # no fused layer ran: its products and call count nothing
    assert all(s > 0 for s in seconds[:2])
    torch.testing.assert_close(out, plain[0], rtol=0, atol=0)
    assert torch.equal(table, plain[1])
    timed.kvlab_timers_reset()
    assert read_timers(timed) == ([0.0] * len(timers.NAMES), [0] * len(timers.NAMES))


@pytest.mark.slow
def test_a_timed_build_counts_a_fused_steps_products_and_its_layers_call(
    tiny_checkpoints, tmp_path, monkeypatch
):
    """Every kernel built with -DKVLAB_TIMERS: a decode step whose layers run in one call
    counts that call once, each layer's four products and its attention once, and decodes
    the tokens the plain build decodes."""
    from torch import nn

    from kvlab import load_model
    from kvlab.cache import build_cache
    from kvlab.engine import Engine, GenerationConfig
    from kvlab.kernels.linear import DecodeLinear
    from kvlab.models import fused_layer

    model, _ = load_model(str(tiny_checkpoints["llama"]), dtype=torch.bfloat16, cpu_prepack=False)
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is nn.Linear:
                setattr(parent, name, DecodeLinear(child))

    def generate() -> list:
        engine = Engine(model, build_cache("full", model.cache_spec()))
        return engine.generate([[5, 17, 3, 99]], GenerationConfig(5, stop_on_eos=False)).tokens

    with torch.inference_mode():
        plain = generate()
        monkeypatch.setattr(build, "FLAGS", [*build.FLAGS, "-DKVLAB_TIMERS"])
        build._compile(build._compiler(), tmp_path / "timed.so")
        timed = ctypes.CDLL(str(tmp_path / "timed.so"))
        monkeypatch.setattr(build, "library", lambda: timed)
        build.kernel.cache_clear()
        fused_layer.weights_changed()
        try:
            timed.kvlab_timers_reset()
            tokens = generate()
            _, calls = read_timers(timed)
        finally:
            build.kernel.cache_clear()
            fused_layer.weights_changed()
    layers, steps = model.config.num_layers, 4  # 5 tokens: the prefill's and 4 decode steps
    assert tokens == plain
    assert dict(zip(timers.NAMES, calls, strict=True)) == {
        "attention": layers * steps, "indexer": 0, "linears": 4 * layers * steps,
        "layers": steps,
    }  # fmt: skip
