#!/usr/bin/env bash
# Install everything, then run the whole test suite (slow tests included; GPU tests skip
# without CUDA). Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
python3 -m pytest "$@"
