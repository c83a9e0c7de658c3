"""kvlab vs Hugging Face transformers ``generate`` (DynamicCache) on the same weights.

Same dtype, same prompt (exact-length WikiText-2 window), same number of greedy new tokens,
runs alternated kvlab (eager, and compiled with --compile) / HF after one warm-up each;
prints per-run TTFT and ITL, the ratios of their medians to HF, and how close kvlab's decode
comes to the memory-bandwidth roof. Not a test: timings here are noisy, compare ratios.

    python scripts/bench_vs_hf.py --dtype float32 --prompt-len 1024 --new-tokens 128
"""

from __future__ import annotations

import argparse
import statistics

import torch
from transformers import AutoModelForCausalLM

import kvlab
from kvlab.analysis.hf_baseline import timed_generate
from kvlab.analysis.roofline import decode_roof
from kvlab.cache import build_cache
from kvlab.engine import Engine, GenerationConfig
from kvlab.engine.timing import percentile
from kvlab.models import resolve_checkpoint
from kvlab.quiet import quiet_third_party
from kvlab.workload import build_prompts


def run_hf(model, prompt: list[int], new_tokens: int) -> tuple[float, list[float], list[int]]:
    ttft, itl, tokens, _ = timed_generate(model, prompt, new_tokens)
    return ttft, itl, tokens


def run_kvlab(engine: Engine, prompt: list[int], new_tokens: int):
    cfg = GenerationConfig(max_new_tokens=new_tokens, stop_on_eos=False)
    run = engine.generate([prompt], cfg)
    return run.stats.ttft_s, run.stats.step_s, run.tokens[0]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--prompt-len", type=int, default=1024)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--compile", action="store_true", help="also kvlab with compiled decode")
    args = ap.parse_args()
    quiet_third_party()
    dtype = getattr(torch, args.dtype)
    model, tok = kvlab.load_model(args.model, dtype=dtype)
    engines = {"kvlab": Engine(model, build_cache("full", model.cache_spec()))}
    if args.compile:
        engines["kvlab compiled"] = Engine(
            model, build_cache("full", model.cache_spec(), static=True), compile=True
        )
    hf = AutoModelForCausalLM.from_pretrained(resolve_checkpoint(args.model), dtype=dtype).eval()
    prompt = build_prompts(tok, args.prompt_len, 1)[0]
    runners = {
        name: (lambda e=e: run_kvlab(e, prompt, args.new_tokens)) for name, e in engines.items()
    }
    runners["hf"] = lambda: run_hf(hf, prompt, args.new_tokens)
    results = {name: [] for name in runners}
    with torch.inference_mode():
        for engine in engines.values():
            run_kvlab(engine, prompt[:64], 4)  # warm-up (and compilation)
        run_hf(hf, prompt[:64], 4)
        for r in range(args.repeats):
            for name, fn in runners.items():
                ttft, itl, toks = fn()
                results[name].append((ttft, itl, toks))
                print(
                    f"run {r} {name:5s} ttft_ms={ttft * 1e3:8.1f} "
                    f"itl_ms_p50={percentile(itl, 50) * 1e3:6.2f} "
                    f"itl_ms_mean={statistics.mean(itl) * 1e3:6.2f}",
                    flush=True,
                )
    summary = {}
    for name, runs in results.items():
        summary[name] = (
            statistics.median(r[0] for r in runs),
            statistics.median(percentile(r[1], 50) for r in runs),
        )
    print(
        f"\nmodel={args.model} dtype={args.dtype} prompt_len={args.prompt_len} "
        f"new_tokens={args.new_tokens} threads={torch.get_num_threads()} repeats={args.repeats}"
    )
    roof = decode_roof(model, refresh=True)  # read in this run
    kv_read = 2 * model.config.num_layers * model.config.num_kv_heads * model.config.head_dim
    kv_read *= (args.prompt_len + args.new_tokens // 2) * dtype.itemsize
    print(f"{roof}; roof ITL here {roof.itl_s(kv_read) * 1e3:.2f} ms")
    hf_ttft, hf_itl = summary["hf"]
    for name, (ttft, itl) in summary.items():
        same = sum(a == b for a, b in zip(results[name][0][2], results["hf"][0][2], strict=True))
        print(
            f"{name:15s} ttft_ms={ttft * 1e3:8.1f} itl_ms_p50={itl * 1e3:6.2f} "
            f"ttft/hf={ttft / hf_ttft:.3f} itl/hf={itl / hf_itl:.3f} "
            f"roof/itl={roof.itl_s(kv_read) / itl:.0%} greedy_equal={same}/{args.new_tokens}"
        )


if __name__ == "__main__":
    main()
