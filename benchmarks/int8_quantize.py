"""The int8 export's per-channel quantization (its batched decode graph, onnx/optimize.quantize_int8_dynamic): ONNX
Runtime's quantize_dynamic with its own loop over the channels, against the same call with every channel at once
(onnx/per_channel.py), on the same fused graph, in the same run.

    python benchmarks/int8_quantize.py --out benchmarks/results/int8-quantize-cpu-2core

--model (random:gpt2: GPT-2 124M's shapes, random weights) is traced and fused once; then --repeat rounds, the two
ways interleaved, each timing one quantize_int8_dynamic call whole (the quantizer's load, shape inference and save
included). Both files are compared byte for byte. Writes OUT.json and OUT.md.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
import tempfile
import time
from pathlib import Path

from gpt2x.bench.report import save_results
from gpt2x.bench.system import system_info
from gpt2x.choices import Precision
from gpt2x.onnx import per_channel
from gpt2x.onnx.optimize import fuse, quantize_int8_dynamic
from gpt2x.onnx.trace import trace_to_onnx
from gpt2x.workflows.models import load_model

WAYS = ("ORT's loop over the channels", "every channel at once")


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="random:gpt2")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--machine", default="2-core AMD EPYC VM (AVX2 only), nothing else running")
    args = parser.parse_args()

    model, _ = load_model(args.model)
    at_once = per_channel.per_channel_at_once
    times: dict[str, list[float]] = {way: [] for way in WAYS}
    with tempfile.TemporaryDirectory() as tmp:
        fused = Path(tmp) / "fused.onnx"
        log(f"tracing and fusing {args.model}")
        fuse(trace_to_onnx(model.float().eval(), 17), fused, model.config, Precision.int8)
        files = {}
        for r in range(args.repeat):
            for way in WAYS:
                # quantize_int8_dynamic takes per_channel_at_once from its module when it runs: ORT's loop is the call without it
                per_channel.per_channel_at_once = at_once if way == WAYS[1] else contextlib.nullcontext
                out = Path(tmp) / f"{WAYS.index(way)}.onnx"
                t = time.perf_counter()
                quantize_int8_dynamic(fused, out)
                times[way].append(time.perf_counter() - t)
                files[way] = out.read_bytes()
                log(f"round {r + 1}: {way}: {times[way][-1]:.2f} s")
        per_channel.per_channel_at_once = at_once
    same = files[WAYS[0]] == files[WAYS[1]]
    medians = {way: statistics.median(t) for way, t in times.items()}
    data = {"machine": args.machine, "system": system_info(), "model": args.model, "repeat": args.repeat,
            "seconds": times, "median_s": medians, "same_file": same,
            "command": f"python benchmarks/int8_quantize.py --model {args.model} --repeat {args.repeat} --out {args.out}"}
    packages = data["system"].get("packages", {})
    ort_version = next((v for k, v in packages.items() if k.startswith("onnxruntime")), "?")
    rows = "\n".join(f"| {way} | {medians[way]:.2f} | {', '.join(f'{t:.2f}' for t in times[way])} |" for way in WAYS)
    markdown = (f"# The int8 export's per-channel quantization: {args.model}\n\n{args.machine}, commit "
                f"{data['system'].get('git')}, ONNX Runtime {ort_version}. `{data['command']}`\n\n"
                f"| quantize_int8_dynamic | median s | each round, s |\n|---|---:|---|\n{rows}\n\n"
                f"{medians[WAYS[0]] / medians[WAYS[1]]:.1f}x sooner; the two files are "
                f"{'the same, byte for byte' if same else 'DIFFERENT'}.\n")
    save_results(args.out, data, markdown)
    print(markdown)


if __name__ == "__main__":
    main()
