"""Compress once, ask many questions (kvpress's protocol; kvlab.cache.saved): a WikiText-2
context prefilled once into a cache and saved, then each question answered from the
loaded cache (load + the question's prefill) against the same question answered by
prefilling context and question from scratch. Prints, per strategy, the time to the
question's first logits both ways (each the median of the questions, after a warm-up),
their ratio, the file's bytes and the largest difference of those logits.

    python scripts/bench_saved_context.py --context 4096 --caches full,int4,compressed
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch

from kvlab import load_model
from kvlab.cache import cache_factory
from kvlab.cache.saved import load_rows, save_rows
from kvlab.data import wikitext2_test_text
from kvlab.workload import text_windows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--context", type=int, default=2048)
    p.add_argument("--question", type=int, default=32)
    p.add_argument("--questions", type=int, default=4)
    p.add_argument("--caches", default="full,int4")
    p.add_argument("--chunk", type=int, default=512, help="prefill chunk of the context")
    args = p.parse_args()
    model, tokenizer = load_model(args.model, dtype=getattr(torch, args.dtype))
    windows = text_windows(
        tokenizer, wikitext2_test_text(), args.context + args.question, args.questions + 1
    )
    context = windows[0][: args.context]
    questions = [w[args.context :] for w in windows[1:]]
    room = args.context + args.question + 8
    folder = Path(tempfile.mkdtemp(prefix="kvlab-saved-"))
    print(f"context {args.context} tokens, {len(questions)} questions of {args.question}")
    print("| cache | recompute (ms) | load + question (ms) | ratio | file MiB | max |dlogit| |")
    print("|---|---:|---:|---:|---:|---:|")
    for name in args.caches.split(","):
        new_cache = cache_factory(name, model)

        def prefill(cache, tokens, start):
            for begin in range(0, len(tokens), args.chunk):
                piece = torch.tensor([tokens[begin : begin + args.chunk]])
                where = start + begin + torch.arange(piece.shape[1])[None]
                logits = model(piece, where, cache, None, torch.tensor([piece.shape[1] - 1]))
            return logits

        with torch.inference_mode():
            saved = new_cache()
            saved.allocate(1, room)
            prefill(saved, context, 0)
            path = save_rows(saved, [0], folder / f"{name}.safetensors")
            scratch, reuse, diff = [], [], 0.0
            for q in [questions[0], *questions]:  # the first one warms up
                began = time.perf_counter()
                cache = new_cache()
                cache.allocate(1, room)
                want = prefill(cache, context + q, 0)
                scratch.append(time.perf_counter() - began)
                began = time.perf_counter()
                got = prefill(load_rows(path, new_cache()), q, args.context)
                reuse.append(time.perf_counter() - began)
                diff = max(diff, (got - want).abs().max().item())
        a, b = statistics.median(scratch[1:]), statistics.median(reuse[1:])
        mib = path.stat().st_size / 2**20
        print(f"| {name} | {a * 1e3:.0f} | {b * 1e3:.1f} | {a / b:.1f}x | {mib:.1f} | {diff:.1e} |")


if __name__ == "__main__":
    main()
