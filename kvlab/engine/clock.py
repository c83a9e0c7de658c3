"""Clocks the engine loop reads: the device's wall clock (idle gaps between arrivals skipped,
since nothing runs in them), or a fake one that advances a fixed time per forward step
(tests compute the metrics by hand from it)."""

from __future__ import annotations

import time

import torch

from kvlab.engine.timing import synchronize


class WallClock:
    """Seconds since the run started, read after the device finished its queued work.
    ``wait_until`` jumps over an idle gap (no request running or waiting) instead of
    sleeping through it: the readings are what a sleeping server would read."""

    def __init__(self, device: torch.device):
        self.device = device
        self._start = time.perf_counter()
        self._skipped = 0.0

    def now(self) -> float:
        return time.perf_counter() - self._start + self._skipped

    def mark(self) -> float:
        """The time a forward step's tokens are produced (after the device is done)."""
        synchronize(self.device)
        return self.now()

    def wait_until(self, t: float) -> None:
        self._skipped += max(0.0, t - self.now())


class FakeClock:
    """Each forward step takes ``step_s``; nothing else takes time."""

    def __init__(self, step_s: float = 1.0):
        self.step_s, self.t = step_s, 0.0

    def now(self) -> float:
        return self.t

    def mark(self) -> float:
        self.t += self.step_s
        return self.t

    def wait_until(self, t: float) -> None:
        self.t = max(self.t, t)
