"""The attention of the exported graph: one ONNX Runtime `com.microsoft::MultiHeadAttention` node per
block, with the KV cache as its past/present key and value.

ONNX Runtime's transformer optimizer recognises LayerNorm+Add and the tanh-GELU in any graph, but its
attention patterns only match the graphs of transformers' TorchScript export. So gpt2x emits the fused
attention itself: a torch custom op `gpt2x::mha` (its eager body is the same maths as model.py, used
while tracing) translated to MultiHeadAttention by the dynamo exporter.
"""

from __future__ import annotations

import math

import onnx
import onnxscript
import torch
from onnx.defs import OpSchema
from torch import Tensor

MSFT = "com.microsoft"


@torch.library.custom_op("gpt2x::mha", mutates_args=())
def mha(
    q: Tensor, k: Tensor, v: Tensor, past_k: Tensor, past_v: Tensor, bias: Tensor, num_heads: int
) -> tuple[Tensor, Tensor, Tensor]:
    """q, k, v (B, T, C); past_k, past_v (B, H, P, D); bias (B, 1, T, P+T) additive.
    Returns the attention output (B, T, C) and the present key, value (B, H, P+T, D)."""
    B, T, C = q.shape
    D = C // num_heads
    q = q.view(B, T, num_heads, D).transpose(1, 2)  # (B, H, T, D)
    k = torch.cat([past_k, k.view(B, T, num_heads, D).transpose(1, 2)], dim=2)  # (B, H, P+T, D)
    v = torch.cat([past_v, v.view(B, T, num_heads, D).transpose(1, 2)], dim=2)  # (B, H, P+T, D)
    att = torch.softmax(q @ k.transpose(-2, -1) * (1.0 / math.sqrt(D)) + bias, dim=-1)  # (B, H, T, P+T)
    y = (att @ v).transpose(1, 2).reshape(B, T, C)  # (B, T, C)
    return y, k, v


@mha.register_fake
def _mha_shapes(q, k, v, past_k, past_v, bias, num_heads):
    B, T, C = q.shape
    total = past_k.shape[2] + T
    return q.new_empty(B, T, C), past_k.new_empty(B, num_heads, total, C // num_heads), past_v.new_empty(B, num_heads, total, C // num_heads)


def _register_mha_schema() -> None:
    """onnx has no schema for ONNX Runtime's contrib ops; the exporter needs one to build the node."""
    try:
        onnx.defs.get_schema("MultiHeadAttention", 1, MSFT)
        return
    except onnx.defs.SchemaError:
        pass
    opt, single = OpSchema.FormalParameterOption.Optional, OpSchema.FormalParameterOption.Single
    names = ["query", "key", "value", "bias", "key_padding_mask", "attention_bias", "past_key", "past_value"]
    schema = OpSchema(
        "MultiHeadAttention", MSFT, 1,
        inputs=[OpSchema.FormalParameter(n, "M" if n == "key_padding_mask" else "T", param_option=single if n == "query" else opt) for n in names],
        outputs=[OpSchema.FormalParameter(n, "T", param_option=single if n == "output" else opt) for n in ("output", "present_key", "present_value")],
        type_constraints=[("T", ["tensor(float)", "tensor(float16)"], ""), ("M", ["tensor(int32)"], "")],
        attributes=[OpSchema.Attribute("num_heads", OpSchema.AttrType.INT, "number of heads")],
    )
    onnx.defs.register_schema(schema)


_register_mha_schema()
_msft = onnxscript.values.Opset(MSFT, 1)


def mha_to_onnx(q, k, v, past_k, past_v, bias, num_heads: int):
    return _msft.MultiHeadAttention(q, k, v, None, None, bias, past_k, past_v, num_heads=num_heads)


TRANSLATIONS = {torch.ops.gpt2x.mha.default: mha_to_onnx}


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
    whole cache into a new present every step (see runtime.SharedKVCache). Its CPU kernel has one
    restriction the MultiHeadAttention graph lacks: a step of more than one token on top of a past
    must have batch 1 (runtime.OrtBackend runs such batches row by row)."""
    from onnx import TensorProto, helper

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
    from . import onnx_io as io

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
