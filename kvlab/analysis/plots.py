"""The sweep report's figures, drawn from result rows alone: accuracy against KV
compression ratio (one line per strategy, as kvpress's leaderboard plots score against
compression ratio), ITL and TTFT against context length (outliers marked at the panel's
edge instead of stretching its axis), KV memory against context length, and the
memory-vs-accuracy Pareto front per prompt length.

Every figure writes what it shows into its PNG's text chunk (``kvlab`` key: JSON with
each panel's title, axis labels and series), so a test reads it back from the file."""

from __future__ import annotations

import json
import statistics
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

#: (suffix, higher is better) of the metrics an accuracy plot shows, in order of preference
ACCURACY_SUFFIXES = (
    ("/ppl", False),
    ("/kld", False),
    ("/top1_agreement", True),
    ("ruler/average", True),
    ("passkey/acc", True),
    ("/acc_norm", True),
    ("/acc", True),
)
MAX_PANELS = 4
OUTLIER_FACTOR = 4.0  # a series this many times the others' median is drawn at the edge


@dataclass(frozen=True)
class Point:
    series: str  # the legend's short label: the preset and the options it sets
    strategy: str  # the preset (and quantizer) alone: one line of the compression plot
    row: dict[str, Any]


def accuracy_metrics(rows: list[dict[str, Any]]) -> list[tuple[str, bool]]:
    """(metric, higher is better) for the accuracy metrics some row has, at most four, in
    ``ACCURACY_SUFFIXES``' order (per-length cells such as ``passkey/acc@4096`` left out)."""
    keys = sorted({k for r in rows for k, v in r.items() if isinstance(v, int | float)})
    found = []
    for suffix, higher in ACCURACY_SUFFIXES:
        found += [(k, higher) for k in keys if k.endswith(suffix) and (k, higher) not in found]
    return found[:MAX_PANELS]


def byte_unit(largest: float) -> tuple[float, str]:
    """The divisor and name that show ``largest`` bytes as a number people read."""
    for size, name in ((2**30, "GiB"), (2**20, "MiB"), (2**10, "KiB")):
        if largest >= size:
            return size, name
    return 1, "bytes"


def compression_ratios(rows: list[dict[str, Any]]) -> dict[int, float]:
    """id(row) -> the KV bytes of ``full`` at the same model, quantizer, prompt length and
    batch over the row's own; rows without such a ``full`` point or holding no KV get none."""

    def key(r):
        return (
            r.get("model.source"),
            r.get("quant.name"),
            r.get("workload.prompt_len"),
            r.get("workload.batch_size"),
        )

    full = {
        key(r): r["kv_bytes"] for r in rows if r.get("cache.name") == "full" and r.get("kv_bytes")
    }
    return {
        id(r): full[key(r)] / r["kv_bytes"] for r in rows if r.get("kv_bytes") and key(r) in full
    }


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _styles(labels: list[str]) -> dict[str, dict[str, Any]]:
    """One color and marker per series, the same in every figure of a report."""
    plt = _pyplot()
    colors, markers = plt.get_cmap("tab10").colors, "os^Dv<>p"
    return {
        label: dict(color=colors[i % 10], marker=markers[i // 10 % len(markers)])
        for i, label in enumerate(sorted(labels))
    }


def _save(fig, path: Path, panels: list[dict[str, Any]]) -> Path:
    fig.savefig(path, dpi=110, bbox_inches="tight", metadata={"kvlab": json.dumps(panels)})
    _pyplot().close(fig)
    return path


def _panel_record(ax, series: list[str]) -> dict[str, Any]:
    return {
        "title": ax.get_title(),
        "xlabel": ax.get_xlabel(),
        "ylabel": ax.get_ylabel(),
        "series": sorted(series),
    }


def _legend(fig, axes, styles: dict[str, dict[str, Any]], shown: set[str]) -> None:
    plt = _pyplot()
    handles = [
        plt.Line2D([], [], linestyle="-", label=label, **styles[label]) for label in sorted(shown)
    ]
    fig.legend(handles=handles, loc="outside lower center", ncols=min(4, len(handles)), fontsize=8)


def accuracy_vs_compression(points: list[Point], out: Path, styles) -> Path | None:
    """Each accuracy metric against KV compression ratio (``full``'s bytes over the
    strategy's), one line per strategy, at the sweep's longest prompt length."""
    rows = [p.row for p in points]
    metrics = accuracy_metrics(rows)
    ratios = compression_ratios(rows)
    lengths = [r.get("workload.prompt_len") for r in rows if id(r) in ratios]
    if not metrics or not lengths:
        return None
    at = max(lengths)
    plt = _pyplot()
    fig, axes = plt.subplots(
        1,
        len(metrics),
        figsize=(max(6.5, 4.2 * len(metrics)), 4.2),
        squeeze=False,
        layout="constrained",
    )
    panels, shown = [], set()
    for ax, (metric, higher) in zip(axes[0], metrics, strict=True):
        by_series = defaultdict(list)
        for p in points:
            r = p.row
            if id(r) in ratios and r.get("workload.prompt_len") == at and r.get(metric) is not None:
                by_series[p.strategy].append((ratios[id(r)], r[metric]))
        for label, xy in sorted(by_series.items()):
            xs, ys = zip(*sorted(xy), strict=True)
            ax.plot(xs, ys, linestyle="-", label=label, **styles[label])
        shown |= set(by_series)
        better = "higher" if higher else "lower"
        ax.set(
            title=f"{metric} ({better} is better)",
            xlabel=f"KV compression ratio vs full (prompt {at})",
            ylabel=metric,
        )
        ax.grid(alpha=0.3)
        panels.append(_panel_record(ax, list(by_series)))
    if not shown:
        plt.close(fig)
        return None
    _legend(fig, axes, styles, shown)
    return _save(fig, out / "accuracy_vs_compression.png", panels)


def _clip_outliers(
    by_series: dict[str, list[tuple[float, float]]],
) -> tuple[set[str], float | None]:
    """The series far above the others (``nocache``'s ITL beside cached ones) and the top
    the others need; (empty, None) when none stands out."""
    medians = {s: statistics.median(y for _, y in xy) for s, xy in by_series.items()}
    if len(medians) < 2:
        return set(), None
    reference = statistics.median(medians.values())
    outliers = {s for s, m in medians.items() if m > OUTLIER_FACTOR * reference}
    rest = [y for s, xy in by_series.items() if s not in outliers for _, y in xy]
    if not outliers or not rest:
        return set(), None
    return outliers, max(rest) * 1.15


def latency_vs_context(points: list[Point], out: Path, styles) -> Path | None:
    """ITL p50 and TTFT against prompt length, one panel each, linear axes; a series far
    above the rest is drawn at the panel's top edge with its values written beside."""
    quantities = (("itl_ms_p50", "ITL p50 (ms)", "Decode"), ("ttft_ms", "TTFT (ms)", "Prefill"))
    plt = _pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(10, 4), squeeze=False, layout="constrained")
    panels, shown = [], set()
    for ax, (metric, ylabel, phase) in zip(axes[0], quantities, strict=True):
        by_series = defaultdict(list)
        for p in points:
            x, y = p.row.get("workload.prompt_len"), p.row.get(metric)
            if x is not None and y is not None:
                by_series[p.series].append((x, y))
        outliers, top = _clip_outliers(by_series)
        for label, xy in sorted(by_series.items()):
            xs, ys = zip(*sorted(xy), strict=True)
            if label in outliers:
                ax.plot(xs, [top] * len(xs), linestyle=":", **styles[label])
                for x, y in zip(xs, ys, strict=True):
                    ax.annotate(
                        f"{y:,.0f}" if y >= 100 else f"{y:.3g}",
                        (x, top),
                        textcoords="offset points",
                        xytext=(0, -11),
                        ha="center",
                        fontsize=7,
                        color=styles[label]["color"],
                    )
            else:
                ax.plot(xs, ys, linestyle="-", **styles[label])
        if top is not None:
            ax.set_ylim(0, top * 1.02)
            names = ", ".join(sorted(outliers))
            ax.text(
                0.99,
                0.02,
                f"drawn at the top, values written: {names}",
                transform=ax.transAxes,
                ha="right",
                va="bottom",
                fontsize=7,
            )
        else:
            ax.set_ylim(bottom=0)
        ax.set(
            title=f"{phase}: {ylabel} vs prompt length",
            xlabel="prompt length (tokens)",
            ylabel=ylabel,
        )
        ax.grid(alpha=0.3)
        shown |= set(by_series)
        panels.append(_panel_record(ax, list(by_series)) | {"outliers": sorted(outliers)})
    if not shown:
        plt.close(fig)
        return None
    _legend(fig, axes, styles, shown)
    return _save(fig, out / "latency_vs_context.png", panels)


def kv_memory_vs_context(points: list[Point], out: Path, styles) -> Path | None:
    """The KV cache's peak bytes (from its tensors) against prompt length, in MiB/GiB."""
    by_series = defaultdict(list)
    for p in points:
        x, y = p.row.get("workload.prompt_len"), p.row.get("kv_bytes")
        if x is not None and y is not None:
            by_series[p.series].append((x, y))
    if not by_series:
        return None
    size, unit = byte_unit(max(y for xy in by_series.values() for _, y in xy))
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6.5, 4.2), layout="constrained")
    for label, xy in sorted(by_series.items()):
        xs, ys = zip(*sorted(xy), strict=True)
        ax.plot(xs, [y / size for y in ys], linestyle="-", **styles[label])
    ax.set(
        title="KV cache memory vs prompt length",
        xlabel="prompt length (tokens)",
        ylabel=f"KV cache ({unit})",
    )
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
    _legend(fig, [[ax]], styles, set(by_series))
    return _save(fig, out / "kv_memory.png", [_panel_record(ax, list(by_series))])


def pareto_front(
    xy: list[tuple[float, float, str]], higher: bool
) -> list[tuple[float, float, str]]:
    """The points no other point beats on both memory (less) and accuracy, by memory."""
    front, best = [], None
    for x, y, label in sorted(xy, key=lambda p: (p[0], -p[1] if higher else p[1])):
        if best is None or (y > best if higher else y < best):
            front.append((x, y, label))
            best = y
    return front


def pareto_memory_accuracy(points: list[Point], out: Path, styles) -> Path | None:
    """Memory against the first accuracy metric, a panel per prompt length (the longest
    four), the Pareto front drawn and its points named. Memory is the KV cache's, or
    weights + KV where the sweep varies the quantizer. Strategies holding no KV
    (``nocache``) are left out: their cost is time, not memory."""
    rows = [p.row for p in points]
    metrics = accuracy_metrics(rows)
    if not metrics:
        return None
    metric, higher = metrics[0]
    with_weights = len({r.get("quant.name") for r in rows}) > 1

    def memory(r: dict[str, Any]) -> float | None:
        if not r.get("kv_bytes"):
            return None
        if not with_weights:
            return r["kv_bytes"]
        return None if r.get("weight_bytes") is None else r["weight_bytes"] + r["kv_bytes"]

    by_length = defaultdict(list)
    for p in points:
        m, y = memory(p.row), p.row.get(metric)
        if m is not None and y is not None:
            by_length[p.row.get("workload.prompt_len")].append((m, y, p.series))
    lengths = sorted(k for k in by_length if k is not None)[-MAX_PANELS:]
    if not lengths:
        return None
    size, unit = byte_unit(max(m for k in lengths for m, _, _ in by_length[k]))
    what = "weights + KV" if with_weights else "KV cache"
    plt = _pyplot()
    fig, axes = plt.subplots(
        1, len(lengths), figsize=(4.5 * len(lengths), 4), squeeze=False, layout="constrained"
    )
    panels, shown = [], set()
    for ax, length in zip(axes[0], lengths, strict=True):
        xy = [(m / size, y, s) for m, y, s in by_length[length]]
        for x, y, s in xy:
            ax.plot([x], [y], linestyle="none", **styles[s])
        front = pareto_front(xy, higher)
        ax.plot(
            [x for x, _, _ in front],
            [y for _, y, _ in front],
            "k--",
            linewidth=1,
            drawstyle="steps-post",
        )
        for x, y, s in front:
            ax.annotate(s, (x, y), textcoords="offset points", xytext=(4, 4), fontsize=7)
        ax.set(title=f"Pareto front at prompt {length}", xlabel=f"{what} ({unit})", ylabel=metric)
        ax.grid(alpha=0.3)
        series = sorted({s for _, _, s in xy})
        shown |= set(series)
        panels.append(_panel_record(ax, series) | {"front": [s for _, _, s in front]})
    _legend(fig, axes, styles, shown)
    return _save(fig, out / "pareto_memory_accuracy.png", panels)


FIGURES = (
    ("Accuracy vs KV compression", accuracy_vs_compression),
    ("Latency vs context length", latency_vs_context),
    ("KV memory vs context length", kv_memory_vs_context),
    ("Memory vs accuracy: the Pareto front", pareto_memory_accuracy),
)


def draw_all(points: list[Point], out: Path) -> list[tuple[str, Path]]:
    """Every figure the points can fill, as (title, path)."""
    styles = _styles(list({p.series for p in points} | {p.strategy for p in points}))
    drawn = []
    for title, figure in FIGURES:
        path = figure(points, out, styles)
        if path is not None:
            drawn.append((title, path))
    return drawn
