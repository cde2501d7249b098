"""The one place that turns user choices (model name, backend, provider, precision, export folder)
into a running backend or an export. The CLI, the bench and the benchmark scripts all come here.

This module imports no torch: running an existing export needs ONNX Runtime alone. The functions
that need PyTorch (loading weights, exporting, the torch backend, training) first check that the
`export` extra is installed, then import the torch-side modules of the lower layers; a missing
extra is one MissingDependencyError naming the install command.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .choices import BackendKind, Precision, Progress, ProviderKind, no_progress
from .errors import ArtifactError, Gpt2xError, HubError, MissingDependencyError, ModelNotFoundError, OutputError, ProviderError, UsageError, WeightsError
from .evaluate.parity import gate_export
from .fileio import folder_lock
from .generation.speculative import Drafter, DraftSettings, ModelDrafter, NgramDrafter, refuse_unrollable
from .model.checkpoints import BUNDLED, resolve, resolve_config, weights_fingerprint
from .onnx.artifact import DEFAULT_OPSET, EXPORTS_ENV, ExportInfo, default_export_dir, is_export, read_export
from .onnx.transformers_js import ALL_PRECISIONS as TRANSFORMERS_JS_PRECISIONS
from .onnx.transformers_js import TransformersJsFolder, check_precisions, default_layout_dir, write_transformers_js
from .runtime.base import Backend, Capabilities
from .runtime.ort import OrtBackend
from .runtime.providers import available_providers
from .runtime.web import WebBackend, require_web
from .tokenizer import folder_vocabulary_differs

if TYPE_CHECKING:
    from .model.checkpoints import ModelSource
    from .model.gpt2 import GPT2

DEFAULT_MODEL = BUNDLED
EXPORT_INSTALL = "pip install 'gpt2x[export]' (the CPU build of torch first, see the README)"


# Optional runtimes: the module each needs, and the command that installs it. onnxruntime-genai's
# wheel requires the `onnxruntime` distribution, which would overwrite `onnxruntime-gpu`'s files: it
# goes in without its dependencies (it loads the ONNX Runtime gpt2x already has).
RUNTIME_EXTRAS = {
    BackendKind.openvino: ("openvino", "pip install 'gpt2x[openvino]'"),
    BackendKind.genai: ("onnxruntime_genai", "pip install --no-deps 'onnxruntime-genai>=0.18'"),
}


def _missing(*modules: str) -> list[str]:
    missing = []
    for name in modules:
        try:
            __import__(name)
        except ImportError:
            missing.append(name)
    return missing


def require_export_extra(purpose: str) -> None:
    """Raise MissingDependencyError unless PyTorch and onnxscript import."""
    missing = _missing("torch", "onnxscript")
    if missing:
        raise MissingDependencyError(f"{purpose} needs {' and '.join(missing)}, which this install lacks: {EXPORT_INSTALL}")


def require_runtime(kind: BackendKind) -> None:
    """Raise MissingDependencyError unless the optional runtime behind `kind` imports."""
    if kind in RUNTIME_EXTRAS:
        module, install = RUNTIME_EXTRAS[kind]
        if _missing(module):
            raise MissingDependencyError(f"the {kind.value} backend needs {module}, which this install lacks: {install}")
    if kind is BackendKind.web:
        require_web()  # Playwright, Chromium and onnxruntime-web from npm


def backend_class(kind: BackendKind) -> type:
    """The class open_backend builds for `kind`, its optional runtime checked first (one line naming
    its install command where it is missing)."""
    if kind is BackendKind.torch:
        require_export_extra("the torch backend")
        from .runtime.pytorch import TorchBackend

        return TorchBackend
    require_runtime(kind)
    if kind is BackendKind.openvino:
        from .runtime.openvino import OpenVinoBackend

        return OpenVinoBackend
    if kind is BackendKind.genai:
        from .runtime.genai import GenaiBackend

        return GenaiBackend
    return {BackendKind.ort: OrtBackend, BackendKind.web: WebBackend}[kind]


def capabilities_of(kind: BackendKind) -> Capabilities:
    """What a backend of `kind` can do (its class's declared Capabilities), before one is opened."""
    return backend_class(kind).capabilities


def kinds_that(capability: str) -> str:
    """The backends that have `capability`, for a message ("ort, openvino, web or torch")."""
    names = [k.value for k in BackendKind if _declares(k, capability)]
    return ", ".join(names[:-1]) + " or " + names[-1] if len(names) > 1 else "".join(names)


def _declares(kind: BackendKind, capability: str) -> bool:
    try:
        return getattr(capabilities_of(kind), capability)
    except MissingDependencyError:  # not installed here: its class says nothing
        return False


def torch_available() -> bool:
    try:
        require_export_extra("PyTorch")
    except MissingDependencyError:
        return False
    return True


# ---------------------------------------------------------------- models (PyTorch)


def load_model(name: str = DEFAULT_MODEL, revision: str | None = None) -> tuple[GPT2, ModelSource]:
    """The PyTorch model and where it came from (bundled, hub, local or random:)."""
    require_export_extra(f"loading {name} into PyTorch")
    from .model.weights import load_model as load_weights

    return load_weights(name, revision)


def torch_backend(model: GPT2, provider: ProviderKind = ProviderKind.cpu, model_name: str = DEFAULT_MODEL,
                  precision: Precision = Precision.fp32, threads: int | None = None) -> Backend:
    """The PyTorch reference backend for a loaded model (fp16: a half-precision copy, CUDA only)."""
    require_export_extra("the torch backend")
    import copy

    import torch

    from .runtime.pytorch import TorchBackend

    if provider is ProviderKind.cuda and not torch.cuda.is_available():
        raise ProviderError("this PyTorch build sees no CUDA device")
    refuse_unsupported(BackendKind.torch, provider, precision)
    if threads:
        torch.set_num_threads(threads)
    m = copy.deepcopy(model).half() if precision is Precision.fp16 else model
    return TorchBackend(m, "cuda" if provider is ProviderKind.cuda else "cpu", model_name)


def unsupported(backend: BackendKind, provider: ProviderKind, precision: Precision) -> Gpt2xError | None:
    """Why `backend` cannot run `precision` on `provider`, as the error to raise, or None when it can.
    Asked before any work (an export, a download), so that a combination that cannot run fails at once."""
    if precision is Precision.fp16 and provider is not ProviderKind.cuda:
        return ProviderError("fp16 runs on CUDA only (its kernels are the GPU's); on the cpu provider use fp32, int8 or int4")
    if backend is BackendKind.torch and precision in (Precision.int8, Precision.int4):
        return UsageError(f"{precision.value} is an ONNX export, run by the ort, openvino, genai and web backends; "
                          "the torch backend runs fp32 (and fp16 on CUDA)")
    if backend is BackendKind.openvino and provider is ProviderKind.cuda:
        return ProviderError("OpenVINO has no CUDA device here; it runs exports on the cpu provider only")
    if backend is BackendKind.web and provider is ProviderKind.cuda:
        return ProviderError("the web backend runs onnxruntime-web's WebAssembly build on the CPU; it has no cuda provider")
    return None


def refuse_unsupported(backend: BackendKind, provider: ProviderKind, precision: Precision) -> None:
    error = unsupported(backend, provider, precision)
    if error is not None:
        raise error


def require_provider(backends: list[BackendKind], provider: ProviderKind) -> None:
    """Fail early, in one line, when a backend's runtime is not installed, or `provider` cannot run
    one of `backends` on this machine."""
    for kind in backends:
        require_runtime(kind)
    if provider is not ProviderKind.cuda:
        return
    if BackendKind.ort in backends:
        status = available_providers()["loadable"]["cuda"]
        if status != "ok":
            raise ProviderError(status)
    if BackendKind.torch in backends:
        require_export_extra("the torch backend")
        import torch

        if not torch.cuda.is_available():
            raise ProviderError("the torch backend on cuda: this PyTorch build sees no CUDA device")


# ---------------------------------------------------------------- exports


def export_model(model: GPT2, source: ModelSource, out: Path, precision: Precision = Precision.fp32,
                 opset: int = DEFAULT_OPSET, force: bool = False, check_parity: bool = True,
                 progress: Progress = no_progress) -> ExportInfo:
    """Export a loaded model to `out`, gated by parity against it (unless check_parity is False)."""
    require_export_extra("exporting")
    from .onnx.build import export
    from .runtime.pytorch import TorchBackend

    def gate(info: ExportInfo) -> dict:
        return gate_export(TorchBackend(model, model_name=source.name), info)

    return export(model, source, out, precision, opset, force, gate if check_parity else None, progress)


def export_by_name(name: str, out: Path | None = None, precision: Precision = Precision.fp32,
                   revision: str | None = None, opset: int = DEFAULT_OPSET, force: bool = False,
                   check_parity: bool = True, progress: Progress = no_progress) -> ExportInfo:
    """Load the model `name` and export it (default folder: default_export_dir, under exports_root())."""
    progress(f"loading {name}")
    model, source = load_model(name, revision)
    return export_model(model, source, out or default_export_dir(name, precision), precision, opset, force,
                        check_parity, progress)


def check_export_matches(info: ExportInfo, model: str, revision: str | None = None) -> None:
    """An export used for `model` must come from it: same config, and for the bundled model (cheap
    to hash) the same weights, so an export left over from another gpt2x version is not run."""
    cfg = resolve_config(model, revision)
    if cfg != info.config:
        raise ArtifactError(
            f"{info.folder} was exported from {info.meta['model']['name']!r}, whose config differs from {model!r}"
        )
    if model == BUNDLED and info.meta["model"].get("weights_sha256") != weights_fingerprint(resolve(model)[0]):
        raise ArtifactError(f"{info.folder} was exported from other {model} weights; export it again, replacing the folder")


def _elsewhere(folder: Path) -> str:
    """A hint when the working directory's exported/ (where exports went by default before
    GPT2X_EXPORTS) holds this export: the setting that would use it."""
    old = Path("exported") / folder.name
    if folder.parent.resolve() != old.parent.resolve() and is_export(old):
        return f" (./{old} holds one: {EXPORTS_ENV}=exported uses it)"
    return ""


def ensure_export(model: str = DEFAULT_MODEL, precision: Precision = Precision.fp32, revision: str | None = None,
                  folder: Path | None = None, loaded: tuple[GPT2, ModelSource] | None = None,
                  progress: Progress = no_progress, notice: Progress = no_progress) -> ExportInfo:
    """The export of `model` at `precision` in `folder` (default: default_export_dir, under
    exports_root()), exported first (parity-gated) when the folder holds none; processes that make the
    same export at once take turns (fileio.folder_lock), and the later ones use the first one's.
    `loaded` reuses a model already in memory; `notice` hears that an export is about to happen."""
    folder = Path(folder) if folder is not None else default_export_dir(model, precision)
    if not is_export(folder):
        with folder_lock(folder):  # another process making the same export: wait for it, then use it
            if not is_export(folder):
                notice(f"no export at {folder}: exporting {model} ({precision.value}) first{_elsewhere(folder)}")
                if loaded is None:
                    export_by_name(model, folder, precision, revision, progress=progress)
                else:
                    export_model(*loaded, folder, precision, progress=progress)
    info = read_export(folder)
    if loaded is None:
        check_export_matches(info, model, revision)
    elif loaded[0].config != info.config:
        raise ArtifactError(f"{info.folder} was exported from {info.meta['model']['name']!r}, whose config differs from {model!r}")
    return info


def export_transformers_js(model: str = DEFAULT_MODEL, out: Path | None = None,
                           precisions: Sequence[Precision] = TRANSFORMERS_JS_PRECISIONS, revision: str | None = None,
                           force: bool = False, progress: Progress = no_progress,
                           notice: Progress = no_progress) -> TransformersJsFolder:
    """A folder transformers.js loads (default exported/<model>-transformers.js) holding the graphs of
    `model`'s exports at `precisions` (fp32, int8, int4): each the export in exported/<model>-<precision>,
    exported first (parity-gated) when missing; the model is loaded once for all the missing ones."""
    precisions = check_precisions(precisions)
    out = Path(out) if out is not None else default_layout_dir(model)
    if out.exists() and not force:
        raise OutputError(f"{out} exists (force=True replaces it)")
    loaded = None
    exports = []
    for precision in precisions:
        missing = not is_export(default_export_dir(model, precision))
        if missing and loaded is None:
            progress(f"loading {model}")
            loaded = load_model(model, revision)
        exports.append(ensure_export(model, precision, revision, loaded=loaded if missing else None,
                                     progress=progress, notice=notice))
    progress(f"writing {out}")
    return write_transformers_js(exports, out, force, progress)


# ---------------------------------------------------------------- backends


def open_backend(backend: BackendKind = BackendKind.ort, provider: ProviderKind = ProviderKind.cpu,
                 model: str | None = None, revision: str | None = None, precision: Precision | None = None,
                 onnx_dir: Path | None = None, threads: int | None = None,
                 loaded: tuple[GPT2, ModelSource] | None = None,
                 progress: Progress = no_progress, notice: Progress = no_progress) -> Backend:
    """The backend the user asked for.

    torch: the model loaded into PyTorch (`loaded` reuses one in memory). ort, openvino, genai: the
    export in `onnx_dir`, or in the default folder for model and precision, exported first when missing.
    An export given by folder is checked against `model` when a model is named, and against its
    precision when one is asked for. A combination that cannot run is refused before any work."""
    refuse_unsupported(backend, provider, precision or Precision.fp32)
    if backend is BackendKind.torch:
        name = model or DEFAULT_MODEL
        if loaded is None:
            progress(f"loading {name}")
            loaded = load_model(name, revision)
        return torch_backend(loaded[0], provider, name, precision or Precision.fp32, threads)

    require_runtime(backend)
    info = resolve_export(model, revision, precision, onnx_dir, loaded, progress, notice)
    progress(f"loading {info.folder} on {backend.value} ({provider.value})")
    return export_backend(backend, info, provider, threads)


def resolve_export(model: str | None = None, revision: str | None = None, precision: Precision | None = None,
                   onnx_dir: Path | None = None, loaded: tuple[GPT2, ModelSource] | None = None,
                   progress: Progress = no_progress, notice: Progress = no_progress) -> ExportInfo:
    """The export the user's choices name: `onnx_dir` (checked against `model` when one is named, and
    against `precision` when one is asked for), or the default folder of model and precision,
    exported first when missing."""
    if onnx_dir is None:
        info = ensure_export(model or DEFAULT_MODEL, precision or Precision.fp32, revision, loaded=loaded,
                             progress=progress, notice=notice)
    else:
        info = read_export(onnx_dir)
        if model is not None:
            check_export_matches(info, model, revision)
    if precision is not None and info.precision is not precision:
        raise UsageError(f"{info.folder} is a {info.precision.value} export, not {precision.value}")
    return info


def export_backend(backend: BackendKind, info: ExportInfo, provider: ProviderKind = ProviderKind.cpu,
                   threads: int | None = None, in_place_kv: bool | None = None) -> Backend:
    """A runtime on an export folder: ONNX Runtime, OpenVINO, onnxruntime-genai or onnxruntime-web in
    headless Chromium (each the same `Backend`). The optional runtimes' modules are imported only once they are known to import.
    `in_place_kv` (ONNX Runtime's KV cache): None updates it in place wherever the graph can, False
    keeps a growing cache, True requires the in-place one."""
    if backend is BackendKind.torch:
        raise UsageError(f"{backend.value} does not run export folders")
    if backend is BackendKind.ort:
        return OrtBackend(info, provider, threads, in_place_kv=in_place_kv)
    return backend_class(backend)(info, provider, threads)


# ---------------------------------------------------------------- drafts (speculative decoding)

NGRAM_DRAFT = "ngram"
DRAFT_HELP = ("int4 or int8 (the target model's own quantized export), ngram (prompt lookup), "
              "or a model or export folder with GPT-2's vocabulary")


def draft_runtime(backend: BackendKind) -> BackendKind:
    """The runtime a draft model runs on for a target on `backend`: the same, but ONNX Runtime for a
    torch target (the drafts are exports: int4 and int8 exist only as exports)."""
    return BackendKind.ort if backend is BackendKind.torch else backend


def check_draft(draft: str, backend: BackendKind = BackendKind.ort, provider: ProviderKind = ProviderKind.cpu,
                vocab_size: int | None = None, revision: str | None = None) -> None:
    """Refuse, before any work (no export, no load), a draft that cannot serve a target on `backend`:
    a backend that cannot roll back its cache (its capabilities), a precision the draft's runtime cannot run on
    `provider`, a model that does not resolve, or one whose vocabulary is not the target's
    (`vocab_size`) or whose tokenizer files are not GPT-2's."""
    if not capabilities_of(backend).rolls_back:
        raise UsageError(f"speculative decoding needs a KV cache it can roll back; the {backend.value} backend cannot drop "
                         f"positions from its cache: use {kinds_that('rolls_back')}")
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
    """The export a draft runs from, for a target of `model` (with `vocab_size` tokens) on `backend`:
    None for `ngram` (no model); for `int4`, `int8` (or `fp32`) the target model's export at that
    precision; an export folder as it is; for a model (name, hub repo or folder) its fp32 export.
    Missing exports are made first (parity-gated, like any). check_draft's refusals come first."""
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
    """The draft for speculative decoding with `target` (opened with `backend` on `provider`), from
    resolve_draft's export (or prompt lookup for `ngram`), run on draft_runtime(backend) on the same
    provider. On the CPU a draft model gets 1 thread unless `threads` says otherwise: its steps are
    small enough that a second thread costs more than it gives, and the target's threads stay free
    (measured: benchmarks/results/speculative-threads-cpu-2core.md). Refused in one line: a target that cannot roll back its
    cache, and a draft with another vocabulary."""
    refuse_unrollable(target, "target")
    info = resolve_draft(draft, target.model_name, target.vocab_size, backend, provider, revision, progress, notice)
    if info is None:
        return NgramDrafter(settings or DraftSettings())
    kind = draft_runtime(backend)
    progress(f"loading the draft {info.folder} on {kind.value} ({provider.value})")
    runner = export_backend(kind, info, provider, threads or (1 if provider is ProviderKind.cpu else None))
    name = f"{target.model_name} {draft}" if draft in {p.value for p in Precision} else draft
    return ModelDrafter(runner, name)


def train_model(corpus: Path, out: Path, steps: int, seed: int, log: Progress = no_progress) -> dict[str, Any]:
    """Train the small Shakespeare GPT-2 (the bundled model) and write it with its model card."""
    require_export_extra("training")
    from .model.train import TrainSettings, train, write_card

    record = train(corpus, out, TrainSettings(steps=steps, seed=seed), log=log)
    write_card(out, record, f"gpt2x train --corpus {corpus} --out {out} --steps {steps} --seed {seed}")
    return record
