"""The ``kvlab`` command: a Hydra app, one job per point of a study.

kvlab model=smollm2-135m cache=full workload.prompt_len=512 workload.new_tokens=64
kvlab -m cache=full,nocache workload.prompt_len=256,1024
kvlab report SWEEP_DIR
kvlab memory llama-2-13b --context 4096 --budget-gib 80
kvlab diagnose workload.prompt_len=2048 cache=int4
kvlab lm-eval --model kvlab --model_args model=smollm2-135m,cache=int4 --tasks hellaswag_local
kvlab serve --port 8000 cache=paged workload.serving.kv_budget_gib=1
"""

from __future__ import annotations

import sys
from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig, OmegaConf

from kvlab.config import RunConfig, to_run_config
from kvlab.paths import CONF_DIR


@hydra.main(version_base="1.3", config_path=CONF_DIR, config_name="config")
def _app(cfg: DictConfig) -> None:
    from kvlab.run import run_point
    from kvlab.tracking import summary_line, write_record

    hydra_cfg = HydraConfig.get()
    out_dir = Path(hydra_cfg.runtime.output_dir)
    try:
        run_cfg: RunConfig = to_run_config(cfg)  # runs every __post_init__ check
    except ValueError as exc:  # a bad point: recorded, and a sweep goes on to the next one
        config = OmegaConf.to_container(cfg, resolve=True)
        record = {"config": config, "status": "failed", "error": f"invalid config: {exc}"}
        write_record(out_dir, record)
        if hydra_cfg.mode != RunMode.MULTIRUN:
            raise SystemExit(f"kvlab: invalid config: {exc}") from None
        print(summary_line(record), flush=True)
        return
    record = run_point(run_cfg, out_dir)
    print(summary_line(record), flush=True)
    if run_cfg.logger.name == "wandb" and not record.get("skipped"):
        from kvlab.wandb_logger import log_record

        multirun = hydra_cfg.mode == RunMode.MULTIRUN
        group = Path(hydra_cfg.sweep.dir).name if multirun else out_dir.name
        study = hydra_cfg.runtime.choices.get("experiment") or ("sweep" if multirun else "run")
        log_record(record, run_cfg.logger, out_dir, group, study)
    if record["status"] != "ok" and hydra_cfg.mode != RunMode.MULTIRUN:
        raise SystemExit(1)  # a single failed run fails the command; its record has the traceback


def report_main(args: list[str]) -> None:
    """``kvlab report SWEEP_DIR [OUT_DIR]``: Markdown report + plots from result files."""
    from kvlab.analysis.report import write_report
    from kvlab.tracking import format_table, load_results

    if not args or args[0] in ("-h", "--help"):
        raise SystemExit("usage: kvlab report SWEEP_DIR [OUT_DIR]")
    if not Path(args[0]).is_dir():
        raise SystemExit(f"kvlab report: {args[0]!r} is not a directory")
    path = write_report(args[0], args[1] if len(args) > 1 else None)
    print(format_table(load_results(args[0])))
    print(f"\nreport: {path} (plots beside it)")


def lm_eval_main(args: list[str]) -> None:
    """``kvlab lm-eval ARGS``: lm-eval's own CLI with the ``kvlab`` model registered and
    kvlab's local-data task folder added to ``--include_path``."""
    from lm_eval.__main__ import cli_evaluate

    import kvlab.lm_eval_model  # noqa: F401  (registers --model kvlab)
    from kvlab.eval.harness import TASKS_DIR

    if "--include_path" in args:
        at = args.index("--include_path") + 1
        args[at] = f"{args[at]}:{TASKS_DIR}"
    else:
        args += ["--include_path", str(TASKS_DIR)]
    sys.argv = ["lm-eval", *args]
    cli_evaluate()


def memory_main(args: list[str]) -> None:
    """``kvlab memory MODEL [--context N] [--batch B] [--cache a,b] [--quant a,b] ...``:
    weight and KV bytes from the model's config alone (no weights are read)."""
    import argparse

    import torch

    from kvlab.analysis.memory import memory_rows, reference_configs
    from kvlab.cache import registered
    from kvlab.quant import registered_quantizers
    from kvlab.tracking import format_table

    parser = argparse.ArgumentParser(prog="kvlab memory", description=memory_main.__doc__)
    names = ", ".join(reference_configs())
    parser.add_argument("model", help=f"{names}, a config.json, a checkpoint dir or a hub id")
    parser.add_argument("--context", type=int, default=4096)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--cache", default=",".join(sorted(registered())))
    parser.add_argument("--quant", default=",".join(sorted(registered_quantizers())))
    parser.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16", "float16"])
    parser.add_argument(
        "--budget-gib", type=float, default=None, help="memory budget for max_batch"
    )
    a = parser.parse_args(args)
    caches = [c for c in a.cache.split(",") if c]
    weights, kv = memory_rows(
        a.model,
        a.context,
        a.batch,
        caches,
        a.quant.split(","),
        getattr(torch, a.dtype),
        a.budget_gib,
    )
    print(f"{a.model}: weights ({a.dtype} where unquantized)")
    print(format_table(weights, ["quant", "weight_bytes", "weight_gib", "note"]))
    print(f"\nKV cache at context={a.context}, batch={a.batch} ({a.dtype})")
    print(format_table(kv, list(kv[0])))


def diagnose_main(args: list[str]) -> None:
    """``kvlab diagnose [overrides]``: one measured run explained phase by phase."""
    from kvlab.analysis.diagnose import diagnose

    print(diagnose(args))


def wandb_view_main(args: list[str]) -> None:
    """``kvlab wandb-view --entity ENTITY [--project kvlab]``: save kvlab's comparison view
    (runs grouped by cache and quant; ITL, TTFT, perplexity and passkey panels) into a W&B
    project, after ``wandb login`` and ``wandb sync`` of an offline sweep."""
    import argparse

    from kvlab.wandb_view import save_view

    parser = argparse.ArgumentParser(prog="kvlab wandb-view", description=wandb_view_main.__doc__)
    parser.add_argument("--entity", required=True, help="your W&B user or team")
    parser.add_argument("--project", default="kvlab")
    a = parser.parse_args(args)
    print(f"saved view: {save_view(a.entity, a.project)}")


def serve_main(args: list[str]) -> None:
    """``kvlab serve [--port P] [overrides]``: an OpenAI-compatible server over the run."""
    from kvlab.serving.serve import serve_main as serve

    serve(args)


SUBCOMMANDS = {
    "serve": serve_main,
    "report": report_main,
    "wandb-view": wandb_view_main,
    "lm-eval": lm_eval_main,
    "memory": memory_main,
    "diagnose": diagnose_main,
}


def main() -> None:
    from kvlab.quiet import quiet_third_party

    quiet_third_party()
    if len(sys.argv) > 1 and sys.argv[1] in SUBCOMMANDS:
        SUBCOMMANDS[sys.argv[1]](sys.argv[2:])
        return
    _app()


if __name__ == "__main__":
    main()
