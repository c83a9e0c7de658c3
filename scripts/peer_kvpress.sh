#!/usr/bin/env bash
# kvpress (NVIDIA, PyPI 0.5.5) as a peer for experiments/eviction_ruler: its own virtual
# environment, .venv-kvpress, because kvpress pins transformers<5.3 and kvlab runs on a
# newer one. Not part of the default setup. torch==2.13.0 is pinned so pip takes the local
# CPU wheel instead of a multi-GB CUDA build.
#   bash scripts/peer_kvpress.sh            # create (or update) .venv-kvpress
#   .venv-kvpress/bin/python experiments/eviction_ruler/kvpress_peer.py ...
# The test suite's kept-set fixture (kvpress's presses of FIXTURE_PRESSES on its own prompt):
#   .venv-kvpress/bin/python experiments/eviction_ruler/kvpress_peer.py fixture \
#     "$(python -c "from kvlab.paths import cache_dir; print(cache_dir() / 'models/smollm2-135m')")" \
#     tests/fixtures/kvpress_kept_ratio05.json tests/fixtures/kvpress_kept_ratio05.json
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${KVPRESS_VENV:-.venv-kvpress}
[ -x "$VENV/bin/python" ] || python3.11 -m venv "$VENV"
"$VENV/bin/pip" install -q --upgrade pip
"$VENV/bin/pip" install -q "torch==2.13.0"
"$VENV/bin/pip" install -q "kvpress==0.5.5" "transformers<5.3" "torch==2.13.0"
"$VENV/bin/python" -c "import kvpress, transformers, torch; print('kvpress', kvpress.__version__ if hasattr(kvpress, '__version__') else '0.5.5', 'transformers', transformers.__version__, 'torch', torch.__version__)"
