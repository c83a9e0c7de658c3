"""Wall-clock timing that waits for the device, and the latency statistics kvlab reports."""

from __future__ import annotations

import time
from collections.abc import Sequence

import torch


def synchronize(device: torch.device) -> None:
    """Wait until queued work on ``device`` is done (a no-op on the CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def now(device: torch.device) -> float:
    """Seconds, after the device has finished what was queued."""
    synchronize(device)
    return time.perf_counter()


def percentile(values: Sequence[float], q: float) -> float:
    """Linear-interpolated percentile (q in [0, 100]) of a non-empty sequence."""
    ordered = sorted(values)
    rank = (len(ordered) - 1) * q / 100
    low = int(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)
