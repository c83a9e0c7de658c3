#!/usr/bin/env bash
# The serving-capacity study: every sweep into one folder, then the README's tables and plots.
# Usage: bash experiments/serving_capacity/run.sh [OUT]   (about 40 min on 2 CPU cores)
set -euo pipefail
out=${1:-multirun/serving_capacity}
rates=workload.serving.rate=0,0.5,2
kvlab -m +experiment=serving_capacity hydra.sweep.dir="$out/main"
kvlab -m +experiment=serving_capacity cache=paged cache.options.kv_bits=4 "$rates" \
  hydra.sweep.dir="$out/paged_int4"
kvlab -m +experiment=serving_capacity cache=sliding cache.options.window=256 "$rates" \
  hydra.sweep.dir="$out/sliding"
# offline throughput with continuous batching vs the same requests one at a time
kvlab -m +experiment=serving_capacity cache=full workload.serving.rate=0 \
  workload.serving.max_running=1 hydra.sweep.dir="$out/one_at_a_time"
# a 1024-token system prompt shared by every request: paged with and without prefix caching
kvlab -m +experiment=serving_capacity cache=paged workload.serving.rate=0.5 \
  cache.options.prefix_sharing=true,false workload.serving.shared_prefix=1024 \
  workload.serving.num_requests=12 workload.serving.kv_budget_gib=0.5 \
  'workload.serving.prompt_len={kind: fixed, value: 64}' \
  'workload.serving.output_len={kind: fixed, value: 32}' hydra.sweep.dir="$out/prefix" \
  'hydra.sweep.subdir=${hydra.job.num}'
python experiments/serving_capacity/summarize.py "$out"
