"""The kernel timers (kvlab/kernels/timers.h) that ``scripts/bench_step_builds.py --timers``
reads to split a decode step: a build with ``-DKVLAB_TIMERS`` counts every decode
attention and CSA indexer call and computes what the plain build computes; kvlab's own
build times nothing."""

from __future__ import annotations

import ctypes
from pathlib import Path

import pytest
import torch

from kvlab.kernels import build, timers
from kvlab.kernels.attention_c import c_attention
from kvlab.kernels.indexer import top_k_table
from kvlab.kernels.segments import Segment, Stored

pytestmark = pytest.mark.skipif(build.library() is None, reason="no C kernels on this machine")
SOURCES = ("decode_attention.c", "attention_codes.c", "indexer.c", "timers.c")  # what is timed


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
    assert read_timers(library) == ([0.0, 0.0], [0, 0])


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
    assert calls == [3, 2]
    assert all(s > 0 for s in seconds)
    torch.testing.assert_close(out, plain[0], rtol=0, atol=0)
    assert torch.equal(table, plain[1])
    timed.kvlab_timers_reset()
    assert read_timers(timed) == ([0.0, 0.0], [0, 0])
