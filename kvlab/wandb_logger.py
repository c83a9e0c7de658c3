"""W&B logging of one result record: a run per sweep point, grouped by sweep, ``job_type``
the study, tags for the cache strategy, the flattened config, summary metrics named as in
DESIGN.md, per-token ITL and the long-context cells as tables, and the run's plots."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from kvlab.config import LoggerConfig
from kvlab.tracking import flatten


def log_record(
    record: dict[str, Any], cfg: LoggerConfig, out_dir: Path, group: str, job_type: str
) -> None:
    """Log ``record`` as one W&B run written under ``out_dir`` (offline unless asked)."""
    try:
        import wandb
    except ImportError as exc:
        raise ImportError("logger=wandb needs wandb: pip install -e '.[wandb]'") from exc
    row = flatten(record)
    metrics = record.get("metrics", {})
    tags = [
        f"cache={row.get('cache.name')}",
        f"quant={row.get('quant.name', 'none')}",
        f"status={record.get('status')}",
    ]
    config = {k: v for k, v in row.items() if "." in k}
    run = wandb.init(
        project=cfg.project,
        entity=cfg.entity,
        mode=cfg.mode,
        dir=str(out_dir),
        group=group,
        job_type=job_type,
        name=out_dir.name,
        tags=tags,
        config=config,
        reinit="finish_previous",
    )
    run.summary.update(
        _scalars(metrics) | {"status": record.get("status"), "error": record.get("error")}
    )
    tables = _tables(wandb, metrics)
    images = {p.stem: wandb.Image(str(p)) for p in sorted(out_dir.glob("*.png"))}
    if tables or images:
        run.log(tables | images)
    run.finish()


def _scalars(metrics: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in metrics.items() if isinstance(v, int | float | str)}


def _tables(wandb: Any, metrics: dict[str, Any]) -> dict[str, Any]:
    tables = {}
    if metrics.get("itl_ms"):
        rows = [[step, ms] for step, ms in enumerate(metrics["itl_ms"], start=1)]
        tables["itl_ms"] = wandb.Table(columns=["decode_step", "itl_ms"], data=rows)
    cells = [_cell(k, v) for k, v in metrics.items() if "/acc@" in k and "/depth" in k]
    if cells:
        tables["longctx"] = wandb.Table(columns=["task", "length", "depth", "acc"], data=cells)
    return tables


def _cell(key: str, value: float) -> list:
    """``passkey/acc@4096/depth0.5`` → [passkey, 4096, 0.5, value]."""
    task, length, depth = key.split("/")
    return [task, int(length.removeprefix("acc@")), float(depth.removeprefix("depth")), value]
