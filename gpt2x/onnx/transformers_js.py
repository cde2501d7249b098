"""A folder that transformers.js loads from a local path, made from one model's fp32, int8 and int4 exports (no
torch): the graphs copied byte for byte (sha256 checked), config.json with "transformers.js_config", the
tokenizer files and gpt2x-transformers-js.json (the layout and why: docs/commands/export.md).
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

from ..choices import Precision, Progress, no_progress
from ..errors import ArtifactError, UsageError
from ..fileio import folder_written_whole, sha256, write_atomic
from ..version import __version__
from . import interop
from .artifact import MODEL_FILE, ExportInfo, exports_root, external_data_locations, safe_model_name

ONNX_FOLDER = "onnx"
# transformers.js's dtype for each gpt2x precision, and the file name it loads for it
# (onnx/model{suffix}.onnx: "" for fp32, "_quantized" for q8, "_q4" for q4).
DTYPES = {Precision.fp32: "fp32", Precision.int8: "q8", Precision.int4: "q4"}
ONNX_FILES = {Precision.fp32: f"{ONNX_FOLDER}/model.onnx", Precision.int8: f"{ONNX_FOLDER}/model_quantized.onnx",
              Precision.int4: f"{ONNX_FOLDER}/model_q4.onnx"}
SOURCES_FILE = "gpt2x-transformers-js.json"
FORMAT = "gpt2x-transformers.js"
FORMAT_VERSION = 1
TOP_FILES = (interop.HF_CONFIG_FILE, interop.GENERATION_CONFIG_FILE, interop.TOKENIZER_FILE,
             interop.TOKENIZER_CONFIG_FILE, interop.SPECIAL_TOKENS_FILE)
ALL_PRECISIONS = tuple(DTYPES)


@dataclass
class TransformersJsFolder:
    """A written transformers.js folder: where it is, its files (relative paths), its metadata."""

    folder: Path
    files: list[str]
    meta: dict


def default_layout_dir(model_name: str, root: Path | None = None) -> Path:
    """<exports>/<model>-transformers.js, as default_export_dir names an export."""
    return (exports_root() if root is None else Path(root)) / f"{safe_model_name(model_name)}-transformers.js"


def _model_identity(info: ExportInfo) -> tuple:
    model = info.meta.get("model") or {}
    return model.get("name"), model.get("revision"), model.get("weights_sha256")


def check_precisions(precisions: Sequence[Precision]) -> list[Precision]:
    """The precisions of a transformers.js folder, in fp32, int8, int4 order: at least one, each once, no fp16."""
    precisions = [Precision(p) for p in precisions]
    if not precisions:
        raise UsageError("no precisions given: a transformers.js folder holds one or more of fp32, int8, int4")
    for p in precisions:
        if p not in DTYPES:
            raise UsageError(f"a transformers.js folder takes {', '.join(d.value for d in DTYPES)} graphs, not {p.value}",
                             option="precision")
        if precisions.count(p) > 1:
            raise UsageError(f"{p.value} given twice; a transformers.js folder holds one graph per precision", option="precision")
    return [p for p in DTYPES if p in precisions]


def check_sources(exports: Sequence[ExportInfo]) -> list[ExportInfo]:
    """The exports in fp32, int8, int4 order, checked to make one folder: each precision at most once, no fp16,
    one model, no external data."""
    exports = list(exports)
    if not exports:
        raise UsageError("no exports given: a transformers.js folder needs at least one of fp32, int8, int4")
    seen: dict[Precision, ExportInfo] = {}
    for info in exports:
        if info.precision not in DTYPES:
            raise UsageError(f"{info.folder} is a {info.precision.value} export; a transformers.js folder takes "
                             f"{', '.join(p.value for p in DTYPES)} exports")
        if info.precision in seen:
            raise UsageError(f"two {info.precision.value} exports given ({seen[info.precision].folder} and {info.folder}); "
                             "a transformers.js folder holds one per precision")
        seen[info.precision] = info
    first = exports[0]
    for info in exports[1:]:
        if info.config != first.config or _model_identity(info) != _model_identity(first):
            raise ArtifactError(f"{info.folder} and {first.folder} are exports of different models "
                                f"({info.meta['model'].get('name')!r}, {first.meta['model'].get('name')!r}); "
                                "a transformers.js folder holds one model")
    for info in exports:
        try:
            external = external_data_locations(info.model_path)
        except (OSError, ValueError) as e:
            raise ArtifactError(f"{info.model_path}: not a readable ONNX file ({e})") from None
        if external:
            raise ArtifactError(f"{info.folder}: its weights are in external data ({', '.join(sorted(external))}, "
                                "a model over 2 GB); transformers.js folders are written for single-file graphs only")
    return [seen[p] for p in DTYPES if p in seen]


def hf_config_for_transformers_js(exports: Sequence[ExportInfo]) -> dict:
    """config.json: interop.hf_config, plus the dtype transformers.js loads when none is asked for."""
    default = exports[0].precision if all(i.precision is not Precision.fp32 for i in exports) else Precision.fp32
    return interop.hf_config(exports[0].config) | {"transformers.js_config": {"dtype": DTYPES[default]}}


def _copy_checked(info: ExportInfo, dest: Path) -> str:
    """Copy the export's graph to `dest`; its sha256, which must be the one the export recorded."""
    want = info.meta["files"].get(MODEL_FILE)
    shutil.copyfile(info.model_path, dest)
    got = sha256(dest)
    if want is not None and got != want:
        raise ArtifactError(f"{info.folder}: {MODEL_FILE} is corrupt or changed since export (sha256 mismatch)")
    return got


def write_transformers_js(exports: Sequence[ExportInfo], out: Path, force: bool = False,
                          progress: Progress = no_progress) -> TransformersJsFolder:
    """Write the folder of `exports` to `out`, whole or not at all; an existing `out` only when `force`."""
    exports = check_sources(exports)
    out = Path(out)
    with folder_written_whole(out, force, f"writing {out}") as tmp:
        (tmp / ONNX_FOLDER).mkdir()
        cfg = exports[0].config
        contents = {
            interop.HF_CONFIG_FILE: hf_config_for_transformers_js(exports),
            interop.GENERATION_CONFIG_FILE: interop.generation_config(),
            interop.TOKENIZER_FILE: interop.tokenizer_json(),
            interop.TOKENIZER_CONFIG_FILE: interop.tokenizer_config(cfg, interop.chat_template_of(exports[0].folder)),
            interop.SPECIAL_TOKENS_FILE: interop.special_tokens_map(),
        }
        for name, data in contents.items():
            write_atomic(tmp / name, json.dumps(data, indent=2, ensure_ascii=False) + "\n")
        graphs = {}
        for info in exports:
            name = ONNX_FILES[info.precision]
            progress(f"copying {info.model_path} to {name}")
            graphs[name] = {
                "dtype": DTYPES[info.precision],
                "precision": info.precision.value,
                "source": str(info.folder.resolve()),
                "source_created": info.meta.get("created"),
                "sha256": _copy_checked(info, tmp / name),
                "fused_operators": info.meta.get("fused_operators"),
            }
        meta = {
            "format": FORMAT,
            "format_version": FORMAT_VERSION,
            "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            "gpt2x": __version__,
            "model": exports[0].meta.get("model"),
            "config": cfg.to_dict(),
            "default_dtype": contents[interop.HF_CONFIG_FILE]["transformers.js_config"]["dtype"],
            "onnx": graphs,
            "files": {name: sha256(tmp / name) for name in TOP_FILES},
        }
        write_atomic(tmp / SOURCES_FILE, json.dumps(meta, indent=1) + "\n")
        files = sorted(str(p.relative_to(tmp)) for p in tmp.rglob("*") if p.is_file())
    return TransformersJsFolder(out, files, meta)


def read_sources(folder: Path) -> dict:
    """The metadata of a transformers.js folder written here (ArtifactError when there is none)."""
    path = Path(folder) / SOURCES_FILE
    try:
        meta = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ArtifactError(f"{folder}: no {SOURCES_FILE}; not a transformers.js folder written by gpt2x") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ArtifactError(f"{path}: unreadable metadata ({e})") from None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        raise ArtifactError(f"{path}: not gpt2x transformers.js metadata")
    return meta
