"""An ONNX file read without copying its weights through protobuf: the file is mapped, its protobuf fields scanned
for the large initializers' raw_data, and those become NumPy views of the mapping (the model's bytes, rewritten on the
wire, mark them as held outside it, IN_MEMORY; the rest is copied as it is, nothing parsed): ONNX Runtime then reads
the weights where the file's pages are (benchmarks/results/cold-start-in-place-cpu-2core: GPT-2 124M int8's first token
1.31 s from process start, 1.75 s when ONNX Runtime read the file itself)."""

from __future__ import annotations

import mmap
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from ..errors import ArtifactError
from . import wire

if TYPE_CHECKING:  # imported by load_mapped alone: mapped_model, which a session on an export uses, needs no onnx
    import onnx

MODEL_GRAPH = wire.field("ModelProto", "graph")
GRAPH_INITIALIZER = wire.field("GraphProto", "initializer")
TENSOR_RAW_DATA = wire.field("TensorProto", "raw_data")
TENSOR_DIMS = wire.field("TensorProto", "dims")
TENSOR_DATA_TYPE = wire.field("TensorProto", "data_type")
TENSOR_NAME = wire.field("TensorProto", "name")
TENSOR_EXTERNAL_DATA = wire.field("TensorProto", "external_data")
TENSOR_DATA_LOCATION = wire.field("TensorProto", "data_location")
ENTRY_KEY, ENTRY_VALUE = wire.field("StringStringEntryProto", "key"), wire.field("StringStringEntryProto", "value")
EXTERNAL = 1  # TensorProto.DataLocation's EXTERNAL
# TensorProto.DataType -> NumPy, for the types whose raw bytes are NumPy's (a tensor of another type stays in the graph)
DTYPES = {1: np.float32, 2: np.uint8, 3: np.int8, 4: np.uint16, 5: np.int16, 6: np.int32, 7: np.int64, 9: np.bool_,
          10: np.float16, 11: np.float64, 12: np.uint32, 13: np.uint64}

IN_MEMORY = "in-memory"  # the location of a weight handed to ONNX Runtime as an array (external initializers)
MAPPED_MIN_BYTES = 1024  # smaller initializers (shapes, axes, scalars) are parsed as they are
UNALIGNED_VIEW_MIN_BYTES = 1 << 20  # an unaligned tensor from this size on is used where it is (see _external)


def mapped_model(path: Path) -> tuple[bytes, dict[str, np.ndarray]]:
    """The model at `path` (its weights inside the file) as bytes ONNX Runtime takes, whose large initializers carry no
    data and say where it is (IN_MEMORY), and those initializers' arrays by name: views of the mapped file (copies of
    the small ones whose bytes are not aligned to their element size). Protobuf's wire format, rewritten where the
    weights are and copied as it is elsewhere: no onnx import, no parse. A file that is not one is an ArtifactError."""
    try:
        return _mapped(Path(path))
    except (ValueError, IndexError) as e:  # a cut or foreign file: where the scan stopped
        raise ArtifactError(f"{path} is not a readable ONNX model: {e or type(e).__name__}") from None


def load_mapped(path: Path) -> tuple[onnx.ModelProto, dict[str, np.ndarray]]:
    """mapped_model's model as onnx's proto (a graph to rewrite before the session: onnx imported here)."""
    data, weights = mapped_model(path)
    return parse_model(data, path), weights


def parse_model(data: bytes, path: Path) -> onnx.ModelProto:
    """mapped_model's bytes (of the file at `path`, for the message) as onnx's proto."""
    import onnx
    from google.protobuf.message import DecodeError

    proto = onnx.ModelProto()
    try:
        proto.ParseFromString(data)
    except DecodeError as e:
        raise ArtifactError(f"{path} is not a readable ONNX model: {e or type(e).__name__}") from None
    return proto


def _mapped(path: Path) -> tuple[bytes, dict[str, np.ndarray]]:
    with open(path, "rb") as f:
        mapping = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)  # private pages: the arrays may be written
    buf = memoryview(mapping)
    out, weights = bytearray(), {}
    for number, kind, start, end, field_start in wire.fields(buf, 0, len(buf)):
        if number != MODEL_GRAPH or kind != wire.LENGTH_DELIMITED:
            out += buf[field_start:end]
            continue
        graph = bytearray()
        for g, gkind, a, b, g_start in wire.fields(buf, start, end):
            tensor = _external(buf, mapping, a, b, weights) \
                if g == GRAPH_INITIALIZER and gkind == wire.LENGTH_DELIMITED and b - a >= MAPPED_MIN_BYTES else None
            graph += buf[g_start:b] if tensor is None else _delimited(GRAPH_INITIALIZER, tensor)
        out += _delimited(MODEL_GRAPH, graph)
    return bytes(out), weights


def _external(buf: memoryview, mapping: mmap.mmap, start: int, end: int, weights: dict[str, np.ndarray]) -> bytes | None:
    """The TensorProto at buf[start:end] without its raw_data, saying its data is IN_MEMORY, its array added to
    `weights`; None for one left as it is (typed fields or external data, or a type NumPy does not hold as raw)."""
    rest, raw, dims, data_type, name = bytearray(), None, [], None, None
    for number, kind, a, b, field_start in wire.fields(buf, start, end):
        if number == TENSOR_RAW_DATA and kind == wire.LENGTH_DELIMITED:
            raw = (a, b)
            continue
        rest += buf[field_start:b]
        if number == TENSOR_DIMS and kind == 0:
            dims.append(wire.varint(buf, a, b)[0])
        elif number == TENSOR_DIMS and kind == wire.LENGTH_DELIMITED:  # packed
            i = a
            while i < b:
                value, i = wire.varint(buf, i, b)
                dims.append(value)
        elif number == TENSOR_DATA_TYPE and kind == 0:
            data_type = wire.varint(buf, a, b)[0]
        elif number == TENSOR_NAME and kind == wire.LENGTH_DELIMITED:
            name = bytes(buf[a:b]).decode()
    if raw is None or name is None or data_type not in DTYPES:
        return None
    dtype = np.dtype(DTYPES[data_type])
    count = (raw[1] - raw[0]) // dtype.itemsize
    array = np.frombuffer(mapping, dtype=dtype, count=count, offset=raw[0]).reshape(tuple(dims))
    # Unaligned bytes stay where they are when large (matmul weights, which ONNX Runtime packs into its own
    # buffers, and embeddings, which it gathers and transposes): copying 400 MB of them took 0.9 s of page faults
    # in a fresh process. Small ones (biases, norms), which elementwise kernels read directly, are copied.
    aligned = raw[0] % dtype.itemsize == 0 or array.nbytes >= UNALIGNED_VIEW_MIN_BYTES
    weights[name] = array if aligned else array.copy()
    rest += _varint(TENSOR_DATA_LOCATION << 3) + _varint(EXTERNAL)
    rest += _delimited(TENSOR_EXTERNAL_DATA, _delimited(ENTRY_KEY, b"location") + _delimited(ENTRY_VALUE, IN_MEMORY.encode()))
    return bytes(rest)


def _varint(value: int) -> bytes:
    out = bytearray()
    while True:
        byte = value & 0x7F
        value >>= 7
        if value:
            out.append(byte | 0x80)
        else:
            out.append(byte)
            return bytes(out)


def _delimited(number: int, value: bytes | bytearray) -> bytes:
    """A length-delimited field (a message, bytes, a string) on the wire."""
    return _varint(number << 3 | wire.LENGTH_DELIMITED) + _varint(len(value)) + bytes(value)
