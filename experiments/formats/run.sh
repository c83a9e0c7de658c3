#!/usr/bin/env bash
# The formats study (experiments/formats/README.md): weights, then the KV formats in four
# sweeps of conf/experiment/formats_kv.yaml (each prints its table; `kvlab report DIR`
# rebuilds one). Output under ${OUT:-outputs/formats}. About an hour on 2 cores the
# first time (GPTQModel quantizes gptq twice and awq once, then they are cached).
set -euo pipefail
out=${OUT:-outputs/formats}
kvlab -m +experiment=formats_weights hydra.sweep.dir="$out/weights"
kvlab -m +experiment=formats_weights quant=rtn,gptq ++quant.options.symmetric=false \
  hydra.sweep.dir="$out/weights_asymmetric"  # AWQ's zero points, for RTN and GPTQ too
kvlab -m +experiment=formats_kv hydra.sweep.dir="$out/kv"
kvlab -m +experiment=formats_kv cache=int4,int2,mxfp4,nvfp4 ++cache.options.rotate=hadamard \
  hydra.sweep.dir="$out/kv_rotated"
kvlab -m +experiment=formats_kv cache=full +cache.options.kv_bits=4 \
  +cache.options.rotate=none,hadamard hydra.sweep.dir="$out/kv_per_token_int4"
kvlab -m +experiment=formats_kv cache=compressed cache.options.kv_bits=8 \
  +cache.options.kv_format=e4m3 cache.options.kv_group_size=32,64 \
  hydra.sweep.dir="$out/kv_compressed_fp8"
