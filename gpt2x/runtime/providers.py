"""ONNX Runtime sessions on exactly the asked execution provider, and which providers really load."""

from __future__ import annotations

import functools
import os
import platform
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import onnxruntime as ort

from ..choices import Precision, ProviderKind
from ..errors import ArtifactError, ProviderError, UsageError
from ..onnx import names as io
from ..onnx.artifact import IR_VERSION, ExportInfo, weights_beside
from ..onnx.graph_cache import InMemoryGraph, kept_or_made
from ..onnx.mapped import mapped_model, parse_model

if TYPE_CHECKING:  # a session on an export imports no onnx (onnx/wire.py says why); the small graphs here do
    import onnx

ORT_PROVIDERS = {ProviderKind.cpu: "CPUExecutionProvider", ProviderKind.cuda: "CUDAExecutionProvider"}
CUDA_HELP = (
    "onnxruntime-gpu needs an NVIDIA GPU with the CUDA and cuDNN 9 libraries of its release "
    "(CUDA 13 for 1.31) on the library path; `gpt2x info` shows which providers load"
)

# What `gpt2x bench` measures by default: fp16's kernels are CUDA's, int8's weight-only MatMuls the CPU's.
DEFAULT_PRECISIONS = {
    ProviderKind.cpu: (Precision.fp32, Precision.int8),
    ProviderKind.cuda: (Precision.fp32, Precision.fp16),
}


def default_precisions(provider: ProviderKind) -> list[Precision]:
    """The precisions to run on `provider` when none are named."""
    return list(DEFAULT_PRECISIONS[ProviderKind(provider)])


def physical_cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


# x86 features with which MLAS's uint8 x int8 kernels sum products in 32 bits; without them (AVX2 alone) pairs of
# products are summed in 16 bits, which full-range int8 weights overflow (docs/export.md, the batched decode graph).
INT8_DOT_FLAGS = ("avx512_vnni", "avx_vnni", "amx_int8")


# x86 features whose fp32 kernels are twice AVX2's width (cpu_mixed_chunk_base).
FP32_WIDE_FLAGS = ("avx512f",)


def x86_flags() -> frozenset[str] | None:
    """An x86 CPU's flags (/proc/cpuinfo's first `flags` line; empty where they cannot be read), None on another
    architecture."""
    if platform.machine().lower() not in ("x86_64", "amd64", "i386", "i686"):
        return None
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return frozenset()
    return frozenset(next((line.split(":", 1)[1].split() for line in text.splitlines() if line.startswith("flags")), []))


@functools.cache
def cpu_sums_int8_in_32_bits() -> bool:
    """Whether MLAS's uint8 x int8 kernels sum products in 32 bits here: an x86 CPU with VNNI or AMX (/proc/cpuinfo),
    or another architecture (ARM's int8 dot products do not saturate). False on an x86 CPU whose flags cannot be read."""
    flags = x86_flags()
    return flags is None or any(flag in flags for flag in INT8_DOT_FLAGS)


# A joiners' chunk where it runs in a decode step's forward (the fixed slots): this many tokens and one more per row
# running. A chunk's tokens cost the step about what as many rows would, and a decode step's cost grows with its rows,
# so the chunk grows with them, keeping the step within about 2.5 times a decode step's time. 545-token prompts joining
# 1.5 a second on the 2-core Xeon (int8; scratch, one round each): ITL p99 2.24x its median at 24 + rows (first token
# 547 ms), 3.19x at a fixed 32 (432 ms), 1.51x at 16 + rows (1017 ms); 9.9x in place with 256 (244 ms).
MIXED_PREFILL_CHUNK = 24
# The same on an x86 CPU without the precision's wide kernels, where a prompt's token costs several times more beside the
# weights a decode step reads. 545-token prompts joining 0.5 a second on a 2-core AMD EPYC with AVX2 alone: int8 (no
# VNNI) ITL p99 5.2x its median at 24 + rows, 3.1x at 12, 1.7x at 8 (first token 1157, 1265, 1566 ms); fp32 (no
# AVX-512) 3.2x at 24, 2.2x at 20 (1391, 1530 ms): scratch, then benchmarks/results/engine-joins-*-epyc-avx2-*.
INT8_NARROW_MIXED_PREFILL_CHUNK = 8  # int8's and int4's weights (MatMulNBits at accuracy level 4: int8 products)
FP32_NARROW_MIXED_PREFILL_CHUNK = 20


@functools.cache
def cpu_mixed_chunk_base(precision: Precision) -> int:
    """MIXED_PREFILL_CHUNK, or on an x86 CPU without `precision`'s wide kernels (int8 and int4: VNNI or AMX; fp32 and
    the rest: AVX-512) its narrow base: chosen by the CPU's flags, never by a timing."""
    flags = x86_flags()
    if flags is None:
        return MIXED_PREFILL_CHUNK
    if Precision(precision) in (Precision.int8, Precision.int4):
        return MIXED_PREFILL_CHUNK if any(f in flags for f in INT8_DOT_FLAGS) else INT8_NARROW_MIXED_PREFILL_CHUNK
    return MIXED_PREFILL_CHUNK if any(f in flags for f in FP32_WIDE_FLAGS) else FP32_NARROW_MIXED_PREFILL_CHUNK


# How long ONNX Runtime's intra-op threads spin after a run, waiting for the next (its session option). Its own default
# spins long enough to hold a core while OpenVINO's prefill runs right after a decode step (a 32-token first token in
# 28 against 18 ms); 1 ms still covers the host's work between decode steps (benchmarks/results/ort-spin-*).
SPIN_ENV = "GPT2X_ORT_SPIN_US"  # microseconds, or "default": ONNX Runtime's own
SPIN_US = 1000
SPIN_KEY = "session.intra_op.spin_duration_us"


def spin_duration_us() -> int | None:
    """The intra-op spin after a run, in microseconds: GPT2X_ORT_SPIN_US's, else SPIN_US; None for "default" (ONNX
    Runtime's own). One UsageError line for another value."""
    value = os.environ.get(SPIN_ENV)
    if value is None:
        return SPIN_US
    if value == "default":
        return None
    if not value.isdigit():
        raise UsageError(f"{SPIN_ENV} must be a whole number of microseconds or 'default', got {value!r}")
    return int(value)


def session_options(threads: int | None = None):
    so = ort.SessionOptions()
    so.intra_op_num_threads = threads or physical_cores()
    spin = spin_duration_us()
    if spin is not None:
        so.add_session_config_entry(SPIN_KEY, str(spin))
    so.inter_op_num_threads = 1
    so.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    so.log_severity_level = 3  # errors only: warnings about fallbacks are checked for explicitly
    return so


def create_session(model_path, provider: ProviderKind, threads: int | None = None, provider_options: dict | None = None,
                   weights: dict[str, np.ndarray] | None = None, dims: dict[str, int] | None = None):
    """An InferenceSession on exactly the asked provider: refuses ONNX Runtime's silent CPU fallback. `weights`: the
    arrays of a graph whose initializers say they are held outside it (onnx.graph_cache.InMemoryGraph), which ONNX
    Runtime copies into the session (AddExternalInitializers' contract): the caller may let them go. `dims`: symbolic
    dimensions fixed (a fixed-shape graph's shape computations fold away)."""
    name = ORT_PROVIDERS[provider]
    if name not in ort.get_available_providers():
        raise ProviderError(f"ONNX Runtime {ort.__version__} here has no {name}; {CUDA_HELP}")
    ort.set_default_logger_severity(4)  # a failing provider is reported below, in one line
    ep_options = dict(provider_options or {})
    if provider is ProviderKind.cuda:
        # fp32 is computed in fp32: ONNX Runtime's CUDA default, TF32 matmuls, misses the fp32 gate (1e-3 on an H100).
        ep_options.setdefault("use_tf32", "0")
    providers = [(name, ep_options)]
    if provider is ProviderKind.cuda:
        providers.append(("CPUExecutionProvider", {}))  # for the few shape ops ORT places there
    options = session_options(threads)  # a bad GPT2X_ORT_SPIN_US is its own error, not the graph's
    try:
        model = model_path if isinstance(model_path, bytes) else str(model_path)
        for dim, size in (dims or {}).items():
            options.add_free_dimension_override_by_name(dim, size)
        values = [ort.OrtValue.ortvalue_from_numpy(a) for a in (weights or {}).values()]
        if weights:
            options.add_external_initializers(list(weights), values)
        sess = ort.InferenceSession(model, sess_options=options, providers=providers)
    except Exception as e:  # ORT raises its own Fail/InvalidGraph/... types for unreadable models
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        where = "a graph made in memory" if isinstance(model_path, bytes) else model_path
        raise ArtifactError(f"ONNX Runtime cannot load {where}: {first}") from None
    if sess.get_providers()[0] != name:
        raise ProviderError(
            f"{name} failed to load (ONNX Runtime fell back to {sess.get_providers()[0]}); {CUDA_HELP}"
        )
    return sess


def create_export_session(path: Path, provider: ProviderKind, threads: int | None = None,
                          transform: Callable[[onnx.ModelProto], None] | None = None, key: str | None = None):
    """create_session on an export's graph file; on the CPU, unless its weights are in a data file, with its weights
    handed to ONNX Runtime from the mapped file (onnx.mapped), not parsed by protobuf first (the cold start it saves:
    docs/export.md); ONNX Runtime copies them into the session, so the mapping goes when this returns. `transform`: a
    rewrite of the graph in place before the session (its weights kept as they are; the CPU, weights in the file only),
    kept on disk under `key` for the next process (onnx.graph_cache: it then imports no onnx)."""
    path = Path(path)
    if provider is ProviderKind.cpu and not weights_beside(path):
        data, weights = mapped_model(path)
        if transform is None:
            return create_session(data, provider, threads, weights=weights)

        def make() -> tuple[InMemoryGraph]:
            proto = parse_model(data, path)
            transform(proto)
            names = {t.name for t in proto.graph.initializer}
            return (InMemoryGraph(proto.SerializeToString(), {n: w for n, w in weights.items() if n in names}, {}),)

        [graph] = kept_or_made([key], weights, make)
        return create_session(graph.graph, provider, threads, weights=graph.weights)
    if transform is not None:
        raise ProviderError(f"{path}: a graph rewritten in memory runs on the CPU, its weights in the graph's file")
    return create_session(path, provider, threads)


def gather_model(dtype) -> bytes:
    from onnx import TensorProto, helper  # building a graph: onnx's

    t = TensorProto.FLOAT16 if dtype == np.float16 else TensorProto.FLOAT
    graph = helper.make_graph(
        [helper.make_node("Gather", ["x", "rows"], ["y"], axis=0)], "reorder",
        [helper.make_tensor_value_info("x", t, None), helper.make_tensor_value_info("rows", TensorProto.INT64, ["n"])],
        [helper.make_tensor_value_info("y", t, None)],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    model.ir_version = IR_VERSION
    return model.SerializeToString()


def slice_positions_model(dtype) -> bytes:
    """A graph keeping a cache tensor's first `length` positions: a growing cache's rollback on CUDA."""
    from onnx import TensorProto, helper  # building a graph: onnx's

    t = TensorProto.FLOAT16 if dtype == np.float16 else TensorProto.FLOAT
    graph = helper.make_graph(
        [helper.make_node("Slice", ["x", "starts", "ends", "axes"], ["y"])], "truncate",
        [helper.make_tensor_value_info("x", t, None), helper.make_tensor_value_info("ends", TensorProto.INT64, [1])],
        [helper.make_tensor_value_info("y", t, None)],
        [helper.make_tensor("starts", TensorProto.INT64, [1], [0]), helper.make_tensor("axes", TensorProto.INT64, [1], [2])],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    model.ir_version = IR_VERSION
    return model.SerializeToString()


def last_argmax_model() -> bytes:
    """Logits (B, T, V) to each row's argmax at its last position (B, 1), the first of equal maxima as NumPy's."""
    from onnx import TensorProto, helper  # building a graph: onnx's

    graph = helper.make_graph(
        [helper.make_node("Slice", ["x", "starts", "ends", "axes"], ["last"]),
         helper.make_node("ArgMax", ["last"], ["y3"], axis=2, keepdims=0, select_last_index=0),
         helper.make_node("Reshape", ["y3", "shape"], ["y"])], "last_argmax",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", "sequence", "vocab"])],
        [helper.make_tensor_value_info("y", TensorProto.INT64, ["batch", 1])],
        [helper.make_tensor("starts", TensorProto.INT64, [1], [-1]), helper.make_tensor("ends", TensorProto.INT64, [1], [2**62]),
         helper.make_tensor("axes", TensorProto.INT64, [1], [1]), helper.make_tensor("shape", TensorProto.INT64, [2], [-1, 1])],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    model.ir_version = IR_VERSION
    return model.SerializeToString()


def available_providers() -> dict[str, Any]:
    """Providers ONNX Runtime lists, and whether each really loads (a one-node session)."""
    listed = ort.get_available_providers()
    loadable = {}
    for kind, name in ORT_PROVIDERS.items():
        if name not in listed:
            loadable[kind.value] = "not in this build"
            continue
        try:
            create_session(gather_model(np.float32), kind)
            loadable[kind.value] = "ok"
        except ProviderError as e:
            loadable[kind.value] = str(e)
    return {"listed": listed, "loadable": loadable}


def refuse_fp16_on_cpu(info: ExportInfo, provider: ProviderKind,
                       hint: str = "run it on the cuda provider, or export fp32, int8 or int4 for the CPU") -> None:
    """fp16 exports run on CUDA only (their kernels are the GPU's): one ProviderError, with `hint`."""
    if info.precision is Precision.fp16 and provider is ProviderKind.cpu:
        raise ProviderError(f"{info.folder} is an fp16 export, which gpt2x runs on CUDA only ({hint})")


def bind_past_and_present(binding, values: list) -> None:
    """Each layer's K and V OrtValue in `values` (the io.input_names order) bound as its past and its present: the same
    buffers, written in place by GroupQueryAttention."""
    n_layer = len(values) // 2
    for name, value in zip(io.input_names(n_layer)[3:], values):
        binding.bind_ortvalue_input(name, value)
    for name, value in zip(io.output_names(n_layer)[1:], values):
        binding.bind_ortvalue_output(name, value)


def batched_from(info: ExportInfo, asked: bool | None, on_cpu: bool) -> int | None:
    """The rows x new tokens from which a step runs on the export's batched decode graph (None: never): the record's
    batched_from (where it timed the graph faster from there on), 1 where asked for (refused in one line where the
    export has none, or off the CPU), None where refused."""
    if asked is False:
        return None
    record = info.batched
    # An export made before its weights kept 7 bits, run on a CPU whose kernel would overflow them: gated where it was
    # made, wrong here (0.42 of the logits' scale off, measured), so never run.
    overflows = record is not None and record.get("weight_bits", 8) > 7 and not cpu_sums_int8_in_32_bits()
    if asked:
        if record is None or not on_cpu or overflows:
            why = "it has none (an int8 export has one unless GPT2X_BATCHED_DECODE=0 or its gate dropped it)" \
                if record is None else "it runs on the CPU only" if not on_cpu else \
                "its 8-bit weights overflow this CPU's int8 kernel (no VNNI); export it again, in 7 bits"
            raise ProviderError(f"{info.folder}: cannot run steps on a batched decode graph: {why}")
        return 1
    return record.get("batched_from") if record is not None and on_cpu and not overflows else None
