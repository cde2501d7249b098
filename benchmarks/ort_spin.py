"""ONNX Runtime's intra-op spin after a run (GPT2X_ORT_SPIN_US) in gpt2x's serving engine: the first token of a fresh
prompt that follows decode steps, batch-1 decode and 16 prompts at once, each setting in processes of its own, in
alternating rounds.

    python benchmarks/ort_spin.py --export EXPORTS/random-gpt2-int8 --out benchmarks/results/ort-spin-cpu-2core

Why: ONNX Runtime's threads spin for a while after each run, waiting for the next. Where the next thing to run is
OpenVINO's prefill graph (an int8 export's fresh prompts), they hold a core that OpenVINO's threads need. Each round
starts one process per setting (`default`: ONNX Runtime's own spin; a number: that many microseconds), which opens the
export's `ort` backend (2 threads) in the serving engine and measures, after a warm-up:

- first token: --prompts fresh prompts of --prompt-len random tokens, one at a time, 4 tokens each (so that decode
  steps run just before every prefill), the median time from submit to the first token, and the same at 512 tokens;
- batch-1 decode: 64 greedy tokens after a 32-token prompt, tokens after the first over the time after it, median of 3;
- 16 prompts of 32 tokens at once, 64 greedy tokens each: output tok/s (median of 3) and the rows' mean first token.

Only the serving engine and the backends, as `gpt2x serve` runs them.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np

from gpt2x.bench.report import save_results
from gpt2x.bench.system import system_info


def run_rows(engine, prompts: np.ndarray, n: int) -> tuple[float, list[float]]:
    """Every prompt submitted at once, n greedy tokens each: (wall s, each row's first-token s)."""
    from gpt2x.generation.settings import SamplingSettings
    from gpt2x.serve.core.engine import Row
    from gpt2x.serve.core.outputs import Failed, Finished, TokenOut

    first, left, done, lock = [0.0] * len(prompts), [len(prompts)], threading.Event(), threading.Lock()
    errors: list[str] = []

    def sink_for(i: int):
        def sink(out) -> None:
            if isinstance(out, TokenOut) and not first[i]:
                first[i] = time.perf_counter()
            elif isinstance(out, (Finished, Failed)):
                if isinstance(out, Failed):
                    errors.append(out.message)
                with lock:
                    left[0] -= 1
                    if not left[0]:
                        done.set()
        return sink

    settings = SamplingSettings(max_new_tokens=n, greedy=True, ignore_eos=True)
    t0 = time.perf_counter()
    engine.submit([Row(p.tolist(), settings, sink_for(i)) for i, p in enumerate(prompts)])
    done.wait()
    if errors:
        raise RuntimeError(errors[0])
    return time.perf_counter() - t0, [f - t0 for f in first]


def measure(export: Path, prompts: int, prompt_len: int) -> dict:
    """One setting's figures, in this process (its GPT2X_ORT_SPIN_US)."""
    from gpt2x.choices import BackendKind, ProviderKind
    from gpt2x.onnx.artifact import read_export
    from gpt2x.serve.core.engine import Engine, EngineSettings
    from gpt2x.workflows.backends import export_backend

    backend = export_backend(BackendKind.ort, read_export(export), ProviderKind.cpu, 2)
    engine = Engine(backend, EngineSettings(max_batch_size=16)).start()
    rng = np.random.default_rng(int(time.time_ns() % 2**32))  # fresh prompts every round: no prefix is reused
    try:
        fresh = lambda rows, length: rng.integers(0, 50257, (rows, length))  # noqa: E731
        run_rows(engine, fresh(16, 32), 8)  # warm-up: both prefill runtimes and the batched graph compile or open
        run_rows(engine, fresh(1, 512), 4)
        ttft = [run_rows(engine, fresh(1, prompt_len), 4)[1][0] for _ in range(prompts)]
        ttft_512 = [run_rows(engine, fresh(1, 512), 4)[1][0] for _ in range(max(3, prompts // 4))]
        decode = []
        for _ in range(3):
            wall, first = run_rows(engine, fresh(1, 32), 64)
            decode.append(63 / (wall - first[0]))
        batch = [run_rows(engine, fresh(16, 32), 64) for _ in range(3)]
        return {"ttft_ms": statistics.median(ttft) * 1e3, "ttft_512_ms": statistics.median(ttft_512) * 1e3,
                "decode_tok_s": statistics.median(decode),
                "batch16_tok_s": statistics.median(16 * 64 / wall for wall, _ in batch),
                "batch16_ttft_mean_ms": statistics.median(statistics.mean(f) for _, f in batch) * 1e3,
                "prefill": backend.prefill, "prefill_from": backend.prefill_from}
    finally:
        engine.close()
        backend.close()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--export", type=Path, required=True, help="a gpt2x export (an int8 one has the OpenVINO prefill)")
    ap.add_argument("--out", type=Path, required=True, help="output path without extension")
    ap.add_argument("--settings", default="default,1000", help="GPT2X_ORT_SPIN_US values, comma-separated")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--prompts", type=int, default=20)
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(measure(args.export, args.prompts, args.prompt_len)))
        return 0
    settings = args.settings.split(",")
    runs: dict[str, list[dict]] = {s: [] for s in settings}
    for r in range(args.rounds):
        for s in settings if r % 2 == 0 else settings[::-1]:
            cmd = [sys.executable, __file__, "--child", "--export", str(args.export), "--out", str(args.out),
                   "--prompts", str(args.prompts), "--prompt-len", str(args.prompt_len)]
            out = subprocess.run(cmd, env={**os.environ, "GPT2X_ORT_SPIN_US": s}, capture_output=True, text=True)
            if out.returncode:
                print(out.stderr, file=sys.stderr)
                return 1
            runs[s].append(json.loads(out.stdout.strip().splitlines()[-1]))
            print(f"round {r + 1}, GPT2X_ORT_SPIN_US={s}: {runs[s][-1]}", file=sys.stderr)
    keys = ("ttft_ms", "ttft_512_ms", "decode_tok_s", "batch16_tok_s", "batch16_ttft_mean_ms")
    rows = [{"setting": s, **{k: statistics.median(x[k] for x in runs[s]) for k in keys},
             **{f"{k}_range": [min(x[k] for x in runs[s]), max(x[k] for x in runs[s])] for k in keys}} for s in settings]
    command = "python benchmarks/ort_spin.py " + " ".join(sys.argv[1:])
    info = system_info()
    lines = ["# ONNX Runtime's intra-op spin in gpt2x's serving engine", "",
             f"Export: {args.export} (prefill: {runs[settings[0]][0]['prefill']}, from {runs[settings[0]][0]['prefill_from']} tokens). "
             f"{args.rounds} rounds, the settings' processes alternating; medians over the rounds (range).", "",
             f"Machine: {info['cpu']}, {info['cores']} cores; {info['date']}, gpt2x git {info.get('git')}.", "",
             f"Command: `{command}`", "",
             f"| GPT2X_ORT_SPIN_US | first token, {args.prompt_len} tokens, ms | first token, 512 tokens, ms | batch-1 decode tok/s "
             "| 16 prompts: output tok/s | 16 prompts: mean first token ms |",
             "| --- | ---: | ---: | ---: | ---: | ---: |"]
    for row in rows:
        cells = [f"{row[k]:.1f} ({row[k + '_range'][0]:.1f}-{row[k + '_range'][1]:.1f})" for k in keys]
        lines.append(f"| {row['setting']} | " + " | ".join(cells) + " |")
    save_results(args.out, {"command": command, "system": info, "rows": rows, "runs": runs}, "\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
