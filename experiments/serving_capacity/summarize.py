"""Tables and plots of the serving-capacity study from its result files.

Usage: python experiments/serving_capacity/summarize.py multirun/serving_capacity [TAG]
Prints the README's tables (markdown), writes the plots into this folder (names end with
TAG) and every point's config and metrics to ``results{TAG}.json`` beside them.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from kvlab.tracking import load_results  # noqa: E402

HERE = Path(__file__).parent


def label(row: dict) -> str:
    name = row["cache.name"]
    if row.get("cache.options.kv_bits"):
        name += f" kv_bits={row['cache.options.kv_bits']}"
    if name == "sliding":
        name += f"({row.get('cache.options.window')})"
    if row.get("workload.serving.max_running") == 1:
        name += " one at a time"
    return name


def ok_rows(root: Path, sweep: str) -> list[dict]:
    rows = [r for r in load_results(root / sweep) if r["status"] == "ok"]
    failed = [r for r in load_results(root / sweep) if r["status"] != "ok"]
    for r in failed:
        print(f"FAILED {r['path']}: {r['error']}", file=sys.stderr)
    return rows


def fmt(value, digits=1) -> str:
    return f"{value:.{digits}f}" if isinstance(value, float) else str(value)


def capacity_table(rows: list[dict]) -> str:
    offline = [r for r in rows if r["workload.serving.rate"] == 0]
    full = next(r for r in offline if label(r) == "full")
    head = (
        "| strategy | predicted concurrency | measured max | mean | x full (max) | output tok/s "
        "| x full | TTFT p50 / p90 (s) | ITL p50 / p90 (ms) | preemptions | KV peak (MiB) "
        "| scheduler / KV moves (% of step) |"
    )
    lines = [head, "|" + "---|" * 12]
    for r in offline:
        lines.append(
            f"| {label(r)} | {r['predicted_max_concurrency']} | {r['max_concurrency']} | "
            f"{r['mean_concurrency']:.1f} | {r['max_concurrency'] / full['max_concurrency']:.2f} | "
            f"{r['output_throughput']:.1f} | "
            f"{r['output_throughput'] / full['output_throughput']:.2f} | "
            f"{r['median_ttft_ms'] / 1e3:.1f} / {r['p90_ttft_ms'] / 1e3:.1f} | "
            f"{r['median_itl_ms']:.0f} / {r['p90_itl_ms']:.0f} | {r['preemptions']} | "
            f"{r['kv_bytes_peak'] / 2**20:.0f} | "
            f"{100 * r['scheduler_share']:.1f} / {100 * r['kv_moves_share']:.1f} |"
        )
    return "\n".join(lines)


def rate_table(rows: list[dict]) -> str:
    rates = sorted({r["workload.serving.rate"] for r in rows}, key=lambda x: x or float("inf"))
    names = list(dict.fromkeys(label(r) for r in rows))
    by = {(label(r), r["workload.serving.rate"]): r for r in rows}
    shown = [f"{x:g}/s" if x else "all at t=0" for x in rates]
    lines = [
        "| strategy | " + " | ".join(f"{s}: max conc / tok/s / TTFT p90 (s)" for s in shown) + " |",
        "|" + "---|" * (len(rates) + 1),
    ]
    for name in names:
        cells = []
        for rate in rates:
            r = by.get((name, rate))
            cells.append(
                "—"
                if r is None
                else f"{r['max_concurrency']} / {r['output_throughput']:.1f} / "
                f"{r['p90_ttft_ms'] / 1e3:.1f}"
            )
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def plots(rows: list[dict], tag: str) -> None:
    names = list(dict.fromkeys(label(r) for r in rows))
    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    for name in names:
        mine = [r for r in rows if label(r) == name]
        mine.sort(key=lambda r: r["workload.serving.rate"] or float("inf"))
        xs = [r["workload.serving.rate"] or 4.0 for r in mine]  # t=0 drawn at 4/s
        for ax, key, scale in (
            (axes[0], "max_concurrency", 1),
            (axes[1], "output_throughput", 1),
            (axes[2], "p90_ttft_ms", 1e-3),
        ):
            ax.plot(xs, [r[key] * scale for r in mine], marker="o", label=name)
    titles = ("peak concurrent requests", "output tokens/s", "TTFT p90 (s)")
    for ax, title in zip(axes, titles, strict=True):
        ax.set_title(title)
        ax.set_xscale("log", base=2)
        ax.set_xticks([0.5, 2, 4], ["0.5/s", "2/s", "t=0"])
        ax.set_xlabel("arrival rate")
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(HERE / f"serving_vs_rate{tag}.png", dpi=100)
    plt.close(fig)
    offline = [r for r in rows if r["workload.serving.rate"] == 0]
    fig, ax = plt.subplots(figsize=(8, 3.5))
    xs = range(len(offline))
    ax.bar([x - 0.2 for x in xs], [r["predicted_max_concurrency"] for r in offline], 0.4,
           label="memory model")  # fmt: skip
    ax.bar([x + 0.2 for x in xs], [r["max_concurrency"] for r in offline], 0.4, label="measured")
    ax.set_xticks(list(xs), [label(r) for r in offline], rotation=15, fontsize=8)
    ax.set_ylabel("concurrent requests")
    ax.legend()
    fig.tight_layout()
    fig.savefig(HERE / f"predicted_vs_measured{tag}.png", dpi=100)
    plt.close(fig)


def main(root: Path, tag: str = "") -> None:
    rows = []
    for sweep in ("main", "paged_int4", "sliding"):
        rows += ok_rows(root, sweep)
    everything = rows + ok_rows(root, "one_at_a_time") + ok_rows(root, "prefix")
    keep = [{k: v for k, v in r.items() if k != "path"} for r in everything]
    (HERE / f"results{tag}.json").write_text(json.dumps(keep, indent=1, default=str))
    print("## Capacity, offline (all 24 requests at t=0)\n")
    print(capacity_table(rows + ok_rows(root, "one_at_a_time")))
    print("\n## By arrival rate\n")
    print(rate_table(rows))
    print("\n## Prefix caching (1024-token shared system prompt, 12 requests at 0.5/s)\n")
    print("| prefix_sharing | TTFT p50 (ms) | TTFT p90 (ms) | hit rate | output tok/s |")
    print("|---|---|---|---|---|")
    for r in ok_rows(root, "prefix"):
        print(
            f"| {r['cache.options.prefix_sharing']} | {r['median_ttft_ms']:.0f} | "
            f"{r['p90_ttft_ms']:.0f} | {r['prefix_cache_hit_rate']:.3f} | "
            f"{r['output_throughput']:.1f} |"
        )
    plots(rows, tag)


if __name__ == "__main__":
    main(
        Path(sys.argv[1] if len(sys.argv) > 1 else "multirun/serving_capacity"),
        sys.argv[2] if len(sys.argv) > 2 else "",
    )
