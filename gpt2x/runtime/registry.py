"""Which class runs each BackendKind and its `Capabilities` before one is opened, each class imported only when
asked for (optional runtimes stay optional; the ONNX Runtime path imports no torch); every "this backend cannot"
message is built here from the records (base.py's, each class's `capabilities`), read without importing the classes: a
message naming the backends that can do something imports none of them (torch alone is over a second)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from ..choices import BackendKind, Precision, ProviderKind
from ..errors import Gpt2xError, MissingDependencyError, ProviderError, UsageError, installed, missing_modules
from .base import (
    GENAI_CAPABILITIES,
    OPENVINO_CAPABILITIES,
    ORT_CAPABILITIES,
    TORCH_CAPABILITIES,
    WEB_CAPABILITIES,
    Capabilities,
    spoken,
)

EXPORT_EXTRA = ("torch", "onnxscript")  # loading weights, exporting, training and the torch backend
EXPORT_INSTALL = "pip install 'gpt2x[export]' (the CPU build of torch first, see the README)"


def _torch() -> type:
    from .pytorch import TorchBackend

    return TorchBackend


def _ort() -> type:
    from .ort import OrtBackend

    return OrtBackend


def _openvino() -> type:
    from .openvino import OpenVinoBackend

    return OpenVinoBackend


def _genai() -> type:
    from .genai import GenaiBackend

    return GenaiBackend


def _web() -> type:
    from .web import WebBackend

    return WebBackend


def _web_ready() -> None:
    from .web import require_web

    require_web()  # Playwright, Chromium and onnxruntime-web from npm


@dataclass(frozen=True)
class Entry:
    load: Callable[[], type]  # imports the module and gives the class
    capabilities: Capabilities  # the class's record
    needs: tuple[str, ...] = ()  # the modules it imports that an install may lack
    install: str = ""  # the command that installs them
    ready: Callable[[], None] | None = None  # what else it checks before one opens (the web's browser)


# genai's --no-deps: its wheel requires `onnxruntime`, which would overwrite onnxruntime-gpu's files.
REGISTRY: dict[BackendKind, Entry] = {
    BackendKind.torch: Entry(_torch, TORCH_CAPABILITIES, EXPORT_EXTRA, EXPORT_INSTALL),
    BackendKind.ort: Entry(_ort, ORT_CAPABILITIES),
    BackendKind.openvino: Entry(_openvino, OPENVINO_CAPABILITIES, ("openvino",), "pip install 'gpt2x[openvino]'"),
    BackendKind.genai: Entry(_genai, GENAI_CAPABILITIES, ("onnxruntime_genai",), "pip install --no-deps 'onnxruntime-genai>=0.18'"),
    BackendKind.web: Entry(_web, WEB_CAPABILITIES, ready=_web_ready),
}


def require_modules(purpose: str, modules: tuple[str, ...], install: str) -> None:
    missing = missing_modules(*modules)
    if missing:
        raise MissingDependencyError(f"{purpose} needs {' and '.join(missing)}, which this install lacks: {install}")


def require_export_extra(purpose: str) -> None:
    """Raise MissingDependencyError unless PyTorch and onnxscript import."""
    require_modules(purpose, EXPORT_EXTRA, EXPORT_INSTALL)


def require_runtime(kind: BackendKind) -> None:
    """Raise MissingDependencyError unless everything the backend of `kind` runs on is here."""
    entry = REGISTRY[kind]
    require_modules(f"the {kind.value} backend", entry.needs, entry.install)
    if entry.ready is not None:
        entry.ready()


def backend_class(kind: BackendKind) -> type:
    """The class that runs `kind`, its runtime checked first."""
    require_runtime(kind)
    return REGISTRY[kind].load()


def capabilities_of(kind: BackendKind) -> Capabilities:
    """Its class's record, before one is opened, where the modules it needs import (not the web's browser)."""
    entry = REGISTRY[kind]
    require_modules(f"the {kind.value} backend", entry.needs, entry.install)
    return entry.capabilities


def kinds_that(predicate: Callable[[Capabilities], bool]) -> list[BackendKind]:
    """The installed kinds (their modules found, none imported) whose record satisfies `predicate`: for messages."""
    return [kind for kind, entry in REGISTRY.items()
            if all(installed(module) for module in entry.needs) and predicate(entry.capabilities)]


def default_backend(precision: Precision, provider: ProviderKind = ProviderKind.cpu) -> BackendKind:
    """The backend a command runs `precision` exports on when none is named: the native one where its record runs
    `precision` on `provider`, else the first installed export runner whose record does (bf16 on the CPU: ONNX Runtime
    computes none there), else the native one, whose refusal then names the backends that would."""
    runners = [kind for kind, entry in REGISTRY.items() if not entry.capabilities.reference]
    native = next(kind for kind in runners if capabilities_of(kind).native)
    for kind in [native, *(k for k in runners if k is not native)]:
        try:
            if capabilities_of(kind).runs(precision, provider):
                return kind
        except MissingDependencyError:
            continue
    return native


def named(kinds: list[BackendKind], last: str = "or") -> str:
    return spoken((k.value for k in kinds), last)


# ---------------------------------------------------------------- what a backend cannot do


def unsupported(kind: BackendKind, provider: ProviderKind, precision: Precision) -> Gpt2xError | None:
    """Why `kind` cannot run `precision` on `provider`, as the error to raise, or None. Asked before any work."""
    caps = capabilities_of(kind)
    refused = caps.refuse_provider(kind.value, provider)
    if refused is not None or caps.runs(precision, provider):
        return refused
    here = spoken(p.value for p in caps.precisions_by_provider[provider])
    elsewhere = [p for p in caps.providers if caps.runs(precision, p)]
    if elsewhere:
        return ProviderError(
            f"{precision.value} runs on {spoken(p.value.upper() for p in elsewhere)} only with the {kind.value} backend; "
            f"on the {provider.value} provider it runs {here}")
    others = kinds_that(lambda c: c.runs(precision))
    by = f"run by the {named(others, 'and')} backend{'s' if len(others) > 1 else ''}" if others else \
        "run by no backend installed here"
    return UsageError(f"the {kind.value} backend does not run {precision.value} (it runs {caps.describe_runs()}): "
                      f"{precision.value} is {by}")


def refuse_unsupported(kind: BackendKind, provider: ProviderKind, precision: Precision) -> None:
    error = unsupported(kind, provider, precision)
    if error is not None:
        raise error


def refuse_export_folder(kind: BackendKind, named_by: str = "an export folder") -> None:
    """Refuse an export for a backend that runs none: the reference runs the model itself."""
    caps = capabilities_of(kind)
    if caps.reference:
        runners = named(kinds_that(lambda c: not c.reference), "and")
        raise UsageError(f"{named_by} names an export, which the {runners} backends run; "
                         f"the {kind.value} backend runs the model itself, in {caps.runtime}")


def cannot_roll_back(name: str, role: str | None = None) -> UsageError:
    """The refusal of speculative decoding on a backend whose cache cannot drop positions."""
    which = f"the {name} backend" + (f" (the {role})" if role else "")
    return UsageError(f"speculative decoding needs a KV cache it can roll back; {which} cannot drop positions "
                      f"from its cache: use {named(kinds_that(lambda c: c.rolls_back))}")
