"""Evaluations run through kvlab's model and cache strategies (registered by name)."""

from kvlab.eval import harness, kld, longctx, perplexity, ruler  # noqa: F401  (registers the evals)
from kvlab.eval.base import eval_options, register_eval, registered_evals, run_evals

__all__ = ["eval_options", "register_eval", "registered_evals", "run_evals"]
