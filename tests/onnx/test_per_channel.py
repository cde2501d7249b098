"""gpt2x/onnx/per_channel.py against the ONNX Runtime installed: every channel at once gives, byte for byte, what ORT's
own loop over the channels gives (the reference: its quantize_data, and its quantize_dynamic's whole model), on weights
with the cases its arithmetic treats apart; the patched method is there with the shape expected, and the patch ends
with the block. A release of ORT that changes either fails here."""

from __future__ import annotations

import inspect

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper
from onnxruntime.quantization import QuantType, base_quantizer, quantize_dynamic
from onnxruntime.quantization.quant_utils import quantize_data

from gpt2x.onnx.per_channel import per_channel_at_once, quantize_per_channel


def weights(shape, seed: int) -> np.ndarray:
    """Random float32 weights, one channel of zeros, one all positive, one all negative, one holding a single value,
    and values on .5 steps of the scale (rounding half to even)."""
    rng = np.random.default_rng(seed)
    w = (rng.standard_normal(shape) * rng.uniform(0.01, 3, shape[-1])).astype(np.float32)
    w[:, 0] = 0
    w[:, 1] = np.abs(w[:, 1])
    w[:, 2] = -np.abs(w[:, 2])
    w[:, 3] = 0.37
    w[:, 4] = np.arange(shape[0], dtype=np.float32) * 0.5 - 3
    return w


@pytest.mark.parametrize("qtype,symmetric,reduce_range", [(TensorProto.INT8, True, True), (TensorProto.INT8, True, False),
                                                          (TensorProto.INT8, False, True), (TensorProto.UINT8, False, True),
                                                          (TensorProto.UINT8, False, False), (TensorProto.UINT8, True, False)])
@pytest.mark.parametrize("axis", [0, 1])
def test_every_channel_at_once_equals_quantize_data_channel_by_channel(qtype, symmetric, reduce_range, axis):
    w = weights((13, 40), seed=axis)
    w = w if axis == 1 else np.ascontiguousarray(w.T)
    zero_point, scale, quantized = quantize_per_channel(w, axis, qtype, symmetric, reduce_range)
    for c in range(w.shape[axis]):
        want_zp, want_scale, want_q = quantize_data(w.take(c, axis).flatten(), qtype, symmetric, reduce_range=reduce_range)
        assert zero_point[c] == want_zp and zero_point.dtype == want_zp.dtype, c
        assert scale[c].tobytes() == want_scale.tobytes(), c  # the same float32, bit for bit
        assert quantized.take(c, axis).tobytes() == want_q.tobytes() and quantized.dtype == want_q.dtype, c


def test_quantize_dynamic_writes_the_same_model_with_the_patch_as_without(tmp_path):
    """A graph of two MatMuls by constant weights (one as wide as GPT-2's unembedding is long would take seconds
    without the patch: 300 channels here), per channel in 7 bits as the int8 export asks: the same file, byte for byte."""
    rng = np.random.default_rng(0)
    a, b = weights((24, 300), seed=2), (rng.standard_normal((300, 16)) * 0.1).astype(np.float32)
    graph = helper.make_graph([helper.make_node("MatMul", ["x", "a"], ["h"], name="first"),
                               helper.make_node("MatMul", ["h", "b"], ["y"], name="second")], "g",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", 24])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["n", 16])],
                              [numpy_helper.from_array(a, "a"), numpy_helper.from_array(b, "b")])
    src = tmp_path / "model.onnx"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), src)

    def quantized(path) -> bytes:
        quantize_dynamic(str(src), str(path), op_types_to_quantize=["MatMul"], per_channel=True, weight_type=QuantType.QInt8,
                         reduce_range=True, extra_options={"MatMulConstBOnly": True})
        return path.read_bytes()

    original = base_quantizer.BaseQuantizer.quantize_weight_per_channel_impl
    calls = []
    with per_channel_at_once():
        patched = base_quantizer.BaseQuantizer.quantize_weight_per_channel_impl
        base_quantizer.BaseQuantizer.quantize_weight_per_channel_impl = lambda *a, **k: calls.append(a[1]) or patched(*a, **k)
        ours = quantized(tmp_path / "ours.onnx")
        base_quantizer.BaseQuantizer.quantize_weight_per_channel_impl = patched
    assert base_quantizer.BaseQuantizer.quantize_weight_per_channel_impl is original
    assert sorted(calls) == ["a", "b"]  # both weights went through the patch
    assert ours == quantized(tmp_path / "ors.onnx")
    scales = {i.name: numpy_helper.to_array(i) for i in onnx.load(str(tmp_path / "ours.onnx")).graph.initializer}
    assert scales["a_scale"].shape == (300,) and scales["a_scale"][0] == 1.0  # the channel of zeros


def test_the_patched_method_is_there_as_expected():
    method = base_quantizer.BaseQuantizer.quantize_weight_per_channel_impl
    assert list(inspect.signature(method).parameters) == ["self", "weight_name", "weight_qType", "channel_axis", "reduce_range",
                                                         "keep_float_weight"]
    source = inspect.getsource(method)
    # what the patch writes as ORT does: scale and zero point first, then the weight under its suffix
    assert source.index("scale_initializer, zero_initializer") < source.index("q_weight_initializer])")
    assert 'weight_name + "_zero_point"' in source and 'weight_name + "_scale"' in source
