"""Result records: one ``result.json`` per run (config, environment, metrics, status), the
table of a sweep directory, and the Hydra callback that prints it when a sweep ends."""

from __future__ import annotations

import dataclasses
import json
import os
import platform
import subprocess
from collections import defaultdict
from collections.abc import Iterable
from importlib import metadata
from pathlib import Path
from typing import Any

import torch

from kvlab.kernels import huge_pages
from kvlab.threads import threads_source

RESULT_FILE = "result.json"
TABLE_COLUMNS = (
    "model.source",
    "cache.name",
    "quant.name",
    "workload.prompt_len",
    "workload.new_tokens",
    "workload.batch_size",
    "status",
    "ttft_ms",
    "itl_ms_p50",
    "itl_ms_p90",
    "decode_tok_s",
    "kv_bytes",
    "kv_bytes_per_token",
    "weight_bytes",
    "wikitext2/ppl",
)

SERVING_COLUMNS = (
    "cache.name",
    "cache.options.kv_bits",
    "quant.name",
    "workload.serving.rate",
    "workload.serving.max_running",
    "status",
    "completed",
    "predicted_max_concurrency",
    "max_concurrency",
    "mean_concurrency",
    "output_throughput",
    "median_ttft_ms",
    "p90_ttft_ms",
    "median_itl_ms",
    "p90_itl_ms",
    "preemptions",
    "prefix_cache_hit_rate",
    "kv_bytes_peak",
)


SPEC_COLUMNS = ("spec.method", "spec/acceptance_rate", "spec/tokens_per_step")
FIDELITY_METRICS = ("/kld", "/top1_agreement", "/delta_nll")


def table_columns(rows: Iterable[dict[str, Any]]) -> tuple[str, ...]:
    """The serving columns for a sweep of serving runs, else the generation columns (with
    the draft's where a point speculates); the cache and quant options that differ between
    points (so each row says which point it is); the fidelity metrics some point has
    (``eval=kld``'s); ``concurrent`` where points ran side by side."""
    rows = list(rows)
    side_by_side = ("concurrent",) if any(r.get("concurrent") for r in rows) else ()
    if any(r.get("workload.kind") == "serving" for r in rows):
        return SERVING_COLUMNS + side_by_side
    columns = TABLE_COLUMNS
    if any(r.get("spec.method", "none") != "none" for r in rows):
        at = TABLE_COLUMNS.index("status")
        columns = TABLE_COLUMNS[:at] + SPEC_COLUMNS + TABLE_COLUMNS[at:]
    at = columns.index("quant.name") + 1
    columns = columns[:at] + varying_options(rows) + columns[at:]
    return columns + fidelity_columns(rows) + side_by_side


def varying_options(rows: list[dict[str, Any]]) -> tuple[str, ...]:
    """``cache.options.*`` / ``quant.options.*`` keys whose values differ between rows of
    the same strategy / quantizer (what else tells two such points apart)."""
    varying = []
    for group in ("cache", "quant"):
        prefix, by_name = f"{group}.options.", defaultdict(list)
        for row in rows:
            by_name[row.get(f"{group}.name")].append(row)
        keys = sorted({k for r in rows for k in r if k.startswith(prefix)})
        varying += [k for k in keys if any(_differ(same, k) for same in by_name.values())]
    return tuple(varying)


def _differ(rows: list[dict[str, Any]], key: str) -> bool:
    return len({json.dumps(r.get(key), default=str, sort_keys=True) for r in rows}) > 1


def fidelity_columns(rows: list[dict[str, Any]]) -> tuple[str, ...]:
    """The KL-divergence eval's headline metrics, where some row has them."""
    keys = sorted({k for r in rows for k in r if k.endswith(FIDELITY_METRICS)})
    return tuple(keys)


def config_dict(cfg: Any) -> dict[str, Any]:
    """A run config as plain JSON-able data."""
    return json.loads(json.dumps(dataclasses.asdict(cfg), default=str))


def environment() -> dict[str, Any]:
    """What the numbers depend on: versions, device, threads, CPU model, kvlab commit."""
    env = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": _version("transformers"),
        "kvlab": _version("kvlab"),
        "kvlab_commit": _git_commit(),
        "threads": torch.get_num_threads(),
        "threads_source": threads_source(),  # threads=, OMP_NUM_THREADS, SLURM, affinity
        "cpu": cpu_model(),
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),  # AVX2, AVX512, ...
        "cpu_kernels": _cpu_kernels(),
        "transparent_huge_pages": huge_pages.mode(),  # the OS's; kvlab advises its own maps
        "cpu_count": os.cpu_count(),
        "cuda": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
        "hostname": platform.node(),
    }
    return env


def _cpu_kernels() -> dict[str, Any]:
    """What this machine's kernels can do, probed (no timing; the run's kernel plan, which
    kernels it chose from this, is in its metrics: ``engine/kernel_plan``): the plan's
    capability (:func:`kvlab.kernels.plan.capability`), the decode attention, and whether
    torch's int8 matmul is exact here (W8A8's prefill takes it only then,
    :func:`kvlab.kernels.linear.w8a8.int8_matmul_exact`)."""
    from kvlab.kernels import kernel_available
    from kvlab.kernels.linear.w8a8 import int8_matmul_exact
    from kvlab.kernels.plan import capability

    return {
        "capability": capability(),
        "attention": "kvlab C decode attention" if kernel_available() else "torch",
        "torch_int8_matmul_exact": int8_matmul_exact("cpu"),
    }


def _version(package: str) -> str | None:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return None


def _git_commit() -> str | None:
    root = Path(__file__).resolve().parents[1]
    try:
        out = subprocess.run(
            ["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True, text=True, timeout=5
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout.strip() or None


def cpu_model() -> str:
    """The CPU's model name, as a benchmark's header states it."""
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.exists():
        for line in cpuinfo.read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor()


def write_record(out_dir: Path, record: dict[str, Any]) -> Path:
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / RESULT_FILE
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(record, indent=2, default=str))
    tmp.replace(path)  # never a half-written result
    return path


def read_record(out_dir: Path) -> dict[str, Any] | None:
    path = out_dir / RESULT_FILE
    return json.loads(path.read_text()) if path.exists() else None


def flatten(record: dict[str, Any]) -> dict[str, Any]:
    """One flat row: dotted config keys, status, error and metrics."""
    row: dict[str, Any] = {}

    def walk(prefix: str, node: Any) -> None:
        if isinstance(node, dict):
            for key, value in node.items():
                walk(f"{prefix}.{key}" if prefix else key, value)
        else:
            row[prefix] = node

    walk("", record.get("config", {}))
    row["status"] = record.get("status")
    row["error"] = record.get("error")
    row["host"] = record.get("environment", {}).get("hostname")
    row["started_at"], row["ended_at"] = record.get("started_at"), record.get("ended_at")
    row.update(record.get("metrics", {}))
    return row


def mark_side_by_side(rows: list[dict[str, Any]]) -> None:
    """``concurrent``: how many other points of the sweep ran on the same host while this
    one did (a joblib sweep, a SLURM array on one node): their timings were taken side by
    side, sharing cores and memory bandwidth, not alone (0: alone)."""
    for row in rows:
        if row.get("started_at") is None:
            continue
        row["concurrent"] = sum(
            other is not row
            and other.get("host") == row.get("host")
            and other.get("started_at") is not None
            and other["started_at"] < row["ended_at"]
            and row["started_at"] < other["ended_at"]
            for other in rows
        )


def load_results(sweep_dir: str | Path) -> list[dict[str, Any]]:
    """Every result under ``sweep_dir`` as flat rows, in job order (Hydra's ``N_...``
    sub-directories sorted by N, not as strings)."""
    paths = sorted(Path(sweep_dir).rglob(RESULT_FILE), key=_job_order)
    rows = [flatten(json.loads(p.read_text())) | {"path": str(p.parent)} for p in paths]
    mark_side_by_side(rows)
    return rows


def _job_order(path: Path) -> tuple:
    number, _, rest = path.parent.name.partition("_")
    return (str(path.parent.parent), int(number) if number.isdigit() else -1, rest)


def format_table(rows: Iterable[dict[str, Any]], columns: Iterable[str] = TABLE_COLUMNS) -> str:
    """A fixed-width text table of ``columns`` (short names in the header)."""
    columns = list(columns)
    header = [_short_name(c) for c in columns]
    body = [[_cell(row.get(c)) for c in columns] for row in rows]
    widths = [max(len(h), *(len(r[i]) for r in body)) for i, h in enumerate(header)]
    lines = ["  ".join(h.rjust(w) for h, w in zip(header, widths, strict=True))]
    lines += ["  ".join(c.rjust(w) for c, w in zip(r, widths, strict=True)) for r in body]
    return "\n".join(lines)


def _short_name(column: str) -> str:
    """``cache.name`` → ``cache``, ``model.source`` → ``model``, ``workload.x`` → ``x``."""
    group, _, leaf = column.rpartition(".")
    return group if leaf in ("name", "source", "method") else leaf.replace("wikitext2/", "wt2_")


def _cell(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return format_float(value)
    return str(value)


def format_float(value: float) -> str:
    """Two decimals, or three significant digits where that would show nothing (a KL
    divergence of 0.0035 nats, a ΔNLL of -0.0012)."""
    return f"{value:.2f}" if value == 0 or abs(value) >= 0.1 else f"{value:.3g}"


def summary_line(record: dict[str, Any]) -> str:
    """One line per run: the point and its headline numbers (or its error)."""
    row = flatten(record)
    point = (
        f"model={row.get('model.source')} cache={row.get('cache.name')} "
        f"quant={row.get('quant.name', 'none')} "
        f"prompt_len={row.get('workload.prompt_len')} new_tokens={row.get('workload.new_tokens')}"
    )
    if row["status"] != "ok":
        return f"[kvlab] {point} FAILED: {row['error']}"
    skipped = " (already done, skipped)" if record.get("skipped") else ""
    if row.get("workload.kind") == "serving":
        return (
            f"[kvlab] cache={row.get('cache.name')} rate={row.get('workload.serving.rate')} "
            f"max_concurrency={row['max_concurrency']} output_tok_s="
            f"{row['output_throughput']:.1f} median_ttft_ms={row['median_ttft_ms']:.0f} "
            f"median_itl_ms={row['median_itl_ms']:.1f} preemptions={row['preemptions']}{skipped}"
        )
    return (
        f"[kvlab] {point} ttft_ms={row['ttft_ms']:.1f} itl_ms_p50={row['itl_ms_p50']:.2f} "
        f"decode_tok_s={row['decode_tok_s']:.1f} kv_bytes={row['kv_bytes']}{skipped}"
    )
