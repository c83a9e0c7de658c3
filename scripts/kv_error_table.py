"""The error each lossy KV setting costs against ``full`` on the default model: mean
next-token NLL increase, mean KL(full || setting) of the next-token distributions (the
``kld`` eval's) and top-1 agreement over 512 WikiText-2 tokens fed in chunks of 128 (so
every chunk after the first predicts from what the cache kept) — the protocol whose
bounds ``tests/test_quantized_cache.py`` checks — and the bytes the cache then holds per
stored token (counted from its tensors, scales and full-precision residual included) as a
fraction of ``full``'s. Not a test: it prints the table.

    python scripts/kv_error_table.py                     # every setting
    python scripts/kv_error_table.py "full kv_bits=4"    # the settings whose label has it
"""

from __future__ import annotations

import itertools
import sys

import torch

import kvlab
from kvlab.cache import build_cache
from kvlab.cache.codecs import token_formats
from kvlab.eval.kld import window_divergence
from kvlab.eval.perplexity import chunked_nll
from kvlab.quiet import quiet_third_party
from kvlab.workload import build_prompts

# the strategies' own lossy settings; every registered per-token format is added below
STRATEGIES = [
    ("int8", {}), ("int8", {"key_axis": "token"}), ("int4", {}), ("int4", {"key_axis": "token"}),
    ("int2", {}), ("int2", {"key_axis": "token"}), ("paged", {"kv_bits": 8}),
    ("paged", {"kv_bits": 4}), ("sliding", {"window": 1024, "kv_bits": 4}),
    ("sliding", {"window": 128, "sinks": 4}), ("gqa_shared", {"factor": 3}),
    ("gqa_shared", {"factor": 3, "merge": "first"}),
    ("int4", {"key_axis": "token", "rotate": "hadamard"}), ("int2", {"rotate": "hadamard"}),
    ("int2", {"key_axis": "token", "rotate": "hadamard"}),
]  # fmt: skip


def format_settings() -> list[tuple[str, dict]]:
    """``full`` in every registered per-token format (kvlab/cache/codecs/formats.py) at each
    of its widths, a scale every 32 and every 64 channels (a head) where the format lets a
    group be chosen, with and without the Hadamard rotation (only with it where the format
    quantizes rotated coordinates)."""
    out = []
    for name, kind in sorted(token_formats().items()):
        for bits, group in itertools.product(kind.bits, [kind.block] if kind.block else [32, 64]):
            options = {"kv_bits": bits, "kv_format": name, "kv_group_size": group}
            rotations = [kind.rotation] if kind.rotation else ["none", "hadamard"]
            out += [("full", options | ({"rotate": r} if r != "none" else {})) for r in rotations]
    return out


SETTINGS = STRATEGIES + format_settings()
RESIDUAL = 32  # int*: so that most of the 512 tokens are really quantized
CHUNK = 128  # chunked_nll's


def main() -> None:
    quiet_third_party()
    model, tokenizer = kvlab.load_model("smollm2-135m")
    ids = torch.tensor(build_prompts(tokenizer, 512, 1))
    reference_nll, reference_top1 = chunked_nll(model, ids, "full", {})
    print("| setting | ΔNLL vs full | KL(full ‖ setting) nats | top-1 agreement | bytes vs full |")
    print("|---|---:|---:|---:|---:|")
    spec = model.cache_spec()
    for name, options in SETTINGS:
        if name.startswith("int"):
            options = {"residual": RESIDUAL, **options}
        label = name + "".join(f" {k}={v}" for k, v in options.items())
        if sys.argv[1:] and not any(part in label for part in sys.argv[1:]):
            continue
        nll, top1 = chunked_nll(model, ids, name, options)
        caches = (build_cache("full", spec), build_cache(name, spec, options))
        kl = window_divergence(model, ids[0], caches, CHUNK)[:, 0].mean().item()
        agreement = (top1 == reference_top1).float().mean().item()
        full, kept = (cache.memory() for cache in caches)  # both hold the 512 tokens fed
        size = kept.used_bytes / max(kept.tokens, 1) / (full.used_bytes / full.tokens)
        row = f"| {label} | {nll - reference_nll:+.3f} | {kl:.4f} | {agreement:.3f} | {size:.3f} |"
        print(row, flush=True)


if __name__ == "__main__":
    main()
