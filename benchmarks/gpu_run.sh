#!/usr/bin/env bash
# The whole GPU run in one command, in stages that can be run or re-run alone:
#
#   bash benchmarks/gpu_run.sh RESULTS_DIR [STAGE ...]
#
# Needs gpt2x installed and ONNX Runtime with its CUDA provider importable (checked by the first
# stage, which stops the run if the CUDA provider does not load: no CUDA figure comes from a CPU run).
# A GPU lease is 15 minutes of device time in all: run `quick` first, in the call right after the
# bundle is installed (about 6 minutes), then the other stages only if time is left.
#   quick   check, the CUDA tests (150 s at most: a fresh H100 ran 9 of them in 70 s) and GPT-2 124M at batch 1 (32-token prompt, 128
#           tokens, 3 repeats): benchmarks/cuda_decode.py (ort's growing cache, fixed cache and CUDA
#           graph, genai, transformers), gpt2x bench (torch, ort, genai; ort's fp16 on the fixed cache
#           too) at fp32 and fp16 and benchmarks/cuda_profile.py (a step's kernels), each step's files
#           written before the next starts, all packed into RESULTS_DIR.tgz (one file back)
#
# GPT2X_GPU_PROVIDER=cpu rehearses every stage on the CPU provider (the CUDA assertion skipped, fp32
# only), so that a lease is spent measuring, not debugging: its figures are CPU figures.
# Stages, in the default order (each meant to finish within 9 minutes on one H100/H200):
#   check   GPU, driver, versions, providers that load          -> env.json, nvidia-smi.txt
#   tests   the CUDA test suite (pytest -m cuda)                 -> cuda-tests.log
#   small   GPT-2 124M (random weights): torch, ort, genai x fp32, fp16 x batch 1, 8, 64 x prompt 32, 512
#   medium  GPT-2 medium, the same matrix
#   large   GPT-2 large, the same matrix
#   xl      GPT-2 xl, the same matrix (its fp16 export needs the GPU machine's memory)
#   spec    speculative decoding on CUDA: fp32 targets with the fp16 and ngram drafts, bundled model and
#           GPT-2 124M (random weights), batch 1 (gpt2x bench --draft)
# Every bench writes bench-<model>-p<prompt>.json (every figure, the environment) and a log.
set -euo pipefail

out=${1:?usage: bash benchmarks/gpu_run.sh RESULTS_DIR [quick|check|tests|small|medium|large|xl|spec ...]}
shift
stages=${*:-check tests small medium large xl spec}
mkdir -p "$out"
export PYTHONUNBUFFERED=1 GPT2X_PROGRESS=lines GPT2X_EXPORTS=${GPT2X_EXPORTS:-/tmp/gpt2x-exports}
provider=${GPT2X_GPU_PROVIDER:-cuda}
case $provider in
    cuda) precisions=fp32,fp16 ;;
    cpu) precisions=fp32; echo "rehearsal on the cpu provider: no figure here is a CUDA figure" | tee "$out/REHEARSAL-CPU.txt" ;;
    *) echo "GPT2X_GPU_PROVIDER must be cuda or cpu, not $provider" >&2; exit 2 ;;
esac

# The files holding the CUDA tests: collecting the whole suite would import the serving stack, which the GPU
# machine lacks (FastAPI, jsonschema, llguidance, ...).
cuda_tests="tests/runtime/test_cuda.py tests/cli/test_export.py"

check() {  # GPU, driver, versions; stops the run unless the asked provider loads
    if command -v nvidia-smi >/dev/null; then nvidia-smi | tee "$out/nvidia-smi.txt"; else echo "no nvidia-smi" | tee "$out/nvidia-smi.txt"; fi
    gpt2x info --json > "$out/env.json"
    python3 - "$out/env.json" "$provider" <<'EOF'
import json, sys
env, provider = json.load(open(sys.argv[1])), sys.argv[2]
status = env["providers loadable"][provider]
print(f"{provider} provider:", status)
sys.exit(0 if status == "ok" else f"the {provider} provider does not load: stopping (no CUDA figure from a CPU run)")
EOF
}

pack() {  # everything so far as one archive: a lease brings back 8 files at most
    tar czf "$out.tgz" -C "$(dirname "$out")" "$(basename "$out")"
}

bench_matrix() {  # MODEL: every backend x precision x batch, prompts of 32 and 512 tokens
    local model=$1 name=${1#random:}
    for prompt in 32 512; do
        echo "== $model, prompt $prompt" >&2
        gpt2x bench --provider "$provider" --model "$model" --backends torch,ort,genai --precisions "$precisions" \
            --batch 1,8,64 --prompt-len "$prompt" --new-tokens 128 --repeat 3 \
            --output "$out/bench-$name-p$prompt.json" 2>&1 | tee "$out/bench-$name-p$prompt.log"
    done
}

for stage in $stages; do
    start=$(date +%s)
    case $stage in
        quick)
            check; pack
            # Its own limit, so that a hang cannot eat the lease; its exit status is kept, not fatal.
            timeout 150 python3 -m pytest -m cuda -n 0 -q -rA -p no:cacheprovider $cuda_tests > "$out/cuda-tests.log" 2>&1 \
                || echo "cuda tests: exit $?" | tee -a "$out/stages.txt"
            pack
            # Every batch-1 decode path beside genai and transformers in one process (exports made here once).
            timeout 150 python3 benchmarks/cuda_decode.py --out "$out/cuda-decode" --provider "$provider" --precisions "$precisions" \
                --prompt-len 32 --new-tokens 128 --repeat 3 > "$out/cuda-decode.log" 2>&1 \
                || echo "cuda decode: exit $?" | tee -a "$out/stages.txt"
            pack
            # genai runs only where onnxruntime-genai is installed: the bench records it as skipped otherwise.
            # On CUDA the bench times ort's fp16 rows on the fixed cache and its CUDA graph too (--fixed-cache's default).
            timeout 120 gpt2x bench --provider "$provider" --model random:gpt2 --backends torch,ort,genai --precisions "$precisions" \
                --batch 1 --prompt-len 32 --new-tokens 128 --repeat 3 --output "$out/quick-bench.json" \
                > "$out/quick-bench.log" 2>&1 || echo "quick bench: exit $?" | tee -a "$out/stages.txt"
            pack
            # Where a step's time goes: wall time against the kernels it ran, with and without the CUDA graph.
            timeout 100 python3 benchmarks/cuda_profile.py --out "$out/cuda-profile" --provider "$provider" \
                > "$out/cuda-profile.log" 2>&1 || echo "cuda profile: exit $?" | tee -a "$out/stages.txt"
            if [ $(( $(date +%s) - start )) -lt 400 ]; then  # time left in the lease's plan: batch 8, longer prompts
                pack
                timeout 80 python3 benchmarks/cuda_decode.py --out "$out/cuda-decode-b8" --provider "$provider" \
                    --precisions "${precisions#*,}" --batch 8 --prompt-len 128 --new-tokens 128 --repeat 3 \
                    > "$out/cuda-decode-b8.log" 2>&1 || echo "cuda decode b8: exit $?" | tee -a "$out/stages.txt"
            fi
            ;;
        check) check ;;
        tests) python3 -m pytest -m cuda -n 0 -q -rA $cuda_tests 2>&1 | tee "$out/cuda-tests.log" ;;  # one process: one CUDA context
        small) bench_matrix random:gpt2 ;;
        medium|large|xl) bench_matrix "random:gpt2-$stage" ;;
        spec)
            for model in shakespeare random:gpt2; do
                name=${model#random:}
                gpt2x bench --provider "$provider" --model "$model" --backends ort --precisions fp32 --draft fp16,ngram \
                    --prompt-text "ROMEO:" --new-tokens 128 --repeat 3 \
                    --output "$out/bench-spec-$name.json" 2>&1 | tee "$out/bench-spec-$name.log"
            done
            ;;
        *) echo "unknown stage $stage (quick, check, tests, small, medium, large, xl, spec)" >&2; exit 2 ;;
    esac
    echo "stage $stage: $(( $(date +%s) - start )) s" | tee -a "$out/stages.txt"
    pack
done
