"""ONNX Runtime's per-channel weight quantization, every channel at once: the one patch of its quantizer that the int8
export needs. ORT computes each channel's scale and values in a Python loop over the channels
(`BaseQuantizer.quantize_weight_per_channel_impl`), about 0.1 ms a channel, and GPT-2's tied unembedding alone has
50,257: seconds of every int8 export, whatever the model's width. `quantize_per_channel` does the same arithmetic
(ORT's `quantize_data` for one channel: the same operations on the same dtypes) on the whole weight;
tests/onnx/test_per_channel.py checks it byte for byte against ORT's own loop on the ORT installed, and that the
patched method is still there with the shape expected. A weight the fast path does not cover (per-channel overrides,
a minimum real range, a type other than int8 or uint8, fp16 weights) takes ORT's own code."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import numpy as np
import onnx
from onnx import TensorProto, numpy_helper
from onnxruntime.quantization import base_quantizer
from onnxruntime.quantization.quant_utils import TENSOR_NAME_QUANT_SUFFIX, get_qmin_qmax_for_qType


def quantize_per_channel(weights: np.ndarray, axis: int, qtype: int, symmetric: bool,
                         reduce_range: bool) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(zero points, scales, quantized weights) of float32 `weights`, one scale per index of `axis`: what ORT's
    quantize_data gives for each channel (its min and max widened to take in 0, symmetric about it or not, the
    scale in float64 then float32, values rounded half to even and clipped to the type's full range)."""
    qmin, qmax = get_qmin_qmax_for_qType(qtype, reduce_range, symmetric=symmetric)
    channels = np.moveaxis(weights, axis, 0)
    rows = channels.reshape(channels.shape[0], -1)
    rmin = np.minimum(rows.min(axis=1), np.array(0, dtype=rows.dtype))
    rmax = np.maximum(rows.max(axis=1), np.array(0, dtype=rows.dtype))
    if symmetric:
        absmax = np.maximum(np.abs(rmin), np.abs(rmax))
        rmin, rmax = -absmax, +absmax
    scale = (rmax.astype(np.float64) - rmin.astype(np.float64)) / (np.float64(qmax) - np.float64(qmin))
    flat = scale < np.finfo(rmax.dtype).tiny  # a channel of zeros: scale 1, zero point 0
    scale = np.where(flat, 1.0, scale)
    if symmetric:
        zero_point = np.full(scale.shape, np.round((qmin + qmax) / np.array(2.0, dtype=np.float64)), dtype=qmin.dtype)
    else:
        zero_point = np.round(qmin - rmin / scale).astype(qmin.dtype)
    zero_point[flat] = 0
    scale = scale.astype(rmax.dtype)
    full_min, full_max = get_qmin_qmax_for_qType(qtype, reduce_range=False, symmetric=False)
    values = (rows / scale[:, None]).round() + zero_point[:, None]
    np.clip(values, full_min, full_max, out=values)
    quantized = np.moveaxis(values.astype(full_min.dtype).reshape(channels.shape), 0, axis)
    return zero_point, scale, quantized


@contextmanager
def per_channel_at_once() -> Iterator[None]:
    """Meanwhile, ORT's quantizers quantize a weight per channel through quantize_per_channel where it covers the
    weight, else through their own loop."""
    original = base_quantizer.BaseQuantizer.quantize_weight_per_channel_impl

    def at_once(self, weight_name, weight_qType, channel_axis, reduce_range=True, keep_float_weight=False):  # noqa: N803 (ORT's names)
        initializer = self.model.get_initializer(weight_name)
        covered = (initializer is not None and initializer.data_type == TensorProto.FLOAT and not keep_float_weight
                   and weight_qType in (TensorProto.INT8, TensorProto.UINT8) and self.min_real_range is None
                   and self.tensor_quant_overrides.get_per_channel_overrides(weight_name) is None
                   and -len(initializer.dims) <= channel_axis < len(initializer.dims) and all(initializer.dims))
        if not covered:
            return original(self, weight_name, weight_qType, channel_axis, reduce_range, keep_float_weight)
        weights = numpy_helper.to_array(initializer)
        zero_point, scale, quantized = quantize_per_channel(weights, channel_axis % weights.ndim, weight_qType,
                                                            self.is_weight_symmetric(weight_qType), self.reduce_range and reduce_range)
        q_name, zp_name, scale_name = weight_name + TENSOR_NAME_QUANT_SUFFIX, weight_name + "_zero_point", weight_name + "_scale"
        shape = [weights.shape[channel_axis]]
        self.model.initializer_extend([onnx.helper.make_tensor(scale_name, initializer.data_type, shape, scale.tolist()),
                                       onnx.helper.make_tensor(zp_name, weight_qType, shape, zero_point.tolist())])
        self.model.initializer_extend([numpy_helper.from_array(quantized, q_name)])
        return q_name, zp_name, scale_name

    base_quantizer.BaseQuantizer.quantize_weight_per_channel_impl = at_once
    try:
        yield
    finally:
        base_quantizer.BaseQuantizer.quantize_weight_per_channel_impl = original
