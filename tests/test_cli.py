"""End to end: the ``kvlab`` command writes complete result records, single and swept; a
failing point is recorded and the sweep goes on; a finished point is not run twice."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from kvlab.tracking import load_results

METRICS = (
    "ttft_ms",
    "itl_ms_p50",
    "itl_ms_p90",
    "itl_ms_mean",
    "decode_tok_s",
    "prefill_tok_s",
    "kv_bytes",
    "kv_bytes_per_token",
    "weight_bytes",
    "peak_rss_bytes",
)
TINY = ["workload.prompt_len=16", "workload.new_tokens=4"]


def kvlab(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "kvlab.cli", *args]
    return subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=600)


@pytest.mark.slow
def test_single_run_writes_a_complete_record(tmp_path):
    out = tmp_path / "run"
    done = kvlab("cache=full", *TINY, f"hydra.run.dir={out}", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    record = json.loads((out / "result.json").read_text())
    assert record["status"] == "ok"
    assert set(METRICS) <= set(record["metrics"])
    assert record["metrics"]["prompt_tokens"] == 16 and record["metrics"]["new_tokens"] == 4
    assert (record["metrics"]["device"], record["metrics"]["dtype"]) == ("cpu", "float32")
    assert record["config"]["engine"] == {
        "compile": "auto", "attention": "auto", "linear": "auto", "wide_linear": "auto",
        "gemv_order": "auto", "autotune": False,
    }  # fmt: skip
    assert record["metrics"]["engine/compiled"] is False  # 4 decode steps: not worth a compile
    assert "4 decode steps < 64" in record["metrics"]["engine/compile_choice"]["reason"]
    plan = record["metrics"]["engine/kernel_plan"]
    assert set(plan) == {"linear", "capability", "settings", "timings", "prefill_attention"}
    assert not plan["timings"]
    env = record["environment"]
    assert {"torch", "transformers", "threads", "cpu", "python"} <= set(env)
    assert env["threads_source"] != "torch default"  # recorded after the run applied it
    assert "[kvlab] model=smollm2-135m cache=full" in done.stdout


@pytest.mark.slow
def test_a_point_records_the_same_kernel_plan_with_and_without_a_concurrent_load(tmp_path):
    """The plan is made from the CPU's capability, not from timings: a run beside a process
    that keeps both cores busy records the plan of a run on a quiet machine."""
    plans = []
    for busy in (0, 2):  # processes that keep a core busy for the whole run
        spin = [sys.executable, "-c", "while True: sum(range(10**6))"]
        burners = [subprocess.Popen(spin) for _ in range(busy)]
        try:
            out = tmp_path / f"run{busy}"
            done = kvlab("cache=full", *TINY, f"hydra.run.dir={out}", cwd=tmp_path)
        finally:
            for burner in burners:
                burner.kill()
        assert done.returncode == 0, done.stderr
        plans.append(json.loads((out / "result.json").read_text())["metrics"]["engine/kernel_plan"])
    assert plans[0] == plans[1]


@pytest.mark.slow
def test_sweep_records_failures_goes_on_and_resumes(tmp_path):
    sweep = tmp_path / "sweep"
    args = [
        "-m",
        "cache=full,nocache",
        "workload.prompt_len=16,8190",
        "workload.new_tokens=4",
        f"hydra.sweep.dir={sweep}",
    ]
    first = kvlab(*args, cwd=tmp_path)
    assert first.returncode == 0, first.stderr
    rows = load_results(sweep)
    assert len(rows) == 4
    failed = [r for r in rows if r["status"] == "failed"]
    assert {r["workload.prompt_len"] for r in failed} == {8190}
    assert all("exceeds the context" in r["error"] for r in failed)
    assert all(r["status"] == "ok" for r in rows if r["workload.prompt_len"] == 16)
    assert "kvlab sweep: 4 points" in first.stdout

    second = kvlab(*args, cwd=tmp_path)
    assert second.returncode == 0, second.stderr
    assert second.stdout.count("already done, skipped") == 2  # only the failed points re-ran


@pytest.mark.slow
def test_a_killed_sweep_resumes_with_only_the_missing_points(tmp_path):
    """SIGKILL the sweep once its first point is recorded; the re-run skips what finished,
    runs the rest, and the report renders."""
    import os
    import signal
    import time

    sweep = tmp_path / "sweep"
    args = ["-m", "cache=full,nocache,int8,int4", "workload.prompt_len=16",
            "workload.new_tokens=2", f"hydra.sweep.dir={sweep}"]  # fmt: skip
    command = [sys.executable, "-m", "kvlab.cli", *args]
    victim = subprocess.Popen(command, cwd=tmp_path, start_new_session=True,
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)  # fmt: skip
    deadline = time.time() + 300
    while not list(sweep.glob("*/result.json")) and time.time() < deadline:
        time.sleep(0.2)
    os.killpg(victim.pid, signal.SIGKILL)
    victim.wait()
    finished = len(list(sweep.glob("*/result.json")))
    assert 1 <= finished < 4, "the kill should land mid-sweep"
    again = kvlab(*args, cwd=tmp_path)
    assert again.returncode == 0, again.stderr
    assert again.stdout.count("already done, skipped") == finished
    rows = load_results(sweep)
    assert len(rows) == 4 and all(r["status"] == "ok" for r in rows)
    assert (sweep / "report.md").exists()


@pytest.mark.slow
def test_invalid_single_run_exits_nonzero_with_the_field(tmp_path):
    done = kvlab("workload.prompt_len=-4", f"hydra.run.dir={tmp_path / 'bad'}", cwd=tmp_path)
    assert done.returncode != 0
    assert "workload.prompt_len=-4" in done.stderr + done.stdout


def test_sweep_rows_come_in_job_order_with_failures_kept(tmp_path):
    from kvlab.tracking import format_table, write_record

    for job in (0, 2, 10, 1):
        status = "failed" if job == 2 else "ok"
        record = {
            "config": {"cache": {"name": f"c{job}"}},
            "status": status,
            "metrics": {} if status == "failed" else {"ttft_ms": float(job)},
        }
        write_record(tmp_path / f"{job}_cache=c{job}", record | {"error": "boom"})
    rows = load_results(tmp_path)
    assert [r["cache.name"] for r in rows] == ["c0", "c1", "c2", "c10"]
    table = format_table(rows).splitlines()
    assert "failed" in table[3] and table[3].split()[-1] == "-"  # missing metrics show as '-'


def test_a_sweep_with_speculation_shows_the_draft_and_its_acceptance(tmp_path):
    from kvlab.tracking import format_table, table_columns, write_record

    for job, method in enumerate(("none", "ngram")):
        metrics = {"spec/acceptance_rate": 0.5, "spec/tokens_per_step": 2.5} if job else {}
        record = {"config": {"spec": {"method": method}}, "status": "ok", "metrics": metrics}
        write_record(tmp_path / f"{job}_spec={method}", record)
    rows = load_results(tmp_path)
    table = format_table(rows, table_columns(rows)).splitlines()
    assert "spec  spec/acceptance_rate  spec/tokens_per_step  status" in table[0]
    assert "ngram                  0.50                  2.50" in table[2]
    assert "spec" not in format_table(rows[:1], table_columns(rows[:1]))


EXPERIMENTS = sorted(
    p.stem for p in (Path(__file__).parents[1] / "conf" / "experiment").glob("*.yaml")
)


@pytest.mark.slow
@pytest.mark.parametrize("experiment", EXPERIMENTS)
def test_every_experiment_runs_with_tiny_limits(experiment, tmp_path):
    sweep = tmp_path / experiment
    tiny_workload = ["workload.prompt_len=16", "workload.new_tokens=2"]
    tiny = [
        *tiny_workload,
        "eval.ppl.seqlen=32",
        "eval.ppl.max_windows=1",
        "eval.ppl.chunk=8",
    ]
    if experiment not in ("kv_strategies", "weight_quant", "joint", "formats_weights"):
        tiny = tiny[:2]  # the others have no ppl
    if experiment == "weight_quant":  # GPTQModel on the default model takes minutes;
        tiny += ["quant=none,rtn_int8,bnb", "cache=full"]  # test_quant runs it on a tiny model
    if experiment == "formats_weights":  # gptq, awq: test_quant and test_awq (tiny model)
        tiny += ["quant=none,rtn"]
    if experiment == "formats_kv":  # eval=kld in one short window; one point per family
        tiny += ["eval.kld.seqlen=32", "eval.kld.max_windows=1", "eval.kld.chunk=8"]
        tiny += ["cache=fp8,int4,compressed"]
    if experiment == "joint":  # the grid of weights x KV: one weight point, every KV one
        tiny.append("quant=rtn_int8")
    if experiment == "compressed_attention":  # ppl and passkey at the prompt length
        tiny = ["workload.prompt_len=64", "workload.new_tokens=2", "workload.prefill_chunk=16"]
        tiny += ["eval.ppl.max_windows=1", "eval.ppl.chunk=16", "eval.longctx.samples=1"]
        tiny += ["eval.longctx.depths=[0.5]", "eval.longctx.max_new_tokens=4"]
    if experiment == "serving_capacity":  # two points of the grid, two short requests
        tiny = ["cache=full,paged", "workload.serving.rate=0", "workload.serving.num_requests=2"]
        tiny += ["workload.serving.prompt_len={kind: fixed, value: 16}"]
        tiny += ["workload.serving.output_len={kind: fixed, value: 3}"]
    if experiment == "eviction_ruler":  # one scorer, one ratio, one short item
        tiny = ["cache.options.scorer=snapkv", "cache.options.ratio=0.5", "cache.options.window=8"]
        tiny += ["eval.ruler.tasks=[niah_single_1]", "eval.ruler.length=256"]
        tiny += ["eval.ruler.samples=1", "eval.ruler.max_new_tokens=4", *tiny_workload]
    done = kvlab("-m", f"+experiment={experiment}", *tiny, f"hydra.sweep.dir={sweep}", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    rows = load_results(sweep)
    assert rows and all(r["status"] == "ok" for r in rows), [r.get("error") for r in rows]
    assert (sweep / "report.md").exists()
    if experiment == "serving_capacity":  # serving decodes eagerly, and its record says why
        for path in sweep.rglob("result.json"):
            metrics = json.loads(path.read_text())["metrics"]
            assert metrics["engine/compiled"] is False
            assert "serving" in metrics["engine/compile_choice"]["reason"]


@pytest.mark.slow
def test_wandb_logger_writes_one_offline_run_per_point(tmp_path):
    sweep = tmp_path / "sweep"
    done = kvlab(
        "-m", "cache=full,int8", *TINY, "logger=wandb", f"hydra.sweep.dir={sweep}", cwd=tmp_path
    )
    assert done.returncode == 0, done.stderr
    runs = sorted(sweep.glob("*/wandb/offline-run-*"))
    assert len(runs) == 2
    for run in runs:
        (table,) = run.glob("files/media/table/itl_ms_*.table.json")
        rows = json.loads(table.read_text())["data"]
        assert [step for step, _ in rows] == [1, 2, 3]  # 4 new tokens: 3 decode steps


def test_unknown_logger_is_refused():
    from kvlab.config import LoggerConfig

    with pytest.raises(ValueError, match="logger.name='mlflow' is invalid; allowed: none, wandb"):
        LoggerConfig(name="mlflow")


def test_third_party_import_chatter_is_silenced():
    """torchao (pulled in by the quantization stack) prints "Failed to load ... .so" and
    torch pytree deprecations on every import; a kvlab process keeps them out of its
    output."""
    code = "from kvlab.quiet import quiet_third_party; quiet_third_party(); import torchao"
    pytest.importorskip("torchao")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert "Failed to load" not in done.stderr and "_pytree" not in done.stderr
