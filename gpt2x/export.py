"""ONNX export with a KV cache: one graph for prefill and decode, fused by ONNX Runtime's transformer
optimizer, converted to fp16 or quantized to int8, gated by parity against PyTorch, written atomically.

Layout of an export folder:
    model.onnx            the graph (+ model.onnx.data when the weights pass 2 GB)
    gpt2x.json            metadata: format version, source, config, precision, versions, hashes, parity
    config.json, tokenizer.json, genai_config.json, ...
                          what Optimum, transformers(.js) and onnxruntime-genai read (interop.py)
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import shutil
import sys
import tempfile
import uuid
import warnings
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

import onnx
import torch
from torch import nn

from . import __version__
from . import onnx_io as io
from .choices import Precision
from .errors import ArtifactError, OutputError
from .model import GPT2, GPT2Config
from .tokenizer import BPE_SHA256
from .weights import ModelSource

FORMAT = "gpt2x-onnx"
FORMAT_VERSION = 1
MODEL_FILE = "model.onnx"
DATA_FILE = "model.onnx.data"
METADATA_FILE = "gpt2x.json"
DEFAULT_OPSET = 18
IR_VERSION = 10  # onnx 1.23 writes IR 12 by default; ONNX Runtime 1.20+ reads up to 10
EXTERNAL_DATA_BYTES = 1_800_000_000  # protobuf's 2 GB limit, with margin
EXTERNAL_MIN_BYTES = 1024  # with external data, tensors from this size on go to the data file
FUSED_OPS = ("MultiHeadAttention", "GroupQueryAttention", "Attention", "SkipLayerNormalization", "FastGelu", "BiasGelu",
             "Gelu", "EmbedLayerNormalization", "MatMulNBits", "MatMulInteger", "DynamicQuantizeMatMul")

Progress = Callable[[str], None]


def default_export_dir(model_name: str, precision: Precision, root: Path = Path("exported")) -> Path:
    safe = model_name.strip("/").replace("/", "--").replace(os.sep, "--").replace(":", "-").lstrip(".-~") or "model"
    return root / f"{safe}-{precision.value}"


# ---------------------------------------------------------------- tracing


class _ExportAttention(nn.Module):
    """A block's attention with the core replaced by the `gpt2x::mha` op (MultiHeadAttention in ONNX)."""

    def __init__(self, attn: nn.Module):
        super().__init__()
        self.c_attn, self.c_proj, self.n_head = attn.c_attn, attn.c_proj, attn.n_head

    def forward(self, x, bias, past):
        C = x.shape[-1]
        q, k, v = self.c_attn(x).split(C, dim=2)  # 3 x (B, T, C)
        y, k, v = torch.ops.gpt2x.mha(q, k, v, past[0], past[1], bias, self.n_head)
        return self.c_proj(y), (k, v)


class _ExportWrapper(nn.Module):
    """Flat tensors in and out, in the order of onnx_io.input_names / output_names."""

    def __init__(self, model: GPT2):
        super().__init__()
        self.model = model

    def forward(self, input_ids, attention_mask, position_ids, past):
        pairs = [(past[2 * i], past[2 * i + 1]) for i in range(len(past) // 2)]
        logits, presents = self.model(input_ids, attention_mask, position_ids, pairs)
        return (logits, *[t for kv in presents for t in kv])


def _export_copy(model: GPT2) -> GPT2:
    """A copy of the model sharing its weights, with export attention in every block."""
    from . import onnx_ops  # noqa: F401  (registers gpt2x::mha and its ONNX schema)

    clone = GPT2.__new__(GPT2)
    nn.Module.__init__(clone)
    clone.config = model.config
    clone.wte, clone.wpe, clone.ln_f = model.wte, model.wpe, model.ln_f
    clone.h = nn.ModuleList()
    for block in model.h:
        b = type(block).__new__(type(block))
        nn.Module.__init__(b)
        b.ln_1, b.ln_2, b.mlp = block.ln_1, block.ln_2, block.mlp
        b.attn = _ExportAttention(block.attn)
        clone.h.append(b)
    return clone.eval()


def trace_to_onnx(model: GPT2, path: Path, opset: int) -> None:
    """Dynamo export of the fp32 graph to `path`, with the conventional names and symbolic dims."""
    from .onnx_ops import TRANSLATIONS

    cfg = model.config
    B, T, P = 2, 3, 4  # example sizes; every axis is dynamic (P = 0 at the first step)
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, cfg.vocab_size, (B, T), generator=gen)
    mask = torch.ones(B, P + T, dtype=torch.long)
    pos = torch.arange(P, P + T).repeat(B, 1)
    past = tuple(torch.zeros(B, cfg.n_head, P, cfg.head_dim) for _ in range(2 * cfg.n_layer))
    dyn = torch.export.Dim.DYNAMIC
    shapes = ({0: dyn, 1: dyn}, {0: dyn, 1: dyn}, {0: dyn, 1: dyn}, tuple({0: dyn, 2: dyn} for _ in past))
    debug = os.environ.get("GPT2X_DEBUG") == "1"
    torch_onnx_log = logging.getLogger("torch.onnx")
    level = torch_onnx_log.level
    # The exporter reports its steps on stdout, which belongs to results: silence it unless debugging.
    with torch.no_grad(), open(os.devnull, "w") as devnull, contextlib.redirect_stdout(sys.stdout if debug else devnull), \
            warnings.catch_warnings():
        if not debug:
            warnings.simplefilter("ignore")
            torch_onnx_log.setLevel(logging.ERROR)  # e.g. "torchvision is not installed"
        try:
            program = torch.onnx.export(
                _ExportWrapper(_export_copy(model)), (ids, mask, pos, past),
                input_names=io.input_names(cfg.n_layer), output_names=io.output_names(cfg.n_layer),
                dynamic_shapes=shapes, opset_version=opset, dynamo=True, verbose=False,
                custom_translation_table=TRANSLATIONS,
            )
        finally:
            torch_onnx_log.setLevel(level)
    proto = program.model_proto
    _name_dims(proto, cfg.n_layer)
    proto.ir_version = IR_VERSION
    save_onnx(proto, path)


def _name_dims(proto: onnx.ModelProto, n_layer: int) -> None:
    """Replace the exporter's symbols (s43, s70 ...) by onnx_io's names on graph inputs and outputs."""
    axes = io.dynamic_axes(n_layer)
    for value in list(proto.graph.input) + list(proto.graph.output):
        for axis, name in axes.get(value.name, {}).items():
            dim = value.type.tensor_type.shape.dim[axis]
            dim.ClearField("dim_value")
            dim.dim_param = name
    del proto.graph.value_info[:]  # intermediate shapes used the old symbols; ORT re-infers them


def save_onnx(proto: onnx.ModelProto, path: Path) -> None:
    """Save, with the weights in `<name>.data` beside the graph when they pass protobuf's 2 GB."""
    if not _fits(proto):
        onnx.save_model(proto, str(path), save_as_external_data=True, all_tensors_to_one_file=True,
                        location=path.name + ".data", size_threshold=EXTERNAL_MIN_BYTES)
    else:
        onnx.save_model(proto, str(path))


def _fits(proto: onnx.ModelProto) -> bool:
    total = sum(len(t.raw_data) for t in proto.graph.initializer)
    return total < EXTERNAL_DATA_BYTES


# ---------------------------------------------------------------- optimisation, fp16, int8


def fuse(raw: Path, out: Path, cfg: GPT2Config, precision: Precision) -> dict[str, int]:
    """ONNX Runtime's transformer optimizer (SkipLayerNormalization, FastGelu; attention is already
    MultiHeadAttention), then fp16 conversion. Returns the fused operator counts."""
    from onnxruntime.transformers.onnx_model import OnnxModel
    from onnxruntime.transformers.optimizer import optimize_model

    data = raw.with_name(raw.name + ".data")
    if data.exists():
        # Weights past 2 GB: fuse the graph alone (the fusions read only a few constants) and let
        # the fused graph point at the same data file, moved beside it. Loading the weights for
        # fusion would hold them three times in memory (torch, graph, optimizer): gpt2-xl ran out.
        proto = onnx.load(str(raw), load_external_data=False)
        # Those constants are read through onnx's numpy_helper, which resolves external data
        # against the working directory.
        with _working_dir(raw.parent):
            opt = optimize_model(proto, model_type="gpt2", num_heads=cfg.n_head, hidden_size=cfg.n_embd, opt_level=0)
        os.replace(data, out.with_name(out.name + ".data"))
        for tensor in opt.model.graph.initializer:
            for entry in tensor.external_data:
                if entry.key == "location":
                    entry.value = out.name + ".data"
        opt.model.ir_version = IR_VERSION
        onnx.save_model(opt.model, str(out))
        if precision is not Precision.fp16:
            return count_ops(opt.model)
        opt = OnnxModel(onnx.load(str(out)))  # the fp16 conversion needs the weights themselves
        out.with_name(out.name + ".data").unlink()  # rewritten below only if fp16 still passes 2 GB
    else:
        opt = optimize_model(str(raw), model_type="gpt2", num_heads=cfg.n_head, hidden_size=cfg.n_embd, opt_level=0)
    if precision is Precision.fp16:
        # Inputs ids/mask/positions are int64; logits stay fp32 for the sampler; the KV cache is fp16.
        # The ops ONNX Runtime's converter blocks by default stay fp32; LayerNorm statistics and
        # softmax are computed in fp32 inside SkipLayerNormalization / MultiHeadAttention kernels.
        opt.convert_float_to_float16(keep_io_types=[io.LOGITS], use_symbolic_shape_infer=True)
    opt.model.ir_version = IR_VERSION
    save_onnx(opt.model, out)
    return count_ops(opt.model)


@contextlib.contextmanager
def _working_dir(path: Path):
    before = os.getcwd()
    os.chdir(path)
    try:
        yield
    finally:
        os.chdir(before)


def fold_transposed_initializers(proto: onnx.ModelProto) -> None:
    """Transpose(initializer) -> a transposed initializer, so the tied unembedding (x @ wte^T) is a
    MatMul with a constant B that dynamic quantization can quantize."""
    from onnx import numpy_helper

    inits = {t.name: t for t in proto.graph.initializer}
    keep = []
    for node in proto.graph.node:
        if node.op_type == "Transpose" and node.input[0] in inits:
            perm = next((list(a.ints) for a in node.attribute if a.name == "perm"), None)
            arr = numpy_helper.to_array(inits[node.input[0]])
            proto.graph.initializer.append(numpy_helper.from_array(arr.transpose(perm).copy(), node.output[0]))
        else:
            keep.append(node)
    del proto.graph.node[:]
    proto.graph.node.extend(keep)


INT8_BLOCK = 128  # weights per quantization scale along the input dimension


def quantize_int8(fused: Path, out: Path) -> dict[str, int]:
    """int8 weights for every MatMul with ONNX Runtime's MatMulNBits quantizer: symmetric, one scale
    per block of 128 input weights of each output column, computed with int8 activations
    (accuracy_level 4). The tied unembedding is quantized too: it is the largest matrix (V x C)
    and every decode step reads it whole; the embedding lookup (Gather on wte) stays fp32, costs
    one row per token and keeps the model's input exact.

    int8 is the CPU precision, so its attention is GroupQueryAttention, whose CPU kernel can update
    a fixed-capacity KV cache in place (onnx_ops.mha_to_gqa); the fp32 and fp16 graphs keep
    MultiHeadAttention, which ONNX Runtime's CUDA provider also runs in fp32."""
    from onnxruntime.quantization.matmul_nbits_quantizer import MatMulNBitsQuantizer

    from .onnx_ops import mha_to_gqa

    proto = onnx.load(str(fused))
    fold_transposed_initializers(proto)
    mha_to_gqa(proto)
    logger = logging.getLogger("onnxruntime.quantization.matmul_nbits_quantizer")
    level = logger.level
    logger.setLevel(logging.WARNING)  # it logs every node at INFO
    try:
        quantizer = MatMulNBitsQuantizer(proto, bits=8, block_size=INT8_BLOCK, is_symmetric=True, accuracy_level=4)
        quantizer.process()
    finally:
        logger.setLevel(level)
    q = quantizer.model.model
    q.ir_version = IR_VERSION
    save_onnx(q, out)
    return count_ops(q)


def attention_layout(ops: dict[str, int]) -> dict:
    """How the runtime may hold the KV cache of a graph with these operators (stored in gpt2x.json)."""
    gqa = bool(ops.get("GroupQueryAttention"))
    return {
        "op": "GroupQueryAttention" if gqa else "MultiHeadAttention",
        # past and present may be one fixed-capacity buffer, updated in place (onnx_ops.mha_to_gqa)
        "shared_kv_buffer": gqa,
        # a step of several tokens on top of a past may have batch > 1
        "batched_multi_token_past": not gqa,
    }


def count_ops(proto: onnx.ModelProto) -> dict[str, int]:
    counts = Counter(n.op_type for n in proto.graph.node)
    return {op: counts[op] for op in FUSED_OPS if counts[op]} | {"total_nodes": len(proto.graph.node)}


# ---------------------------------------------------------------- metadata


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            h.update(chunk)
    return h.hexdigest()


def weights_fingerprint(source: ModelSource) -> str | None:
    """sha256 over the weight files of a bundled or local model (None for hub and random models,
    which their name, revision and config identify)."""
    from .weights import weights_files

    if source.kind not in ("bundled", "local"):
        return None
    files = weights_files(source.path) if source.path.is_dir() else [source.path]
    h = hashlib.sha256()
    for f in files:
        h.update(sha256(f).encode())
    return h.hexdigest()


def versions() -> dict[str, str]:
    import onnxruntime
    import onnxscript

    return {"gpt2x": __version__, "torch": torch.__version__, "onnx": onnx.__version__,
            "onnxruntime": onnxruntime.__version__, "onnxscript": onnxscript.__version__}


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
            f"{FORMAT_VERSION}; re-export with `gpt2x export --force`"
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
    from onnx.external_data_helper import uses_external_data

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


# ---------------------------------------------------------------- the whole export


def export(
    model: GPT2,
    source: ModelSource,
    out: Path,
    precision: Precision = Precision.fp32,
    opset: int = DEFAULT_OPSET,
    force: bool = False,
    check_parity: bool = True,
    progress: Progress = lambda msg: None,
) -> ExportInfo:
    """Export, optimise, convert, check parity, and only then move the folder into place."""
    from .interop import write_interop_files
    from .parity import gate_export

    out = Path(out)
    if out.exists() and not force:
        raise OutputError(f"{out} exists; pass --force to replace it")
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        remove_stale_partials(out)
        tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.partial-{os.getpid()}-", dir=out.parent))
    except OSError as e:
        raise OutputError(f"cannot write to {out.parent}: {e.strerror}") from None
    umask = os.umask(0)
    os.umask(umask)
    tmp.chmod(0o777 & ~umask)  # mkdtemp makes it private; the export is an ordinary folder
    try:
        work = tmp / "work"
        work.mkdir()
        progress("tracing the model to ONNX")
        trace_to_onnx(model.float().eval(), work / "raw.onnx", opset)
        progress("fusing with ONNX Runtime's transformer optimizer")
        fused = work / "fused.onnx"
        ops = fuse(work / "raw.onnx", fused if precision is Precision.int8 else tmp / MODEL_FILE, model.config, precision)
        if precision is Precision.int8:
            progress("quantizing MatMul weights to int8")
            ops = quantize_int8(fused, tmp / MODEL_FILE)
        shutil.rmtree(work)
        # config.json, tokenizer.json, genai_config.json ...: the folder loads in Optimum and genai too.
        attention = attention_layout(ops)
        write_interop_files(tmp, model.config, genai_provider="cuda" if precision is Precision.fp16 else None,
                            share_buffer=attention["shared_kv_buffer"])
        for p in tmp.iterdir():
            p.chmod(0o666 & ~umask)  # onnx writes external data owner-only; exports are ordinary files
        files = {p.name: sha256(p) for p in sorted(tmp.iterdir())}
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
            "tokenizer": BPE_SHA256,
            "io": {"inputs": io.input_names(model.config.n_layer), "outputs": io.output_names(model.config.n_layer)},
            "fused_operators": ops,
            "attention": attention,
        }
        info = ExportInfo(tmp, meta)
        if check_parity:
            progress("checking parity against PyTorch")
            meta["parity"] = gate_export(model, info)
        else:
            meta["parity"] = {"status": "not checked (--no-check-parity)"}
        (tmp / METADATA_FILE).write_text(json.dumps(meta, indent=1) + "\n")
        _move_into_place(tmp, out)
        return ExportInfo(out, meta)
    except OSError as e:  # disk full, permissions: nothing is left behind either way
        shutil.rmtree(tmp, ignore_errors=True)
        raise OutputError(f"export to {out} failed: {e.strerror or e}") from None
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def remove_stale_partials(out: Path) -> None:
    """Remove what an export killed outright (SIGKILL, power loss) left: `.NAME.partial-PID-*`
    folders whose process is gone. They never look like an export (no gpt2x.json, hidden name)."""
    for folder in out.parent.glob(f".{out.name}.partial-*"):
        pid = folder.name[len(f".{out.name}.partial-") :].split("-", 1)[0]
        if pid.isdigit() and int(pid) != os.getpid() and not Path(f"/proc/{pid}").exists():
            shutil.rmtree(folder, ignore_errors=True)


def _move_into_place(tmp: Path, out: Path) -> None:
    old = None
    if out.exists():
        old = out.with_name(f".{out.name}.old-{uuid.uuid4().hex[:8]}")
        os.replace(out, old)
    os.replace(tmp, out)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
