#!/usr/bin/env bash
# The eviction study: kvlab's settings (study.py: every scorer x ratio, budgets, KIVI,
# sliding, compressed on RULER 4k), kvpress 0.5.5 as a peer on the same items, then the
# README's tables and plot; scripts/bench_evict.py measures the speed side.
# Usage: bash experiments/eviction_ruler/run.sh [OUT]   (~1 h on 2 CPU cores, plus ~25 min
# for kvpress; its venv: bash scripts/peer_kvpress.sh)
set -euo pipefail
out=${1:-experiments/eviction_ruler/out}
mkdir -p "$out"
python - "$out" <<'PY'
import json, sys
from kvlab import load_model
from kvlab.eval.ruler import RulerOptions, ruler_items
_, tokenizer = load_model("smollm2-135m")
options = RulerOptions(samples=1)
with open(f"{sys.argv[1]}/items.jsonl", "w") as f:
    for item in ruler_items(tokenizer, options):
        f.write(json.dumps({**item.to_json(), "max_new_tokens": options.max_new_tokens}) + "\n")
PY
checkpoint=$(python -c "from kvlab.models.loading import cache_dir; print(cache_dir() / 'models' / 'smollm2-135m')")
# every registered scorer that equals a kvpress press, under its press
peers=$(python -c "from kvlab.cache.evict.scorers import scorers
print(' '.join(f'{n}={e.kvpress}:0.5' for n, e in sorted(scorers().items()) if e.kvpress))")
if [ -x .venv-kvpress/bin/python ]; then
  HF_HUB_DISABLE_PROGRESS_BARS=1 .venv-kvpress/bin/python experiments/eviction_ruler/kvpress_peer.py \
    ruler "$checkpoint" "$out/items.jsonl" "$out/kvpress_ruler.json" none:0 $peers
fi
python experiments/eviction_ruler/study.py "$out/study" --replayed-only
python experiments/eviction_ruler/study.py "$out/study" --eval-path-only  # sliding, compressed
python experiments/eviction_ruler/summarize.py "$out"
python scripts/bench_evict.py --prompt-len 4096 --new-tokens 32 --rounds 2
