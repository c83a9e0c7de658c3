"""Every KV strategy on the default model, side by side in one process: KV bytes, TTFT, ITL
(ratios to ``full``), greedy-token agreement with ``full``, and how close decode comes to
the memory-bandwidth roof; Hugging Face's DynamicCache and QuantizedCache (quanto int4) as
peers; ``paged`` vs ``full`` decode throughput on a batch of 16 mixed lengths. Decode
steps of all strategies run interleaved (one step of each in turn), in rounds (medians
over rounds), so a slow spell of the machine hits them all alike. Not a test: timings are
noisy, read ratios.

    pip install -e '.[bench]'   # optimum-quanto, for the HF QuantizedCache peer
    python scripts/bench_kv_strategies.py --prompt-len 4096 --new-tokens 64 --rounds 3
"""

from __future__ import annotations

import argparse
import random
import statistics

import torch

import kvlab
from kvlab.analysis.hf_baseline import tensor_bytes, timed_generate
from kvlab.analysis.roofline import decode_roof
from kvlab.cache import build_cache
from kvlab.cache.codecs import token_formats
from kvlab.data import wikitext2_test_text
from kvlab.engine import Engine, GenerationConfig
from kvlab.engine.timing import percentile
from kvlab.models import resolve_checkpoint
from kvlab.models.loading import random_model
from kvlab.quiet import quiet_third_party
from kvlab.workload import build_prompts, text_windows

STRATEGIES = [
    ("full", {}),
    ("int8", {}),
    ("int4", {}),
    ("int2", {}),
    ("int4", {"key_axis": "token"}),
    ("sliding", {"window": 1024}),
    ("sliding", {"window": 1024, "kv_bits": 4}),
    ("gqa_shared", {"factor": 3}),
    ("paged", {}),
    ("paged", {"kv_bits": 4}),
    ("quest", {"token_budget": 1024}),
    ("compressed", {}),
]


def format_rows() -> list[tuple[str, dict]]:
    """``full`` in every registered per-token format (kvlab/cache/codecs/formats.py) at each
    of its widths, a scale every 32 channels where the format lets a group be chosen (a
    norm a head's row where it quantizes rotated rows), with the rotation a format needs."""
    rows = []
    for name, kind in sorted(token_formats().items()):
        for bits in kind.bits:
            group = kind.block or (64 if kind.rotation else 32)
            options = {"kv_bits": bits, "kv_format": name, "kv_group_size": group}
            rows.append(("full", options | ({"rotate": kind.rotation} if kind.rotation else {})))
    return rows


STRATEGIES += format_rows()


def agreement(tokens: list[int], reference: list[int], count: int) -> tuple[int, int]:
    """(equal positions among the first ``count``, index of the first difference)."""
    count = min(count, len(reference))
    pairs = list(zip(tokens[:count], reference[:count], strict=True))
    first = next((i for i, (a, b) in enumerate(pairs) if a != b), count)
    return sum(a == b for a, b in pairs), first


def label(name: str, options: dict) -> str:
    return name + "".join(f" {k}={v}" for k, v in options.items())


def selected(name: str, options: dict, only: list[str]) -> bool:
    """The reference (``full`` exact) always; the rest when ``--only`` is empty or one of
    its entries is the strategy's name or part of its label (``kv_format``: the fp rows)."""
    if (name == "full" and not options) or not only:
        return True
    return any(entry == name or (entry != "full" and entry in label(name, options))
               for entry in only)  # fmt: skip


def kvlab_rows(model, prompt, args) -> list[dict]:
    chosen = [(n, o) for n, o in STRATEGIES if selected(n, o, args.only)]
    cfg = GenerationConfig(args.new_tokens, stop_on_eos=False, prefill_chunk=args.chunk)
    engines = {}
    for name, options in chosen:  # warm-up, and compilation when asked
        cache = build_cache(name, model.cache_spec(), options, static=args.compile)
        engine = Engine(model, cache, compile=args.compile)
        engine.generate([prompt[:600]], GenerationConfig(4, stop_on_eos=False, prefill_chunk=512))
        engines[label(name, options)] = engine
    runs: dict[str, list] = {key: [] for key in engines}
    for round_ in range(args.rounds):
        for key, run in lockstep(engines, [prompt], cfg).items():
            runs[key].append(run)
            itl = percentile(run.stats.step_s, 50) * 1e3
            print(f"round {round_} {key:32s} ttft_ms={run.stats.ttft_s * 1e3:8.0f} "
                  f"itl_ms_p50={itl:7.2f}", flush=True)  # fmt: skip
    reference = runs["full"][0].tokens[0]
    rows = []
    for key, key_runs in runs.items():
        equal, first = agreement(key_runs[0].tokens[0], reference, args.agree_tokens)
        peak = key_runs[0].stats.kv_peak
        rows.append(dict(
            strategy=key, kv_bytes=peak.held_bytes, kv_used=peak.used_bytes,
            ttft_ms=statistics.median(r.stats.ttft_s for r in key_runs) * 1e3,
            itl_ms_p50=statistics.median(percentile(r.stats.step_s, 50) for r in key_runs) * 1e3,
            agree=equal, first_diff=first,
        ))  # fmt: skip
    return rows


def lockstep(engines: dict[str, Engine], prompts: list[list[int]], cfg) -> dict:
    """One generation per engine: every prefill in turn, then the decode steps interleaved
    (one step of each engine, then the next step of each), so a slow spell of a shared
    machine lands on every strategy alike instead of on whichever ran then."""
    runs = {key: engine.stream(prompts, cfg) for key, engine in engines.items()}
    steps = {key: iter(run) for key, run in runs.items()}
    for step in steps.values():
        next(step)  # the prefill and first token
    while steps:
        for key in list(steps):
            if next(steps[key], None) is None:
                del steps[key]
    return runs


def hf_peers(args):
    """Hugging Face's model and the caches it is timed with: the default checkpoint with
    DynamicCache and quanto's int4 QuantizedCache, or with --random-weights a model of the
    same config built by transformers (DynamicCache), on the run's device and dtype."""
    import importlib.util

    from transformers import AutoConfig, AutoModelForCausalLM

    dtype = getattr(torch, args.dtype)
    if args.random_weights:
        config = AutoConfig.from_pretrained(args.random_weights)
        with torch.device(args.device):
            hf = AutoModelForCausalLM.from_config(config, dtype=dtype)
        return hf.eval(), {"hf DynamicCache": {}}
    if importlib.util.find_spec("optimum.quanto") is None:
        raise SystemExit(
            "the HF QuantizedCache peer needs optimum-quanto: "
            "pip install -e '.[bench]', or pass --skip-hf"
        )
    checkpoint = resolve_checkpoint("smollm2-135m")
    hf = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=dtype).to(args.device).eval()
    quanto = dict(cache_implementation="quantized", cache_config={"backend": "quanto", "nbits": 4})
    return hf, {"hf DynamicCache": {}, "hf QuantizedCache quanto int4": quanto}


def hf_rows(prompt, args) -> list[dict]:
    hf, peers = hf_peers(args)
    runs: dict[str, list] = {key: [] for key in peers}
    with torch.inference_mode():
        for kwargs in peers.values():
            timed_generate(hf, prompt[:64], 4, **kwargs)  # warm-up
        for _ in range(args.rounds):
            for key, kwargs in peers.items():
                runs[key].append(timed_generate(hf, prompt, args.new_tokens, **kwargs))
                print(f"{key} itl_ms_p50={percentile(runs[key][-1][1], 50) * 1e3:.2f}", flush=True)
    reference, rows = runs["hf DynamicCache"][0][2], []
    for key, key_runs in runs.items():
        equal, first = agreement(key_runs[0][2], reference, args.agree_tokens)
        kv = tensor_bytes(key_runs[0][3].past_key_values)
        rows.append(dict(
            strategy=key, kv_bytes=kv, kv_used=kv,
            ttft_ms=statistics.median(r[0] for r in key_runs) * 1e3,
            itl_ms_p50=statistics.median(percentile(r[1], 50) for r in key_runs) * 1e3,
            agree=equal, first_diff=first,
        ))  # fmt: skip
    return rows


def batch_throughput(model, tokenizer, args) -> None:
    """Decode tokens/s of ``paged`` and ``full`` on the same 16 prompts of mixed lengths,
    and paged's waste and prefix sharing."""
    rng = random.Random(0)
    lengths = [rng.randint(args.batch_min, args.batch_max) for _ in range(16)]
    windows = text_windows(tokenizer, wikitext2_test_text(), max(*lengths, 1024 + 64), 16)
    prompts = [w[:n] for w, n in zip(windows, lengths, strict=True)]
    cfg = GenerationConfig(args.batch_new_tokens, stop_on_eos=False)  # one-pass prefill
    engines = {n: Engine(model, build_cache(n, model.cache_spec())) for n in ("full", "paged")}
    speeds: dict[str, list[float]] = {n: [] for n in engines}
    for _ in range(args.rounds):
        for name, run in lockstep(engines, prompts, cfg).items():
            speeds[name].append(sum(run.stats.step_rows) / sum(run.stats.step_s))
    for name, values in speeds.items():
        print(f"batch of 16 ({min(lengths)}-{max(lengths)} tokens) {name}: "
              f"decode_tok_s={statistics.median(values):.1f}", flush=True)  # fmt: skip
    for label_, batch in (
        ("mixed lengths", prompts),
        ("shared 1024-token prefix", [windows[0][:1024] + w[:64] for w in windows]),
    ):
        for sharing in (False, True):
            cache = build_cache("paged", model.cache_spec(), {"prefix_sharing": sharing})
            report = Engine(model, cache).generate(batch, cfg).stats.kv_peak
            d = report.details
            print(
                f"paged {label_:26s} sharing={sharing!s:5s} blocks_in_use={d['blocks_in_use']} "
                f"waste={d['waste_bytes'] / d['in_use_bytes']:.2%} "
                f"contiguous_waste={1 - report.used_bytes / d['contiguous_bytes']:.2%} "
                f"shared_saved_bytes={d['shared_saved_bytes']}",
                flush=True,
            )


def print_table(rows: list[dict], roof, args) -> None:
    full = rows[0]
    hf_full = next((r for r in rows if r["strategy"] == "hf DynamicCache"), None)
    weights = "random weights" if args.random_weights else "smollm2-135m"
    print(f"\n{weights} on {args.device} prompt_len={args.prompt_len} "
          f"new_tokens={args.new_tokens} chunk={args.chunk} dtype={args.dtype} "
          f"threads={torch.get_num_threads()} compile={args.compile} "
          f"rounds={args.rounds}; agreement over the first {args.agree_tokens} tokens")  # fmt: skip
    print(f"{roof}\n")
    print("| strategy | KV bytes | KV / full | TTFT ms | TTFT / full | ITL p50 ms | ITL / full "
          "| roof ms | ITL / roof | tokens equal | first diff |")  # fmt: skip
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    agreed = min(args.agree_tokens, args.new_tokens)
    for r in rows:
        base = hf_full if r["strategy"].startswith("hf") else full
        floor = roof.itl_s(r["kv_used"]) * 1e3
        print(
            f"| {r['strategy']} | {r['kv_bytes']:,} | {r['kv_bytes'] / base['kv_bytes']:.3f} | "
            f"{r['ttft_ms']:.0f} | {r['ttft_ms'] / base['ttft_ms']:.2f} | "
            f"{r['itl_ms_p50']:.2f} | {r['itl_ms_p50'] / base['itl_ms_p50']:.2f} | "
            f"{floor:.2f} | {r['itl_ms_p50'] / floor:.2f} | {r['agree']}/{agreed} | "
            f"{r['first_diff']} |"
        )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompt-len", type=int, default=4096)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--chunk", type=int, default=512, help="prefill chunk (0: one pass)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--agree-tokens", type=int, default=32)
    ap.add_argument("--compile", action="store_true", help="compiled decode steps")
    ap.add_argument("--batch-min", type=int, default=128)
    ap.add_argument("--batch-max", type=int, default=1024)
    ap.add_argument("--batch-new-tokens", type=int, default=32)
    ap.add_argument("--skip-hf", action="store_true")
    ap.add_argument("--skip-batch", action="store_true")
    ap.add_argument("--only", type=lambda s: s.split(","), default=[],
                    help="strategies to run besides full (the reference): names, or parts "
                         "of a label (kv_format: the fp8/fp4 rows); hf: the HF peers")  # fmt: skip
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--random-weights", metavar="CONFIG_JSON", default=None,
                    help="the default model's shape with random weights (timing only, e.g. on "
                         "a GPU machine the weights cannot reach)")  # fmt: skip
    args = ap.parse_args()
    quiet_third_party()
    dtype = getattr(torch, args.dtype)
    if args.random_weights:
        model, tokenizer = random_model(args.random_weights, dtype, args.device), None
        gen = torch.Generator().manual_seed(0)
        vocab = model.config.vocab_size
        prompt = torch.randint(0, vocab, (args.prompt_len,), generator=gen).tolist()
        args.skip_batch = True  # batches read WikiText through the tokenizer
    else:
        model, tokenizer = kvlab.load_model("smollm2-135m", dtype=dtype, device=args.device)
        prompt = build_prompts(tokenizer, args.prompt_len, 1)[0]
    rows = kvlab_rows(model, prompt, args)
    with_hf = not args.skip_hf and (not args.only or "hf" in args.only)
    rows += hf_rows(prompt, args) if with_hf else []
    if not args.skip_batch and (not args.only or "paged" in args.only):
        batch_throughput(model, tokenizer, args)
    print_table(rows, decode_roof(model, refresh=True), args)  # read in this run


if __name__ == "__main__":
    main()
