"""OpenVINO running an int8 export's prefill graph (openvino/prefill.xml) for the ONNX Runtime backend, which takes
its presents into its own KV cache (runtime/prefill.py chooses when). No torch."""

from __future__ import annotations

import numpy as np
import openvino as ov

from ..errors import ArtifactError
from ..onnx import names as io
from ..onnx.artifact import ExportInfo
from .providers import physical_cores


class OpenVinoPrefill:
    """The compiled prefill graph and one infer request; a call's presents are views valid until the next call."""

    def __init__(self, info: ExportInfo, threads: int | None = None):
        config = {
            "INFERENCE_NUM_THREADS": threads or physical_cores(),
            # f32 compute: the graph was gated at f32 (bf16 compute is OpenVINO's default where the CPU has it).
            "INFERENCE_PRECISION_HINT": "f32",
            "PERFORMANCE_HINT": "LATENCY",
            # Pinned threads wait for their core beside ONNX Runtime's (runtime/openvino.py measured it).
            "ENABLE_CPU_PINNING": False,
        }
        core = ov.Core()
        try:
            self.compiled = core.compile_model(core.read_model(str(info.prefill_path)), "CPU", config)
        except Exception as e:  # OpenVINO raises RuntimeError (and its own types) for unreadable graphs
            raise ArtifactError(f"OpenVINO {ov.__version__} cannot load {info.prefill_path}: {e}".splitlines()[0]) from None
        self.request = self.compiled.create_infer_request()
        n = info.config.n_layer
        self._ports = [self.compiled.input(name) for name in (io.INPUT_IDS, io.ATTENTION_MASK, io.POSITION_IDS)]
        self._logits = self.compiled.output(io.LOGITS)
        self._presents = [self.compiled.output(name) for name in io.output_names(n)[1:]]

    def __call__(self, input_ids, attention_mask, position_ids) -> tuple[np.ndarray, list[np.ndarray]]:
        """The last position's logits (B, V), a copy, and the presents (B, H, T, D), views into the request."""
        for port, arr in zip(self._ports, (input_ids, attention_mask, position_ids)):
            self.request.set_tensor(port, ov.Tensor(np.ascontiguousarray(arr, dtype=np.int64)))
        self.request.infer()
        logits = self.request.get_tensor(self._logits).data[:, -1].copy()
        return logits, [self.request.get_tensor(port).data for port in self._presents]
