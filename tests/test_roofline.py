"""Roofline and diagnosis: phase costs put prefill above the ridge and decode below it,
peaks are measured from real kernels, and ``kvlab diagnose`` explains a real run."""

from __future__ import annotations

import pytest

from kvlab.analysis.memory import Architecture, load_config
from kvlab.analysis.roofline import Peaks, measure_peaks, phase_costs, roofline_rows


def test_prefill_is_compute_bound_and_decode_memory_bound_on_paper():
    arch = Architecture.from_config(load_config("llama-2-7b"))
    weights, per_token = 2 * 6_738_415_616, 524_288
    prefill, decode = phase_costs(arch, 2048, 128, 1, weights, per_token)
    assert prefill.intensity > 500 and decode.intensity < 2  # FLOP per byte
    batched = phase_costs(arch, 2048, 128, 16, weights, per_token)[1]
    assert batched.intensity > 4 * decode.intensity  # batching amortises the weight reads
    peaks = Peaks({"bfloat16": 1e12}, 1e11, 2**31, 2048, "paper")  # ridge: 10 FLOP/byte
    rows = roofline_rows(peaks, "bfloat16", prefill, decode, ttft_s=1.0, itl_s=0.1)
    assert [r["bound"] for r in rows] == ["compute", "memory"]
    assert rows[1]["pct_peak_bandwidth"] == pytest.approx(100 * decode.bytes / 0.1 / 1e11)


def test_peaks_come_from_real_kernels():
    peaks = measure_peaks(matmul_size=256, bandwidth_bytes=64 * 2**20, repeats=2)
    assert all(f > 1e8 for f in peaks.matmul_flops.values())  # > 0.1 GFLOP/s: they ran
    assert peaks.bandwidth > 1e8 and peaks.bandwidth_bytes == 64 * 2**20


def test_cached_peaks_are_measured_again_on_another_cpu(monkeypatch, tmp_path):
    """The cache is keyed by the CPU's model and flags, not its name alone: an AVX2-only
    EPYC and a Zen4 are both "AMD EPYC", and a shared cache dir must not hand one the
    other's bandwidth."""
    from kvlab.analysis import roofline

    monkeypatch.setenv("KVLAB_CACHE", str(tmp_path))
    reads = []

    def measured(**_):
        reads.append(1)
        return measure_peaks(matmul_size=64, bandwidth_bytes=2**20, repeats=1)

    monkeypatch.setattr(roofline, "measure_peaks", measured)
    first = roofline.cached_peaks()
    assert roofline.cached_peaks() == first and len(reads) == 1  # the same CPU: cached
    monkeypatch.setattr("kvlab.kernels.build.cpu_identity", lambda: "model name : other")
    roofline.cached_peaks()
    assert len(reads) == 2


@pytest.mark.slow
def test_diagnose_explains_a_real_run(monkeypatch, tmp_path):
    from kvlab.analysis import diagnose as module

    small = measure_peaks(matmul_size=512, bandwidth_bytes=512 * 2**20, repeats=2)
    monkeypatch.setattr(module, "cached_peaks", lambda **_: small)
    text = module.diagnose(["workload.prompt_len=256", "workload.new_tokens=8"])
    assert "TTFT" in text and "levers" in text and "KV strategy" in text
    lines = [line for line in text.splitlines() if line.strip().startswith(("prefill", "decode"))]
    bounds = {line.split()[0]: ("memory" if " memory " in line else "compute") for line in lines}
    assert bounds == {"prefill": "compute", "decode": "memory"}  # measured on this machine
