"""One decode step's sampling for rows with samplers of their own (the serving engine's: a Sampler
per request), before and after issue 30 item 4, in one run on the same logits.

    python benchmarks/sample_rows.py --out benchmarks/results/sample-rows-cpu-2core

- per-row loop (before): each row's Sampler called on its own (1, V) row, what sample_rows did for
  rows with samplers of their own: processors, softmax, cumsum and draw, once per row;
- grouped (after): gpt2x.generation.sampling.sample_many, what sample_rows now calls for those rows:
  one (B, V) NumPy pass per group of rows whose processor lists are of one shape, each row drawing
  from its own generator;
- sample_rows: the whole call as the decode loop makes it (grouped sampling, then accepting the tokens).
Every row its own seed; random float32 logits (B, 50257), a new array each step. Two settings: temperature
1 with top_p 0.9, and greedy. The loop and the grouped path are checked to give the same tokens.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path

import numpy as np

from gpt2x.bench.report import save_results
from gpt2x.bench.system import system_info
from gpt2x.generation.decode import Sequence, sample_rows
from gpt2x.generation.sampling import sample_many
from gpt2x.generation.settings import SamplingSettings

V = 50257
SETTINGS = {"top_p 0.9": SamplingSettings(top_p=0.9), "greedy": SamplingSettings(greedy=True)}


def _ms(fn, logits: list[np.ndarray], warmup: int) -> dict:
    """fn(logits) timed once per array after `warmup` untimed calls: mean and median ms."""
    for x in logits[:warmup]:
        fn(x)
    times = []
    for x in logits[warmup:]:
        t = time.perf_counter()
        fn(x)
        times.append((time.perf_counter() - t) * 1e3)
    return {"mean": statistics.fmean(times), "median": statistics.median(times), "n": len(times)}


def run(name: str, batch: int, steps: int, warmup: int) -> dict:
    """The three timings of one setting at one batch size, on the same logits."""
    base = SETTINGS[name]
    rng = np.random.default_rng(batch)
    logits = [(rng.standard_normal((batch, V)) * 3).astype(np.float32) for _ in range(warmup + steps)]

    def settings(i: int) -> SamplingSettings:
        return replace(base, seed=i, ignore_eos=True, max_new_tokens=10 * (warmup + steps))

    loop_rows = [Sequence([464, 3290], settings(i)) for i in range(batch)]
    group_rows = [Sequence([464, 3290], settings(i)) for i in range(batch)]
    whole_rows = [Sequence([464, 3290], settings(i)) for i in range(batch)]
    loop_tokens, group_tokens = [], []

    def loop(x: np.ndarray) -> None:
        loop_tokens.append([int(s.sampler(x[i : i + 1], [s.history])[0]) for i, s in enumerate(loop_rows)])

    def grouped(x: np.ndarray) -> None:
        group_tokens.append(sample_many([s.sampler for s in group_rows], x, [s.history for s in group_rows]).tolist())

    out = {"setting": name, "batch": batch,
           "per_row_loop": _ms(loop, logits, warmup), "grouped": _ms(grouped, logits, warmup),
           "sample_rows": _ms(lambda x: sample_rows(whole_rows, x), logits, warmup)}
    if loop_tokens != group_tokens or [s.tokens for s in whole_rows] != [list(t) for t in zip(*group_tokens)]:
        raise SystemExit(f"{name} batch {batch}: the grouped tokens differ from the per-row loop's")
    out["speedup"] = out["per_row_loop"]["mean"] / out["grouped"]["mean"]
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batches", default="1,4,16")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--out", type=Path, default=None, help="results path without extension")
    args = ap.parse_args()
    results = [run(name, int(b), args.steps, args.warmup) for name in SETTINGS for b in args.batches.split(",")]
    lines = [f"One decode step's sampling for rows with samplers of their own, random logits (B, {V}) float32, "
             f"{args.steps} timed steps after {args.warmup}. Mean ms (median in brackets). Before: a loop of "
             "per-row Sampler calls; after: sample_many (grouped); sample_rows: the whole call (after).", "",
             "| setting | batch | per-row loop (before) | grouped (after) | speedup | sample_rows (after) |",
             "| --- | ---: | ---: | ---: | ---: | ---: |"]
    for r in results:
        cells = " | ".join(f"{r[k]['mean']:.3f} ({r[k]['median']:.3f})" for k in ("per_row_loop", "grouped"))
        whole = f"{r['sample_rows']['mean']:.3f} ({r['sample_rows']['median']:.3f})"
        lines.append(f"| {r['setting']} | {r['batch']} | {cells} | {r['speedup']:.2f}x | {whole} |")
    text = "\n".join(lines) + "\n"
    if args.out is not None:
        save_results(args.out, {"machine": system_info(), "command": " ".join(["python", *sys.argv]),
                                "vocab": V, "steps": args.steps, "warmup": args.warmup, "results": results}, text)
    print(text)


if __name__ == "__main__":
    main()
