#!/usr/bin/env bash
# The whole GPU run in one command, in stages that can be run or re-run alone:
#
#   bash benchmarks/gpu_run.sh RESULTS_DIR [STAGE ...]
#
# Needs gpt2x installed and ONNX Runtime with its CUDA provider importable (checked by the first
# stage, which stops the run if the CUDA provider does not load: no CUDA figure comes from a CPU run).
# A GPU lease is 15 minutes of device time in all: run `quick` first, in the call right after the
# bundle is installed (about 6 minutes), then `serve` in a call right after it, then others only if time is left.
#   quick   check, the CUDA tests (110 s at most) and GPT-2 124M (32-token prompt, 128 tokens):
#           benchmarks/cuda_generate.py (what gpt2x generate decodes at, the library call and the command, beside the
#           bench's fixed-cache row, greedy and sampled, batch 1 and 8) and benchmarks/cuda_decode.py (every batch-1
#           decode path beside the peers) in fp16 (fp32 on the CPU), each step's files written before the next
#           starts, all packed into RESULTS_DIR.tgz (one file back). GPT2X_COMMIT names the commit (commit.txt).
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
#   serve   gpt2x serve on GPT-2 124M (random weights; fp16 on CUDA, fp32 on the CPU) under gpt2x loadtest at concurrency
#           1, 16, 64 (128-token prompts, 128 tokens out), the default KV cache, then --kv-cache slots (CUDA), about 4
#           minutes (not in the default order: name it)               -> serve-meta.json, serve-<variant>-c<N>.{json,log}
# Every bench writes bench-<model>-p<prompt>.json (every figure, the environment) and a log.
set -euo pipefail

out=${1:?usage: bash benchmarks/gpu_run.sh RESULTS_DIR [quick|check|tests|small|medium|large|xl|spec|serve ...]}
shift
stages=${*:-check tests small medium large xl spec}
mkdir -p "$out"
echo "${GPT2X_COMMIT:-unknown (GPT2X_COMMIT not passed)}" > "$out/commit.txt"  # passed in: the device's tree has no .git
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

# ---------------------------------------------------------------- the serve stage
# gpt2x serve under gpt2x loadtest, one server per variant of the KV cache. Its knobs (the defaults are the GPU run's;
# the CPU rehearsal shrinks them):
#   GPT2X_SERVE_LEVELS     CONCURRENCY:REQUESTS, one level each (default "1:32 16:192 64:320": about 15-25 s a level on
#                          an H200, a guess: host-bound steps of about 4, 12 and 32 ms at 1, 16 and 64 rows, from the
#                          batch-1 decode of docs/results/cuda.md and the server's per-row cost on the CPU)
#   GPT2X_SERVE_SCALE      each level's requests x this, at least its concurrency (default 1)
#   GPT2X_SERVE_LEVEL_S    a level's --max-duration in s (default 40; its unfinished requests then count as failed)
#   GPT2X_SERVE_BUDGET_S   the stage's time in s, export included (default 270): a level or variant that would not fit
#                          is skipped and recorded
#   GPT2X_SERVE_VARIANTS   default (the KV cache's auto) and other --kv-cache choices (default "default slots" on
#                          cuda, "default" on cpu)
#   GPT2X_SERVE_MAX_BATCH  --max-batch-size (default 64: the top level's requests decode together)
#   GPT2X_SERVE_PORT       the first variant's port (default 8765; each next variant's one more)
#   GPT2X_COMMIT           the commit recorded in serve-meta.json (default: git's HEAD where there is a .git)
# Prompts: 128 random GPT-2 words each (exactly 128 tokens, checked), each level its own, so that no prompt is
# served twice by one server (the prefix cache, on by default, finds nothing to reuse). Temperature: the loadtest's
# default (1); the loadtest sends no ignore_eos, so a request stops early only where it draws <|endoftext|> (about 1 in
# 50,257 a token on random weights): each level's mean_output_tokens says how many came out.

serve_note() {  # VARIANT KEY VALUE: one record of the stage (serve-status.tsv), shown and kept in stages.txt
    printf '%s\t%s\t%s\n' "$1" "$2" "$3" >> "$out/serve-status.tsv"
    echo "serve $1: $2 $3" | tee -a "$out/stages.txt"
}

serve_left() { echo $(( serve_deadline - $(date +%s) )); }

serve_health() {  # PORT: /health answers 200 (bash's /dev/tcp: no curl needed)
    # shellcheck disable=SC2016  # $1 is the inner shell's
    timeout 3 bash -c 'exec 3<>"/dev/tcp/127.0.0.1/$1" && printf "GET /health HTTP/1.0\r\nHost: 127.0.0.1\r\n\r\n" >&3 &&
        IFS= read -r line <&3 && [[ $line == *" 200 "* ]]' _ "$1" 2>/dev/null
}

serve_stop() {  # PID VARIANT: SIGTERM (requests in flight get 3 s), 20 s to exit, then SIGKILL to its process group
    local pid=$1 variant=$2 rc=0 i
    kill -TERM "$pid" 2>/dev/null || true
    for i in $(seq 20); do kill -0 "$pid" 2>/dev/null || break; sleep 1; done
    if kill -0 "$pid" 2>/dev/null; then
        serve_note "$variant" stop "still running 20 s after SIGTERM: killed"
        kill -KILL -- "-$pid" 2>/dev/null || kill -KILL "$pid" 2>/dev/null || true
    fi
    wait "$pid" 2>/dev/null || rc=$?
    serve_note "$variant" exit "$rc"
}

serve_meta() {  # serve-meta.json from the stage's records and each level's JSON, and the summary table
    python3 - "$out" <<'EOF'
import json, sys
from pathlib import Path

out = Path(sys.argv[1])
meta = json.loads((out / "serve-meta.json").read_text())
variants = meta["variants"] = {}
status = out / "serve-status.tsv"
for line in status.read_text().splitlines() if status.exists() else []:
    variant, key, value = line.split("\t", 2)
    variants.setdefault(variant, {"records": {}, "levels": []})["records"][key] = value
rows = []
for variant, v in variants.items():
    for c in meta["settings"]["concurrency"]:
        path = out / f"serve-{variant}-c{c}.json"
        if not path.exists():
            continue
        try:
            level = json.loads(path.read_text())["levels"][0]
        except (ValueError, KeyError, IndexError):
            continue
        ms = lambda name, p: (level.get(name) or {}).get(f"{p}_ms")
        done = level["completed"]
        row = {"concurrency": c, "requests": level["requests"], "completed": done, "failed": level["failed"],
               "failures": level["failures"], "wall_s": level["wall_s"],
               "output_tok_s": level["output_token_throughput"], "requests_s": level["request_throughput"],
               "ttft_p50_ms": ms("ttft", "p50"), "ttft_p99_ms": ms("ttft", "p99"), "tpot_p50_ms": ms("tpot", "p50"),
               "itl_p50_ms": ms("itl", "p50"), "itl_p99_ms": ms("itl", "p99"), "e2e_p50_ms": ms("e2e", "p50"),
               "mean_output_tokens": level["mean_output_tokens"],
               "prompt_tokens_each": level["prompt_tokens"] / level["prompt_tokens_stated"] if level.get("prompt_tokens_stated") else None,
               "prefix_cache_hit_rate": level["prefix_cache_hit_rate"], "file": path.name}
        v["levels"].append(row)
        rows.append((variant, row))
(out / "serve-meta.json").write_text(json.dumps(meta, indent=1) + "\n")
fmt = lambda x, f="{:.1f}": "-" if x is None else f.format(x)
lines = ["| variant | concurrency | done/requests | wall s | output tok/s | req/s | TTFT p50 ms | TTFT p99 ms | TPOT p50 ms | "
         "ITL p99 ms | e2e p50 ms | mean out tokens | prompt tokens |", "|" + " --- |" * 13]
for variant, r in rows:
    lines.append(f"| {variant} | {r['concurrency']} | {r['completed']}/{r['requests']} | {fmt(r['wall_s'])} | {fmt(r['output_tok_s'])} | "
                 f"{fmt(r['requests_s'], '{:.2f}')} | {fmt(r['ttft_p50_ms'])} | {fmt(r['ttft_p99_ms'])} | {fmt(r['tpot_p50_ms'], '{:.2f}')} | "
                 f"{fmt(r['itl_p99_ms'])} | {fmt(r['e2e_p50_ms'])} | {fmt(r['mean_output_tokens'])} | {fmt(r['prompt_tokens_each'])} |")
(out / "serve-summary.md").write_text("\n".join(lines) + "\n")
EOF
}

serve_stage() {
    local levels=${GPT2X_SERVE_LEVELS:-1:32 16:192 64:320} scale=${GPT2X_SERVE_SCALE:-1} level_s=${GPT2X_SERVE_LEVEL_S:-40}
    local max_batch=${GPT2X_SERVE_MAX_BATCH:-64} port=${GPT2X_SERVE_PORT:-8765} precision=fp16 variants
    local prompt_tokens=128 new_tokens=128 model=random:gpt2 commit work folder
    serve_deadline=$(( $(date +%s) + ${GPT2X_SERVE_BUDGET_S:-270} ))
    if [ "$provider" = cpu ]; then precision=fp32; variants=${GPT2X_SERVE_VARIANTS:-default}; else variants=${GPT2X_SERVE_VARIANTS:-default slots}; fi
    commit=${GPT2X_COMMIT:-$(git rev-parse HEAD 2>/dev/null || echo unknown)}
    rm -f "$out/serve-status.tsv"
    work=$(mktemp -d)

    # What runs, before anything is timed: the commit, the environment, the providers that load.
    timeout 60 gpt2x info --json > "$work/info.json" 2> "$out/serve-info.log" || echo '{}' > "$work/info.json"
    # Each level's requests (the scale applied, at least the concurrency) and prompts, each level its own.
    local plan
    plan=$(python3 - "$scale" "$levels" <<'EOF'
import sys
scale = float(sys.argv[1])
for pair in sys.argv[2].split():
    c, n = (int(x) for x in pair.split(":"))
    print(f"{c}:{max(c, round(n * scale))}", end=" ")
EOF
    )
    python3 - "$out/serve-meta.json" "$work/info.json" "$commit" "$provider" "$precision" "$model" "$plan" "$scale" \
        "$prompt_tokens" "$new_tokens" "$max_batch" "$level_s" "${GPT2X_SERVE_BUDGET_S:-270}" "$variants" <<'EOF'
import json, sys, time
path, info, commit, provider, precision, model, plan, scale, prompt, new, batch, level_s, budget, variants = sys.argv[1:]
pairs = [tuple(int(x) for x in p.split(":")) for p in plan.split()]
try:
    info = json.load(open(info))
except ValueError:
    info = {}
meta = {"commit": commit, "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "provider": provider, "precision": precision,
        "model": model,
        "settings": {"concurrency": [c for c, _ in pairs], "requests": [n for _, n in pairs], "scale": float(scale),
                     "prompt_tokens": int(prompt), "max_tokens": int(new), "temperature": "loadtest default",
                     "ignore_eos": False, "max_batch_size": int(batch), "level_max_duration_s": float(level_s),
                     "budget_s": float(budget), "variants": variants.split()},
        "info": info}
json.dump(meta, open(path, "w"), indent=1)
print(f"serve stage: commit {commit}, {provider} {precision}, levels (concurrency:requests) {plan}, variants {variants}")
EOF
    # Skipped where gpt2x info says the provider does not load (no CUDA figure from a CPU run); where info itself
    # failed, the server's own check (it refuses a provider that does not load) decides.
    local loads
    loads=$(python3 -c 'import json, sys
try:
    print(json.load(open(sys.argv[1]))["providers loadable"][sys.argv[2]])
except (ValueError, KeyError, TypeError):
    print("unknown")' "$work/info.json" "$provider")
    case $loads in
        ok) ;;
        unknown) serve_note all info "gpt2x info gave no provider status (serve-info.log): the server checks it" ;;
        *) serve_note all skipped "the $provider provider does not load (gpt2x info: $loads): no figure"
           serve_meta; rm -rf "$work"; return 0 ;;
    esac
    if ! timeout 60 python3 - "$work" "$prompt_tokens" "$plan" <<'EOF'
import re, sys
import numpy as np
from gpt2x.tokenizer import get_encoding

work, tokens, plan = sys.argv[1], int(sys.argv[2]), sys.argv[3]
enc = get_encoding()
words, firsts = [], []  # " word" tokens, and "Word" tokens to begin a line with
for i in range(enc.n_vocab):
    try:
        b = enc.decode_single_token_bytes(i)
    except KeyError:
        continue
    if re.fullmatch(rb" [a-z]{3,}", b):
        words.append(i)
    elif re.fullmatch(rb"[A-Z][a-z]{2,}", b):
        firsts.append(i)
rng = np.random.default_rng(20261204)
seen = set()
counts = [("warmup", 64)] + [(f"c{p.split(':')[0]}", int(p.split(":")[1])) for p in plan.split()]
for name, n in counts:
    prompts = []
    while len(prompts) < n:
        ids = [int(rng.choice(firsts))] + [int(t) for t in rng.choice(words, tokens - 1)]
        text = enc.decode(ids)
        if len(enc.encode(text)) == tokens and text not in seen:
            seen.add(text)
            prompts.append(text)
    with open(f"{work}/prompts-{name}.txt", "w", encoding="utf-8") as f:
        f.write("\n".join(prompts) + "\n")
print(f"prompts: {sum(n for _, n in counts)} of {tokens} tokens")
EOF
    then
        serve_note all skipped "the prompts could not be made"; serve_meta; rm -rf "$work"; return 0
    fi
    # The export, made here where missing (not inside the server's 90 s to start): the folder both variants serve.
    local t0=$SECONDS
    if ! folder=$(timeout $(( $(serve_left) > 60 ? $(serve_left) - 60 : 1 )) python3 -c '
import sys
from gpt2x.choices import Precision
from gpt2x.workflows.exports import resolve_export
print(resolve_export(sys.argv[1], precision=Precision(sys.argv[2])).folder.resolve())' "$model" "$precision" 2> "$out/serve-export.log"); then
        serve_note all skipped "the $model $precision export failed (serve-export.log)"; serve_meta; rm -rf "$work"; return 0
    fi
    serve_note all export "$folder in $(( SECONDS - t0 )) s"

    local variant i=0 pid url c n ld started kv rc
    for variant in $variants; do
        url="http://127.0.0.1:$(( port + i ))"; i=$(( i + 1 ))
        if [ "$(serve_left)" -lt 60 ]; then serve_note "$variant" skipped "$(serve_left) s left of the stage's budget"; continue; fi
        kv=(); [ "$variant" = default ] || kv=(--kv-cache "$variant")
        # --onnx: the folder the export step made (or found), the same for every variant.
        local cmd=(gpt2x serve --provider "$provider" --onnx "$folder" --model "$model" --port "${url##*:}"
                   --max-batch-size "$max_batch" "${kv[@]}" --json)
        serve_note "$variant" command "${cmd[*]}"
        started=$SECONDS
        # timeout: the server cannot outlive the stage (it forwards the SIGTERM of serve_stop to the server)
        timeout -s TERM $(( $(serve_left) + 30 )) "${cmd[@]}" > "$out/serve-$variant-ready.json" 2> "$out/serve-$variant.log" &
        pid=$!
        # shellcheck disable=SC2064  # this server's pid, now
        trap "kill -TERM $pid 2>/dev/null || true" EXIT  # a run stopped by an error leaves no server behind
        while [ $(( SECONDS - started )) -lt 90 ] && kill -0 "$pid" 2>/dev/null && ! serve_health "${url##*:}"; do sleep 1; done
        if ! kill -0 "$pid" 2>/dev/null; then
            rc=0; wait "$pid" 2>/dev/null || rc=$?; trap - EXIT
            serve_note "$variant" refused "exit $rc before /health answered: $(tail -n 3 "$out/serve-$variant.log" | tr '\n\t' '  ' | cut -c1-400)"
            serve_meta; pack; continue
        fi
        if ! serve_health "${url##*:}"; then
            serve_note "$variant" failed "no /health within 90 s"
            serve_stop "$pid" "$variant"; trap - EXIT; serve_meta; pack; continue
        fi
        serve_note "$variant" ready "$(( SECONDS - started )) s after start"
        # Warm-up (not recorded as a level): every row count up to the top level's joins, 16 tokens each.
        timeout 60 gpt2x loadtest "$url" --requests 64 --concurrency 64 --max-tokens 16 --max-duration 30 --timeout 30 \
            --prompts-file "$work/prompts-warmup.txt" > "$out/serve-$variant-warmup.log" 2>&1 \
            || serve_note "$variant" warmup "exit $?"
        for pair in $plan; do
            c=${pair%%:*} n=${pair#*:}
            ld=$(( $(serve_left) - 15 )); [ "$ld" -le "$level_s" ] || ld=$level_s
            if [ "$ld" -lt 10 ]; then serve_note "$variant" "c$c" "skipped: $(serve_left) s left of the stage's budget"; continue; fi
            if ! kill -0 "$pid" 2>/dev/null; then serve_note "$variant" "c$c" "skipped: the server exited"; continue; fi
            echo "== serve $variant: concurrency $c, $n requests, --max-duration $ld" >&2
            # --timeout: a request may take the whole level (queued behind --max-batch-size), not the default 60 s.
            # Exit 11: every request failed (the JSON is written first).
            rc=0
            timeout $(( ld + 30 )) gpt2x loadtest "$url" --requests "$n" --concurrency "$c" --max-tokens "$new_tokens" \
                --max-duration "$ld" --timeout "$ld" --prompts-file "$work/prompts-c$c.txt" \
                --output "$out/serve-$variant-c$c.json" > "$out/serve-$variant-c$c.log" 2>&1 || rc=$?
            serve_note "$variant" "c$c" "exit $rc: $(python3 -c 'import json, sys; l = json.load(open(sys.argv[1]))["levels"][0]
print("%d/%d completed in %.1f s, %.0f output tok/s, failures %s" % (l["completed"], l["requests"], l["wall_s"],
      l["output_token_throughput"] or 0, l["failures"] or "none"))' "$out/serve-$variant-c$c.json" 2>/dev/null || echo "no JSON")"
            serve_meta; pack
        done
        serve_stop "$pid" "$variant"
        trap - EXIT
        serve_meta; pack
    done
    cat "$out/serve-summary.md" 2>/dev/null || true
    rm -rf "$work"
}

for stage in $stages; do
    start=$(date +%s)
    case $stage in
        quick)
            check; pack
            # Its own limit, so that a hang cannot eat the lease; its exit status is kept, not fatal.
            timeout 110 python3 -m pytest -m cuda -n 0 -q -rA -p no:cacheprovider $cuda_tests > "$out/cuda-tests.log" 2>&1 \
                || echo "cuda tests: exit $?" | tee -a "$out/stages.txt"
            pack
            # What gpt2x generate decodes at (its library call and the command itself) beside the bench's fixed-cache
            # row, greedy and sampled, batch 1 and 8, in one process (the export made here once).
            timeout 110 python3 benchmarks/cuda_generate.py --out "$out/cuda-generate" --provider "$provider" \
                --batches 1,8 --repeat 5 --cli > "$out/cuda-generate.log" 2>&1 \
                || echo "cuda generate: exit $?" | tee -a "$out/stages.txt"
            pack
            # Every batch-1 decode path beside the peers (genai with and without its CUDA graph, transformers eager and
            # static + torch.compile, a compiled PyTorch loop of gpt2x's own model) in one process.
            # The compiled peers run last (their compile is the longest part): a limit reached loses only them.
            timeout 200 python3 benchmarks/cuda_decode.py --out "$out/cuda-decode" --provider "$provider" \
                --precisions "${precisions#*,}" --prompt-len 32 --new-tokens 128 --repeat 3 \
                --contenders "=ort growing,=ort fixed cache + CUDA graph,=ort fixed cache,onnxruntime-genai,transformers,compile,graph loop" \
                > "$out/cuda-decode.log" 2>&1 || echo "cuda decode: exit $?" | tee -a "$out/stages.txt"
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
        serve) serve_stage ;;
        *) echo "unknown stage $stage (quick, check, tests, small, medium, large, xl, spec, serve)" >&2; exit 2 ;;
    esac
    echo "stage $stage: $(( $(date +%s) - start )) s" | tee -a "$out/stages.txt"
    pack
done
