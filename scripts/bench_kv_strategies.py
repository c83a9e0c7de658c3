"""Every KV strategy on the default model: KV bytes, TTFT, ITL (ratios to ``full``) and
greedy-token agreement with ``full``; Hugging Face's QuantizedCache (quanto) as a peer; and
the paged cache's waste and prefix sharing on a batch of 16. Not a test: timings are noisy.

    pip install -e '.[bench]'   # optimum-quanto, for the HF QuantizedCache peer
    python scripts/bench_kv_strategies.py --prompt-len 4096 --new-tokens 128
"""

from __future__ import annotations

import argparse
import random

import torch

import kvlab
from kvlab.analysis.hf_baseline import tensor_bytes, timed_generate
from kvlab.cache import build_cache
from kvlab.data import wikitext2_test_text
from kvlab.engine import Engine, GenerationConfig
from kvlab.engine.timing import percentile
from kvlab.models import resolve_checkpoint
from kvlab.workload import build_prompts, text_windows

STRATEGIES = [
    ("full", {}),
    ("int8", {}),
    ("int4", {}),
    ("int2", {}),
    ("int4", {"key_axis": "token"}),
    ("sliding", {"window": 1024}),
    ("sliding", {"window": 1024, "kv_bits": 4}),
    ("gqa_shared", {"factor": 1}),
    ("gqa_shared", {"factor": 3}),
    ("paged", {}),
    ("paged", {"kv_bits": 4}),
    ("compressed", {}),
]


def agreement(tokens: list[int], reference: list[int], count: int) -> tuple[int, int]:
    """(equal positions among the first ``count``, index of the first difference)."""
    pairs = list(zip(tokens[:count], reference[:count], strict=True))
    first = next((i for i, (a, b) in enumerate(pairs) if a != b), count)
    return sum(a == b for a, b in pairs), first


def kvlab_rows(model, prompt, args) -> list[dict]:
    rows, reference = [], None
    chosen = [(n, o) for n, o in STRATEGIES if n == "full" or not args.only or n in args.only]
    for name, options in chosen:
        engine = Engine(model, build_cache(name, model.cache_spec(), options))
        engine.generate([prompt[:64]], GenerationConfig(4, stop_on_eos=False))  # warm-up
        run = engine.generate([prompt], GenerationConfig(args.new_tokens, stop_on_eos=False))
        reference = reference or run.tokens[0]
        equal, first = agreement(run.tokens[0], reference, args.agree_tokens)
        rows.append(
            dict(
                strategy=name,
                options=options,
                kv_bytes=run.stats.kv_peak.held_bytes,
                ttft_ms=run.stats.ttft_s * 1e3,
                itl_ms_p50=percentile(run.stats.step_s, 50) * 1e3,
                agree=equal,
                first_diff=first,
            )
        )
        print(rows[-1], flush=True)
    return rows


def hf_rows(prompt, args) -> list[dict]:
    import importlib.util

    from transformers import AutoModelForCausalLM

    if importlib.util.find_spec("optimum.quanto") is None:
        raise SystemExit(
            "the HF QuantizedCache peer needs optimum-quanto: "
            "pip install -e '.[bench]', or pass --skip-hf"
        )

    hf = AutoModelForCausalLM.from_pretrained(
        resolve_checkpoint("smollm2-135m"), dtype=torch.float32
    ).eval()
    rows, reference = [], None
    quanto = dict(cache_implementation="quantized", cache_config={"backend": "quanto", "nbits": 4})
    with torch.inference_mode():
        for label, kwargs in (("hf DynamicCache", {}), ("hf QuantizedCache quanto int4", quanto)):
            timed_generate(hf, prompt[:64], 4, **kwargs)  # warm-up
            ttft, itl, tokens, out = timed_generate(hf, prompt, args.new_tokens, **kwargs)
            reference = reference or tokens
            equal, first = agreement(tokens, reference, args.agree_tokens)
            rows.append(
                dict(
                    strategy=label,
                    options={},
                    kv_bytes=tensor_bytes(out.past_key_values),
                    ttft_ms=ttft * 1e3,
                    itl_ms_p50=percentile(itl, 50) * 1e3,
                    agree=equal,
                    first_diff=first,
                )
            )
            print(rows[-1], flush=True)
    return rows


def paged_batch(model, tokenizer, args) -> None:
    """Waste of a batch of 16 mixed-length prompts; bytes saved by a shared prefix."""
    rng = random.Random(0)
    lengths = [rng.randint(args.batch_min, args.batch_max) for _ in range(16)]
    windows = text_windows(tokenizer, wikitext2_test_text(), max(*lengths, 1024 + 64), 16)
    prompts = [w[:n] for w, n in zip(windows, lengths, strict=True)]
    cfg = GenerationConfig(args.batch_new_tokens, stop_on_eos=False)
    for label, batch in (
        ("mixed lengths", prompts),
        ("shared 1024-token prefix", [windows[0][:1024] + w[:64] for w in windows]),
    ):
        for sharing in (False, True):
            cache = build_cache("paged", model.cache_spec(), {"prefix_sharing": sharing})
            report = Engine(model, cache).generate(batch, cfg).stats.kv_peak
            d = report.details
            stored = report.used_bytes
            print(
                f"paged {label:26s} sharing={sharing!s:5s} blocks_in_use={d['blocks_in_use']} "
                f"in_use_bytes={d['in_use_bytes']} "
                f"waste={d['waste_bytes'] / d['in_use_bytes']:.2%} "
                f"contiguous_bytes={d['contiguous_bytes']} "
                f"contiguous_waste={1 - stored / d['contiguous_bytes']:.2%} "
                f"shared_saved_bytes={d['shared_saved_bytes']}",
                flush=True,
            )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompt-len", type=int, default=4096)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--agree-tokens", type=int, default=64)
    ap.add_argument("--batch-min", type=int, default=128)
    ap.add_argument("--batch-max", type=int, default=1024)
    ap.add_argument("--batch-new-tokens", type=int, default=32)
    ap.add_argument("--skip-hf", action="store_true")
    ap.add_argument(
        "--only",
        type=lambda s: s.split(","),
        default=[],
        help="strategies to run besides full (the reference); also skips the rest",
    )
    args = ap.parse_args()
    model, tokenizer = kvlab.load_model("smollm2-135m")
    prompt = build_prompts(tokenizer, args.prompt_len, 1)[0]
    rows = kvlab_rows(model, prompt, args)
    rows += [] if args.skip_hf or args.only else hf_rows(prompt, args)
    if not args.only or "paged" in args.only:
        paged_batch(model, tokenizer, args)
    full, hf_full = rows[0], next((r for r in rows if r["strategy"] == "hf DynamicCache"), None)
    print(
        f"\nprompt_len={args.prompt_len} new_tokens={args.new_tokens} dtype=float32 "
        f"threads={torch.get_num_threads()}; agreement over the first {args.agree_tokens} tokens"
    )
    print(
        "| strategy | options | KV bytes | KV / full | TTFT ms | ITL p50 ms | ITL / full "
        "| tokens equal | first diff |"
    )
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        base = hf_full if r["strategy"].startswith("hf") else full
        print(
            f"| {r['strategy']} | {r['options'] or ''} | {r['kv_bytes']:,} | "
            f"{r['kv_bytes'] / base['kv_bytes']:.3f} | {r['ttft_ms']:.0f} | {r['itl_ms_p50']:.2f} "
            f"| {r['itl_ms_p50'] / base['itl_ms_p50']:.2f} | {r['agree']}/{args.agree_tokens} "
            f"| {r['first_diff']} |"
        )


if __name__ == "__main__":
    main()
