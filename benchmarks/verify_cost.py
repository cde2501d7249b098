"""What speculative decoding can gain here: the cost of one target step over N = 1..8 new tokens on
top of a KV cache, at each precision (issue 19: "measure before choosing").

    python benchmarks/verify_cost.py --out benchmarks/results/verify-cost-cpu-2core

GPT-2 124M (random weights), batch 1, the ONNX Runtime backend as `gpt2x generate` opens it (int8 and
int4 on the in-place KV cache), a cache of --past positions. For each N: --repeat runs, N interleaved
within each round, each from a fresh copy of the same cache (the copy is not timed), medians. A
step over N tokens is what verifying N drafted tokens costs; it pays when N tokens cost less than N
single steps, by as much as the draft's acceptance allows. Also reported: the ratio to N = 1, which
is the break-even: the mean tokens a verification must yield to beat plain decoding, before the
draft's own cost.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np

from gpt2x.bench.report import save_results
from gpt2x.bench.system import system_info
from gpt2x.choices import BackendKind, Precision
from gpt2x.numerics import positions
from gpt2x.onnx.artifact import default_export_dir
from gpt2x.workflows import ensure_export, export_backend


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="random:gpt2")
    ap.add_argument("--precisions", default="fp32,int8,int4")
    ap.add_argument("--past", default="32,256", help="cache lengths (positions already in the cache)")
    ap.add_argument("--max-n", type=int, default=8)
    ap.add_argument("--repeat", type=int, default=15)
    ap.add_argument("--exports", type=Path, default=Path("exported"))
    ap.add_argument("--out", type=Path, required=True, help="output path without extension (.json, .md)")
    args = ap.parse_args()
    rng = np.random.default_rng(0)
    cases = []
    for name in args.precisions.split(","):
        precision = Precision(name)
        info = ensure_export(args.model, precision, folder=default_export_dir(args.model, precision, args.exports),
                             progress=log, notice=log)
        backend = export_backend(BackendKind.ort, info)
        for past_len in (int(p) for p in args.past.split(",")):
            ids = rng.integers(0, info.config.vocab_size, (1, past_len + args.max_n), dtype=np.int64)
            mask = np.ones_like(ids)
            _, cache = backend.run(ids[:, :past_len], mask[:, :past_len], positions(mask[:, :past_len], past_len), None)
            arrays = cache.to_numpy()
            times: dict[int, list[float]] = {n: [] for n in range(1, args.max_n + 1)}
            log(f"{name}, past {past_len}")
            for r in range(args.repeat + 1):
                order = list(times) if r % 2 else list(times)[::-1]
                for n in order:
                    past = backend.past_from_numpy(arrays)
                    m = mask[:, : past_len + n]
                    t0 = time.perf_counter()
                    backend.step(ids[:, past_len : past_len + n], m, positions(m, n), past)
                    if r:  # round 0 warms up
                        times[n].append((time.perf_counter() - t0) * 1e3)
            med = {n: statistics.median(v) for n, v in times.items()}
            cases.append({"precision": name, "past": past_len, "in_place_kv": bool(backend.in_place_kv), "median_ms": med,
                          "ratio_to_n1": {n: med[n] / med[1] for n in med},
                          "runs_ms": times})
    lines = [f"One target step over N new tokens, batch 1, {args.model}, median of {args.repeat} (ms; in brackets: x the N = 1 step).", "",
             "| precision | past | " + " | ".join(f"N={n}" for n in range(1, args.max_n + 1)) + " |",
             "| --- | ---: | " + " | ".join("---:" for _ in range(args.max_n)) + " |"]
    for c in cases:
        lines.append(f"| {c['precision']} | {c['past']} | " + " | ".join(
            f"{c['median_ms'][n]:.1f} ({c['ratio_to_n1'][n]:.2f}x)" for n in range(1, args.max_n + 1)) + " |")
    lines += ["", "A verification of N drafted tokens costs the N-token step; it yields between 1 and N + 1 tokens. "
              "Speculation beats plain decoding when the mean tokens per verification exceed the ratio in brackets "
              "(plus the draft's own cost)."]
    out = {"machine": system_info(), "command": " ".join(["python", *sys.argv]), "cases": cases}
    text = "\n".join(lines) + "\n"
    save_results(args.out, out, text)
    print(text)


if __name__ == "__main__":
    main()
