"""The eviction study (see README.md): RULER at 4k on the default model under every
scorer x ratio, the other memory levers at comparable bytes, and the decode speed and
scoring overhead of eviction, measured side by side in one process.

Each item's context is prefilled once, recording every layer's queries, keys and values
(they do not depend on what a cache keeps: the context attends to itself exactly under
``full``, KIVI and eviction); each eviction setting then compresses that record with
:meth:`kvlab.cache.policies.evict.Evict.compress_step` (exactly what ``attend``
leaves; checked on the first item against ``eval=ruler``'s own path) and answers the
question. ``sliding`` and ``compressed`` attend differently within the context, so they run
through ``eval=ruler``.

  python experiments/eviction_ruler/study.py OUT_DIR [--samples 1]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time
from pathlib import Path

import torch

from kvlab import load_model
from kvlab.cache import build_cache, cache_factory
from kvlab.cache.base import StepInfo
from kvlab.cache.evict.scorers.base import _SCORERS, scorers
from kvlab.engine.runner import decode_logits
from kvlab.eval.longctx_tasks import score
from kvlab.eval.ruler import RulerOptions, answer, full_bytes, ruler_items
from kvlab.eval.ruler_tasks import prompt_ids
from kvlab.models.rope import RotaryTables

SCORERS = sorted(scorers())  # every registered scorer
RATIOS = [0.25, 0.5, 0.75, 0.875]
BUDGETS = [("snapkv", 0.5, "pyramid"), ("snapkv", 0.5, "adaptive"),
           ("expected_attention", 0.5, "adaptive"), ("knorm", 0.5, "adaptive")]  # fmt: skip
REPLAYED = [("full", {}), ("int4", {}), ("int2", {})]  # exact within the context step
THROUGH_EVAL = [("sliding", dict(sinks=4, window=1020)), ("compressed", {})]


def record(model, context: list[int]):
    """Prefill ``context`` under ``full``; per layer (q, k, v) and the prefill seconds."""
    cache = build_cache("full", model.cache_spec())
    cache.allocate(1, len(context) + 1)
    seen = []
    attend = cache.attend
    cache.attend = lambda step, layer, q, k, v, k_raw: (
        seen.append((q, k, v)),
        attend(step, layer, q, k, v, k_raw),
    )[1]  # noqa: E501
    ids = torch.tensor([context])
    start = time.perf_counter()
    with torch.inference_mode():
        last = torch.tensor([len(context) - 1])
        model(ids, torch.arange(len(context))[None], cache, [len(context)], last)
    return seen, time.perf_counter() - start


def replay(model, cache, recorded, length: int, capacity: int) -> float:
    """Put the recorded context into ``cache`` as its context step; seconds spent."""
    cache.allocate(1, capacity)
    positions = torch.arange(length)[None]
    rope = RotaryTables(model.inv_freq, positions, model.embed_tokens.weight.dtype)
    start = time.perf_counter()
    with torch.inference_mode():
        step = cache.plan(StepInfo(positions, [length], rope, None, [True]))
        for layer, (q, k, v) in enumerate(recorded):
            if hasattr(getattr(cache, "policy", None), "compress_step"):
                cache.policy.compress_step(step, cache.store, layer, q, k, v)
            else:
                cache.attend(step, layer, q, k, v, k)
        cache.end(step)
    return time.perf_counter() - start


def continue_answer(model, tokenizer, cache, context_len, question, max_new):
    """Prefill the question after the cached context, then greedy decode; (text, peak
    held bytes, decode step seconds)."""
    eos = set(model.config.eos_token_ids)
    with torch.inference_mode():
        ids = torch.tensor([question])
        positions = context_len + torch.arange(len(question))[None]
        logits = model(ids, positions, cache, [len(question)], torch.tensor([len(question) - 1]))
        seq = [0] * context_len + list(question)
        tokens, steps, peak = [], [], cache.memory().held_bytes
        token = int(logits[0].argmax())
        while True:
            tokens.append(token)
            seq.append(token)
            if token in eos or len(tokens) >= max_new:
                break
            start = time.perf_counter()
            token = int(decode_logits(model, cache, [seq])[0].argmax())
            steps.append(time.perf_counter() - start)
            peak = max(peak, cache.memory().held_bytes)
    return tokenizer.decode(tokens, skip_special_tokens=True), peak, steps


def memoize_scorers() -> dict:
    """Scores depend on the recorded context and the scorer's own options, not on the ratio
    or the budget: compute each (scorer, layer) once per item. Returns the memo (cleared
    per item)."""
    memo: dict = {}
    for name, entry in list(scorers().items()):

        def cached(obs, name=name, fn=entry.fn):
            o = obs.options
            key = (name, obs.layer, o.window, o.kernel, o.kept_sinks, o.future, o.seed)
            if key not in memo:
                memo[key] = fn(obs)
            return memo[key].clone()

        _SCORERS[name] = dataclasses.replace(entry, fn=cached)
    return memo


def settings(ratios=RATIOS, replayed=REPLAYED):
    """(label, strategy, options) of every replayed setting."""
    out = [(name, name, opts) for name, opts in replayed]
    out += [(f"{s}@{r}", "evict", dict(scorer=s, ratio=r)) for s in SCORERS for r in ratios]
    out += [(f"{s}@{r}/{b}", "evict", dict(scorer=s, ratio=r, budget=b)) for s, r, b in BUDGETS]
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out", type=Path)
    parser.add_argument("--samples", type=int, default=1)
    parser.add_argument("--ratios", type=float, nargs="+", default=RATIOS)
    parser.add_argument("--replayed", nargs="+", default=[n for n, _ in REPLAYED])
    parser.add_argument(
        "--replayed-only", action="store_true", help="skip sliding and compressed (run later)"
    )
    parser.add_argument(
        "--eval-path-only", action="store_true",
        help="only sliding and compressed, into kvlab_ruler_evalpath.jsonl (a second process)",
    )  # fmt: skip
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(0)
    model, tokenizer = load_model("smollm2-135m")
    memo = memoize_scorers()
    options = RulerOptions(samples=args.samples)
    name = "kvlab_ruler_evalpath.jsonl" if args.eval_path_only else "kvlab_ruler.jsonl"
    path = args.out / name  # resumed: settings already there are kept
    rows = [json.loads(line) for line in path.open()] if path.exists() else []
    done = {(r["task"], r["setting"]) for r in rows}
    for index, item in enumerate(ruler_items(tokenizer, options)):
        context, question = prompt_ids(tokenizer, item)
        capacity = len(context) + len(question) + options.max_new_tokens
        replayed = [(n, o) for n, o in REPLAYED if n in args.replayed]
        todo = [] if args.eval_path_only else settings(args.ratios, replayed)
        todo = [s for s in todo if (item.task, s[0]) not in done]
        memo.clear()
        recorded, ttft = record(model, context) if todo else (None, 0.0)
        for label, name, opts in todo:
            cache = build_cache(name, model.cache_spec(), opts)
            seconds = replay(model, cache, recorded, len(context), capacity)
            text, peak, steps = continue_answer(
                model, tokenizer, cache, len(context), question, options.max_new_tokens
            )
            row = dict(
                task=item.task, setting=label, cache=name, options=opts, answer=text,
                score=100 * score(text, item.references), kv_bytes=peak,
                full_bytes=full_bytes(model, capacity), context_tokens=len(context),
                full_prefill_s=ttft, compress_s=seconds if name == "evict" else None,
                decode_step_ms=1000 * sum(steps[2:]) / max(1, len(steps) - 2),
            )  # fmt: skip
            rows.append(row)
            with path.open("a") as f:
                f.write(json.dumps(row) + "\n")
            print(item.task, label, row["score"], f"{row['decode_step_ms']:.1f} ms",
                  f"{peak / row['full_bytes']:.3f}", repr(text[:40]), flush=True)  # fmt: skip
        if index == 0 and todo:  # the replay is what eval=ruler computes
            check = dict(scorer="snapkv", ratio=0.5)
            memo.clear()  # the eval path scores its own forward
            new_cache = cache_factory("evict", model, check)
            text, _, _ = answer(model, tokenizer, new_cache, item, options)
            replayed = next(r for r in rows if r["setting"] == "snapkv@0.5")
            assert text == replayed["answer"], (text, replayed["answer"])
            print("replay == eval=ruler on", item.task, flush=True)
        through_eval = [] if args.replayed_only else THROUGH_EVAL
        for name, opts in [(n, o) for n, o in through_eval if (item.task, n) not in done]:
            new_cache = cache_factory(name, model, opts)
            text, peak, _ = answer(model, tokenizer, new_cache, item, options)
            row = dict(
                task=item.task, setting=name, cache=name, options=opts, answer=text,
                score=100 * score(text, item.references), kv_bytes=peak,
                full_bytes=full_bytes(model, capacity), context_tokens=len(context),
            )  # fmt: skip
            with path.open("a") as f:
                f.write(json.dumps(row) + "\n")
            print(item.task, name, row["score"], f"{peak / row['full_bytes']:.3f}", flush=True)


if __name__ == "__main__":
    main()
