"""Roofline of both inference phases (Williams et al., CACM 2009): this machine's peak
matrix-multiply FLOP/s and memory bandwidth, measured once and cached, against the FLOPs
and bytes a run's prefill and decode must move. Prefill should land near the compute roof,
decode near the bandwidth roof."""

from __future__ import annotations

import hashlib
import json
import time
from dataclasses import asdict, dataclass
from typing import Any

import torch

from kvlab.analysis.memory import Architecture, linear_shapes
from kvlab.paths import cache_dir


@dataclass(frozen=True)
class Peaks:
    """Measured peaks: FLOP/s of a square matmul per dtype; read bandwidth of a tensor of
    ``bandwidth_bytes`` (chosen well beyond the last-level cache)."""

    matmul_flops: dict[str, float]
    bandwidth: float
    bandwidth_bytes: int
    matmul_size: int
    machine: str


def _best_seconds(fn, repeats: int) -> float:
    fn()  # warm-up
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def measure_peaks(
    matmul_size: int = 2048,
    bandwidth_bytes: int = 2 * 2**30,
    repeats: int = 5,
    device: str = "cpu",
) -> Peaks:
    """Best of ``repeats``: an n×n×n matmul per dtype, and a full read (sum) of a fp32 tensor
    of ``bandwidth_bytes`` (2 GiB default: far beyond any CPU's last-level cache or a GPU's
    L2), on ``device`` (synchronised on CUDA)."""
    from kvlab.engine.timing import synchronize

    target = torch.device(device)

    def timed(fn):
        def run():
            fn()
            synchronize(target)

        return _best_seconds(run, repeats)

    flops = {}
    for dtype in (torch.float32, torch.bfloat16):
        a = torch.randn(matmul_size, matmul_size, device=target).to(dtype)
        b = torch.randn(matmul_size, matmul_size, device=target).to(dtype)
        flops[str(dtype).removeprefix("torch.")] = (
            2 * matmul_size**3 / timed(lambda a=a, b=b: a @ b)
        )
    big = _read_target(bandwidth_bytes, target)
    bandwidth = bandwidth_bytes / timed(lambda: big.sum())
    return Peaks(flops, bandwidth, bandwidth_bytes, matmul_size, _machine(device))


def _read_target(nbytes: int, device: torch.device) -> torch.Tensor:
    """fp32 ones of ``nbytes`` for the bandwidth read: on the CPU on huge pages where the OS
    gives them, as kvlab's weights are (:mod:`kvlab.kernels.huge_pages`; from 4 KiB pages a
    streaming read is slower), so the roof is what the weights' pages allow."""
    from kvlab.kernels import huge_pages

    return huge_pages.zeros([((nbytes // 4,), torch.float32)], device)[0].fill_(1.0)


def _machine(device: str = "cpu") -> str:
    if device.startswith("cuda"):
        return f"{torch.cuda.get_device_name(torch.device(device))}, torch {torch.__version__}"
    from kvlab.tracking import environment

    env = environment()
    return f"{env['cpu']} x{env['threads']} threads, torch {env['torch']}"


def cached_peaks(refresh: bool = False, device: str = "cpu") -> Peaks:
    """The peaks of ``device`` on this machine, measured on first use and kept in
    ``$KVLAB_CACHE`` (a CUDA run is placed on the GPU's roofs, not the host CPU's)."""
    kind = "cuda" if device.startswith("cuda") else "cpu"
    path = cache_dir() / f"roofline-{kind}-v2.json"  # v2: the CPU read from huge pages
    machine, identity = _machine(device), _identity(device)
    if path.exists() and not refresh:
        stored = json.loads(path.read_text())
        if stored.pop("identity", None) == identity and stored.get("machine") == machine:
            return Peaks(**stored)
    peaks = measure_peaks(device=device)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({**asdict(peaks), "identity": identity}, indent=2))
    return peaks


def _identity(device: str) -> str:
    """What a cached measurement must have been made on: the GPU's name, or a digest of the
    CPU's model name and feature flags (``_machine``'s "AMD EPYC" names an AVX2-only EPYC
    and a Zen4 alike, and a cache dir may be shared between them)."""
    if device.startswith("cuda"):
        return torch.cuda.get_device_name(torch.device(device))
    from kvlab.kernels.build import cpu_identity

    return hashlib.sha256(cpu_identity().encode()).hexdigest()[:16]


@dataclass(frozen=True)
class PhaseCost:
    """FLOPs and bytes one phase must move (weights once per step, the KV it reads and writes)."""

    flops: float
    bytes: float

    @property
    def intensity(self) -> float:
        return self.flops / self.bytes


def phase_costs(
    arch: Architecture, prompt_len: int, new_tokens: int, batch: int,
    weight_bytes: int, kv_bytes_per_token: float,
) -> tuple[PhaseCost, PhaseCost]:  # fmt: skip
    """(prefill, the mean decode step) of a GQA model: 2 FLOPs per linear weight per token,
    4·L·H·D per attended (query, key) pair; weights read once per forward, the KV written by
    prefill and read by every decode step."""
    linear = sum(n * k for _, n, k in linear_shapes(arch)) + arch.vocab * arch.hidden  # + head
    pair = 4 * arch.layers * arch.heads * arch.head_dim
    prefill = PhaseCost(
        2 * linear * batch * prompt_len + pair * batch * prompt_len * (prompt_len + 1) / 2,
        weight_bytes + kv_bytes_per_token * batch * prompt_len,
    )
    context = prompt_len + new_tokens / 2  # keys the mean decode step attends
    decode = PhaseCost(
        2 * linear * batch + pair * batch * context,
        weight_bytes + kv_bytes_per_token * batch * context,
    )
    return prefill, decode


def roofline_rows(peaks: Peaks, dtype: str, prefill: PhaseCost, decode: PhaseCost,
                  ttft_s: float, itl_s: float) -> list[dict[str, Any]]:  # fmt: skip
    """Per phase: achieved FLOP/s and bytes/s, as % of the roofs, and which roof binds."""
    peak_flops = peaks.matmul_flops[dtype]
    ridge = peak_flops / peaks.bandwidth  # FLOPs per byte where the two roofs meet
    rows = []
    for phase, cost, seconds in (("prefill", prefill, ttft_s), ("decode", decode, itl_s)):
        rows.append({
            "phase": phase, "seconds": seconds,
            "gflop": cost.flops / 1e9, "gbytes": cost.bytes / 1e9,
            "flop_per_byte": cost.intensity, "ridge_flop_per_byte": ridge,
            "bound": "compute" if cost.intensity > ridge else "memory",
            "pct_peak_flops": 100 * cost.flops / seconds / peak_flops,
            "pct_peak_bandwidth": 100 * cost.bytes / seconds / peaks.bandwidth,
        })  # fmt: skip
    return rows


@dataclass(frozen=True)
class DecodeRoof:
    """The least time a decode step can take on this machine: the bytes it must read
    (every weight matrix once, plus the KV it attends) at the measured read bandwidth."""

    weight_bytes_read: int
    bandwidth: float
    machine: str
    read_bytes_measured: int  # the size of the streaming read that measured ``bandwidth``

    def itl_s(self, kv_bytes_read: int) -> float:
        return (self.weight_bytes_read + kv_bytes_read) / self.bandwidth

    def __str__(self) -> str:
        return (
            f"decode roof: {self.weight_bytes_read / 1e6:.1f} MB of weights per step + the KV "
            f"read, at {self.bandwidth / 1e9:.1f} GB/s (a streaming read of "
            f"{self.read_bytes_measured >> 20} MiB on {self.machine})"
        )


def decode_roof(model: torch.nn.Module, refresh: bool = False) -> DecodeRoof:
    """Bytes a decode step reads from the model's own tensors: all it holds, except that
    only one row of the embedding table is read (unless a plain tied head reads it all) and
    the linears' prepacked copies for many rows are not read (the plain weights are).
    ``refresh``: measure the bandwidth now rather than take the cached one (benchmarks do:
    a shared machine's read bandwidth moves within minutes, and a cached reading from hours
    before would put decode nearer or farther from its roof than it is)."""
    from kvlab.engine.metrics import prepacked_copy_bytes, weight_bytes

    embedding = model.embed_tokens.weight
    head_reads_embedding = getattr(model.lm_head, "weight", None) is embedding
    held = weight_bytes(model) - prepacked_copy_bytes(model)
    row = embedding[0].numel() * embedding.element_size()
    read = (
        held if head_reads_embedding else held - embedding.numel() * embedding.element_size() + row
    )
    peaks = cached_peaks(refresh=refresh, device=str(embedding.device))
    return DecodeRoof(read, peaks.bandwidth, peaks.machine, peaks.bandwidth_bytes)
