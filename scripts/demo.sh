#!/usr/bin/env bash
# The main job: a small sweep on the embedded default model (every KV strategy family and the
# no-cache baseline, two prompt lengths, a short WikiText-2 perplexity with the cache in the
# loop), printing the comparison table at the end. Extra arguments go to kvlab.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
kvlab -m cache=full,nocache,int8,int4,sliding,paged workload.prompt_len=256,1024 \
  workload.new_tokens=32 eval=ppl eval.ppl.seqlen=1024 eval.ppl.max_windows=2 \
  eval.ppl.chunk=256 "$@"
