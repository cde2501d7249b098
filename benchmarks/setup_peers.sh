#!/usr/bin/env bash
# A separate environment for benchmarks/compare_peers.py: Optimum's ONNX Runtime support
# (optimum-onnx) pins transformers < 4.58, older than gpt2x's test environment, so the peers and
# gpt2x share this one instead. Usage: bash benchmarks/setup_peers.sh [VENV_DIR]
set -euo pipefail
venv=${1:-.venv-peers}
python3 -m venv "$venv"
"$venv/bin/python" -m pip install --quiet --upgrade pip
"$venv/bin/python" -m pip install --quiet torch==2.13.0
"$venv/bin/python" -m pip install --quiet -e . "optimum-onnx" "transformers<4.58" matplotlib
"$venv/bin/python" -c "import optimum.onnxruntime, transformers, gpt2x; print('peers ready: transformers', transformers.__version__)"
