"""The API's token logprobs (`generation.logprobs.token_logprobs`) over GPT-2's vocabulary: a decode step's row, and a
prompt scored whole (`echo` with `logprobs`: lm-eval's loglikelihood requests to `gpt2x serve`).

    git worktree add /tmp/base COMMIT && python benchmarks/logprobs_speed.py --baseline /tmp/base
        # writes benchmarks/results/logprobs-speed-<machine>.{json,md}: the baseline checkout and this one
    python benchmarks/logprobs_speed.py --baseline /tmp/base --served EXPORT_DIR
        # and a prompt scored over the API, each checkout's `gpt2x serve` on the export

Each checkout runs in a worker process of its own (PYTHONPATH), on the same random float32 logits (standard normal
times 4) and chosen tokens; the workers take turns round by round, the order alternating, so that the machine's
drift hits both alike. Median ms over the rounds per case; and, per case, the largest difference between the two
checkouts' log-probabilities and whether they listed the same top tokens in the same order.

--served: both checkouts' `gpt2x serve --onnx EXPORT_DIR --threads 1` run side by side, idle but for the request sent
to one of them at a time (in turns, the order alternating): /v1/completions with the longest prompt the export takes,
echo, logprobs 1 and max_tokens 1 (the request lm-eval's loglikelihood sends); the median latency of each.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

import numpy as np
from sampling_speed import cpu_model, take_turns

V = 50257
ROOT = Path(__file__).resolve().parent.parent
CASES = [(1, 0), (1, 5), (255, 1), (1023, 0), (1023, 5)]  # (rows, k): a decode row; prompts of 256 and 1024 tokens


def commit(path: Path) -> str:
    return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=path, capture_output=True, text=True,
                          check=False).stdout.strip()


def worker(repeats: int) -> None:
    """--worker, as take_turns drives it: a step's number a line (step 0 untimed), every case run ("ok" after each);
    "end": every timed step's median ms per case, and every case's entries, for the comparison, as one JSON line."""
    from gpt2x.generation.logprobs import token_logprobs

    rng = np.random.default_rng(0)
    data = {(t, k): ((rng.standard_normal((t, V)) * 4).astype(np.float32), rng.integers(0, V, t).tolist())
            for t, k in CASES}
    rounds = []
    for line in sys.stdin:
        if line.strip() == "end":
            break
        times = {}
        for (t, k), (logits, chosen) in data.items():
            spans = []
            for _ in range(repeats if t == 1 else 1):
                start = time.perf_counter()
                token_logprobs(logits, chosen, k)
                spans.append(time.perf_counter() - start)
            times[f"{t},{k}"] = statistics.median(spans) * 1e3
        if int(line):  # the first step warms up
            rounds.append(times)
        print("ok", flush=True)
    print(json.dumps({"rounds": rounds, "entries": {f"{t},{k}": token_logprobs(*data[(t, k)], k) for t, k in CASES}}),
          flush=True)


def served(checkouts: dict[str, Path], export: Path, rounds: int) -> dict:
    """Each checkout's server on `export`, a prompt scored in turns; {checkout: median ms, "prompt_tokens": n}."""
    import httpx

    n = json.loads((export / "config.json").read_text())["n_positions"] - 1
    prompt = [int(t) for t in np.random.default_rng(1).integers(0, V - 1, n)]
    body = {"prompt": prompt, "echo": True, "logprobs": 1, "max_tokens": 1, "temperature": 0}
    with contextlib.ExitStack() as stack:
        urls = {}
        for name, path in checkouts.items():
            proc = subprocess.Popen([sys.executable, "-m", "gpt2x", "serve", "--onnx", str(export), "--port", "0",
                                     "--threads", "1", "--json"], env={**os.environ, "PYTHONPATH": str(path)},
                                    cwd=path, stdout=subprocess.PIPE, text=True)  # -m: the cwd's gpt2x comes first
            stack.callback(proc.wait, 30)
            stack.callback(proc.terminate)
            urls[name] = json.loads(proc.stdout.readline())["url"]
        spans: dict[str, list[float]] = {name: [] for name in urls}
        with httpx.Client(timeout=120) as client:
            for r in range(rounds + 1):
                for name in list(urls) if r % 2 == 0 else list(urls)[::-1]:
                    start = time.perf_counter()
                    answer = client.post(f"{urls[name]}/v1/completions", json=body)
                    answer.raise_for_status()
                    if r:  # the first round warms up
                        spans[name].append(time.perf_counter() - start)
    return {"prompt_tokens": n, **{name: statistics.median(s) * 1e3 for name, s in spans.items()}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--baseline", type=Path, required=True, help="the other checkout (git worktree add DIR COMMIT)")
    ap.add_argument("--rounds", type=int, default=15, help="timed rounds per checkout (after one untimed)")
    ap.add_argument("--repeats", type=int, default=200, help="calls per round for a single row (their median)")
    ap.add_argument("--served", type=Path, default=None, help="an export: a prompt scored over each checkout's server too")
    ap.add_argument("--out", type=Path, default=None, help="default: benchmarks/results/logprobs-speed-cpu-<cores>core")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        return worker(args.repeats)
    checkouts = {"before": args.baseline.resolve(), "after": ROOT}
    command = [sys.executable, __file__, "--worker", "--baseline", str(args.baseline), "--repeats", str(args.repeats)]
    runs = take_turns(command, checkouts, args.rounds + 1)
    rounds = {name: run["rounds"] for name, run in runs.items()}
    entries = {name: run["entries"] for name, run in runs.items()}
    results = []
    for t, k in CASES:
        key = f"{t},{k}"
        a, b = entries["before"][key], entries["after"][key]
        diff = max(max([abs(x[1] - y[1])] + [abs(p[1] - q[1]) for p, q in zip(x[2], y[2])]) for x, y in zip(a, b))
        same_top = all([p[0] for p in x[2]] == [q[0] for q in y[2]] for x, y in zip(a, b))
        results.append({"rows": t, "k": k, **{f"{name}_ms": statistics.median(r[key] for r in rounds[name])
                                             for name in rounds},
                        "max_logprob_difference": diff, "same_top_tokens": same_top})
    api = served(checkouts, args.served.resolve(), args.rounds) if args.served else None
    record = {"command": " ".join(["python", "benchmarks/logprobs_speed.py", *sys.argv[1:]]),
              "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
              "machine": {"cpu": cpu_model(), "cores": os.cpu_count(), "python": platform.python_version(),
                          "numpy": np.__version__},
              "commits": {name: commit(path) for name, path in checkouts.items()}, "vocab": V, "rounds": args.rounds,
              "repeats": args.repeats, "results": results,
              **({"served": {"export": str(args.served), **api}} if api else {})}
    lines = [f"`{record['command']}`: before at {record['commits']['before']}, after at {record['commits']['after']}, "
             f"{record['date']}, {record['machine']['cpu']} ({record['machine']['cores']} cores), NumPy "
             f"{record['machine']['numpy']}. Median ms over {args.rounds} rounds (a single row: the median of "
             f"{args.repeats} calls a round).", "",
             "| rows | k | before ms | after ms | speed-up | max \\|Δ logprob\\| | same top tokens |",
             "| ---: | ---: | ---: | ---: | ---: | ---: | --- |"]
    lines += [f"| {r['rows']} | {r['k']} | {r['before_ms']:.3f} | {r['after_ms']:.3f} | "
              f"{r['before_ms'] / r['after_ms']:.2f}x | {r['max_logprob_difference']:.1e} | "
              f"{'yes' if r['same_top_tokens'] else 'NO'} |" for r in results]
    if api:
        config = json.loads((args.served / "config.json").read_text())
        lines += ["", f"Over the API: a {api['prompt_tokens']}-token prompt scored (echo, logprobs 1, max_tokens 1) by "
                  f"`gpt2x serve --threads 1` on `{args.served.name}` ({config['n_layer']} layers, {config['n_embd']} "
                  f"wide), median of {args.rounds} requests each: before {api['before']:.1f} ms, after "
                  f"{api['after']:.1f} ms ({api['before'] / api['after']:.2f}x)."]
    out = args.out or ROOT / "benchmarks" / "results" / f"logprobs-speed-cpu-{os.cpu_count()}core"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(record, indent=1) + "\n")
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return None


if __name__ == "__main__":
    main()
