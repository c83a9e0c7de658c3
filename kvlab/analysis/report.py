"""``kvlab report <sweep_dir>``: a Markdown report with tables and PNG plots built from the
``result.json`` files alone, so it works on partial and failed sweeps; the Hydra callback
that prints a sweep's comparison table and writes its report when the sweep ends."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

from hydra.experimental.callback import Callback

from kvlab.analysis.plots import Point, byte_unit, draw_all
from kvlab.tracking import format_float, format_table, load_results, table_columns

NO_KV_NOTE = (
    "Strategies that hold no KV (`nocache`) are left out of the memory plots: their cost is "
    "decode time, in the latency plot."
)


def series_label(row: dict[str, Any], storage: bool = True) -> str:
    """A point's series: its cache strategy and quantizer, each with the options it sets
    away from their defaults (``int4[group_size=64] + rtn[bits=8]``), and with ``storage``
    how the strategy stores K/V (the table's long form; legends take the short one)."""
    from kvlab.cache import registered
    from kvlab.quant import registered_quantizers

    label = _with_options(row, "cache", registered(), storage)
    quant = row.get("quant.name") or "none"
    return (
        label
        if quant == "none"
        else f"{label} + {_with_options(row, 'quant', registered_quantizers(), False)}"
    )


def _with_options(row: dict[str, Any], group: str, known: dict[str, Any], storage: bool) -> str:
    name, prefix = row.get(f"{group}.name"), f"{group}.options."
    options = {k.removeprefix(prefix): v for k, v in row.items() if k.startswith(prefix)}
    entry = known.get(name)
    options_type = getattr(entry, "Options", None) or getattr(entry, "options", None)
    defaults = _field_defaults(options_type) if options_type else {}
    changed = {k: v for k, v in sorted(options.items()) if defaults.get(k, object()) != v}
    label = f"{name}" + (f"[{','.join(f'{k}={v}' for k, v in changed.items())}]" if changed else "")
    return label + (_storage(entry, options) if storage else "")


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


def markdown_table(rows: list[dict[str, Any]], columns: tuple[str, ...]) -> str:
    """The table, byte columns in MiB/GiB, each point's strategy described in full."""
    shown = [c for c in columns if any(r.get(c) is not None for r in rows)]
    lines = ["| strategy | " + " | ".join(shown) + " |", "|" + "---|" * (len(shown) + 1)]
    for row in rows:
        cells = [_describe(row)] + [_cell(c, row.get(c)) for c in shown]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _strategy(row: dict[str, Any]) -> str:
    quant = row.get("quant.name") or "none"
    return row.get("cache.name", "?") + ("" if quant == "none" else f" + {quant}")


def _describe(row: dict[str, Any]) -> str:
    return series_label(row) if row.get("cache.name") else "-"


def _cell(column: str, value: Any) -> str:
    if value is None:
        return "-"
    if column.endswith("_bytes") and isinstance(value, int | float) and value >= 1024:
        size, unit = byte_unit(value)
        return f"{value / size:.3g} {unit}"
    return format_float(value) if isinstance(value, float) else str(value)


def write_report(sweep_dir: str | Path, out_dir: str | Path | None = None) -> Path:
    """Write ``report.md`` and its plots (into ``out_dir``, default the sweep directory)."""
    sweep_dir = Path(sweep_dir)
    out = Path(out_dir) if out_dir else sweep_dir
    out.mkdir(parents=True, exist_ok=True)
    rows = load_results(sweep_dir)
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
    points = [Point(series_label(r, storage=False), _strategy(r), r) for r in ok]
    for title, path in draw_all(points, out):
        parts += [f"## {title}", "", f"![{title}]({path.name})", ""]
    if any(r.get("kv_bytes") == 0 for r in ok):
        parts += [NO_KV_NOTE, ""]
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
