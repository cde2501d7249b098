"""An ONNX file read without copying its weights through protobuf: the file is mapped, its protobuf fields scanned
for the large initializers' raw_data, and those become NumPy views of the mapping (the graph proto marks them as held
outside it, IN_MEMORY), while protobuf parses the rest (the nodes and small tensors): ONNX Runtime then reads the
weights where the file's pages are (benchmarks/results/cold-start-*: the fp32 twin's first token came sooner than the
export's own graph's, read from its file by ONNX Runtime)."""

from __future__ import annotations

import mmap
from pathlib import Path

import numpy as np
import onnx
from google.protobuf.message import DecodeError
from onnx import TensorProto, helper

from ..errors import ArtifactError

# Field numbers of onnx.proto3's messages (checked against onnx's descriptors in tests/onnx/test_mapped.py).
MODEL_GRAPH = 7
GRAPH_INITIALIZER = 5
TENSOR_RAW_DATA = 9
LENGTH_DELIMITED = 2

IN_MEMORY = "in-memory"  # the location of a weight handed to ONNX Runtime as an array (external initializers)
MAPPED_MIN_BYTES = 1024  # smaller initializers (shapes, axes, scalars) are parsed as they are
UNALIGNED_VIEW_MIN_BYTES = 1 << 20  # an unaligned tensor from this size on is used where it is (see _load_mapped)


def _varint(buf: memoryview, pos: int) -> tuple[int, int]:
    result = shift = 0
    while True:
        b = buf[pos]
        pos += 1
        result |= (b & 0x7F) << shift
        if b < 0x80:
            return result, pos
        shift += 7


def _fields(buf: memoryview, start: int, end: int):
    """(number, wire type, value start, value end, field start) of each field of the message in buf[start:end]."""
    pos = start
    while pos < end:
        field_start = pos
        key, pos = _varint(buf, pos)
        number, wire = key >> 3, key & 7
        if wire == 0:
            _, after = _varint(buf, pos)
        elif wire == 1:
            after = pos + 8
        elif wire == LENGTH_DELIMITED:
            length, pos = _varint(buf, pos)
            after = pos + length
        elif wire == 5:
            after = pos + 4
        else:
            raise ValueError(f"unsupported protobuf wire type {wire} at byte {field_start}")
        yield number, wire, pos, after, field_start
        pos = after
    if pos != end:
        raise ValueError("a protobuf message overruns its length")


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
    for number, wire, start, end, field_start in _fields(buf, 0, len(buf)):
        if number == MODEL_GRAPH and wire == LENGTH_DELIMITED:
            graph_at = (start, end)
        else:
            model_rest += buf[field_start:end]
    proto = onnx.ModelProto()
    proto.ParseFromString(bytes(model_rest))
    if graph_at is None:
        return proto, {}
    graph_rest, large = bytearray(), []
    for number, wire, start, end, field_start in _fields(buf, *graph_at):
        if number == GRAPH_INITIALIZER and wire == LENGTH_DELIMITED and end - start >= MAPPED_MIN_BYTES:
            large.append((start, end))
        else:
            graph_rest += buf[field_start:end]
    proto.graph.ParseFromString(bytes(graph_rest))
    weights: dict[str, np.ndarray] = {}
    for start, end in large:
        rest, raw = bytearray(), None
        for number, wire, value_start, value_end, field_start in _fields(buf, start, end):
            if number == TENSOR_RAW_DATA and wire == LENGTH_DELIMITED:
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
