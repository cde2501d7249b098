"""The whole export: trace, fuse, convert or quantize, write the interop files and metadata, gate, and only then
move the folder into place (a failed export leaves nothing). The gate is handed in: this layer builds
artifacts and does not judge them."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from datetime import datetime, timezone
from pathlib import Path

import onnx
import onnxruntime
import onnxscript
import torch

from .. import __version__
from ..choices import Precision, Progress, no_progress
from ..fileio import folder_written_whole, sha256
from ..model.checkpoints import ModelSource, weights_fingerprint
from ..model.gpt2 import GPT2
from ..tokenizer import BPE_SHA256
from . import names as io
from .artifact import (
    DEFAULT_OPSET,
    FORMAT,
    FORMAT_VERSION,
    IR_VERSION,
    METADATA_FILE,
    MODEL_FILE,
    ExportInfo,
    attention_layout,
)
from .interop import write_interop_files
from .optimize import INT4_HEAD_BITS, fuse, quantize_int4, quantize_int8
from .trace import trace_to_onnx

# Returns the parity record stored in gpt2x.json, or raises ParityError to stop the export.
Gate = Callable[[ExportInfo], dict]
NOT_CHECKED = "not checked (exported without the parity gate)"


def versions() -> dict[str, str]:
    return {"gpt2x": __version__, "torch": torch.__version__, "onnx": onnx.__version__,
            "onnxruntime": onnxruntime.__version__, "onnxscript": onnxscript.__version__}


def export(
    model: GPT2,
    source: ModelSource,
    out: Path,
    precision: Precision = Precision.fp32,
    opset: int = DEFAULT_OPSET,
    force: bool = False,
    gate: Gate | None = None,
    progress: Progress = no_progress,
) -> ExportInfo:
    """Export, run `gate` on the finished folder (None: recorded as not checked), then move it into place."""
    out = Path(out)
    with folder_written_whole(out, force, f"export to {out}") as tmp:
        work = tmp / "work"
        work.mkdir()
        progress("tracing the model to ONNX")
        trace_to_onnx(model.float().eval(), work / "raw.onnx", opset)
        progress("fusing with ONNX Runtime's transformer optimizer")
        fused = work / "fused.onnx"
        quantized = precision in (Precision.int8, Precision.int4)
        ops = fuse(work / "raw.onnx", fused if quantized else tmp / MODEL_FILE, model.config, precision)
        if precision is Precision.int8:
            progress("quantizing MatMul weights to int8")
            ops = quantize_int8(fused, tmp / MODEL_FILE)
        elif precision is Precision.int4:
            progress(f"quantizing MatMul weights to int4 (the unembedding to int{INT4_HEAD_BITS})")
            ops = quantize_int4(fused, tmp / MODEL_FILE)
        shutil.rmtree(work)
        # config.json, tokenizer.json, genai_config.json ...: the folder loads in Optimum and genai too.
        attention = attention_layout(ops)
        write_interop_files(tmp, model.config, genai_provider="cuda" if precision is Precision.fp16 else None,
                            share_buffer=io.in_place_kv(attention))
        files = {p.name: sha256(p) for p in sorted(tmp.iterdir())}  # checked by `gpt2x verify`
        sizes = {p.name: p.stat().st_size for p in sorted(tmp.iterdir())}  # checked on every load
        meta = {
            "format": FORMAT,
            "format_version": FORMAT_VERSION,
            "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            "model": {"name": source.name, "kind": source.kind, "revision": source.revision,
                      "weights_sha256": weights_fingerprint(source)},
            "config": model.config.to_dict(),
            "precision": precision.value,
            "opset": opset,
            "ir_version": IR_VERSION,
            "versions": versions(),
            "files": files,
            "sizes": sizes,
            "tokenizer": BPE_SHA256,
            "io": {"inputs": io.input_names(model.config.n_layer), "outputs": io.output_names(model.config.n_layer)},
            "fused_operators": ops,
            "attention": attention,
        }
        info = ExportInfo(tmp, meta)
        if gate is not None:
            progress("checking parity against PyTorch")
            meta["parity"] = gate(info)
        else:
            meta["parity"] = {"status": NOT_CHECKED}
        (tmp / METADATA_FILE).write_text(json.dumps(meta, indent=1) + "\n")
    return ExportInfo(out, meta)
