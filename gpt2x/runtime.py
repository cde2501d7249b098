"""Running an export on ONNX Runtime: session set-up per provider, IO binding with the KV cache kept
as OrtValues on the device between steps, and device-side cache reordering for beam search."""

from __future__ import annotations

import os
from typing import Any

import numpy as np

from . import onnx_io as io
from .choices import Precision, ProviderKind
from .errors import ArtifactError, ProviderError
from .export import ExportInfo

ORT_PROVIDERS = {ProviderKind.cpu: "CPUExecutionProvider", ProviderKind.cuda: "CUDAExecutionProvider"}
CUDA_HELP = (
    "onnxruntime-gpu needs an NVIDIA GPU with the CUDA and cuDNN 9 libraries of its release "
    "(CUDA 13 for 1.31) on the library path; `gpt2x info` shows which providers load"
)


def physical_cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def session_options(threads: int | None = None):
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.intra_op_num_threads = threads or physical_cores()
    so.inter_op_num_threads = 1
    so.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    so.log_severity_level = 3  # errors only: warnings about fallbacks are checked for explicitly
    return so


def create_session(model_path, provider: ProviderKind, threads: int | None = None, provider_options: dict | None = None):
    """An InferenceSession on exactly the asked provider: refuses ONNX Runtime's silent CPU fallback."""
    import onnxruntime as ort

    name = ORT_PROVIDERS[provider]
    if name not in ort.get_available_providers():
        raise ProviderError(f"ONNX Runtime {ort.__version__} here has no {name}; {CUDA_HELP}")
    ort.set_default_logger_severity(4)  # a failing provider is reported below, in one line
    providers = [(name, provider_options or {})]
    if provider is ProviderKind.cuda:
        providers.append(("CPUExecutionProvider", {}))  # for the few shape ops ORT places there
    try:
        model = model_path if isinstance(model_path, bytes) else str(model_path)
        sess = ort.InferenceSession(model, sess_options=session_options(threads), providers=providers)
    except Exception as e:  # ORT raises its own Fail/InvalidGraph/... types for unreadable models
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ArtifactError(f"ONNX Runtime cannot load {model_path}: {first}") from None
    if sess.get_providers()[0] != name:
        raise ProviderError(
            f"{name} failed to load (ONNX Runtime fell back to {sess.get_providers()[0]}); {CUDA_HELP}"
        )
    return sess


class OrtBackend:
    """One export on one provider. The KV cache is a list of OrtValues that stay where ONNX Runtime
    produced them (host memory on CPU, device memory on CUDA); only logits come back to the host."""

    name = "ort"

    def __init__(self, info: ExportInfo, provider: ProviderKind = ProviderKind.cpu, threads: int | None = None):
        import onnxruntime as ort

        if info.precision is Precision.fp16 and provider is ProviderKind.cpu:
            raise ProviderError(
                f"{info.folder} is an fp16 export, which gpt2x runs on CUDA only "
                "(use --provider cuda, or export --precision fp32/int8 for the CPU)"
            )
        self.info = info
        self.source_name = info.meta["model"]["name"]  # the model the export was made from
        self.cfg = info.config
        self.n_positions = self.cfg.n_positions
        self.provider = provider
        self.session = create_session(info.model_path, provider, threads)
        self.device = "cuda" if provider is ProviderKind.cuda else "cpu"
        self.kv_dtype = np.float16 if info.precision is Precision.fp16 else np.float32
        self.names_in = io.input_names(self.cfg.n_layer)
        self.names_out = io.output_names(self.cfg.n_layer)
        self._ort = ort
        self._reorder_session = None

    # -- the KV cache as OrtValues

    def empty_past(self, batch: int) -> list:
        shape = (batch, self.cfg.n_head, 0, self.cfg.head_dim)
        return [self._ort.OrtValue.ortvalue_from_shape_and_type(shape, self.kv_dtype, self.device, 0)
                for _ in range(2 * self.cfg.n_layer)]

    def past_from_numpy(self, arrays: list[np.ndarray]) -> list:
        return [self._ort.OrtValue.ortvalue_from_numpy(np.ascontiguousarray(a, dtype=self.kv_dtype), self.device, 0)
                for a in arrays]

    @staticmethod
    def present_to_numpy(present: list) -> list[np.ndarray]:
        return [v.numpy().astype(np.float32) for v in present]

    # -- running

    def run(self, input_ids: np.ndarray, attention_mask: np.ndarray, position_ids: np.ndarray, past: list | None):
        """All logits (B, T, V) on the host, and the presents as device-resident OrtValues."""
        if past is None:
            past = self.empty_past(input_ids.shape[0])
        binding = self.session.io_binding()
        for name, arr in ((io.INPUT_IDS, input_ids), (io.ATTENTION_MASK, attention_mask), (io.POSITION_IDS, position_ids)):
            binding.bind_cpu_input(name, np.ascontiguousarray(arr, dtype=np.int64))
        for name, value in zip(self.names_in[3:], past):
            binding.bind_ortvalue_input(name, value)
        binding.bind_output(io.LOGITS, "cpu")
        for name in self.names_out[1:]:
            binding.bind_output(name, self.device)
        self.session.run_with_iobinding(binding)
        outputs = binding.get_outputs()
        return outputs[0].numpy(), list(outputs[1:])

    def step(self, input_ids, attention_mask, position_ids, past):
        logits, present = self.run(input_ids, attention_mask, position_ids, past)
        return logits[:, -1], present

    def reorder(self, past: list, rows: np.ndarray) -> list:
        """Gather batch rows of every cache tensor, on the device (a one-node Gather graph)."""
        if self.device == "cpu":
            return [self._ort.OrtValue.ortvalue_from_numpy(np.ascontiguousarray(v.numpy()[rows])) for v in past]
        if self._reorder_session is None:
            self._reorder_session = create_session(_gather_model(self.kv_dtype), self.provider)
        idx = self._ort.OrtValue.ortvalue_from_numpy(np.asarray(rows, dtype=np.int64), self.device, 0)
        out = []
        for v in past:
            binding = self._reorder_session.io_binding()
            binding.bind_ortvalue_input("x", v)
            binding.bind_ortvalue_input("rows", idx)
            binding.bind_output("y", self.device)
            self._reorder_session.run_with_iobinding(binding)
            out.append(binding.get_outputs()[0])
        return out


def _gather_model(dtype) -> bytes:
    from onnx import TensorProto, helper

    t = TensorProto.FLOAT16 if dtype == np.float16 else TensorProto.FLOAT
    graph = helper.make_graph(
        [helper.make_node("Gather", ["x", "rows"], ["y"], axis=0)], "reorder",
        [helper.make_tensor_value_info("x", t, None), helper.make_tensor_value_info("rows", TensorProto.INT64, ["n"])],
        [helper.make_tensor_value_info("y", t, None)],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    model.ir_version = 10
    return model.SerializeToString()


def available_providers() -> dict[str, Any]:
    """Providers ONNX Runtime lists, and whether each really loads (a one-node session)."""
    import onnxruntime as ort

    listed = ort.get_available_providers()
    loadable = {}
    for kind, name in ORT_PROVIDERS.items():
        if name not in listed:
            loadable[kind.value] = "not in this build"
            continue
        try:
            create_session(_gather_model(np.float32), kind)
            loadable[kind.value] = "ok"
        except ProviderError as e:
            loadable[kind.value] = str(e)
    return {"listed": listed, "loadable": loadable}
