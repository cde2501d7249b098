#!/usr/bin/env bash
# A separate environment for benchmarks/compare_peers.py (and check_interop.py): Optimum's ONNX
# Runtime support (optimum-onnx) pins transformers < 4.58, older than gpt2x's test environment, so
# the peers and gpt2x share this one instead. Usage: bash benchmarks/setup_peers.sh [VENV_DIR]
#
# onnxruntime-genai goes in with --no-deps: its wheel requires the `onnxruntime` distribution, while
# gpt2x brings `onnxruntime-gpu` (on Linux/Windows x86-64), whose `onnxruntime` module and
# libonnxruntime.so genai loads instead (see docs/interop.md); installing both distributions would
# leave two copies of the same module fighting over one directory. (genai 0.18 wants ONNX Runtime
# >= 1.31, which the line before installs.)
#
# ONNX Runtime's own GPT-2 tool (onnxruntime.transformers.models.gpt2, shipped inside onnxruntime)
# needs nothing more, but does not run with this transformers: compare_peers.py records why.
# The `export` extra (onnxscript; torch is pinned above) is what gpt2x.workflows needs to load and export;
# the `openvino` extra (OpenVINO's runtime) is what gpt2x's openvino backend needs (compare_peers.py
# --gpt2x-backends ... openvino).
set -euo pipefail
venv=${1:-.venv-peers}
genai_version=0.18.0
python3 -m venv "$venv"
"$venv/bin/python" -m pip install --quiet --upgrade pip
"$venv/bin/python" -m pip install --quiet torch==2.13.0
"$venv/bin/python" -m pip install --quiet -e ".[export,openvino]" "optimum-onnx" "transformers<4.58" matplotlib
"$venv/bin/python" -m pip install --quiet --no-deps "onnxruntime-genai==$genai_version"
"$venv/bin/python" -c "import optimum.onnxruntime, onnxruntime_genai, openvino, transformers, gpt2x; print('peers ready: transformers', transformers.__version__, '/ onnxruntime-genai', onnxruntime_genai.__version__, '/ openvino', openvino.__version__)"
