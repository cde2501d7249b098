"""An ONNX file read without copying its weights through protobuf: the file is mapped, its protobuf fields scanned
for the large initializers' raw_data, and those become NumPy views of the mapping (the graph proto marks them as held
outside it, IN_MEMORY), while protobuf parses the rest (the nodes and small tensors): ONNX Runtime then reads the
weights where the file's pages are (benchmarks/results/cold-start-in-place-cpu-2core: GPT-2 124M int8's first token
1.31 s from process start, 1.75 s when ONNX Runtime read the file itself)."""

from __future__ import annotations

import mmap
from pathlib import Path

import numpy as np
import onnx
from google.protobuf.message import DecodeError
from onnx import TensorProto, helper

from ..errors import ArtifactError
from . import wire

MODEL_GRAPH = wire.number(onnx.ModelProto, "graph")
GRAPH_INITIALIZER = wire.number(onnx.GraphProto, "initializer")
TENSOR_RAW_DATA = wire.number(onnx.TensorProto, "raw_data")

IN_MEMORY = "in-memory"  # the location of a weight handed to ONNX Runtime as an array (external initializers)
MAPPED_MIN_BYTES = 1024  # smaller initializers (shapes, axes, scalars) are parsed as they are
UNALIGNED_VIEW_MIN_BYTES = 1 << 20  # an unaligned tensor from this size on is used where it is (see _load_mapped)


def load_mapped(path: Path) -> tuple[onnx.ModelProto, dict[str, np.ndarray]]:
    """The model at `path` (its weights inside the file) and its large initializers' arrays by name: views of the
    mapped file (copies of the small ones whose bytes are not aligned to their element size). The proto's copies of those
    initializers carry no data and say where it is (IN_MEMORY); the rest is protobuf's parse. A file that is not
    one is an ArtifactError."""
    try:
        return _load_mapped(Path(path))
    except (ValueError, IndexError, DecodeError) as e:  # a cut or foreign file: where the scan or protobuf stopped
        raise ArtifactError(f"{path} is not a readable ONNX model: {e or type(e).__name__}") from None


def _load_mapped(path: Path) -> tuple[onnx.ModelProto, dict[str, np.ndarray]]:
    with open(path, "rb") as f:
        mapping = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)  # private pages: the arrays may be written
    buf = memoryview(mapping)
    model_rest, graph_at = bytearray(), None
    for number, kind, start, end, field_start in wire.fields(buf, 0, len(buf)):
        if number == MODEL_GRAPH and kind == wire.LENGTH_DELIMITED:
            graph_at = (start, end)
        else:
            model_rest += buf[field_start:end]
    proto = onnx.ModelProto()
    proto.ParseFromString(bytes(model_rest))
    if graph_at is None:
        return proto, {}
    graph_rest, large = bytearray(), []
    for number, kind, start, end, field_start in wire.fields(buf, *graph_at):
        if number == GRAPH_INITIALIZER and kind == wire.LENGTH_DELIMITED and end - start >= MAPPED_MIN_BYTES:
            large.append((start, end))
        else:
            graph_rest += buf[field_start:end]
    proto.graph.ParseFromString(bytes(graph_rest))
    weights: dict[str, np.ndarray] = {}
    for start, end in large:
        rest, raw = bytearray(), None
        for number, kind, value_start, value_end, field_start in wire.fields(buf, start, end):
            if number == TENSOR_RAW_DATA and kind == wire.LENGTH_DELIMITED:
                raw = (value_start, value_end)
            else:
                rest += buf[field_start:value_end]
        tensor = proto.graph.initializer.add()
        if raw is None:  # typed fields or external data: as protobuf reads it
            tensor.ParseFromString(bytes(buf[start:end]))
            continue
        tensor.ParseFromString(bytes(rest))
        dtype = np.dtype(helper.tensor_dtype_to_np_dtype(tensor.data_type))
        count = (raw[1] - raw[0]) // dtype.itemsize
        array = np.frombuffer(mapping, dtype=dtype, count=count, offset=raw[0]).reshape(tuple(tensor.dims))
        # Unaligned bytes stay where they are when large (matmul weights, which ONNX Runtime packs into its own
        # buffers, and embeddings, which it gathers and transposes): copying 400 MB of them took 0.9 s of page faults
        # in a fresh process. Small ones (biases, norms), which elementwise kernels read directly, are copied.
        aligned = raw[0] % dtype.itemsize == 0 or array.nbytes >= UNALIGNED_VIEW_MIN_BYTES
        weights[tensor.name] = array if aligned else array.copy()
        tensor.data_location = TensorProto.EXTERNAL
        tensor.external_data.add(key="location", value=IN_MEMORY)
    return proto, weights
