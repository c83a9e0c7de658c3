"""The ``kvlab`` command: a Hydra app, one job per point of a study.

kvlab model=smollm2-135m cache=full workload.prompt_len=512 workload.new_tokens=64
kvlab -m cache=full,nocache workload.prompt_len=256,1024
"""

from __future__ import annotations

import os
from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig, OmegaConf

from kvlab.config import RunConfig, register_configs

CONF_DIR = os.environ.get("KVLAB_CONF", str(Path(__file__).resolve().parents[1] / "conf"))

register_configs()


@hydra.main(version_base="1.3", config_path=CONF_DIR, config_name="config")
def _app(cfg: DictConfig) -> None:
    from kvlab.run import run_point
    from kvlab.tracking import summary_line, write_record

    hydra_cfg = HydraConfig.get()
    out_dir = Path(hydra_cfg.runtime.output_dir)
    try:
        run_cfg: RunConfig = OmegaConf.to_object(cfg)  # runs every __post_init__ check
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
    if record["status"] != "ok" and hydra_cfg.mode != RunMode.MULTIRUN:
        raise SystemExit(1)  # a single failed run fails the command; its record has the traceback


def main() -> None:
    _app()


if __name__ == "__main__":
    main()
