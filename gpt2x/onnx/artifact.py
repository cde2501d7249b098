"""The export folder's contract, written by build.py and read by every runtime (no torch here):

    model.onnx            the graph (+ model.onnx.data when the weights pass 2 GB)
    gpt2x.json            metadata: format version, source, config, precision, versions, hashes, parity
    config.json, tokenizer.json, genai_config.json, ...
                          what Optimum, transformers(.js) and onnxruntime-genai read (interop.py)

`read_export` checks the metadata and every file's sha256 on load; `ExportInfo` is what it returns.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

import onnx
from onnx.external_data_helper import uses_external_data

from ..choices import Precision
from ..errors import ArtifactError
from ..fileio import sha256
from ..model.config import GPT2Config
from ..tokenizer import BPE_SHA256

FORMAT = "gpt2x-onnx"
FORMAT_VERSION = 1
MODEL_FILE = "model.onnx"
DATA_FILE = "model.onnx.data"
METADATA_FILE = "gpt2x.json"
DEFAULT_OPSET = 18
IR_VERSION = 10  # onnx 1.23 writes IR 12 by default; ONNX Runtime 1.20+ reads up to 10
EXTERNAL_DATA_BYTES = 1_800_000_000  # protobuf's 2 GB limit, with margin
EXTERNAL_MIN_BYTES = 1024  # with external data, tensors from this size on go to the data file


def default_export_dir(model_name: str, precision: Precision, root: Path = Path("exported")) -> Path:
    safe = model_name.strip("/").replace("/", "--").replace(os.sep, "--").replace(":", "-").lstrip(".-~") or "model"
    return root / f"{safe}-{precision.value}"


def is_export(folder: Path) -> bool:
    """Whether `folder` holds a finished export (its metadata file; read_export checks the rest)."""
    return (Path(folder) / METADATA_FILE).is_file()


def attention_layout(ops: dict[str, int]) -> dict:
    """How the runtime may hold the KV cache of a graph with these operators (stored in gpt2x.json)."""
    gqa = bool(ops.get("GroupQueryAttention"))
    return {
        "op": "GroupQueryAttention" if gqa else "MultiHeadAttention",
        # past and present may be one fixed-capacity buffer, updated in place (optimize.mha_to_gqa)
        "shared_kv_buffer": gqa,
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


def read_export(folder: Path, verify_hashes: bool = True) -> ExportInfo:
    """Open an export folder and check its metadata and files; clear errors for each mismatch."""
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
    for name, want in meta["files"].items():
        path = folder / name
        if not path.is_file():
            raise ArtifactError(f"{folder}: {name} is missing")
        if verify_hashes and sha256(path) != want:
            raise ArtifactError(f"{folder}: {name} is corrupt or changed since export (sha256 mismatch)")
    check_external_data(folder / MODEL_FILE)
    try:
        info = ExportInfo(folder, meta)
        info.config, info.precision  # noqa: B018  (validate)
    except (TypeError, ValueError) as e:
        raise ArtifactError(f"{meta_path}: invalid metadata ({e})") from None
    return info


def check_external_data(model_path: Path) -> None:
    """External-data references must name files inside the export folder, and those files must exist."""
    try:
        proto = onnx.load(str(model_path), load_external_data=False)
    except Exception as e:  # protobuf's DecodeError and onnx's own errors for truncated files
        raise ArtifactError(f"{model_path}: not a readable ONNX file ({type(e).__name__})") from None
    folder = model_path.parent.resolve()
    for tensor in proto.graph.initializer:
        if not uses_external_data(tensor):
            continue
        location = next((e.value for e in tensor.external_data if e.key == "location"), "")
        target = (folder / location).resolve()
        if target.parent != folder:
            raise ArtifactError(f"{model_path}: external data {location!r} points outside the export folder; refused")
        if not target.is_file():
            raise ArtifactError(f"{model_path}: external data file {location} is missing")


def save_onnx(proto: onnx.ModelProto, path: Path) -> None:
    """Save, with the weights in `<name>.data` beside the graph when they pass protobuf's 2 GB."""
    total = sum(len(t.raw_data) for t in proto.graph.initializer)
    if total >= EXTERNAL_DATA_BYTES:
        onnx.save_model(proto, str(path), save_as_external_data=True, all_tensors_to_one_file=True,
                        location=path.name + ".data", size_threshold=EXTERNAL_MIN_BYTES)
    else:
        onnx.save_model(proto, str(path))
