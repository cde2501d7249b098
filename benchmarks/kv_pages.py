"""The in-place KV cache's buffers in memory with transparent huge pages (np.empty, the kernel's
default here) against small pages only (runtime.kvbuffers.small_page_arrays, MADV_NOHUGEPAGE): what a fresh
buffer costs when first written, and whether a decode step reading it slows down.

    python benchmarks/kv_pages.py --out benchmarks/results/kv-pages-cpu-2core

GPT-2 124M (random weights), int8 export, ONNX Runtime's in-place cache on the CPU. For each
allocator, in interleaved rounds:
- a serving merge that needs larger buffers: 16 rows prefilled (15 tokens) and stepped 3 times, 4
  rows joining (12 tokens): the merge into buffers of twice the rows (kvbuffers.merge_rows), timed;
- the first decode step of 16 rows after their prefill (it moves the cache into buffers with room);
- decode steps at batch 16 and at batch 1 on a grown cache (the median of 32 steps).
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
from gpt2x.runtime import ort as ort_runtime
from gpt2x.runtime.kvbuffers import small_page_arrays
from gpt2x.workflows import ensure_export, export_backend

ALLOCATORS = {
    "huge pages allowed (np.empty)": lambda shape, count, dtype: [np.empty(shape, dtype=dtype) for _ in range(count)],
    "small pages only (MADV_NOHUGEPAGE)": small_page_arrays,
}


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def one_round(backend, rng) -> dict[str, float]:
    ids = rng.integers(0, backend.vocab_size, (16, 15))
    mask = np.ones_like(ids)
    _, past = backend.step(ids, mask, positions(mask, 15), None)
    mask = np.concatenate([mask, np.ones((16, 1), np.int64)], 1)
    t = time.perf_counter()
    _, past = backend.step(ids[:, :1], mask, positions(mask, 1), past)
    first_step = time.perf_counter() - t
    for _ in range(2):
        mask = np.concatenate([mask, np.ones((16, 1), np.int64)], 1)
        _, past = backend.step(ids[:, :1], mask, positions(mask, 1), past)
    jids = rng.integers(0, backend.vocab_size, (4, 12))
    jmask = np.ones_like(jids)
    _, jpast = backend.step(jids, jmask, positions(jmask, 12), None)
    t = time.perf_counter()
    past.merge(np.arange(20), jpast, mask.shape[1])
    merge = time.perf_counter() - t
    out = {"merge_ms": merge * 1e3, "first_step_16_ms": first_step * 1e3}
    for batch in (16, 1):
        ids = rng.integers(0, backend.vocab_size, (batch, 15))
        mask = np.ones_like(ids)
        _, past = backend.step(ids, mask, positions(mask, 15), None)
        times = []
        for _ in range(40):
            mask = np.concatenate([mask, np.ones((batch, 1), np.int64)], 1)
            t = time.perf_counter()
            _, past = backend.step(ids[:, :1], mask, positions(mask, 1), past)
            times.append(time.perf_counter() - t)
        out[f"step_{batch}_ms"] = statistics.median(times[8:]) * 1e3  # after the growth
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="random:gpt2")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--exports", type=Path, default=Path("exported"))
    ap.add_argument("--out", type=Path, required=True, help="output path without extension (.json, .md)")
    args = ap.parse_args()
    info = ensure_export(args.model, Precision.int8, folder=default_export_dir(args.model, Precision.int8, args.exports),
                         progress=log, notice=log)
    backend = export_backend(BackendKind.ort, info, in_place_kv=True)
    rng = np.random.default_rng(0)
    runs: dict[str, list[dict]] = {name: [] for name in ALLOCATORS}
    real = ort_runtime.unset_arrays
    try:
        for r in range(args.rounds + 1):
            for name in (list(ALLOCATORS) if r % 2 else list(ALLOCATORS)[::-1]):
                ort_runtime.unset_arrays = ALLOCATORS[name]
                result = one_round(backend, rng)
                if r:  # round 0 warms up
                    runs[name].append(result)
                log(f"round {r}: {name}: {result}")
    finally:
        ort_runtime.unset_arrays = real
    keys = list(next(iter(runs.values()))[0])
    medians = {name: {k: statistics.median(x[k] for x in rs) for k in keys} for name, rs in runs.items()}
    lines = [f"In-place KV buffers, {args.model} int8 on ONNX Runtime (CPU), median of {args.rounds} interleaved rounds.", "",
             "| allocator | merge into larger buffers, ms | first decode step of 16 rows, ms | decode step batch 16, ms | batch 1, ms |",
             "| --- | ---: | ---: | ---: | ---: |"]
    for name, m in medians.items():
        lines.append(f"| {name} | {m['merge_ms']:.1f} | {m['first_step_16_ms']:.1f} | {m['step_16_ms']:.2f} | {m['step_1_ms']:.2f} |")
    text = "\n".join(lines) + "\n"
    save_results(args.out, {"machine": system_info(), "command": " ".join(["python", *sys.argv]), "runs": runs,
                            "medians": medians}, text)
    print(text)


if __name__ == "__main__":
    main()
