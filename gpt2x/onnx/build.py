"""The whole export: trace, fuse, convert or quantize, write the interop files and metadata, gate, and only then
move the folder into place (a failed export leaves nothing). The gate is handed in: this layer builds
artifacts and does not judge them."""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable
from datetime import datetime, timezone
from importlib import resources
from pathlib import Path

import numpy as np
import onnx
import onnxruntime
import onnxscript
import torch

from ..choices import Precision, Progress, no_progress
from ..errors import ParityError, UsageError, missing_modules
from ..fileio import folder_written_whole, sha256
from ..model.checkpoints import ModelSource, weights_fingerprint
from ..model.gpt2 import GPT2
from ..tokenizer import BPE_SHA256
from ..version import __version__
from . import kvcache
from . import names as io
from . import openvino_prefill as ov_prefill  # imports neither openvino nor nncf
from .artifact import (
    BATCHED_FILE,
    BATCHED_KEY,
    BF16,
    DEFAULT_OPSET,
    F32,
    FORMAT,
    FORMAT_VERSION,
    INT8_KV_ASKED_PRECISIONS,
    INT8_KV_PRECISIONS,
    IR_VERSION,
    KV_KEY,
    KV_SCALES_FILE,
    METADATA_FILE,
    MODEL_FILE,
    PREFILL_KEY,
    PREFILL_XML,
    ExportInfo,
    attention_layout,
    export_files,
    file_name,
    needs_external_data,
    save_onnx,
)
from .interop import write_interop_files
from .optimize import INT4_HEAD_BITS, fuse, quantize_int4, quantize_int8, quantize_int8_dynamic
from .trace import trace_to_onnx

# Returns the parity record stored in gpt2x.json, or raises ParityError to stop the export.
Gate = Callable[[ExportInfo], dict]
NOT_CHECKED = "not checked (exported without the parity gate)"
# Whether an fp32, int8 or bf16 export gets OpenVINO's prefill graph when not said (1 or 0): it costs an export seconds
# (conversion, its gate, timing both prefills) and is of no use where every prefill runs on ONNX Runtime.
OPENVINO_PREFILL_ENV = "GPT2X_OPENVINO_PREFILL"
# Unset, int8 and bf16 exports get it and fp32 exports do not: an fp32 graph doubles the export's size (its f32 weights)
# and makes the export 3-4x longer (the first `gpt2x generate`, which decodes on ONNX Runtime), for a server on the
# paged slots in 0.6x the memory (benchmarks/results/serve-memory-fp32-paged-*) or a prefill 11-23% faster on ONNX
# Runtime's with AVX-512 (docs/results/engines.md); a bf16 export's
# prefills 1.5-2.2x faster on it than on model.onnx, both at bf16 (benchmarks/results/bf16-prefill-cpu-2core.md).
OPENVINO_PREFILL_BY_DEFAULT = (Precision.int8, Precision.bf16)


# Whether an int8 export gets the batched decode graph (BATCHED_FILE) when not said (1 or 0; unset: 1): it costs an
# export a second quantization, gate and timing, and the folder the graph's size.
BATCHED_DECODE_ENV = "GPT2X_BATCHED_DECODE"


# Whether an int8 or int4 export gets the int8 KV cache's scales (KV_SCALES_FILE) when not said (1 or 0; unset:
# 1): it costs an export a calibration forward, a gate and a timing.
INT8_KV_ENV = "GPT2X_INT8_KV"
# The scales' headroom over the largest |key| or |value| calibration saw at a channel: a value up to that much larger
# is stored unclipped, at 1/127 of the widened range. Fresh random rows reached 1.6-1.9x calibration's largest at a
# few channels (GPT-2 124M random and the bundled model, scratch): the tail grows with the tokens seen.
KV_MARGIN = 2.0


def _wanted(asked: bool | None, env: str, default: bool) -> bool:
    """`asked`, else the environment variable `env`'s 0 or 1, else `default`; one UsageError line for another value
    of `env` (even where asked)."""
    value = os.environ.get(env)
    if value not in (None, "0", "1"):
        raise UsageError(f"{env} must be 0 or 1, got {value!r}")
    if asked is not None:
        return asked
    return default if value is None else value == "1"


def openvino_prefill_wanted(asked: bool | None, precision: Precision = Precision.int8) -> bool:
    """`asked`, else GPT2X_OPENVINO_PREFILL's 0 or 1, else whether `precision` is in OPENVINO_PREFILL_BY_DEFAULT;
    one UsageError line for another value."""
    return _wanted(asked, OPENVINO_PREFILL_ENV, precision in OPENVINO_PREFILL_BY_DEFAULT)


def batched_decode_wanted(asked: bool | None) -> bool:
    """`asked`, else GPT2X_BATCHED_DECODE's 0 or 1, else yes (int8 exports only have the graph)."""
    return _wanted(asked, BATCHED_DECODE_ENV, True)


def int8_kv_wanted(asked: bool | None, precision: Precision = Precision.int8) -> bool:
    """Whether a `precision` export gets its int8 KV cache's scales: int8 and int4 `asked`, else GPT2X_INT8_KV's 0 or 1,
    else yes; fp32 only where `asked` (GPT2X_INT8_KV is the quantized exports' default); another precision never."""
    if precision in INT8_KV_ASKED_PRECISIONS:
        _wanted(asked, INT8_KV_ENV, False)  # a bad value is its own error here too
        return asked is True
    return precision in INT8_KV_PRECISIONS and _wanted(asked, INT8_KV_ENV, True)


# The OpenVINO prefill graph's gate and timings (evaluate.prefill): returns its record's parity and timings, or
# raises ParityError, and the graph is then dropped (the export goes on without it).
PrefillGate = Callable[[ExportInfo], dict]
# The batched decode graph's gate and timings (evaluate.batched): returns its record's parity, timings and
# batched_from, or raises ParityError, and the graph is then dropped.
BatchedGate = Callable[[ExportInfo], dict]
# The int8 KV cache's gate and timings (evaluate.kvcache): returns its record's parity, timings and whether the runtime
# uses it, or raises ParityError, and the scales are then dropped.
KvGate = Callable[[ExportInfo], dict]


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
    prefill_gate: PrefillGate | None = None,
    openvino_prefill: bool | None = None,
    batched_gate: BatchedGate | None = None,
    batched_decode: bool | None = None,
    kv_gate: KvGate | None = None,
    int8_kv: bool | None = None,
    chat_template: str | None = None,
    adapter: dict | None = None,
) -> ExportInfo:
    """Export, run `gate` on the finished folder (None: recorded as not checked), then move it into place. An fp32,
    int8 or bf16 export also gets OpenVINO's prefill graph where openvino (and nncf, for int8) import, kept only if
    `prefill_gate` passes it (None: not checked, and not made: the runtime uses no graph nothing checked);
    `openvino_prefill` False: none (None: openvino_prefill_wanted's default). An int8 export also gets the batched
    decode graph (BATCHED_FILE), kept only if `batched_gate` passes it (None: not made), unless `batched_decode` is
    False (None: batched_decode_wanted's default). An int8 or int4 export also gets its int8 KV cache's scales, kept
    only if `kv_gate` passes them (None: not made), unless `int8_kv` is False (None: int8_kv_wanted's default); an fp32
    export only where `int8_kv` is True.
    `chat_template`: recorded in tokenizer_config.json, where transformers, vLLM and gpt2x serve read it. `adapter`: the
    record of a LoRA adapter merged into `model` (workflows.models.load_adapted), kept under "model" beside its base's."""
    want_kv = int8_kv_wanted(int8_kv, precision) and kv_gate is not None
    want_batched = precision is Precision.int8 and batched_decode_wanted(batched_decode) and batched_gate is not None
    with_prefill = precision in ov_prefill.MODULES
    want_prefill = with_prefill and openvino_prefill_wanted(openvino_prefill, precision)
    out = Path(out)
    with folder_written_whole(out, force, f"export to {out}") as tmp:
        work = tmp / "work"
        work.mkdir()
        progress("tracing the model to ONNX")
        raw = trace_to_onnx(model.float().eval(), opset)
        if needs_external_data(raw):  # fused from disk, beside its weights' file (optimize.fuse)
            save_onnx(raw, work / "raw.onnx")
            raw = work / "raw.onnx"
        progress("fusing with ONNX Runtime's transformer optimizer")
        fused = work / "fused.onnx"
        quantized = precision in (Precision.int8, Precision.int4)
        ops = fuse(raw, fused if quantized else tmp / MODEL_FILE, model.config, precision)
        if precision is Precision.int8:
            progress("quantizing MatMul weights to int8")
            ops = quantize_int8(fused, tmp / MODEL_FILE)
            if want_batched:
                progress("quantizing the batched decode graph's MatMul weights (quantize_dynamic, per channel)")
                quantize_int8_dynamic(fused, tmp / BATCHED_FILE)
        elif precision is Precision.int4:
            progress(f"quantizing MatMul weights to int4 (the unembedding to int{INT4_HEAD_BITS})")
            ops = quantize_int4(fused, tmp / MODEL_FILE)
        shutil.rmtree(work)
        # config.json, tokenizer.json, genai_config.json ...: the folder loads in Optimum and genai too.
        attention = attention_layout(ops)
        write_interop_files(tmp, model.config, genai_provider="cuda" if precision is Precision.fp16 else None,
                            share_buffer=io.in_place_kv(attention), chat_template=chat_template)
        meta = {
            "format": FORMAT,
            "format_version": FORMAT_VERSION,
            "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            "model": {"name": source.name, "kind": source.kind, "revision": source.revision,
                      "weights_sha256": weights_fingerprint(source), **({"adapter": adapter} if adapter else {})},
            "config": model.config.to_dict(),
            "precision": precision.value,
            "opset": opset,
            "ir_version": IR_VERSION,
            "versions": versions(),
            "files": {},
            "sizes": {},
            "tokenizer": BPE_SHA256,
            "io": {"inputs": io.input_names(model.config.n_layer), "outputs": io.output_names(model.config.n_layer)},
            "fused_operators": ops,
            "attention": attention,
        }
        _record_files(tmp, meta)
        info = ExportInfo(tmp, meta)
        if gate is not None:
            progress("checking parity against PyTorch")
            meta["parity"] = gate(info)
        else:
            meta["parity"] = {"status": NOT_CHECKED}
        if precision is Precision.int8:  # after the gate: that one runs model.onnx alone
            meta[BATCHED_KEY] = _batched_decode(info, batched_gate, progress) if want_batched else \
                {"kept": False, "reason": "not asked for" if batched_gate is not None else NOT_CHECKED}
            _record_files(tmp, meta)  # a dropped graph's file is gone
        if with_prefill:
            meta[PREFILL_KEY] = _openvino_prefill(model, info, prefill_gate, progress) if want_prefill else \
                {"kept": False, "reason": "not asked for"}
            if meta[PREFILL_KEY]["kept"]:  # its files join the others' (a dropped graph's are gone)
                _record_files(tmp, meta)
        if precision in INT8_KV_PRECISIONS or want_kv:  # last: its gate runs the whole backend, every graph above on its cache
            meta[KV_KEY] = _int8_kv(model, info, kv_gate, progress) if want_kv else \
                {"kept": False, "reason": "not asked for" if kv_gate is not None else NOT_CHECKED}
            _record_files(tmp, meta)
        (tmp / METADATA_FILE).write_text(json.dumps(meta, indent=1) + "\n")
    return ExportInfo(out, meta)


def _record_files(folder: Path, meta: dict) -> None:
    """Every file's sha256 (checked by `gpt2x verify`) and size (checked on every load) into `meta`."""
    paths = export_files(folder)
    meta["files"] = {file_name(folder, p): sha256(p) for p in paths}
    meta["sizes"] = {file_name(folder, p): p.stat().st_size for p in paths}


def _openvino_prefill(model: GPT2, info: ExportInfo, gate: PrefillGate | None, progress: Progress) -> dict:
    """OpenVINO's prefill graph written into the export, gated and timed; its record for gpt2x.json. A graph that
    fails its gate (or was not gated) is removed: the export keeps only ONNX Runtime's prefill."""
    precision = info.precision
    missing = missing_modules(*ov_prefill.MODULES[precision])
    if missing:
        progress(f"no OpenVINO prefill graph: {' and '.join(missing)} do not import (pip install 'gpt2x[openvino]')")
        return {"kept": False, "reason": f"{', '.join(missing)} not installed"}
    if gate is None:
        return {"kept": False, "reason": NOT_CHECKED}
    progress(f"converting the prefill to OpenVINO ({'int8 weights, nncf' if precision is Precision.int8 else 'f32 weights'})")
    files = ov_prefill.convert_prefill(model, info.folder, precision)
    record = {"kept": True, "files": files, "inputs": io.input_names(model.config.n_layer),
              "outputs": io.output_names(model.config.n_layer),
              "weights": ov_prefill.WEIGHTS[precision],
              # bf16's is gated at bf16 (its backend runs nothing else); the others' at f32, bf16 asked for later
              "inference_precision": BF16 if precision is Precision.bf16 else F32}
    return _gated(info, PREFILL_KEY, record, gate, lambda: shutil.rmtree((info.folder / PREFILL_XML).parent),
                  "OpenVINO prefill graph", "checking the OpenVINO prefill against PyTorch and timing both prefills", progress)


def _batched_decode(info: ExportInfo, gate: BatchedGate, progress: Progress) -> dict:
    """The batched decode graph (written beside model.onnx), gated and timed; its record for gpt2x.json. A graph
    that fails its gate is removed: every step then runs on model.onnx."""
    record = {"kept": True, "file": BATCHED_FILE, "weights": "int8 symmetric in 7 bits, one scale per output channel "
              "(ONNX Runtime quantize_dynamic, QInt8, reduce_range); activations quantized per step (uint8, one scale a tensor)",
              "weight_bits": 7}  # a record without it holds 8-bit weights, which the runtime skips on a CPU without VNNI
    return _gated(info, BATCHED_KEY, record, gate, info.batched_path.unlink, "batched decode graph",
                  "checking the batched decode graph against PyTorch and timing both decode graphs", progress)


def _int8_kv(model: GPT2, info: ExportInfo, gate: KvGate, progress: Progress) -> dict:
    """The int8 KV cache's scales, calibrated and written beside model.onnx, gated and timed; its record for
    gpt2x.json. Scales that fail the gate are removed: the runtime keeps a float cache."""
    progress("calibrating the int8 KV cache's scales")
    write_kv_scales(model, info.folder)
    record = {"kept": True, "file": KV_SCALES_FILE, "margin": KV_MARGIN,
              "scales": "float32 per layer, key or value, head and channel: the largest |value| at that channel over "
                        "the calibration rows (kv_calibration_ids) times the margin, over 127",
              "rule": "round half to even of value / scale, clipped to [-128, 127] (GroupQueryAttention's)"}
    return _gated(info, KV_KEY, record, gate, (info.folder / KV_SCALES_FILE).unlink, "int8 KV cache",
                  "checking the int8 KV cache against PyTorch and timing decode steps on both caches", progress)


def write_kv_scales(model: GPT2, folder: Path) -> Path:
    """The int8 KV cache's scales calibrated on `model` (kv_absmax, KV_MARGIN) and written into `folder`."""
    return kvcache.save_scales(folder, kvcache.scales_from_absmax(kv_absmax(model), KV_MARGIN))


KV_SHORT_ROWS = (16, 64)  # calibration's short rows (rows, tokens): the first positions' values, where they differ


def kv_calibration_ids(n_positions: int, vocab_size: int) -> list[torch.Tensor]:
    """Calibration batches of token ids: two rows of the whole context, English prose (the bundled model's card, tiled:
    not the held-out text that `gpt2x eval` scores) and random ids (every kind of token, as the parity gate sends), then
    KV_SHORT_ROWS of random ids."""
    from ..tokenizer import encode

    text = encode((resources.files("gpt2x") / "data" / "shakespeare" / "MODEL_CARD.md").read_text(encoding="utf-8"))
    text = [t for t in text if t < vocab_size] or [0]
    natural = (text * (n_positions // len(text) + 1))[:n_positions]
    draw = torch.Generator().manual_seed(0)
    random = torch.randint(0, vocab_size, (n_positions,), generator=draw).tolist()
    rows, tokens = KV_SHORT_ROWS
    return [torch.tensor([natural, random], dtype=torch.long),
            torch.randint(0, vocab_size, (rows, min(tokens, n_positions)), generator=draw)]


@torch.no_grad()
def kv_absmax(model: GPT2) -> np.ndarray:
    """(2L, H, D): the largest |key| and |value| of each layer, head and channel over kv_calibration_ids, every
    position."""
    cfg = model.config
    model = model.float().eval()
    seen = []
    for ids in kv_calibration_ids(cfg.n_positions, cfg.vocab_size):
        _, presents = model(ids, logits_to_keep=1)
        seen.append(np.stack([t.abs().amax(dim=(0, 2)).numpy() for layer in presents for t in layer]))  # (H, D) each
    return np.max(seen, axis=0)


def _gated(info: ExportInfo, key: str, record: dict, gate: Gate, drop: Callable[[], None], what: str, checking: str,
           progress: Progress) -> dict:
    """A graph written into the export, under `key` in its metadata while `gate` checks and times it: its record with
    the gate's, or, where the gate raises ParityError, the graph's files removed (`drop`) and why."""
    info.meta[key] = record
    progress(checking)
    try:
        return record | gate(info)
    except ParityError as e:
        reason = str(e)
    drop()
    progress(f"{what} dropped: {reason}")
    return {"kept": False, "reason": reason}
