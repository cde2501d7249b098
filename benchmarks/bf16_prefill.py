"""A bf16 export's first token on the openvino backend: its own graph (model.onnx at INFERENCE_PRECISION_HINT bf16)
against the export's OpenVINO prefill graph (onnx/openvino_prefill.py, f32 weights) at bf16 compute, its presents
widened into the backend's KV buffers (OpenVinoBackend's prefill_graph False and True).

    python benchmarks/bf16_prefill.py --export /tmp/g124-bf16 --out benchmarks/results/bf16-prefill-cpu-2core

--export: a bf16 export of random:gpt2 with its prefill graph (`gpt2x export -m random:gpt2 --precision bf16 --out
DIR`). Each prompt length (--lengths) is a batch-1 prompt of random ids, the first token its step's argmax; each way
runs it once first (`first_ms`: OpenVINO lays out its weights at a graph's first inference, and compiles the prefill
graph at its first use, or imports it from its cache), then --repeat times, the two ways interleaved, the best of each
counting: the machine is shared, and the best is the run least disturbed. A step is timed as the backend takes one,
its KV buffers allocated included. Writes OUT.json and OUT.md.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path

import numpy as np


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--export", type=Path, required=True)
    parser.add_argument("--lengths", default="32,512")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--machine", default="2-core AMD EPYC VM (AVX-512 BF16), shared with other work at the time")
    args = parser.parse_args()

    from gpt2x.numerics import positions
    from gpt2x.onnx.artifact import read_export
    from gpt2x.runtime.openvino import OpenVinoBackend

    info = read_export(args.export)
    assert info.precision.value == "bf16" and info.prefill is not None, f"{args.export}: no bf16 export with a prefill graph"
    lengths = [int(n) for n in args.lengths.split(",")]
    rng = np.random.default_rng(0)
    rows = []
    with OpenVinoBackend(info, threads=args.threads, prefill_graph=False) as plain, \
            OpenVinoBackend(info, threads=args.threads, prefill_graph=True) as fast:
        ways = {"model_onnx": plain, "prefill_graph": fast}
        for T in lengths:
            ids = rng.integers(0, info.config.vocab_size, (1, T), dtype=np.int64)
            mask = np.ones_like(ids)
            pos = positions(mask, T)
            times: dict[str, list[float]] = {name: [] for name in ways}
            first, tokens = {}, {}
            for name, backend in ways.items():
                start = time.perf_counter()
                tokens[name] = int(backend.step(ids, mask, pos, None)[0].argmax())
                first[name] = round((time.perf_counter() - start) * 1e3, 2)
            for _ in range(args.repeat):
                for name, backend in ways.items():
                    start = time.perf_counter()
                    backend.step(ids, mask, pos, None)[0].argmax()
                    times[name].append((time.perf_counter() - start) * 1e3)
            row = {"tokens": T, **{f"{n}_ms": [round(t, 2) for t in ts] for n, ts in times.items()},
                   **{f"{n}_best_ms": round(min(ts), 2) for n, ts in times.items()},
                   **{f"{n}_first_ms": first[n] for n in ways},
                   "same_first_token": tokens["model_onnx"] == tokens["prefill_graph"],
                   "prefill_steps": fast.prefill_steps, "load_average": [round(x, 2) for x in os.getloadavg()]}
            log(json.dumps(row))
            rows.append(row)
        threads = fast.threads
    import openvino as ov

    result = {"model": info.meta["model"]["name"], "export": str(args.export), "threads": threads,
              "repeat": args.repeat, "openvino": ov.__version__, "machine": platform.processor() or platform.machine(),
              "cpus": os.cpu_count(), "machine_note": args.machine, "rows": rows}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".json").write_text(json.dumps(result, indent=1) + "\n")
    lines = [f"# bf16 first token, {result['model']}: model.onnx against the prefill graph on the openvino backend",
             "", f"OpenVINO {ov.__version__}, {threads} threads, time to first token of a batch-1 prompt, best of {args.repeat} "
             f"after a first run (its time in brackets); {args.machine}.", "",
             "| prompt tokens | model.onnx (ms) | prefill graph (ms) | speed-up | same first token | load average |",
             "|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['tokens']} | {r['model_onnx_best_ms']} ({r['model_onnx_first_ms']}) | "
                     f"{r['prefill_graph_best_ms']} ({r['prefill_graph_first_ms']}) | "
                     f"{r['model_onnx_best_ms'] / r['prefill_graph_best_ms']:.2f}x | {r['same_first_token']} | "
                     f"{r['load_average'][0]} |")
    args.out.with_suffix(".md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
