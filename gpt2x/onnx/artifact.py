"""The export folder's contract (model.onnx [+ model.onnx.data], gpt2x.json, the interop files), written by
build.py and read by every runtime (no torch). `read_export` checks sizes and external data without parsing the
weights, so opening an export costs only ONNX Runtime's own load; `verify_export` adds every sha256.
"""

from __future__ import annotations

import json
import mmap
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from ..choices import Precision
from ..errors import ArtifactError
from ..fileio import sha256
from ..model.config import GPT2Config
from ..tokenizer import BPE_SHA256
from . import wire
from .names import IN_PLACE_KV

if TYPE_CHECKING:  # onnx is imported where a graph is written, not by reading an export (wire.py says why)
    import onnx

FORMAT = "gpt2x-onnx"
FORMAT_VERSION = 1
MODEL_FILE = "model.onnx"
DATA_FILE = "model.onnx.data"
METADATA_FILE = "gpt2x.json"
DEFAULT_OPSET = 18
# How the quantized exports store their weights (onnx/optimize.py writes them so; the roofline reads them).
INT8_BLOCK = 128  # weights per quantization scale along the input dimension
INT4_BLOCK = 32
INT4_HEAD_BITS = 8  # the tied unembedding's bits: 8 (int8's settings) or 4 (like the blocks)
IR_VERSION = 10  # onnx 1.23 writes IR 12 by default; ONNX Runtime 1.20+ reads up to 10
EXTERNAL_DATA_BYTES = 1_800_000_000  # protobuf's 2 GB limit, with margin
EXTERNAL_MIN_BYTES = 1024  # with external data, tensors from this size on go to the data file
EXPORTS_ENV = "GPT2X_EXPORTS"  # the folder of the exports made by model name (exports_root)
# fp32 and int8 exports: OpenVINO's prefill graph (onnx/openvino_prefill.py) and its record in gpt2x.json, kept only when it
# passed its own gate (docs/export.md, the OpenVINO prefill).
PREFILL_XML = "openvino/prefill.xml"
PREFILL_BIN = "openvino/prefill.bin"
PREFILL_KEY = "openvino_prefill"
F32, BF16 = "f32", "bf16"  # the compute precisions a prefill graph is gated and recorded at (`inference_precision`)
# int8 exports: a second decode graph, quantized by ONNX Runtime's quantize_dynamic (per-channel int8, MLAS's QGEMM),
# for steps of many rows x new tokens, and its record in gpt2x.json, kept only when it passed the export's gate
# (docs/export.md, the batched decode graph).
BATCHED_FILE = "model_batched.onnx"
BATCHED_KEY = "batched_decode"
KV_SCALES_FILE = "kv_scales.safetensors"  # the int8 KV cache's scales (onnx/kvcache.py)
KV_KEY = "kv_cache"  # their record in gpt2x.json
PAGED_KV_KEY = "paged"  # in that record, OpenVINO's own u8 cache on the paged slots, gated beside the scales
INT8_KV_PRECISIONS = (Precision.int8, Precision.int4)  # GroupQueryAttention graphs: the operator quantizes the cache
# The precisions whose exports get the scales only where asked (gpt2x export --int8-kv): fp32's cache then computes in
# fp32 from int8 keys and values, a gate of its own (evaluate.parity.INT8_KV_ON_FP32), on its GroupQueryAttention twin.
INT8_KV_ASKED_PRECISIONS = (Precision.fp32,)
INT8_KV_ANY_PRECISIONS = INT8_KV_PRECISIONS + INT8_KV_ASKED_PRECISIONS  # those that may hold the scales at all


def safe_model_name(model_name: str) -> str:
    """A model name (a path, a hub id, random:NAME) as one safe folder-name part."""
    return model_name.strip("/").replace("/", "--").replace(os.sep, "--").replace(":", "-").lstrip(".-~") or "model"


def exports_root() -> Path:
    """GPT2X_EXPORTS, else gpt2x/exported in the user's cache; absolute, so every working directory finds them."""
    named = os.environ.get(EXPORTS_ENV)
    if named:
        return Path(named).expanduser().resolve()
    cache = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return (Path(cache).expanduser() / "gpt2x" / "exported").resolve()


def default_export_dir(model_name: str, precision: Precision, root: Path | None = None) -> Path:
    """<root>/<model>-<precision>, root being exports_root() unless given."""
    return (exports_root() if root is None else Path(root)) / f"{safe_model_name(model_name)}-{precision.value}"


def is_export(folder: Path) -> bool:
    """Whether `folder` holds a finished export (its metadata file; read_export checks the rest)."""
    return (Path(folder) / METADATA_FILE).is_file()


def attention_layout(ops: dict[str, int]) -> dict:
    """How the runtime may hold the KV cache of a graph with these operators (stored in gpt2x.json)."""
    gqa = bool(ops.get("GroupQueryAttention"))
    return {
        "op": "GroupQueryAttention" if gqa else "MultiHeadAttention",
        # past and present may be one fixed-capacity buffer, updated in place (optimize.mha_to_gqa)
        IN_PLACE_KV: gqa,
        # a step of several tokens on top of a past may have batch > 1
        "batched_multi_token_past": not gqa,
    }


@dataclass
class ExportInfo:
    """What gpt2x.json holds, read back and checked."""

    folder: Path
    meta: dict

    @property
    def config(self) -> GPT2Config:
        return GPT2Config.from_dict(self.meta["config"])

    @property
    def precision(self) -> Precision:
        return Precision(self.meta["precision"])

    @property
    def model_path(self) -> Path:
        return self.folder / MODEL_FILE

    @property
    def attention(self) -> dict:
        return self.meta.get("attention") or attention_layout(self.meta.get("fused_operators", {}))

    def _kept(self, key: str) -> dict | None:
        """The record under `key` of a graph the export kept beside model.onnx, else None."""
        record = self.meta.get(key)
        return record if isinstance(record, dict) and record.get("kept") else None

    @property
    def prefill(self) -> dict | None:
        """The OpenVINO prefill graph's record (files, parity, timings) when the export kept one, else None."""
        return self._kept(PREFILL_KEY)

    @property
    def prefill_path(self) -> Path:
        return self.folder / PREFILL_XML

    @property
    def batched(self) -> dict | None:
        """The batched decode graph's record (parity, timings, batched_from) when the export kept one, else None."""
        return self._kept(BATCHED_KEY)

    @property
    def batched_path(self) -> Path:
        return self.folder / BATCHED_FILE

    @property
    def int8_kv(self) -> dict | None:
        """The int8 KV cache's record (parity, timings, whether the runtime uses it) when the export kept its scales,
        else None."""
        return self._kept(KV_KEY)

    @property
    def paged_int8_kv(self) -> dict | None:
        """The record of OpenVINO's u8 KV cache on the paged slots (an fp32 export with its int8 KV cache and its
        OpenVINO prefill graph, evaluate.kvcache.gate_paged_int8_kv) where it passed its gate, else None."""
        record = (self.int8_kv or {}).get(PAGED_KV_KEY)
        return record if isinstance(record, dict) and record.get("kept") else None


def read_export(folder: Path, verify_hashes: bool = False) -> ExportInfo:
    """Open an export folder, checking its metadata, its files' sizes (where recorded) and that external data stays
    inside it; with `verify_hashes`, every sha256 too."""
    meta_path = folder / METADATA_FILE
    if not folder.is_dir():
        raise ArtifactError(f"no export at {folder} (run `gpt2x export` first)")
    if not meta_path.is_file():
        raise ArtifactError(f"{folder}: no {METADATA_FILE}; not a gpt2x export (or an interrupted one)")
    try:
        meta = json.loads(meta_path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ArtifactError(f"{meta_path}: unreadable metadata ({e})") from None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        raise ArtifactError(f"{meta_path}: not gpt2x export metadata")
    if meta.get("format_version") != FORMAT_VERSION:
        raise ArtifactError(
            f"{folder}: export format version {meta.get('format_version')} but this gpt2x reads version "
            f"{FORMAT_VERSION}; export it again, replacing the folder"
        )
    for key in ("config", "precision", "files", "tokenizer"):
        if key not in meta:
            raise ArtifactError(f"{meta_path}: metadata lacks {key!r}")
    if meta["tokenizer"] != BPE_SHA256:
        raise ArtifactError(f"{folder}: exported with a different tokenizer than this gpt2x ships")
    sizes = meta.get("sizes") or {}
    for name, want in meta["files"].items():
        if Path(name).is_absolute() or ".." in Path(name).parts:
            raise ArtifactError(f"{meta_path}: file {name!r} points outside the export folder; refused")
        path = folder / name
        if not path.is_file():
            raise ArtifactError(f"{folder}: {name} is missing")
        if name in sizes and path.stat().st_size != sizes[name]:
            raise ArtifactError(f"{folder}: {name} is corrupt or changed since export "
                                f"({path.stat().st_size} bytes, {sizes[name]} at export)")
        if verify_hashes and sha256(path) != want:
            raise ArtifactError(f"{folder}: {name} is corrupt or changed since export (sha256 mismatch)")
    check_external_data(folder / MODEL_FILE)
    try:
        info = ExportInfo(folder, meta)
        info.config, info.precision  # noqa: B018  (validate)
    except (TypeError, ValueError) as e:
        raise ArtifactError(f"{meta_path}: invalid metadata ({e})") from None
    return info


def verify_export(folder: Path) -> ExportInfo:
    """read_export, and every file's sha256 against the one recorded at export time."""
    return read_export(folder, verify_hashes=True)


def export_files(folder: Path) -> list[Path]:
    """Every file of an export being written, sub-folders' included (the prefill graph's), in a stable order."""
    return sorted(p for p in folder.rglob("*") if p.is_file())


def file_name(folder: Path, path: Path) -> str:
    """A file's name in gpt2x.json: its path inside the folder, with forward slashes."""
    return path.relative_to(folder).as_posix()


def weights_beside(model_path: Path) -> bool:
    """Whether the graph at `model_path` keeps its weights in a data file beside it (its name + ".data")."""
    return Path(model_path).with_name(Path(model_path).name + ".data").exists()


def check_external_data(model_path: Path) -> None:
    """External-data references must name existing files inside the export folder."""
    try:
        locations = external_data_locations(model_path)
    except (OSError, ValueError) as e:
        raise ArtifactError(f"{model_path}: not a readable ONNX file ({e})") from None
    folder = model_path.parent.resolve()
    for location in sorted(locations):
        target = (folder / location).resolve()
        if target.parent != folder:
            raise ArtifactError(f"{model_path}: external data {location!r} points outside the export folder; refused")
        if not target.is_file():
            raise ArtifactError(f"{model_path}: external data file {location} is missing")


# ---------------------------------------------------------------- the graph's external data, from the wire format
# onnx.load parses every weight (~1 s for GPT-2 124M, every start) to read a few strings; on the wire a weight is a
# length and a jump. Every place a model can hold a tensor is walked; field numbers are onnx.proto's (wire.FIELDS).


_number = wire.field

_MODEL_GRAPH, _MODEL_FUNCTIONS = _number("ModelProto", "graph"), _number("ModelProto", "functions")
_GRAPH_NODES, _GRAPH_INITS = _number("GraphProto", "node"), _number("GraphProto", "initializer")
_GRAPH_SPARSE = _number("GraphProto", "sparse_initializer")
_FUNCTION_NODES = _number("FunctionProto", "node")
_NODE_ATTRS = _number("NodeProto", "attribute")
_ATTR_TENSORS = {_number("AttributeProto", f) for f in ("t", "tensors")}
_ATTR_GRAPHS = {_number("AttributeProto", f) for f in ("g", "graphs")}
_ATTR_SPARSE = {_number("AttributeProto", f) for f in ("sparse_tensor", "sparse_tensors")}
_SPARSE_TENSORS = {_number("SparseTensorProto", f) for f in ("values", "indices")}
_TENSOR_EXTERNAL = _number("TensorProto", "external_data")
_ENTRY_KEY, _ENTRY_VALUE = _number("StringStringEntryProto", "key"), _number("StringStringEntryProto", "value")


def _fields(buf, start: int, end: int) -> Iterator[tuple[int, int, int]]:
    """(field number, start, end) of every length-delimited field in buf[start:end]; the others stepped over."""
    for field, kind, a, b, _ in wire.fields(buf, start, end):
        if kind == wire.LENGTH_DELIMITED:
            yield field, a, b


def _tensor_locations(buf, start: int, end: int, out: set[str]) -> None:
    for field, a, b in _fields(buf, start, end):
        if field == _TENSOR_EXTERNAL:
            entry = {f: bytes(buf[x:y]).decode("utf-8", "replace") for f, x, y in _fields(buf, a, b)}
            if entry.get(_ENTRY_KEY) == "location":
                out.add(entry.get(_ENTRY_VALUE, ""))


def _node_locations(buf, start: int, end: int, out: set[str]) -> None:
    for field, a, b in _fields(buf, start, end):
        if field != _NODE_ATTRS:
            continue
        for f, x, y in _fields(buf, a, b):
            if f in _ATTR_TENSORS:
                _tensor_locations(buf, x, y, out)
            elif f in _ATTR_GRAPHS:
                _graph_locations(buf, x, y, out)
            elif f in _ATTR_SPARSE:
                for g, u, v in _fields(buf, x, y):
                    if g in _SPARSE_TENSORS:
                        _tensor_locations(buf, u, v, out)


def _graph_locations(buf, start: int, end: int, out: set[str]) -> None:
    for field, a, b in _fields(buf, start, end):
        if field == _GRAPH_INITS:
            _tensor_locations(buf, a, b, out)
        elif field == _GRAPH_NODES:
            _node_locations(buf, a, b, out)
        elif field == _GRAPH_SPARSE:
            for g, u, v in _fields(buf, a, b):
                if g in _SPARSE_TENSORS:
                    _tensor_locations(buf, u, v, out)


def external_data_locations(model_path: Path) -> set[str]:
    """Every external-data `location` in the ONNX file; ValueError for a malformed protobuf."""
    with open(model_path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        if size == 0:
            raise ValueError("empty file")
        with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
            out: set[str] = set()
            graphs = 0
            for field, a, b in _fields(buf, 0, size):
                if field == _MODEL_GRAPH:
                    graphs += 1
                    _graph_locations(buf, a, b, out)
                elif field == _MODEL_FUNCTIONS:
                    for g, u, v in _fields(buf, a, b):
                        if g == _FUNCTION_NODES:
                            _node_locations(buf, u, v, out)
            if not graphs:
                raise ValueError("no graph")
            return out


def needs_external_data(proto: onnx.ModelProto) -> bool:
    """Whether `proto`'s weights pass what protobuf holds in one file (save_onnx writes them beside it)."""
    return sum(len(t.raw_data) for t in proto.graph.initializer) >= EXTERNAL_DATA_BYTES


def save_onnx(proto: onnx.ModelProto, path: Path) -> None:
    """Save, with the weights in `<name>.data` beside the graph when they pass protobuf's 2 GB."""
    import onnx  # the export's (wire.py: reading an export imports none)

    if needs_external_data(proto):
        onnx.save_model(proto, str(path), save_as_external_data=True, all_tensors_to_one_file=True,
                        location=path.name + ".data", size_threshold=EXTERNAL_MIN_BYTES)
    else:
        onnx.save_model(proto, str(path))
