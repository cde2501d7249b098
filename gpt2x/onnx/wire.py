"""Protobuf's wire format, read directly: an ONNX file's fields walked without parsing its weights (onnx.load copies
every one). The field numbers are onnx.proto's (`FIELDS`), written here so that reading an export imports no onnx
(its import, ml_dtypes', took 0.8-2 s of every command's start); a field's number never changes in protobuf, and
tests/onnx/test_wire.py checks each against onnx's own descriptors (`number`)."""

from __future__ import annotations

from collections.abc import Iterator

LENGTH_DELIMITED = 2


# (message, field) -> its number in onnx.proto: what the readers of an export walk.
FIELDS = {
    ("ModelProto", "graph"): 7, ("ModelProto", "functions"): 25,
    ("GraphProto", "node"): 1, ("GraphProto", "initializer"): 5, ("GraphProto", "sparse_initializer"): 15,
    ("FunctionProto", "node"): 7, ("NodeProto", "attribute"): 5,
    ("AttributeProto", "t"): 5, ("AttributeProto", "tensors"): 10, ("AttributeProto", "g"): 6,
    ("AttributeProto", "graphs"): 11, ("AttributeProto", "sparse_tensor"): 22, ("AttributeProto", "sparse_tensors"): 23,
    ("SparseTensorProto", "values"): 1, ("SparseTensorProto", "indices"): 2,
    ("TensorProto", "dims"): 1, ("TensorProto", "data_type"): 2, ("TensorProto", "name"): 8,
    ("TensorProto", "raw_data"): 9, ("TensorProto", "external_data"): 13, ("TensorProto", "data_location"): 14,
    ("StringStringEntryProto", "key"): 1, ("StringStringEntryProto", "value"): 2,
}


def field(message: str, name: str) -> int:
    """The number of field `name` of onnx.proto's `message` ("ModelProto", ...)."""
    return FIELDS[message, name]


def number(message, field: str) -> int:
    """The field number of `field` in the protobuf message class `message` (onnx.ModelProto, ...)."""
    return message.DESCRIPTOR.fields_by_name[field].number


def varint(buf, i: int, end: int) -> tuple[int, int]:
    """The varint at buf[i] and the index after it; ValueError past `end`."""
    value, shift = 0, 0
    while True:
        if i >= end or shift > 63:
            raise ValueError("truncated or malformed protobuf")
        byte = buf[i]
        value |= (byte & 0x7F) << shift
        i += 1
        if byte < 0x80:
            return value, i
        shift += 7


def fields(buf, start: int, end: int) -> Iterator[tuple[int, int, int, int, int]]:
    """(field number, wire type, value start, value end, field start) of every field in buf[start:end]; a value's
    bytes are buf[value start:value end] for length-delimited fields (messages, bytes, strings)."""
    i = start
    while i < end:
        field_start = i
        key, i = varint(buf, i, end)
        field, wire = key >> 3, key & 7
        if wire == 0:
            after = varint(buf, i, end)[1]
        elif wire == 1:
            after = i + 8
        elif wire == 5:
            after = i + 4
        elif wire == LENGTH_DELIMITED:
            n, i = varint(buf, i, end)
            after = i + n
        else:
            raise ValueError(f"malformed protobuf (wire type {wire})")
        if field == 0 or after > end:
            raise ValueError("truncated or malformed protobuf")
        yield field, wire, i, after, field_start
        i = after
