"""The hf backend's cost: the default model through kvlab's decoder (``native``) and through
transformers' own class with kvlab's attention (``hf``), each under ``full``, KIVI ``int4``,
``sliding`` (window 1024) and ``quest`` (budget 1024), their decode steps interleaved one
of each in turn; and plain transformers ``generate`` with its ``DynamicCache`` on the same
weights between rounds. Prints TTFT and ITL p50 per row, each strategy's ratio to ``full``
on its own backend, and hf ``full`` against transformers itself. Not a test: read ratios.

    python scripts/bench_hf_backend.py --prompt-lens 1024,4096 --rounds 3
"""

from __future__ import annotations

import argparse
import statistics

import torch

from kvlab import load_model
from kvlab.analysis.hf_baseline import timed_generate
from kvlab.cache import build_cache
from kvlab.data import wikitext2_test_text
from kvlab.engine import Engine, GenerationConfig
from kvlab.engine.timing import percentile
from kvlab.models import resolve_checkpoint
from kvlab.quiet import quiet_third_party
from kvlab.tracking import cpu_model
from kvlab.workload import text_windows

STRATEGIES = [
    ("full", {}),
    ("int4", {}),
    ("sliding", {"window": 1024}),
    ("quest", {"token_budget": 1024}),
]


def lockstep(engines: dict[str, Engine], prompt: list[int], cfg) -> dict:
    """Every prefill in turn, then the decode steps interleaved (one step of each engine)."""
    runs = {key: engine.stream([prompt], cfg) for key, engine in engines.items()}
    steps = {key: iter(run) for key, run in runs.items()}
    for step in steps.values():
        next(step)
    while steps:
        for key in list(steps):
            if next(steps[key], None) is None:
                del steps[key]
    return runs


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompt-lens", default="1024,4096")
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    quiet_third_party()
    from transformers import AutoModelForCausalLM

    models = {
        backend: load_model("smollm2-135m", backend=backend)[0] for backend in ("native", "hf")
    }
    tokenizer = load_model("smollm2-135m")[1]
    plain = AutoModelForCausalLM.from_pretrained(resolve_checkpoint("smollm2-135m")).eval()
    text = wikitext2_test_text()
    cfg = GenerationConfig(args.new_tokens, stop_on_eos=False, prefill_chunk=512)
    print(
        f"{cpu_model()}, {torch.get_num_threads()} threads, "
        f"torch {torch.__version__}, fp32, {args.new_tokens} new tokens, {args.rounds} rounds"
    )
    for length in map(int, args.prompt_lens.split(",")):
        prompt = text_windows(tokenizer, text, length, 1)[0]
        engines = {}
        for backend, model in models.items():
            for name, options in STRATEGIES:
                engine = Engine(model, build_cache(name, model.cache_spec(), options))
                engine.generate([prompt[:600]], GenerationConfig(4, stop_on_eos=False))
                engines[f"{backend} {name}"] = engine
        runs = {key: [] for key in [*engines, "transformers DynamicCache"]}
        with torch.inference_mode():
            timed_generate(plain, prompt[:64], 4)
            for _ in range(args.rounds):
                for key, run in lockstep(engines, prompt, cfg).items():
                    runs[key].append((run.stats.ttft_s, percentile(run.stats.step_s, 50)))
                ttft, steps, *_ = timed_generate(plain, prompt, args.new_tokens)
                runs["transformers DynamicCache"].append((ttft, percentile(steps, 50)))
        medians = {
            key: tuple(statistics.median(r[i] for r in rs) * 1e3 for i in (0, 1))
            for key, rs in runs.items()
        }
        print(
            f"\nprompt {length} tokens\n| row | TTFT ms | ITL p50 ms | ITL / its backend's full |"
        )
        print("|---|---:|---:|---:|")
        for key, (ttft, itl) in medians.items():
            full = medians.get(f"{key.split()[0]} full", (0, itl))[1]
            print(f"| {key} | {ttft:.0f} | {itl:.2f} | {itl / full:.2f} |")
        hf, peer, native = (medians["hf full"], medians["transformers DynamicCache"],
                            medians["native full"])  # fmt: skip
        print(
            f"hf full / transformers: TTFT {hf[0] / peer[0]:.2f}, ITL {hf[1] / peer[1]:.2f}; "
            f"hf full / native full: TTFT {hf[0] / native[0]:.2f}, ITL {hf[1] / native[1]:.2f}"
        )


if __name__ == "__main__":
    main()
