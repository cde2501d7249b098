"""A batched decode step of an int8 export, op type by op type, and what an int8 KV cache would save in its attention
(issue 36: 16-prompt throughput).

    python benchmarks/decode_step_profile.py --export EXPORTS/random-gpt2-int8 --out benchmarks/results/decode-step-profile-cpu-2core

1. The step: --rows rows of one new token on a past of --past positions, on the export's model.onnx and on its batched
   decode graph (model_batched.onnx) where it has one, each run as gpt2x runs a step on the CPU: one buffer of
   n_positions per layer's key and value bound as both past and present (GroupQueryAttention's in-place cache). ONNX
   Runtime's own profiler times every node; the table sums them by op type (ms per step, the median step of --steps).
2. GroupQueryAttention alone, n_layer nodes of the export's shapes on one input (a step's attention), with the cache in
   float32 (the export's) and in int8 with per-channel scales (the operator's kv_cache_bit_width = 8,
   k_quant_type = v_quant_type = PER_CHANNEL, which ONNX Runtime's CPU kernel runs): ms per call, medians of
   --repeat interleaved rounds at each past length. Random caches and scales: this times the kernel, not the answers.

Only onnx and onnxruntime; nothing of gpt2x's runtime.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import onnxruntime as ort
from onnx import TensorProto, helper

from gpt2x.bench.report import save_results
from gpt2x.bench.system import system_info


def options(threads: int, profile_dir: str | None = None) -> ort.SessionOptions:
    so = ort.SessionOptions()
    so.intra_op_num_threads = threads
    so.log_severity_level = 3
    if profile_dir is not None:
        so.enable_profiling = True
        so.profile_file_prefix = os.path.join(profile_dir, "step")
    return so


def step_profile(path: Path, cfg: dict, rows: int, past: int, steps: int, threads: int) -> tuple[float, dict[str, float]]:
    """The median step's wall ms and the median ms per op type over `steps` steps, the caches bound in place."""
    with tempfile.TemporaryDirectory() as tmp:
        session = ort.InferenceSession(str(path), options(threads, tmp), providers=["CPUExecutionProvider"])
        heads, dim, n = cfg["n_head"], cfg["n_embd"] // cfg["n_head"], cfg["n_positions"]
        rng = np.random.default_rng(0)
        binding = session.io_binding()
        binding.bind_cpu_input("input_ids", rng.integers(0, cfg["vocab_size"], (rows, 1)))
        binding.bind_cpu_input("attention_mask", np.ones((rows, past + 1), np.int64))
        binding.bind_cpu_input("position_ids", np.full((rows, 1), past, np.int64))
        caches = []
        for i in range(cfg["n_layer"]):
            for kind in ("key", "value"):
                value = ort.OrtValue.ortvalue_from_numpy(rng.standard_normal((rows, heads, n, dim)).astype(np.float32))
                caches.append(value)
                binding.bind_ortvalue_input(f"past_key_values.{i}.{kind}", value)
                binding.bind_ortvalue_output(f"present.{i}.{kind}", value)
        binding.bind_output("logits", "cpu")
        names = {i.name for i in session.get_inputs()}
        if "logits_to_keep" in names:
            binding.bind_cpu_input("logits_to_keep", np.array(1, np.int64))
        for _ in range(3):
            session.run_with_iobinding(binding)
        walls = []
        for _ in range(steps):
            t = time.perf_counter()
            session.run_with_iobinding(binding)
            walls.append((time.perf_counter() - t) * 1e3)
        events = json.loads(Path(session.end_profiling()).read_text())
    # Each node's time goes to the run whose interval holds it (the profile lists a run after its nodes).
    runs = sorted((e["ts"], e["ts"] + e["dur"]) for e in events if e.get("cat") == "Session" and e.get("name") == "model_run")
    timed = runs[-steps:]  # after the warm-up
    sums: dict[str, list[float]] = collections.defaultdict(lambda: [0.0] * len(timed))
    for e in events:
        if e.get("cat") == "Node" and e["name"].endswith("_kernel_time"):
            for i, (start, end) in enumerate(timed):
                if start <= e["ts"] <= end:
                    sums[e["args"]["op_name"]][i] += e["dur"] / 1e3
                    break
    ops = {op: statistics.median(per_step) for op, per_step in sums.items()}
    return statistics.median(walls), dict(sorted(ops.items(), key=lambda kv: -kv[1]))


def attention_graph(cfg: dict, cache: str) -> bytes:
    """n_layer GroupQueryAttention nodes on one query/key/value, each with its cache (float32, or int8 per channel)."""
    heads = cfg["n_head"]
    quant = cache == "int8"
    cache_type = TensorProto.INT8 if quant else TensorProto.FLOAT
    nodes, inputs, outputs = [], [], []
    for i in range(cfg["n_layer"]):
        attrs = {"num_heads": heads, "kv_num_heads": heads}
        names = ["q", "k", "v", f"past_k{i}", f"past_v{i}", "seqlens_k", "total"]
        if quant:
            attrs.update(kv_cache_bit_width=8, k_quant_type="PER_CHANNEL", v_quant_type="PER_CHANNEL")
            names += ["", "", "", "", "", "k_scale", "v_scale"]
        nodes.append(helper.make_node("GroupQueryAttention", names, [f"out{i}", f"present_k{i}", f"present_v{i}"],
                                      domain="com.microsoft", **attrs))
        inputs += [helper.make_tensor_value_info(f"past_{x}{i}", cache_type, None) for x in "kv"]
        outputs += [helper.make_tensor_value_info(f"out{i}", TensorProto.FLOAT, None)]
        outputs += [helper.make_tensor_value_info(f"present_{x}{i}", cache_type, None) for x in "kv"]
    inputs += [helper.make_tensor_value_info(x, TensorProto.FLOAT, None) for x in "qkv"]
    inputs += [helper.make_tensor_value_info(x, TensorProto.INT32, None) for x in ("seqlens_k", "total")]
    if quant:
        inputs += [helper.make_tensor_value_info(x, TensorProto.FLOAT, None) for x in ("k_scale", "v_scale")]
    model = helper.make_model(helper.make_graph(nodes, "attention", inputs, outputs),
                              opset_imports=[helper.make_opsetid("", 18), helper.make_opsetid("com.microsoft", 1)])
    model.ir_version = 10  # what this ONNX Runtime reads
    return model.SerializeToString()


class Attention:
    """One session of attention_graph, its caches bound in place (n_positions each), at a settable past length."""

    def __init__(self, cfg: dict, cache: str, rows: int, threads: int):
        heads, dim, n = cfg["n_head"], cfg["n_embd"] // cfg["n_head"], cfg["n_positions"]
        self.session = ort.InferenceSession(attention_graph(cfg, cache), options(threads), providers=["CPUExecutionProvider"])
        self.binding = self.session.io_binding()
        self.rows = rows
        rng = np.random.default_rng(1)
        for x in "qkv":
            self.binding.bind_cpu_input(x, rng.standard_normal((rows, 1, heads * dim)).astype(np.float32))
        if cache == "int8":
            for x in ("k_scale", "v_scale"):
                self.binding.bind_cpu_input(x, np.full((1, heads, 1, dim), 0.02, np.float32))
        self.caches = []
        for i in range(cfg["n_layer"]):
            for x in "kv":
                data = rng.standard_normal((rows, heads, n, dim)) * (50 if cache == "int8" else 1)
                value = ort.OrtValue.ortvalue_from_numpy(data.astype(np.int8 if cache == "int8" else np.float32))
                self.caches.append(value)
                self.binding.bind_ortvalue_input(f"past_{x}{i}", value)
                self.binding.bind_ortvalue_output(f"present_{x}{i}", value)
            self.binding.bind_output(f"out{i}", "cpu")

    def time(self, past: int, calls: int) -> float:
        self.binding.bind_cpu_input("seqlens_k", np.full(self.rows, past, np.int32))  # the last position's index
        self.binding.bind_cpu_input("total", np.array([past + 1], np.int32))
        self.session.run_with_iobinding(self.binding)
        t = time.perf_counter()
        for _ in range(calls):
            self.session.run_with_iobinding(self.binding)
        return (time.perf_counter() - t) / calls * 1e3


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--export", type=Path, required=True, help="an int8 export folder (gpt2x export --precision int8)")
    ap.add_argument("--rows", type=int, default=16)
    ap.add_argument("--past", type=int, default=64, help="past positions of the profiled step")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--pasts", default="64,256", help="past lengths of the attention comparison")
    ap.add_argument("--repeat", type=int, default=7)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", type=Path, required=True, help="output path without extension")
    args = ap.parse_args()
    meta_path = args.export / "gpt2x.json"
    if not meta_path.is_file():
        raise SystemExit(f"error: {args.export} is not a gpt2x export (no gpt2x.json)")
    meta = json.loads(meta_path.read_text())
    cfg = meta["config"]
    graphs = {"model.onnx": args.export / "model.onnx"}
    if (args.export / "model_batched.onnx").is_file():
        graphs["model_batched.onnx"] = args.export / "model_batched.onnx"
    steps = {}
    for name, path in graphs.items():
        wall, ops = step_profile(path, cfg, args.rows, args.past, args.steps, args.threads)
        steps[name] = {"wall_ms": wall, "ops_ms": ops}
    pasts = [int(p) for p in args.pasts.split(",")]
    kernels = {cache: Attention(cfg, cache, args.rows, args.threads) for cache in ("float32", "int8")}
    times: dict = {cache: {str(p): [] for p in pasts} for cache in kernels}
    for i in range(args.repeat):
        for cache in (list(kernels) if i % 2 == 0 else list(kernels)[::-1]):  # alternating, so drift falls on both
            for p in pasts:
                times[cache][str(p)].append(kernels[cache].time(p, 20))
    medians = {c: {p: statistics.median(v) for p, v in by.items()} for c, by in times.items()}
    env = system_info()
    md = [f"A decode step of `{args.export.name}` ({meta['precision']}): {args.rows} rows x 1 new token on a past of "
          f"{args.past}, ms per step (ONNX Runtime's profiler, the median of {args.steps} steps), caches bound in place; "
          f"{args.threads} threads. `benchmarks/decode_step_profile.py`.",
          f"Machine: {env.get('cpu', 'n/a')}, {env.get('platform', '')}; git {env.get('git')}; onnxruntime {ort.__version__}.", "",
          "| op type | " + " | ".join(graphs) + " |", "| --- |" + " ---: |" * len(graphs)]
    op_types = list(dict.fromkeys(op for s in steps.values() for op in s["ops_ms"]))
    for op in op_types:
        if max(s["ops_ms"].get(op, 0) for s in steps.values()) >= 0.05:
            md.append(f"| {op} | " + " | ".join(f"{steps[g]['ops_ms'].get(op, 0):.2f}" for g in graphs) + " |")
    md += ["| **step, wall** | " + " | ".join(f"**{steps[g]['wall_ms']:.2f}**" for g in graphs) + " |", "",
           f"GroupQueryAttention alone: {cfg['n_layer']} nodes (one step's), {args.rows} rows, ms per call (median of "
           f"{args.repeat} interleaved rounds), the cache in float32 against int8 with per-channel scales:", "",
           "| past | float32 cache | int8 cache | float32 / int8 |", "| ---: | ---: | ---: | ---: |"]
    for p in pasts:
        f, q = medians["float32"][str(p)], medians["int8"][str(p)]
        md.append(f"| {p} | {f:.2f} | {q:.2f} | {f / q:.2f}x |")
    text = "\n".join(md) + "\n"
    save_results(args.out, {"environment": env, "export": str(args.export), "config": cfg, "rows": args.rows,
                            "past": args.past, "threads": args.threads, "steps": steps, "attention_times_ms": times,
                            "attention_median_ms": medians}, text)
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
