"""gpt2x, every contender opened through gpt2x.workflows as a user's would be (ensure_export into
--exports, parity-gated when made, then export_backend; torch_backend for PyTorch), through the
shared decode loop and sampler: PyTorch fp32, and ONNX Runtime, OpenVINO and onnxruntime-genai
(gpt2x's step-by-step backend) at each of --precisions. --gpt2x-backends and --precisions narrow it.
The exports (ensure_exports) are shared with genai.py, which runs onnxruntime-genai's own loop on them."""

from __future__ import annotations

import numpy as np

from gpt2x.bench.run import timed_generation
from gpt2x.choices import BackendKind, Precision, ProviderKind
from gpt2x.errors import MissingDependencyError
from gpt2x.onnx.artifact import default_export_dir
from gpt2x.runtime.registry import require_runtime
from gpt2x.workflows.backends import export_backend, torch_backend
from gpt2x.workflows.exports import ensure_export

from .core import Context, error_line, log

KEY = "gpt2x"
ORDER = 30
LABEL = "gpt2x"


class _Recorder:
    """A gpt2x backend that notes the greedy token of every step (warm-up only)."""

    def __init__(self, backend):
        self.backend, self.tokens = backend, []

    def __getattr__(self, name: str):  # everything else the decode loop asks of a backend (capabilities, ...)
        return getattr(self.backend, name)

    def step(self, input_ids, attention_mask, position_ids, past):
        logits, present = self.backend.step(input_ids, attention_mask, position_ids, past)
        self.tokens.append(logits.argmax(-1))
        return logits, present


class Gpt2x:
    """gpt2x's generation loop as `gpt2x bench` times it (gpt2x.bench.run.timed_generation) on a
    backend from gpt2x.workflows: named "gpt2x BACKEND PRECISION" ("gpt2x torch" for PyTorch fp32)."""

    batches = None
    ENGINES = {BackendKind.torch: "torch", BackendKind.ort: "ort", BackendKind.openvino: "openvino",
               BackendKind.genai: "ort"}  # the library that runs the kernels (genai runs ONNX Runtime)

    def __init__(self, kind: BackendKind, precision: Precision, backend):
        self.runtime = f"gpt2x {kind.value}"
        self.name = self.runtime if kind is BackendKind.torch else f"{self.runtime} {precision.value}"
        self.engine, self.precision, self.backend = self.ENGINES[kind], precision, backend
        # ONNX Runtime's backend may run fresh prompts' prefills on an int8 export's OpenVINO graph (docs/backends.md).
        self.prefill = getattr(backend, "prefill", None)

    def check(self, prompt: np.ndarray, k: int) -> np.ndarray:
        rec = _Recorder(self.backend)
        timed_generation(rec, prompt, k)
        return np.stack(rec.tokens, axis=1)

    def run(self, prompt: np.ndarray, n: int) -> dict:
        return timed_generation(self.backend, prompt, n)


def ensure_exports(ctx: Context) -> dict:
    """{precision: ExportInfo} of the model at each precision in EXPORTS/<model>-<precision>, exported
    (parity-gated) first where missing, all through workflows.ensure_export; one that fails is skipped.
    Made once per run (genai.py uses the same)."""
    if "gpt2x_exports" in ctx.shared:
        return ctx.shared["gpt2x_exports"]
    exports = {}
    for precision in ctx.precisions:
        try:
            info = ensure_export(ctx.model_name, precision,
                                           folder=default_export_dir(ctx.model_name, precision, ctx.exports_dir),
                                           loaded=(ctx.model, ctx.source), progress=log, notice=log)
        except Exception as e:  # not available yet, failed its parity gate, ...: this precision only
            ctx.skip(f"gpt2x {precision.value} export", error_line(e))
            continue
        exports[precision] = info
        ctx.results[f"gpt2x_{precision.value}_parity"] = info.meta["parity"]
    ctx.shared["gpt2x_exports"] = exports
    return exports


def load(ctx: Context) -> list:
    """gpt2x's backends, each opened through gpt2x.workflows: the PyTorch model (fp32), then every
    export runtime at every precision exported. A runtime that does not import, or a backend that
    does not open, is recorded in results["skipped"]."""
    exports = ensure_exports(ctx)
    contenders = []
    for kind in ctx.kinds:
        if kind is BackendKind.torch:
            if Precision.fp32 in ctx.precisions:  # PyTorch runs fp32 here; int8 and int4 are ONNX exports
                contenders.append(Gpt2x(kind, Precision.fp32,
                                        torch_backend(ctx.model, ProviderKind.cpu, ctx.model_name, threads=ctx.threads)))
            continue
        try:
            require_runtime(kind)
        except MissingDependencyError as e:
            ctx.skip(f"gpt2x {kind.value}", str(e))
            continue
        for precision, info in exports.items():
            name = f"gpt2x {kind.value} {precision.value}"
            log(f"{name}: opening {info.folder}")
            try:
                backend = export_backend(kind, info, ProviderKind.cpu, ctx.threads)
            except Exception as e:  # e.g. an operator this runtime cannot run
                ctx.skip(name, error_line(e))
                continue
            contenders.append(Gpt2x(kind, precision, backend))
            if getattr(backend, "prefill", None) == "openvino":  # the same export with ONNX Runtime's prefill, in the same rounds
                from gpt2x.runtime.ort import OrtBackend

                baseline = Gpt2x(kind, precision, OrtBackend(info, ProviderKind.cpu, ctx.threads, prefill="onnxruntime"))
                baseline.name += " (ONNX Runtime prefill)"
                contenders.append(baseline)
            if getattr(backend, "kv_scales", None) is not None:  # the same export on its float KV cache, in the same rounds
                from gpt2x.runtime.ort import OrtBackend

                floats = Gpt2x(kind, precision, OrtBackend(info, ProviderKind.cpu, ctx.threads, kv_cache_dtype="float"))
                floats.name += " (float KV cache)"
                contenders.append(floats)
            if backend.capabilities.warms_up:  # as gpt2x serve opens it (its bf16 prefill on folded weights), in the same rounds
                served = Gpt2x(kind, precision, export_backend(kind, info, ProviderKind.cpu, ctx.threads))
                served.backend.warm_up()
                served.name += " (warmed up, as gpt2x serve)"
                contenders.append(served)
            if backend.capabilities.native and not backend.in_place_kv:  # and asked for it, in the same rounds
                from gpt2x.runtime.ort import OrtBackend

                in_place = Gpt2x(kind, precision, OrtBackend(info, ProviderKind.cpu, ctx.threads, in_place_kv=True))
                in_place.name += " (in-place KV cache)"
                contenders.append(in_place)
    return contenders
