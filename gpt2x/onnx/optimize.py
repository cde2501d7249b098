"""Graph optimisation after tracing: ONNX Runtime's transformer optimizer (SkipLayerNormalization,
FastGelu), fp16 conversion, int8 weights (MatMulNBits), and the MultiHeadAttention ->
GroupQueryAttention rewrite of the int8 graph. Works on ONNX files alone (no torch)."""

from __future__ import annotations

import contextlib
import logging
import os
from collections import Counter
from pathlib import Path

import onnx
from onnx import TensorProto, helper, numpy_helper

from ..choices import Precision
from ..model.config import GPT2Config
from . import names as io
from .artifact import IR_VERSION, save_onnx
from .names import MSFT

FUSED_OPS = ("MultiHeadAttention", "GroupQueryAttention", "Attention", "SkipLayerNormalization", "FastGelu", "BiasGelu",
             "Gelu", "EmbedLayerNormalization", "MatMulNBits", "MatMulInteger", "DynamicQuantizeMatMul")



def fuse(raw: Path, out: Path, cfg: GPT2Config, precision: Precision) -> dict[str, int]:
    """ONNX Runtime's transformer optimizer (SkipLayerNormalization, FastGelu; attention is already
    MultiHeadAttention), then fp16 conversion. Returns the fused operator counts."""
    from onnxruntime.transformers.onnx_model import OnnxModel
    from onnxruntime.transformers.optimizer import optimize_model

    data = raw.with_name(raw.name + ".data")
    if data.exists():
        # Weights past 2 GB: fuse the graph alone (the fusions read only a few constants) and let
        # the fused graph point at the same data file, moved beside it. Loading the weights for
        # fusion would hold them three times in memory (torch, graph, optimizer): gpt2-xl ran out.
        proto = onnx.load(str(raw), load_external_data=False)
        # Those constants are read through onnx's numpy_helper, which resolves external data
        # against the working directory.
        with _working_dir(raw.parent):
            opt = optimize_model(proto, model_type="gpt2", num_heads=cfg.n_head, hidden_size=cfg.n_embd, opt_level=0)
        os.replace(data, out.with_name(out.name + ".data"))
        for tensor in opt.model.graph.initializer:
            for entry in tensor.external_data:
                if entry.key == "location":
                    entry.value = out.name + ".data"
        opt.model.ir_version = IR_VERSION
        onnx.save_model(opt.model, str(out))
        if precision is not Precision.fp16:
            return count_ops(opt.model)
        opt = OnnxModel(onnx.load(str(out)))  # the fp16 conversion needs the weights themselves
        out.with_name(out.name + ".data").unlink()  # rewritten below only if fp16 still passes 2 GB
    else:
        opt = optimize_model(str(raw), model_type="gpt2", num_heads=cfg.n_head, hidden_size=cfg.n_embd, opt_level=0)
    if precision is Precision.fp16:
        # Inputs ids/mask/positions are int64; logits stay fp32 for the sampler; the KV cache is fp16.
        # The ops ONNX Runtime's converter blocks by default stay fp32; LayerNorm statistics and
        # softmax are computed in fp32 inside SkipLayerNormalization / MultiHeadAttention kernels.
        opt.convert_float_to_float16(keep_io_types=[io.LOGITS], use_symbolic_shape_infer=True)
    opt.model.ir_version = IR_VERSION
    save_onnx(opt.model, out)
    return count_ops(opt.model)


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


INT8_BLOCK = 128  # weights per quantization scale along the input dimension


def quantize_int8(fused: Path, out: Path) -> dict[str, int]:
    """int8 weights for every MatMul with ONNX Runtime's MatMulNBits quantizer: symmetric, one scale
    per block of 128 input weights of each output column, computed with int8 activations
    (accuracy_level 4). The tied unembedding is quantized too: it is the largest matrix (V x C)
    and every decode step reads it whole; the embedding lookup (Gather on wte) stays fp32, costs
    one row per token and keeps the model's input exact.

    int8 is the CPU precision, so its attention is GroupQueryAttention, whose CPU kernel can update
    a fixed-capacity KV cache in place (onnx_ops.mha_to_gqa); the fp32 and fp16 graphs keep
    MultiHeadAttention, which ONNX Runtime's CUDA provider also runs in fp32."""
    from onnxruntime.quantization.matmul_nbits_quantizer import MatMulNBitsQuantizer

    proto = onnx.load(str(fused))
    fold_transposed_initializers(proto)
    mha_to_gqa(proto)
    logger = logging.getLogger("onnxruntime.quantization.matmul_nbits_quantizer")
    level = logger.level
    logger.setLevel(logging.WARNING)  # it logs every node at INFO
    try:
        quantizer = MatMulNBitsQuantizer(proto, bits=8, block_size=INT8_BLOCK, is_symmetric=True, accuracy_level=4)
        quantizer.process()
    finally:
        logger.setLevel(level)
    q = quantizer.model.model
    q.ir_version = IR_VERSION
    save_onnx(q, out)
    return count_ops(q)


def count_ops(proto: onnx.ModelProto) -> dict[str, int]:
    counts = Counter(n.op_type for n in proto.graph.node)
    return {op: counts[op] for op in FUSED_OPS if counts[op]} | {"total_nodes": len(proto.graph.node)}



# ---------------------------------------------------------------- GroupQueryAttention (int8, CPU)

GQA = "GroupQueryAttention"
_GQA_SEQLENS = "gqa_seqlens_k"  # int32 [batch]: total_sequence_length - 1 for every row
_GQA_TOTAL = "gqa_total_sequence_length"  # int32 scalar: the attention mask's width


def mha_to_gqa(proto: onnx.ModelProto) -> int:
    """Replace every MultiHeadAttention node by ONNX Runtime's GroupQueryAttention (kv heads = heads),
    in place; returns how many were replaced.

    The inputs and outputs of the graph do not change. GroupQueryAttention reads the packed QKV
    projection directly (the Split before it goes), takes the same additive mask as attention_bias
    (so left padding works as before) and every row's length as the mask's width. What it adds is
    that its present key/value may be the very buffers passed as past: given a fixed-capacity cache
    bound as both input and output, it writes the new positions in place instead of copying the
    whole cache into a new present every step (see runtime.ort.SharedKVCache). Its CPU kernel has one
    restriction the MultiHeadAttention graph lacks: a step of more than one token on top of a past
    must have batch 1 (runtime.ort.OrtBackend runs such batches row by row)."""
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
