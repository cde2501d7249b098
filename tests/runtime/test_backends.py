"""What every backend shares: a capabilities record that matches its methods and that callers read
(a backend declaring less is treated as having less, whatever runtime it is), `close()` and the
context manager, and an engine whose `close` says when it could not stop its thread."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
import threading

import numpy as np
import pytest

from gpt2x.choices import BackendKind, Precision, ProviderKind
from gpt2x.errors import ProviderError, UsageError
from gpt2x.evaluate.parity import compare_on_cases
from gpt2x.generation.generate import generate
from gpt2x.generation.settings import SamplingSettings
from gpt2x.generation.speculative import NgramDrafter, refuse_unrollable
from gpt2x.runtime.base import Capabilities, greedy_step
from gpt2x.runtime.openvino_prefill import cpu_has_bf16
from gpt2x.runtime.ort import OrtBackend
from gpt2x.runtime.registry import backend_class, capabilities_of, kinds_that, refuse_export_folder, unsupported
from gpt2x.serve.core.engine import Engine, EngineSettings, Row
from gpt2x.tokenizer import encode
from gpt2x.workflows.backends import export_backend, open_backend, torch_backend
from gpt2x.workflows.drafts import check_draft, draft_runtime

# The methods each capability brings (runtime/base.py), on the backend or on each of its cache forms;
# a backend without it has none of them.
METHODS = {"takes_past": ("past_from_numpy",), "argmax_where_logits_are": ("step_greedy",),
           "page": ("page_memory_mb", "reset_page_memory"), "estimates_prefill": ("prefill_ms",)}
CACHE_METHODS = {"joins_rows": ("merge",), "rolls_back": ("truncate",)}
EXPORT_KINDS = (BackendKind.ort, BackendKind.openvino, BackendKind.genai)


@pytest.mark.parametrize("kind", list(BackendKind))
def test_each_capability_comes_with_its_methods(kind):
    cls = backend_class(kind)
    caps = capabilities_of(kind)
    assert isinstance(caps, Capabilities) and caps is cls.capabilities
    for field, methods in METHODS.items():
        for method in methods:
            assert callable(getattr(cls, method, None)) is getattr(caps, field), (kind, field, method)
    for method in ("run", "step", "close", "__enter__", "__exit__", "peak_device_memory_mb"):
        assert callable(getattr(cls, method, None)), (kind, method)
    assert cls.cache_forms
    for form in cls.cache_forms:
        for field, methods in CACHE_METHODS.items():
            for method in methods:
                assert callable(getattr(form, method, None)) is getattr(caps, field), (kind, form, field, method)
        for method in ("reorder", "to_numpy"):
            assert callable(getattr(form, method, None)), (kind, form, method)


@pytest.mark.parametrize("kind", EXPORT_KINDS)
def test_a_closed_backend_is_one_error_and_a_with_block_closes_it(kind, bundled_export):
    ids = np.array([encode("ROMEO:")])
    mask, pos = np.ones_like(ids), np.arange(ids.shape[1])[None]
    with export_backend(kind, bundled_export(Precision.fp32), threads=1) as backend:
        logits, _ = backend.step(ids, mask, pos, None)
        assert logits.shape == (1, backend.vocab_size)
    with pytest.raises(ProviderError, match=f"^this {kind.value} backend is closed$"):
        backend.step(ids, mask, pos, None)
    backend.close()  # twice: nothing more happens


class Declaring:
    """An ONNX Runtime backend that declares fewer capabilities than it has: callers must go by the record."""

    def __init__(self, backend: OrtBackend, **caps: bool):
        self.backend = backend
        self.capabilities = dataclasses.replace(backend.capabilities, **caps)

    def __getattr__(self, name):
        return getattr(self.backend, name)


@pytest.fixture(scope="module")
def ort(bundled_export):
    return OrtBackend(bundled_export(Precision.fp32), threads=1)


def test_callers_go_by_the_record(ort, bundled_export):
    # Speculative decoding refuses a backend that declares no rollback, whatever it is.
    with pytest.raises(UsageError, match="cannot drop positions"):
        refuse_unrollable(Declaring(ort, rolls_back=False), "target")
    s = SamplingSettings(max_new_tokens=6, greedy=True)
    with pytest.raises(UsageError, match="cannot drop positions"):
        generate(Declaring(ort, rolls_back=False), ["ROMEO:"], s, draft=NgramDrafter())
    # The engine batches statically when rows cannot join.
    assert Engine(ort, EngineSettings(max_batch_size=4)).joins is True
    assert Engine(Declaring(ort, joins_rows=False), EngineSettings(max_batch_size=4)).joins is False
    # Greedy steps use step_greedy only where it is declared.
    assert greedy_step(ort) == ort.step_greedy
    assert greedy_step(Declaring(ort, argmax_where_logits_are=False)) != ort.step_greedy
    # The parity cases hand no cache to a backend that takes none: it runs whole sequences instead,
    # with the same logits (within fp32's rounding) as when it is handed the reference's cache.
    from gpt2x.model.weights import load_model
    from gpt2x.runtime.pytorch import TorchBackend

    reference = TorchBackend(load_model("shakespeare")[0])
    calls = []
    owner = Declaring(ort, takes_past=False)
    owner.past_from_numpy = lambda arrays: calls.append(arrays)  # must not be called
    whole, handed = compare_on_cases(reference, owner), compare_on_cases(reference, ort)
    assert calls == [] and whole["max_rel"] < 1e-4 and handed["max_rel"] < 1e-4


def test_capabilities_of_a_kind_before_opening_it():
    assert capabilities_of(BackendKind.genai).rolls_back is False
    with pytest.raises(UsageError, match="the genai backend cannot drop positions from its cache: use torch, ort, openvino or web$"):
        check_draft("ngram", BackendKind.genai)
    check_draft("ngram", BackendKind.openvino)  # it rolls back: accepted


def test_one_reference_and_one_native_and_the_reference_runs_no_export(bundled_export):
    [reference] = kinds_that(lambda c: c.reference)
    [native] = kinds_that(lambda c: c.native)
    assert (reference, native) == (BackendKind.torch, BackendKind.ort)
    with pytest.raises(UsageError, match="does not run export folders"):
        export_backend(reference, bundled_export(Precision.fp32))
    with pytest.raises(UsageError, match="the ort, openvino, genai and web backends run; the torch backend runs the model"):
        refuse_export_folder(reference, "an export folder")
    for kind in kinds_that(lambda c: not c.reference):
        refuse_export_folder(kind)  # the others run exports: nothing to refuse
    assert draft_runtime(reference) is native and draft_runtime(BackendKind.openvino) is BackendKind.openvino


def _opens(kind: BackendKind, provider: ProviderKind, info) -> None:
    """`info` opened by `kind`'s class itself on `provider` (not through the record's refusal) and
    stepped once."""
    ids = np.array([encode("ROMEO:")])
    with backend_class(kind)(info, provider, 1) as backend:
        logits, _ = backend.step(ids, np.ones_like(ids), np.arange(ids.shape[1])[None], None)
    assert logits.shape == (1, backend.vocab_size) and np.isfinite(logits).all()


@pytest.mark.parametrize("kind", [BackendKind.ort, BackendKind.openvino, BackendKind.genai, BackendKind.web])
def test_what_an_export_backend_declares_it_runs_and_what_it_does_not_it_refuses(kind, bundled_export):
    """Each precision the record declares on the CPU opens there (CUDA's: tests/runtime/test_cuda.py);
    each provider and precision it does not declare is refused before any work with the error
    unsupported() builds from the record, and the class itself refuses it too where it checks (the
    CPU has no fp16 kernels; OpenVINO and the page have no CUDA device)."""
    caps = capabilities_of(kind)
    for provider in ProviderKind:
        for precision in Precision:
            error = unsupported(kind, provider, precision)
            if caps.runs(precision, provider):
                assert error is None, (kind, provider, precision)
                if provider is ProviderKind.cpu and precision is Precision.bf16 and not cpu_has_bf16():
                    # declared, but this CPU cannot compute it: the export is refused in one line before any work
                    with pytest.raises(UsageError, match="needs a CPU that computes bf16"):
                        bundled_export(precision)
                elif provider is ProviderKind.cpu and kind is not BackendKind.web:
                    _opens(kind, provider, bundled_export(precision))
                # the page (a Chromium each, 5 s on a busy machine): test_web opens each precision it declares
                continue
            assert isinstance(error, (ProviderError, UsageError)) and kind.value in str(error), (provider, precision)
            with pytest.raises(type(error)) as refused:
                open_backend(kind, provider, "shakespeare", precision=precision)
            assert str(refused.value) == str(error)
            if provider not in caps.providers:
                assert f"no {provider.value} provider" in str(error)
                info = bundled_export(Precision.fp32)
                with pytest.raises(ProviderError, match=f"no {provider.value} provider"):
                    _opens(kind, provider, info)
            elif precision is Precision.fp16 and kind is not BackendKind.web:  # the page has no check of its own
                info = bundled_export(precision)
                with pytest.raises(ProviderError, match="CUDA only"):
                    _opens(kind, provider, info)


def test_the_records_and_the_messages_built_from_them_import_no_backend():
    """Which backends run exports, roll back or run a precision is read from the records without importing a backend's
    module or its runtime (torch's import alone is over a second of a refusal); a fresh process, to see its imports."""
    code = ("import sys\n"
            "from gpt2x.choices import Precision, ProviderKind\n"
            "from gpt2x.runtime.registry import cannot_roll_back, default_backend, unsupported\n"
            "assert 'openvino' in str(cannot_roll_back('genai', 'target'))\n"
            "assert 'openvino' in str(unsupported(default_backend(Precision.fp32), ProviderKind.cpu, Precision.bf16))\n"
            "loaded = [m for m in ('torch', 'openvino', 'onnxruntime_genai', 'playwright', 'gpt2x.runtime.pytorch', "
            "'gpt2x.runtime.openvino', 'gpt2x.runtime.genai', 'gpt2x.runtime.web', 'gpt2x.runtime.ort') if m in sys.modules]\n"
            "assert not loaded, loaded\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, encoding="utf-8", timeout=120)
    assert r.returncode == 0, r.stderr


def test_the_reference_runs_what_it_declares():
    import torch

    from gpt2x.model.weights import load_model

    model = load_model("shakespeare")[0]
    caps = capabilities_of(BackendKind.torch)
    assert caps.precisions_by_provider == {ProviderKind.cpu: (Precision.fp32,), ProviderKind.cuda: (Precision.fp32, Precision.fp16)}
    ids = np.array([encode("ROMEO:")])
    for provider in ProviderKind:
        if provider is ProviderKind.cuda and not torch.cuda.is_available():
            continue  # torch_backend refuses a machine without CUDA first
        for precision in Precision:
            error = unsupported(BackendKind.torch, provider, precision)
            if caps.runs(precision, provider):
                assert error is None
                backend = torch_backend(model, provider, precision=precision)
                logits, _ = backend.step(ids, np.ones_like(ids), np.arange(ids.shape[1])[None], None)
                assert np.isfinite(logits).all()
                continue
            with pytest.raises(type(error)) as refused:
                torch_backend(model, provider, precision=precision)
            assert str(refused.value) == str(error)
    # int8 and int4 exist only as exports, which the others run: the refusal names them from their records
    assert [k.value for k in kinds_that(lambda c: c.runs(Precision.int8))] == ["ort", "openvino", "genai", "web"]
    assert "int8 is run by the ort, openvino, genai and web backends" in str(unsupported(BackendKind.torch, ProviderKind.cpu, Precision.int8))


class Stuck:
    """A backend whose step waits for `release` (a step that does not return in time)."""

    capabilities = Capabilities()

    def __init__(self, backend):
        self.backend, self.release, self.entered = backend, threading.Event(), threading.Event()

    def step(self, *args):
        self.entered.set()
        self.release.wait(30)
        return self.backend.step(*args)

    def __getattr__(self, name):
        return getattr(self.backend, name)


def test_engine_close_says_when_its_thread_could_not_stop(ort, caplog):
    stuck = Stuck(ort)
    engine = Engine(stuck, EngineSettings(max_batch_size=1)).start()
    engine.submit([Row(encode("ROMEO:"), SamplingSettings(max_new_tokens=3, greedy=True), lambda out: None)])
    assert stuck.entered.wait(30)
    assert engine.close(timeout=0.2) is False and engine.alive
    assert "did not stop" in caplog.text
    stuck.release.set()
    assert engine.close(timeout=30) is True and not engine.alive
