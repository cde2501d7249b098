"""Where a batched decode step of gpt2x's OpenVINO backend goes: --rows rows after a --prompt-len prefill, each
configuration's step timed as the backend runs it (OpenVinoBackend.step; every configuration of an export compiled
once and stepped in turn, --steps rounds, the median), then one inference at the backend's own configuration
profiled by OpenVINO's counters (PERF_COUNT, a compile of its own), summed by node type and kernel. Int8 exports
also run with OpenVINO's activation groups set (DYNAMIC_QUANTIZATION_GROUP_SIZE 0 = none, and 128 = the int8
weights' block), the setting that would let its int8 matmuls quantize their activations.

    python benchmarks/openvino_batch_profile.py --export EXPORTS/random-gpt2-int8 --export EXPORTS/random-gpt2-fp32 \\
        --out benchmarks/results/openvino-batch-profile-cpu-2core-gpt2-124m
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections import Counter
from pathlib import Path

import numpy as np
import openvino as ov

from gpt2x.bench.report import save_results
from gpt2x.bench.system import system_info
from gpt2x.onnx.artifact import read_export
from gpt2x.runtime import openvino as backend_module
from gpt2x.runtime.providers import physical_cores

TOP = 8  # node types shown per run


class Stepper:
    """One compiled configuration of the backend, its batch prefilled; `step` runs and times one decode step."""

    def __init__(self, info, threads: int, extra: dict, rows: int, prompt_len: int):
        real = ov.Core.compile_model
        ov.Core.compile_model = lambda core, model, device, config: real(core, model, device, dict(config) | extra)
        try:
            self.backend = backend_module.OpenVinoBackend(info, threads=threads)
        finally:
            ov.Core.compile_model = real
        rng = np.random.default_rng(0)
        ids = rng.integers(0, self.backend.vocab_size, (rows, prompt_len))
        self.mask = np.ones((rows, prompt_len), np.int64)
        logits, self.cache = self.backend.run(ids, self.mask, np.tile(np.arange(prompt_len), (rows, 1)), None)
        self.next = logits[:, -1].argmax(-1)[:, None]
        self.times: list[float] = []

    def step(self) -> None:
        rows, width = self.mask.shape
        self.mask = np.concatenate([self.mask, np.ones((rows, 1), np.int64)], 1)
        t0 = time.perf_counter()
        logits, self.cache = self.backend.step(self.next, self.mask, np.full((rows, 1), width), self.cache)
        self.times.append(time.perf_counter() - t0)
        self.next = logits.argmax(-1)[:, None]


def _profile(info, threads: int, args) -> dict:
    stepper = Stepper(info, threads, {"PERF_COUNT": True}, args.rows, args.prompt_len)
    stepper.step()
    stepper.step()
    by: Counter = Counter()
    count: Counter = Counter()
    for p in stepper.backend.request.profiling_info:  # the last inference: one row of a rows-only graph, else the batch
        if p.status == p.Status.EXECUTED:
            by[(p.node_type, p.exec_type)] += p.real_time.total_seconds() * 1e3
            count[(p.node_type, p.exec_type)] += 1
    return {"profiled_inference_ms": sum(by.values()),
            "nodes": [{"type": t, "kernel": k, "ms": ms, "count": count[(t, k)]} for (t, k), ms in by.most_common()]}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--export", type=Path, action="append", required=True)
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results/openvino-batch-profile-cpu-2core-gpt2-124m"))
    ap.add_argument("--rows", type=int, default=16)
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--steps", type=int, default=8)
    args = ap.parse_args()
    threads = physical_cores()
    env = system_info()
    runs = []
    for folder in args.export:
        info = read_export(folder)
        configs = {"backend's": {}}
        if info.precision.value == "int8":
            configs |= {f"DYNAMIC_QUANTIZATION_GROUP_SIZE {g}": {"DYNAMIC_QUANTIZATION_GROUP_SIZE": g} for g in (0, 128)}
        steppers = {name: Stepper(info, threads, extra, args.rows, args.prompt_len) for name, extra in configs.items()}
        for _ in range(args.steps + 1):  # the first step is a new shape (compiled then): not counted
            for stepper in steppers.values():
                stepper.step()
        profile = _profile(info, threads, args)
        for name, stepper in steppers.items():
            b = stepper.backend
            runs.append({"export": str(folder), "precision": info.precision.value, "config": name,
                         "step_ms": 1e3 * statistics.median(stepper.times[1:]),
                         "step_ms_runs": [1e3 * t for t in stepper.times[1:]], "rows_only": b.rows_only,
                         "capacity": stepper.cache.capacity,
                         "dynamic_quantization_group_size": b.compiled.get_property("DYNAMIC_QUANTIZATION_GROUP_SIZE")}
                        | (profile if name == "backend's" else {"profiled_inference_ms": None, "nodes": []}))
    lines = [f"# OpenVINO backend: a {args.rows}-row decode step after {args.prompt_len} prompt tokens", "",
             f"Machine: {env['cpu']}, {env['cores']} cores, {env['platform']}; {env['date']}, gpt2x git {env['git']}; "
             f"openvino {ov.__version__}; {threads} threads. Step: OpenVinoBackend.step, median of {args.steps}, an export's "
             "configurations in turn. Profile (the backend's configuration): OpenVINO's PERF_COUNT of one inference "
             "(rows-only graphs: one row's), by node type and kernel; its counters slow the inference.", "",
             "| precision | config | rows only | activation group | step ms | profiled inference ms | top node types (ms) |",
             "|---|---|---|---:|---:|---:|---|"]
    for r in runs:
        top = "; ".join(f"{n['type']} {n['kernel']} {n['ms']:.1f} (x{n['count']})" for n in r["nodes"][:TOP]) or "-"
        profiled = "-" if r["profiled_inference_ms"] is None else f"{r['profiled_inference_ms']:.1f}"
        lines.append(f"| {r['precision']} | {r['config']} | {r['rows_only']} | {r['dynamic_quantization_group_size']} | "
                     f"{r['step_ms']:.1f} | {profiled} | {top} |")
    save_results(args.out, {"settings": vars(args) | {"export": [str(e) for e in args.export], "out": str(args.out),
                                                      "threads": threads}, "environment": env, "runs": runs},
                 "\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
