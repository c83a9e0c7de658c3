#!/usr/bin/env bash
# Wheels the GPU machine lacks (it has torch, transformers, safetensors, pandas, matplotlib,
# pytest, but no network): downloaded here into .whl/ (git-ignored) for the device tool to
# carry. Python 3.12 there.
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p .whl
for wheel in hydra-core==1.3.2 omegaconf==2.3.0 antlr4-python3-runtime==4.9.3; do
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
    --implementation cp --platform manylinux2014_x86_64 --platform any -d .whl "$wheel" ||
  python3 -m pip download -q --no-deps --python-version 3.12 -d .whl "$wheel"
done
ls .whl
