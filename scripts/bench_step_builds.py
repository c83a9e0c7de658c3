"""Two builds of kvlab's C kernels side by side on whole decode steps of the default model:
one generation, its steps handed to build A and build B in turns (``--block`` steps each,
the first of each block dropped as its warm-up), so a slow spell of a shared machine hits
both and the ratio B/A of their median steps is what to read. Also checks that both builds
generate the same tokens. Not a test.

    # the committed kernels (A) against the working tree's (B), fp32 weights, full KV
    python scripts/bench_step_builds.py --a HEAD --weights fp32 --cache full --depth 1024

A and B are git revisions or folders of kernel sources (``*.c`` and ``*.h``), as in
scripts/bench_attention_builds.py. ``--timers`` builds both with ``-DKVLAB_TIMERS`` (see
kvlab/kernels/include/timers.h) and also prints how much of each build's step its decode attention
and its CSA indexer took (their calls timed in C, all layers of a step summed): the split
of a step between attention and the rest, within the same turns.

    # where int4 KV spends a step at 4096 tokens, against a variant of the kernels
    python scripts/bench_step_builds.py --b /tmp/variant --cache int4 --depth 4096 --timers
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
from pathlib import Path

import torch
from bench_attention_builds import KERNELS, ROOT, compiled, sources, use_library
from bench_vs_llamacpp import WEIGHTS, load_weights, wikitext_prompt

from kvlab.cache import cache_factory
from kvlab.engine import Engine, GenerationConfig
from kvlab.kernels import build, timers
from kvlab.models import fused_layer
from kvlab.tracking import environment


def switch(library) -> None:
    """Every kernel call and every fused layer's plan from the next step on use ``library``
    (the walk orders are the layers' own, passed to each call)."""
    use_library(library)
    fused_layer.weights_changed()


def timed_ms(library, steps: int) -> dict[str, tuple[float, float]]:
    """{timer: (ms a step, calls a step)} since the library's timers were last reset (no
    calls where the build has no timers, or was built without -DKVLAB_TIMERS)."""
    seconds, calls = timers.read(library)
    return {
        name: (seconds[i] * 1e3 / steps, calls[i] / steps) for i, name in enumerate(timers.NAMES)
    }


def timed_turn(run, tokens, library, block: int) -> tuple[list[float], dict]:
    """One turn of ``block`` steps of a streamed generation: the first its warm-up, then the
    ms of each other step and their timed_ms."""
    next(tokens)  # the turn's first step: its warm-up, not kept
    first = len(run.stats.step_s)
    timers.reset(library)
    for _ in range(block - 1):
        next(tokens)
    return [s * 1e3 for s in run.stats.step_s[first:]], timed_ms(library, block - 1)


def interleaved_steps(engine: Engine, prompt: list[int], libraries: dict, args):
    """({build: [ms of each kept step]}, {build: [timed_ms of each kept turn]}) over one
    generation whose steps alternate builds."""
    steps = {name: [] for name in libraries}
    timed = {name: [] for name in libraries}
    order = list(libraries.items()) * (args.rounds + 1)  # the first round: warm-up
    cfg = GenerationConfig(1 + len(order) * args.block, stop_on_eos=False)
    run = engine.stream([prompt], cfg)
    tokens = iter(run)
    next(tokens)  # prefill and the first token
    for turn, (name, library) in enumerate(order):
        switch(library)
        kept, turn_timed = timed_turn(run, tokens, library, args.block)
        if turn >= len(libraries):
            steps[name].extend(kept)
            timed[name].append(turn_timed)
    return steps, timed


def timer_table(timed: dict) -> str:
    """Each timer's median ms a step for A and B (and calls a step), as a markdown table."""
    lines = [
        "| kernel | calls a step | A ms a step | B ms a step | B / A |",
        "|---|---:|---:|---:|---:|",
    ]
    for name in timers.NAMES:
        a, b = ([turn[name] for turn in timed[build_]] for build_ in ("A", "B"))
        calls = max(statistics.median(c for _, c in turns) for turns in (a, b))
        if calls == 0:
            continue
        ms_a, ms_b = (statistics.median(ms for ms, _ in turns) for turns in (a, b))
        ratio = f"{ms_b / ms_a:.3f}" if ms_a and ms_b else "-"
        a_text, b_text = (f"{ms:.2f}" if ms else "- (no timers)" for ms in (ms_a, ms_b))
        lines.append(f"| {name} | {calls:.0f} | {a_text} | {b_text} | {ratio} |")
    return "\n".join(lines)


def same_tokens(engine: Engine, libraries: dict, prompt: list[int]) -> bool:
    """Whether every build greedily generates the same 16 tokens after ``prompt``."""
    outputs = []
    for library in libraries.values():
        switch(library)
        outputs.append(engine.generate([prompt], GenerationConfig(16, stop_on_eos=False)).tokens)
    return all(out == outputs[0] for out in outputs)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--a", default="HEAD", help="git revision or folder (default HEAD)")
    parser.add_argument("--b", default=str(ROOT / KERNELS), help="default: the working tree")
    parser.add_argument("--weights", default="fp32", choices=sorted(WEIGHTS))
    parser.add_argument("--cache", default="full")
    parser.add_argument("--depth", type=int, default=1024)
    parser.add_argument("--block", type=int, default=9, help="steps a build runs in a turn")
    parser.add_argument("--rounds", type=int, default=12)
    parser.add_argument("--timers", action="store_true",
                        help="build with -DKVLAB_TIMERS: also each build's attention and "
                        "indexer ms a step")  # fmt: skip
    args = parser.parse_args()
    if args.block < 2:
        parser.error(f"--block={args.block}: a turn needs its warm-up step and one more (>= 2)")
    defines = ("-DKVLAB_TIMERS",) if args.timers else ()
    with tempfile.TemporaryDirectory() as tmp:
        folders = {"A": sources(args.a, Path(tmp) / "a"), "B": sources(args.b, Path(tmp) / "b")}
        libraries = {name: compiled(folder, Path(tmp) / f"{name}.so", defines)
                     for name, folder in folders.items()}  # fmt: skip
        model = load_weights(WEIGHTS[args.weights])
        engine = Engine(model, cache_factory(args.cache, model, {})(static=False), compile=False)
        prompt = wikitext_prompt(args.depth)
        original = build.library
        try:
            identical = same_tokens(engine, libraries, prompt[:64])
            steps, timed = interleaved_steps(engine, prompt, libraries, args)
        finally:
            build.library = original
            build.kernel.cache_clear()
            fused_layer.weights_changed()
    env = environment()
    a, b = (statistics.median(steps[name]) for name in ("A", "B"))
    print(f"decode steps of SmolLM2-135M, weights {args.weights}, cache {args.cache}, depth "
          f"{args.depth}; A = {args.a}, B = {args.b}; {env['cpu']}, {torch.get_num_threads()} "
          f"threads, torch {env['torch']}; {args.rounds} turns of {args.block} steps a build, "
          f"medians of {len(steps['A'])} steps\n")  # fmt: skip
    print("| A ms | B ms | B / A | same tokens |\n|---:|---:|---:|---|")
    print(f"| {a:.2f} | {b:.2f} | {b / a:.3f} | {'yes' if identical else 'NO'} |")
    if args.timers:
        print(
            f"\nkernel time inside those steps (medians of {args.rounds} turns, "
            f"{args.block - 1} steps each):\n\n{timer_table(timed)}"
        )


if __name__ == "__main__":
    main()
