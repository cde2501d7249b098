"""Tracing the PyTorch model to ONNX: torch's dynamo exporter on a copy of the model whose attention
is the `gpt2x::mha` custom op (translated to MultiHeadAttention, ops.py), with onnx.names' names."""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import importlib.metadata
import inspect
import json
import logging
import os
import sys
import warnings
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx
import torch
from google.protobuf.message import DecodeError
from onnx import TensorProto, numpy_helper
from torch import nn

from ..errors import OutputError
from ..fileio import cache_folder, folder_lock, write_atomic
from ..model.gpt2 import GPT2
from . import names as io
from .artifact import IR_VERSION
from .ops import TRANSLATIONS


class _ExportAttention(nn.Module):
    """A block's attention with the core replaced by the `gpt2x::mha` op (MultiHeadAttention in ONNX)."""

    def __init__(self, attn: nn.Module):
        super().__init__()
        self.c_attn, self.c_proj, self.n_head = attn.c_attn, attn.c_proj, attn.n_head

    def forward(self, x, bias, past, keep: int = 0):
        if keep:  # the graph's logits_to_keep is an input of its own (optimize.py): every position runs here
            raise ValueError("the ONNX export traces every position (logits_to_keep 0)")
        C = x.shape[-1]
        q, k, v = self.c_attn(x).split(C, dim=2)  # 3 x (B, T, C)
        y, k, v = torch.ops.gpt2x.mha(q, k, v, past[0], past[1], bias, self.n_head)
        return self.c_proj(y), (k, v)


class _ExportWrapper(nn.Module):
    """Flat tensors in and out, in the order of names.input_names / output_names."""

    def __init__(self, model: GPT2):
        super().__init__()
        self.model = model

    def forward(self, input_ids, attention_mask, position_ids, past):
        pairs = [(past[2 * i], past[2 * i + 1]) for i in range(len(past) // 2)]
        logits, presents = self.model(input_ids, attention_mask, position_ids, pairs)
        return (logits, *[t for kv in presents for t in kv])


def _export_copy(model: GPT2) -> GPT2:
    """A copy of the model sharing its weights, with export attention in every block."""
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


@dataclass(frozen=True)
class _Weight:
    """A graph initializer that holds a parameter (FQN of _ExportWrapper's), or its transpose (the exporter
    folds a Linear's weight.T into a constant)."""

    index: int
    param: str
    transposed: bool


# The traced graph depends on the architecture, not on the weights: a process traces each (class, config,
# opset) once and later models refill the weights (exports of several precisions, bench). None: that graph
# could not be mapped, so it is traced every time.
_TEMPLATES: dict[tuple, tuple[onnx.ModelProto, list[_Weight]] | None] = {}

_POSITIONS = "model.wpe.weight"  # (n_positions, C): the one weight whose shape the context length sets


def _architecture(model: GPT2) -> tuple[tuple[str, int], ...]:
    """The config's fields the traced graph depends on: all but the context length, which is only wpe's rows (a Gather
    by position_ids, its dims refilled with the weights), so models that differ in it alone share a trace."""
    return tuple((k, v) for k, v in dataclasses.asdict(model.config).items() if k != "n_positions")


TRACES_ENV = "GPT2X_TRACES"  # the folder of traced graphs kept between processes, or "off"
_WEIGHTS_KEY = "gpt2x.trace.weights"  # the template's metadata: where each weight goes


def traces_root() -> Path | None:
    """GPT2X_TRACES, else gpt2x/traces in the user's cache; None when it is "off"."""
    return cache_folder(TRACES_ENV, "traces")


def _disk_key(model: GPT2, opset: int) -> str | None:
    """What the traced graph depends on, hashed: the source of the model's classes and of this package's model and
    tracing code, the config, the opset and the exporter's versions. None where a class has no source file."""
    h = hashlib.sha256()
    files = sorted(Path(__file__).parents[1].joinpath("model").glob("*.py"))
    files += [Path(__file__).with_name(n) for n in ("trace.py", "ops.py", "names.py")]
    try:
        files += [Path(inspect.getsourcefile(cls)) for cls in type(model).__mro__ if issubclass(cls, GPT2)]
        for f in files:
            h.update(f.read_bytes())
    except (TypeError, OSError):  # a class made at run time, or a file gone
        return None
    versions = {d: importlib.metadata.version(d) for d in ("torch", "onnx", "onnxscript")}
    h.update(json.dumps([type(model).__qualname__, dict(_architecture(model)), opset, versions]).encode())
    return h.hexdigest()[:32]


def _load_template(path: Path, params: dict[str, torch.Tensor]) -> tuple[onnx.ModelProto, list[_Weight]] | None:
    """A template kept by an earlier process, if it is whole and fits these parameters; else None."""
    try:
        proto = onnx.load_from_string(path.read_bytes())
        meta = {p.key: p.value for p in proto.metadata_props}
        weights = [_Weight(*w) for w in json.loads(meta[_WEIGHTS_KEY])]
    except (OSError, KeyError, ValueError, TypeError, DecodeError):  # missing, cut short, or of another layout
        return None
    inits = proto.graph.initializer
    for w in weights:
        if not (0 <= w.index < len(inits)) or w.param not in params:
            return None
        shape = tuple(params[w.param].shape)
        dims = tuple(inits[w.index].dims)
        if w.param == _POSITIONS:  # another context length's rows: refilled with the weights
            dims, shape = dims[1:], shape[1:]
        if dims != (shape[::-1] if w.transposed else shape):
            return None
    del proto.metadata_props[:]
    return proto, weights


def _keep_template(path: Path, template: tuple[onnx.ModelProto, list[_Weight]]) -> None:
    """Write the template for later processes, whole or not at all (a read-only cache only costs the next trace)."""
    proto = onnx.ModelProto()
    proto.CopyFrom(template[0])
    proto.metadata_props.add(key=_WEIGHTS_KEY, value=json.dumps([dataclasses.astuple(w) for w in template[1]]))
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        write_atomic(path, proto.SerializeToString())
    except (OSError, OutputError):
        pass


def trace_to_onnx(model: GPT2, opset: int) -> onnx.ModelProto:
    """The fp32 graph of `model`, with the conventional names and symbolic dims: traced by
    torch's dynamo exporter, or the architecture's traced graph (this process's, or one kept in
    traces_root() by an earlier process) with this model's weights."""
    key = (type(model), _architecture(model), opset, torch.__version__)  # a subclass may trace to another graph
    params = _parameters(model)
    root = traces_root()
    disk_key = _disk_key(model, opset) if root is not None and key not in _TEMPLATES else None
    kept_at = root / f"{disk_key}.onnx" if disk_key is not None else None
    with contextlib.ExitStack() as turn:
        if kept_at is not None:
            # Processes tracing one architecture at once take turns: the later reads what the first keeps (a trace
            # costs seconds). The locks lie beside the folder, which holds the graphs alone; where they cannot be
            # written, no turns are taken and what is kept is read as before.
            with contextlib.suppress(OutputError):
                turn.enter_context(folder_lock(root.parent / f".{root.name}-locks" / disk_key))
            kept = _load_template(kept_at, params)
            if kept is not None:
                _TEMPLATES[key] = kept
        template = _TEMPLATES.get(key)
        if template is not None:
            proto = onnx.ModelProto()
            proto.CopyFrom(template[0])
            for w in template[1]:
                value = params[w.param].float().numpy()
                value = np.ascontiguousarray(value.T if w.transposed else value)
                init = proto.graph.initializer[w.index]
                init.dims[:] = value.shape
                init.raw_data = value.tobytes()
        else:
            proto = _trace(model, opset)
            if key not in _TEMPLATES:
                _TEMPLATES[key] = _template(proto, params)
                if kept_at is not None and _TEMPLATES[key] is not None:
                    _keep_template(kept_at, _TEMPLATES[key])
    return proto


def _parameters(model: GPT2) -> dict[str, torch.Tensor]:
    """The model's parameters under the names the traced graph's initializers take (_ExportWrapper's)."""
    return {name: p.detach() for name, p in _ExportWrapper(_export_copy(model)).named_parameters()}


def _template(proto: onnx.ModelProto, params: dict[str, torch.Tensor]) -> tuple[onnx.ModelProto, list[_Weight]] | None:
    """The graph without its weights, and where each weight goes; None unless every float initializer of
    more than one element is exactly one parameter or its transpose (anything else might derive from the
    weights in a way a refill would miss)."""
    by_shape: dict[tuple, list[str]] = {}
    for name, p in params.items():
        by_shape.setdefault(tuple(p.shape), []).append(name)
    weights = []
    for i, init in enumerate(proto.graph.initializer):
        value = numpy_helper.to_array(init)
        if init.data_type != TensorProto.FLOAT or value.size <= 1:
            continue  # shapes, axes and scalar constants: the architecture's
        if not init.HasField("raw_data"):
            return None
        if init.name in params and np.array_equal(params[init.name].numpy(), value):
            weights.append(_Weight(i, init.name, False))
            continue
        # Candidates by their first column (a whole comparison of each costs seconds on GPT-2 124M), then the one whole.
        found = [n for n in by_shape.get(value.shape[::-1], []) if value.ndim == 2 and np.array_equal(params[n][:, 0].numpy(), value[0])]
        if len(found) != 1 or not np.array_equal(params[found[0]].numpy().T, value):
            return None
        weights.append(_Weight(i, found[0], True))
    template = onnx.ModelProto()
    template.CopyFrom(proto)
    for w in weights:
        template.graph.initializer[w.index].ClearField("raw_data")
    return template, weights


def _trace(model: GPT2, opset: int) -> onnx.ModelProto:
    """Dynamo export of the fp32 graph."""
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
    return proto


def _name_dims(proto: onnx.ModelProto, n_layer: int) -> None:
    """Replace the exporter's symbols (s43, s70 ...) by onnx.names' names on graph inputs and outputs."""
    axes = io.dynamic_axes(n_layer)
    for value in list(proto.graph.input) + list(proto.graph.output):
        for axis, name in axes.get(value.name, {}).items():
            dim = value.type.tensor_type.shape.dim[axis]
            dim.ClearField("dim_value")
            dim.dim_param = name
    del proto.graph.value_info[:]  # intermediate shapes used the old symbols; ORT re-infers them

