"""onnx.optimize.sampling_head, the sampler's draw inside a decode graph, alone in a graph of its own on ONNX Runtime's
CPU provider, against the host sampler's inverse CDF (generation.sampling) on the same float64 masses."""

from __future__ import annotations

import numpy as np
import onnxruntime as ort
from onnx import TensorProto, helper

from gpt2x.generation.sampling import _inverse_cdf
from gpt2x.numerics import CDF_BLOCK
from gpt2x.onnx import names as io
from gpt2x.onnx.artifact import IR_VERSION
from gpt2x.onnx.optimize import sampling_head

VOCAB = 50257


def head_session(vocab: int) -> ort.InferenceSession:
    graph = helper.make_graph(
        [], "head",
        [helper.make_tensor_value_info(io.LOGITS, TensorProto.FLOAT, ["batch", 1, vocab]),
         helper.make_tensor_value_info(io.TEMPERATURE, TensorProto.DOUBLE, ["batch"]),
         helper.make_tensor_value_info(io.UNIFORM, TensorProto.DOUBLE, ["batch"])],
        [helper.make_tensor_value_info(io.LOGITS, TensorProto.FLOAT, ["batch", 1, vocab])])
    graph.node.extend(sampling_head(graph))
    del graph.output[:]
    graph.output.append(helper.make_tensor_value_info(io.NEXT_TOKEN, TensorProto.INT64, ["batch", 1]))
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)], ir_version=IR_VERSION)
    return ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])


def host_draw(logits: np.ndarray, temperature: np.ndarray, uniform: np.ndarray) -> np.ndarray:
    """What the host sampler draws: float64 exponentials of the logits over the temperature, by inverse CDF."""
    scaled = logits.astype(np.float64) / temperature[:, None]
    return _inverse_cdf(np.exp(scaled - scaled.max(-1, keepdims=True)), uniform)


def test_the_head_draws_the_host_samplers_tokens():
    rng = np.random.default_rng(0)
    session = head_session(VOCAB)
    for trial in range(20):
        rows = 6
        logits = rng.normal(0, 1 + trial % 4, (rows, VOCAB)).astype(np.float32)
        logits[1, : VOCAB - 7] = -np.inf  # the mass in the last, partial block only
        logits[2, CDF_BLOCK : 3 * CDF_BLOCK] += 8  # most of it in two blocks
        temperature = rng.uniform(0.3, 2.0, rows)
        uniform = rng.random(rows)
        uniform[3], uniform[4] = 0.0, np.nextafter(1.0, 0.0)  # the ends of [0, 1)
        got = session.run(None, {io.LOGITS: logits[:, None], io.TEMPERATURE: temperature, io.UNIFORM: uniform})[0][:, 0]
        np.testing.assert_array_equal(got, host_draw(logits, temperature, uniform), err_msg=f"trial {trial}")
        assert VOCAB - 7 <= got[1] < VOCAB


def test_a_row_at_temperature_zero_takes_the_argmax_and_one_block_is_enough():
    rng = np.random.default_rng(1)
    logits = rng.normal(0, 3, (3, VOCAB)).astype(np.float32)
    temperature, uniform = np.array([0.0, 1.0, 0.0]), rng.random(3)
    got = head_session(VOCAB).run(None, {io.LOGITS: logits[:, None], io.TEMPERATURE: temperature, io.UNIFORM: uniform})[0]
    assert got[[0, 2], 0].tolist() == logits[[0, 2]].argmax(-1).tolist()
    assert got[1, 0] == host_draw(logits[1:2], temperature[1:2], uniform[1:2])[0]
    small = rng.normal(0, 2, (4, 300)).astype(np.float32)  # a vocabulary within one block
    t, u = np.full(4, 0.9), rng.random(4)
    got = head_session(300).run(None, {io.LOGITS: small[:, None], io.TEMPERATURE: t, io.UNIFORM: u})[0][:, 0]
    np.testing.assert_array_equal(got, host_draw(small, t, u))
