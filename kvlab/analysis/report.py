"""``kvlab report <sweep_dir>``: a Markdown report with tables and PNG plots built from the
``result.json`` files alone, so it works on partial and failed sweeps; the Hydra callback
that prints a sweep's comparison table and writes its report when the sweep ends."""

from __future__ import annotations

import dataclasses
from collections import defaultdict
from pathlib import Path
from typing import Any

from hydra.experimental.callback import Callback

from kvlab.tracking import format_float, format_table, load_results, table_columns

PLOTS = (
    # (file, title, x column, y column, x label, y label)
    (
        "itl_vs_context.png",
        "Decode: ITL vs prompt length",
        "workload.prompt_len",
        "itl_ms_p50",
        "prompt length (tokens)",
        "ITL p50 (ms)",
    ),
    (
        "ttft_vs_prompt.png",
        "Prefill: TTFT vs prompt length",
        "workload.prompt_len",
        "ttft_ms",
        "prompt length (tokens)",
        "TTFT (ms)",
    ),
    (
        "kv_bytes.png",
        "KV bytes vs prompt length",
        "workload.prompt_len",
        "kv_bytes",
        "prompt length (tokens)",
        "KV bytes",
    ),
    (
        "pareto_memory_accuracy.png",
        "Memory vs accuracy",
        "kv_bytes",
        "wikitext2/ppl",
        "KV bytes",
        "WikiText-2 perplexity",
    ),
    (
        "pareto_total_memory_accuracy.png",
        "Weights + KV vs accuracy",
        "total_bytes",
        "wikitext2/ppl",
        "weight + KV bytes",
        "WikiText-2 perplexity",
    ),
)


def series_label(row: dict[str, Any]) -> str:
    """A point's series: its cache strategy and quantizer, each with the options it sets
    away from their defaults (``int4[group_size=64] + rtn[bits=8]``)."""
    from kvlab.cache import registered
    from kvlab.quant import registered_quantizers

    label = _with_options(row, "cache", registered())
    quant = row.get("quant.name") or "none"
    return (
        label
        if quant == "none"
        else f"{label} + {_with_options(row, 'quant', registered_quantizers())}"
    )


def _with_options(row: dict[str, Any], group: str, known: dict[str, Any]) -> str:
    name, prefix = row.get(f"{group}.name"), f"{group}.options."
    options = {k.removeprefix(prefix): v for k, v in row.items() if k.startswith(prefix)}
    entry = known.get(name)
    options_type = getattr(entry, "Options", None) or getattr(entry, "options", None)
    defaults = _field_defaults(options_type) if options_type else {}
    changed = {k: v for k, v in sorted(options.items()) if defaults.get(k, object()) != v}
    label = f"{name}" + (f"[{','.join(f'{k}={v}' for k, v in changed.items())}]" if changed else "")
    return label + _storage(entry, options)


def _storage(entry: Any, options: dict[str, Any]) -> str:
    """ " (KIVI int4: keys per channel, ...)" for strategies whose storage is quantized."""
    describe = getattr(entry, "describe", None)
    if describe is None:
        return ""
    try:
        from kvlab.cache.base import cache_options

        text = describe(cache_options(entry.name, _nested(options)))
    except (ValueError, TypeError):
        return ""
    return f" ({text})" if text else ""


def _nested(flat: dict[str, Any]) -> dict[str, Any]:
    """Result rows flatten nested options with dots; options dataclasses take them nested."""
    out: dict[str, Any] = {}
    for key, value in flat.items():
        head, _, rest = key.partition(".")
        if rest:
            out.setdefault(head, {})[rest] = value
        else:
            out[key] = value
    return out


def _field_defaults(options_type: type) -> dict[str, Any]:
    """Declared defaults (before ``__post_init__`` fills them: rtn's group_size stays None);
    nested option dicts flattened with dots, as result rows are."""
    out = {}
    for f in dataclasses.fields(options_type):
        if f.default is not dataclasses.MISSING:
            out[f.name] = f.default
        elif f.default_factory is not dataclasses.MISSING:
            out[f.name] = f.default_factory()
        if isinstance(out.get(f.name), dict):
            out |= {f"{f.name}.{k}": v for k, v in out.pop(f.name).items()}
    return out


def plot(rows: list[dict[str, Any]], spec: tuple, out_dir: Path) -> Path | None:
    """One line (or scatter) per series; None when no row has both columns."""
    name, title, x, y, xlabel, ylabel = spec
    points = defaultdict(list)
    for row in rows:
        if row.get("status") == "ok" and row.get(x) is not None and row.get(y) is not None:
            points[series_label(row)].append((row[x], row[y]))
    if not points:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    scatter = x == "kv_bytes"  # a Pareto view: points, not curves
    colors, markers = plt.get_cmap("tab10").colors, "os^Dv"  # 50 distinct series
    for i, (label, xy) in enumerate(sorted(points.items())):
        xs, ys = zip(*sorted(xy), strict=True)
        style = dict(color=colors[i % 10], marker=markers[i // 10 % len(markers)])
        ax.plot(xs, ys, linestyle="none" if scatter else "-", label=label, **style)
    values = [v for xy in points.values() for _, v in xy if v > 0]
    if values and max(values) / min(values) > 20:
        ax.set_yscale("log")  # e.g. no-cache ITL next to cached ITL
    ax.set(title=title, xlabel=xlabel, ylabel=ylabel)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    path = out_dir / name
    fig.savefig(path, dpi=100, bbox_inches="tight")
    plt.close(fig)
    return path


def markdown_table(rows: list[dict[str, Any]], columns: tuple[str, ...]) -> str:
    shown = [c for c in columns if any(r.get(c) is not None for r in rows)]
    lines = ["| " + " | ".join(shown) + " |", "|" + "---|" * len(shown)]
    for row in rows:
        cells = [_cell(row.get(c)) for c in shown]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _cell(value: Any) -> str:
    if value is None:
        return "-"
    return format_float(value) if isinstance(value, float) else str(value)


def write_report(sweep_dir: str | Path, out_dir: str | Path | None = None) -> Path:
    """Write ``report.md`` and its plots (into ``out_dir``, default the sweep directory)."""
    sweep_dir = Path(sweep_dir)
    out = Path(out_dir) if out_dir else sweep_dir
    out.mkdir(parents=True, exist_ok=True)
    rows = load_results(sweep_dir)
    for row in rows:  # the memory a point needs: its weights and its peak KV
        if row.get("weight_bytes") is not None and row.get("kv_bytes") is not None:
            row["total_bytes"] = row["weight_bytes"] + row["kv_bytes"]
    ok = [r for r in rows if r.get("status") == "ok"]
    failed = [r for r in rows if r.get("status") != "ok"]
    parts = [
        f"# kvlab report: {sweep_dir}",
        "",
        f"{len(rows)} points: {len(ok)} ok, {len(failed)} failed.",
        "",
        markdown_table(rows, table_columns(rows)),
        "",
    ]
    for spec in PLOTS:
        path = plot(ok, spec, out)
        if path is not None:
            parts += [f"## {spec[1]}", "", f"![{spec[1]}]({path.name})", ""]
    if failed:
        parts += ["## Failed points", ""]
        parts += [f"- `{Path(r['path']).name}`: {r.get('error')}" for r in failed]
    report = out / "report.md"
    report.write_text("\n".join(parts) + "\n")
    return report


def results_frame(sweep_dir: str | Path):
    """The sweep's results as one pandas DataFrame (a row per point, dotted config keys)."""
    import pandas as pd

    return pd.DataFrame(load_results(sweep_dir))


class SweepTableCallback(Callback):
    """When a ``-m`` sweep ends: print its comparison table, write its report with plots."""

    def on_multirun_end(self, config: Any, **kwargs: Any) -> None:
        sweep_dir = Path(config.hydra.sweep.dir)
        rows = load_results(sweep_dir)
        if rows:
            table = format_table(rows, table_columns(rows))
            print(f"\nkvlab sweep: {len(rows)} points in {sweep_dir}\n{table}")
            print(f"\nreport: {write_report(sweep_dir)} (plots beside it)")
