"""onnx.mapped.load_mapped against onnx.load (protobuf's own parse) on exports and on hand-made graphs."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from gpt2x.choices import Precision
from gpt2x.errors import ArtifactError
from gpt2x.onnx import mapped
from gpt2x.onnx.mapped import IN_MEMORY, load_mapped


def same_as_onnx_load(path) -> dict[str, np.ndarray]:
    proto, weights = load_mapped(path)
    want = onnx.load(str(path))
    assert [n.SerializeToString() for n in proto.graph.node] == [n.SerializeToString() for n in want.graph.node]
    for field in ("input", "output"):
        assert [v.SerializeToString() for v in getattr(proto.graph, field)] == \
            [v.SerializeToString() for v in getattr(want.graph, field)]
    assert (proto.ir_version, list(proto.opset_import)) == (want.ir_version, list(want.opset_import))
    wanted = {t.name: numpy_helper.to_array(t) for t in want.graph.initializer}
    got = {}
    for t in proto.graph.initializer:
        if t.name in weights:
            assert t.data_location == TensorProto.EXTERNAL and t.external_data[0].value == IN_MEMORY
            got[t.name] = weights[t.name]
        else:
            got[t.name] = numpy_helper.to_array(t)
    assert set(got) == set(wanted)
    for name, array in wanted.items():
        assert got[name].dtype == array.dtype and got[name].shape == array.shape
        np.testing.assert_array_equal(got[name], array)
    return weights


@pytest.mark.parametrize("precision", [Precision.fp32, Precision.int8])
def test_an_export_reads_as_onnx_load_reads_it(tiny_export, precision):
    info = tiny_export(precision)[2]
    weights = same_as_onnx_load(info.model_path)
    assert weights and all(a.nbytes >= mapped.MAPPED_MIN_BYTES for a in weights.values())


def test_typed_fields_small_tensors_and_unaligned_bytes(tmp_path):
    """A large tensor in float_data (not raw_data) is parsed as it is; a small one stays in the graph; raw bytes at
    any offset come back equal (copied where unaligned)."""
    rng = np.random.default_rng(0)
    tensors = [numpy_helper.from_array(rng.standard_normal((40, 30)).astype(np.float32), f"w{i}") for i in range(3)]
    typed = helper.make_tensor("typed", TensorProto.FLOAT, [400], rng.standard_normal(400).astype(np.float32).tolist())
    small = numpy_helper.from_array(np.arange(3, dtype=np.int64), "small")
    odd = numpy_helper.from_array(rng.standard_normal(999).astype(np.float16), "odd")  # shifts the later offsets
    nodes = [helper.make_node("Identity", [t.name], [f"y_{t.name}"]) for t in (*tensors, typed, small, odd)]
    graph = helper.make_graph(nodes, "g", [], [helper.make_tensor_value_info(n.output[0], TensorProto.UNDEFINED, None)
                                                 for n in nodes], initializer=[tensors[0], odd, *tensors[1:], typed, small])
    path = tmp_path / "m.onnx"
    onnx.save(helper.make_model(graph), str(path))
    weights = same_as_onnx_load(path)
    assert set(weights) == {"w0", "w1", "w2", "odd"}  # not the typed one, nor the small one


def test_a_damaged_file_is_one_error(tiny_export, tmp_path):
    data = tiny_export(Precision.fp32)[2].model_path.read_bytes()
    path = tmp_path / "cut.onnx"
    path.write_bytes(data[: len(data) // 2])
    with pytest.raises(ArtifactError, match="cut.onnx is not a readable ONNX model: truncated or malformed protobuf"):
        load_mapped(path)
    path.write_bytes(b"\xff" * 64)  # not protobuf at all
    with pytest.raises(ArtifactError, match="not a readable ONNX model"):
        load_mapped(path)
