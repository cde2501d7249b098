"""Drafts for speculative decoding: checked against the target before any work, resolved to the
export they run from (made first when missing), and opened on the target's runtime."""

from __future__ import annotations

from pathlib import Path

from ..choices import BackendKind, Precision, Progress, ProviderKind, no_progress
from ..errors import HubError, ModelNotFoundError, UsageError, WeightsError
from ..generation.speculative import Drafter, DraftSettings, ModelDrafter, NgramDrafter, refuse_unrollable
from ..model.checkpoints import resolve_config
from ..onnx.artifact import ExportInfo, is_export, read_export
from ..runtime.base import Backend
from ..runtime.registry import cannot_roll_back, capabilities_of, unsupported
from ..tokenizer import folder_vocabulary_differs
from .backends import export_backend
from .exports import ensure_export, resolve_export

NGRAM_DRAFT = "ngram"
DRAFT_HELP = ("int4 or int8 (the target model's own quantized export), ngram (prompt lookup), "
              "or a model or export folder with GPT-2's vocabulary")


def draft_runtime(backend: BackendKind) -> BackendKind:
    """The target's runtime, but the native one for the reference, which runs no export."""
    if not capabilities_of(backend).reference:
        return backend
    return next(kind for kind in BackendKind if kind is not backend and capabilities_of(kind).native)


def check_draft(draft: str, backend: BackendKind = BackendKind.ort, provider: ProviderKind = ProviderKind.cpu,
                vocab_size: int | None = None, revision: str | None = None) -> None:
    """Refuse, before any export or load, a draft that cannot serve the target: no rollback, a precision its runtime
    cannot run, a model that does not resolve, or another vocabulary or tokenizer."""
    if not capabilities_of(backend).rolls_back:
        raise cannot_roll_back(backend.value)
    if draft == NGRAM_DRAFT:
        return
    runtime = draft_runtime(backend)

    def refuse(precision: Precision) -> None:
        reason = unsupported(runtime, provider, precision)
        if reason is not None:
            raise type(reason)(f"draft {draft}: {reason}")

    if draft in {p.value for p in Precision}:
        refuse(Precision(draft))
        return
    if is_export(Path(draft)):
        info = read_export(Path(draft))
        config = info.config
        refuse(info.precision)
    else:
        folder = Path(draft).expanduser()
        if folder.is_dir():
            reason = folder_vocabulary_differs(folder)
            if reason:
                raise UsageError(f"draft {draft}: {reason}; a draft must share the target's tokenizer")
        try:
            config = resolve_config(draft, revision)
        except (ModelNotFoundError, HubError, WeightsError) as e:
            raise type(e)(f"draft {draft} is neither ngram, a precision (int4, int8) nor an export folder, "
                          f"and as a model: {e}") from None
    if vocab_size is not None and config.vocab_size != vocab_size:
        raise UsageError(f"draft {draft}: its vocabulary has {config.vocab_size} tokens, the target's {vocab_size}; "
                         "a draft must share the target's tokenizer")


def resolve_draft(draft: str, model: str, vocab_size: int, backend: BackendKind = BackendKind.ort,
                  provider: ProviderKind = ProviderKind.cpu, revision: str | None = None,
                  progress: Progress = no_progress, notice: Progress = no_progress) -> ExportInfo | None:
    """The export a draft runs from: None for `ngram`; for a precision, the target model's export at it; a folder as
    it is; for a model, its fp32 export. Missing exports are made first."""
    check_draft(draft, backend, provider, vocab_size, revision)
    if draft == NGRAM_DRAFT:
        return None
    if draft in {p.value for p in Precision}:
        return ensure_export(model, Precision(draft), revision, progress=progress, notice=notice)
    if is_export(Path(draft)):
        return read_export(Path(draft))
    return resolve_export(draft, revision, Precision.fp32, progress=progress, notice=notice)


def open_drafter(draft: str, target: Backend, backend: BackendKind = BackendKind.ort,
                 provider: ProviderKind = ProviderKind.cpu, threads: int | None = None,
                 settings: DraftSettings | None = None, revision: str | None = None,
                 progress: Progress = no_progress, notice: Progress = no_progress) -> Drafter:
    """The drafter for `target`, on draft_runtime(backend) and the same provider. On the CPU a draft model gets 1
    thread by default: its steps are too small for a second (benchmarks/results/speculative-threads-cpu-2core.md)."""
    refuse_unrollable(target, "target")
    info = resolve_draft(draft, target.model_name, target.vocab_size, backend, provider, revision, progress, notice)
    if info is None:
        return NgramDrafter(settings or DraftSettings())
    kind = draft_runtime(backend)
    progress(f"loading the draft {info.folder} on {kind.value} ({provider.value})")
    runner = export_backend(kind, info, provider, threads or (1 if provider is ProviderKind.cpu else None))
    name = f"{target.model_name} {draft}" if draft in {p.value for p in Precision} else draft
    return ModelDrafter(runner, name)
