"""The mixed step (gpt2x.onnx.mixed) against the two forwards it would replace: does one forward of the decode rows
and a joiner's chunk cost less than the decode step plus the chunk's own prefill?

    python benchmarks/mixed_step.py --out benchmarks/results/mixed-step-cpu-2core
        [--model random:gpt2] [--precision int8] [--rows 16] [--decode-past 64] [--chunks 32,128]
        [--threads 2] [--runs 20] [--rounds 3]

On the export (workflows.ensure_export; made first when missing), ONNX Runtime on the CPU, `--threads` threads:
- decode: the export's graph on `--rows` rows of one new token each, on a batch cache holding `--decode-past`
  positions (the in-place cache: capacity buffers bound as past and present, as runtime.ort.InPlaceCache binds them);
- chunk (ONNX Runtime): the export's graph on one joiner's chunk of C tokens on an empty past, last logits only;
- chunk (OpenVINO): the same prompt through OrtBackend.step as the serving engine runs a fresh prompt, where the
  export has an OpenVINO prefill graph that its record chose for C tokens (its handoff into the cache included);
- mixed: the mixed graph (onnx.mixed.mixed_graph, built here; its build time recorded) on both streams at once.
Each forward runs `--runs` times per round (the median kept); `--rounds` rounds in an order rotated every round; the
figure is the median round. Then ONNX Runtime's profiler splits one round of decode, chunk and mixed by operator
type (the sum of the nodes' times: the operators' share, not wall time). Writes OUT.json and OUT.md.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections import defaultdict
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort

from gpt2x.bench.report import save_results
from gpt2x.bench.system import system_info
from gpt2x.choices import Precision, ProviderKind
from gpt2x.onnx import names as io
from gpt2x.onnx.mixed import mixed_graph
from gpt2x.runtime.ort import OrtBackend
from gpt2x.runtime.providers import session_options
from gpt2x.workflows.exports import ensure_export

KEEP_ONE = ort.OrtValue.ortvalue_from_numpy(np.array(1, dtype=np.int64))  # logits_to_keep: the last position


def log(message: str) -> None:
    print(message, flush=True)


class Streams:
    """The buffers and bindings of the decode rows and one chunk; `bind(binding, stream)` binds one stream's
    ids, mask, positions and its cache in place (`prefix`: the mixed graph's chunk.* names)."""

    def __init__(self, backend: OrtBackend, rows: int, decode_past: int, chunk: int, seed: int):
        cfg = backend.cfg
        rng = np.random.default_rng(seed)
        capacity = min(cfg.n_positions, max(decode_past + 1, chunk))

        def buffers(batch: int) -> list[np.ndarray]:
            # Past positions hold random values: the cost does not depend on them, and no position is left unset.
            return [rng.standard_normal((batch, cfg.n_head, capacity, cfg.head_dim)).astype(np.float32)
                    for _ in range(2 * cfg.n_layer)]

        self.decode = (rng.integers(0, cfg.vocab_size, (rows, 1)), decode_past, buffers(rows))
        self.chunk = (rng.integers(0, cfg.vocab_size, (1, chunk)), 0, buffers(1))
        self.backend = backend

    def bind(self, binding, stream, prefix: str = "") -> None:
        ids, past, arrays = stream
        batch, new = ids.shape
        binding.bind_cpu_input(prefix + io.INPUT_IDS, ids.astype(np.int64))
        binding.bind_cpu_input(prefix + io.ATTENTION_MASK, np.ones((batch, past + new), np.int64))
        binding.bind_cpu_input(prefix + io.POSITION_IDS, np.tile(np.arange(past, past + new), (batch, 1)).astype(np.int64))
        values = [ort.OrtValue.ortvalue_from_numpy(a) for a in arrays]
        for name, value in zip(self.backend.names_in[3:], values):
            binding.bind_ortvalue_input(prefix + name, value)
        for name, value in zip(self.backend.names_out[1:], values):
            binding.bind_ortvalue_output(prefix + name, value)


def forwards(backend: OrtBackend, session, mixed, streams: Streams, openvino: OrtBackend | None) -> dict:
    """name -> a callable running that forward once (bindings made once: the steps rewrite the same positions)."""

    def single(stream):
        binding = session.io_binding()
        binding.bind_output(io.LOGITS, "cpu")
        streams.bind(binding, stream)
        if backend.logits_to_keep is not None:
            binding.bind_ortvalue_input(io.LOGITS_TO_KEEP, KEEP_ONE)
        return lambda: session.run_with_iobinding(binding)

    both = mixed.io_binding()
    both.bind_output(io.LOGITS, "cpu")
    streams.bind(both, streams.decode)
    streams.bind(both, streams.chunk, io.CHUNK_PREFIX)
    runs = {"decode": single(streams.decode), "chunk-onnxruntime": single(streams.chunk),
            "mixed": lambda: mixed.run_with_iobinding(both)}
    if openvino is not None:
        ids = streams.chunk[0].astype(np.int64)
        mask, positions = np.ones_like(ids), np.arange(ids.shape[1])[None]
        runs["chunk-openvino"] = lambda: openvino.step(ids, mask, positions, None)
    return runs


def timed(run, n: int) -> float:
    times = []
    for _ in range(n):
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    return 1e3 * statistics.median(times)


def op_times(model, threads: int, bind, runs: int) -> dict[str, float]:
    """ms per run by operator type, from ONNX Runtime's profiler (a session of its own)."""
    options = session_options(threads)
    options.enable_profiling = True
    session = ort.InferenceSession(model, sess_options=options, providers=["CPUExecutionProvider"])
    binding = session.io_binding()
    bind(binding)
    session.run_with_iobinding(binding)  # warm
    for _ in range(runs):
        session.run_with_iobinding(binding)
    path = Path(session.end_profiling())
    totals: dict[str, float] = defaultdict(float)
    for event in json.loads(path.read_text()):
        if event.get("cat") == "Node" and event["name"].endswith("_kernel_time"):
            totals[event["args"]["op_name"]] += event["dur"] / 1e3
    path.unlink()
    # the warm-up run is in the profile too
    return {op: round(ms / (runs + 1), 3) for op, ms in sorted(totals.items(), key=lambda kv: -kv[1])}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, required=True, help="OUT.json and OUT.md are written")
    ap.add_argument("--model", default="random:gpt2")
    ap.add_argument("--precision", default="int8", choices=["int8", "int4"])
    ap.add_argument("--exports", type=Path, default=None, help="the export folder (default: gpt2x's for the model)")
    ap.add_argument("--rows", type=int, default=16)
    ap.add_argument("--decode-past", type=int, default=64)
    ap.add_argument("--chunks", default="32,128")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--runs", type=int, default=20)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--profile-runs", type=int, default=10)
    args = ap.parse_args()
    chunks = [int(c) for c in args.chunks.split(",")]

    info = ensure_export(args.model, Precision(args.precision), folder=args.exports, notice=log)
    backend = OrtBackend(info, ProviderKind.cpu, args.threads, prefill="onnxruntime")
    openvino = OrtBackend(info, ProviderKind.cpu, args.threads, prefill="auto")  # the engine's choice: the record's
    start = time.perf_counter()
    proto = onnx.load(str(info.model_path))
    loaded = time.perf_counter()
    mixed_proto = mixed_graph(proto)
    built = time.perf_counter()
    mixed_bytes = mixed_proto.SerializeToString()
    mixed = ort.InferenceSession(mixed_bytes, sess_options=session_options(args.threads), providers=["CPUExecutionProvider"])
    session_made = time.perf_counter()
    build = {"load_s": round(loaded - start, 3), "mixed_graph_s": round(built - loaded, 3),
             "session_s": round(session_made - built, 3)}
    log(f"mixed graph: load {build['load_s']} s, build {build['mixed_graph_s']} s, session {build['session_s']} s")

    results = []
    for c in chunks:
        streams = Streams(backend, args.rows, args.decode_past, c, seed=c)
        ov = openvino if openvino.prefill_runtime(c) == "openvino" else None
        runs = forwards(backend, backend.session, mixed, streams, ov)
        names = list(runs)
        for name in names:
            timed(runs[name], 3)  # warm
        rounds = []
        for r in range(args.rounds):
            order = names[r % len(names):] + names[: r % len(names)]
            rounds.append({name: round(timed(runs[name], args.runs), 3) for name in order})
            log(f"chunk {c}, round {r + 1}: " + ", ".join(f"{k} {v:.2f} ms" for k, v in rounds[-1].items()))
        median = {name: round(statistics.median(rd[name] for rd in rounds), 3) for name in names}
        ratios = {"mixed / (decode + chunk-onnxruntime)": round(median["mixed"] / (median["decode"] + median["chunk-onnxruntime"]), 3)}
        if "chunk-openvino" in median:
            ratios["mixed / (decode + chunk-openvino)"] = round(median["mixed"] / (median["decode"] + median["chunk-openvino"]), 3)
        profile = {
            "decode": op_times(str(info.model_path), args.threads,
                               lambda b, s=streams: (b.bind_output(io.LOGITS, "cpu"), s.bind(b, s.decode),
                                                     b.bind_ortvalue_input(io.LOGITS_TO_KEEP, KEEP_ONE)),
                               args.profile_runs),
            "chunk-onnxruntime": op_times(str(info.model_path), args.threads,
                                          lambda b, s=streams: (b.bind_output(io.LOGITS, "cpu"), s.bind(b, s.chunk),
                                                                b.bind_ortvalue_input(io.LOGITS_TO_KEEP, KEEP_ONE)),
                                          args.profile_runs),
            "mixed": op_times(mixed_bytes, args.threads,
                              lambda b, s=streams: (b.bind_output(io.LOGITS, "cpu"), s.bind(b, s.decode),
                                                    s.bind(b, s.chunk, io.CHUNK_PREFIX)),
                              args.profile_runs),
        }
        results.append({"chunk": c, "rounds": rounds, "median_ms": median, "ratios": ratios, "profile_ms": profile})
        log(f"chunk {c}: {median} {ratios}")

    settings = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}
    data = {"benchmark": "mixed-step", "settings": settings, "export": str(info.folder), "build": build,
            "results": results, "environment": system_info()}
    save_results(args.out, data, markdown(data))
    log(f"wrote {args.out.with_suffix('.json')} and {args.out.with_suffix('.md')}")


def markdown(data: dict) -> str:
    s = data["settings"]
    lines = [f"# The mixed step: {s['model']} {s['precision']}, {s['rows']} decode rows (past {s['decode_past']}) "
             f"+ one chunk, {s['threads']} threads\n",
             f"Median of {s['rounds']} rounds of {s['runs']} runs each (ms per forward). Mixed graph built in "
             f"{data['build']['mixed_graph_s']} s (session {data['build']['session_s']} s).\n",
             "| chunk | decode | chunk (ONNX Runtime) | chunk (OpenVINO, engine path) | mixed | mixed / (decode + chunk ORT) "
             "| mixed / (decode + chunk OpenVINO) |", "|---|---|---|---|---|---|---|"]
    for r in data["results"]:
        m, q = r["median_ms"], r["ratios"]
        ov = m.get("chunk-openvino")
        lines.append(f"| {r['chunk']} | {m['decode']:.2f} | {m['chunk-onnxruntime']:.2f} | "
                     f"{'-' if ov is None else f'{ov:.2f}'} | {m['mixed']:.2f} | "
                     f"{q['mixed / (decode + chunk-onnxruntime)']:.2f} | {q.get('mixed / (decode + chunk-openvino)', '-')} |")
    lines += ["", "ONNX Runtime's profiler, ms per forward by operator type (nodes' time summed):", ""]
    for r in data["results"]:
        ops = sorted({op for p in r["profile_ms"].values() for op in p}, key=lambda op: -r["profile_ms"]["mixed"].get(op, 0))
        lines += [f"chunk {r['chunk']}:", "", "| operator | decode | chunk (ONNX Runtime) | mixed |", "|---|---|---|---|"]
        for op in ops:
            p = r["profile_ms"]
            lines.append(f"| {op} | {p['decode'].get(op, 0):.2f} | {p['chunk-onnxruntime'].get(op, 0):.2f} | {p['mixed'].get(op, 0):.2f} |")
        lines.append("")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
