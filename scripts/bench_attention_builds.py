"""Two builds of kvlab's C kernels side by side in one process, on the decode attention of a
SmolLM2-135M-shaped cache (30 layers, 3 KV heads of 64 channels, 3 query heads each): the
builds take turns round after round, so a slow spell of a shared machine hits both, and the
ratio B/A is what to read. Also checks that both give the same output. Not a test.

    # the committed kernels (A) against the working tree's (B), every format at 4096 tokens
    python scripts/bench_attention_builds.py --a HEAD --tokens 4096

    # the kernels' compute alone: 30 calls over one layer's cache, which stays in L2/L3
    python scripts/bench_attention_builds.py --a HEAD --cases fp32,bf16 --tokens 1024 --layers 1

A and B are git revisions or folders of kernel sources (``*.c`` and ``*.h``).
"""

from __future__ import annotations

import argparse
import ctypes
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import torch

from kvlab.kernels import build
from kvlab.kernels.attention import backend_c
from kvlab.kernels.attention.segments import Segment, Stored
from kvlab.kernels.codes.int_codes import ChannelCodes, TokenCodes
from kvlab.tracking import environment

ROOT = Path(__file__).resolve().parent.parent
KERNELS = "kvlab/kernels"
CASES = ("fp32", "bf16", "kivi8", "kivi4", "tokens4", "topk", "paged", "mqa", "mqa-bf16")
# kivi: channel keys, token values; topk: CSA's decode, each KV head over the top half of
# ``tokens`` entries, a block a slot; paged: fp32 in blocks of 16 tokens, the row's table a
# shuffled pool; mqa: one KV head for all nine query heads (gqa_shared factor 3), fp32/bf16


def sources(spec: str, into: Path) -> Path:
    """A folder of kernel sources: ``spec`` itself, or its files at git revision ``spec``."""
    if Path(spec).is_dir():
        return Path(spec)
    listing = ["git", "ls-tree", "-r", "--name-only", f"{spec}:{KERNELS}"]
    names = subprocess.run(listing, cwd=ROOT, check=True, capture_output=True, text=True).stdout
    names = names.split()
    into.mkdir(parents=True)
    for name in names:
        if name.endswith((".c", ".h")):
            text = subprocess.run(["git", "show", f"{spec}:{KERNELS}/{name}"], cwd=ROOT,
                                  check=True, capture_output=True).stdout  # fmt: skip
            (into / name).parent.mkdir(parents=True, exist_ok=True)
            (into / name).write_bytes(text)
    return into


def compiled(folder: Path, out: Path, defines: tuple[str, ...] = ()) -> ctypes.CDLL:
    """The kernels of ``folder`` built as kvlab builds them, loaded; ``defines``: extra
    ``-D`` flags (``-DKVLAB_TIMERS``: kernel timers, see kvlab/kernels/include/timers.h)."""
    saved = build.SOURCES, build.HEADERS, build.FLAGS
    build.SOURCES, build.HEADERS = sorted(folder.rglob("*.c")), sorted(folder.rglob("*.h"))
    build.FLAGS = [*build.FLAGS, *defines]
    try:
        build._compile(build._compiler(), out)
    finally:
        build.SOURCES, build.HEADERS, build.FLAGS = saved
    return ctypes.CDLL(str(out))


def layer(case: str, tokens: int) -> Segment:
    k, v, q = torch.randn(1, 3, tokens, 64), torch.randn(1, 3, tokens, 64), torch.randn(1, 3, 3, 64)
    if case.endswith("bf16"):  # a bf16 model's query: bf16 values, widened
        q = q.to(torch.bfloat16).float()
    if case == "topk":
        return top_half(q, k, v)
    if case == "paged":
        return paged(q, k, v)
    if case.startswith("mqa"):
        dtype = torch.bfloat16 if case.endswith("bf16") else torch.float32
        keys, values = Stored(k[:, :1].to(dtype)), Stored(v[:, :1].to(dtype))
        table, lo, hi = (
            torch.zeros(1, 1, dtype=torch.int64),
            torch.tensor([0]),
            torch.tensor([tokens]),
        )
        return Segment(q.reshape(1, 1, 9, 64), keys, values, table, lo, hi)
    if case in ("fp32", "bf16"):
        dtype = torch.float32 if case == "fp32" else torch.bfloat16
        keys, values = Stored(k.to(dtype)), Stored(v.to(dtype))
    else:
        bits = int(case[-1])
        axis = "token" if case.startswith("tokens") else "channel"
        key_codec = TokenCodes(bits, 32) if axis == "token" else ChannelCodes(bits, 32)
        keys = Stored(*_first(key_codec.encode(k), f"{axis}_codes", bits, 32))
        values = Stored(*_first(TokenCodes(bits, 32).encode(v), "token_codes", bits, 32))
    table, lo, hi = torch.zeros(1, 1, dtype=torch.int64), torch.tensor([0]), torch.tensor([tokens])
    return Segment(q, keys, values, table, lo, hi)


def top_half(q, k, v) -> Segment:
    """Each KV head over its own half of the entries (Segment.per_head's layout)."""
    heads, tokens = k.shape[1], k.shape[2]
    chosen = torch.stack([torch.randperm(tokens)[: tokens // 2].sort().values for _ in range(3)])
    table = (torch.arange(heads)[:, None] * tokens + chosen).contiguous()
    lo, hi = torch.zeros(heads, dtype=torch.int64), torch.full((heads,), tokens // 2)
    single = [Stored(t.view(-1, 1, 1, t.shape[-1])) for t in (k, v)]
    return Segment(q.reshape(heads, 1, *q.shape[2:]), *single, table, lo, hi)


def paged(q, k, v, block: int = 16) -> Segment:
    """The row's tokens in blocks of ``block`` slots of a pool, in shuffled order (a paged
    store's layout: (blocks, H_kv, block, D))."""
    heads, tokens, dim = k.shape[1], k.shape[2], k.shape[3]
    blocks = -(-tokens // block)
    order = torch.randperm(blocks)

    def pool(x):
        padded = torch.zeros(1, heads, blocks * block, dim)
        padded[:, :, :tokens] = x
        pages = padded.view(heads, blocks, block, dim).transpose(0, 1)  # (blocks, H, block, D)
        out = torch.empty_like(pages)
        out[order] = pages
        return Stored(out.contiguous())

    table, lo, hi = order[None].contiguous(), torch.tensor([0]), torch.tensor([tokens])
    return Segment(q, pool(k), pool(v), table, lo, hi)


def _first(parts, fmt: str, bits: int, group: int) -> tuple:
    words, scale, zero = parts
    return words, fmt, bits, group, scale, zero


def use_library(library: ctypes.CDLL) -> None:
    """Every kernel call from now on goes to ``library`` (the callers look their functions
    up through ``build.kernel``, whose declared functions are dropped)."""
    build.library = lambda: library
    build.kernel.cache_clear()


def step_seconds(layers: list[Segment]) -> float:
    start = time.perf_counter()
    for segment in layers:
        backend_c.c_attention([segment], 0.125, torch.float32)
    return time.perf_counter() - start


def compare(libraries: dict[str, ctypes.CDLL], case: str, args) -> str:
    distinct = [layer(case, args.tokens) for _ in range(args.layers)]
    layers = [distinct[i % args.layers] for i in range(30)]
    times: dict[str, list[float]] = {name: [] for name in libraries}
    outputs = {}
    original = build.library
    try:
        for round_ in range(args.warmup + args.rounds):
            for name, library in libraries.items():
                use_library(library)
                seconds = step_seconds(layers)
                if round_ >= args.warmup:
                    times[name].append(seconds)
                outputs[name] = backend_c.c_attention([layers[0]], 0.125, torch.float32)
    finally:
        build.library = original
        build.kernel.cache_clear()
    a, b = (statistics.median(times[name]) * 1e3 for name in ("A", "B"))
    diff = (outputs["A"] - outputs["B"]).abs().max().item()
    return f"| {case} | {args.tokens} | {a:.2f} | {b:.2f} | {b / a:.2f} | {diff:.1e} |"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--a", default="HEAD", help="git revision or folder (default HEAD)")
    parser.add_argument("--b", default=str(ROOT / KERNELS), help="default: the working tree")
    parser.add_argument("--cases", default=",".join(CASES), type=lambda s: s.split(","))
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--rounds", type=int, default=21)
    parser.add_argument("--layers", type=int, default=30,
                        help="layers with caches of their own (1: every call reads one cache, "
                        "which stays in cache: the kernels' compute alone)")  # fmt: skip
    parser.add_argument("--warmup", type=int, default=3)
    args = parser.parse_args()
    torch.manual_seed(0)
    with tempfile.TemporaryDirectory() as tmp:
        folders = {"A": sources(args.a, Path(tmp) / "a"), "B": sources(args.b, Path(tmp) / "b")}
        libraries = {name: compiled(folder, Path(tmp) / f"{name}.so")
                     for name, folder in folders.items()}  # fmt: skip
        env = environment()
        print(f"decode attention, 30 calls over {args.layers} layers' caches x 3 KV heads x 64, "
              f"A = {args.a}, B = {args.b}; "
              f"{env['cpu']}, {torch.get_num_threads()} threads, torch {env['torch']}; "
              f"medians of {args.rounds} rounds, builds in turns\n")  # fmt: skip
        print("| case | tokens | A ms | B ms | B / A | max diff |\n|---|---:|---:|---:|---:|---:|")
        for case in args.cases:
            print(compare(libraries, case, args), flush=True)


if __name__ == "__main__":
    main()
