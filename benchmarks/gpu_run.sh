#!/usr/bin/env bash
# The whole GPU run in one command, in stages that can be run or re-run alone:
#
#   bash benchmarks/gpu_run.sh RESULTS_DIR [STAGE ...]
#
# Needs gpt2x installed and ONNX Runtime with its CUDA provider importable (checked by the first
# stage, which stops the run if the CUDA provider does not load: no CUDA figure comes from a CPU run).
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

out=${1:?usage: bash benchmarks/gpu_run.sh RESULTS_DIR [check|tests|small|medium|large|xl|spec ...]}
shift
stages=${*:-check tests small medium large xl spec}
mkdir -p "$out"
export PYTHONUNBUFFERED=1 GPT2X_PROGRESS=lines

bench_matrix() {  # MODEL: every backend x precision x batch, prompts of 32 and 512 tokens
    local model=$1 name=${1#random:}
    for prompt in 32 512; do
        echo "== $model, prompt $prompt" >&2
        gpt2x bench --provider cuda --model "$model" --backends torch,ort,genai --precisions fp32,fp16 \
            --batch 1,8,64 --prompt-len "$prompt" --new-tokens 128 --repeat 3 \
            --output "$out/bench-$name-p$prompt.json" 2>&1 | tee "$out/bench-$name-p$prompt.log"
    done
}

for stage in $stages; do
    start=$(date +%s)
    case $stage in
        check)
            nvidia-smi | tee "$out/nvidia-smi.txt"
            gpt2x info --json > "$out/env.json"
            python3 - "$out/env.json" <<'EOF'
import json, sys
env = json.load(open(sys.argv[1]))
status = env["providers loadable"]["cuda"]
print("CUDA provider:", status)
sys.exit(0 if status == "ok" else "the CUDA provider does not load: stopping (no CUDA figure from a CPU run)")
EOF
            ;;
        tests) python3 -m pytest -m cuda -n 0 -q -rA 2>&1 | tee "$out/cuda-tests.log" ;;  # one process: one CUDA context
        small) bench_matrix random:gpt2 ;;
        medium|large|xl) bench_matrix "random:gpt2-$stage" ;;
        spec)
            for model in shakespeare random:gpt2; do
                name=${model#random:}
                gpt2x bench --provider cuda --model "$model" --backends ort --precisions fp32 --draft fp16,ngram \
                    --prompt-text "ROMEO:" --new-tokens 128 --repeat 3 \
                    --output "$out/bench-spec-$name.json" 2>&1 | tee "$out/bench-spec-$name.log"
            done
            ;;
        *) echo "unknown stage $stage (check, tests, small, medium, large, xl, spec)" >&2; exit 2 ;;
    esac
    echo "stage $stage: $(( $(date +%s) - start )) s" | tee -a "$out/stages.txt"
done
