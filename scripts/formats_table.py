"""The formats study's tables (experiments/formats/README.md) from the result.json files
``experiments/formats/run.sh`` wrote: weights (perplexity, bytes, TTFT, ITL) and KV formats
(ΔNLL, KL, top-1, bytes and ITL at the 4k prompt, as ratios to ``full`` in the same sweep).

    python scripts/formats_table.py outputs/formats
"""

from __future__ import annotations

import sys
from pathlib import Path

from kvlab.tracking import load_results

KV_OPTIONS = ("kv_bits", "kv_format", "kv_group_size", "rotate", "bits", "key_axis")


def label(row: dict, group: str) -> str:
    """The point as its preset name plus the options that make it what it is."""
    name = row.get(f"{group}.name", "?")
    keys = KV_OPTIONS if group == "cache" else ("symmetric", "group_size")
    options = {k: row.get(f"{group}.options.{k}") for k in keys}
    parts = [f"{k}={v}" for k, v in options.items() if v is not None]
    return " ".join([name, *parts])


def weights_table(rows: list[dict]) -> list[str]:
    lines = [
        "| quant | weight MB | WikiText-2 ppl | TTFT ms | ITL p50 ms |",
        "|---|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {label(r, 'quant')} | {r['weight_bytes'] / 1e6:.1f} | {r['wikitext2/ppl']:.2f} "
            f"| {r['ttft_ms']:.0f} | {r['itl_ms_p50']:.2f} |"
        )
    return lines


def kv_table(rows: list[dict], full: dict) -> list[str]:
    lines = [
        "| setting | KV MB @4k | bytes / full | ΔNLL | KL nats | top-1 | ITL p50 ms | ITL / full |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {label(r, 'cache')} | {r['kv_bytes'] / 1e6:.1f} | "
            f"{r['kv_bytes'] / full['kv_bytes']:.3f} | {r['wikitext2/delta_nll']:+.4f} | "
            f"{r['wikitext2/kld']:.4f} | {r['wikitext2/top1_agreement']:.3f} | "
            f"{r['itl_ms_p50']:.2f} | {r['itl_ms_p50'] / full['itl_ms_p50']:.2f} |"
        )
    return lines


def main(root: Path) -> None:
    for sweep in ("weights", "weights_asymmetric"):
        if (root / sweep).exists():
            print(f"\n{sweep}\n" + "\n".join(weights_table(load_results(root / sweep))))
    full = next(r for r in load_results(root / "kv") if r.get("cache.options.kv_bits") is None)
    for sweep in sorted(p.name for p in root.glob("kv*")):
        rows = [r for r in load_results(root / sweep) if r.get("status") == "ok"]
        print(f"\n{sweep} (ratios to full of the kv sweep)\n" + "\n".join(kv_table(rows, full)))


if __name__ == "__main__":
    main(Path(sys.argv[1] if sys.argv[1:] else "outputs/formats"))
