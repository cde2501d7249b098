"""Where a decode step's time goes on CUDA: StaticDecoder's greedy step (fp16, fixed-capacity cache) with and without
its CUDA graph, its wall time beside the GPU kernels it ran, kernel by kernel:

    python benchmarks/cuda_profile.py --out RESULTS/cuda-profile [--model random:gpt2] [--rows 1] [--steps 300]
        [--variants default,ORT_DISABLE_FLASH_ATTENTION=1] [--provider cuda]

The kernels come from torch.profiler's CUDA trace (CUPTI, which records every kernel of the process, ONNX Runtime's
included, and those a CUDA graph replays). Each variant (environment settings read by ONNX Runtime, `default` for
none) runs in a process of its own and times both decoders' steps (mean and median µs over --steps steps after a
warm-up, on the public `step()`: the seqlens write, the run and the token's copy back); the first variant's process
also profiles 50 steps of each. `--provider cpu` rehearses it on an fp32 export (no graph, no kernels: CPU figures).
Writes OUT.json (every figure, the environment) and OUT.md.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from gpt2x.bench.system import system_info
from gpt2x.choices import Precision, ProviderKind
from gpt2x.onnx.artifact import default_export_dir
from gpt2x.runtime.static_decode import StaticDecoder
from gpt2x.workflows.exports import ensure_export

PROFILED_STEPS = 50
PROMPT = 32


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def kernels(decoder: StaticDecoder, steps: int) -> dict:
    """The GPU kernels and copies of `steps` steps, by name: launches and device µs per step, and their sum."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            decoder.step()
    by_name = []
    for e in prof.key_averages():
        device_us = getattr(e, "self_device_time_total", None)
        if device_us is None:  # torch before 2.4 called it cuda time
            device_us = e.self_cuda_time_total
        if device_us > 0:
            by_name.append({"name": e.key, "per_step": e.count / steps, "us_per_step": device_us / steps})
    by_name.sort(key=lambda k: -k["us_per_step"])
    return {"torch": torch.__version__, "steps": steps, "kernels": by_name,
            "launches_per_step": sum(k["per_step"] for k in by_name),
            "device_us_per_step": sum(k["us_per_step"] for k in by_name)}


def child(a: argparse.Namespace) -> dict:
    """One variant, in this process: both decoders timed, and profiled when asked."""
    precision = Precision.fp16 if a.provider is ProviderKind.cuda else Precision.fp32
    info = ensure_export(a.model, precision, folder=default_export_dir(a.model, precision, a.exports))
    prompt = np.random.default_rng(0).integers(0, info.config.vocab_size, (a.rows, PROMPT), dtype=np.int64)
    out = {"precision": precision.value, "decoders": []}
    for graph in (False, True) if a.provider is ProviderKind.cuda else (False,):
        decoder = StaticDecoder(info, a.provider, rows=a.rows, capacity=PROMPT + a.steps + 1, cuda_graph=graph)
        decoder.prefill(prompt)
        for _ in range(20):
            decoder.step()
        decoder.prefill(prompt)
        times = []
        for _ in range(a.steps):
            t0 = time.perf_counter()
            decoder.step()
            times.append(time.perf_counter() - t0)
        row = {"cuda_graph": graph, "ran_on": decoder.providers[0], "mean_us": 1e6 * statistics.fmean(times),
               "median_us": 1e6 * statistics.median(times), "tok_s": a.rows / statistics.median(times)}
        if a.profile and a.provider is ProviderKind.cuda:
            decoder.prefill(prompt)
            try:
                row["profile"] = kernels(decoder, PROFILED_STEPS)
            except Exception as e:  # the timings stand without it; say why it is missing
                row["profile"] = {"error": f"{type(e).__name__}: {e}"}
        decoder.close()
        out["decoders"].append(row)
    return out


def parse_variant(text: str) -> dict[str, str]:
    if text == "default":
        return {}
    return dict(item.split("=", 1) for item in text.split("+"))


def markdown(record: dict) -> str:
    lines = ["| variant | CUDA graph | step µs (median) | step µs (mean) | tok/s | ran on |",
             "| --- | --- | ---: | ---: | ---: | --- |"]
    for v in record["variants"]:
        for d in v.get("decoders", []):
            lines.append(f"| {v['variant']} | {'yes' if d['cuda_graph'] else 'no'} | {d['median_us']:.0f} | "
                         f"{d['mean_us']:.0f} | {d['tok_s']:.0f} | {d['ran_on']} |")
        if "error" in v:
            lines.append(f"| {v['variant']} | - | - | - | - | failed: {v['error']} |")
    for v in record["variants"]:
        for d in v.get("decoders", []):
            p = d.get("profile")
            if not p:
                continue
            graph = "with" if d["cuda_graph"] else "without"
            if "error" in p:
                lines += ["", f"Profile {graph} the CUDA graph failed: {p['error']}"]
                continue
            lines += ["", f"### Kernels per step {graph} the CUDA graph ({v['variant']}): {p['launches_per_step']:.0f} "
                          f"launches, {p['device_us_per_step']:.0f} µs of device time against {d['median_us']:.0f} µs "
                          f"of wall time", "", "| kernel | per step | µs per step |", "| --- | ---: | ---: |"]
            lines += [f"| `{k['name'][:110]}` | {k['per_step']:.1f} | {k['us_per_step']:.1f} |" for k in p["kernels"][:25]]
    return "\n".join(lines) + "\n"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path)
    ap.add_argument("--provider", type=ProviderKind, default=ProviderKind.cuda)
    ap.add_argument("--model", default="random:gpt2")
    ap.add_argument("--rows", type=int, default=1)
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--variants", default="default,ORT_DISABLE_FLASH_ATTENTION=1",
                    help="comma-separated; each `default` or NAME=VALUE[+NAME=VALUE]")
    ap.add_argument("--exports", type=Path, default=None, help="exports root (default: GPT2X_EXPORTS, as gpt2x's)")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--profile", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        print(json.dumps(child(a)))
        return 0
    if a.out is None:
        ap.error("--out is required")
    a.out.parent.mkdir(parents=True, exist_ok=True)
    record = {"command": " ".join(sys.argv), "variants": [], "environment": system_info()}
    for i, variant in enumerate(a.variants.split(",")):
        log(f"== {variant}")
        cmd = [sys.executable, __file__, "--child", "--provider", a.provider.value, "--model", a.model,
               "--rows", str(a.rows), "--steps", str(a.steps), *(["--exports", str(a.exports)] if a.exports else []),
               *(["--profile"] if i == 0 else [])]
        done = subprocess.run(cmd, env={**os.environ, **parse_variant(variant)}, capture_output=True, text=True)
        entry = {"variant": variant}
        if done.returncode == 0:
            entry.update(json.loads(done.stdout.strip().splitlines()[-1]))
        else:
            entry["error"] = (done.stderr.strip().splitlines() or ["no output"])[-1][:300]
        log(json.dumps({k: v for k, v in entry.items() if k != "decoders"}) + " " + " ".join(
            f"graph={d['cuda_graph']}: {d['median_us']:.0f} µs" for d in entry.get("decoders", [])))
        record["variants"].append(entry)
        a.out.with_suffix(".json").write_text(json.dumps(record, indent=1, default=str))
        a.out.with_suffix(".md").write_text(markdown(record))
    return 0


if __name__ == "__main__":
    sys.exit(main())
