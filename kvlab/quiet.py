"""Keep a run's output to kvlab's own lines: silence third-party import chatter that says
nothing about the run (torchao's "Failed to load ... .so" for CUDA kernels on a CPU
machine, torch's pytree deprecation notes that torchao triggers, datasets' progress bars
for reading a local text file). Warnings that matter to a result are left alone."""

from __future__ import annotations

import logging

CHATTY_LOGGERS = ("torchao", "torch.utils._pytree")


def quiet_third_party() -> None:
    for name in CHATTY_LOGGERS:
        logging.getLogger(name).setLevel(logging.ERROR)
    try:
        import datasets

        datasets.disable_progress_bars()
        datasets.logging.set_verbosity_error()
    except ImportError:  # datasets is a dependency; nothing to silence without it
        pass
