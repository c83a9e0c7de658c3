"""Eviction's cost and payoff on the default model, side by side in one process: TTFT
with each scorer's compression against ``full``'s (the scoring overhead), then decode step
time after compression at each ratio against ``full``'s over the same 4096-token context
(fewer tokens read per step), and ``full`` over a short context (the weights-only floor
of a decode step). Decode steps of every setting run interleaved, in rounds (medians), so
a slow spell of the machine hits them all alike. Not a test: timings are noisy, read ratios.

    python scripts/bench_evict.py --prompt-len 4096 --new-tokens 32 --rounds 2
"""

from __future__ import annotations

import argparse
import statistics

import torch

import kvlab
from kvlab.cache import build_cache
from kvlab.cache.evict.scorers import scorers
from kvlab.data import wikitext2_test_text
from kvlab.engine import Engine, GenerationConfig
from kvlab.quiet import quiet_third_party

SCORERS = sorted(scorers())  # every registered scorer
RATIOS = [0.5, 0.75, 0.875]


def settings(prompt_len: int):
    """(label, strategy, options, prompt tokens) of every setting."""
    out = [("full", "full", {}, prompt_len), ("full@64 (floor)", "full", {}, 64)]
    out += [(f"{s}@0.5", "evict", dict(scorer=s, ratio=0.5), prompt_len) for s in SCORERS]
    out += [(f"knorm@{r}", "evict", dict(scorer="knorm", ratio=r), prompt_len) for r in RATIOS[1:]]
    out += [("snapkv@0.5/adaptive", "evict", dict(scorer="snapkv", ratio=0.5, budget="adaptive"),
             prompt_len)]  # fmt: skip
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--prompt-len", type=int, default=4096)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    quiet_third_party()
    model, tokenizer = kvlab.load_model("smollm2-135m")
    ids = tokenizer(wikitext2_test_text()[:60_000])["input_ids"]
    ttft, steps, held = {}, {}, {}
    cfg = GenerationConfig(args.new_tokens, stop_on_eos=False)
    for _ in range(args.rounds):
        runs = {}
        for label, name, opts, length in settings(args.prompt_len):
            run = Engine(model, build_cache(name, model.cache_spec(), opts)).stream(
                [ids[:length]], cfg
            )
            iterator = iter(run)
            next(iterator)  # prefill
            runs[label] = (run, iterator)
            ttft.setdefault(label, []).append(run.stats.ttft_s)
            held[label] = run.stats.kv_peak.held_bytes
        for _ in range(args.new_tokens - 1):  # one decode step of each setting in turn
            for _run, iterator in runs.values():
                next(iterator, None)
        for label, (run, _) in runs.items():
            steps.setdefault(label, []).extend(run.stats.step_s[2:])
    cpu = torch.backends.cpu.get_cpu_capability()
    print(
        f"prompt {args.prompt_len} tokens, {args.new_tokens} new, {args.rounds} rounds, CPU {cpu}"
    )
    full_ttft = statistics.median(ttft["full"])
    full_step = statistics.median(steps["full"])
    print("| setting | TTFT s | TTFT vs full | decode step ms | vs full | KV MiB held |")
    print("|---|---|---|---|---|---|")
    for label, *_ in settings(args.prompt_len):
        t, s = statistics.median(ttft[label]), statistics.median(steps[label])
        print(f"| {label} | {t:.2f} | {t / full_ttft:.3f} | {1000 * s:.1f} | "
              f"{s / full_step:.3f} | {held[label] / 2**20:.1f} |")  # fmt: skip


if __name__ == "__main__":
    main()
