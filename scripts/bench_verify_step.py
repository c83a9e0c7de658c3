"""What a speculative verification step costs against a decode step on the default model:
one token vs 1 + k tokens fed after a prompt, and the model's linear layers alone at 1 and
1 + k rows (median ms after a warm-up; the kernel plan's linear kernel, or --linear).

    python scripts/bench_verify_step.py --prompt-len 425 --drafts 4
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from kvlab.cache import build_cache
from kvlab.config import ModelConfig, QuantConfig
from kvlab.engine import Engine
from kvlab.kernels.plan import KernelSettings, make_plan
from kvlab.run import load_run_model


def median_ms(work, reps: int = 15) -> float:
    work()
    times = []
    for _ in range(reps):
        began = time.perf_counter()
        work()
        times.append(time.perf_counter() - began)
    return statistics.median(times) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompt-len", type=int, default=425)
    parser.add_argument("--drafts", type=int, default=4)
    parser.add_argument("--linear", default="auto", help="engine.linear: auto, plain, kvlab")
    args = parser.parse_args()
    plan = make_plan(KernelSettings(linear=args.linear))
    model, _ = load_run_model(ModelConfig(), QuantConfig(), torch.device("cpu"), plan)
    linears = [m for m in model.modules() if hasattr(m, "in_features")]
    prompt = list(range(100, 100 + args.prompt_len))
    engine = Engine(model, build_cache("full", model.cache_spec()))
    engine.cache.allocate(1, args.prompt_len + args.drafts + 1)
    with torch.inference_mode():
        engine.prefill([prompt], args.prompt_len)
        for rows in (1, 1 + args.drafts):
            inputs = [torch.randn(rows, m.in_features) for m in linears]
            ms = median_ms(lambda: [m(x) for m, x in zip(linears, inputs, strict=True)])  # noqa: B023
            print(f"{len(linears)} linear layers, {rows} rows: {ms:.1f} ms")

        def step(drafts: list[int]) -> None:
            engine.verify([prompt + [5]], [drafts]) if drafts else engine.decode_step(
                [prompt + [5]]
            )
            engine.cache.truncate([args.prompt_len])

        plain = median_ms(lambda: step([]))
        verify = median_ms(lambda: step(list(range(6, 6 + args.drafts))))
        print(f"decode step {plain:.1f} ms, verification of {1 + args.drafts}: {verify:.1f} ms "
              f"({verify / plain:.2f}x)")  # fmt: skip


if __name__ == "__main__":
    main()
