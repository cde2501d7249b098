"""Exports: made from a model (parity-gated), found by model and precision (made first when
missing), and checked against the model a user names."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from ..choices import Precision, Progress, no_progress
from ..errors import ArtifactError, OutputError, UsageError
from ..evaluate.batched import gate_batched
from ..evaluate.kvcache import gate_int8_kv
from ..evaluate.parity import gate_export
from ..evaluate.prefill import gate_prefill
from ..fileio import folder_lock
from ..model.checkpoints import BUNDLED, resolve, resolve_config, weights_fingerprint
from ..onnx.artifact import (
    BF16,
    DEFAULT_OPSET,
    EXPORTS_ENV,
    F32,
    INT8_KV_ANY_PRECISIONS,
    INT8_KV_ASKED_PRECISIONS,
    ExportInfo,
    default_export_dir,
    is_export,
    read_export,
)
from ..onnx.interop import DEFAULT_CHAT_TEMPLATE
from ..runtime.kvdtype import KvDtypeChoice, kv_dtype_for
from ..runtime.kvdtype import asked as asked_kv_dtype
from ..runtime.registry import require_export_extra, require_modules
from .models import DEFAULT_MODEL, adapted_name, check_adapter_export, load_adapted, load_model

if TYPE_CHECKING:
    from ..model.checkpoints import ModelSource
    from ..model.gpt2 import GPT2


def export_model(model: GPT2, source: ModelSource, out: Path, precision: Precision = Precision.fp32,
                 opset: int = DEFAULT_OPSET, force: bool = False, check_parity: bool = True,
                 progress: Progress = no_progress, openvino_prefill: bool | None = None,
                 batched_decode: bool | None = None, int8_kv: bool | None = None,
                 prefill_compute: str = F32, chat_template: str | None = None, adapter: dict | None = None) -> ExportInfo:
    """Export a loaded model to `out`, gated by parity against it (unless check_parity is False). An fp32 or int8
    export also gets OpenVINO's prefill graph, gated on its own, unless `openvino_prefill` is False (None:
    GPT2X_OPENVINO_PREFILL's 0 or 1, default int8 only); an int8 export the batched decode graph, gated on its own,
    unless `batched_decode` is False (None: GPT2X_BATCHED_DECODE's 0 or 1, default yes); an int8 or int4 export its
    int8 KV cache's scales, gated on their own, unless `int8_kv` is False (None: GPT2X_INT8_KV's 0 or 1, default yes;
    docs/export.md). `prefill_compute` bf16: the int8 export's prefill graph computes in bf16 (refused in one line
    before anything is exported on another precision or a CPU without bf16). `chat_template`: the Jinja2 chat
    template its tokenizer_config.json records (None: the default one for the bundled model, none for others).
    `adapter`: the record of the LoRA adapter merged into `model` (load_adapted), kept in the metadata."""
    require_export_extra("exporting")
    check_prefill_compute(precision, prefill_compute)
    check_int8_kv(precision, int8_kv, check_parity)
    if precision is Precision.bf16:
        require_bf16_cpu("--precision bf16", "precision")
    if chat_template is None and source.kind == "bundled":
        chat_template = DEFAULT_CHAT_TEMPLATE
    from ..onnx.build import export
    from ..runtime.pytorch import TorchBackend

    def gate(info: ExportInfo) -> dict:
        return gate_export(TorchBackend(model, model_name=source.name), info)

    def prefill_gate(info: ExportInfo) -> dict:
        return gate_prefill(TorchBackend(model, model_name=source.name), info, compute=prefill_compute)

    def batched_gate(info: ExportInfo) -> dict:
        return gate_batched(TorchBackend(model, model_name=source.name), info)

    def kv_gate(info: ExportInfo) -> dict:
        return gate_int8_kv(TorchBackend(model, model_name=source.name), info)

    # The gates open backends on the export as it stands at each (its int8 KV cache's gate asks for each cache by name),
    # whatever cache the process asks for (--kv-cache-dtype int8 before an int8 export by name is made: none yet).
    with kv_dtype_for(KvDtypeChoice.auto):
        return export(model, source, out, precision, opset, force, gate if check_parity else None, progress,
                      prefill_gate if check_parity else None, openvino_prefill, batched_gate if check_parity else None,
                      batched_decode, kv_gate if check_parity else None, int8_kv, chat_template, adapter)


def check_int8_kv(precision: Precision, int8_kv: bool | None, check_parity: bool) -> None:
    """One UsageError line where an int8 KV cache's scales are asked for (`int8_kv` True) and cannot be had: a precision
    without them, or no parity check (the scales are kept only where their gate passes)."""
    if not int8_kv:
        return
    if precision not in INT8_KV_ANY_PRECISIONS:
        raise UsageError(f"--int8-kv is for fp32, int8 and int4 exports; {precision.value} exports keep a float cache",
                         option="int8-kv")
    if not check_parity:
        raise UsageError("--int8-kv keeps the scales only where their gate passes: it cannot go with --no-check-parity",
                         option="int8-kv")


def check_prefill_compute(precision: Precision, compute: str) -> None:
    """One UsageError line where bf16 prefill compute is asked for an export that cannot have it."""
    if compute == F32:
        return
    if compute != BF16:
        raise UsageError(f"prefill compute {compute!r} is not one of {F32}, {BF16}", option="prefill-compute")
    if precision is Precision.bf16:
        raise UsageError("--prefill-compute bf16 is for int8 exports: a bf16 export computes in bf16 whole already",
                         option="prefill-compute")
    if precision is not Precision.int8:
        raise UsageError(f"--prefill-compute bf16 is for int8 exports: {precision.value}'s parity gate refuses bf16's "
                         "rounding", option="prefill-compute")
    require_bf16_cpu("--prefill-compute bf16", "prefill-compute")


def require_bf16_cpu(what: str, option: str = "precision") -> None:
    """One line, before any work, where `what` (an option asking for bf16 compute) cannot have it here: openvino, which
    computes it and says whether this CPU can, is not installed (MissingDependencyError), or the CPU has neither
    AVX-512 BF16 nor AMX (UsageError)."""
    require_modules(what, ("openvino",), "pip install 'gpt2x[openvino]'")
    from ..runtime.openvino_prefill import cpu_has_bf16

    if not cpu_has_bf16():
        raise UsageError(f"{what} needs a CPU that computes bf16 (AVX-512 BF16 or AMX); this one does not", option=option)


def export_by_name(name: str, out: Path | None = None, precision: Precision = Precision.fp32,
                   revision: str | None = None, opset: int = DEFAULT_OPSET, force: bool = False,
                   check_parity: bool = True, progress: Progress = no_progress,
                   openvino_prefill: bool | None = None, int8_kv: bool | None = None,
                   prefill_compute: str = F32, chat_template: str | None = None,
                   adapter: Path | None = None) -> ExportInfo:
    """Load the model `name` and export it (default folder: default_export_dir, under exports_root()). `adapter`: a
    PEFT LoRA adapter folder merged into it first, gated on its own before the export starts (load_adapted; the
    default folder is then named by adapted_name)."""
    check_prefill_compute(precision, prefill_compute)
    check_int8_kv(precision, int8_kv, check_parity)
    if precision is Precision.bf16:  # before the model loads
        require_bf16_cpu("--precision bf16", "precision")
    record = None
    if adapter is None:
        progress(f"loading {name}")
        model, source = load_model(name, revision)
    else:
        model, source, record = load_adapted(name, adapter, revision, progress)
    return export_model(model, source, out or default_export_dir(source.name, precision), precision, opset, force,
                        check_parity, progress, openvino_prefill, int8_kv=int8_kv, prefill_compute=prefill_compute,
                        chat_template=chat_template, adapter=record)


def check_export_matches(info: ExportInfo, model: str, revision: str | None = None) -> None:
    """Same config, and for the bundled model (cheap to hash) the same weights: no export left from another version.
    An export with a LoRA adapter merged in is not its base's: `model` must then be the name it records."""
    adapter = info.meta["model"].get("adapter")
    if adapter is not None:
        if model != info.meta["model"]["name"]:
            raise ArtifactError(f"{info.folder} holds {adapter['base']} with the LoRA adapter {adapter['path']} merged in, "
                                f"not {model!r}: name it {info.meta['model']['name']!r}, or no model")
        return  # the merged weights are nowhere else to compare against
    cfg = resolve_config(model, revision)
    if cfg != info.config:
        raise ArtifactError(
            f"{info.folder} was exported from {info.meta['model']['name']!r}, whose config differs from {model!r}"
        )
    if model == BUNDLED and info.meta["model"].get("weights_sha256") != weights_fingerprint(resolve(model)[0]):
        raise ArtifactError(f"{info.folder} was exported from other {model} weights; export it again, replacing the folder")


def _elsewhere(folder: Path) -> str:
    """A hint when ./exported/ (the default before GPT2X_EXPORTS) holds this export."""
    old = Path("exported") / folder.name
    if folder.parent.resolve() != old.parent.resolve() and is_export(old):
        return f" (./{old} holds one: {EXPORTS_ENV}=exported uses it)"
    return ""


# The folder of an fp32 export by name made with its int8 KV cache's scales (`gpt2x export --int8-kv`), beside the plain
# one: where the process holds an int8 cache (--kv-cache-dtype int8, GPT2X_KV_CACHE_DTYPE), as an int8 export's is.
INT8_KV_SUFFIX = "-int8-kv"


def by_name_int8_kv(precision: Precision) -> bool:
    """Whether an export by name at `precision` is made with its int8 KV cache's scales whatever GPT2X_INT8_KV says:
    where this process asks for an int8 cache, an fp32, int8 or int4 one."""
    return precision in INT8_KV_ANY_PRECISIONS and asked_kv_dtype(None) is KvDtypeChoice.int8


def ensure_export(model: str = DEFAULT_MODEL, precision: Precision = Precision.fp32, revision: str | None = None,
                  folder: Path | None = None, loaded: tuple[GPT2, ModelSource] | None = None,
                  progress: Progress = no_progress, notice: Progress = no_progress, adapter: Path | None = None) -> ExportInfo:
    """The export of `model` at `precision` in `folder`, made first when missing; processes making the same export
    take turns (folder_lock) and the later ones use the first's. `notice` hears an export is about to happen.
    `adapter`: a PEFT LoRA adapter folder merged into `model` first (export_by_name), the export named and found by
    adapted_name, and refused where it was made from other adapter files. Where the process asks for an int8 KV cache
    (by_name_int8_kv), the export is made with its scales: an fp32 one in the default folder's twin named
    INT8_KV_SUFFIX."""
    name = model if adapter is None else adapted_name(model, adapter)
    int8_kv = True if by_name_int8_kv(precision) else None
    asked_only = bool(int8_kv) and precision in INT8_KV_ASKED_PRECISIONS  # the plain folder holds none
    if folder is None:
        folder = default_export_dir(name, precision)
        folder = folder.with_name(folder.name + INT8_KV_SUFFIX) if asked_only else folder
    folder = Path(folder)
    if not is_export(folder):
        with folder_lock(folder):
            if folder.exists() and not is_export(folder):  # not ours to replace: say so before any work
                raise OutputError(f"{folder} exists but holds no export (no gpt2x.json): remove it, or replace it "
                                  f"with gpt2x export --out {folder} --force")  # another process making the same export: wait for it, then use it
            if not is_export(folder):
                what = f"{precision.value}, with an int8 KV cache" if asked_only else precision.value
                notice(f"no export at {folder}: exporting {name} ({what}) first{_elsewhere(folder)}")
                if loaded is None:
                    export_by_name(model, folder, precision, revision, progress=progress, int8_kv=int8_kv, adapter=adapter)
                else:
                    export_model(*loaded, folder, precision, progress=progress, int8_kv=int8_kv)
    info = read_export(folder)
    if adapter is not None:
        check_adapter_export(info.meta["model"].get("adapter") or {}, adapter, info.folder)
    if loaded is None:
        check_export_matches(info, name, revision)
    elif loaded[0].config != info.config:
        raise ArtifactError(f"{info.folder} was exported from {info.meta['model']['name']!r}, whose config differs from {model!r}")
    return info


def resolve_export(model: str | None = None, revision: str | None = None, precision: Precision | None = None,
                   onnx_dir: Path | None = None, loaded: tuple[GPT2, ModelSource] | None = None,
                   progress: Progress = no_progress, notice: Progress = no_progress, adapter: Path | None = None) -> ExportInfo:
    """`onnx_dir` (checked against a named `model` and an asked `precision`), else the default folder, made first
    when missing (`adapter`: of `model` with that LoRA adapter merged in, ensure_export)."""
    if onnx_dir is None:
        info = ensure_export(model or DEFAULT_MODEL, precision or Precision.fp32, revision, loaded=loaded,
                             progress=progress, notice=notice, adapter=adapter)
    else:
        info = read_export(onnx_dir)
        if model is not None:
            check_export_matches(info, model, revision)
    if precision is not None and info.precision is not precision:
        raise UsageError(f"{info.folder} is a {info.precision.value} export, not {precision.value}")
    return info
