#!/usr/bin/env bash
# kvlab serve beside vLLM's CPU build on this machine, both driven by vLLM's own load
# generator (experiments/serving_vs_vllm). Creates .venv-vllm once (scripts/peer_vllm.sh),
# then runs scripts/bench_vs_vllm.py with the arguments given, e.g.
#   bash scripts/bench_vs_vllm.sh --rates inf,2,8
#   bash scripts/bench_vs_vllm.sh --engines kvlab --kvlab-args "cache=int4 workload.serving.chunk=2048"
set -euo pipefail
cd "$(dirname "$0")/.."
[ -x .venv-vllm/bin/python ] || bash scripts/peer_vllm.sh
python scripts/bench_vs_vllm.py "$@"
