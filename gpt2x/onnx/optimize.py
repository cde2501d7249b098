"""Graph optimisation after tracing: fusion, fp16, int8 and int4 weights (MatMulNBits), and the GroupQueryAttention
rewrite of the CPU precisions. ONNX files alone, no torch (but for HQQ int4, not the default). The choices and
their measurements: docs/export.md."""

from __future__ import annotations

import contextlib
import logging
import os
import tempfile
from collections import Counter
from io import StringIO
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from ..choices import Precision
from ..model.config import GPT2Config
from ..numerics import CDF_BLOCK
from . import names as io
from .artifact import INT4_BLOCK, INT4_HEAD_BITS, INT8_BLOCK, IR_VERSION, attention_layout, save_onnx, weights_beside
from .graph_cache import InMemoryGraph
from .mapped import load_mapped
from .names import GQA, MSFT

FUSED_OPS = ("MultiHeadAttention", "GroupQueryAttention", "Attention", "SkipLayerNormalization", "FastGelu", "BiasGelu",
             "Gelu", "EmbedLayerNormalization", "MatMulNBits", "MatMulInteger", "DynamicQuantizeMatMul")



def fuse(raw: onnx.ModelProto | Path, out: Path, cfg: GPT2Config, precision: Precision) -> dict[str, int]:
    """ONNX Runtime's transformer optimizer (SkipLayerNormalization, FastGelu; attention is already
    MultiHeadAttention), then fp16 conversion, into `out`. `raw`: the traced graph, or its file where its
    weights are in a data file beside it. Returns the fused operator counts."""
    from onnxruntime.transformers.onnx_model import OnnxModel
    from onnxruntime.transformers.optimizer import optimize_model

    data = raw.with_name(raw.name + ".data") if isinstance(raw, Path) else None
    if data is not None and data.exists():
        # Past 2 GB, the graph is fused alone (the fusions read a few constants) and keeps the data file:
        # the weights held three times (torch, graph, optimizer) ran gpt2-xl out of memory.
        proto = onnx.load(str(raw), load_external_data=False)
        # numpy_helper resolves external data against the working directory.
        with _working_dir(raw.parent):
            opt = optimize_model(proto, model_type="gpt2", num_heads=cfg.n_head, hidden_size=cfg.n_embd, opt_level=0)
        os.replace(data, out.with_name(out.name + ".data"))
        for tensor in opt.model.graph.initializer:
            for entry in tensor.external_data:
                if entry.key == "location":
                    entry.value = out.name + ".data"
        keep_last_logits(opt.model)
        opt.model.ir_version = IR_VERSION
        onnx.save_model(opt.model, str(out))
        if precision is not Precision.fp16:
            return count_ops(opt.model)
        opt = OnnxModel(onnx.load(str(out)))  # the fp16 conversion needs the weights themselves
        out.with_name(out.name + ".data").unlink()  # rewritten below only if fp16 still passes 2 GB
    else:
        opt = optimize_model(str(raw) if isinstance(raw, Path) else raw, model_type="gpt2", num_heads=cfg.n_head, hidden_size=cfg.n_embd, opt_level=0)
    if precision is Precision.fp16:
        # Logits stay fp32 for the sampler; the KV cache is fp16; the kernels keep LayerNorm and softmax in fp32.
        opt.convert_float_to_float16(keep_io_types=[io.LOGITS], use_symbolic_shape_infer=True)
    keep_last_logits(opt.model)
    opt.model.ir_version = IR_VERSION
    save_onnx(opt.model, out)
    return count_ops(opt.model)


def logits_producer(proto: onnx.ModelProto) -> onnx.NodeProto:
    """The unembedding: the MatMul (or MatMulNBits) whose output is the logits, or is cast to them."""
    producer = {o: n for n in proto.graph.node for o in n.output if o}
    node = producer.get(io.LOGITS)
    if node is not None and node.op_type == "Cast":  # fp16 graphs: fp16 logits cast to fp32
        node = producer.get(node.input[0])
    if node is None or node.op_type not in ("MatMul", "MatMulNBits"):
        raise ValueError("no MatMul produces the logits")
    return node


def keep_last_logits(proto: onnx.ModelProto) -> None:
    """Give the unembedding the optional input `logits_to_keep` (0 = every position). An initializer listed as an
    input, i.e. an overridable default: loaders that do not feed it see no change. Idempotent."""
    graph = proto.graph
    if any(i.name == io.LOGITS_TO_KEEP for i in graph.input):
        return
    unembed = logits_producer(proto)
    hidden = unembed.input[0]  # (B, T, C)
    kept = "logits_to_keep_hidden"  # (B, min(k, T) or T, C)
    graph.initializer.extend([
        helper.make_tensor(io.LOGITS_TO_KEEP, TensorProto.INT64, [], [0]),
        helper.make_tensor("logits_to_keep_axis", TensorProto.INT64, [1], [0]),
        helper.make_tensor("logits_to_keep_axes", TensorProto.INT64, [1], [1]),
        helper.make_tensor("logits_to_keep_end", TensorProto.INT64, [1], [2**63 - 1]),
    ])
    graph.input.append(helper.make_tensor_value_info(io.LOGITS_TO_KEEP, TensorProto.INT64, []))
    # Slice(hidden, starts=-k, ends=end, axes=1): k = 0 starts at 0 (every position), k >= T too.
    prelude = [
        helper.make_node("Neg", [io.LOGITS_TO_KEEP], ["logits_to_keep_neg"], name="logits_to_keep_neg"),
        helper.make_node("Unsqueeze", ["logits_to_keep_neg", "logits_to_keep_axis"], ["logits_to_keep_start"],
                         name="logits_to_keep_start"),
        helper.make_node("Slice", [hidden, "logits_to_keep_start", "logits_to_keep_end", "logits_to_keep_axes"], [kept],
                         name="logits_to_keep_slice"),
    ]
    nodes = list(graph.node)
    at = nodes.index(unembed)
    unembed.input[0] = kept
    del graph.node[:]
    graph.node.extend(nodes[:at] + prelude + nodes[at:])


@contextlib.contextmanager
def _working_dir(path: Path):
    before = os.getcwd()
    os.chdir(path)
    try:
        yield
    finally:
        os.chdir(before)


def fold_transposed_initializers(proto: onnx.ModelProto) -> None:
    """Transpose(initializer) -> a transposed initializer, so the tied unembedding (x @ wte^T) is a
    MatMul with a constant B that dynamic quantization can quantize."""
    inits = {t.name: t for t in proto.graph.initializer}
    keep = []
    for node in proto.graph.node:
        if node.op_type == "Transpose" and node.input[0] in inits:
            perm = next((list(a.ints) for a in node.attribute if a.name == "perm"), None)
            arr = numpy_helper.to_array(inits[node.input[0]])
            proto.graph.initializer.append(numpy_helper.from_array(arr.transpose(perm).copy(), node.output[0]))
        else:
            keep.append(node)
    del proto.graph.node[:]
    proto.graph.node.extend(keep)


NBITS_LOGGERS = ("onnxruntime.quantization.matmul_nbits_quantizer", "neural_compressor")


def _load_folded(fused: Path) -> onnx.ModelProto:
    """The fused graph with the tied unembedding as a MatMul with a constant weight."""
    proto = onnx.load(str(fused))
    fold_transposed_initializers(proto)
    return proto


def _finish_nbits(q: onnx.ModelProto, out: Path) -> dict[str, int]:
    """GroupQueryAttention (after quantizing: ONNX Runtime's k-quant path re-sorts the graph and
    would lose GroupQueryAttention's optional inputs), then write the graph."""
    mha_to_gqa(q)
    q.ir_version = IR_VERSION
    save_onnx(q, out)
    return count_ops(q)


def _matmul_nbits(proto: onnx.ModelProto, exclude: frozenset[str] = frozenset(), **options) -> onnx.ModelProto:
    """ONNX Runtime's MatMulNBitsQuantizer over every MatMul with a constant weight, except the nodes
    named in `exclude`; `options` go to the quantizer (bits, block_size, algo_config, ...)."""
    MatMulNBitsQuantizer = nbits_quantizer_module().MatMulNBitsQuantizer
    loggers = [logging.getLogger(name) for name in NBITS_LOGGERS]
    levels = [logger.level for logger in loggers]
    for logger in loggers:
        logger.setLevel(logging.WARNING)  # they log every node at INFO
    try:
        # the k-quant path also draws a progress bar on stdout, which would corrupt JSON output
        with contextlib.redirect_stdout(StringIO()):
            quantizer = MatMulNBitsQuantizer(proto, nodes_to_exclude=sorted(exclude), **options)
            quantizer.process()
    finally:
        for logger, level in zip(loggers, levels):
            logger.setLevel(level)
    return quantizer.model.model


def _int8_options() -> dict:
    return {"bits": 8, "block_size": INT8_BLOCK, "is_symmetric": True, "accuracy_level": 4}


def quantize_int8(fused: Path, out: Path) -> dict[str, int]:
    """int8 MatMulNBits weights (symmetric, blocks of 128, int8 activations), the tied unembedding too (every step
    reads it whole); GroupQueryAttention for the in-place KV cache."""
    return _finish_nbits(_matmul_nbits(_load_folded(fused), **_int8_options()), out)


@contextlib.contextmanager
def _root_logger_quiet():
    """The quantizer warns through logging.warning, whose first call on a root logger without handlers installs
    one (basicConfig) for the rest of the process: a handler held meanwhile, and the level raised."""
    root = logging.getLogger()
    hold, level = logging.NullHandler(), root.level
    root.addHandler(hold)
    root.setLevel(logging.ERROR)
    try:
        yield
    finally:
        root.removeHandler(hold)
        root.setLevel(level)


def quantize_int8_dynamic(fused: Path, out: Path) -> dict[str, int]:
    """int8 weights by ONNX Runtime's quantize_dynamic: one scale per output channel, activations quantized per step
    (MLAS's u8s8 QGEMM: faster than MatMulNBits from ~16 rows a step, slower at one; docs/results/engines.md), the
    tied unembedding too; GroupQueryAttention after, as quantize_int8's. The batched decode graph (build.py). Weights in
    7 bits (reduce_range): on a CPU without VNNI (AVX2 only) that kernel sums u8 x s8 pairs in int16, which full-range
    weights overflow (0.42 of the logits' scale off on an AVX2 EPYC, measured), and the file may run on any CPU."""
    from onnxruntime.quantization import QuantType, quantize_dynamic

    from .per_channel import per_channel_at_once

    # per_channel_at_once: the same weights as ORT's own loop over the channels, seconds sooner (per_channel.py)
    with tempfile.TemporaryDirectory() as tmp, _root_logger_quiet(), per_channel_at_once():
        src, dst = Path(tmp) / "folded.onnx", Path(tmp) / "quantized.onnx"
        # external data: the quantizer's own shape inference copies the graph, which protobuf caps at 2 GB
        onnx.save(_load_folded(fused), str(src), save_as_external_data=True, location="folded.onnx.data")
        # MatMulConstBOnly: activation x activation products (none here past attention's own op) stay fp32;
        # DefaultTensorType: the fused contrib ops' outputs have no inferred type, which the quantizer needs.
        quantize_dynamic(str(src), str(dst), op_types_to_quantize=["MatMul"], per_channel=True, weight_type=QuantType.QInt8,
                         reduce_range=True, extra_options={"MatMulConstBOnly": True, "DefaultTensorType": TensorProto.FLOAT})
        q = onnx.load(str(dst))
    return _finish_nbits(q, out)


# int4 defaults, by measured quality against PyTorch fp32 (docs/export.md's table): blocks of 32, RTN symmetric (keeps
# the packed int8-activation kernel, which HQQ's float zero points lose), the unembedding at 8 bits (4x lower KL).
INT4_ALGORITHMS = ("rtn-sym", "rtn-asym", "hqq", "k-quant")
INT4_ALGORITHM = "rtn-sym"


def unembedding_matmul(proto: onnx.ModelProto) -> onnx.NodeProto:
    """The MatMul that produces the logits: the tied unembedding x @ wte^T."""
    node = logits_producer(proto)
    if not node.name:
        node.name = "unembedding"  # the quantizer excludes nodes by name
    return node


def nbits_quantizer_module():
    """ORT's matmul_nbits_quantizer, imported with the root logger kept: its import calls basicConfig(level=INFO),
    after which every library's INFO records reached stderr for the rest of the process."""
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    from onnxruntime.quantization import matmul_nbits_quantizer

    for handler in [h for h in root.handlers if h not in handlers]:
        root.removeHandler(handler)
    root.setLevel(level)
    return matmul_nbits_quantizer


def _int4_options(algorithm: str, block_size: int) -> dict:
    module = nbits_quantizer_module()
    HQQWeightOnlyQuantConfig, KQuantWeightOnlyQuantConfig = module.HQQWeightOnlyQuantConfig, module.KQuantWeightOnlyQuantConfig

    if algorithm in ("rtn-sym", "rtn-asym"):  # ONNX Runtime's own round-to-nearest (its DEFAULT algorithm)
        return {"bits": 4, "block_size": block_size, "is_symmetric": algorithm == "rtn-sym", "accuracy_level": 4}
    if algorithm == "hqq":  # half-quadratic: asymmetric, float zero points fitted by a solver (uses torch)
        return {"algo_config": HQQWeightOnlyQuantConfig(block_size=block_size, bits=4)}
    if algorithm == "k-quant":  # llama.cpp's k-quant search of scale and minimum per block, asymmetric
        # (ONNX Runtime 1.31's k-quant fails on a matrix that is a single block deep, e.g. K = block = 128)
        return {"bits": 4, "block_size": block_size, "accuracy_level": 4, "algo_config": KQuantWeightOnlyQuantConfig()}
    raise ValueError(f"unknown int4 algorithm {algorithm!r} (one of {', '.join(INT4_ALGORITHMS)})")


def quantize_int4(fused: Path, out: Path, algorithm: str = INT4_ALGORITHM, block_size: int = INT4_BLOCK,
                  head_bits: int = INT4_HEAD_BITS) -> dict[str, int]:
    """4-bit MatMulNBits weights for the blocks, int8 activations, GroupQueryAttention. An 8-bit unembedding takes a
    second pass: the first excludes it by name, so the second finds it the only constant-weight MatMul left."""
    if head_bits not in (4, 8):
        raise ValueError(f"head_bits must be 4 or 8, not {head_bits}")
    proto = _load_folded(fused)
    head = unembedding_matmul(proto).name
    options = _int4_options(algorithm, block_size)
    q = _matmul_nbits(proto, exclude=frozenset({head}) if head_bits == 8 else frozenset(), **options)
    if head_bits == 8:
        q = _matmul_nbits(q, **_int8_options())
    for node in q.graph.node:  # HQQ writes no accuracy_level (and ONNX Runtime ignores it for float zero points)
        if node.op_type == "MatMulNBits" and not any(a.name == "accuracy_level" for a in node.attribute):
            node.attribute.append(helper.make_attribute("accuracy_level", 4))
    return _finish_nbits(q, out)


def count_ops(proto: onnx.ModelProto) -> dict[str, int]:
    counts = Counter(n.op_type for n in proto.graph.node)
    return {op: counts[op] for op in FUSED_OPS if counts[op]} | {"total_nodes": len(proto.graph.node)}


# ---------------------------------------------------------------- GroupQueryAttention (int8 and int4, CPU)

_GQA_SEQLENS = "gqa_seqlens_k"  # int32 [batch]: total_sequence_length - 1 for every row
_GQA_TOTAL = "gqa_total_sequence_length"  # int32 scalar: the attention mask's width


def mha_to_gqa(proto: onnx.ModelProto) -> int:
    """Replace every MultiHeadAttention by GroupQueryAttention (kv heads = heads) in place; returns the count. The
    graph's I/O stay; it reads the packed QKV (the Split goes) and the same additive mask, and may write its
    present into the past's buffers (the in-place KV cache, docs/export.md)."""
    graph = proto.graph
    producer = {o: n for n in graph.node for o in n.output if o}
    consumers: dict[str, int] = {}
    for n in graph.node:
        for i in n.input:
            consumers[i] = consumers.get(i, 0) + 1
    replaced, dropped, nodes = 0, set(), []
    for n in graph.node:
        if n.op_type != "MultiHeadAttention" or n.domain != MSFT:
            nodes.append(n)
            continue
        split = producer.get(n.input[0])
        if split is None or split.op_type != "Split" or list(split.output) != list(n.input[:3]) or \
                any(consumers.get(o, 0) != 1 for o in split.output):
            raise ValueError(f"{n.name}: query/key/value do not come from one Split of a packed QKV projection")
        attrs = {a.name: helper.get_attribute_value(a) for a in n.attribute}
        heads = attrs["num_heads"]
        bias = n.input[5] if len(n.input) > 5 else ""
        past_k, past_v = (n.input[6], n.input[7]) if len(n.input) > 7 else ("", "")
        nodes.append(helper.make_node(
            GQA, [split.input[0], "", "", past_k, past_v, _GQA_SEQLENS, _GQA_TOTAL, "", "", "", bias],
            list(n.output), name=n.name.replace("mha", "gqa") or None, domain=MSFT, num_heads=heads, kv_num_heads=heads,
        ))
        dropped.add(split.output[0])
        replaced += 1
    if not replaced:
        return 0
    prelude = [
        helper.make_node("Shape", [io.ATTENTION_MASK], ["gqa_mask_shape"]),
        helper.make_node("Gather", ["gqa_mask_shape", "gqa_i64_0"], ["gqa_batch"], axis=0),
        helper.make_node("Gather", ["gqa_mask_shape", "gqa_i64_1"], ["gqa_total_i64"], axis=0),
        helper.make_node("Cast", ["gqa_total_i64"], [_GQA_TOTAL], to=TensorProto.INT32),
        helper.make_node("Sub", [_GQA_TOTAL, "gqa_i32_1"], ["gqa_last"]),
        helper.make_node("Unsqueeze", ["gqa_batch", "gqa_axis_0"], ["gqa_batch_1d"]),
        helper.make_node("Expand", ["gqa_last", "gqa_batch_1d"], [_GQA_SEQLENS]),
    ]
    graph.initializer.extend([
        helper.make_tensor("gqa_i64_0", TensorProto.INT64, [], [0]),
        helper.make_tensor("gqa_i64_1", TensorProto.INT64, [], [1]),
        helper.make_tensor("gqa_i32_1", TensorProto.INT32, [], [1]),
        helper.make_tensor("gqa_axis_0", TensorProto.INT64, [1], [0]),
    ])
    del graph.node[:]
    graph.node.extend(prelude + [n for n in nodes if not (n.op_type == "Split" and n.output[0] in dropped)])
    return replaced




def in_place_form(path: Path) -> InMemoryGraph | None:
    """A MultiHeadAttention graph's GroupQueryAttention twin (mha_to_gqa) in memory, for the in-place KV cache on
    ONNX Runtime's CPU provider (whose GroupQueryAttention runs fp32; its CUDA kernels do not), without a second
    file in the export. The weights are not serialized again: they go to ONNX Runtime as arrays. None where the
    graph keeps its weights in a data file beside it (past 2 GB), or has no MultiHeadAttention."""
    loaded = _gqa_proto(path, require_rewrite=True)
    return None if loaded is None else _in_memory(*loaded)


def static_forms(path: Path, sampling: bool = False, logits: bool = False, steps: bool = False,
                 padded: bool = False) -> tuple[InMemoryGraph, InMemoryGraph] | None:
    """The export's two graphs for StaticDecoder, from one read of its file, their weights shared:
    - the prompt's: its GroupQueryAttention graph (the export's, or its twin) without the attention bias, for prompts
      without padding (the operator's own causal mask suffices), which lets ONNX Runtime's CUDA kernels take their
      fastest path; `padded`: with it, for left-padded prompts of several lengths in one forward (the CPU's slots);
    - the one-token decode step with every shape fixed, for a step captured in a CUDA graph (to_static_decode): its
      lengths read from the inputs seqlens_k (on the device) and total_sequence_length (the cache's capacity,
      constant) instead of the attention mask, which goes (rows hold no padding), and each row's argmax (next_token)
      returned instead of the logits; `sampling`: each row's draw at its temperature instead (sampling_head); `logits`:
      the logits themselves, for a sampler on the host (runtime.static_decode.SlotDecoder's serving rows); `steps`:
      the step that advances its own positions and keeps its tokens (with_device_steps).
    None where the weights are in a data file, or the graph has no attention to rewrite."""
    loaded = _gqa_proto(path, require_rewrite=False)
    if loaded is None:
        return None
    prefill, weights = loaded
    decode = onnx.ModelProto()
    decode.CopyFrom(prefill)  # the graph alone: its large weights are in `weights`
    if not padded:
        _drop_attention_bias(prefill.graph)
        _prune(prefill.graph)
    to_static_decode(decode, sampling, logits, steps)
    return _in_memory(prefill, weights), _in_memory(decode, weights)


def _gqa_proto(path: Path, require_rewrite: bool) -> tuple[onnx.ModelProto, dict[str, np.ndarray]] | None:
    """The export's graph with GroupQueryAttention (rewritten where it has MultiHeadAttention) and its large weights
    as arrays (onnx.mapped: no copy through protobuf), or None."""
    path = Path(path)
    if weights_beside(path):
        return None
    proto, weights = load_mapped(path)
    rewritten = mha_to_gqa(proto)
    if require_rewrite and not rewritten:
        return None
    if not any(n.op_type == GQA for n in proto.graph.node):
        return None
    return proto, weights


def to_static_decode(proto: onnx.ModelProto, sampling: bool = False, logits: bool = False, steps: bool = False) -> None:
    """In place: the decode graph of static_forms. Input ids become [batch, 1]; position ids are computed from
    seqlens_k. Its output: next_token (the argmax, or with `sampling` the draw), or with `logits` the logits; `steps`:
    with_device_steps's I/O too."""
    if sampling and logits:
        raise ValueError("a decode graph returns the logits or a token chosen from them, not both")
    if steps and logits:
        raise ValueError("a step that keeps its tokens on the device chooses them: not with logits")
    graph = proto.graph
    _drop_attention_bias(graph)
    for n in graph.node:
        if n.op_type == GQA and n.domain == MSFT:
            n.input[5], n.input[6] = io.SEQLENS_K, io.TOTAL_SEQUENCE_LENGTH
    # logits_to_keep becomes a constant; each row's new position is its seqlens_k (no padding): one input less to write
    kept = [i for i in graph.input if i.name not in (io.ATTENTION_MASK, io.LOGITS_TO_KEEP, io.POSITION_IDS)]
    for i in kept:
        if i.name == io.INPUT_IDS:
            i.type.tensor_type.shape.dim[1].Clear()
            i.type.tensor_type.shape.dim[1].dim_value = 1
    graph.initializer.append(helper.make_tensor("static_axis_1", TensorProto.INT64, [1], [1]))
    graph.node.insert(0, helper.make_node("Unsqueeze", [io.SEQLENS_K, "static_axis_1"], ["static_seqlens_2d"]))
    graph.node.insert(1, helper.make_node("Cast", ["static_seqlens_2d"], [io.POSITION_IDS], to=TensorProto.INT64))
    del graph.input[:]
    graph.input.extend(kept + [
        helper.make_tensor_value_info(io.SEQLENS_K, TensorProto.INT32, [io.BATCH]),
        helper.make_tensor_value_info(io.TOTAL_SEQUENCE_LENGTH, TensorProto.INT32, [1]),
    ])
    if sampling:
        graph.input.append(helper.make_tensor_value_info(io.TEMPERATURE, TensorProto.DOUBLE, [io.BATCH]))
        if not steps:  # with steps, each step's uniform is taken from the block's (with_device_steps)
            graph.input.append(helper.make_tensor_value_info(io.UNIFORM, TensorProto.DOUBLE, [io.BATCH]))
        graph.node.extend(sampling_head(graph))
    elif not logits:
        graph.node.append(helper.make_node("ArgMax", [io.LOGITS], [io.NEXT_TOKEN], axis=-1, keepdims=0))
    outputs = list(graph.output) if logits else \
        [helper.make_tensor_value_info(io.NEXT_TOKEN, TensorProto.INT64, [io.BATCH, 1])] + [o for o in graph.output if o.name != io.LOGITS]
    del graph.output[:]
    graph.output.extend(outputs)
    if steps:
        with_device_steps(graph, sampling)
    _prune(graph)


def with_device_steps(graph: onnx.GraphProto, sampling: bool) -> None:
    """In place, on a decode graph of to_static_decode: the step advances its own positions and keeps its tokens, so
    that a block of steps replays with nothing written or read by the host between them (runtime.static_decode.
    StaticDecoder.steps). Its next_token is written into `tokens` at column `step`; seqlens_k_next = seqlens_k + 1 and
    step_next = step + 1, each bound by the caller to its input's buffer. A value is written over its input only
    after its last read: the increments add a one computed from the tokens written last, so no order of execution
    can advance a length before the attention has read it (10 small nodes a step). With `sampling`, the step's
    uniform is column `step` of the block's uniforms."""
    i64, i32 = TensorProto.INT64, TensorProto.INT32

    def const(name: str, dtype: int, dims: list[int], values: list) -> str:
        graph.initializer.append(helper.make_tensor(name, dtype, dims, values))
        return name

    f32 = TensorProto.FLOAT
    zero, one = const("steps_zero", f32, [], [0.0]), const("steps_one", f32, [], [1.0])
    rows_by_one = const("steps_rows_by_one", i64, [2], [-1, 1])
    n = helper.make_node
    head = [  # first (the graph is sorted): the sampling head reads the uniform made here
        # [batch, 1]: this step's column, every row
        n("Shape", [io.SEQLENS_K], ["steps_batch"]),
        n("Concat", ["steps_batch", const("steps_one_dim", i64, [1], [1])], ["steps_index_shape"], axis=0),
        n("Expand", [io.STEP, "steps_index_shape"], ["steps_index"]),
    ]
    if sampling:
        graph.input.append(helper.make_tensor_value_info(io.UNIFORMS, TensorProto.DOUBLE, [io.BATCH, io.STEPS]))
        head += [n("GatherElements", [io.UNIFORMS, "steps_index"], ["steps_uniform"], axis=1),
                 n("Reshape", ["steps_uniform", const("steps_flat", i64, [1], [-1])], [io.UNIFORM])]
    # Both increments' 1 is a value of the tensor written last, the tokens (0 times their sum, plus 1), which follow
    # next_token, which follows every read of seqlens_k; the step's index is read by the scatter that writes them.
    tail = [
        n("Reshape", [io.NEXT_TOKEN, rows_by_one], ["steps_next_token"]),
        n("ScatterElements", [io.TOKENS, "steps_index", "steps_next_token"], [io.TOKENS_NEXT], axis=1),
        # in float: every execution provider reduces it (an int64 reduction may leave CUDA for the CPU, which a
        # captured graph cannot hold); the sum, however rounded, is finite, so 0 times it is 0
        n("Cast", [io.TOKENS_NEXT], ["steps_tokens_f"], to=f32),
        n("ReduceSum", ["steps_tokens_f"], ["steps_tokens_sum"], keepdims=0),
        n("Mul", ["steps_tokens_sum", zero], ["steps_tokens_zero"]),
        n("Add", ["steps_tokens_zero", one], ["steps_after_tokens_f"]),
        n("Cast", ["steps_after_tokens_f"], ["steps_after_tokens"], to=i64),
        n("Add", [io.STEP, "steps_after_tokens"], [io.STEP_NEXT]),
        n("Cast", ["steps_after_tokens_f"], ["steps_after_tokens_32"], to=i32),
        n("Add", [io.SEQLENS_K, "steps_after_tokens_32"], [io.SEQLENS_K_NEXT]),
    ]
    for k, x in enumerate(head):
        graph.node.insert(k, x)
    graph.node.extend(tail)
    graph.input.extend([helper.make_tensor_value_info(io.STEP, i64, [1]),
                        helper.make_tensor_value_info(io.TOKENS, i64, [io.BATCH, io.STEPS])])
    graph.output.extend([helper.make_tensor_value_info(io.TOKENS_NEXT, i64, [io.BATCH, io.STEPS]),
                         helper.make_tensor_value_info(io.SEQLENS_K_NEXT, i32, [io.BATCH]),
                         helper.make_tensor_value_info(io.STEP_NEXT, i64, [1])])


def sampling_head(graph: onnx.GraphProto) -> list[onnx.NodeProto]:
    """Nodes from the logits [batch, 1, vocab] to next_token [batch, 1]: the sampler's draw (generation.sampling) on
    the device. Each row's logits over its temperature and their exponentials, then the host sampler's blocked
    inverse CDF in float64 as the host's (in float32 the running sum over 50,257 near-equal masses drifted by tokens):
    the block of CDF_BLOCK tokens where the running sum of the block sums reaches the row's uniform of its total, then
    the first token in it where the running sum does (the block's last token with mass where rounding leaves it a hair
    short). A row at temperature 0 takes the argmax."""
    vocab = next(o for o in graph.output if o.name == io.LOGITS).type.tensor_type.shape.dim[2].dim_value
    blocks = -(-vocab // CDF_BLOCK)

    def const(name: str, dtype: int, dims: list[int], values: list) -> str:
        graph.initializer.append(helper.make_tensor(name, dtype, dims, values))
        return name

    i64, f64 = TensorProto.INT64, TensorProto.DOUBLE
    axes12 = const("sample_axes_12", i64, [2], [1, 2])
    last = const("sample_last", i64, [], [-1])
    last_axes = const("sample_last_axes", i64, [1], [-1])  # opset 18: the reductions take axes as an input
    axis1 = const("sample_axis_1", i64, [1], [1])
    zero = const("sample_zero", f64, [], [0.0])
    n = helper.make_node
    return [
        n("Cast", [io.LOGITS], ["sample_logits"], to=f64),
        n("Max", [io.TEMPERATURE, const("sample_tiny", f64, [], [1e-6])], ["sample_t"]),  # a greedy row's 0 divides nothing
        n("Unsqueeze", ["sample_t", axes12], ["sample_t3"]),
        n("Div", ["sample_logits", "sample_t3"], ["sample_scaled"]),
        n("ReduceMax", ["sample_scaled", last_axes], ["sample_max"], keepdims=1),
        n("Sub", ["sample_scaled", "sample_max"], ["sample_shifted"]),
        n("Exp", ["sample_shifted"], ["sample_mass3"]),
        # [batch, vocab], zeros past the vocabulary to whole blocks, [batch, blocks, CDF_BLOCK]
        n("Reshape", ["sample_mass3", const("sample_rows", i64, [2], [0, vocab])], ["sample_mass"]),
        n("Pad", ["sample_mass", const("sample_pads", i64, [4], [0, 0, 0, blocks * CDF_BLOCK - vocab])], ["sample_padded"]),
        n("Reshape", ["sample_padded", const("sample_blocked", i64, [3], [0, blocks, CDF_BLOCK])], ["sample_blocks"]),
        n("ReduceSum", ["sample_blocks", last_axes], ["sample_block_mass"], keepdims=0),  # [batch, blocks]
        n("CumSum", ["sample_block_mass", last], ["sample_ends"]),  # the mass up to each block's end
        n("CumSum", ["sample_block_mass", last], ["sample_starts"], exclusive=1),  # ... and before its start
        n("ReduceMax", ["sample_ends", last_axes], ["sample_total"], keepdims=1),  # [batch, 1]
        n("Unsqueeze", [io.UNIFORM, axis1], ["sample_u"]),
        n("Mul", ["sample_u", "sample_total"], ["sample_cut"]),
        n("GreaterOrEqual", ["sample_ends", "sample_cut"], ["sample_block_reached"]),
        n("Cast", ["sample_block_reached"], ["sample_block_reached_f"], to=TensorProto.FLOAT),  # ArgMax takes no bool
        n("ArgMax", ["sample_block_reached_f"], ["sample_block"], axis=-1, keepdims=1),  # [batch, 1]: the first reached
        n("GatherElements", ["sample_starts", "sample_block"], ["sample_base"], axis=1),
        n("Unsqueeze", ["sample_block", axis1], ["sample_block3"]),
        n("Expand", ["sample_block3", const("sample_block_shape", i64, [3], [1, 1, CDF_BLOCK])], ["sample_block_index"]),
        n("GatherElements", ["sample_blocks", "sample_block_index"], ["sample_in_block3"], axis=1),
        n("Reshape", ["sample_in_block3", const("sample_block_row", i64, [2], [0, CDF_BLOCK])], ["sample_in_block"]),
        n("CumSum", ["sample_in_block", last], ["sample_running"]),
        n("Add", ["sample_base", "sample_running"], ["sample_cdf"]),
        n("GreaterOrEqual", ["sample_cdf", "sample_cut"], ["sample_reached"]),
        n("Cast", ["sample_reached"], ["sample_reached_f"], to=TensorProto.FLOAT),
        n("ArgMax", ["sample_reached_f"], ["sample_first"], axis=-1, keepdims=1),
        n("ReduceMax", ["sample_reached_f", last_axes], ["sample_any"], keepdims=1),
        # The block's last token with mass: the largest index among those with mass
        n("Greater", ["sample_in_block", zero], ["sample_has_mass"]),
        n("Cast", ["sample_has_mass"], ["sample_has_mass_f"], to=TensorProto.FLOAT),
        n("Mul", ["sample_has_mass_f", const("sample_columns", TensorProto.FLOAT, [CDF_BLOCK], list(range(CDF_BLOCK)))],
          ["sample_massed_columns"]),
        n("ArgMax", ["sample_massed_columns"], ["sample_last_massed"], axis=-1, keepdims=1),
        n("Cast", ["sample_any"], ["sample_any_b"], to=TensorProto.BOOL),
        n("Where", ["sample_any_b", "sample_first", "sample_last_massed"], ["sample_in_block_index"]),
        n("Mul", ["sample_block", const("sample_block_size", i64, [], [CDF_BLOCK])], ["sample_block_start"]),
        n("Add", ["sample_block_start", "sample_in_block_index"], ["sample_index"]),
        n("Min", ["sample_index", const("sample_vocab_last", i64, [], [vocab - 1])], ["sample_drawn"]),
        n("ArgMax", ["sample_logits"], ["sample_greedy"], axis=-1, keepdims=0),  # [batch, 1]
        n("Greater", [io.TEMPERATURE, zero], ["sample_draws"]),
        n("Unsqueeze", ["sample_draws", axis1], ["sample_draws2"]),
        n("Where", ["sample_draws2", "sample_drawn", "sample_greedy"], [io.NEXT_TOKEN]),
    ]


def _drop_attention_bias(graph: onnx.GraphProto) -> None:
    for n in graph.node:
        if n.op_type == GQA and n.domain == MSFT:
            inputs = list(n.input)[:10]  # input 10: the additive mask
            while inputs and not inputs[-1]:
                inputs.pop()
            del n.input[:]
            n.input.extend(inputs)


def _prune(graph: onnx.GraphProto) -> None:
    """Drop the nodes and initializers no output depends on (the attention mask's, the twin's length prelude)."""
    needed = {o.name for o in graph.output}
    kept = []
    for n in reversed(graph.node):
        if any(o in needed for o in n.output):
            kept.append(n)
            needed.update(i for i in n.input if i)
    del graph.node[:]
    graph.node.extend(reversed(kept))
    inits = [t for t in graph.initializer if t.name in needed]
    del graph.initializer[:]
    graph.initializer.extend(inits)


def _in_memory(proto: onnx.ModelProto, weights: dict[str, np.ndarray]) -> InMemoryGraph:
    """`proto` (from load_mapped: its large weights held outside it) serialized, with the arrays of those of its
    initializers that `weights` holds (a pruned graph keeps fewer)."""
    names = {t.name for t in proto.graph.initializer}
    weights = {name: array for name, array in weights.items() if name in names}
    return InMemoryGraph(proto.SerializeToString(), weights, attention_layout(count_ops(proto)))



def mixed_form(path: Path) -> InMemoryGraph | None:
    """The export's one-forward step of decode rows and prefill chunks together (to_mixed_step), its weights as arrays,
    or None where static_forms has none."""
    loaded = _gqa_proto(path, require_rewrite=False)
    if loaded is None:
        return None
    proto, weights = loaded
    to_mixed_step(proto)
    return _in_memory(proto, weights)


def to_mixed_step(proto: onnx.ModelProto) -> None:
    """In place: one forward of B decode rows (one token each, on a cache of B rows read at seqlens_k) and J chunk rows
    (S tokens each, on a cache of their own read at chunk_seqlens_k), their tokens packed in one row: input_ids and
    position_ids [1, B + J * S], the decode rows' first. Everything but attention runs on the packed tokens, so a chunk
    costs its own tokens and the decode rows theirs (no padding to a common length); each attention is split in two
    GroupQueryAttention nodes, one per group, and joined again. The logits: those of the positions `keep` [K]
    ([1, K, vocab])."""
    graph = proto.graph
    _drop_attention_bias(graph)
    i64 = TensorProto.INT64

    def const(name: str, values: list[int]) -> str:
        graph.initializer.append(helper.make_tensor(name, i64, [len(values)], values))
        return name

    n = helper.make_node
    prelude = [
        n("Shape", [io.SEQLENS_K], ["mixed_decode_rows"]),  # [1]: B
        n("Concat", ["mixed_decode_rows", const("mixed_minus_1", [-1])], ["mixed_chunk_rows_shape"], axis=0),
        n("Shape", [io.CHUNK_SEQLENS_K], ["mixed_chunk_rows"]),  # [1]: J
    ]
    zero, axis1, end = const("mixed_zero", [0]), const("mixed_axis_1", [1]), const("mixed_end", [2**63 - 1])
    flat = const("mixed_flat", [1, -1, 0])  # [J, S, C] -> [1, J * S, C]
    nodes, layer = [], 0
    for node in graph.node:
        if node.op_type != GQA or node.domain != MSFT:
            nodes.append(node)
            continue
        p = f"mixed_{layer}_"
        qkv, attn = node.input[0], node.output[0]
        rest = list(node.input[7:])
        attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
        nodes += [
            n("Slice", [qkv, zero, "mixed_decode_rows", axis1], [p + "qkv_d1"]),  # [1, B, 3C]
            n("Transpose", [p + "qkv_d1"], [p + "qkv_d"], perm=[1, 0, 2]),  # [B, 1, 3C]
            n("Slice", [qkv, "mixed_decode_rows", end, axis1], [p + "qkv_c1"]),  # [1, J * S, 3C]
            n("Shape", [qkv], [p + "qkv_shape"]),
            n("Slice", [p + "qkv_shape", const(p + "two", [2]), const(p + "three", [3])], [p + "width"]),
            n("Concat", ["mixed_chunk_rows", const(p + "minus_1", [-1]), p + "width"], [p + "chunk_shape"], axis=0),
            n("Reshape", [p + "qkv_c1", p + "chunk_shape"], [p + "qkv_c"]),  # [J, S, 3C]
            helper.make_node(GQA, [p + "qkv_d", "", "", node.input[3], node.input[4], io.SEQLENS_K,
                                   io.TOTAL_SEQUENCE_LENGTH, *rest], [p + "attn_d", node.output[1], node.output[2]],
                             name=f"{node.name}_decode", domain=MSFT, **attrs),
            helper.make_node(GQA, [p + "qkv_c", "", "", io.chunk_past_key(layer), io.chunk_past_value(layer),
                                   io.CHUNK_SEQLENS_K, io.CHUNK_TOTAL, *rest],
                             [p + "attn_c", io.chunk_present_key(layer), io.chunk_present_value(layer)],
                             name=f"{node.name}_chunk", domain=MSFT, **attrs),
            n("Transpose", [p + "attn_d"], [p + "attn_d1"], perm=[1, 0, 2]),  # [1, B, C]
            n("Reshape", [p + "attn_c", flat], [p + "attn_c1"]),  # [1, J * S, C]
            n("Concat", [p + "attn_d1", p + "attn_c1"], [attn], axis=1),
        ]
        layer += 1
    # The unembedding of the kept positions alone: logits_to_keep's slice becomes a gather of them (an int8 batched
    # graph quantizes the slice's output on its way to the unembedding: no MatMul reads it directly).
    sliced = next((x for x in nodes if x.name == "logits_to_keep_slice"), None)
    if sliced is not None:
        nodes[nodes.index(sliced)] = n("Gather", [sliced.input[0], io.KEEP], [sliced.output[0]], axis=1)
    else:
        unembed = logits_producer(proto)
        nodes.insert(nodes.index(unembed), n("Gather", [unembed.input[0], io.KEEP], ["mixed_kept_hidden"], axis=1))
        unembed.input[0] = "mixed_kept_hidden"
    del graph.node[:]
    graph.node.extend(prelude + nodes)
    layers = layer
    kept = [i for i in graph.input if i.name in (io.INPUT_IDS, io.POSITION_IDS) or i.name.startswith("past_key_values.")]
    for i in kept:
        if i.name in (io.INPUT_IDS, io.POSITION_IDS):
            i.type.tensor_type.shape.dim[0].Clear()
            i.type.tensor_type.shape.dim[0].dim_value = 1
    past = next(i for i in graph.input if i.name == io.past_key(0)).type.tensor_type
    dtype, (_, heads, _, dim) = past.elem_type, [d.dim_value for d in past.shape.dim]
    chunk_cache = ["chunk_rows", heads, "capacity", dim]
    del graph.input[:]
    graph.input.extend(kept + [
        helper.make_tensor_value_info(io.SEQLENS_K, TensorProto.INT32, [io.BATCH]),
        helper.make_tensor_value_info(io.TOTAL_SEQUENCE_LENGTH, TensorProto.INT32, [1]),
        helper.make_tensor_value_info(io.CHUNK_SEQLENS_K, TensorProto.INT32, ["chunk_rows"]),
        helper.make_tensor_value_info(io.CHUNK_TOTAL, TensorProto.INT32, [1]),
        helper.make_tensor_value_info(io.KEEP, i64, ["kept"]),
    ] + [helper.make_tensor_value_info(name, dtype, chunk_cache)
         for i in range(layers) for name in (io.chunk_past_key(i), io.chunk_past_value(i))])
    outputs = list(graph.output) + [helper.make_tensor_value_info(name, dtype, chunk_cache)
                                    for i in range(layers) for name in (io.chunk_present_key(i), io.chunk_present_value(i))]
    del graph.output[:]
    graph.output.extend(outputs)
    _prune(graph)
