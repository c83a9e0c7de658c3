#!/usr/bin/env bash
# The main job: a small sweep on the embedded default model (full cache vs no cache, two prompt
# lengths), printing the comparison table at the end. Extra arguments go to kvlab.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
kvlab -m cache=full,nocache workload.prompt_len=256,1024 workload.new_tokens=32 "$@"
