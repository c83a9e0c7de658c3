"""kvlab sweeps on a real SLURM cluster: a one-node cluster on this machine
(``scripts/slurm_local.sh``: Debian's slurm-wlm and munge, no accounting database) runs
sweeps through Hydra's submitit launcher (``hydra/launcher=slurm_cpu``). Each point runs
on the CPUs its task was given; a point that SLURM preempts (USR2) is requeued and
finishes; a point killed outright is re-run by the same sweep with ``resume=true``, which
leaves finished points alone. Skips, with the script's reason, where SLURM cannot
be installed."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "slurm_local.sh"
UNAVAILABLE = 3  # the script's exit status where SLURM cannot be had here

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def slurm():
    if shutil.which("bash") is None:
        pytest.skip("no bash to run scripts/slurm_local.sh")
    running = subprocess.run(["pgrep", "-x", "slurmctld"], capture_output=True).returncode == 0
    started = subprocess.run(
        ["bash", str(SCRIPT), "start"], capture_output=True, text=True, timeout=900
    )
    if started.returncode == UNAVAILABLE:
        pytest.skip(started.stderr.strip())
    assert started.returncode == 0, started.stderr
    yield
    if not running:  # leave a cluster that was up before as it was
        subprocess.run(["bash", str(SCRIPT), "stop"], capture_output=True, timeout=60)


def sweep(sweep_dir: Path, *overrides: str) -> list[str]:
    return [
        sys.executable, "-m", "kvlab.cli", "-m", "hydra/launcher=slurm_cpu",
        "hydra.launcher.partition=debug", "hydra.launcher.cpus_per_task=1",
        "hydra.launcher.mem_gb=4", f"hydra.sweep.dir={sweep_dir}", "workload.prompt_len=64",
        *overrides,
    ]  # fmt: skip


def records(sweep_dir: Path) -> dict[str, dict]:
    return {
        path.parent.name: json.loads(path.read_text())
        for path in sorted(sweep_dir.glob("*/result.json"))
    }


def array_tasks() -> dict[str, str]:
    """Task id (``JOB_INDEX``) → state of every job in the queue."""
    out = subprocess.run(["squeue", "-h", "-o", "%i %T"], capture_output=True, text=True)
    return dict(line.split() for line in out.stdout.splitlines() if line.strip())


def wait_for(condition, timeout: float, what: str):
    deadline = time.time() + timeout
    while time.time() < deadline:
        value = condition()
        if value:
            return value
        time.sleep(1)
    raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")


def running_task(index: int) -> str | None:
    return next(
        (task for task, state in array_tasks().items()
         if task.endswith(f"_{index}") and state == "RUNNING"),
        None,
    )  # fmt: skip


def test_a_two_point_sweep_runs_each_point_on_the_cpus_it_was_given(slurm, tmp_path):
    done = subprocess.run(
        sweep(tmp_path, "cache=full,int4", "workload.new_tokens=4"),
        capture_output=True, text=True, timeout=900, cwd=ROOT,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    found = records(tmp_path)
    assert len(found) == 2, found.keys()
    for record in found.values():
        assert record["status"] == "ok", record.get("error")
        assert record["environment"]["threads"] == 1
        assert record["environment"]["threads_source"] == "SLURM_CPUS_PER_TASK"
    assert {r["config"]["cache"]["name"] for r in found.values()} == {"full", "int4"}
    assert "kvlab sweep: 2 points" in done.stdout
    assert done.stderr.count("Bypassing sacct error") <= 1  # said once, not at every poll


def test_a_preempted_point_is_requeued_and_finishes(slurm, tmp_path):
    launcher = subprocess.Popen(
        sweep(tmp_path, "workload.new_tokens=4,200"), cwd=ROOT,
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        task = wait_for(lambda: running_task(1), 300, "the long point to run")
        time.sleep(8)  # into its run: the model is loading or decoding
        subprocess.run(["scancel", "--signal=USR2", task], check=True)
        out, err = launcher.communicate(timeout=600)
    finally:
        launcher.kill()
    assert launcher.returncode == 0, err[-3000:]
    found = records(tmp_path)
    assert [r["status"] for r in found.values()] == ["ok", "ok"]
    task_logs = lambda kind: "".join(  # noqa: E731
        path.read_text() for path in tmp_path.glob(f".submitit/*_1/*_log.{kind}")
    )
    assert "Caught signal SIGUSR2" in task_logs("err") and "JOB REQUEUE" in task_logs("err")
    assert "Job completed successfully" in task_logs("out")


def test_a_killed_point_is_rerun_and_finished_points_are_kept(slurm, tmp_path):
    command = sweep(tmp_path, "workload.new_tokens=4,1000", "resume=true")  # ~1 min
    launcher = subprocess.Popen(
        command, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        start_new_session=True,
    )  # fmt: skip
    try:
        short = wait_for(lambda: records(tmp_path) or None, 300, "the short point's result")
        task = wait_for(lambda: running_task(1), 300, "the long point to run")
        subprocess.run(["scancel", task], check=True)  # TERM (submitit ignores it), then KILL
        wait_for(lambda: task not in array_tasks(), 120, "the killed task to leave")
        try:  # without accounting, submitit cannot learn the task ended: stop the sweep
            launcher.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(launcher.pid, signal.SIGTERM)
            launcher.wait(timeout=30)
    finally:
        if launcher.poll() is None:
            os.killpg(launcher.pid, signal.SIGKILL)
    (name,) = short
    kept = (tmp_path / name / "result.json").read_bytes()
    assert len(records(tmp_path)) == 1  # the killed point wrote nothing
    again = subprocess.run(command, capture_output=True, text=True, timeout=900, cwd=ROOT)
    assert again.returncode == 0, again.stderr[-3000:]
    found = records(tmp_path)
    assert [r["status"] for r in found.values()] == ["ok", "ok"]
    assert (tmp_path / name / "result.json").read_bytes() == kept  # not run again
