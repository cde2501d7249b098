"""The API's token logprobs (`generation.logprobs.token_logprobs`) over GPT-2's vocabulary: a decode step's row, and a
prompt scored whole (`echo` with `logprobs`: lm-eval's loglikelihood requests to `gpt2x serve`).

    git worktree add /tmp/base COMMIT && python benchmarks/logprobs_speed.py --baseline /tmp/base
        # writes benchmarks/results/logprobs-speed-<machine>.{json,md}: the baseline checkout and this one

Each checkout runs in a worker process of its own (PYTHONPATH), on the same random float32 logits (standard normal
times 4) and chosen tokens; the workers take turns round by round, the order alternating, so that the machine's
drift hits both alike. Median ms over the rounds per case; and, per case, the largest difference between the two
checkouts' log-probabilities and whether they listed the same top tokens in the same order.
"""

from __future__ import annotations

import argparse
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

V = 50257
ROOT = Path(__file__).resolve().parent.parent
CASES = [(1, 0), (1, 5), (255, 1), (1023, 0), (1023, 5)]  # (rows, k): a decode row; prompts of 256 and 1024 tokens


def cpu_model() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor() or "unknown"


def commit(path: Path) -> str:
    return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=path, capture_output=True, text=True,
                          check=False).stdout.strip()


def worker(repeats: int) -> None:
    """--worker: one round a line on stdin ("end": stop); each round prints every case's median ms, then (at the end)
    the entries of every case, for the comparison."""
    from gpt2x.generation.logprobs import token_logprobs

    rng = np.random.default_rng(0)
    data = {(t, k): ((rng.standard_normal((t, V)) * 4).astype(np.float32), rng.integers(0, V, t).tolist())
            for t, k in CASES}
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
        print(json.dumps(times), flush=True)
    print(json.dumps({f"{t},{k}": token_logprobs(*data[(t, k)], k) for t, k in CASES}), flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--baseline", type=Path, required=True, help="the other checkout (git worktree add DIR COMMIT)")
    ap.add_argument("--rounds", type=int, default=15, help="timed rounds per checkout (after one untimed)")
    ap.add_argument("--repeats", type=int, default=200, help="calls per round for a single row (their median)")
    ap.add_argument("--out", type=Path, default=None, help="default: benchmarks/results/logprobs-speed-cpu-<cores>core")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        return worker(args.repeats)
    checkouts = {"before": args.baseline.resolve(), "after": ROOT}
    command = [sys.executable, __file__, "--worker", "--baseline", str(args.baseline), "--repeats", str(args.repeats)]
    procs = {name: subprocess.Popen(command, env={**os.environ, "PYTHONPATH": str(path)}, stdin=subprocess.PIPE,
                                    stdout=subprocess.PIPE, text=True) for name, path in checkouts.items()}
    rounds: dict[str, list[dict]] = {name: [] for name in procs}
    for r in range(args.rounds + 1):
        for name in list(procs) if r % 2 == 0 else list(procs)[::-1]:
            procs[name].stdin.write("round\n")
            procs[name].stdin.flush()
            times = json.loads(procs[name].stdout.readline())
            if r:  # the first round warms up
                rounds[name].append(times)
    entries = {}
    for name, proc in procs.items():
        proc.stdin.write("end\n")
        proc.stdin.flush()
        entries[name] = json.loads(proc.stdout.readline())
        proc.wait()
    results = []
    for t, k in CASES:
        key = f"{t},{k}"
        a, b = entries["before"][key], entries["after"][key]
        diff = max(max([abs(x[1] - y[1])] + [abs(p[1] - q[1]) for p, q in zip(x[2], y[2])]) for x, y in zip(a, b))
        same_top = all([p[0] for p in x[2]] == [q[0] for q in y[2]] for x, y in zip(a, b))
        results.append({"rows": t, "k": k, **{f"{name}_ms": statistics.median(r[key] for r in rounds[name])
                                             for name in rounds},
                        "max_logprob_difference": diff, "same_top_tokens": same_top})
    record = {"command": " ".join(["python", "benchmarks/logprobs_speed.py", *sys.argv[1:]]),
              "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
              "machine": {"cpu": cpu_model(), "cores": os.cpu_count(), "python": platform.python_version(),
                          "numpy": np.__version__},
              "commits": {name: commit(path) for name, path in checkouts.items()}, "vocab": V, "rounds": args.rounds,
              "repeats": args.repeats, "results": results}
    lines = [f"`{record['command']}`: before at {record['commits']['before']}, after at {record['commits']['after']}, "
             f"{record['date']}, {record['machine']['cpu']} ({record['machine']['cores']} cores), NumPy "
             f"{record['machine']['numpy']}. Median ms over {args.rounds} rounds (a single row: the median of "
             f"{args.repeats} calls a round).", "",
             "| rows | k | before ms | after ms | speed-up | max \\|Δ logprob\\| | same top tokens |",
             "| ---: | ---: | ---: | ---: | ---: | ---: | --- |"]
    lines += [f"| {r['rows']} | {r['k']} | {r['before_ms']:.3f} | {r['after_ms']:.3f} | "
              f"{r['before_ms'] / r['after_ms']:.2f}x | {r['max_logprob_difference']:.1e} | "
              f"{'yes' if r['same_top_tokens'] else 'NO'} |" for r in results]
    out = args.out or ROOT / "benchmarks" / "results" / f"logprobs-speed-cpu-{os.cpu_count()}core"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(record, indent=1) + "\n")
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return None


if __name__ == "__main__":
    main()
