"""Cold start of `gpt2x generate --onnx`: process start to the first token, against ONNX Runtime's
bare session creation and first run on the same export, in the same run.

    python benchmarks/cold_start.py --out benchmarks/results/cold-start-cpu-2core [--xl]

For each export (GPT-2 124M, random weights, at --precisions; with --xl also the gpt2-xl
architecture, fp32, whose weights are a 6.2 GB model.onnx.data), --repeat interleaved rounds of:
- gpt2x: `python -m gpt2x generate PROMPT --onnx DIR --greedy --max-new-tokens 1`, from process start
  until stdout holds more than the prompt (the first token's text); for fp32 also with `--kv-cache growing` (the
  export's own graph, where the default runs its in-place GroupQueryAttention twin);
- bare: a minimal Python process that imports onnxruntime and numpy, creates an InferenceSession
  (CPU provider, ONNX Runtime's defaults: every graph optimization, one intra-op thread per core),
  runs the prompt's ids once with an empty cache, and prints the argmax. It reports its session
  creation and first run, timed inside the process: the target's denominator.
Then one breakdown of gpt2x's start, phase by phase, in a fresh process (imports, opening the export,
the tokenizer, the session, the first step).

The export's files are in the page cache for every run (read once before the rounds): this measures
what a process costs, not the disk. Target (issue 18): gpt2x's median ≤ 1.3 x the bare median of
session creation + first run.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

from gpt2x.bench.report import save_results
from gpt2x.bench.system import system_info
from gpt2x.choices import Precision
from gpt2x.onnx.artifact import default_export_dir
from gpt2x.tokenizer import encode
from gpt2x.workflows.exports import ensure_export

PROMPT = "Hello, my name is"
TARGET = 1.3

BARE = r"""
import sys, time, json
t0 = time.perf_counter()
import numpy as np
import onnxruntime as ort
t1 = time.perf_counter()
path, ids, n_layer, n_head, head_dim = sys.argv[1], [int(x) for x in sys.argv[2].split(",")], *map(int, sys.argv[3:6])
so = ort.SessionOptions()
so.log_severity_level = 3
sess = ort.InferenceSession(path, sess_options=so, providers=["CPUExecutionProvider"])
t2 = time.perf_counter()
x = np.array([ids], dtype=np.int64)
feeds = {"input_ids": x, "attention_mask": np.ones_like(x), "position_ids": np.arange(x.shape[1], dtype=np.int64)[None]}
for i in range(n_layer):
    for kv in ("key", "value"):
        feeds[f"past_key_values.{i}.{kv}"] = np.zeros((1, n_head, 0, head_dim), np.float32)
logits = sess.run(["logits"], feeds)[0]
t3 = time.perf_counter()
print(int(logits[0, -1].argmax()), flush=True)
print(json.dumps({"import_s": t1 - t0, "session_s": t2 - t1, "first_run_s": t3 - t2}), flush=True)
"""

PHASES = r"""
import sys, time, json
t = [time.perf_counter()]
from gpt2x.choices import BackendKind
from gpt2x.workflows.backends import export_backend
from gpt2x.workflows.exports import resolve_export
from gpt2x.cli import app  # noqa: F401  (what the command line imports)
t.append(time.perf_counter())
info = resolve_export(onnx_dir=__import__("pathlib").Path(sys.argv[1]))
t.append(time.perf_counter())
from gpt2x.tokenizer import encode
ids = encode(sys.argv[2])
t.append(time.perf_counter())
backend = export_backend(BackendKind.ort, info, prefill_tokens=len(ids))  # as generate opens it
t.append(time.perf_counter())
import numpy as np
from gpt2x.numerics import positions
x = np.array([ids], dtype=np.int64)
m = np.ones_like(x)
backend.step(x, m, positions(m, x.shape[1]), None)
t.append(time.perf_counter())
names = ["imports", "open the export (read_export)", "tokenizer", "ONNX Runtime session", "first step"]
print(json.dumps({n: b - a for n, a, b in zip(names, t, t[1:])}))
"""


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def first_output_seconds(cmd: list[str], skip: int) -> tuple[float, str]:
    """Seconds from process start until stdout holds more than `skip` bytes, and all it printed."""
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    got = b""
    while len(got) <= skip:
        chunk = proc.stdout.read1(64)
        if not chunk:
            raise RuntimeError(f"no output from {cmd}: {proc.stderr.read().decode()[-500:]}")
        got += chunk
    elapsed = time.perf_counter() - t0
    rest, err = proc.communicate()
    if proc.returncode != 0:
        raise RuntimeError(f"{cmd} failed: {err.decode()[-500:]}")
    return elapsed, (got + rest).decode()


def warm_page_cache(folder: Path) -> None:
    for p in folder.rglob("*"):  # an export's folders too (its OpenVINO prefill graph)
        if not p.is_file():
            continue
        with open(p, "rb") as f:
            while f.read(1 << 24):
                pass


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="random:gpt2")
    ap.add_argument("--precisions", default="fp32,int8")
    ap.add_argument("--xl", action="store_true", help="also random:gpt2-xl at fp32 (exported first if missing: ~3 min, 13 GB RSS)")
    ap.add_argument("--repeat", type=int, default=7)
    ap.add_argument("--exports", type=Path, default=Path("exported"))
    ap.add_argument("--out", type=Path, required=True, help="output path without extension (.json, .md)")
    args = ap.parse_args()
    cases = [(args.model, Precision(p)) for p in args.precisions.split(",")]
    if args.xl:
        cases.append(("random:gpt2-xl", Precision.fp32))
    ids = encode(PROMPT)
    exports = {}
    for model, precision in cases:
        info = ensure_export(model, precision, folder=default_export_dir(model, precision, args.exports),
                                       progress=log, notice=log)
        exports[(model, precision)] = info
        warm_page_cache(info.folder)
    runs: dict = {f"{m} {p.value}": {"gpt2x_s": [], "gpt2x_growing_s": [], "bare_process_s": [], "bare_session_s": [],
                                      "bare_first_run_s": [], "bare_import_s": []} for m, p in cases}
    for r in range(args.repeat):
        log(f"round {r + 1}/{args.repeat}")
        for (model, precision), info in exports.items():
            cfg = info.config
            key = f"{model} {precision.value}"
            # fp32 also with --kv-cache growing: the export's own graph, not its in-place twin (the default)
            who_all = ["gpt2x", "bare"] + (["gpt2x_growing"] if precision is Precision.fp32 else [])
            order = who_all[r % len(who_all):] + who_all[: r % len(who_all)]
            for who in order:
                if who.startswith("gpt2x"):
                    cmd = [sys.executable, "-m", "gpt2x", "generate", PROMPT, "--onnx", str(info.folder), "--greedy",
                           "--max-new-tokens", "1", *(["--kv-cache", "growing"] if who == "gpt2x_growing" else [])]
                    s, _ = first_output_seconds(cmd, len(PROMPT))
                    runs[key][f"{who}_s"].append(s)
                else:
                    cmd = [sys.executable, "-c", BARE, str(info.model_path), ",".join(map(str, ids)), str(cfg.n_layer),
                           str(cfg.n_head), str(cfg.head_dim)]
                    s, text = first_output_seconds(cmd, 0)
                    inner = json.loads(text.strip().splitlines()[-1])
                    runs[key]["bare_process_s"].append(s)
                    runs[key]["bare_session_s"].append(inner["session_s"])
                    runs[key]["bare_first_run_s"].append(inner["first_run_s"])
                    runs[key]["bare_import_s"].append(inner["import_s"])
                time.sleep(0.2)
    results = []
    for (model, precision), info in exports.items():
        key = f"{model} {precision.value}"
        rr = runs[key]
        phases = json.loads(subprocess.run([sys.executable, "-c", PHASES, str(info.folder), PROMPT], capture_output=True,
                                           text=True, check=True).stdout.strip().splitlines()[-1])
        med = {k: statistics.median(v) for k, v in rr.items() if v}
        bare = statistics.median([a + b for a, b in zip(rr["bare_session_s"], rr["bare_first_run_s"])])
        results.append({"export": key, "folder": str(info.folder),
                        "bytes": sum(p.stat().st_size for p in info.folder.iterdir()),
                        "median_s": med, "bare_session_plus_first_run_s": bare, "ratio": med["gpt2x_s"] / bare,
                        "target": TARGET, "met": med["gpt2x_s"] / bare <= TARGET, "runs": rr, "gpt2x_phases_s": phases})
    out = {"machine": system_info(), "command": " ".join(["python", *sys.argv]), "prompt": PROMPT, "repeat": args.repeat,
           "results": results}
    lines = [f"Cold start on {out['machine']['cpu']} ({out['machine']['cores']} cores), {out['machine']['date']}, "
             f"gpt2x git {out['machine']['git']}; {args.repeat} interleaved rounds, medians; files in the page cache.", "",
             "| export | size | gpt2x generate: start to first token | the same, --kv-cache growing | bare ORT process: "
             "start to first token | bare session creation | bare first run | gpt2x / (session + first run) | target ≤ 1.3x "
             "| gpt2x phases |",
             "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- | --- |"]
    for x in results:
        m = x["median_s"]
        ph = ", ".join(f"{k} {v * 1e3:.0f} ms" for k, v in x["gpt2x_phases_s"].items())
        growing = f"{m['gpt2x_growing_s']:.2f} s" if "gpt2x_growing_s" in m else "n/a"
        lines.append(f"| {x['export']} | {x['bytes'] / 1e6:.0f} MB | {m['gpt2x_s']:.2f} s | {growing} | {m['bare_process_s']:.2f} s | "
                     f"{m['bare_session_s']:.2f} s | {m['bare_first_run_s'] * 1e3:.0f} ms | {x['ratio']:.2f}x | "
                     f"{'met' if x['met'] else 'not met'} | {ph} |")
    text = "\n".join(lines) + "\n"
    save_results(args.out, out, text)
    print(text)


if __name__ == "__main__":
    main()
