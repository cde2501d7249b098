"""Where a prefill's time goes on ONNX Runtime, and what computing the logits of the last position
only (the graph's logits_to_keep input, which `step` sets to 1) saves: GPT-2 124M (random weights),
batch 1, prompts of --prompt-lens tokens, at each precision.

    python benchmarks/profile_prefill.py --out benchmarks/results/profile-prefill-cpu-2core.json

For each precision and prompt length, on one session: --repeat interleaved pairs of prefills, one
with every position's logits (run, logits_to_keep = 0, what gpt2x did before) and one with the last
position's only (step, logits_to_keep = 1), the medians, and checks that the last position's logits
are the same either way (and the greedy token). Then ONNX Runtime's profiler over --profile-runs
prefills of the last-position kind, per operator type (MatMulNBits at M = prompt length, the
attention, ...), and the share of the prefill that is the unembedding (the MatMul or MatMulNBits that
produces the logits), with and without logits_to_keep.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path

import numpy as np
import onnxruntime as ort

from gpt2x.bench.system import system_info
from gpt2x.choices import Precision
from gpt2x.numerics import positions
from gpt2x.runtime.ort import OrtBackend
from gpt2x.runtime.providers import physical_cores, session_options
from gpt2x.workflows import ensure_export


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def prefill(backend: OrtBackend, ids: np.ndarray, last_only: bool) -> tuple[float, np.ndarray]:
    mask = np.ones_like(ids)
    t0 = time.perf_counter()
    if last_only:
        logits, _ = backend.step(ids, mask, positions(mask, ids.shape[1]), None)
    else:
        logits = backend.run(ids, mask, positions(mask, ids.shape[1]), None)[0][:, -1]
    return time.perf_counter() - t0, logits


def unembedding_nodes(info) -> set[str]:
    import onnx

    from gpt2x.onnx.optimize import logits_producer

    return {logits_producer(onnx.load(str(info.model_path), load_external_data=False)).name}


def profile_ops(info, ids: np.ndarray, runs: int, threads: int, folder: Path, last_only: bool) -> dict:
    backend = OrtBackend(info, threads=threads)
    so = session_options(threads)
    so.enable_profiling = True
    so.profile_file_prefix = str(folder / f"prefill-{info.precision.value}-{ids.shape[1]}-{int(last_only)}")
    backend.session = ort.InferenceSession(str(info.model_path), sess_options=so, providers=["CPUExecutionProvider"])
    prefill(backend, ids, last_only)  # warm-up, left out below
    backend.session.end_profiling()
    backend.session = ort.InferenceSession(str(info.model_path), sess_options=so, providers=["CPUExecutionProvider"])
    prefill(backend, ids, last_only)
    for _ in range(runs):
        prefill(backend, ids, last_only)
    events = json.loads(Path(backend.session.end_profiling()).read_text())
    model_runs = sorted((e for e in events if e.get("name") == "model_run"), key=lambda e: e["ts"])[1:]
    start = model_runs[0]["ts"]
    head = unembedding_nodes(info)
    per_op: dict[str, float] = defaultdict(float)
    head_us = 0.0
    for e in events:
        if e.get("cat") == "Node" and e["name"].endswith("_kernel_time") and e["ts"] >= start:
            per_op[e["args"]["op_name"]] += e["dur"]
            if e["name"][: -len("_kernel_time")] in head:
                head_us += e["dur"]
    total = sum(per_op.values())
    n = len(model_runs)
    return {"runs": n, "run_ms": sum(r["dur"] for r in model_runs) / n / 1e3, "kernel_ms": total / n / 1e3,
            "unembedding_ms": head_us / n / 1e3, "unembedding_share": head_us / total,
            "ops": {op: {"ms": us / n / 1e3, "share": us / total} for op, us in sorted(per_op.items(), key=lambda kv: -kv[1])}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="random:gpt2")
    ap.add_argument("--precisions", default="fp32,int8,int4")
    ap.add_argument("--prompt-lens", default="32,512")
    ap.add_argument("--repeat", type=int, default=15, help="interleaved pairs (all logits / last only) per case")
    ap.add_argument("--profile-runs", type=int, default=5)
    ap.add_argument("--exports", type=Path, default=Path("exported"))
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    threads = physical_cores()
    lens = [int(x) for x in args.prompt_lens.split(",")]
    result = {"machine": system_info(), "model": args.model, "batch": 1, "threads": threads,
              "command": " ".join(["python", *sys.argv]), "cases": []}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    scratch = args.out.parent / ".profiles"
    scratch.mkdir(exist_ok=True)
    from gpt2x.onnx.artifact import default_export_dir

    for name in args.precisions.split(","):
        precision = Precision(name)
        info = ensure_export(args.model, precision, folder=default_export_dir(args.model, precision, args.exports),
                             progress=log, notice=log)
        backend = OrtBackend(info, threads=threads)
        if backend.logits_to_keep is None:
            raise SystemExit(f"{info.folder} predates logits_to_keep: export it again")
        for n in lens:
            ids = np.random.default_rng(n).integers(0, info.config.vocab_size, (1, n), dtype=np.int64)
            log(f"{name}, prompt {n}: timing")
            prefill(backend, ids, True)
            prefill(backend, ids, False)
            times: dict[str, list[float]] = {"all_logits": [], "last_only": []}
            for r in range(args.repeat):
                for last_only in ((True, False) if r % 2 else (False, True)):
                    t, _ = prefill(backend, ids, last_only)
                    times["last_only" if last_only else "all_logits"].append(t)
            _, full = prefill(backend, ids, False)
            _, last = prefill(backend, ids, True)
            log(f"{name}, prompt {n}: profiling")
            case = {
                "precision": name, "prompt": n,
                "all_logits_ms": statistics.median(times["all_logits"]) * 1e3,
                "last_only_ms": statistics.median(times["last_only"]) * 1e3,
                "runs_ms": {k: [t * 1e3 for t in v] for k, v in times.items()},
                "max_abs_diff_last_logits": float(np.abs(full - last).max()),
                "same_greedy_token": bool((full.argmax(-1) == last.argmax(-1)).all()),
                "profile_last_only": profile_ops(info, ids, args.profile_runs, threads, scratch, True),
                "profile_all_logits": profile_ops(info, ids, args.profile_runs, threads, scratch, False),
            }
            case["speedup"] = case["all_logits_ms"] / case["last_only_ms"]
            result["cases"].append(case)
            p = case["profile_last_only"]
            top = ", ".join(f"{op} {v['ms']:.1f} ms ({v['share']:.0%})" for op, v in list(p["ops"].items())[:4])
            log(f"  all logits {case['all_logits_ms']:.1f} ms, last only {case['last_only_ms']:.1f} ms "
                f"({case['speedup']:.2f}x); {top}")
    for f in scratch.iterdir():
        f.unlink()
    scratch.rmdir()
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print("| precision | prompt | prefill, every position's logits (ms) | prefill, last position's (ms) | speed-up | "
          "unembedding share before / after | top operators (last only) |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | --- |")
    for c in result["cases"]:
        top = ", ".join(f"{op} {v['share']:.0%}" for op, v in list(c["profile_last_only"]["ops"].items())[:4])
        print(f"| {c['precision']} | {c['prompt']} | {c['all_logits_ms']:.1f} | {c['last_only_ms']:.1f} | {c['speedup']:.2f}x | "
              f"{c['profile_all_logits']['unembedding_share']:.0%} / {c['profile_last_only']['unembedding_share']:.0%} | {top} |")


if __name__ == "__main__":
    main()
