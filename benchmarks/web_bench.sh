#!/usr/bin/env bash
# The web backend's figures: `gpt2x bench --backends ort,web` on the bundled model and on GPT-2 124M
# (the gpt2 architecture with random weights: this machine has no hub), at fp32, int8 and int4,
# batch 1. Each writes benchmarks/results/bench-web-cpu-2core-MODEL.{json,txt,png}. Run it alone on a
# quiet machine, from the README's set-up (Chromium, and `npm ci --prefix gpt2x/runtime/web`).
#
#   bash benchmarks/web_bench.sh [NEW_TOKENS] [REPEAT]
set -euo pipefail
cd "$(dirname "$0")/.."
new_tokens=${1:-64}
repeat=${2:-3}
out=benchmarks/results
for pair in shakespeare:shakespeare random:gpt2:gpt2-124m; do
    model=${pair%:*}
    name=${pair##*:}
    echo "gpt2x bench --model $model --backends ort,web --precisions fp32,int8,int4 --new-tokens $new_tokens --repeat $repeat" >&2
    gpt2x bench --model "$model" --backends ort,web --precisions fp32,int8,int4 --batch 1 --new-tokens "$new_tokens" \
        --repeat "$repeat" --output "$out/bench-web-cpu-2core-$name.json" --plot "$out/bench-web-cpu-2core-$name.png" \
        > "$out/bench-web-cpu-2core-$name.txt"
    cat "$out/bench-web-cpu-2core-$name.txt"
done
