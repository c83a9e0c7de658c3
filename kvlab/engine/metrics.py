"""The numbers a generation reports, named as in DESIGN.md: TTFT, ITL percentiles, prefill
and decode throughput, KV and weight bytes (counted from tensors) and peak memory."""

from __future__ import annotations

import resource
import statistics
from pathlib import Path

import torch
from torch import nn

from kvlab.engine.loop import GenerationStats
from kvlab.engine.timing import percentile
from kvlab.quant.base import held_tensors

_CLEAR_REFS = Path("/proc/self/clear_refs")
_STATUS = Path("/proc/self/status")


def generation_metrics(stats: GenerationStats) -> dict[str, float | int]:
    """Latency, throughput and KV memory of one finished generation."""
    per_row = [
        tokens / rows for tokens, rows in zip(stats.step_tokens, stats.step_rows, strict=True)
    ]
    itl_ms = [s * 1e3 / n for s, n in zip(stats.step_s, per_row, strict=True)] or [0.0]
    decoded = sum(stats.step_tokens)
    kv = stats.kv_peak
    return {
        "ttft_ms": stats.ttft_s * 1e3,
        "itl_ms_p50": percentile(itl_ms, 50),
        "itl_ms_p90": percentile(itl_ms, 90),
        "itl_ms_mean": statistics.fmean(itl_ms),
        "prefill_tok_s": stats.prompt_tokens / stats.ttft_s if stats.ttft_s else 0.0,
        "decode_tok_s": decoded / sum(stats.step_s) if stats.step_s else 0.0,
        "prompt_tokens": stats.prompt_tokens,
        "decode_steps": len(stats.step_s),
        "preemptions": stats.preemptions,
        "reprefill_ms": sum(stats.reprefill_s) * 1e3,  # recomputing preempted sequences
        "reprefills": len(stats.reprefill_s),
        "kv_bytes": kv.held_bytes,
        "kv_bytes_used": kv.used_bytes,
        "kv_bytes_reserved": kv.reserved_bytes,
        "kv_tokens": kv.tokens,
        "kv_bytes_per_token": kv.bytes_per_token,
        "itl_ms": itl_ms,  # every decode step, per token emitted, for plots and tables
        **speculation_metrics(stats),
    }


def speculation_metrics(stats: GenerationStats) -> dict[str, float | int]:
    """Draft tokens verified and kept, drafts kept per row and step, tokens a row emits
    per decode step (1 without speculation), and the mean ms a step spends drafting and
    verifying."""
    rows = sum(stats.step_rows)
    mean_ms = lambda seconds: 1e3 * statistics.fmean(seconds) if seconds else 0.0  # noqa: E731
    return {
        "spec/drafted": stats.drafted,
        "spec/accepted": stats.accepted,
        "spec/acceptance_rate": stats.accepted / stats.drafted if stats.drafted else 0.0,
        "spec/mean_accepted": stats.accepted / rows if rows and stats.drafted else 0.0,
        "spec/tokens_per_step": sum(stats.step_tokens) / rows if rows else 0.0,
        "spec/draft_ms": mean_ms(stats.draft_s),
        "spec/verify_ms": mean_ms(stats.verify_s),
    }


def weight_bytes(model: nn.Module) -> int:
    """Bytes of every tensor the model holds (parameters, buffers, quantization state),
    shared storage counted once."""
    seen, total = set(), 0
    for tensor in held_tensors(model):
        key = id(tensor) if tensor.is_mkldnn else (tensor.device, tensor.data_ptr())
        if key not in seen:
            seen.add(key)
            total += tensor.numel() * tensor.element_size()
    return total


def prepacked_copy_bytes(model: nn.Module) -> int:
    """Bytes of the prepacked copies the model's linears hold beside their plain weights for
    steps of many rows (:class:`~kvlab.kernels.linear.DecodeLinear`'s ``packed``): counted
    in :func:`weight_bytes`, but a step reads one copy of each weight, never both."""
    from kvlab.kernels.linear import DecodeLinear

    copies = [m.packed_weight for m in model.modules() if isinstance(m, DecodeLinear)]
    return sum(c.numel() * c.element_size() for c in copies if c is not None)


class PeakMemory:
    """Peak memory over a ``with`` block: CUDA allocator peak on GPU; on CPU the resident-set
    high-water mark, reset on entry through /proc/self/clear_refs where Linux allows."""

    def __init__(self, device: torch.device):
        self.device = device
        self.metrics: dict[str, int] = {}

    def __enter__(self) -> PeakMemory:
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
        elif _CLEAR_REFS.exists():
            try:
                _CLEAR_REFS.write_text("5")  # 5: reset the peak RSS (VmHWM) of this process
            except OSError:
                pass
        return self

    def __exit__(self, *exc) -> None:
        if self.device.type == "cuda":
            self.metrics = {"peak_cuda_bytes": torch.cuda.max_memory_allocated(self.device)}
        else:
            self.metrics = {"peak_rss_bytes": _peak_rss_bytes()}


def _peak_rss_bytes() -> int:
    if _STATUS.exists():
        for line in _STATUS.read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024  # reported in kB
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
