"""`gpt2x eval`'s task check with lm-eval's own tasks: each run parsing lm-eval's task files (GPT2X_LMEVAL_INDEX=off,
as before the kept index) against reading the index an earlier run kept, in the same run.

    python benchmarks/eval_index.py --out benchmarks/results/eval-index-cpu-2core

--repeat interleaved rounds of two fresh processes each: `gpt2x eval --tasks hellasawg` (a misspelt task: the one
line naming the closest names comes after the whole index, before any model is loaded), timed from process start to
its exit, with the index off and with the index kept in a temporary folder (made once before the rounds: its first
run, timed too). Medians.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from importlib.metadata import version
from pathlib import Path

from gpt2x.bench.report import save_results
from gpt2x.bench.system import system_info
from gpt2x.lmeval.index import INDEX_ENV

COMMAND = [sys.executable, "-m", "gpt2x", "eval", "--tasks", "hellasawg"]


def timed(index: str) -> float:
    """Seconds from start to exit of COMMAND with GPT2X_LMEVAL_INDEX=`index`; it must end with the unknown task's line."""
    start = time.perf_counter()
    r = subprocess.run(COMMAND, capture_output=True, text=True, encoding="utf-8", env={**os.environ, INDEX_ENV: index})
    took = time.perf_counter() - start
    if r.returncode == 0 or "unknown task 'hellasawg' (did you mean hellaswag" not in r.stderr:
        raise SystemExit(f"unexpected: exit {r.returncode}, {r.stderr.strip()[-300:]}")
    return took


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--out", type=Path, required=True, help="output path without extension (.json, .md)")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as folder:
        first = timed(folder)
        runs: dict[str, list[float]] = {"off": [], "kept": []}
        for _ in range(args.repeat):
            runs["off"].append(timed("off"))
            runs["kept"].append(timed(folder))
        kept_bytes = sum(p.stat().st_size for p in Path(folder).iterdir())
    medians = {k: statistics.median(v) for k, v in runs.items()}
    machine = system_info()
    out = {"machine": machine, "command": " ".join(["python", *sys.argv]), "timed": " ".join(COMMAND[1:]),
           "lm_eval": version("lm_eval"), "repeat": args.repeat, "first_run_s": first, "runs_s": runs,
           "median_s": medians, "kept_bytes": kept_bytes}
    text = (f"`gpt2x eval --tasks hellasawg` (a misspelt task), process start to exit, on {machine['cpu']} "
            f"({machine['cores']} cores), {machine['date']}, gpt2x git {machine.get('git')}, lm-eval {out['lm_eval']}; "
            f"{args.repeat} interleaved rounds, medians.\n\n"
            "| lm-eval's task index | start to exit |\n| --- | ---: |\n"
            f"| parsed on every run (`{INDEX_ENV}=off`) | {medians['off']:.2f} s |\n"
            f"| parsed and kept (the first run) | {first:.2f} s |\n"
            f"| read back from the first run's ({kept_bytes / 2**20:.0f} MiB) | {medians['kept']:.2f} s |\n")
    save_results(args.out, out, text)
    sys.stdout.write(text)


if __name__ == "__main__":
    main()
