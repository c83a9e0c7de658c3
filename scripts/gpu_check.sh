#!/usr/bin/env bash
# The CUDA lane in one short run on a GPU machine (no network there; it has torch,
# transformers and pytest): the gpu-marked tests, then the decode benchmark on the GPU in
# bf16, eager and compiled (CUDA graphs), with the default model's shape and random weights
# (its GGUF cannot travel: timing only). Results go to $OUT (default results/gpu). Budget:
# under 8 minutes. Before calling the device tool: bash scripts/gpu_wheels.sh, then carry
# .whl (run: command "bash scripts/gpu_check.sh", carry [".whl"]).
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
python3 -c "import torch; print('torch', torch.__version__, torch.cuda.get_device_name())" \
  | tee "$OUT/versions.txt"
timeout 240 python3 -m pytest -m gpu -q -p no:cacheprovider tests/test_gpu.py 2>&1 \
  | tee "$OUT/gpu_tests.log"
for mode in eager compiled; do
  flag=$([ "$mode" = compiled ] && echo --compile || true)
  timeout 150 python3 scripts/bench_kv_strategies.py --device cuda --dtype bfloat16 \
    --random-weights scripts/smollm2-135m-config.json --prompt-len 4096 --new-tokens 64 \
    --rounds 2 --agree-tokens 8 $flag 2>&1 | tee "$OUT/bench_$mode.log"
done
