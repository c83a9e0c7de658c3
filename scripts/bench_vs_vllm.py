"""kvlab serve against vLLM's CPU build on the same machine, checkpoint, dtype, cores and KV
budget, both driven by vLLM's own load generator (``vllm bench serve``,
scripts/vllm_bench_client.py) — experiments/serving_vs_vllm.

Each engine in turn (never both at once: they share the two cores): its server starts,
the client replays each workload at each request rate, the server stops. Workloads: vLLM's
``random`` dataset (fixed prompt and output lengths, EOS ignored) and kvlab's WikiText-2
long-tail trace exported as a ``custom`` JSONL dataset (its prompts and output lengths).

    bash scripts/peer_vllm.sh                                  # once: .venv-vllm
    python scripts/bench_vs_vllm.py --rates inf,2,8            # the study's table
    python scripts/bench_vs_vllm.py --engines kvlab --kvlab-args "cache=int4"
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
VENV_PYTHON = ROOT / ".venv-vllm" / "bin" / "python"
NAME = "smollm2"
KVLAB_DEFAULT = "cache=paged workload.serving.chunk=2048"
COLUMNS = [("request_throughput", "req/s"), ("output_throughput", "out tok/s"),
           ("median_ttft_ms", "TTFT p50"), ("p99_ttft_ms", "TTFT p99"),
           ("median_tpot_ms", "TPOT p50"), ("p99_tpot_ms", "TPOT p99"),
           ("median_itl_ms", "ITL p50"), ("p99_itl_ms", "ITL p99"),
           ("peak_running", "peak running")]  # fmt: skip


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--engines", default="vllm,kvlab")
    p.add_argument("--workloads", default="random,wikitext")
    p.add_argument("--rates", default="inf,2,8", help="requests per second (inf: all at once)")
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--input-len", type=int, default=256, help="random dataset's prompts")
    p.add_argument("--output-len", type=int, default=128, help="random dataset's outputs")
    p.add_argument("--kv-gib", type=int, default=1, help="KV budget of both engines")
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--kvlab-args", action="append",
                   help="kvlab serve's run overrides (repeat for several kvlab rows; default: "
                   f"{KVLAB_DEFAULT!r})")  # fmt: skip
    p.add_argument(
        "--repeats",
        type=int,
        default=1,
        help="rounds of every server in turn; the table gives each metric's median "
        "over them and each kvlab row's throughput over vLLM's, round by round",
    )
    p.add_argument("--port", type=int, default=8311)
    p.add_argument("--out", default=str(ROOT / "experiments/serving_vs_vllm/out"))
    args = p.parse_args()
    args.kvlab_args = args.kvlab_args or [KVLAB_DEFAULT]
    return args


def checkpoint() -> str:
    """kvlab's converted SmolLM2-135M (a transformers checkpoint directory): both load it."""
    from kvlab.models import resolve_checkpoint

    return str(resolve_checkpoint("smollm2-135m"))


def export_wikitext(path: Path, num: int, max_len: int) -> None:
    """kvlab's serving trace (WikiText-2 prompts, long-tail prompt and output lengths, seed
    0) as vLLM's custom JSONL dataset."""
    from transformers import AutoTokenizer

    from kvlab.run import compose_run_config
    from kvlab.serving.study import build_trace

    cfg = compose_run_config(["workload=serving", f"workload.serving.num_requests={num}"])
    tokenizer = AutoTokenizer.from_pretrained(checkpoint())
    requests = build_trace(tokenizer, cfg.workload.serving, seed=0)
    with path.open("w") as f:
        for r in requests:
            out = min(r.max_new_tokens, max_len - len(r.prompt) - 8)
            f.write(json.dumps({"prompt": tokenizer.decode(r.prompt), "output_tokens": out}) + "\n")


def servers(args: argparse.Namespace) -> list[tuple[str, str]]:
    """(label, kvlab overrides or "") of each server to run, in order."""
    out = []
    for engine in args.engines.split(","):
        if engine != "kvlab":
            out.append((engine, ""))
            continue
        for overrides in args.kvlab_args:
            label = " ".join(o.removeprefix("cache=").removeprefix("cache.options.")
                             for o in overrides.split() if o.startswith("cache"))  # fmt: skip
            out.append((f"kvlab {label}".strip(), overrides))
    return out


def server_command(engine: str, overrides: str, args, ckpt: str) -> tuple[list[str], dict]:
    env = dict(os.environ)
    if engine.startswith("vllm"):
        env |= {"VLLM_CPU_OMP_THREADS_BIND": "0-1", "VLLM_CPU_NUM_OF_RESERVED_CPU": "0",
                "VLLM_CPU_KVCACHE_SPACE": str(args.kv_gib)}  # fmt: skip
        command = [str(VENV_PYTHON), "-m", "vllm.entrypoints.openai.api_server",
                   "--model", ckpt, "--served-model-name", NAME, "--dtype", args.dtype,
                   "--max-model-len", str(args.max_model_len), "--port", str(args.port),
                   "--host", "127.0.0.1"]  # fmt: skip
        return command, env
    command = [sys.executable, "-m", "kvlab.cli", "serve", "--port", str(args.port),
               "--max-model-len", str(args.max_model_len), "--served-model-name", NAME,
               f"model.source={ckpt}", f"model.dtype={args.dtype}",
               f"workload.serving.kv_budget_gib={args.kv_gib}", *overrides.split()]  # fmt: skip
    return command, env


def wait_ready(url: str, process: subprocess.Popen, timeout: float = 600) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"the server exited with {process.returncode}")
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(1)
    raise TimeoutError(f"{url} not ready after {timeout} s")


def run_client(args, ckpt: str, workload: str, rate: str, out: Path, dataset: Path) -> dict:
    name = out.name
    command = [str(VENV_PYTHON), str(ROOT / "scripts/vllm_bench_client.py"),
               "--backend", "openai", "--base-url", f"http://127.0.0.1:{args.port}",
               "--endpoint", "/v1/completions", "--model", NAME, "--tokenizer", ckpt,
               "--num-prompts", str(args.num_prompts), "--request-rate", rate, "--seed", "0",
               "--temperature", "0", "--percentile-metrics", "ttft,tpot,itl,e2el",
               "--metric-percentiles", "50,99", "--save-result", "--result-dir",
               str(out.parent), "--result-filename", name]  # fmt: skip
    if workload == "random":
        command += ["--dataset-name", "random", "--random-input-len", str(args.input_len),
                    "--random-output-len", str(args.output_len), "--ignore-eos"]  # fmt: skip
    else:
        command += ["--dataset-name", "custom", "--dataset-path", str(dataset),
                    "--custom-output-len", "-1",  # each request's own output_tokens
                    "--ignore-eos", "--disable-shuffle"]  # fmt: skip
    env = dict(os.environ, VLLM_CPU_OMP_THREADS_BIND="0-1")
    peak = PeakRunning(f"http://127.0.0.1:{args.port}/metrics")
    peak.start()
    try:
        subprocess.run(command, check=True, env=env, cwd=ROOT)
    finally:
        peak.stop()
    return json.loads(out.read_text()) | {"peak_running": peak.most}


class PeakRunning(threading.Thread):
    """The most requests the server ran at once, from its own ``vllm:num_requests_running``
    gauge (both servers export it), read every quarter second."""

    def __init__(self, url: str):
        super().__init__(daemon=True)
        self.url, self.most, self.done = url, 0, threading.Event()

    def run(self) -> None:
        while not self.done.wait(0.25):
            try:
                with urllib.request.urlopen(self.url, timeout=2) as r:
                    text = r.read().decode()
            except OSError:
                continue
            for line in text.splitlines():
                if line.startswith("vllm:num_requests_running"):
                    self.most = max(self.most, int(float(line.split()[-1])))

    def stop(self) -> None:
        self.done.set()
        self.join()


def main() -> None:
    args = parse()
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    ckpt = checkpoint()
    dataset = out_dir / "wikitext_longtail.jsonl"
    export_wikitext(dataset, args.num_prompts, args.max_model_len)
    rows = []
    for round_ in range(args.repeats):  # engines alternate: a slow spell of the machine
        for engine, overrides in servers(args):  # falls on every engine's rounds alike
            command, env = server_command(engine, overrides, args, ckpt)
            tag = engine.replace(" ", "_").replace(".", "")
            log = (out_dir / f"server_{tag}.log").open("w")
            process = subprocess.Popen(command, env=env, cwd=ROOT, stdout=log, stderr=log,
                                       start_new_session=True)  # fmt: skip
            try:
                wait_ready(f"http://127.0.0.1:{args.port}", process)
                for workload in args.workloads.split(","):
                    for rate in args.rates.split(","):
                        suffix = f"_round{round_}" if args.repeats > 1 else ""
                        out = out_dir / f"{tag}_{workload}_rate{rate}{suffix}.json"
                        result = run_client(args, ckpt, workload, rate, out, dataset)
                        rows.append({"engine": engine, "workload": workload, "rate": rate,
                                     "round": round_} | result)  # fmt: skip
            finally:
                stop(process)
    print_table(rows, args)


def stop(process: subprocess.Popen) -> None:
    """The server and what it started (its own process group), gone."""
    if process.poll() is not None:
        return
    os.killpg(process.pid, signal.SIGINT)
    try:
        process.wait(timeout=60)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        process.wait()


def print_table(rows: list[dict], args: argparse.Namespace) -> None:
    """One line per (workload, rate, engine): each metric's median over the rounds; with
    several rounds, each kvlab row's output throughput over vLLM's, paired round by round
    (median, lowest, highest)."""
    from statistics import median

    from kvlab.tracking import cpu_model

    print(f"\n{cpu_model()}, {os.cpu_count()} CPUs, {args.dtype}, KV budget {args.kv_gib} GiB, "
          f"{args.num_prompts} requests, {args.repeats} round(s); "
          f"kvlab: {' / '.join(args.kvlab_args)}")  # fmt: skip
    groups: dict[tuple, list[dict]] = {}
    for row in rows:
        groups.setdefault((row["workload"], row["rate"], row["engine"]), []).append(row)
    header = ["workload", "rate", "engine", *(label for _, label in COLUMNS)]
    print("| " + " | ".join(header) + " |")
    print("|" + "---|" * len(header))
    for key in sorted(groups):
        cells = list(key)
        cells += [f"{median(r.get(k, float('nan')) for r in groups[key]):.2f}" for k, _ in COLUMNS]
        print("| " + " | ".join(cells) + " |")
    if args.repeats < 2:
        return
    for (workload, rate, engine), kvlab in sorted(groups.items()):
        vllm = {r["round"]: r for r in groups.get((workload, rate, "vllm"), [])}
        ratios = [r["output_throughput"] / vllm[r["round"]]["output_throughput"]
                  for r in kvlab if r["round"] in vllm]  # fmt: skip
        if engine.startswith("kvlab") and ratios:
            print(
                f"{workload} rate {rate}: {engine} / vLLM output tok/s, round by round: "
                f"median {median(ratios):.3f} (lowest {min(ratios):.3f}, highest "
                f"{max(ratios):.3f}, {len(ratios)} rounds)"
            )


if __name__ == "__main__":
    main()
