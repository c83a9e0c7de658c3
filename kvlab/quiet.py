"""Keep a run's output to kvlab's own lines: silence third-party import chatter that says
nothing about the run (torchao's "Failed to load ... .so" for CUDA kernels on a CPU
machine, torch's pytree deprecation notes that torchao triggers, datasets' progress bars
for reading a local text file, submitit's warning at every poll of a SLURM cluster without
accounting). Warnings that matter to a result are left alone."""

from __future__ import annotations

import logging

CHATTY_LOGGERS = ("torchao", "torch.utils._pytree")


class OnceOnly(logging.Filter):
    """Pass the first record whose message contains ``marker``, then none of them."""

    def __init__(self, marker: str, note: str = ""):
        super().__init__()
        self.marker, self.note, self.seen = marker, note, False

    def filter(self, record: logging.LogRecord) -> bool:
        if self.marker not in record.getMessage():
            return True
        if self.seen:
            return False
        self.seen = True
        record.msg, record.args = f"{record.getMessage()}{self.note}", ()
        return True


SACCT_NOTE = (
    " (kvlab: said once; without SLURM accounting submitit learns that a job ended from its "
    "result file, so a job cancelled by hand is waited for until the sweep is stopped)"
)


def quiet_third_party() -> None:
    for name in CHATTY_LOGGERS:
        logging.getLogger(name).setLevel(logging.ERROR)
    submitit = logging.getLogger("submitit")
    if not any(isinstance(f, OnceOnly) for f in submitit.filters):
        submitit.addFilter(OnceOnly("Bypassing sacct error", SACCT_NOTE))
    try:
        import datasets

        datasets.disable_progress_bars()
        datasets.logging.set_verbosity_error()
    except ImportError:  # datasets is a dependency; nothing to silence without it
        pass
