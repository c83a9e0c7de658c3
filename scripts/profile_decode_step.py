"""Where a decode step's time goes: torch.profiler over the decode steps of one generation on
the default model (after a warm-up run), ops grouped by name, self time per step, for each
weight format asked (the weights of scripts/bench_vs_llamacpp.py). Not a test: read the
shares. ``--python-only``: the step's wall time, unprofiled, with every kvlab C kernel it
calls made a no-op (libc's ``labs``): what the Python and torch ops around the kernels cost
a step (the outputs are garbage then; only the time counts). With ``--time``, also the
ms a step spent in each named function or method (``module:Class.method``) over those
stubbed generations, each one's prefill step included (a timer around each call, ~0.3 us).
With ``--pollute MB``, also that Python time in steps whose every stubbed kernel call reads
MB (a float a cache line, on every thread) from 32 such slices in turn, as the weights'
stream does, minus the reads' own time: the weights evict the Python's working set from
the caches, so the stubbed steps alone understate what the Python costs in a real step
(the ``--time`` timers then cover these steps).

    python scripts/profile_decode_step.py --weights fp32,bf16,int8,int4 --depth 1024
    python scripts/profile_decode_step.py --weights fp32 --python-only
    python scripts/profile_decode_step.py --weights fp32 --cache int4 --depth 4096 \
        --python-only --time kvlab.cache.composed:ComposedCache.plan
    python scripts/profile_decode_step.py --weights int4 --python-only --pollute 2
"""

from __future__ import annotations

import argparse
from collections import defaultdict

import torch
from bench_vs_llamacpp import WEIGHTS, load_weights, wikitext_prompt  # scripts/, beside it
from torch.profiler import ProfilerActivity, profile

from kvlab.cache import cache_factory
from kvlab.engine import Engine, GenerationConfig
from kvlab.tracking import environment


def label_kvlab_kernels() -> None:
    """kvlab's C kernels are called through ctypes, which torch.profiler does not see in an
    eager step: wrap their entry points in named ranges so they show up as ops."""
    from torch.profiler import record_function

    from kvlab.kernels import linear
    from kvlab.kernels.attention import backend_c
    from kvlab.models import fused_layer

    def labelled(module, name: str, label: str) -> None:
        inner = getattr(module, name)

        def call(*args, **kwargs):
            with record_function(label):
                return inner(*args, **kwargs)

        setattr(module, name, call)

    labelled(linear, "_small_linear_impl", "kvlab::small_linear (C, ctypes)")
    labelled(linear, "_int8_linear_impl", "kvlab::int8_linear (C, ctypes)")
    labelled(linear, "_int4_linear_impl", "kvlab::int4_linear (C, ctypes)")
    labelled(backend_c, "_attend", "kvlab::decode_attention (C, ctypes)")
    declared = fused_layer.kernel  # the fused layer's three calls, by the C function's name

    def labelled_kernel(name: str, *argtypes):
        function = declared(name, *argtypes)

        def call(*args):
            with record_function(f"kvlab::{name.removeprefix('kvlab_')} (C, ctypes)"):
                return function(*args)

        return call

    fused_layer.kernel = labelled_kernel


STUBBED = ("kvlab_gemv", "kvlab_gemv_int8", "kvlab_gemv_int4", "kvlab_rms_norm",
           "kvlab_decode_attention", "kvlab_layer_attention_in", "kvlab_layer_mlp_in",
           "kvlab_layer_out", "kvlab_layer_decode_in", "kvlab_layer_decode",
           "kvlab_layers_decode", "kvlab_swiglu", "kvlab_top_k_entries")  # fmt: skip


def timed_functions(paths: list[str]) -> dict[str, list[float]]:
    """Wrap each function or method named ``module:Owner.name`` (or ``module:name``) in a
    timer: {path: [seconds, calls]}, added to by every call from now on. Plain functions
    and methods only (a staticmethod would be bound once wrapped)."""
    import importlib
    import time

    totals: dict[str, list[float]] = {}
    for path in paths:
        module, _, qualified = path.partition(":")
        *owners, name = qualified.split(".")
        owner = importlib.import_module(module)
        for part in owners:
            owner = getattr(owner, part)
        inner, total = getattr(owner, name), totals.setdefault(path, [0.0, 0])

        def call(*args, _inner=inner, _total=total, **kwargs):
            start = time.perf_counter()
            try:
                return _inner(*args, **kwargs)
            finally:
                _total[0] += time.perf_counter() - start
                _total[1] += 1

        setattr(owner, name, call)
    return totals


STREAM_C = r"""
#include <stdint.h>
#include <time.h>
static const float *buffer;
static int64_t floats, slices, turn, calls;
static double spent;
volatile float stream_sink;
static double now(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return t.tv_sec + 1e-9 * t.tv_nsec;
}
void stream_over(const float *data, int64_t slice_floats, int64_t count) {
  buffer = data, floats = slice_floats, slices = count, turn = 0;
}
double stream_spent(void) { return spent; }
int64_t stream_calls(void) { return calls; }
void stream_reset(void) { spent = 0, calls = 0; }
long stream_slice(void) { /* a stubbed kernel: the next slice read, a float a line */
  const double start = now();
  const float *slice = buffer + (turn++ % slices) * floats;
  float sum = 0.f;
#pragma omp parallel for reduction(+ : sum)
  for (int64_t i = 0; i < floats; i += 16) sum += slice[i];
  stream_sink = sum;
  spent += now() - start;
  calls++;
  return 0;
}
"""


def stream_stub(megabytes: float):
    """The C library of ``STREAM_C`` built (with kvlab's compiler) and pointed at 32 slices
    of ``megabytes`` each, on huge pages where the weights are, and the buffer (kept alive
    by the caller)."""
    import ctypes
    import subprocess
    import tempfile
    from pathlib import Path

    from kvlab.kernels import build, huge_pages

    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        (folder / "stream.c").write_text(STREAM_C)
        command = [build._compiler(), "-O2", "-fopenmp", "-fPIC", "-shared", "stream.c", "-o",
                   "s.so"]  # fmt: skip
        subprocess.run(command, cwd=folder, check=True)
        stream = ctypes.CDLL(str(folder / "s.so"))  # stays loaded once its file is gone
    stream.stream_spent.restype = ctypes.c_double
    stream.stream_calls.restype = ctypes.c_int64
    floats = int(megabytes * 2**20) // 4
    buffer = huge_pages.zeros([((32 * floats,), torch.float32)], "cpu")[0].fill_(1.0)
    stream.stream_over(ctypes.c_void_p(buffer.data_ptr()), ctypes.c_int64(floats), 32)
    return stream, buffer


def python_only_ms(name: str, prompt: list[int], args, rounds: int = 5) -> tuple:
    """(real, stubbed, polluted) median ms a decode step: the kernels real, then made
    no-ops (each a function of its own: ``kernel()`` declares argument types on it; extra
    arguments to a C function are harmless in the x86-64 calling convention), then (with
    ``args.pollute``, else None) made reads of ``args.pollute`` MB, their time taken off
    (polluted: that ms and the reads a step); and {function: (ms a step, calls a step)}
    over the last of those for ``args.time``."""
    import ctypes

    from kvlab.kernels import build
    from kvlab.models import fused_layer

    model = load_weights(WEIGHTS[name])
    engine = Engine(model, cache_factory(args.cache, model, {})(static=False), compile=False)
    gen = GenerationConfig(args.steps + 1, stop_on_eos=False)
    engine.generate([prompt], gen)  # warm-up

    def median_step(stream=None) -> float:
        times = []
        for _ in range(rounds):
            run = engine.stream([prompt], gen)
            if stream is not None:
                stream.stream_reset()
            for _ in run:
                pass
            read = 0.0 if stream is None else stream.stream_spent()
            times.append((sum(run.stats.step_s) - read) * 1e3 / args.steps)
        return sorted(times)[rounds // 2]

    def stub(function) -> None:  # function(): a new function object each call
        for kernel in STUBBED:
            setattr(build.library(), kernel, function())
        build.kernel.cache_clear()
        fused_layer.weights_changed()  # the layers' plans take the stubs

    real = median_step()
    stub(lambda: ctypes.CDLL(None).labs)
    totals = {} if args.pollute else timed_functions(args.time)
    stubbed, steps, polluted = median_step(), rounds * args.steps, None
    if args.pollute:
        stream, _buffer = stream_stub(args.pollute)
        stub(lambda: ctypes.CDLL(stream._name).stream_slice)
        totals = timed_functions(args.time)
        polluted = (median_step(stream), stream.stream_calls() / args.steps)
    timed = {f: (s * 1e3 / steps, n / steps) for f, (s, n) in totals.items()}
    return real, stubbed, polluted, timed


def profile_steps(name: str, prompt: list[int], args) -> tuple[dict[str, list[float]], float]:
    """({op: [self ms per step, calls per step]}, wall ms per step) over the decode steps."""
    model = load_weights(WEIGHTS[name])
    engine = Engine(model, cache_factory(args.cache, model, {})(static=args.compile),
                    compile=args.compile)  # fmt: skip
    gen = GenerationConfig(args.steps + 1, stop_on_eos=False)
    engine.generate([prompt], gen)  # warm-up (and compilation)
    run = engine.stream([prompt], gen)
    steps = iter(run)
    next(steps)  # prefill and first token, outside the profile
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in steps:
            pass
    wall = sum(run.stats.step_s) * 1e3 / args.steps
    ops: dict[str, list[float]] = defaultdict(lambda: [0.0, 0.0])
    for event in prof.key_averages():
        ops[event.key][0] += event.self_cpu_time_total / 1e3 / args.steps
        ops[event.key][1] += event.count / args.steps
    return ops, wall


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--weights", default="fp32,bf16,int8,int4", type=lambda s: s.split(","))
    parser.add_argument("--cache", default="full")
    parser.add_argument("--depth", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--top", type=int, default=12)
    parser.add_argument("--compile", action="store_true")
    parser.add_argument("--python-only", action="store_true")
    parser.add_argument("--time", default=[], type=lambda s: s.split(","),
                        help="with --python-only: module:Class.method,... to time")  # fmt: skip
    parser.add_argument("--pollute", type=float, default=0.0,
                        help="with --python-only: MB each stubbed kernel call reads")  # fmt: skip
    args = parser.parse_args()
    prompt = wikitext_prompt(args.depth)
    if args.python_only:  # one weight format: the no-ops stay in the process
        if len(args.weights) != 1:
            parser.error(f"--python-only takes one weight format, got {','.join(args.weights)}")
        real, stubbed, polluted, timed = python_only_ms(args.weights[0], prompt, args)
        print(f"{args.weights[0]} cache={args.cache} depth {args.depth}: {real:.2f} ms a step, "
              f"{stubbed:.2f} ms with every C kernel a no-op")  # fmt: skip
        if polluted is not None:
            print(f"  {polluted[0]:.2f} ms with every C kernel a read of {args.pollute:g} MB "
                  f"({polluted[1]:.1f} a step), the reads' time taken off")  # fmt: skip
        for function, (ms, calls) in timed.items():
            print(f"  {function}: {ms:.3f} ms a step ({calls:.1f} calls)")
        return
    label_kvlab_kernels()
    env = environment()
    print(f"decode-step profile, SmolLM2-135M, cache={args.cache}, depth {args.depth}, "
          f"{args.steps} steps, compile={args.compile}, {env['cpu']}, "
          f"{torch.get_num_threads()} threads, torch {env['torch']}")  # fmt: skip
    with torch.inference_mode():
        for name in args.weights:
            ops, wall = profile_steps(name, prompt, args)
            ranked = sorted(ops.items(), key=lambda kv: -kv[1][0])
            profiled = sum(ms for ms, _ in ops.values())
            calls = sum(n for _, n in ops.values())
            print(f"\n### {name}: {wall:.2f} ms a step (profiled: {profiled:.2f} ms of self "
                  f"time in {calls:.0f} op calls)\n")  # fmt: skip
            print("| op | self ms / step | share | calls / step |")
            print("|---|---:|---:|---:|")
            for op, (ms, count) in ranked[: args.top]:
                print(f"| `{op}` | {ms:.2f} | {ms / profiled:.0%} | {count:.0f} |")
            rest = ranked[args.top :]
            rest_ms = sum(ms for _, (ms, _) in rest)
            print(f"| {len(rest)} other ops | {rest_ms:.2f} | {rest_ms / profiled:.0%} | "
                  f"{sum(n for _, (_, n) in rest):.0f} |")  # fmt: skip


if __name__ == "__main__":
    main()
