"""What importing a module costs a fresh process: `onnx` (and `ml_dtypes`, which it imports), against the versions of
ml_dtypes each interpreter given has, in the same run.

    python benchmarks/import_cost.py --out benchmarks/results/import-cost-cpu-2core \
        --python .venv/bin/python --python /tmp/mlv07/bin/python

Each interpreter, --repeat interleaved rounds: a new process per module that imports numpy first (every gpt2x process
has it), then times the module's import in CPU seconds (time.process_time) and wall seconds. Medians. The
interpreters are labelled by their ml_dtypes and onnx versions. Every process that reads or writes a graph with
onnx (`gpt2x export`, a serving replica that rewrites its graph, the tests' workers) pays the onnx row once.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

from gpt2x.bench.report import save_results
from gpt2x.bench.system import system_info

MODULES = ("ml_dtypes", "onnx")

TIMED = r"""
import json, sys, time
import numpy
c0, w0 = time.process_time(), time.perf_counter()
__import__(sys.argv[1])
print(json.dumps({"cpu_s": time.process_time() - c0, "wall_s": time.perf_counter() - w0}))
"""

VERSIONS = r"""
import json
from importlib.metadata import version
print(json.dumps({name: version(name) for name in ("ml_dtypes", "onnx", "numpy")}))
"""


def run(python: str, code: str, *args: str) -> dict:
    out = subprocess.run([python, "-c", code, *args], capture_output=True, text=True, encoding="utf-8", check=True)
    return json.loads(out.stdout)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--python", action="append", required=True, help="an interpreter to time (repeat the option)")
    ap.add_argument("--repeat", type=int, default=9)
    ap.add_argument("--out", type=Path, required=True, help="output path without extension (.json, .md)")
    args = ap.parse_args()
    versions = {python: run(python, VERSIONS) for python in args.python}
    times: dict = {python: {m: [] for m in MODULES} for python in args.python}
    for _ in range(args.repeat):
        for python in args.python:
            for module in MODULES:
                times[python][module].append(run(python, TIMED, module))
    rows = []
    for python in args.python:
        for module in MODULES:
            runs = times[python][module]
            rows.append({"python": python, **versions[python], "module": module,
                         "cpu_s": statistics.median(r["cpu_s"] for r in runs),
                         "wall_s": statistics.median(r["wall_s"] for r in runs), "runs": runs})
    machine = system_info()
    out = {"machine": machine, "command": " ".join(["python", *sys.argv]), "repeat": args.repeat, "rows": rows}
    lines = [f"Import cost in a fresh process on {machine['cpu']} ({machine['cores']} cores), {machine['date']}, "
             f"gpt2x git {machine.get('git')}; {args.repeat} interleaved rounds, medians; numpy imported first.", "",
             "| ml_dtypes | onnx | numpy | module | CPU | wall |", "| --- | --- | --- | --- | ---: | ---: |"]
    for r in rows:
        lines.append(f"| {r['ml_dtypes']} | {r['onnx']} | {r['numpy']} | `{r['module']}` | {r['cpu_s'] * 1e3:.0f} ms | "
                     f"{r['wall_s'] * 1e3:.0f} ms |")
    save_results(args.out, out, "\n".join(lines) + "\n")
    sys.stdout.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
