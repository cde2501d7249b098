"""OpenVINO running an fp32 or int8 export's prefill graph (openvino/prefill.xml) for the ONNX Runtime backend,
writing its presents straight into that backend's KV cache (runtime/prefill.py chooses when). No torch."""

from __future__ import annotations

import numpy as np
import openvino as ov

from ..errors import ArtifactError
from ..onnx import names as io
from ..onnx.artifact import BF16, F32, ExportInfo
from .providers import physical_cores


def cpu_has_bf16() -> bool:
    """Whether OpenVINO's CPU plugin computes in bf16 here (AVX-512 BF16 or AMX)."""
    return "BF16" in ov.Core().get_property("CPU", "OPTIMIZATION_CAPABILITIES")


def compute_precision(info: ExportInfo) -> str:
    """The compute precision the export's record chose, f32 where it says bf16 and this CPU has none: every record
    choosing bf16 passed the same gate at f32 first (evaluate/prefill.py), so f32 is the gated fallback."""
    recorded = (info.prefill or {}).get("inference_precision", F32)
    return BF16 if recorded == BF16 and cpu_has_bf16() else F32


def bf16_from(info: ExportInfo) -> int | None:
    """The prefill tokens (rows x prompt length) from which the prefill computes in bf16 where the record chose bf16
    for long prompts only (its `bf16_from`, a prompt length at batch 1, evaluate/prefill.py; None: one compute
    precision for every size, or this CPU has no bf16)."""
    start = (info.prefill or {}).get("bf16_from")
    return start if start is not None and compute_precision(info) == F32 and cpu_has_bf16() else None


class _Compiled:
    """The graph compiled at one compute precision, its ports and one infer request."""

    def __init__(self, model: ov.Model, precision: str, threads: int, n_layer: int):
        config = {
            "INFERENCE_NUM_THREADS": threads,
            # The gated compute precision: OpenVINO's own default is bf16 wherever the CPU has it, gated or not.
            "INFERENCE_PRECISION_HINT": precision,
            "PERFORMANCE_HINT": "LATENCY",
            # Pinned threads wait for their core beside ONNX Runtime's (runtime/openvino.py measured it).
            "ENABLE_CPU_PINNING": False,
        }
        self.compiled = ov.Core().compile_model(model, "CPU", config)
        self.request = self.compiled.create_infer_request()
        self.inputs = [self.compiled.input(name) for name in (io.INPUT_IDS, io.ATTENTION_MASK, io.POSITION_IDS)]
        self.logits = self.compiled.output(io.LOGITS)
        self.presents = [self.compiled.output(name) for name in io.output_names(n_layer)[1:]]


class OpenVinoPrefill:
    """The compiled prefill graph, at the compute precision its record chose (compute_precision), and one infer
    request; where the record chose bf16 from a prompt length on (bf16_from), the graph compiled at bf16 too, which
    runs the prefills of that many tokens (rows x prompt length) and more."""

    def __init__(self, info: ExportInfo, threads: int | None = None):
        self.inference_precision = compute_precision(info)
        self.bf16_from = bf16_from(info)
        self._threads, self._n_layer, self._path = threads or physical_cores(), info.config.n_layer, info.prefill_path
        try:
            self._model = ov.Core().read_model(str(info.prefill_path))
        except Exception as e:  # OpenVINO raises RuntimeError (and its own types) for unreadable graphs
            raise ArtifactError(f"OpenVINO {ov.__version__} cannot load {info.prefill_path}: {e}".splitlines()[0]) from None
        self._graphs: dict[str, _Compiled] = {}

    def _graph(self, precision: str) -> _Compiled:
        """The graph compiled at `precision`, at its first use: a process whose prompts all run on ONNX Runtime (short
        ones) never compiles it (0.25 s for GPT-2 124M int8 here)."""
        if precision not in self._graphs:
            try:
                self._graphs[precision] = _Compiled(self._model, precision, self._threads, self._n_layer)
            except Exception as e:  # as read_model's
                raise ArtifactError(f"OpenVINO {ov.__version__} cannot compile {self._path}: {e}".splitlines()[0]) from None
        return self._graphs[precision]

    @property
    def compiled(self):
        """The compiled graph at inference_precision (compiled now if it was not)."""
        return self._graph(self.inference_precision).compiled

    @property
    def request(self):
        return self._graph(self.inference_precision).request

    def precision_for(self, prompt_len: int, rows: int = 1) -> str:
        """The compute precision `rows` prompts of `prompt_len` tokens run at."""
        return BF16 if self.bf16_from is not None and rows * prompt_len >= self.bf16_from else self.inference_precision

    def __call__(self, input_ids, attention_mask, position_ids, presents: list[np.ndarray]) -> np.ndarray:
        """The last position's logits (B, V); every layer's presents written by OpenVINO straight into the first T
        positions of `presents` (C-contiguous float32 arrays (B, H, >= T, D), in the outputs' order): no copy after.
        The request keeps pointers into them until the next call sets its own, and writes only during a call."""
        B, T = input_ids.shape
        graph = self._graph(self.precision_for(T, B))
        for port, arr in zip(graph.inputs, (input_ids, attention_mask, position_ids)):
            graph.request.set_tensor(port, ov.Tensor(np.ascontiguousarray(arr, dtype=np.int64)))
        for port, arr in zip(graph.presents, presents):
            whole = ov.Tensor(arr, shared_memory=True)
            # A region (positions [0, T)) of a longer buffer: the Python binding shares C-contiguous arrays only.
            region = whole if arr.shape[2] == T else ov.Tensor(whole, [0, 0, 0, 0], [B, arr.shape[1], T, arr.shape[3]])
            graph.request.set_tensor(port, region)
        graph.request.infer()
        return graph.request.get_tensor(graph.logits).data[:, -1].copy()
