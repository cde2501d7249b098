"""Where a batch-1 prefill goes: gpt2x's OpenVINO prefill graph (an export's openvino/prefill.xml) beside the IR
optimum-intel makes for OpenVINO GenAI from the same weights (`optimum-cli export openvino --task
text-generation-with-past`, a stateful model), each compiled by plain openvino.Core at each compute precision
(2 threads, latency hint, unpinned as gpt2x's runtime compiles it), --prompt-len tokens. Each configuration is timed
(--runs interleaved rounds, the median; the GenAI IR's state reset before each run, so every run is a fresh
prefill), then one inference profiled by OpenVINO's counters (PERF_COUNT, a compile of its own), summed by node
type and kernel, and by where in the model a node is (the embedding, attention, the MLP, the unembedding).

gpt2x's graph runs as its runtime runs it (runtime/openvino_prefill.py): the presents written into regions of
longer buffers (--capacity positions, as ONNX Runtime's KV cache; at bf16 compute given out in bf16 and widened into
them, on one thread), and also with OpenVINO's own output tensors.
The GenAI IR computes logits at every position (GenAI's pipeline slices the last position before its unembedding):
its unembedding's time is reported on its own.

    python benchmarks/prefill_profile.py --export EXPORTS/random-gpt2-int8 --genai OV_INT8 \\
        --export EXPORTS/random-gpt2-fp32 --genai OV_FP32 --out benchmarks/results/prefill-profile-cpu-2core-gpt2-124m
"""

from __future__ import annotations

import argparse
import re
import statistics
import time
from collections import Counter
from pathlib import Path

import numpy as np
import openvino as ov

from gpt2x.bench.report import save_results
from gpt2x.bench.system import system_info
from gpt2x.onnx import names as io
from gpt2x.onnx.artifact import read_export
from gpt2x.runtime.kvbuffers import small_page_arrays
from gpt2x.runtime.openvino_prefill import cpu_has_bf16, fresh_graph, presents_in_bf16, widen
from gpt2x.runtime.providers import physical_cores

COMPILED: dict = {}
TOP = 10  # node types shown per configuration
# Where a node sits, by the names the two converters give (gpt2x: model.blocks.N..., optimum: ...transformer.h.N...).
PARTS = (("unembedding", re.compile(r"lm_head|unembed|logits|tok_emb.*MatMul|wte.*MatMul", re.I)),
         ("attention", re.compile(r"attn|attention|ScaledDotProduct|sdpa", re.I)),
         ("mlp", re.compile(r"mlp|c_fc|fc1|fc2|gelu", re.I)),
         ("layer norm", re.compile(r"ln_|norm", re.I)),
         ("embedding", re.compile(r"wte|wpe|tok_emb|pos_emb|embed|Gather", re.I)))


def part(name: str) -> str:
    return next((label for label, pattern in PARTS if pattern.search(name)), "other")


class Graph:
    """One compiled configuration and its inputs; `run` is one fresh prefill."""

    def __init__(self, label: str, model: ov.Model, compute: str, threads: int, T: int, capacity: int | None,
                 profile: bool = False, fresh: bool = False):
        config = {"INFERENCE_NUM_THREADS": threads, "INFERENCE_PRECISION_HINT": compute, "PERFORMANCE_HINT": "LATENCY",
                  "ENABLE_CPU_PINNING": False, "PERF_COUNT": profile}
        key = (id(model), compute, profile)  # one compile for every variant of a graph
        if key not in COMPILED:
            COMPILED[key] = ov.Core().compile_model(model, "CPU", config)
        self.label, self.compiled = label, COMPILED[key]
        self.request = self.compiled.create_infer_request()
        rng = np.random.default_rng(0)
        names = {n for p in self.compiled.inputs for n in p.get_names()}
        self.inputs = {io.INPUT_IDS: rng.integers(0, 50257, (1, T), dtype=np.int64),
                       io.ATTENTION_MASK: np.ones((1, T), np.int64), io.POSITION_IDS: np.arange(T, dtype=np.int64)[None]}
        if "beam_idx" in names:
            self.inputs["beam_idx"] = np.zeros(1, np.int32)
        for port in self.compiled.inputs:  # the rest, a past (gpt2x's graph, as fresh_graph made it): an empty one
            if not port.get_names() & set(self.inputs):
                shape = port.get_partial_shape()  # (B, H, 0, D)
                self.inputs[port.get_any_name()] = np.zeros((1, shape[1].get_length(), 0, shape[3].get_length()), np.float32)
        self.stateful = bool(self.request.query_state())
        self.capacity, self.fresh = capacity, fresh
        self.buffers = []
        if capacity:  # the presents into regions of longer buffers, as the runtime's handoff into ONNX Runtime's cache
            for port in self.compiled.outputs[1:]:
                H, D = port.get_partial_shape()[1].get_length(), port.get_partial_shape()[3].get_length()
                self.buffers.append((port, H, D))
        self.regions = self._regions(T)
        # gpt2x's graph at bf16, as the runtime compiles it: presents given out in bf16, then widened into the buffers
        self.narrow = len(self.compiled.outputs) > 1 and self.compiled.outputs[1].get_element_type() == ov.Type.bf16

    def _regions(self, T: int) -> list[ov.Tensor]:
        """Regions (positions [0, T)) of new buffers of `capacity` positions, in small pages as the runtime's."""
        arrays = [small_page_arrays((1, H, self.capacity, D), 1, np.float32)[0] for _, H, D in self.buffers]
        self._arrays = arrays  # the tensors share their memory
        return [ov.Tensor(ov.Tensor(a, shared_memory=True), [0, 0, 0, 0], [1, a.shape[1], T, a.shape[3]]) for a in arrays]

    def run(self) -> float:
        if self.stateful:
            self.request.reset_state()
        t0 = time.perf_counter()
        if self.fresh:  # new buffers for every prompt, as the runtime allocates them (their pages first written here)
            self.regions = self._regions(self.inputs[io.INPUT_IDS].shape[1])
        for name, arr in self.inputs.items():
            self.request.set_tensor(name, ov.Tensor(arr))
        if not self.narrow:
            for (port, _, _), region in zip(self.buffers, self.regions):
                self.request.set_tensor(port, region)
        self.request.infer()
        if self.narrow:  # one thread here; the runtime shares them among its threads
            T = self.inputs[io.INPUT_IDS].shape[1]
            for (port, _, _), arr in zip(self.buffers, self._arrays):
                widen(self.request.get_tensor(port), arr, 1, 0, T)
        self.request.get_tensor(self.compiled.outputs[0]).data[:, -1].copy()
        return time.perf_counter() - t0

    def profile(self) -> dict:
        self.run()
        self.run()
        by: Counter = Counter()
        count: Counter = Counter()
        parts: Counter = Counter()
        for p in self.request.profiling_info:
            if p.status == p.Status.EXECUTED:
                ms = p.real_time.total_seconds() * 1e3
                by[(p.node_type, p.exec_type)] += ms
                count[(p.node_type, p.exec_type)] += 1
                parts[part(p.node_name)] += ms
        return {"profiled_ms": round(sum(by.values()), 3), "by_part_ms": {k: round(v, 3) for k, v in parts.most_common()},
                "nodes": [{"type": t, "kernel": k, "ms": round(ms, 3), "count": count[(t, k)]} for (t, k), ms in by.most_common()]}


def configurations(args, computes: list[str]) -> list[tuple[str, str, ov.Model, int | None, bool]]:
    core = ov.Core()
    out = []
    for export, genai in zip(args.export, args.genai):
        info = read_export(export)
        tag = info.precision.value
        fresh = fresh_graph(core.read_model(str(info.prefill_path)), info.config.n_layer)  # as the runtime compiles it
        theirs = core.read_model(str(Path(genai) / "openvino_model.xml"))
        for compute in computes:
            ours = presents_in_bf16(fresh) if compute == "bf16" else fresh
            out.append((f"gpt2x {tag} ({compute}), presents into new buffers", compute, ours, args.capacity, True))
            out.append((f"gpt2x {tag} ({compute}), presents into the same buffers", compute, ours, args.capacity, False))
            out.append((f"gpt2x {tag} ({compute}), OpenVINO's outputs", compute, ours, None, False))
            out.append((f"optimum-intel IR {tag} ({compute})", compute, theirs, None, False))
    return out


def markdown(results: dict) -> str:
    s = results["settings"]
    lines = [f"# Prefill profile, {s['prompt_len']} tokens, batch 1, {s['threads']} threads", "",
             "| configuration | median ms | profiled ms | embedding | attention | mlp | layer norm | unembedding | other |",
             "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for r in results["runs"]:
        p = r["profile"]["by_part_ms"]
        cells = " | ".join(f"{p.get(k, 0):.1f}" for k in ("embedding", "attention", "mlp", "layer norm", "unembedding", "other"))
        lines.append(f"| {r['label']} | {r['median_ms']:.1f} | {r['profile']['profiled_ms']:.1f} | {cells} |")
    for r in results["runs"]:
        lines += ["", f"## {r['label']}", "", "| node type | kernel | ms | count |", "| --- | --- | ---: | ---: |"]
        lines += [f"| {n['type']} | {n['kernel']} | {n['ms']:.2f} | {n['count']} |" for n in r["profile"]["nodes"][:TOP]]
    return "\n".join(lines) + "\n"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--export", type=Path, action="append", required=True, help="a gpt2x export with a prefill graph")
    ap.add_argument("--genai", type=Path, action="append", required=True,
                    help="the optimum-intel folder of the same weights and precision (one per --export, in order)")
    ap.add_argument("--out", type=Path, required=True, help="output path without extension")
    ap.add_argument("--prompt-len", type=int, default=512)
    ap.add_argument("--capacity", type=int, default=1024, help="the KV cache's positions the presents go into")
    ap.add_argument("--runs", type=int, default=5)
    args = ap.parse_args()
    if len(args.export) != len(args.genai):
        ap.error("give one --genai folder per --export")
    threads = physical_cores()
    computes = ["f32"] + (["bf16"] if cpu_has_bf16() else [])
    graphs = [(Graph(label, model, compute, threads, args.prompt_len, capacity, fresh=fresh), (label, model, compute, capacity, fresh))
              for label, compute, model, capacity, fresh in configurations(args, computes)]
    times: dict[str, list[float]] = {g.label: [] for g, _ in graphs}
    for g, _ in graphs:
        g.run()  # warm-up: the first inference of a shape compiles its kernels
    for _ in range(args.runs):
        for g, _ in graphs:
            times[g.label].append(g.run() * 1e3)
    runs = []
    for _, (label, model, compute, capacity, fresh) in graphs:
        profiled = Graph(label, model, compute, threads, args.prompt_len, capacity, profile=True, fresh=fresh)
        runs.append({"label": label, "compute": compute, "median_ms": round(statistics.median(times[label]), 3),
                     "ms": [round(t, 3) for t in times[label]], "profile": profiled.profile()})
    results = {"environment": system_info(), "settings": {"prompt_len": args.prompt_len, "capacity": args.capacity,
                                                          "runs": args.runs, "threads": threads,
                                                          "exports": [str(p) for p in args.export],
                                                          "genai": [str(p) for p in args.genai]},
               "runs": runs}
    save_results(args.out, results, markdown(results))
    print(markdown(results))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
