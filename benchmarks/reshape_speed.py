"""Speed before and after a reshaping of the runtime band (issue 28): `gpt2x bench` at batch 1
(decode tokens/s and time to first token, ONNX Runtime on the CPU) run from a base commit and from
this checkout, alternating, in one run of this script, so that both see the same machine; then, with
`--engine-load`, each version's own `benchmarks/engine_load.py` (the serving engine alone under
concurrent load), once each, one after the other.

    python benchmarks/reshape_speed.py --base 0b8f387 --out benchmarks/results/reshape-speed-cpu-2core

The base runs from a detached `git worktree` of the base commit (PYTHONPATH), in the same virtual
environment; each version makes its own exports (the export metadata changed between them), in its
own folder, before the first timed round. Each round runs both versions, in an order that alternates;
the table gives each version's median over the rounds and the ratio after/before.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
TEXT = "ROMEO: But soft, what light through yonder window breaks? It is the east, and Juliet is the sun."


def bench_args(args) -> list[str]:
    return ["bench", "--model", args.model, "--backends", "ort", "--precisions", args.precisions, "--batch", "1",
            "--prompt-len", str(args.prompt_len), "--new-tokens", str(args.new_tokens), "--repeat", str(args.repeat)]


def run_version(name: str, source: Path, work: Path, args, result_file: Path) -> dict:
    """One `gpt2x bench` of the version in `source`, in `work` (its exports under work/exported)."""
    env = {**os.environ, "PYTHONPATH": str(source), "GPT2X_EXPORTS": str(work / "exported"), "HF_HUB_OFFLINE": "1"}
    # The base commit's bench writes its JSON with `--json PATH`; this checkout's with `--output PATH`.
    out_flag = "--json" if name == "before" else "--output"
    cmd = [sys.executable, "-m", "gpt2x", "-q", *bench_args(args), "--text", str(work / "text.txt"), out_flag, str(result_file)]
    r = subprocess.run(cmd, cwd=work, env=env, capture_output=True, text=True, timeout=1800)
    if r.returncode != 0:
        raise SystemExit(f"{name}: gpt2x bench failed ({r.returncode}):\n{r.stderr[-2000:]}")
    return json.loads(result_file.read_text())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--base", required=True, help="the commit before the reshaping")
    ap.add_argument("--model", default="random:gpt2")
    ap.add_argument("--precisions", default="fp32,int8")
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--engine-load", default="", help="concurrency levels for engine_load.py (e.g. 1,4,16); empty: skip")
    ap.add_argument("--out", type=Path, required=True, help="output path without extension (.json, .md)")
    args = ap.parse_args()
    base = subprocess.run(["git", "rev-parse", "--short", args.base], cwd=REPO, capture_output=True, text=True, check=True).stdout.strip()
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True, check=True).stdout.strip()
    rows = []
    with tempfile.TemporaryDirectory(prefix="gpt2x-reshape-") as tmp:
        tmp = Path(tmp)
        tree = tmp / "base-tree"
        subprocess.run(["git", "worktree", "add", "--detach", str(tree), args.base], cwd=REPO, check=True, capture_output=True)
        try:
            versions = {"before": tree, "after": REPO}
            for name in versions:
                (tmp / name).mkdir()
                (tmp / name / "text.txt").write_text(TEXT)
            for name, source in versions.items():  # exports first, untimed
                print(f"{name}: exporting", file=sys.stderr, flush=True)
                run_version(name, source, tmp / name, argparse.Namespace(**{**vars(args), "repeat": 1, "new_tokens": 4}),
                            tmp / name / "warm.json")
            for r in range(args.rounds):
                order = list(versions) if r % 2 == 0 else list(versions)[::-1]
                for name in order:
                    print(f"round {r + 1}/{args.rounds}: {name}", file=sys.stderr, flush=True)
                    result = run_version(name, versions[name], tmp / name, args, tmp / name / f"r{r}.json")
                    for e in result["speed"]:
                        rows.append({"round": r, "version": name, "precision": e["precision"], "batch": e["batch"],
                                     "decode_tokens_per_s": e["decode_tokens_per_s"], "ttft_ms": e["ttft_ms"]})
                    machine = result["environment"].get("cpu")
            engine = engine_load(versions, tmp, args) if args.engine_load else []
        finally:
            subprocess.run(["git", "worktree", "remove", "--force", str(tree)], cwd=REPO, capture_output=True)
    summary = []
    for precision in args.precisions.split(","):
        med = {v: {k: statistics.median(x[k] for x in rows if x["version"] == v and x["precision"] == precision)
                   for k in ("decode_tokens_per_s", "ttft_ms")} for v in ("before", "after")}
        summary.append({"precision": precision, **{f"{v}_{k}": med[v][k] for v in med for k in med[v]},
                        "decode_ratio": med["after"]["decode_tokens_per_s"] / med["before"]["decode_tokens_per_s"],
                        "ttft_ratio": med["after"]["ttft_ms"] / med["before"]["ttft_ms"]})
    data = {"base": base, "head": head, "machine": machine, "settings": {k: str(v) for k, v in vars(args).items()},
            "rows": rows, "summary": summary, "engine_load": engine}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".json").write_text(json.dumps(data, indent=1) + "\n")
    lines = [f"# gpt2x bench at batch 1, before ({base}) and after ({head}), {args.rounds} alternating rounds", "",
             f"Machine: {machine}. Model {args.model}, ONNX Runtime on the CPU, prompt {args.prompt_len} tokens, "
             f"{args.new_tokens} new tokens, median of {args.repeat} timed runs per bench; medians over the rounds.", "",
             "| precision | decode tok/s before | after | after/before | TTFT ms before | after | after/before |",
             "| --- | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for s in summary:
        lines.append(f"| {s['precision']} | {s['before_decode_tokens_per_s']:.1f} | {s['after_decode_tokens_per_s']:.1f} | "
                     f"{s['decode_ratio']:.3f} | {s['before_ttft_ms']:.1f} | {s['after_ttft_ms']:.1f} | {s['ttft_ratio']:.3f} |")
    if engine:
        lines += engine_table(engine)
    args.out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


def engine_load(versions: dict[str, Path], tmp: Path, args) -> list[dict]:
    """Each version's benchmarks/engine_load.py, once, in turn (before first), its exports in its own
    folder; the rows of its results (output tokens/s by configuration and concurrency, and the median
    decode step at that level)."""
    rows = []
    for name, source in versions.items():
        print(f"engine_load: {name}", file=sys.stderr, flush=True)
        env = {**os.environ, "PYTHONPATH": str(source), "HF_HUB_OFFLINE": "1"}
        out = tmp / name / "engine"
        cmd = [sys.executable, str(source / "benchmarks" / "engine_load.py"), "--model", args.model, "--concurrency",
               args.engine_load, "--exports", str(tmp / name / "exported"), "--out", str(out)]
        r = subprocess.run(cmd, cwd=tmp / name, env=env, capture_output=True, text=True, timeout=3600)
        if r.returncode != 0:
            raise SystemExit(f"{name}: engine_load.py failed ({r.returncode}):\n{r.stderr[-2000:]}")
        for e in json.loads(out.with_suffix(".json").read_text())["results"]:
            decode = [v["median"] for k, v in e["backend_calls_ms"].items() if k.startswith("decode step")]
            rows.append({"version": name, "config": e["config"], "concurrency": e["concurrency"],
                         "output_tokens_per_s": e["output_tokens_per_s"], "decode_step_ms": decode[0] if decode else None,
                         "merge_ms": e["backend_calls_ms"].get("merge", {}).get("median")})
    return rows


def engine_table(rows: list[dict]) -> list[str]:
    lines = ["", "## benchmarks/engine_load.py, each version's own, one run each (before, then after)", "",
             "| cache | concurrency | output tok/s before | after | after/before | decode step ms before | after | merge ms before | after |",
             "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    def cell(v):
        return "" if v is None else f"{v:.1f}"
    for b in (r for r in rows if r["version"] == "before"):
        a = next(r for r in rows if r["version"] == "after" and r["config"] == b["config"] and r["concurrency"] == b["concurrency"])
        lines.append(f"| {b['config']} | {b['concurrency']} | {b['output_tokens_per_s']:.1f} | {a['output_tokens_per_s']:.1f} | "
                     f"{a['output_tokens_per_s'] / b['output_tokens_per_s']:.3f} | {cell(b['decode_step_ms'])} | "
                     f"{cell(a['decode_step_ms'])} | {cell(b['merge_ms'])} | {cell(a['merge_ms'])} |")
    return lines


if __name__ == "__main__":
    main()
