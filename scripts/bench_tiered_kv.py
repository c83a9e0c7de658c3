"""KV beyond working memory (experiments/tiered_kv): multi-turn conversations over long
WikiText-2 documents (kvlab.serving.conversations) under a KV budget that holds a fraction
of the live conversations, served by stores that keep less or more of what a later turn
needs — nothing (``recompute``: no prefix caching), the pool alone (``paged``), the pool
and a slow tier (``tiered``: host RAM or a file, exact or int4) — then a trace whose
requests outgrow the budget served with ``preemption=swap`` and ``recompute`` on the tiered
store, and the memory model's bytes per tier against the real tensors'. Prints markdown
tables; writes results.json and ttft_by_turn.png to --out.

    python scripts/bench_tiered_kv.py --document-len 4096 --conversations 4 --turns 3
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import torch

from kvlab import load_model
from kvlab.analysis.memory import Architecture, load_config, tier_block_bytes
from kvlab.cache import build_cache
from kvlab.config import ConversationConfig, ServingConfig
from kvlab.data import wikitext2_test_text
from kvlab.engine.clock import WallClock
from kvlab.engine.sequence import Request
from kvlab.serving.conversations import build_conversations, serve_conversations, tier_traffic
from kvlab.serving.server import serve
from kvlab.workload import text_windows

MIB = 2**20


def stores(folder: str) -> list[tuple[str, str, dict]]:
    """(label, strategy, options) of each store the conversations run on."""
    return [
        ("recompute (no prefix caching)", "paged", dict(prefix_sharing=False)),
        ("paged (pool only)", "paged", {}),
        ("tiered, RAM, exact", "tiered", dict(slow_tier="ram")),
        ("tiered, file, exact", "tiered", dict(slow_tier="file", slow_path=folder)),
        ("tiered, file, int4", "tiered",
         dict(slow_tier="file", slow_path=folder, slow_kv_bits=4, slow_kv_group_size=32)),
        ("tiered, RAM, exact, ARC", "tiered", dict(slow_tier="ram", slow_eviction="arc")),
    ]  # fmt: skip


def block_bytes(model) -> int:
    probe = build_cache("paged", model.cache_spec(), {})
    probe.serve(2**26, 64)
    return probe.store.block_bytes()


def conversations_table(model, tokenizer, args, folder: str) -> list[dict]:
    talk = ConversationConfig(args.turns, args.document_len, args.question_len,
                              args.answer_len, args.think_s)  # fmt: skip
    longest = -(-talk.longest() // 16) + 1  # blocks of a conversation's last turn
    blocks = max(longest, round(args.fraction * args.conversations * longest))
    budget = (blocks + 1) * block_bytes(model)
    cfg = ServingConfig(num_requests=args.conversations, rate=args.rate, kv_budget_bytes=budget,
                        chunk=args.chunk, conversation=talk)  # fmt: skip
    conversations = build_conversations(tokenizer, wikitext2_test_text(), cfg)
    device = model.embed_tokens.weight.device
    warm = ServingConfig(num_requests=1, kv_budget_bytes=budget, chunk=args.chunk,
                         conversation=ConversationConfig(2, 256, 16, 4, 0.0))  # fmt: skip
    serve_conversations(model, build_cache("tiered", model.cache_spec(), {}),
                        build_conversations(tokenizer, wikitext2_test_text(), warm), warm,
                        WallClock(device))  # fmt: skip
    rows = []
    for label, name, options in stores(folder):
        cache = build_cache(name, model.cache_spec(), options)
        began = time.perf_counter()
        result = serve_conversations(model, cache, conversations, cfg, WallClock(device))
        wall = time.perf_counter() - began
        m = result.metrics()
        later = [f"turn{t + 1}" for t in range(1, args.turns)]
        rows.append({
            "store": label, "strategy": name, "options": options, "wall_s": wall,
            "budget_blocks": blocks, "live_blocks": args.conversations * longest,
            "turn1_ttft_p50_ms": m["turn1/ttft_p50_ms"],
            "later_ttft_p50_ms": m["later_turns/ttft_p50_ms"],
            "later_ttft_mean_ms": m["later_turns/ttft_mean_ms"],
            "later_prompt_tokens": sum(m[f"{t}/prompt_tokens"] for t in later),
            "later_reused_tokens": sum(m[f"{t}/reused_tokens"] for t in later),
            "output_throughput": m["output_throughput"], "preemptions": m["preemptions"],
            "per_turn_ttft_p50_ms": [m[f"turn{t + 1}/ttft_p50_ms"] for t in range(args.turns)],
            **{k: v for k, v in result.tiers.items()},
        })  # fmt: skip
        print(f"  {label}: {wall:.1f} s", flush=True)
    return rows


def preemption_table(model, tokenizer, args, folder: str) -> list[dict]:
    """Requests that outgrow the budget together: the tiered store with its preempted
    requests' blocks kept (swap) or forgotten (recompute)."""
    n, prompt, output = args.preempt_requests, args.preempt_prompt, args.preempt_output
    windows = text_windows(tokenizer, wikitext2_test_text(), prompt, n)
    requests = [Request(i, 0.0, tuple(w), output) for i, w in enumerate(windows)]
    per_request = -(-(prompt + output) // 16) + 1
    budget = (args.preempt_fit * per_request + 1) * block_bytes(model)
    device = model.embed_tokens.weight.device
    rows = []
    for preemption in ("swap", "recompute"):
        cfg = ServingConfig(kv_budget_bytes=budget, chunk=args.chunk, preemption=preemption)
        cache = build_cache("tiered", model.cache_spec(), dict(slow_tier="file", slow_path=folder))
        result = serve(model, cache, requests, cfg, WallClock(device))
        m = result.metrics()
        fed = sum(result.profile.stats.fed_tokens)
        rows.append({
            "preemption": preemption, "output_throughput": m["output_throughput"],
            "duration_s": m["duration_s"], "preemptions": m["preemptions"],
            "prompt_tokens_fed": fed, "prompt_tokens": n * prompt,
            **tier_traffic(cache),
        })  # fmt: skip
        print(f"  preemption={preemption}: {m['duration_s']:.1f} s", flush=True)
    return rows


def memory_check(model, source: str, folder: str) -> list[dict]:
    """The memory model's bytes per block in each tier against the real tensors'."""
    arch = Architecture.from_config(load_config(source))
    rows = []
    for label, name, options in stores(folder)[2:5]:
        cache = build_cache(name, model.cache_spec(), options)
        cache.serve(2**26, 64)
        predicted = tier_block_bytes(arch, options, model.embed_tokens.weight.dtype)
        measured = {"fast": cache.store._pool_block_bytes(), "slow": cache.store.tier.record_bytes}
        rows.append({"store": label, "predicted": predicted, "measured": measured})
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--conversations", type=int, default=4)
    p.add_argument("--turns", type=int, default=3)
    p.add_argument("--document-len", type=int, default=4096)
    p.add_argument("--question-len", type=int, default=32)
    p.add_argument("--answer-len", type=int, default=32)
    p.add_argument("--think-s", type=float, default=1.0)
    p.add_argument("--rate", type=float, default=0.0,
                   help="conversations started per second (0: all at once)")  # fmt: skip
    p.add_argument("--parts", default="conversations,preemption")
    p.add_argument("--fraction", type=float, default=0.25,
                   help="of the live conversations' blocks the budget holds")  # fmt: skip
    p.add_argument("--chunk", type=int, default=512)
    p.add_argument("--preempt-requests", type=int, default=12)
    p.add_argument("--preempt-prompt", type=int, default=512)
    p.add_argument("--preempt-output", type=int, default=256)
    p.add_argument("--preempt-fit", type=int, default=4,
                   help="requests at full length the preemption budget holds")  # fmt: skip
    p.add_argument("--out", default="experiments/tiered_kv")
    p.add_argument("--table", help="print the tables of a results.json and stop")
    args = p.parse_args()
    if args.table:
        print_tables(json.loads(Path(args.table).read_text()))
        return
    model, tokenizer = load_model(args.model, dtype=getattr(torch, args.dtype))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="kvlab-tiers-") as folder:
        parts = args.parts.split(",")
        print("conversations:", flush=True)
        turns = conversations_table(model, tokenizer, args, folder)
        preempt = []
        if "preemption" in parts:
            print("preemption:", flush=True)
            preempt = preemption_table(model, tokenizer, args, folder)
        memory = memory_check(model, args.model, folder)
    results = {"args": vars(args), "conversations": turns, "preemption": preempt,
               "memory_model": memory}  # fmt: skip
    (out / "results.json").write_text(json.dumps(results, indent=1))
    print_tables(results)
    plot(turns, out / "ttft_by_turn.png")


def print_tables(results: dict) -> None:
    turns = results["conversations"]
    base = turns[0]["later_ttft_mean_ms"]
    count = len(turns[0]["per_turn_ttft_p50_ms"])
    heads = " | ".join(f"turn {t + 1} TTFT p50" for t in range(count))
    print(f"\n| store | {heads} | turns 2+ TTFT mean | vs recompute | turns 2+ tokens reused "
          "| slow-tier hits | written MiB | read MiB | wall s |")  # fmt: skip
    print("|---|" + "---:|" * (count + 7))
    for r in turns:
        per_turn = " | ".join(f"{v / 1e3:.2f} s" for v in r["per_turn_ttft_p50_ms"])
        reused = f"{r['later_reused_tokens']} / {r['later_prompt_tokens']}"
        mean = r["later_ttft_mean_ms"]
        print(f"| {r['store']} | {per_turn} | {mean / 1e3:.2f} s | {base / mean:.1f}x | {reused} "
              f"| {r.get('slow_hit_blocks', '-')} | {r.get('slow_written_bytes', 0) / MIB:.0f} | "
              f"{r.get('slow_read_bytes', 0) / MIB:.0f} | {r['wall_s']:.1f} |")  # fmt: skip
    print("\n| store | fast block bytes: model / tensors | slow block bytes: model / tensors |")
    print("|---|---:|---:|")
    for r in results["memory_model"]:
        p, m = r["predicted"], r["measured"]
        print(f"| {r['store']} | {p['fast']} / {m['fast']} | {p['slow']} / {m['slow']} |")
    if not results["preemption"]:
        return
    print("\n| preemption | out tok/s | duration s | preemptions | prompt tokens fed "
          "| slow-tier hits | read MiB |")  # fmt: skip
    print("|---|---:|---:|---:|---:|---:|---:|")
    for r in results["preemption"]:
        read = r.get("slow_read_bytes", 0) / MIB
        print(f"| {r['preemption']} | {r['output_throughput']:.1f} | {r['duration_s']:.1f} | "
              f"{r['preemptions']} | {r['prompt_tokens_fed']} (of {r['prompt_tokens']}) | "
              f"{r.get('slow_hit_blocks', 0)} | {read:.0f} |")  # fmt: skip


def plot(turns: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4))
    count = len(turns[0]["per_turn_ttft_p50_ms"])
    width = 0.8 / len(turns)
    for i, r in enumerate(turns):
        xs = [t + i * width for t in range(count)]
        ax.bar(xs, [v / 1e3 for v in r["per_turn_ttft_p50_ms"]], width, label=r["store"])
    ax.set_xticks([t + 0.4 - width / 2 for t in range(count)])
    ax.set_xticklabels([f"turn {t + 1}" for t in range(count)])
    ax.set_ylabel("TTFT p50 (s)")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


if __name__ == "__main__":
    main()
