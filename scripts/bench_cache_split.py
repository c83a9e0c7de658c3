"""KV strategies' decode steps side by side in one process, each split into its decode
attention, its CSA indexer and the rest: one generation per strategy on the default model,
their steps in turns (``--block`` steps each, the first of each turn dropped as its
warm-up), with the kernels built with ``-DKVLAB_TIMERS`` (kvlab/kernels/include/timers.h) so the
attention and indexer calls of the same steps are timed in C (so are the fused layers'
products, "linears", and the call that runs a step's layers, whose time taken off the step
leaves what runs outside it: the head, the cache's plan, the Python). Ratios are to the
first strategy. Where a strategy's step goes, and so what would move its ratio to ``full``:
its attention, or what it does around it. Not a test.

    python scripts/bench_cache_split.py --caches full,int4,compressed --depth 4096

A cache written ``NAME:KEY=VALUE:...`` takes those options (``gqa_shared:factor=3``: MQA;
values read as YAML). A cache written ``NAME@CHUNKS/MIN`` runs its turns with the decode
attention's chunk rule set so (``kvlab.kernels.attention.backend_c.chunk_tokens``: LONG_CHUNKS the
dot-separated CHUNKS, longest first, none if empty; MIN_CHUNKS = MIN): ``int4@/4`` is
int4 with chunks of 256 at any span, ``int4@2048.1024.512/2`` allows chunks of 2048, in
turns with ``int4``.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import tempfile
from pathlib import Path

import torch
import yaml
from bench_attention_builds import KERNELS, ROOT, compiled, sources
from bench_step_builds import switch, timed_turn
from bench_vs_llamacpp import WEIGHTS, load_weights, wikitext_prompt

from kvlab.cache import cache_factory
from kvlab.engine import Engine, GenerationConfig
from kvlab.kernels import build, timers
from kvlab.kernels.attention import backend_c
from kvlab.models import fused_layer
from kvlab.tracking import environment


@contextlib.contextmanager
def chunk_rule(cache: str):
    """The chunk rule ``cache``'s ``@CHUNKS/MIN`` asks for (see the module doc), while it
    runs; the library's own without one."""
    saved = backend_c.LONG_CHUNKS, backend_c.MIN_CHUNKS
    if "@" in cache:
        chunks, _, least = cache.split("@", 1)[1].partition("/")
        backend_c.LONG_CHUNKS = tuple(int(c) for c in chunks.split(".") if c)
        backend_c.MIN_CHUNKS = int(least or saved[1])
    try:
        yield
    finally:
        backend_c.LONG_CHUNKS, backend_c.MIN_CHUNKS = saved


def _pair(text: str) -> tuple[str, str]:
    """(KEY, VALUE) of a cache's ``KEY=VALUE`` option, or a clear error naming it."""
    key, eq, value = text.partition("=")
    if not (key and eq):
        raise SystemExit(f"--caches: option {text!r} is not KEY=VALUE")
    return key, value


def split_steps(model, prompt: list[int], caches: list[str], args) -> dict:
    """{cache: (ms of each kept step, [timed_ms of each kept turn])}, turns in rounds."""
    runs = {}
    for cache in caches:
        name, *pairs = cache.split("@", 1)[0].split(":")
        options = {key: yaml.safe_load(value) for key, value in map(_pair, pairs)}
        engine = Engine(model, cache_factory(name, model, options)(static=False), compile=False)
        run = engine.stream([prompt], GenerationConfig(2 + (args.rounds + 1) * args.block,
                                                       stop_on_eos=False))  # fmt: skip
        tokens = iter(run)
        with chunk_rule(cache):
            next(tokens)  # prefill and the first token
        runs[cache] = (run, tokens)
    kept = {cache: ([], []) for cache in caches}
    for round_ in range(args.rounds + 1):  # the first round: warm-up
        for cache, (run, tokens) in runs.items():
            with chunk_rule(cache):
                steps, timed = timed_turn(run, tokens, build.library(), args.block)
            if round_:
                kept[cache][0].extend(steps)
                kept[cache][1].append(timed)
    return kept


def table(kept: dict) -> str:
    lines = [
        "| cache | step ms | / first | attention ms | indexer ms | rest ms | linears ms "
        "| outside the layers' call ms |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    first = None
    for cache, (steps, turns) in kept.items():
        step = statistics.median(steps)
        first = first or step
        timed = {name: statistics.median(turn[name][0] for turn in turns) for name in timers.NAMES}
        rest = step - timed["attention"] - timed["indexer"]
        outside = f"{step - timed['layers']:.2f}" if timed["layers"] else "- (layer by layer)"
        lines.append(f"| {cache} | {step:.2f} | {step / first:.3f} | {timed['attention']:.2f} | "
                     f"{timed['indexer']:.2f} | {rest:.2f} | {timed['linears']:.2f} | "
                     f"{outside} |")  # fmt: skip
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--caches", default="full,int4,compressed", type=lambda s: s.split(","))
    parser.add_argument("--weights", default="fp32", choices=sorted(WEIGHTS))
    parser.add_argument("--depth", type=int, default=4096)
    parser.add_argument("--block", type=int, default=9, help="steps a cache runs in a turn")
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--kernels", default=str(ROOT / KERNELS),
                        help="git revision or folder of kernel sources (default: the working "
                        "tree)")  # fmt: skip
    args = parser.parse_args()
    if args.block < 2:
        parser.error(f"--block={args.block}: a turn needs its warm-up step and one more (>= 2)")
    original = build.library
    with tempfile.TemporaryDirectory() as tmp, torch.inference_mode():
        folder = sources(args.kernels, Path(tmp) / "kernels")
        switch(compiled(folder, Path(tmp) / "timed.so", ("-DKVLAB_TIMERS",)))
        try:
            model = load_weights(WEIGHTS[args.weights])
            kept = split_steps(model, wikitext_prompt(args.depth), args.caches, args)
        finally:
            build.library = original
            build.kernel.cache_clear()
            fused_layer.weights_changed()
    env = environment()
    print(f"decode steps of SmolLM2-135M, weights {args.weights}, depth {args.depth}, kernels "
          f"{args.kernels} (timed build); {env['cpu']}, {torch.get_num_threads()} threads, "
          f"torch {env['torch']}; {args.rounds} turns of {args.block} steps a cache, the "
          f"first of each dropped; medians\n\n{table(kept)}")  # fmt: skip


if __name__ == "__main__":
    main()
