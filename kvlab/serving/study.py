"""The serving workload of a run (``workload=serving``): build the trace from WikiText-2,
warm up, serve it on a fresh cache under the budget, and report vLLM's serving metrics with
the KV timeline (``serving_timeline.json`` and a plot beside ``result.json``) and the memory
model's predicted concurrency beside the measured one."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from kvlab.cache.base import KVCache
from kvlab.config import ServingConfig
from kvlab.data import wikitext2_test_text
from kvlab.engine.clock import WallClock
from kvlab.engine.sampling import SamplingConfig
from kvlab.engine.sequence import Request
from kvlab.models.llama import Decoder
from kvlab.serving.server import ServeResult, check_serves, serve
from kvlab.serving.trace import make_trace
from kvlab.speculative.config import SpecConfig
from kvlab.workload import text_windows


def build_trace(tokenizer: Any, cfg: ServingConfig, seed: int) -> list[Request]:
    trace_cfg = cfg.trace_config(seed)
    corpus = text_windows(tokenizer, wikitext2_test_text(), trace_cfg.tokens_needed(), 1)[0]
    return make_trace(trace_cfg, corpus)


def predicted_concurrency(cache: KVCache, requests: list[Request]) -> int:
    """The memory model's concurrency: the budget over the bytes of the mean request at its
    full length (a contiguous row is reserved at the capacity whatever its length)."""
    need = [cache.request_bytes(len(r.prompt) + r.max_new_tokens) for r in requests]
    return int(cache.free_bytes() // (sum(need) / len(need)))


def measure_serving(
    model: Decoder,
    tokenizer: Any,
    new_cache: Callable[[], KVCache],
    cfg: ServingConfig,
    sampling: SamplingConfig,
    eos_ids: frozenset[int],
    warmup: bool,
    out_dir: Path | None,
    spec: SpecConfig | None = None,
) -> dict[str, Any]:
    cache = new_cache()  # the measured run's
    check_serves(cache)
    if cfg.conversation.turns:
        return measure_conversations(
            model, tokenizer, new_cache, cache, cfg, sampling, eos_ids, warmup
        )
    requests = build_trace(tokenizer, cfg, sampling.seed)
    device = model.embed_tokens.weight.device
    if warmup:  # the first forwards load kernels; a request's worth, never measured
        short = [Request(0, 0.0, requests[0].prompt, 2)]
        serve(model, new_cache(), short, cfg, WallClock(device), eos_ids, sampling, spec)
    result = serve(model, cache, requests, cfg, WallClock(device), eos_ids, sampling, spec)
    metrics = result.metrics()
    metrics["predicted_max_concurrency"] = predicted_concurrency(cache, requests)
    metrics["kv_budget_bytes"] = cfg.budget_bytes
    metrics["prompt_tokens"] = sum(len(r.prompt) for r in requests)
    if out_dir is not None:
        write_timeline(result, out_dir)
    return metrics


def measure_conversations(model, tokenizer, new_cache, cache, cfg, sampling, eos_ids, warmup):
    """``workload.serving.conversation``: multi-turn conversations under the budget on
    ``cache`` (:mod:`kvlab.serving.conversations`), after a warm-up of one short
    conversation on a cache of its own."""
    import dataclasses

    from kvlab.serving.conversations import build_conversations, serve_conversations

    conversations = build_conversations(tokenizer, wikitext2_test_text(), cfg)
    device = model.embed_tokens.weight.device
    if warmup:
        first = conversations[0]
        short = dataclasses.replace(first, document=first.document[:64], start_s=0.0)
        talk = dataclasses.replace(cfg.conversation, turns=1, answer_len=2)
        small = dataclasses.replace(cfg, conversation=talk)
        serve_conversations(model, new_cache(), [short], small, WallClock(device), eos_ids,
                            sampling)  # fmt: skip
    result = serve_conversations(model, cache, conversations, cfg, WallClock(device),
                                 eos_ids, sampling)  # fmt: skip
    return result.metrics() | {"kv_budget_bytes": cfg.budget_bytes}


def write_timeline(result: ServeResult, out_dir: Path) -> None:
    """``serving_timeline.json`` (time, KV bytes in use, requests admitted, per step) and
    ``serving_timeline.png``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out_dir.mkdir(parents=True, exist_ok=True)
    rows = [{"t_s": t, "kv_bytes": b, "requests": n} for t, b, n in result.timeline]
    (out_dir / "serving_timeline.json").write_text(json.dumps(rows))
    fig, ax = plt.subplots(figsize=(7, 3.5))
    times = [r["t_s"] for r in rows]
    ax.plot(times, [r["kv_bytes"] / 2**20 for r in rows], color="tab:blue")
    ax.set_xlabel("time (s)")
    ax.set_ylabel("KV in use (MiB)", color="tab:blue")
    twin = ax.twinx()
    twin.step(times, [r["requests"] for r in rows], color="tab:orange", where="post")
    twin.set_ylabel("requests admitted", color="tab:orange")
    fig.tight_layout()
    fig.savefig(out_dir / "serving_timeline.png", dpi=100)
    plt.close(fig)
