"""Tables and plots of the eviction study from its result files.

Usage: python experiments/eviction_ruler/summarize.py OUT_DIR
Reads OUT_DIR/study/kvlab_ruler.jsonl (study.py) and OUT_DIR/kvpress_ruler.json
(kvpress_peer.py), prints the README's tables (markdown), writes the plots and a copy of
both result files into this folder.
"""

from __future__ import annotations

import json
import statistics
import sys
from collections import defaultdict
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

HERE = Path(__file__).parent
RATIOS = [0.25, 0.5, 0.75, 0.875]


def scorers_in(summary: dict) -> list[str]:
    """The scorers the study ran (its settings ``<scorer>@<ratio>``: study.py runs every
    registered scorer)."""
    return sorted({s.split("@")[0] for s in summary if "@" in s and "/" not in s})


def by_setting(rows: list[dict]) -> dict[str, dict]:
    """setting -> {score: mean over items, kv: mean held / full bytes, tasks: {task: score}}."""
    grouped = defaultdict(list)
    for row in rows:
        grouped[row["setting"]].append(row)
    out = {}
    for setting, items in grouped.items():
        tasks = defaultdict(list)
        for r in items:
            tasks[r["task"]].append(r["score"])
        out[setting] = dict(
            score=statistics.fmean(statistics.fmean(v) for v in tasks.values()),
            kv=sum(r["kv_bytes"] for r in items) / sum(r["full_bytes"] for r in items),
            tasks={t: statistics.fmean(v) for t, v in tasks.items()},
            items=len(items),
        )
    return out


def ratio_table(summary: dict, ratios=RATIOS) -> str:
    lines = ["| scorer | " + " | ".join(f"ratio {r}" for r in [0, *ratios]) + " |"]
    lines.append("|---" * (len(ratios) + 2) + "|")
    for scorer in scorers_in(summary):
        cells = [summary["full"]["score"]] + [
            summary.get(f"{scorer}@{r}", {}).get("score", float("nan")) for r in ratios
        ]
        lines.append(f"| {scorer} | " + " | ".join(f"{c:.1f}" for c in cells) + " |")
    return "\n".join(lines)


def bytes_table(summary: dict) -> str:
    lines = ["| setting | RULER avg | KV held / full's | items |", "|---|---|---|---|"]
    for setting, s in sorted(summary.items(), key=lambda kv: -kv[1]["kv"]):
        lines.append(f"| {setting} | {s['score']:.1f} | {s['kv']:.3f} | {s['items']} |")
    return "\n".join(lines)


def peer_table(summary: dict, peer_rows: list[dict]) -> str:
    peer = defaultdict(dict)
    for r in peer_rows:
        peer[(r["press"], r["ratio"])][r["task"]] = r["score"]
    lines = ["| method | task | kvlab | kvpress | diff |", "|---|---|---|---|---|"]
    for (press, ratio), tasks in peer.items():
        setting = "full" if press == "none" else f"{press}@{ratio}"
        ours = summary.get(setting, {}).get("tasks", {})
        for task, theirs in tasks.items():
            mine = ours.get(task, float("nan"))
            lines.append(
                f"| {setting} | {task} | {mine:.0f} | {theirs:.0f} | {mine - theirs:+.0f} |"
            )
    return "\n".join(lines)


def plots(summary: dict, ratios=(0.5, 0.875)) -> None:
    """Ratios measured on every task only (a point must average the same items)."""
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.5))
    for scorer in scorers_in(summary):
        xs = [0, *ratios]
        ys = [summary["full"]["score"]]
        ys += [summary.get(f"{scorer}@{r}", {}).get("score", float("nan")) for r in ratios]
        left.plot(xs, ys, marker="o", label=scorer)
        kv = [summary["full"]["kv"]] + [summary.get(f"{scorer}@{r}", {}).get("kv") for r in ratios]
        right.plot(kv, ys, marker="o", label=scorer)
    for other in ("int4", "int2", "sliding", "compressed"):
        if other in summary and summary[other]["items"] == summary["full"]["items"]:
            s = summary[other]
            right.scatter([s["kv"]], [s["score"]], marker="s", s=60, label=other, zorder=3)
    left.set(xlabel="compression ratio (fraction of context removed)", ylabel="RULER avg (%)",
             title="RULER 4k vs ratio (SmolLM2-135M)")  # fmt: skip
    right.set(xlabel="KV bytes held / full's (measured)", ylabel="RULER avg (%)",
              title="RULER 4k vs real KV bytes")  # fmt: skip
    right.legend(fontsize=7)
    left.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(HERE / "ruler_vs_ratio_and_bytes.png", dpi=100)


def main() -> None:
    out = Path(sys.argv[1])
    rows = []
    for name in ("kvlab_ruler.jsonl", "kvlab_ruler_evalpath.jsonl"):
        if (out / "study" / name).exists():
            rows += [json.loads(line) for line in (out / "study" / name).open()]
    peer_path = out / "kvpress_ruler.json"
    peer_rows = json.loads(peer_path.read_text()) if peer_path.exists() else []
    summary = by_setting(rows)
    tasks = sorted({r["task"] for r in rows})
    print(f"## RULER average (%) over {len(tasks)} tasks, by scorer and ratio\n")
    print(ratio_table(summary, [0.5, 0.875]))
    every_ratio = {r["task"] for r in rows if r["setting"] == "knorm@0.25"}
    subset = by_setting([r for r in rows if r["task"] in every_ratio])
    print(
        f"\n## Every ratio, on the {len(every_ratio)} tasks measured at all of them "
        f"({', '.join(sorted(every_ratio))})\n"
    )
    print(ratio_table(subset))
    print("\n## Every setting: score and measured KV bytes\n")
    print(bytes_table(summary))
    if peer_rows:
        print("\n## kvlab vs kvpress, per task\n")
        print(peer_table(summary, peer_rows))
    plots(summary)
    (HERE / "results_kvlab.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    if peer_rows:
        (HERE / "results_kvpress.json").write_text(peer_path.read_text())


if __name__ == "__main__":
    main()
