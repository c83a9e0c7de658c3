"""The lm-eval model ``kvlab`` (lm-evaluation-harness 0.4, Gao et al.): a run's model,
cache strategy and weight quantizer built from lm-eval's model args, scored through
:class:`~kvlab.eval.lm_eval_adapter.KvlabLM`.

Importing this module registers the model (lm-eval 0.4 has no plugin entry points, so
``kvlab lm-eval ...`` runs lm-eval's own CLI with it registered). Model args: ``model``,
``cache`` and ``quant`` (names of files under ``conf/cache`` and ``conf/quant``), ``dtype``,
``device``, ``batch_size`` (rows per step, or ``auto``), ``max_batch_size``, ``chunk``
(context prefill chunk; 0 = one pass), ``max_length``, and dotted ``cache.options.X`` /
``quant.options.X`` overrides.
"""

from __future__ import annotations

import warnings
from typing import Any

import torch
from lm_eval.api.model import TemplateLM
from lm_eval.api.registry import register_model

from kvlab.eval.lm_eval_adapter import AUTO_ROWS, KvlabLM
from kvlab.run import build_run_model


@register_model("kvlab")
class KvlabRunLM(KvlabLM):
    """:class:`KvlabLM` over the run that the model args compose to."""

    def __init__(
        self, model: str = "smollm2-135m", cache: str = "full", quant: str = "none",
        dtype: str = "auto", device: str = "auto", batch_size: int | str = 8, chunk: int = 0,
        max_length: int | None = None, max_batch_size: int = AUTO_ROWS, **overrides: Any,
    ) -> None:  # fmt: skip
        TemplateLM.__init__(self)
        quant = quant or "none"  # lm-eval's argument parser turns "none" into None
        choices = {"model.source": model, "model.dtype": dtype, "model.device": _device(device)}
        loaded, tokenizer, new_cache = build_run_model(cache, quant, choices | overrides)
        self._setup(loaded, tokenizer, new_cache, batch_size, chunk, max_length, max_batch_size)


def _device(name: str) -> str:
    """lm-eval's ``--device`` (``cuda:0`` by default) as a kvlab device; without CUDA,
    ``cuda`` falls back to the CPU with a warning, as lm-eval's ``hf`` backend does."""
    kind = name.split(":")[0]
    if kind == "cuda" and not torch.cuda.is_available():
        warnings.warn(f"device={name!r}: CUDA is not available; running on the CPU", stacklevel=3)
        return "cpu"
    return kind
