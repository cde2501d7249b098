"""A running backend from the user's choices: the model in PyTorch (the reference) or an export on
one of the runtimes (runtime.registry), refused before any work where the backend's record says it
cannot run the combination."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from ..choices import BackendKind, Precision, Progress, ProviderKind, no_progress
from ..errors import ProviderError, UsageError
from ..onnx.artifact import ExportInfo, is_export, read_export
from ..runtime.base import Backend
from ..runtime.providers import available_providers
from ..runtime.registry import (
    backend_class,
    capabilities_of,
    default_backend,
    refuse_unsupported,
    require_export_extra,
    require_runtime,
)
from ..tokenizer import load_in_background
from .exports import require_bf16_cpu, resolve_export
from .models import DEFAULT_MODEL, load_model

if TYPE_CHECKING:
    from ..model.checkpoints import ModelSource
    from ..model.gpt2 import GPT2


def torch_backend(model: GPT2, provider: ProviderKind = ProviderKind.cpu, model_name: str = DEFAULT_MODEL,
                  precision: Precision = Precision.fp32, threads: int | None = None) -> Backend:
    """The PyTorch reference backend for a loaded model (fp16: a half-precision copy, CUDA only)."""
    require_export_extra("the torch backend")
    import copy

    import torch

    from ..runtime.pytorch import TorchBackend

    if provider is ProviderKind.cuda and not torch.cuda.is_available():
        raise ProviderError("this PyTorch build sees no CUDA device")
    refuse_unsupported(BackendKind.torch, provider, precision)
    if threads:
        torch.set_num_threads(threads)
    # A copy for CUDA (TorchBackend moves its module): the caller's model, the CPU reference of `gpt2x bench`, stays.
    m = copy.deepcopy(model).half() if precision is Precision.fp16 else \
        copy.deepcopy(model) if provider is ProviderKind.cuda else model
    return TorchBackend(m, "cuda" if provider is ProviderKind.cuda else "cpu", model_name)


def require_provider(backends: list[BackendKind], provider: ProviderKind) -> None:
    """Fail early when a backend's runtime is missing or `provider` cannot run one of `backends` here."""
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


def choose_backend(backend: BackendKind | None, precision: Precision | None, provider: ProviderKind,
                   onnx_dir: Path | None = None, asked_as: str = "--precision bf16") -> BackendKind:
    """`backend`, else the one that runs the precision asked (with an export folder and none asked, the folder's) by
    default (registry.default_backend: its record, not its name). bf16 on a CPU that does not compute it: one line
    (naming it `asked_as`) here, before any work. The commands' and the offline API's choice."""
    if precision is Precision.bf16:
        require_bf16_cpu(asked_as)
    if backend is not None:
        return backend
    if precision is None and onnx_dir is not None and is_export(onnx_dir):
        precision = read_export(onnx_dir).precision
    return default_backend(precision or Precision.fp32, provider)


def open_backend(backend: BackendKind = BackendKind.ort, provider: ProviderKind = ProviderKind.cpu,
                 model: str | None = None, revision: str | None = None, precision: Precision | None = None,
                 onnx_dir: Path | None = None, threads: int | None = None,
                 loaded: tuple[GPT2, ModelSource] | None = None,
                 progress: Progress = no_progress, notice: Progress = no_progress, in_place_kv: bool | None = None,
                 prefill_tokens: int | None = None) -> Backend:
    """The backend the user asked for: the model in PyTorch for the reference (`loaded` reuses one), else the
    export in `onnx_dir` or the default folder (exported first when missing). Refusals come before any work.
    `in_place_kv` and `prefill_tokens`: the native backend's options (export_backend)."""
    refuse_unsupported(backend, provider, precision or Precision.fp32)
    if precision is Precision.bf16:
        require_bf16_cpu("--precision bf16")
    load_in_background()  # the tokenizer, ready when the backend is
    if capabilities_of(backend).reference:
        name = model or DEFAULT_MODEL
        if loaded is None:
            progress(f"loading {name}")
            loaded = load_model(name, revision)
        return torch_backend(loaded[0], provider, name, precision or Precision.fp32, threads)

    require_runtime(backend)
    info = resolve_export(model, revision, precision, onnx_dir, loaded, progress, notice)
    refuse_unsupported(backend, provider, info.precision)  # an --onnx folder's, where no precision was asked
    progress(f"loading {info.folder} on {backend.value} ({provider.value})")
    return export_backend(backend, info, provider, threads, in_place_kv=in_place_kv, prefill_tokens=prefill_tokens)


def export_backend(backend: BackendKind, info: ExportInfo, provider: ProviderKind = ProviderKind.cpu,
                   threads: int | None = None, in_place_kv: bool | None = None, batched: bool | None = None,
                   kv_cache_dtype: str | None = None, prefill_tokens: int | None = None) -> Backend:
    """A runtime on an export folder, checked before its module is imported. `in_place_kv`, `batched` (its
    batched decode graph: None as recorded, False never), `kv_cache_dtype` (None: GPT2X_KV_CACHE_DTYPE's, else
    auto) and `prefill_tokens` (the most rows x tokens a multi-token step will run, where known): the native
    backend's (OrtBackend's) options."""
    caps = capabilities_of(backend)
    if caps.reference:
        raise UsageError(f"the {backend.value} backend does not run export folders (it runs the model itself, in {caps.runtime})")
    options = {"in_place_kv": in_place_kv, "batched": batched, "kv_cache_dtype": kv_cache_dtype,
               "prefill_tokens": prefill_tokens} if caps.native else {}
    return backend_class(backend)(info, provider, threads, **options)
