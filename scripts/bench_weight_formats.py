"""Weight formats side by side on the default model's decode: one engine per format, their
decode steps interleaved one step of each in turn (so a slow spell of a shared machine hits
every format alike), ITL as the median of per-step ratios to the first format; and their
prefills (TTFT: prefill and first token) in turns each round. Not a test.

    python scripts/bench_weight_formats.py --depth 1024 \
        --formats none,rtn_int8,rtn_int8_w8a8,rtn_int8:head,rtn_int8_w8a8:head

A format is a ``quant`` preset; ``:head`` quantizes the tied output head too (its
``skip`` emptied; llama.cpp's Q8_0 and Q4_1 files hold that head in Q8_0). Activations and
non-quantized weights are in ``--dtype``, or in the format's own ``@dtype``: issue 23's
bf16-vs-fp32 target interleaved, where bench_vs_llamacpp.py times each format in a window
of its own (a shared machine's bandwidth moves between windows):

    python scripts/bench_weight_formats.py --depth 1024 \
        --formats none@float32,none@bfloat16,rtn_int8:head,rtn_int4_g32_asym:head

``:4k`` leaves the format's weights and its cache on torch's memory (4 KiB pages where THP
is ``madvise``) instead of huge pages (``model.huge_pages``, kvlab/kernels/huge_pages.py),
in turns with the same format on huge pages; ``:layers`` calls the fused layers one by one
instead of a step's layers in one C call (``Decoder.step_in_one_call``, FusedStep in
kvlab/models/fused_layer.py); ``:row`` gives W8A8 one activation scale a row instead of one
every 32 channels; ``:qwen3`` runs the model's weights as a Qwen3 checkpoint (per-head q/k
norms of ones: the fused layer norms them in C; ``kvlab.models.loading.as_qwen3``);
``--cache`` names the KV strategy:

    python scripts/bench_weight_formats.py --depth 4096 --cache full \
        --formats none@float32,none:4k@float32
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch
from bench_vs_llamacpp import wikitext_prompt  # scripts/, beside it

from kvlab.cache import cache_factory
from kvlab.engine import Engine, GenerationConfig
from kvlab.kernels.huge_pages import summary
from kvlab.models.loading import as_qwen3
from kvlab.run import compose_run_config, load_run_model
from kvlab.tracking import environment

QWEN3_DIR = Path(tempfile.gettempdir()) / "kvlab-bench-qwen3"  # remade each run
EXTRAS = {
    "head": "+quant.options.skip=[]",
    "4k": "model.huge_pages=false",
    "layers": None,
    "row": "quant.options.activation_group=row",
    "qwen3": None,
}


def load(spec: str, dtype: str) -> torch.nn.Module:
    """The model for ``spec`` (``preset[:head][:4k][:layers][:row][@dtype]``), in ``dtype`` unless
    it names one (the run config refuses a dtype it does not know, naming ``model.dtype``)."""
    spec, _, own_dtype = spec.partition("@")
    preset, *extras = spec.split(":")
    unknown = sorted(set(extras) - set(EXTRAS))
    if unknown:
        raise SystemExit(f"--formats: {spec!r} asks for {unknown}; allowed: {sorted(EXTRAS)}")
    overrides = [f"quant={preset}", f"model.dtype={own_dtype or dtype}"]
    overrides += [EXTRAS[extra] for extra in extras if EXTRAS[extra] is not None]
    if "qwen3" in extras:
        qwen3 = as_qwen3(compose_run_config([]).model.source, QWEN3_DIR)
        overrides.append(f"model.source={qwen3}")
    cfg = compose_run_config(overrides)
    model = load_run_model(cfg.model, cfg.quant, torch.device("cpu"))[0]
    model.step_in_one_call = "layers" not in extras
    return model


def interleaved_steps(
    engines: dict, prompt: list[int], steps: int, rounds: int
) -> tuple[dict, dict]:
    """({format: [seconds of each decode step]}, {format: [seconds of each prefill and first
    token]}), every round one generation per engine, their prefills and then their steps
    taking turns."""
    times = {name: [] for name in engines}
    first = {name: [] for name in engines}
    gen = GenerationConfig(steps + 1, stop_on_eos=False)
    for _ in range(rounds):
        runs = {name: iter(engine.stream([prompt], gen)) for name, engine in engines.items()}
        for name, run in runs.items():
            start = time.perf_counter()
            next(run)  # prefill and first token
            first[name].append(time.perf_counter() - start)
        for _ in range(steps):
            for name, run in runs.items():
                start = time.perf_counter()
                next(run)
                times[name].append(time.perf_counter() - start)
        for run in runs.values():
            for _ in run:
                pass
    return times, first


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--formats", default="none,rtn_int8,rtn_int8_w8a8")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--depth", type=int, default=1024)
    parser.add_argument("--cache", default="full", help="the KV strategy every format runs")
    parser.add_argument("--steps", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    formats = args.formats.split(",")
    prompt = wikitext_prompt(args.depth)
    with torch.inference_mode():
        engines = {}
        for spec in formats:
            model = load(spec, args.dtype)
            print(f"{spec}: {summary(model)}", flush=True)
            engines[spec] = Engine(model, cache_factory(args.cache, model, {})(static=False))
            engines[spec].generate([prompt[:600]], GenerationConfig(4, stop_on_eos=False))
        times, first = interleaved_steps(engines, prompt, args.steps, args.rounds)
    env = environment()
    print(f"decode at depth {args.depth}, cache {args.cache}, {args.dtype} activations "
          f"(unless a format says), {args.steps} steps x {args.rounds} rounds interleaved; "
          f"{env['cpu']}, "
          f"{torch.get_num_threads()} threads, "
          f"torch {env['torch']}\n")  # fmt: skip
    print(f"| format | ITL p50 ms | ITL / {formats[0]} (median of per-step ratios) "
          f"| TTFT p50 ms | TTFT / {formats[0]} (median of per-round ratios) |")  # fmt: skip
    print("|---|---:|---:|---:|---:|")
    reference, first_reference = times[formats[0]], first[formats[0]]
    for spec in formats:
        ratios = [a / b for a, b in zip(times[spec], reference, strict=True)]
        first_ratios = [a / b for a, b in zip(first[spec], first_reference, strict=True)]
        print(f"| {spec} | {statistics.median(times[spec]) * 1e3:.2f} | "
              f"{statistics.median(ratios):.3f} | {statistics.median(first[spec]) * 1e3:.0f} | "
              f"{statistics.median(first_ratios):.3f} |")  # fmt: skip


if __name__ == "__main__":
    main()
