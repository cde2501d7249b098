"""The int8 KV cache of a GroupQueryAttention export (int8, int4): one float32 scale per layer, key or value, head and
channel, calibrated at export (onnx/build.py) and stored beside model.onnx (KV_SCALES_FILE). Values are stored as
round-half-even(x / scale) clipped to int8, ONNX Runtime's GroupQueryAttention rule (kv_cache_bit_width 8,
PER_CHANNEL), so every writer of the cache (ONNX Runtime, the OpenVINO prefill, a cache handed in as floats) stores
the same bytes for the same value. model.onnx keeps its float cache for Optimum and onnxruntime-genai; the runtime
rewrites the graph in memory (with_int8_kv). Why: docs/export.md, the int8 KV cache. No torch."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
from safetensors.numpy import load_file, save_file

from . import names as io
from .artifact import KV_SCALES_FILE
from .names import GQA, MSFT

if TYPE_CHECKING:  # with_int8_kv's alone: the rest (the runtime's quantize, dequantize) needs no onnx
    import onnx

INT8_RANGE = (-128, 127)  # what GroupQueryAttention clips to
_K_SCALE, _V_SCALE = 12, 13  # GroupQueryAttention's k_scale and v_scale inputs


def scale_name(layer: int, kind: str) -> str:
    """The scales' name for layer `layer`'s key or value (`kind`), in the file and in the rewritten graph."""
    return f"kv_scale.{layer}.{kind}"


def scales_from_absmax(absmax: np.ndarray, margin: float) -> np.ndarray:
    """(2L, H, D) scales in the cache's order (each layer's key, then value) from the largest |value| calibration
    saw at each, widened by `margin` so that a value that much larger than any seen still fits; never 0."""
    return (np.maximum(absmax, 1e-8) * margin / INT8_RANGE[1]).astype(np.float32)


def save_scales(folder: Path, scales: np.ndarray) -> Path:
    """(2L, H, D) scales written as KV_SCALES_FILE in `folder`."""
    path = Path(folder) / KV_SCALES_FILE
    save_file({scale_name(i // 2, ("key", "value")[i % 2]): np.ascontiguousarray(s) for i, s in enumerate(scales)}, str(path))
    return path


def load_scales(folder: Path, n_layer: int) -> np.ndarray:
    """The (2L, H, D) scales of an export, in the cache's order."""
    tensors = load_file(str(Path(folder) / KV_SCALES_FILE))
    return np.stack([tensors[scale_name(i, kind)] for i in range(n_layer) for kind in ("key", "value")])


def quantize(x: np.ndarray, scale: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
    """(B, H, T, D) floats as the cache stores them, `scale` (H, D): GroupQueryAttention's rule."""
    q = np.rint(np.asarray(x, dtype=np.float32) / scale[None, :, None, :])
    np.clip(q, *INT8_RANGE, out=q)
    if out is None:
        return q.astype(np.int8)
    out[...] = q
    return out


def dequantize(q: np.ndarray, scale: np.ndarray) -> np.ndarray:
    """(B, H, T, D) int8 cache values as floats, `scale` (H, D)."""
    return q.astype(np.float32) * scale[None, :, None, :]


def with_int8_kv(proto: onnx.ModelProto, scales: np.ndarray) -> None:
    """In place: every GroupQueryAttention reads and writes an int8 cache with `scales` (2L, H, D) per channel, and the
    graph's past and present inputs and outputs are int8 (the mixed step's, onnx.optimize.to_mixed_step: both of a
    layer's attentions, on the decode rows' cache and the chunk's). ValueError where some layer has no
    GroupQueryAttention."""
    from onnx import TensorProto, helper  # rewriting a graph: onnx's

    graph = proto.graph
    nodes = [n for n in graph.node if n.op_type == GQA and n.domain == MSFT]
    n_layer = len(scales) // 2
    # A node's past key names its layer: the export's past, or the mixed step's chunk past.
    layer_of = {name: i // 2 for i, name in enumerate(io.input_names(n_layer)[3:]) if i % 2 == 0}
    layer_of.update({io.chunk_past_key(i): i for i in range(n_layer)})
    layers = {layer_of.get(n.input[3]) for n in nodes}
    if len(nodes) < n_layer or layers != set(range(n_layer)):
        raise ValueError(f"the graph has {len(nodes)} GroupQueryAttention nodes; the scales are for {n_layer} layers")
    for n in nodes:
        layer = layer_of[n.input[3]]
        while len(n.input) <= _V_SCALE:
            n.input.append("")
        for slot, kind, k in ((_K_SCALE, "key", 0), (_V_SCALE, "value", 1)):
            name = scale_name(layer, kind)
            heads, dim = scales[2 * layer + k].shape
            if not any(t.name == name for t in graph.initializer):  # one per layer, shared by its two attentions
                graph.initializer.append(helper.make_tensor(name, TensorProto.FLOAT, [1, heads, 1, dim],
                                                            scales[2 * layer + k].ravel().tolist()))
            n.input[slot] = name
        n.attribute.extend([helper.make_attribute("kv_cache_bit_width", 8), helper.make_attribute("k_quant_type", "PER_CHANNEL"),
                            helper.make_attribute("v_quant_type", "PER_CHANNEL")])
    cache = set(io.input_names(n_layer)[3:]) | set(io.output_names(n_layer)[1:])
    cache |= {name(i) for i in range(n_layer) for name in (io.chunk_past_key, io.chunk_past_value, io.chunk_present_key,
                                                          io.chunk_present_value)}
    for value in list(graph.input) + list(graph.output):
        if value.name in cache:
            value.type.tensor_type.elem_type = TensorProto.INT8
