"""Where a serving step's time goes, in process: a packed step of prompt chunks beside a
running batch's decode tokens (kvlab.models.packed), the chunks alone, and the decode step
alone, each timed after a warm-up, then torch's profiler over one packed step (matrix
products vs attention vs the rest). experiments/serving_vs_vllm cites it.

    python scripts/profile_packed_step.py --chunks 7 --chunk-len 256 --rows 56 --context 256
"""

from __future__ import annotations

import argparse
import time

import torch
from torch.profiler import ProfilerActivity, profile

from kvlab import load_model
from kvlab.cache import build_cache
from kvlab.models.packed import StepPart


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--cache", default="paged")
    p.add_argument("--chunks", type=int, default=7, help="requests fed a prompt chunk")
    p.add_argument("--chunk-len", type=int, default=256)
    p.add_argument("--rows", type=int, default=56, help="running rows decoding beside them")
    p.add_argument("--context", type=int, default=256, help="tokens each running row holds")
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args()
    model, _ = load_model(args.model, dtype=getattr(torch, args.dtype))
    spec = model.cache_spec()
    capacity = args.context + args.chunk_len + 2 * args.repeats + 8
    running = build_cache(args.cache, spec)
    running.serve(2**32, capacity)
    gen = torch.Generator().manual_seed(0)
    vocab = model.config.vocab_size
    with torch.inference_mode():
        for first in range(0, args.rows, 8):
            rows = min(8, args.rows - first)
            group = running.spawn()
            group.allocate(rows, capacity)
            ids = torch.randint(0, vocab, (rows, args.context), generator=gen)
            model(ids, torch.arange(args.context).expand_as(ids), group)
            running.join(group)
    position = [args.context]

    def chunks() -> list[StepPart]:
        parts = []
        for _ in range(args.chunks):
            cache = running.spawn()
            cache.allocate(1, capacity)
            ids = torch.randint(0, vocab, (1, args.chunk_len), generator=gen)
            where = torch.arange(args.chunk_len)[None]
            parts.append(StepPart(cache, ids, where, [args.chunk_len], where[:, -1]))
        return parts

    def decode() -> list[StepPart]:
        ids = torch.randint(0, vocab, (args.rows, 1), generator=gen)
        where = torch.full((args.rows, 1), position[0])
        position[0] += 1
        return [StepPart(running, ids, where, [1] * args.rows)]

    def timed(parts: list[StepPart]) -> float:
        began = time.perf_counter()
        model.forward_parts(parts)
        return time.perf_counter() - began

    with torch.inference_mode():
        timed(chunks() + decode())  # warm-up
        for _ in range(args.repeats):
            mixed, alone = timed(chunks() + decode()), timed(chunks())
            print(f"packed {mixed:.3f} s | chunks alone {alone:.3f} s | "
                  f"decode alone {timed(decode()):.3f} s")  # fmt: skip
        parts = chunks() + decode()
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            model.forward_parts(parts)
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=10))


if __name__ == "__main__":
    main()
