"""kvpress 0.5.5 as a peer, run in its own environment (``bash scripts/peer_kvpress.sh``;
then ``.venv-kvpress/bin/python experiments/eviction_ruler/kvpress_peer.py ...``). It does
not import kvlab: it reads kvlab's converted checkpoint (a plain HF Llama directory) and
kvlab's generated items, and writes what kvpress does with them.

  fixture CHECKPOINT IDS_JSON OUT_JSON   kept (layer, head, token) sets of each press of
                                         FIXTURE_PRESSES at ratio 0.5 on one prompt, by
                                         press name (kvlab's scorers name the press they
                                         equal; tests/test_evict.py compares them)
  bytes CHECKPOINT ITEMS_JSONL OUT_JSON  bytes kvpress's cache holds after compressing the
                                         first item's context: no press, SnapKV and
                                         AdaKV(SnapKV) at ratio 0.5
  ruler CHECKPOINT ITEMS_JSONL OUT_JSON [name[=Press]:ratio ...]
                                         RULER answers and scores through kvpress's
                                         pipeline (context compressed, question after),
                                         each under kvlab's scorer name (its press: a
                                         kvpress class, or PRESSES[name])
"""

from __future__ import annotations

import json
import sys
import time
from contextlib import nullcontext

import kvpress
import torch
from kvpress import (
    ExpectedAttentionPress,
    KeyDiffPress,
    KnormPress,
    ObservedAttentionPress,
    RandomPress,
    SnapKVPress,
    StreamingLLMPress,
    TOVAPress,
)
from transformers import AutoModelForCausalLM, AutoTokenizer, pipeline

PRESSES = {
    "knorm": KnormPress, "snapkv": SnapKVPress, "tova": TOVAPress,
    "streaming": StreamingLLMPress, "expected_attention": ExpectedAttentionPress,
    "h2o": ObservedAttentionPress, "random": RandomPress,
}  # fmt: skip
# kvpress's scorer presses that score what kvlab's Observation holds (the keys as cached,
# the attention of the last queries) deterministically: the fixture's catalogue, kvpress's
# side, whatever kvlab implements; a kvlab scorer that equals one names it (kvpress=...)
FIXTURE_PRESSES = (KnormPress, SnapKVPress, TOVAPress, StreamingLLMPress, KeyDiffPress)


def load(checkpoint: str, attn: str = "sdpa"):
    model = AutoModelForCausalLM.from_pretrained(
        checkpoint, dtype=torch.float32, attn_implementation=attn
    )
    return model.eval(), AutoTokenizer.from_pretrained(checkpoint)


def kept_sets(model, press, ids: list[int]) -> list[list[str]]:
    """Per layer and KV head, the kept token indices as a bit string over the prompt:
    the top-k of the press's own scores, exactly as ``ScorerPress.compress`` takes them."""
    kept: dict[int, torch.Tensor] = {}
    score = press.score

    def recording(module, hidden_states, keys, values, attentions, kwargs):
        scores = score(module, hidden_states, keys, values, attentions, kwargs)
        n_kept = int(keys.shape[2] * (1 - press.compression_ratio))
        kept[module.layer_idx] = scores.topk(n_kept, dim=-1).indices[0]  # (H_kv, n_kept)
        return scores

    press.score = recording
    with torch.inference_mode(), press(model):
        model.model(input_ids=torch.tensor([ids]))
    length = len(ids)
    out = []
    for layer in range(len(kept)):
        heads = []
        for indices in kept[layer]:
            bits = ["0"] * length
            for i in indices.tolist():
                bits[i] = "1"
            heads.append("".join(bits))
        out.append(heads)
    return out


def fixture(checkpoint: str, ids_path: str, out_path: str) -> None:
    model, _ = load(checkpoint)
    ids = json.load(open(ids_path))["ids"]
    sets = {
        press.__name__: kept_sets(model, press(compression_ratio=0.5), ids)
        for press in FIXTURE_PRESSES
    }
    json.dump({"ids": ids, "ratio": 0.5, "kvpress": "0.5.5", "kept": sets}, open(out_path, "w"))


def cache_bytes(checkpoint: str, items_path: str, out_path: str) -> None:
    from kvpress import AdaKVPress
    from transformers import DynamicCache

    model, tokenizer = load(checkpoint)
    item = json.loads(open(items_path).readline())
    pipe = pipeline("kv-press-text-generation", model=model, tokenizer=tokenizer, device="cpu")
    context = pipe.preprocess(item["context"], [item["question"]], "", 100_000)["context_ids"]
    presses = {
        "none": None, "snapkv@0.5": SnapKVPress(compression_ratio=0.5),
        "adakv(snapkv)@0.5": AdaKVPress(SnapKVPress(compression_ratio=0.5)),
    }  # fmt: skip
    out = {"context_tokens": context.shape[1]}
    for name, press in presses.items():
        cache = DynamicCache()
        with torch.inference_mode(), press(model) if press else nullcontext():
            model.model(input_ids=context, past_key_values=cache)
        held = sum(t.numel() * t.element_size() for layer in cache.layers
                   for t in (layer.keys, layer.values))  # fmt: skip
        out[name] = held
        print(name, held, flush=True)
    json.dump(out, open(out_path, "w"), indent=1)


def string_match_all(answer: str, references: list[str]) -> float:
    lowered = answer.lower()
    return sum(r.lower() in lowered for r in references) / len(references)


def ruler(checkpoint: str, items_path: str, out_path: str, specs: list[str]) -> None:
    items = [json.loads(line) for line in open(items_path)]
    needs_eager = any(s.split(":")[0] == "h2o" for s in specs)
    model, tokenizer = load(checkpoint, "eager" if needs_eager else "sdpa")
    pipe = pipeline("kv-press-text-generation", model=model, tokenizer=tokenizer, device="cpu")
    results = []
    for spec in specs:
        named, ratio = spec.split(":")
        name, _, cls = named.partition("=")
        kind = getattr(kvpress, cls) if cls else PRESSES.get(name)
        press = None if name == "none" else kind(compression_ratio=float(ratio))
        for item in items:
            start = time.perf_counter()
            answer = pipe(
                item["context"], question=item["question"], answer_prefix=item["answer_prefix"],
                press=press, max_new_tokens=item.get("max_new_tokens", 32),
            )["answer"]  # fmt: skip
            results.append({
                "press": name, "ratio": float(ratio), "task": item["task"], "answer": answer,
                "score": 100 * string_match_all(answer, item["references"]),
                "seconds": time.perf_counter() - start,
            })  # fmt: skip
            print(name, ratio, item["task"], results[-1]["score"], repr(answer[:60]), flush=True)
            json.dump(results, open(out_path, "w"), indent=1)


if __name__ == "__main__":
    torch.set_grad_enabled(False)
    command, *args = sys.argv[1:]
    if command == "fixture":
        fixture(*args)
    elif command == "bytes":
        cache_bytes(*args)
    else:
        ruler(args[0], args[1], args[2], args[3:])
