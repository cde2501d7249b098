"""Running an export on ONNX Runtime: session set-up per provider, IO binding with the KV cache kept
as OrtValues on the device between steps, and device-side cache reordering for beam search.

Two ways to hold the cache, chosen from the export's metadata:
- growing (every export): each step's present outputs, one position longer, are the next step's
  past, as in Optimum. ONNX Runtime allocates them and copies the whole cache into them every step.
- shared (exports whose attention is GroupQueryAttention, i.e. int8): a fixed-capacity buffer per
  layer is bound as both past and present, and each step writes only its new positions into it.
"""

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


KV_CAPACITY_STEP = 256  # positions a shared KV cache holds beyond its first step, and grows by at least


class SharedKVCache:
    """Fixed-capacity KV buffers, one (B, H, capacity, D) OrtValue per layer and key/value, that a
    GroupQueryAttention graph reads as past and writes as present in place. Positions [0, length)
    hold the cache. A step writes position `length` onward into the same buffers: the cache given
    to a step must not be stepped from again (generation and beam search never do)."""

    def __init__(self, values: list, arrays: list[np.ndarray], length: int, binding=None):
        self.values = values  # what is bound to the graph
        self.arrays = arrays  # the host memory behind them (CPU only), kept alive here
        self.length = length
        self.binding = binding  # an IOBinding with these buffers bound as past and present, reused

    @property
    def capacity(self) -> int:
        return self.arrays[0].shape[2]

    def filled(self) -> list[np.ndarray]:
        return [a[:, :, : self.length] for a in self.arrays]


class OrtBackend:
    """One export on one provider. The KV cache is a list of OrtValues that stay where ONNX Runtime
    produced them (host memory on CPU, device memory on CUDA), or a SharedKVCache for graphs that
    update it in place; only logits come back to the host."""

    name = "ort"

    def __init__(self, info: ExportInfo, provider: ProviderKind = ProviderKind.cpu, threads: int | None = None,
                 shared_kv: bool | None = None):
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
        layout = info.attention
        self.batched_multi_token_past = layout["batched_multi_token_past"]
        # In-place cache updates: GroupQueryAttention graphs on the CPU (int8), unless turned off.
        can_share = layout["shared_kv_buffer"] and provider is ProviderKind.cpu
        if shared_kv and not can_share:
            raise ProviderError(f"{info.folder}: this export's attention cannot share its KV buffers on {provider.value}")
        self.shared_kv = can_share if shared_kv is None else shared_kv

    # -- the KV cache as OrtValues

    def empty_past(self, batch: int) -> list:
        shape = (batch, self.cfg.n_head, 0, self.cfg.head_dim)
        return [self._ort.OrtValue.ortvalue_from_shape_and_type(shape, self.kv_dtype, self.device, 0)
                for _ in range(2 * self.cfg.n_layer)]

    def past_from_numpy(self, arrays: list[np.ndarray]) -> list:
        return [self._ort.OrtValue.ortvalue_from_numpy(np.ascontiguousarray(a, dtype=self.kv_dtype), self.device, 0)
                for a in arrays]

    # -- running

    def run(self, input_ids: np.ndarray, attention_mask: np.ndarray, position_ids: np.ndarray, past):
        """All logits (B, T, V) on the host, and the new cache: presents as device-resident OrtValues,
        or the SharedKVCache, now `T` positions longer."""
        if isinstance(past, SharedKVCache) or (past is None and self.shared_kv):
            return self._run_shared(input_ids, attention_mask, position_ids, past)
        if past is None:
            past = self.empty_past(input_ids.shape[0])
        B, T = input_ids.shape
        if B > 1 and T > 1 and not self.batched_multi_token_past and attention_mask.shape[1] > T:
            return self._run_rows(input_ids, attention_mask, position_ids, past)
        return self._run_growing(input_ids, attention_mask, position_ids, past)

    def _bind_inputs(self, binding, input_ids, attention_mask, position_ids, past_values) -> None:
        for name, arr in ((io.INPUT_IDS, input_ids), (io.ATTENTION_MASK, attention_mask), (io.POSITION_IDS, position_ids)):
            binding.bind_cpu_input(name, np.ascontiguousarray(arr, dtype=np.int64))
        for name, value in zip(self.names_in[3:], past_values):
            binding.bind_ortvalue_input(name, value)

    def _run_growing(self, input_ids, attention_mask, position_ids, past: list):
        binding = self.session.io_binding()
        self._bind_inputs(binding, input_ids, attention_mask, position_ids, past)
        binding.bind_output(io.LOGITS, "cpu")
        for name in self.names_out[1:]:
            binding.bind_output(name, self.device)
        self.session.run_with_iobinding(binding)
        outputs = binding.get_outputs()
        return outputs[0].numpy(), list(outputs[1:])

    def _run_rows(self, input_ids, attention_mask, position_ids, past: list):
        """Several tokens on top of a past for a batch, one row at a time: GroupQueryAttention's CPU
        kernel takes such steps for batch 1 only. (CPU only: GroupQueryAttention graphs are int8.)"""
        host = [v.numpy() for v in past]
        logits, presents = [], []
        for r in range(input_ids.shape[0]):
            row_past = [self._ort.OrtValue.ortvalue_from_numpy(np.ascontiguousarray(a[r : r + 1])) for a in host]
            lg, pr = self._run_growing(input_ids[r : r + 1], attention_mask[r : r + 1], position_ids[r : r + 1], row_past)
            logits.append(lg)
            presents.append([v.numpy() for v in pr])
        merged = [self._ort.OrtValue.ortvalue_from_numpy(np.concatenate(parts)) for parts in zip(*presents)]
        return np.concatenate(logits), merged

    def _shared_cache(self, batch: int, capacity: int, keep: SharedKVCache | None = None) -> SharedKVCache:
        """Zeroed buffers of `capacity` positions, holding `keep`'s filled positions if given."""
        shape = (batch, self.cfg.n_head, capacity, self.cfg.head_dim)
        arrays = [np.zeros(shape, dtype=self.kv_dtype) for _ in range(2 * self.cfg.n_layer)]
        length = 0
        if keep is not None:
            length = keep.length
            for new, old in zip(arrays, keep.filled()):
                new[:, :, :length] = old
        return self._wrap_shared(arrays, length)

    def _wrap_shared(self, arrays: list[np.ndarray], length: int) -> SharedKVCache:
        """A SharedKVCache over host arrays: OrtValues that share their memory (no copy)."""
        return SharedKVCache([self._ort.OrtValue.ortvalue_from_numpy(a) for a in arrays], arrays, length)

    def _run_shared(self, input_ids, attention_mask, position_ids, cache: SharedKVCache | None):
        B, T = input_ids.shape
        length = 0 if cache is None else cache.length
        if attention_mask.shape[1] != length + T:
            raise ValueError(f"attention_mask covers {attention_mask.shape[1]} positions; the cache holds {length} + {T} new")
        if cache is None:
            cache = self._shared_cache(B, min(self.n_positions, T + KV_CAPACITY_STEP))
        elif length + T > cache.capacity:
            grown = max(length + T, min(self.n_positions, cache.capacity + max(KV_CAPACITY_STEP, cache.capacity)))
            cache = self._shared_cache(B, grown, keep=cache)
        binding = cache.binding
        if binding is None:
            binding = self.session.io_binding()
            for name, value in zip(self.names_in[3:], cache.values):
                binding.bind_ortvalue_input(name, value)
            for name, value in zip(self.names_out[1:], cache.values):
                binding.bind_ortvalue_output(name, value)  # the same buffers: written in place
        self._bind_inputs(binding, input_ids, attention_mask, position_ids, [])
        # A fresh host array for the logits each step, written by ONNX Runtime directly.
        logits = np.empty((B, T, self.cfg.vocab_size), dtype=np.float32)
        binding.bind_output(io.LOGITS, "cpu", 0, np.float32, list(logits.shape), logits.ctypes.data)
        self.session.run_with_iobinding(binding)
        return logits, SharedKVCache(cache.values, cache.arrays, length + T, binding)

    def step(self, input_ids, attention_mask, position_ids, past):
        logits, present = self.run(input_ids, attention_mask, position_ids, past)
        return logits[:, -1], present

    def present_to_numpy(self, present) -> list[np.ndarray]:
        if isinstance(present, SharedKVCache):
            return [a.astype(np.float32) for a in present.filled()]
        return [v.numpy().astype(np.float32) for v in present]

    def reorder(self, past, rows: np.ndarray):
        """Gather batch rows of every cache tensor, on the device (a one-node Gather graph)."""
        if isinstance(past, SharedKVCache):
            return self._wrap_shared([np.ascontiguousarray(a[rows]) for a in past.arrays], past.length)
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
