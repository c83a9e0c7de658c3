"""kvlab as an lm-eval model (lm-evaluation-harness 0.4, Gao et al.): ``loglikelihood``,
``loglikelihood_rolling`` and ``generate_until`` run through kvlab's model and engine with
the configured cache strategy and weight quantizer in the loop.

:class:`KvlabLM` wraps a model a run has loaded; :mod:`kvlab.lm_eval_model` registers
the lm-eval model ``kvlab`` that builds one from model args.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import lm_eval.models  # noqa: F401  (lm-eval loads its own models only into an empty registry)
from lm_eval.api.model import TemplateLM
from lm_eval.utils import get_rolling_token_windows, make_disjoint_window
from tqdm import tqdm

from kvlab.cache.base import KVCache
from kvlab.engine import Engine, GenerationConfig, SamplingConfig
from kvlab.eval.scoring import scored_batches
from kvlab.models.llama import Decoder

Pair = tuple[tuple[str, str], list[int], list[int]]
AUTO_ROWS = 32  # batch_size=auto: rows per forward step (max_batch_size's default)
AUTO_TOKENS = 4096  # batch_size=auto: padded tokens per forward step (the logits' memory)


class KvlabLM(TemplateLM):
    """An lm-eval LM over a kvlab model, a cache factory and a tokenizer."""

    @classmethod
    def from_loaded(
        cls, model: Decoder, tokenizer: Any, new_cache: Callable[[], KVCache],
        batch_size: int | str = 8, chunk: int = 0, max_length: int | None = None,
        max_batch_size: int = AUTO_ROWS,
    ) -> KvlabLM:  # fmt: skip
        """Wrap a model a kvlab run has already loaded (``eval=lm_eval``)."""
        lm = cls.__new__(cls)
        TemplateLM.__init__(lm)
        lm._setup(model, tokenizer, new_cache, batch_size, chunk, max_length, max_batch_size)
        return lm

    def _setup(
        self, model, tokenizer, new_cache, batch_size, chunk, max_length, max_batch_size=AUTO_ROWS
    ) -> None:
        if tokenizer is None:
            raise ValueError("the lm-eval adapter needs a model with a tokenizer")
        self.model, self.tokenizer, self.new_cache = model, tokenizer, new_cache
        self.batch_size, self.max_tokens = batch_limits(batch_size, max_batch_size)
        self.chunk = int(chunk)
        config = model.config  # a trained sliding window bounds what kvlab models exactly
        self.max_length = int(max_length or config.sliding_window or config.max_position_embeddings)

    @property
    def eot_token_id(self) -> int:
        return self.tokenizer.eos_token_id

    @property
    def prefix_token_id(self) -> int:
        bos = self.tokenizer.bos_token_id
        return bos if bos is not None else self.eot_token_id

    @property
    def tokenizer_name(self) -> str:
        return self.tokenizer.name_or_path.replace("/", "__")

    def tok_encode(
        self, string: str, add_special_tokens: bool | None = None, **_: Any
    ) -> list[int]:
        return self.tokenizer.encode(string, add_special_tokens=bool(add_special_tokens))

    def tok_decode(self, tokens: list[int]) -> str:
        return self.tokenizer.decode(tokens)

    def _loglikelihood_tokens(
        self, requests: list[Pair], disable_tqdm: bool = False, **_: Any
    ) -> list[tuple[float, bool]]:
        """Score in batches of similar length (longest first), each distinct context
        prefilled once; answers in request order."""
        pairs = [self._truncated(context, continuation) for _, context, continuation in requests]
        batches = scored_batches(
            self.model, self.new_cache, *zip(*pairs, strict=True), self.batch_size,
            self.chunk, self.max_tokens,
        )  # fmt: skip
        results: list[tuple[float, bool]] = [(0.0, False)] * len(requests)
        with tqdm(total=len(requests), disable=disable_tqdm, desc="kvlab loglikelihood") as bar:
            for batch, scored in batches:
                for i, answer in zip(batch, scored, strict=True):
                    results[i] = answer
                    key = requests[i][0]  # None: a rolling window, cached per whole text
                    if self.cache_hook is not None and key is not None:
                        self.cache_hook.add_partial("loglikelihood", key, answer)
                bar.update(len(batch))
        return results

    def _truncated(self, context: list[int], continuation: list[int]) -> tuple[list, list]:
        """The ``hf`` backend's window: the last ``max_length + 1`` tokens of context +
        continuation, of which all but the last are fed (``max_length`` positions)."""
        if len(continuation) > self.max_length:
            raise ValueError(
                f"a continuation of {len(continuation)} tokens exceeds max_length="
                f"{self.max_length}; allowed: continuations of at most max_length tokens"
            )
        return context[-(self.max_length + 1 - len(continuation)) :], continuation

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        """Whole-text log-likelihood over disjoint windows of ``max_length`` tokens."""
        totals = []
        for request in tqdm(requests, disable=disable_tqdm, desc="kvlab rolling"):
            (text,) = request.args
            windows = get_rolling_token_windows(
                self.tok_encode(text), self.prefix_token_id, self.max_length, context_len=1
            )
            pairs = [(None, *make_disjoint_window(w)) for w in windows]  # not cached alone
            scored = self._loglikelihood_tokens(pairs, disable_tqdm=True)
            totals.append(sum(logprob for logprob, _ in scored))
            if self.cache_hook is not None:
                self.cache_hook.add_partial("loglikelihood_rolling", (text,), totals[-1])
        return totals

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        """Greedy (or sampled, per ``gen_kwargs``) generation until a stop string or
        ``max_gen_toks`` tokens, one request at a time."""
        outputs = []
        for request in tqdm(requests, disable=disable_tqdm, desc="kvlab generate_until"):
            context, gen_kwargs = request.args
            text = generate_text(self, context, dict(gen_kwargs))
            outputs.append(text)
            if self.cache_hook is not None:
                self.cache_hook.add_partial("generate_until", request.args, text)
        return outputs


def generate_text(lm: KvlabLM, context: str, gen_kwargs: dict[str, Any]) -> str:
    """lm-eval's generation contract: stop at the first ``until`` string (cut there) or
    after ``max_gen_toks`` tokens; ``do_sample``/``temperature`` pick the sampler."""
    until = gen_kwargs.pop("until", None) or [lm.tok_decode([lm.eot_token_id])]
    until = [until] if isinstance(until, str) else list(until)
    max_new = int(gen_kwargs.pop("max_gen_toks", 256))
    temperature = (
        float(gen_kwargs.pop("temperature", 0.0)) if gen_kwargs.pop("do_sample", False) else 0.0
    )
    if max_new >= lm.max_length:  # the hf backend asserts the same
        raise ValueError(
            f"max_gen_toks={max_new} must be less than max_length={lm.max_length}: the "
            "prompt needs at least one position"
        )
    prompt = lm.tok_encode(context)[-(lm.max_length - max_new) :]
    config = GenerationConfig(max_new, SamplingConfig(temperature), stop_on_eos=True)
    run = Engine(lm.model, lm.new_cache()).stream([prompt], config)
    text = ""
    for _ in run:
        text = lm.tok_decode(run.tokens[0])
        if any(stop in text for stop in until):
            break
    for stop in until:
        text = text.split(stop)[0]
    return text


def batch_limits(batch_size: int | str, max_batch_size: int = AUTO_ROWS) -> tuple[int, int]:
    """(rows, padded tokens; 0: no limit) per forward step. ``auto`` (``auto:N``, as lm-eval
    spells it): up to ``max_batch_size`` rows and ``AUTO_TOKENS`` padded tokens, which
    bounds the logits a step holds (the ``hf`` backend probes the largest batch that fits
    its memory instead). 32 rows by default: more rows pad more and fewer leave the
    products narrow (experiments/accuracy/README.md measures the choice)."""
    text = str(batch_size)
    if text.startswith("auto"):
        return int(max_batch_size), AUTO_TOKENS
    if not text.isdigit() or int(text) < 1:
        raise ValueError(
            f"batch_size={batch_size!r} is invalid; allowed: a positive integer, 'auto' or 'auto:N'"
        )
    return int(text), 0
