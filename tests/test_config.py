"""Every file under conf/ composes into a valid run config; bad values fail early with a
message naming the field, the value and what is allowed."""

from __future__ import annotations

from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir

from kvlab.cli import CONF_DIR
from kvlab.config import (
    CacheConfig,
    ModelConfig,
    RunConfig,
    WorkloadConfig,
    check_context,
    to_run_config,
)

GROUPS = sorted(
    (group.name, option.stem)
    for group in Path(CONF_DIR).iterdir()
    if group.is_dir() and group.name != "hydra"
    for option in group.glob("*.yaml")
)


@pytest.mark.parametrize(("group", "option"), GROUPS)
def test_every_config_file_composes(group, option):
    prefix = "+" if group == "experiment" else ""  # experiments are not in the defaults
    overrides = [f"{prefix}{group}={option}"]
    with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
        cfg = compose(config_name="config", overrides=overrides)
        if group == "experiment":  # an experiment defines its grid
            full = compose(config_name="config", overrides=overrides, return_hydra_config=True)
            assert full.hydra.sweeper.params
    assert isinstance(to_run_config(cfg), RunConfig)


@pytest.mark.parametrize(
    ("build", "message"),
    [
        (lambda: WorkloadConfig(prompt_len=-1), r"workload.prompt_len=-1 .*>= 1"),
        (lambda: WorkloadConfig(new_tokens=0), r"workload.new_tokens=0"),
        (lambda: WorkloadConfig(top_p=1.5), r"workload.top_p=1.5"),
        (lambda: CacheConfig(name="bogus"), r"cache.name='bogus' .*full.*nocache"),
        (lambda: ModelConfig(dtype="int3"), r"model.dtype='int3' .*float32"),
        (lambda: RunConfig(threads=-2), r"threads=-2"),
    ],
)
def test_bad_values_name_field_value_and_allowed(build, message):
    with pytest.raises(ValueError, match=message):
        build()


def test_prompt_longer_than_context_fails_before_loading():
    cfg = RunConfig(workload=WorkloadConfig(prompt_len=8000, new_tokens=500))
    with pytest.raises(ValueError, match=r"8500 exceeds the context .*<= 8192"):
        check_context(cfg)


LAUNCHERS = sorted(p.stem for p in (Path(CONF_DIR) / "hydra" / "launcher").glob("*.yaml"))


@pytest.mark.parametrize("launcher", LAUNCHERS)
def test_every_launcher_config_composes(launcher):
    with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
        cfg = compose(
            config_name="config", overrides=[f"hydra/launcher={launcher}"], return_hydra_config=True
        )
    assert "launcher" in cfg.hydra.launcher._target_.lower()


def test_cache_positions_may_run_past_the_context():
    streaming = CacheConfig(name="sliding", options=dict(window=1024, positions="cache"))
    check_context(
        RunConfig(cache=streaming, workload=WorkloadConfig(prompt_len=8000, new_tokens=500))
    )
    original = CacheConfig(name="sliding", options=dict(window=1024))
    with pytest.raises(ValueError, match="exceeds the context"):
        check_context(
            RunConfig(cache=original, workload=WorkloadConfig(prompt_len=8000, new_tokens=500))
        )


def test_composed_overrides_reach_the_run():
    with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
        cfg = compose(
            config_name="config",
            overrides=["cache=nocache", "workload.prompt_len=256", "threads=1"],
        )
    run = to_run_config(cfg)
    assert (run.cache.name, run.workload.prompt_len, run.threads) == ("nocache", 256, 1)
