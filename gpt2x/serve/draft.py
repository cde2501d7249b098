"""The draft of a served model (`gpt2x serve --draft`), prepared before Ray starts.

The command resolves the draft where it resolves the target's export: in its own process, exporting a
quantized draft (int4, int8) or a draft model's fp32 export first when missing, and refusing in one
line what `workflows.open_drafter` would refuse in the replicas (a backend that cannot roll back its
cache, a draft with another vocabulary, a precision the provider cannot run). The replicas then open
the draft next to their backend from what this returns: `ngram`, or an export folder, so that no
replica exports anything or races another to do it.
"""

from __future__ import annotations

from ..choices import BackendKind, Progress, ProviderKind, no_progress
from ..onnx.artifact import ExportInfo
from ..workflows.drafts import NGRAM_DRAFT, resolve_draft


def prepare_draft(draft: str, target: ExportInfo, backend: BackendKind = BackendKind.ort,
                  provider: ProviderKind = ProviderKind.cpu, revision: str | None = None,
                  progress: Progress = no_progress, notice: Progress = no_progress) -> str:
    """What the replicas open as the draft of `target` (run by `backend` on `provider`): `ngram`, or
    the absolute path of the draft's export (workflows.resolve_draft: exported first when missing)."""
    info = resolve_draft(draft, target.meta["model"]["name"], target.config.vocab_size, backend, provider, revision,
                         progress, notice)
    return NGRAM_DRAFT if info is None else str(info.folder.resolve())
