"""The exported attention: a torch custom op `gpt2x::mha` (eager body: model/gpt2.py's maths) that the dynamo
exporter writes as one com.microsoft::MultiHeadAttention per block, since ONNX Runtime's optimizer matches
attention only in transformers' TorchScript graphs.
"""

from __future__ import annotations

import math

import onnx
import onnxscript
import torch
from onnx.defs import OpSchema
from torch import Tensor

from .names import MSFT


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
