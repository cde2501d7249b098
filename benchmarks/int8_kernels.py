"""The int8 matmul kernels at GPT-2 124M's weight shapes and batched-step row counts: which is fastest at M = 16-64
(issue 36: 16-prompt throughput), and what it costs at M = 1.

    python benchmarks/int8_kernels.py --out benchmarks/results/int8-kernels-cpu-2core

Each case is one ONNX Runtime session or one compiled OpenVINO model of a few-node graph, random weights (normal,
std 0.02) and random activations: a block shape (K x N: qkv 768x2304, proj 768x768, fc 768x3072, fc proj 3072x768)
holds 12 copies of its matmul side by side on one input, like GPT-2's 12 layers, so that the weights read per call
exceed the L3 cache as a decode step's do; the unembedding (768x50257) is one node. Every case runs at each M in
interleaved rounds (the cases' order alternating), a measurement being, after a 100 ms pause (for the previous case's
threads to stop spinning) and a quarter as many untimed calls, the mean of enough calls to last about 20 ms;
medians are reported, per matmul (a block shape's time over its 12 copies) and as G multiply-adds a second.

Cases:
- ONNX Runtime MatMulNBits, 8 bits, symmetric (ONNX Runtime's matmul_nbits_quantizer, as gpt2x's int8 export): block 128
  at accuracy_level 4 (int8 activations: the export's), blocks 32/64/256 at 4, block 128 at levels 0 and 1 (fp32
  compute on dequantized weights).
- ONNX Runtime quantize_dynamic, per-channel int8 weights (DynamicQuantizeLinear + MatMulInteger, which ONNX Runtime's
  optimizer turns into DynamicQuantizeLinear + MatMulIntegerToFloat: MLAS's u8s8 QGEMM).
- ONNX Runtime fp32 MatMul (MLAS sgemm).
- OpenVINO CPU: int8-compressed weights (nncf compress_weights, INT8_ASYM: per-channel u8 with zero points, as
  optimum-intel and gpt2x's prefill make them) at INFERENCE_PRECISION_HINT f32 and bf16, each with
  DYNAMIC_QUANTIZATION_GROUP_SIZE left at its default and at 0 (no int8 activations); f32 weights at f32 and bf16.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import math
import multiprocessing
import statistics
import tempfile
import time
from io import StringIO
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import openvino as ov
from onnx import TensorProto, helper, numpy_helper

from gpt2x.bench.report import save_results
from gpt2x.bench.system import system_info
from gpt2x.onnx.artifact import IR_VERSION
from gpt2x.onnx.optimize import INT8_BLOCK, NBITS_LOGGERS, nbits_quantizer_module
from gpt2x.runtime.providers import session_options

SHAPES = {"qkv": (768, 2304), "attn proj": (768, 768), "fc": (768, 3072), "fc proj": (3072, 768),
          "unembedding": (768, 50257)}
LAYERS = 12  # copies of a block shape per call
EXPORTED = f"ORT MatMulNBits b{INT8_BLOCK} acc4 (export)"
TARGET_S = 20e-3  # each measurement: the mean of enough calls to last about this long
PAUSE_S = 0.1


def _copies(shape: str) -> int:
    return 1 if shape == "unembedding" else LAYERS


def _weights(shape: str) -> list[np.ndarray]:
    k, n = SHAPES[shape]
    rng = np.random.default_rng(k * 7 + n)
    return [(rng.standard_normal((k, n), np.float32) * 0.02) for _ in range(_copies(shape))]


def _onnx_matmuls(weights: list[np.ndarray]) -> onnx.ModelProto:
    """Y_i = X @ W_i for each weight, X of shape (M, K) with M free."""
    k, n = weights[0].shape
    nodes, inits, outs = [], [], []
    for i, w in enumerate(weights):
        inits.append(numpy_helper.from_array(w, f"w{i}"))
        nodes.append(helper.make_node("MatMul", ["x", f"w{i}"], [f"y{i}"], name=f"matmul{i}"))
        outs.append(helper.make_tensor_value_info(f"y{i}", TensorProto.FLOAT, ["m", n]))
    graph = helper.make_graph(nodes, "matmuls", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["m", k])],
                              outs, inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)])
    model.ir_version = IR_VERSION
    return model


def _nbits(proto: onnx.ModelProto, block: int, level: int) -> onnx.ModelProto:
    # the export's quantizer call (gpt2x.onnx.optimize._matmul_nbits) at this block and accuracy level
    quantizer_cls = nbits_quantizer_module().MatMulNBitsQuantizer
    for name in NBITS_LOGGERS:
        logging.getLogger(name).setLevel(logging.WARNING)
    with contextlib.redirect_stdout(StringIO()):
        q = quantizer_cls(onnx.ModelProto.FromString(proto.SerializeToString()), bits=8, block_size=block,
                          is_symmetric=True, accuracy_level=level)
        q.process()
    out = q.model.model
    out.ir_version = IR_VERSION
    return out


def _dynamic(proto: onnx.ModelProto, tmp: Path) -> onnx.ModelProto:
    from onnxruntime.quantization import QuantType, quantize_dynamic

    src, dst = tmp / "fp32.onnx", tmp / "dynamic.onnx"
    onnx.save(proto, str(src))
    quantize_dynamic(str(src), str(dst), op_types_to_quantize=["MatMul"], per_channel=True, weight_type=QuantType.QInt8,
                     extra_options={"MatMulConstBOnly": True})
    return onnx.load(str(dst))


class OrtCase:
    def __init__(self, proto: onnx.ModelProto, threads: int, tmp: Path):
        so = session_options(threads)
        so.optimized_model_filepath = str(tmp / "optimized.onnx")  # to report the op types that actually run
        self.session = ort.InferenceSession(proto.SerializeToString(), so, providers=["CPUExecutionProvider"])
        optimized = onnx.load(so.optimized_model_filepath, load_external_data=False)
        self.ops = sorted({n.op_type for n in optimized.graph.node})

    def __call__(self, x: np.ndarray) -> None:
        self.session.run(None, {"x": x})


def _ov_matmuls(weights: list[np.ndarray]) -> ov.Model:
    from openvino import opset13 as ops

    x = ops.parameter([-1, weights[0].shape[0]], np.float32, name="x")
    outs = [ops.matmul(x, ops.constant(w), False, False) for w in weights]
    return ov.Model([o.output(0) for o in outs], [x], "matmuls")


def _compress(model: ov.Model) -> ov.Model:
    import nncf

    logging.getLogger("nncf").setLevel(logging.ERROR)
    with contextlib.redirect_stdout(StringIO()):
        return nncf.compress_weights(model, mode=nncf.CompressWeightsMode.INT8_ASYM)


class OvCase:
    def __init__(self, core: ov.Core, model: ov.Model, hint: str, group: str | None, threads: int):
        config = {"INFERENCE_NUM_THREADS": threads, "INFERENCE_PRECISION_HINT": hint, "PERFORMANCE_HINT": "LATENCY",
                  "ENABLE_CPU_PINNING": False}
        if group is not None:
            config["DYNAMIC_QUANTIZATION_GROUP_SIZE"] = group
        compiled = core.compile_model(model, "CPU", config)
        self.group = str(compiled.get_property("DYNAMIC_QUANTIZATION_GROUP_SIZE"))
        self.request = compiled.create_infer_request()
        self.ops = sorted({op.get_rt_info()["layerType"].astype(str) for op in compiled.get_runtime_model().get_ordered_ops()})

    def __call__(self, x: np.ndarray) -> None:
        self.request.infer({0: x})


NBITS = {EXPORTED: (INT8_BLOCK, 4), **{f"ORT MatMulNBits b{b} acc4": (b, 4) for b in (32, 64, 256)},
         **{f"ORT MatMulNBits b{INT8_BLOCK} acc{a}": (INT8_BLOCK, a) for a in (0, 1)}}
DYNAMIC, FP32 = "ORT quantize_dynamic per-channel", "ORT fp32 MatMul"
# OpenVINO cases: (int8 weights?, INFERENCE_PRECISION_HINT, DYNAMIC_QUANTIZATION_GROUP_SIZE or None for its default)
OV = {f"OV int8 weights {hint}, dq {'default' if g is None else g}": (True, hint, g) for hint in ("f32", "bf16")
      for g in (None, "0")} | {"OV f32 weights f32": (False, "f32", None), "OV f32 weights bf16": (False, "bf16", None)}
CASES = [*NBITS, DYNAMIC, FP32, *OV]


def _case(name: str, shape: str, threads: int, tmp: Path):
    """One case's callable for one shape."""
    weights = _weights(shape)
    if name in OV:
        int8, hint, group = OV[name]
        model = _ov_matmuls(weights)
        return OvCase(ov.Core(), _compress(model) if int8 else model, hint, group, threads)
    proto = _onnx_matmuls(weights)
    if name in NBITS:
        proto = _nbits(proto, *NBITS[name])
    elif name == DYNAMIC:
        proto = _dynamic(proto, tmp)
    return OrtCase(proto, threads, tmp)


def _worker(name: str, shape: str, threads: int, conn) -> None:
    """A case in its own process, so that no case's allocator or thread pools share a process with another's."""
    with tempfile.TemporaryDirectory() as tmp:
        case = _case(name, shape, threads, Path(tmp))
    conn.send((case.ops, getattr(case, "group", None)))
    k, _ = SHAPES[shape]
    while (job := conn.recv()) is not None:
        m, calls = job
        x = np.random.default_rng(m).standard_normal((m, k), np.float32)
        conn.send(_time(case, x, calls))


def _time(fn, x: np.ndarray, calls: int) -> float:
    # The previous case's thread pool may still spin (ONNX Runtime's do after a run; 10 ms left the next case up to
    # 2x slow, 100 ms did not): let it stop, then wake this one.
    # Then a quarter of the calls untimed: an idle virtual CPU wakes slowly, and 2 ms windows read up to 5x slow.
    time.sleep(PAUSE_S)
    for _ in range(calls // 4 + 1):
        fn(x)
    t = time.perf_counter()
    for _ in range(calls):
        fn(x)
    return (time.perf_counter() - t) / calls


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", default="1,16,32,64", help="M values: rows (tokens) per call")
    ap.add_argument("--shapes", default=",".join(SHAPES))
    ap.add_argument("--repeat", type=int, default=7)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", type=Path, required=True, help="output path without extension")
    args = ap.parse_args()
    rows = [int(m) for m in args.rows.split(",")]
    shapes = args.shapes.split(",")
    if unknown := sorted(set(shapes) - set(SHAPES)):
        raise SystemExit(f"error: unknown shape(s) {', '.join(unknown)}; known: {', '.join(SHAPES)}")
    names = CASES
    times: dict = {}
    ops: dict = {}
    groups: dict = {}
    ctx = multiprocessing.get_context("spawn")
    for shape in shapes:  # one shape's cases at a time, to keep the weights in memory to a few GB
        workers = {}
        for name in names:  # built one at a time: building is heavy, the measurement must not overlap it
            parent, child = ctx.Pipe()
            proc = ctx.Process(target=_worker, args=(name, shape, args.threads, child), daemon=True)
            proc.start()
            ops[name], group = parent.recv()
            if group is not None:
                groups[name] = group
            workers[name] = (proc, parent)

        def measure(name: str, m: int, calls: int, workers=workers) -> float:
            workers[name][1].send((m, calls))
            return workers[name][1].recv()

        for m in rows:
            calls = {name: max(1, math.ceil(TARGET_S / measure(name, m, 2))) for name in names}
            for i in range(args.repeat):  # alternating order, so drift falls on every case alike
                for name in names if i % 2 == 0 else names[::-1]:
                    times.setdefault(name, {}).setdefault(shape, {}).setdefault(str(m), []).append(
                        measure(name, m, calls[name]) * 1e3 / _copies(shape))
        for proc, conn in workers.values():
            conn.send(None)
            proc.join()
    medians = {n: {s: {m: statistics.median(v) for m, v in by_m.items()} for s, by_m in by_s.items()}
               for n, by_s in times.items()}
    gmacs = {n: {s: {m: int(m) * SHAPES[s][0] * SHAPES[s][1] / (ms * 1e-3) / 1e9 for m, ms in by_m.items()}
                 for s, by_m in by_s.items()} for n, by_s in medians.items()}
    env = system_info()
    md = [f"int8 matmul kernels at GPT-2 124M's shapes: ms per matmul (median of {args.repeat} interleaved rounds) and "
          f"G multiply-adds a second, {args.threads} threads; block shapes as {LAYERS} copies per call "
          f"(time divided by {LAYERS}). Cases: `benchmarks/int8_kernels.py`'s docstring.",
          f"Machine: {env.get('cpu', 'n/a')}, {env.get('platform', '')}; git {env.get('git')}; "
          f"OpenVINO DYNAMIC_QUANTIZATION_GROUP_SIZE default here: "
          f"{groups.get('OV int8 weights f32, dq default', 'n/a')} (f32), {groups.get('OV int8 weights bf16, dq default', 'n/a')} (bf16).", ""]
    for shape in shapes:
        k, n = SHAPES[shape]
        md += [f"### {shape} ({k}x{n})", "",
               "| case | " + " | ".join(f"M={m}: ms (GMAC/s)" for m in rows) + " | M=16 vs export |",
               "| --- |" + " ---: |" * (len(rows) + 1)]
        base = medians[EXPORTED][shape].get("16")
        for name in names:
            cells = " | ".join(f"{medians[name][shape][str(m)]:.3f} ({gmacs[name][shape][str(m)]:.0f})" for m in rows)
            speed = f"{base / medians[name][shape]['16']:.2f}x" if base else "n/a"
            md.append(f"| {name} | {cells} | {speed} |")
        md.append("")
    total = {name: {str(m): sum(medians[name][s][str(m)] * _copies(s) for s in shapes) for m in rows} for name in names}
    md += ["### Sum over one decode step's matmuls (12 layers + unembedding), ms", "",
           "| case | " + " | ".join(f"M={m}" for m in rows) + " | M=16 vs export |", "| --- |" + " ---: |" * (len(rows) + 1)]
    for name in names:
        speed = f"{total[EXPORTED]['16'] / total[name]['16']:.2f}x" if "16" in total[name] else "n/a"
        md.append(f"| {name} | " + " | ".join(f"{total[name][str(m)]:.2f}" for m in rows) + f" | {speed} |")
    md += ["", "Op types each case runs (ONNX Runtime's optimized graph / OpenVINO's runtime model):", ""]
    md += [f"- {name}: {', '.join(o for o in ops[name] if o not in ('Parameter', 'Result', 'Constant'))}" for name in names]
    text = "\n".join(md) + "\n"
    save_results(args.out, {"environment": env, "shapes": SHAPES, "layers": LAYERS, "rows": rows, "threads": args.threads,
                            "repeat": args.repeat, "ov_dynamic_quantization_group": groups, "ops": ops,
                            "times_ms": times, "median_ms": medians, "gmac_per_s": gmacs, "step_ms": total}, text)
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
