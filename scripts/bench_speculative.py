"""Speculative decoding across KV strategies on the default model, in one process: for each
strategy and each draft, decode tok/s against the same strategy without speculation
(ratios measured side by side), acceptance, tokens per step, drafting and verification
time, and whether the greedy text equals the plain run's. Two workloads, greedy, batch 1:
input-grounded (the instruct model asked to repeat a WikiText-2 passage it is given:
prompt lookup's home) and open-ended (the passage continued). Strategies that cannot
speculate get a row with the reason.

    python scripts/bench_speculative.py --passage-tokens 384 --new-tokens 96 --rounds 2

``--compile``: every engine's one-token steps (the target's and each model draft's) run
under ``torch.compile`` over static caches, as ``engine.compile`` runs them.
"""

from __future__ import annotations

import argparse
import statistics

import torch

from kvlab.cache import build_cache
from kvlab.config import ModelConfig, QuantConfig
from kvlab.data import wikitext2_test_text
from kvlab.engine import Engine, GenerationConfig
from kvlab.engine.metrics import generation_metrics
from kvlab.kernels.build import cpu_identity
from kvlab.run import load_run_model
from kvlab.speculative import SpecConfig
from kvlab.speculative.drafts import ModelDraft, early_exit
from kvlab.workload import text_windows

K = 4
STRATEGIES = {
    "full": {},
    "paged": {},
    "int8": dict(rollback=K),
    "int4": dict(rollback=K),
    "sliding": dict(window=256, rollback=K),
    "evict": dict(scorer="snapkv", ratio=0.5),
    "compressed": {},
}
INT4 = dict(bits=4, group_size=32, symmetric=False)


def workloads(tokenizer, passage_tokens: int) -> dict[str, list[int]]:
    passage_ids = text_windows(tokenizer, wikitext2_test_text(), passage_tokens, 2)[1]
    passage = tokenizer.decode(passage_ids)
    ask = f"Repeat the following text exactly, word for word.\n\n{passage}"
    chat = [{"role": "user", "content": ask}]
    text = tokenizer.apply_chat_template(chat, add_generation_prompt=True, tokenize=False)
    grounded = tokenizer.encode(text, add_special_tokens=False)
    return {"input-grounded": grounded, "open-ended": passage_ids}


def drafts(model, args) -> dict[str, tuple[SpecConfig, object]]:
    """Draft label -> (spec, draft object or None for prompt lookup)."""
    device = model.embed_tokens.weight.device
    int4_model, _ = load_run_model(ModelConfig(), QuantConfig("rtn", INT4), device)

    compiled = {"compile": args.compile, "reason": "--compile"}

    def over(draft_model, cache="full", options=None):
        draft_cache = build_cache(cache, draft_model.cache_spec(), options or {}, args.compile)
        return ModelDraft(draft_model, draft_cache, compiled)

    return {
        "ngram": (SpecConfig("ngram", K), None),
        "self int4 weights": (SpecConfig("self", K), over(int4_model)),
        "self int4/int4": (
            SpecConfig("self", K),
            over(int4_model, "int4", dict(rollback=K, residual=128)),
        ),
        f"layerskip L={args.exit_layer}": (
            SpecConfig("layerskip", K, layers=args.exit_layer),
            over(early_exit(model, args.exit_layer)),
        ),
    }


def generate(engine, prompt, new_tokens, spec=None):
    cfg = GenerationConfig(new_tokens, stop_on_eos=False, spec=spec or SpecConfig())
    return engine.generate([prompt], cfg)


def measure(model, strategy, options, prompt, args, spec=None, draft=None) -> dict:
    """Median decode tok/s over rounds (after a warm-up, which compiles where ``--compile``
    asks) of one engine, the metrics and tokens of the last."""
    cache = build_cache(strategy, model.cache_spec(), options, static=args.compile)
    engine = Engine(model, cache, draft=draft, compile=args.compile)
    generate(engine, prompt, args.new_tokens, spec)  # warm-up: the rounds' shapes, compiled
    speeds, run = [], None
    for _ in range(args.rounds):
        run = generate(engine, prompt, args.new_tokens, spec)
        speeds.append(generation_metrics(run.stats)["decode_tok_s"])
    return {"tok_s": statistics.median(speeds), "metrics": generation_metrics(run.stats),
            "tokens": run.tokens[0]}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--passage-tokens", type=int, default=384)
    parser.add_argument("--new-tokens", type=int, default=96)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--exit-layer", type=int, default=15)
    parser.add_argument("--only", default=",".join(STRATEGIES))
    parser.add_argument("--compile", action="store_true")
    args = parser.parse_args()
    torch.manual_seed(0)
    model, tokenizer = load_run_model(ModelConfig(), QuantConfig(), torch.device("cpu"))
    prompts, candidates = workloads(tokenizer, args.passage_tokens), drafts(model, args)
    cpu = cpu_identity().splitlines()[0].split(":")[1].strip()
    steps = "compiled" if args.compile else "eager"
    print(f"smollm2-135m fp32, CPU {cpu}, threads "
          f"{torch.get_num_threads()}, k={K}, {args.new_tokens} new tokens, greedy, batch 1, "
          f"median of {args.rounds} rounds, {steps} steps")  # fmt: skip
    print(
        "\n| workload | strategy | draft | tok/s | vs none | acceptance | tokens/step "
        "| draft ms | verify ms | text = none |"
    )
    print("|---|---|---|---:|---:|---:|---:|---:|---:|---:|")
    for workload, prompt in prompts.items():
        for strategy in args.only.split(","):
            rows(model, strategy, STRATEGIES[strategy], workload, prompt, candidates, args)


def rows(model, strategy, options, workload, prompt, candidates, args) -> None:
    plain = measure(model, strategy, options, prompt, args)
    head = f"| {workload} ({len(prompt)} tok) | {strategy} |"
    print(f"{head} none | {plain['tok_s']:.1f} | 1.00 | | 1.00 | | | |", flush=True)
    for label, (spec, draft) in candidates.items():
        try:
            got = measure(model, strategy, options, prompt, args, spec, draft)
        except ValueError as exc:
            reason = str(exc).split(" cannot: ")[-1].split("; allowed")[0]
            print(f"{head} {label} | refused: {reason} | | | | | | |", flush=True)
            continue
        m = got["metrics"]
        same = "yes" if got["tokens"] == plain["tokens"] else "NO"
        ratio = got["tok_s"] / plain["tok_s"]
        print(f"{head} {label} | {got['tok_s']:.1f} | {ratio:.2f} | "
              f"{m['spec/acceptance_rate']:.2f} | {m['spec/tokens_per_step']:.2f} | "
              f"{m['spec/draft_ms']:.1f} | {m['spec/verify_ms']:.1f} | {same} |",
              flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
