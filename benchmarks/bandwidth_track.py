"""Decode speed beside the memory bandwidth measured right before and after it, many times over.

    python benchmarks/bandwidth_track.py --rounds 8 --out benchmarks/results/bandwidth-track-cpu-2core.json

On a shared VM the read bandwidth moves in steps (on this project's 2-core machine between about
35 and 67 GB/s, sometimes within a minute), so one bandwidth sample per benchmark run does not say
how close a decode rate is to its roofline. This script pairs each decode measurement (batch 1,
32-token prompt, 64 greedy tokens, gpt2x on ONNX Runtime CPU) with a bandwidth sample just before
and just after it, for each export given (default: GPT-2 124M architecture, random weights, fp32 and
int8, exported if missing), and reports decode tok/s as a share of the roofline computed from the
lower of the two samples (bytes per step from gpt2x.bench.roofline.roofline_tokens_per_s).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import numpy as np

from gpt2x import workflows
from gpt2x.bench.roofline import cpu_read_bandwidth, roofline_tokens_per_s
from gpt2x.bench.run import timed_generation
from gpt2x.bench.system import system_info
from gpt2x.choices import BackendKind, Precision, ProviderKind
from gpt2x.runtime.providers import physical_cores

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
    model, source = workflows.load_model(args.model)
    cfg = model.config
    prompt = np.random.default_rng(0).integers(0, cfg.vocab_size, (1, PROMPT_LEN), dtype=np.int64)
    results = {"environment": system_info(), "settings": vars(args) | {"out": str(args.out), "threads": threads,
                                                                       "prompt_len": PROMPT_LEN, "new_tokens": NEW_TOKENS},
               "precisions": {}}
    for name in args.precisions.split(","):
        precision = Precision(name)
        # The export in exported/<model>-<precision>, made (parity-gated) first when missing.
        backend = workflows.open_backend(BackendKind.ort, ProviderKind.cpu, args.model, precision=precision,
                                         threads=threads, loaded=(model, source), progress=log, notice=log)
        timed_generation(backend, prompt, 8)  # warm-up
        rows = []
        for r in range(args.rounds):
            before = cpu_read_bandwidth(threads, megabytes=512, repeats=3)
            run = timed_generation(backend, prompt, NEW_TOKENS)
            after = cpu_read_bandwidth(threads, megabytes=512, repeats=3)
            decode = len(run["steps_s"]) / sum(run["steps_s"])
            roof = roofline_tokens_per_s(min(before, after), cfg, precision, 1, PROMPT_LEN + NEW_TOKENS // 2)
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
