"""Decode speed beside the memory bandwidth measured right before and after it, many times over.

    python benchmarks/bandwidth_track.py --rounds 8 --out benchmarks/results/bandwidth-track-cpu-2core.json

On a shared VM the read bandwidth moves in steps (on this project's 2-core machine between about
35 and 67 GB/s, sometimes within a minute), so one bandwidth sample per benchmark run does not say
how close a decode rate is to its roofline. This script pairs each decode measurement (batch 1,
32-token prompt, 64 greedy tokens, gpt2x on ONNX Runtime CPU) with a bandwidth sample just before
and just after it, for each export given (default: GPT-2 124M architecture, random weights, fp32 and
int8, exported if missing), and reports decode tok/s as a share of the roofline computed from the
lower of the two samples (bytes per step from gpt2x.bench.roofline_tokens_per_s).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import numpy as np

from gpt2x import bench
from gpt2x.choices import Precision
from gpt2x.export import default_export_dir, export, read_export
from gpt2x.runtime import OrtBackend, physical_cores
from gpt2x.system import system_info
from gpt2x.weights import load_model

PROMPT_LEN, NEW_TOKENS = 32, 64


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="random:gpt2")
    ap.add_argument("--precisions", default="fp32,int8")
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    threads = physical_cores()
    model, source = load_model(args.model)
    cfg = model.config
    prompt = np.random.default_rng(0).integers(0, cfg.vocab_size, (1, PROMPT_LEN), dtype=np.int64)
    results = {"environment": system_info(), "settings": vars(args) | {"out": str(args.out), "threads": threads,
                                                                       "prompt_len": PROMPT_LEN, "new_tokens": NEW_TOKENS},
               "precisions": {}}
    for name in args.precisions.split(","):
        precision = Precision(name)
        folder = default_export_dir(args.model, precision)
        if not (folder / "gpt2x.json").exists():
            log(f"exporting {args.model} ({precision.value}) to {folder}")
            export(model, source, folder, precision, progress=log)
        backend = OrtBackend(read_export(folder), threads=threads)
        bench.timed_generation(backend, prompt, 8, lambda: None)  # warm-up
        rows = []
        for r in range(args.rounds):
            before = bench.cpu_read_bandwidth(threads, megabytes=512, repeats=3)
            run = bench.timed_generation(backend, prompt, NEW_TOKENS, lambda: None)
            after = bench.cpu_read_bandwidth(threads, megabytes=512, repeats=3)
            decode = len(run["steps_s"]) / sum(run["steps_s"])
            roof = bench.roofline_tokens_per_s(min(before, after), cfg, precision, 1, PROMPT_LEN + NEW_TOKENS // 2)
            rows.append({"bandwidth_before": before, "bandwidth_after": after, "decode_tokens_per_s": decode,
                         "roofline_tokens_per_s": roof, "roofline_share": decode / roof})
            log(f"{precision.value} round {r + 1}: {before / 1e9:.1f} / {after / 1e9:.1f} GB/s, "
                f"decode {decode:.1f} tok/s, {decode / roof:.0%} of roofline")
        results["precisions"][precision.value] = {
            "rounds": rows,
            "median_roofline_share": statistics.median(r["roofline_share"] for r in rows),
            "median_decode_tokens_per_s": statistics.median(r["decode_tokens_per_s"] for r in rows),
        }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=1) + "\n")
    for name, p in results["precisions"].items():
        print(f"{name}: median decode {p['median_decode_tokens_per_s']:.1f} tok/s, "
              f"median {p['median_roofline_share']:.0%} of the roofline at the bandwidth measured around it")
    return 0


if __name__ == "__main__":
    sys.exit(main())
