#!/usr/bin/env bash
# The CUDA lane in one short run on a GPU machine (no network there; it has torch with
# triton, transformers and pytest): the gpu-marked tests, then one table per (model,
# prompt length) — kvlab's strategies on the CUDA backends (FlexAttention, Triton) beside
# Hugging Face generate on the same shapes, and vLLM where it is installed — in bf16 with
# random weights (checkpoints cannot travel: timing only): the default model's shape and
# Llama-3.2-1B's, at 4k and 32k tokens, plus the default shape compiled (CUDA graphs) at
# 4k. Results go to $OUT (default results/gpu). Budget: under 8 minutes. Before calling
# the device tool: bash scripts/gpu_wheels.sh, then carry .whl
# (run: command "bash scripts/gpu_check.sh", carry [".whl"]).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-results/gpu}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD:${PYTHONPATH:-}"
if compgen -G ".whl/*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl && export PYTHONPATH="$PYTHONPATH:/tmp/site"
fi
nvidia-smi > "$OUT/nvidia-smi.txt" 2>&1
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__,
torch.cuda.get_device_name())" | tee "$OUT/versions.txt"
timeout 120 python3 -m pytest -m gpu -q -p no:cacheprovider tests/test_gpu.py 2>&1 \
  | tee "$OUT/gpu_tests.log"

# the default model's shape, with room for 32k tokens (its own context is 8k)
python3 - "$OUT/smollm2-135m-40k.json" <<'EOF'
import json, sys
config = json.load(open("scripts/smollm2-135m-config.json"))
config["max_position_embeddings"] = 40960
json.dump(config, open(sys.argv[1], "w"))
EOF
ONE_B=kvlab/analysis/reference_configs/llama-3.2-1b/config.json
bench() {  # name config prompt_len [flags...]
  local name=$1 config=$2 len=$3
  shift 3
  timeout 55 python3 scripts/bench_kv_strategies.py --device cuda --dtype bfloat16 \
    --random-weights "$config" --prompt-len "$len" --new-tokens 32 --rounds 1 \
    --agree-tokens 8 --only hf,int8,int4,paged,sliding,compressed,evict "$@" 2>&1 \
    | tee "$OUT/bench_${name}_${len}$([ $# -gt 0 ] && echo _compiled).log"
}
for len in 4096 32768; do
  bench smollm2-135m "$OUT/smollm2-135m-40k.json" "$len"
  bench llama-3.2-1b "$ONE_B" "$len"
done
bench smollm2-135m "$OUT/smollm2-135m-40k.json" 4096 --compile

# vLLM on the same shapes, where it is installed (it cannot be on a machine with no index)
if python3 -c "import vllm" 2>/dev/null; then
  for len in 4096 32768; do
    mkdir -p "$OUT/vllm-1b" && cp "$ONE_B" "$OUT/vllm-1b/config.json"
    timeout 60 vllm bench latency --model "$OUT/vllm-1b" --load-format dummy \
      --skip-tokenizer-init --dtype bfloat16 --input-len "$len" --output-len 32 \
      --batch-size 1 --num-iters 3 --max-model-len 40960 2>&1 | tail -20 \
      | tee "$OUT/vllm_llama-3.2-1b_${len}.log"
  done
else
  echo "vllm: not installed on this machine" | tee "$OUT/vllm.log"
fi
