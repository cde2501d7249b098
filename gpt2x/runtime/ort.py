"""ONNX Runtime backend (no torch): IO binding, the KV cache kept as OrtValues on the device between steps.
Two cache forms: `GrowingCache` (each step's presents are the next past) and `InPlaceCache` (GroupQueryAttention
graphs on the CPU: one buffer bound as past and present; docs/export.md). An int8 export's batched decode graph, where
it has one, runs the steps of many rows x new tokens on the same caches (`OrtBackend.batched_from`).
"""

from __future__ import annotations

import warnings
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import replace

import numpy as np
import onnxruntime as ort

from ..choices import Precision, ProviderKind
from ..errors import ProviderError
from ..onnx import names as io
from ..onnx.artifact import DATA_FILE, ExportInfo, weights_beside
from ..onnx.graph_cache import InMemoryGraph, graph_key, kept_or_made, recorded_file
from ..onnx.kvcache import dequantize, quantize, with_int8_kv
from ..onnx.mapped import mapped_model
from .base import ORT_CAPABILITIES, Closable, Released, merge_on_host
from .kvbuffers import (
    BufferCache,
    IdleBuffers,
    KVBuffers,
    KVCacheView,
    buffers_for_step,
    holding,
    refuse_stale,
    rows_to_keep,
    small_page_arrays,
)
from .kvdtype import KvDtypeChoice, int8_kv_scales, scales_digest
from .kvdtype import asked as asked_kv_dtype
from .prefill import PrefillChoice, asked, estimate_ms, openvino_from, openvino_past_from
from .providers import (
    batched_from,
    bind_past_and_present,
    create_export_session,
    create_session,
    gather_model,
    last_argmax_model,
    refuse_fp16_on_cpu,
    slice_positions_model,
)
from .static_decode import StaticDecoder, fixed_cache_refusal


def unset_arrays(shape: tuple[int, ...], count: int, dtype) -> list[np.ndarray]:
    """Arrays left unset: GroupQueryAttention reads no position before writing it (tests/onnx/test_gqa.py fills
    them with NaN to check). Small pages: only the pages written are touched (kvbuffers.small_page_arrays)."""
    return small_page_arrays(shape, count, dtype)



# From a recorded OpenVINO prefill length this short (nearly every prompt), the graph is compiled on a thread of its own
# while the ONNX Runtime session is made: a fresh process's first prompt then waits less for it (the same graph, compiled
# once, whatever the wait: no timing chooses where a prompt runs).
PREPARE_PREFILL_FROM = 32

def in_place_twin(info: ExportInfo, kv_scales: np.ndarray | None = None) -> InMemoryGraph | None:
    """An fp32 export's GroupQueryAttention twin (onnx.optimize.in_place_form), on an int8 cache with `kv_scales`
    (onnx.kvcache.with_int8_kv), from the rewrite an earlier process kept on disk where there is one (onnx.graph_cache:
    no onnx imported), else made here and kept. None where the export has none (weights in a data file, no
    MultiHeadAttention)."""
    path = info.model_path
    if weights_beside(path):
        return None

    def make():
        from ..onnx.optimize import in_place_form  # onnx's rewrite: imported by the sessions that need it

        twin = in_place_form(path)
        if twin is None:
            return None
        if kv_scales is not None:
            import onnx

            proto = onnx.load_from_string(twin.graph)
            with_int8_kv(proto, kv_scales)
            twin = replace(twin, graph=proto.SerializeToString())
        return (twin,)

    key = graph_key("gqa-twin", recorded_file(info, path)) if kv_scales is None else \
        graph_key("gqa-twin-int8-kv", {"file": recorded_file(info, path), "scales": scales_digest(kv_scales)})
    kept = kept_or_made([key], mapped_model(path)[1], make)
    return None if kept is None else kept[0]


class _KVBuffers(KVBuffers):
    """KV buffers with OrtValues over the rows in use and their IO binding, both remade when the rows change."""

    def __init__(self, arrays: list[np.ndarray], length: int = 0, rows: int | None = None):
        super().__init__(arrays, length, rows)
        self.rows_changed()

    def rows_changed(self) -> None:
        self.values = [ort.OrtValue.ortvalue_from_numpy(a[: self.rows]) for a in self.arrays]  # no copy
        # IOBindings with these buffers bound as past and present, reused: one per session (a binding is its session's)
        self.bindings: dict[int, object] = {}


class GrowingCache:
    """OrtValues left where ONNX Runtime produced them (host or device); a step's presents are the next past."""

    __slots__ = ("owner", "values")

    def __init__(self, owner: OrtBackend, values: list):
        self.owner = owner
        self.values = values

    @classmethod
    def empty(cls, owner: OrtBackend, batch: int) -> GrowingCache:
        shape = (batch, owner.cfg.n_head, 0, owner.cfg.head_dim)
        return cls(owner, [ort.OrtValue.ortvalue_from_shape_and_type(shape, owner.kv_dtype, owner.device, 0)
                           for _ in range(2 * owner.cfg.n_layer)])

    @classmethod
    def from_numpy(cls, owner: OrtBackend, arrays: list[np.ndarray]) -> GrowingCache:
        return cls(owner, [ort.OrtValue.ortvalue_from_numpy(np.ascontiguousarray(a, dtype=owner.kv_dtype), owner.device, 0)
                           for a in arrays])

    @property
    def rows(self) -> int:
        return self.values[0].shape()[0]

    @property
    def length(self) -> int:
        return self.values[0].shape()[2]

    def to_numpy(self) -> list[np.ndarray]:
        return [v.numpy().astype(np.float32, copy=False) for v in self.values]  # numpy() copies already

    stored = to_numpy  # float32, or float16 read as float32

    # -- stepping

    def forward(self, input_ids, attention_mask, position_ids, keep: int) -> tuple[np.ndarray, GrowingCache]:
        """Logits of the last `keep` positions (0: every position) on the host, and the next cache."""
        B, T = input_ids.shape
        if B > 1 and T > 1 and self.length and not self.owner.batched_multi_token_past:
            return self._forward_rows(input_ids, attention_mask, position_ids, keep)
        session = self.owner.session_for(B, T)
        binding = session.io_binding()
        self.owner.bind_inputs(binding, input_ids, attention_mask, position_ids, self.values, keep)
        binding.bind_output(io.LOGITS, "cpu")
        for name in self.owner.names_out[1:]:
            binding.bind_output(name, self.owner.device)
        session.run_with_iobinding(binding)
        outputs = binding.get_outputs()
        return outputs[0].numpy(), GrowingCache(self.owner, list(outputs[1:]))

    def forward_greedy(self, input_ids, attention_mask, position_ids) -> tuple[np.ndarray, GrowingCache]:
        """A step whose logits stay on the device, returning each row's argmax."""
        binding = self.owner.session.io_binding()
        self.owner.bind_inputs(binding, input_ids, attention_mask, position_ids, self.values, keep=1)
        for name in self.owner.names_out:
            binding.bind_output(name, self.owner.device)  # the logits too: they stay on the device
        self.owner.session.run_with_iobinding(binding)
        outputs = binding.get_outputs()
        return self.owner.argmax_on_device(outputs[0]), GrowingCache(self.owner, list(outputs[1:]))

    def _forward_rows(self, input_ids, attention_mask, position_ids, keep: int):
        """One row at a time (CPU only: GroupQueryAttention graphs are int8 and int4)."""
        host = [v.numpy() for v in self.values]
        logits, presents = [], []
        for r in range(input_ids.shape[0]):
            row = GrowingCache(self.owner, [ort.OrtValue.ortvalue_from_numpy(np.ascontiguousarray(a[r : r + 1])) for a in host])
            lg, pr = row.forward(input_ids[r : r + 1], attention_mask[r : r + 1], position_ids[r : r + 1], keep)
            logits.append(lg)
            presents.append([v.numpy() for v in pr.values])
        merged = [ort.OrtValue.ortvalue_from_numpy(np.concatenate(parts)) for parts in zip(*presents)]
        return np.concatenate(logits), GrowingCache(self.owner, merged)

    # -- the cache's operations

    def reorder(self, rows: np.ndarray) -> GrowingCache:
        """Batch rows gathered: on the host for the CPU, with a one-node Gather graph on CUDA."""
        if self.owner.device == "cpu":
            return GrowingCache(self.owner, [ort.OrtValue.ortvalue_from_numpy(np.ascontiguousarray(v.numpy()[rows]))
                                             for v in self.values])
        idx = ort.OrtValue.ortvalue_from_numpy(np.asarray(rows, dtype=np.int64), self.owner.device, 0)
        return GrowingCache(self.owner, self.owner.each_on_device("reorder", self.values, "rows", idx))

    def truncate(self, length: int) -> GrowingCache:
        """The first `length` positions as new tensors (they are not contiguous): on the host for the CPU,
        a one-node Slice graph on CUDA."""
        held = self.length
        if not 0 <= length <= held:
            raise ValueError(f"cannot keep {length} positions of a cache holding {held}")
        if length == held:
            return self
        if self.owner.device == "cpu":
            return GrowingCache(self.owner, [ort.OrtValue.ortvalue_from_numpy(np.ascontiguousarray(v.numpy()[:, :, :length]))
                                             for v in self.values])
        ends = ort.OrtValue.ortvalue_from_numpy(np.array([length], dtype=np.int64))  # a shape input: on the host
        return GrowingCache(self.owner, self.owner.each_on_device("truncate", self.values, "ends", ends))

    def merge(self, rows: np.ndarray, joiner: GrowingCache | None, width: int) -> GrowingCache:
        return merge_on_host(self, rows, joiner, width, self.owner.past_from_numpy)


class InPlaceCache(BufferCache):
    """Buffers a GroupQueryAttention graph reads as past and writes as present, bound once per buffers and rows."""

    merges_to_context = True  # a merged batch decodes: a one-token step takes as long in 640 or 1024 positions

    @classmethod
    def allocate(cls, owner: OrtBackend, batch: int, capacity: int, keep: KVCacheView | None) -> _KVBuffers:
        """Unset buffers holding `keep`, with at least as many rows as its buffers had (rows may join later)."""
        batch, rows = rows_to_keep(batch, keep)
        shape = (batch, owner.cfg.n_head, capacity, owner.cfg.head_dim)
        count = 2 * owner.cfg.n_layer
        reused = owner.idle.take(shape, count, owner.kv_dtype)
        arrays = holding(reused or owner.idle.adopt(unset_arrays(shape, count, owner.kv_dtype)), keep)
        return _KVBuffers(arrays) if keep is None else _KVBuffers(arrays, keep.length, rows)

    @property
    def values(self) -> list:
        return self.buffers.values

    @classmethod
    def from_numpy(cls, owner: OrtBackend, arrays: list[np.ndarray]) -> InPlaceCache:
        """As BufferCache's; where the cache is int8 (owner.kv_scales), float arrays quantized as it stores them and
        int8 ones (`stored`'s) taken as they are."""
        if owner.kv_scales is not None and arrays[0].dtype != np.int8:
            arrays = [quantize(a, s) for a, s in zip(arrays, owner.kv_scales)]
        return super().from_numpy(owner, arrays)

    def to_numpy(self) -> list[np.ndarray]:
        """float32 arrays (B, H, length, D); an int8 cache's dequantized."""
        if self.owner.kv_scales is None:
            return super().to_numpy()
        return [dequantize(a, s) for a, s in zip(self.filled(), self.owner.kv_scales)]

    @classmethod
    def first(cls, owner: OrtBackend, input_ids, attention_mask, position_ids, keep: int) -> tuple[np.ndarray, InPlaceCache]:
        """A prefill. A batch's gets no spare positions (GroupQueryAttention's multi-token step grows with the
        capacity); a single row's keeps them, where the later move costs more (docs/results/serving.md)."""
        B, T = input_ids.shape
        buffers = buffers_for_step(None, B, T, owner.n_positions, cls.capacity_step,
                                   lambda b, c, k: cls.allocate(owner, b, c, k), first_room=0 if B > 1 else None)
        return cls._run(owner, buffers, 0, input_ids, attention_mask, position_ids, keep)

    def forward(self, input_ids, attention_mask, position_ids, keep: int) -> tuple[np.ndarray, InPlaceCache]:
        B, T = input_ids.shape
        refuse_stale(self)
        if attention_mask.shape[1] != self.length + T:
            raise ValueError(f"attention_mask covers {attention_mask.shape[1]} positions; the cache holds {self.length} + {T} new")
        return self._run(self.owner, self.buffers_for_step(B, T), self.length, input_ids, attention_mask, position_ids, keep)

    @classmethod
    def _run(cls, owner: OrtBackend, buffers: _KVBuffers, length: int, input_ids, attention_mask, position_ids,
             keep: int) -> tuple[np.ndarray, InPlaceCache]:
        B, T = input_ids.shape
        if B > 1 and T > 1 and length and not owner.batched_multi_token_past:  # row by row (GrowingCache's rule)
            logits = np.concatenate([
                cls._run_views(owner, buffers, [a[r : r + 1] for a in buffers.arrays], input_ids[r : r + 1],
                               attention_mask[r : r + 1], position_ids[r : r + 1], keep)
                for r in range(B)
            ])
        else:
            logits = cls._run_views(owner, buffers, None, input_ids, attention_mask, position_ids, keep)
        buffers.length = length + T
        return logits, cls(buffers, length + T, owner)

    @staticmethod
    def _run_views(owner: OrtBackend, buffers: _KVBuffers, row_views: list[np.ndarray] | None, input_ids,
                   attention_mask, position_ids, keep: int) -> np.ndarray:
        """One run with `buffers` bound as past and present, or `row_views` (one row of each) for a row run, on
        the session for its rows x new tokens."""
        B, T = input_ids.shape
        session = owner.session_for(B, T)
        if row_views is None:
            binding = buffers.bindings.get(id(session))
            if binding is None:
                binding = buffers.bindings[id(session)] = owner.bind_in_place(buffers.values, session)
        else:
            binding = owner.bind_in_place([ort.OrtValue.ortvalue_from_numpy(a) for a in row_views], session)
        owner.bind_inputs(binding, input_ids, attention_mask, position_ids, [], keep)
        kept = min(keep, T) if keep and owner.logits_to_keep is not None else T
        logits = np.empty((B, kept, owner.vocab_size), dtype=np.float32)
        binding.bind_output(io.LOGITS, "cpu", 0, np.float32, list(logits.shape), logits.ctypes.data)
        session.run_with_iobinding(binding)
        return logits


# Rows a step needs to run on the batched decode graph (unless asked for every step): the export times steps of rows,
# and one row's 32-token prefill, on that graph after decode steps on model.onnx, came later than on model.onnx
# (gpt2x bench at batch 1, docs/results/engines.md).
BATCHED_MIN_ROWS = 2


def _open_openvino_prefill(info: ExportInfo, threads: int | None, kv_scales: np.ndarray | None, compile_now: bool):
    """OrtBackend's OpenVINO prefill, on its thread: openvino imported only where it runs a prefill."""
    try:
        from .openvino_prefill import OpenVinoPrefill
    except ImportError as e:
        raise ProviderError(f"{info.folder}: cannot run the prefill on OpenVINO: openvino does not import ({e})") from None
    graph = OpenVinoPrefill(info, threads, kv_scales)
    if compile_now:
        graph.prepare(wait=True)
    return graph


class OrtBackend(Closable):
    """One export on one provider; only logits come back to the host. `in_place_kv`: None uses the in-place
    cache wherever it can on the CPU (an fp32 export through its twin), False never, True requires it (`shared_kv`: its deprecated name).
    `prefill` (runtime.prefill.PrefillChoice; None: GPT2X_PREFILL's, else auto): where a fresh prompt's `step` runs,
    ONNX Runtime or an fp32 or int8 export's OpenVINO prefill graph, whose presents then fill this backend's own cache.
    `batched` (CPU): None runs a step of rows x new tokens >= the export's recorded batched_from on its batched decode
    graph (none where it has none), True every step, False none. `kv_cache_dtype` (runtime.kvdtype.KvDtypeChoice;
    None: GPT2X_KV_CACHE_DTYPE's, else auto): an int8 or int4 export's in-place cache in int8 or its float.
    `prefill_tokens`: the most new tokens (rows x tokens) a multi-token step will run, where the caller knows it (a
    one-shot generation); the OpenVINO prefill is then opened at start only where such a step runs on it."""

    name = "ort"
    # step_greedy takes the argmax on the device on CUDA (on the CPU, NumPy's on the host).
    capabilities = ORT_CAPABILITIES
    cache_forms = (GrowingCache, InPlaceCache)

    def __init__(self, info: ExportInfo, provider: ProviderKind = ProviderKind.cpu, threads: int | None = None,
                 in_place_kv: bool | None = None, *, shared_kv: bool | None = None,
                 prefill: PrefillChoice | str | None = None, batched: bool | None = None,
                 kv_cache_dtype: KvDtypeChoice | str | None = None, prefill_tokens: int | None = None):
        if shared_kv is not None:
            warnings.warn("OrtBackend(shared_kv=...) is deprecated; use in_place_kv=...", DeprecationWarning, stacklevel=2)
            if in_place_kv is None:
                in_place_kv = shared_kv
        refuse_fp16_on_cpu(info, provider)
        refused = self.capabilities.refuse_export(self.name, info.folder, info.precision, provider)
        if refused is not None:
            raise refused
        self.info = info
        self.model_name = info.meta["model"]["name"]
        self.cfg = info.config
        self.n_positions = self.cfg.n_positions
        self.vocab_size = self.cfg.vocab_size
        self.provider = provider
        layout = info.attention
        # Unless asked not to, an fp32 export's MultiHeadAttention graph runs on the CPU as its GroupQueryAttention
        # twin, made in memory: a step copies no past, and its weights come from the mapped file (docs/export.md).
        # On an int8 cache where the export's record chose one (runtime.kvdtype: an fp32 export made with --int8-kv).
        twin = scales = None
        kv_choice = asked_kv_dtype(kv_cache_dtype)
        if provider is ProviderKind.cpu and in_place_kv is not False and not io.in_place_kv(layout):
            scales = int8_kv_scales(info, kv_choice, not weights_beside(info.model_path))
            twin = in_place_twin(info, scales)
        if twin is not None:
            layout = twin.attention
        can = io.in_place_kv(layout) and provider is ProviderKind.cpu
        if in_place_kv and not can:
            raise ProviderError(f"{info.folder}: this export's attention cannot update its KV cache in place on {provider.value}")
        self.in_place_kv = can if in_place_kv is None else in_place_kv
        # An int8 or int4 export's cache in int8 where its record chose that (runtime.kvdtype): the graphs rewritten
        # in memory to read and write it (onnx.kvcache.with_int8_kv); an fp32 export's twin was rewritten above.
        # (read once: the twin's are those, its cache being in place)
        self.kv_scales = scales if twin is not None else int8_kv_scales(info, kv_choice, self.in_place_kv)
        scales = None if twin is not None else self.kv_scales
        self._transform = None if scales is None else (lambda proto: with_int8_kv(proto, scales))
        # the int8 cache's graphs, kept rewritten on disk for the next process (onnx.graph_cache), by file and scales
        self._scales_digest = scales_digest(scales)
        self._twin = twin
        choice = asked(prefill)
        self._openvino_from = openvino_from(info, choice, provider is ProviderKind.cpu)
        # A step of several new tokens a row on a past (a prompt's next chunk, its rest after a cached prefix) on
        # OpenVINO too, where it reads and writes the in-place cache's buffers (a growing cache stays on ONNX Runtime).
        self._openvino_past_from = openvino_past_from(info, choice, self._openvino_from) if self.in_place_kv else None
        # OpenVINO's prefill imported, loaded and (where nearly every prompt runs there) compiled and run once on a thread
        # of its own while the session is made (ONNX Runtime releases the GIL): a fresh process's first token waits for
        # what is left of it, not for all of it (openvino's import alone is 0.2-0.3 s). Where the caller knows that no
        # step will run there (`prefill_tokens`), at its first use instead: the thread's work would slow the session's.
        self._prefill_graph_opening: Future | None = None
        self._prefill_graph_opened = None
        self._prefill_graph_later: tuple | None = None  # what opens it at its first use, where that is left to it
        if self._openvino_from is not None:
            first = min(self._openvino_from, self._openvino_past_from or self._openvino_from)
            if prefill_tokens is not None and prefill_tokens < first:
                self._prefill_graph_later = (info, threads, self.kv_scales)
            else:
                pool = ThreadPoolExecutor(1, thread_name_prefix="gpt2x-openvino-prefill")
                self._prefill_graph_opening = pool.submit(_open_openvino_prefill, info, threads, self.kv_scales,
                                                          self._openvino_from <= PREPARE_PREFILL_FROM)
                pool.shutdown(wait=False)  # the thread ends with its one job
        self.session = self._open_session(threads)
        self._twin = None  # its weights copied into the session: the mapped file is let go (create_session)
        self.attention = layout
        self.idle = IdleBuffers()  # the in-place cache's memory, reused by its next buffers
        self._batched_from = batched_from(info, batched, provider is ProviderKind.cpu)
        self._batched_rows = 1 if batched else BATCHED_MIN_ROWS
        # Opened by the first step that runs on it: a batch-1 user never loads its weights (282 MB for GPT-2 124M).
        self._batched = None
        self._threads = threads
        self.device = "cuda" if provider is ProviderKind.cuda else "cpu"
        self.kv_dtype = np.int8 if self.kv_scales is not None else np.float16 if info.precision is Precision.fp16 else np.float32
        self.names_in = io.input_names(self.cfg.n_layer)
        self.names_out = io.output_names(self.cfg.n_layer)
        self._helpers: dict = {}  # one-node graphs on this provider (gather, slice, argmax), made when first used
        self._fixed: dict = {}  # fixed_decoder's, by (rows, sampling): each holds a captured CUDA graph on CUDA
        # Optional (older exports lack it): `step` binds 1, so a prefill unembeds its last position only; `run` 0.
        overridable = {i.name for i in self.session.get_overridable_initializers()}
        self.logits_to_keep = {k: ort.OrtValue.ortvalue_from_numpy(np.array(k, dtype=np.int64)) for k in (0, 1)} \
            if io.LOGITS_TO_KEEP in overridable else None
        self.batched_multi_token_past = layout["batched_multi_token_past"]

    @property
    def _openvino_prefill(self):
        """The OpenVINO prefill (None: none), once its thread has opened it (or now, where it was left to its first
        use): an error there is raised here, at each use."""
        if self._prefill_graph_later is not None:
            self._prefill_graph_opened = _open_openvino_prefill(*self._prefill_graph_later, False)
            self._prefill_graph_later = None
        if self._prefill_graph_opening is not None:
            self._prefill_graph_opened = self._prefill_graph_opening.result()
            self._prefill_graph_opening = None
        return self._prefill_graph_opened

    @_openvino_prefill.setter
    def _openvino_prefill(self, graph) -> None:
        self._prefill_graph_opening, self._prefill_graph_opened, self._prefill_graph_later = None, graph, None

    @property
    def prefill(self) -> str:
        """The runtime that runs a fresh prompt's prefill: "onnxruntime", or "openvino" (from `prefill_from`
        tokens on; `run`, every position's logits, stays on ONNX Runtime)."""
        return (PrefillChoice.onnxruntime if self._openvino_from is None else PrefillChoice.openvino).value

    @property
    def prefill_precision(self) -> str | None:
        """OpenVINO's compute precision for the prefill ("f32" or "bf16", the export's record's; None: no OpenVINO)."""
        return None if self._openvino_prefill is None else self._openvino_prefill.inference_precision

    @property
    def prefill_from(self) -> int | None:
        """The prefill tokens (rows x prompt length) from which OpenVINO runs the prefill (None: never)."""
        return self._openvino_from

    @property
    def prefill_past_from(self) -> int | None:
        """The new tokens (rows x new tokens) from which OpenVINO runs a multi-token step on a past (None: never)."""
        return self._openvino_past_from

    def prefill_ms(self, rows: int, new_tokens: int, past_tokens: int = 0) -> float | None:
        """The estimated ms of a prefill of `rows` x `new_tokens` on a past of `past_tokens`, on the runtime that
        prefill_runtime says runs it, from the times the export recorded for one row on both runtimes
        (runtime.prefill.estimate_ms: fresh prompts, and chunks on the one past it timed; an export without the
        latter, ONNX Runtime's fresh line); None without an OpenVINO prefill, where every prefill runs on ONNX Runtime
        and fewer tokens take less time."""
        if self._openvino_from is None:
            return None
        runtime = PrefillChoice(self.prefill_runtime(new_tokens, rows, past_tokens))
        timing = self.info.prefill.get("timing") or {}
        on_past = timing.get("past") if past_tokens else None
        return estimate_ms(on_past or timing, runtime, rows * new_tokens)

    def prefill_runtime(self, prompt_len: int, rows: int = 1, past_tokens: int = 0) -> str:
        """The runtime that runs `rows` prompts of `prompt_len` new tokens on a past of `past_tokens`: "onnxruntime"
        or "openvino". The export timed one row's prompts; a batch is placed by its tokens, rows x prompt_len, which
        its matmuls scale with (16 rows of 32 tokens ran sooner on OpenVINO, as one of 512 does:
        docs/results/engines.md). A decode step (one new token a row) always runs on ONNX Runtime."""
        start = self._openvino_past_from if past_tokens else self._openvino_from
        openvino = self._openvino_from is not None and start is not None and prompt_len > 1 and rows * prompt_len >= start
        return (PrefillChoice.openvino if openvino else PrefillChoice.onnxruntime).value

    @property
    def batched_from(self) -> int | None:
        """The rows x new tokens from which a step runs on the export's batched decode graph (None: never)."""
        return self._batched_from

    def session_for(self, rows: int, new_tokens: int):
        """The session that runs a step of `rows` x `new_tokens`: the batched decode graph's from batched_from rows x
        new tokens on, with BATCHED_MIN_ROWS rows at least unless asked for every step."""
        if self._batched_from is None or rows < self._batched_rows or rows * new_tokens < self._batched_from:
            return self.session
        if self._batched is None:
            self._batched = self._open_session(self._threads, batched=True)
        return self._batched

    def _open_session(self, threads: int | None, batched: bool = False):
        """A session on model.onnx (an fp32 export's in its in-place twin) or on the batched decode graph."""
        path = self.info.batched_path if batched else self.info.model_path
        if self._twin is not None and not batched:
            return create_session(self._twin.graph, self.provider, threads, weights=self._twin.weights)
        key = None if self._transform is None else \
            graph_key("int8-kv", {"file": recorded_file(self.info, path), "scales": self._scales_digest})
        return create_export_session(path, self.provider, threads, self._transform, key)

    def warm_up(self, fold_bf16: bool = False) -> None:
        """Open now what a step would on its first use: the batched decode graph's session, and OpenVINO's prefill
        graph compiled for each compute precision and form (fresh, on a past) it may run at (a 512-token prompt joining
        a served batch first: 270-390 ms more of the rows' wait, scratch), its bf16 graphs with their weights folded
        where the export gated that (`fold_bf16`: regardless, for that gate)."""
        if self._batched_from is not None:
            self.session_for(max(self._batched_rows, self._batched_from), 1)  # a decode step it runs
        if self._openvino_prefill is not None:
            self._openvino_prefill.warm_up(past=self._openvino_past_from is not None, fold_bf16=fold_bf16)

    @property
    def batched_open(self) -> bool:
        """Whether the batched decode graph's session is open (a step has run on it)."""
        return self._batched is not None and self._batched is not self.session

    @property
    def shared_kv(self) -> bool:
        """Deprecated: `in_place_kv`'s former name (for one release)."""
        warnings.warn("OrtBackend.shared_kv is deprecated; use in_place_kv", DeprecationWarning, stacklevel=2)
        return self.in_place_kv

    def close(self) -> None:
        self.session = Released(self.name)
        self._batched = None if self._batched_from is None else self.session  # batched steps refused as the others
        self._openvino_prefill = None
        self._helpers.clear()
        for decoder in self._fixed.values():
            decoder.close()
        self._fixed.clear()

    def fixed_refusal(self) -> str | None:
        """Why this export cannot decode on the fixed-capacity cache here (static_decode.fixed_cache_refusal), or None."""
        if (self.info.folder / DATA_FILE).exists():  # optimize.static_forms rewrites a graph whose weights it holds
            return "its weights are in a data file (past 2 GB), which the fixed-shape decode graph does not read"
        return fixed_cache_refusal(self.provider, self.info.precision)

    def fixed_decoder(self, rows: int, positions: int, sampling: bool = False) -> StaticDecoder:
        """A StaticDecoder of `rows` rows holding at least `positions` positions on this export and provider, its step a
        CUDA graph on CUDA. Its capacity is `positions` rounded up to 64, sized to the generation as the bench's
        decoder is (not the model's context); made once per (rows, capacity, sampling) and kept (its capture paid
        once), closed with the backend."""
        key = (rows, min(self.n_positions, -(-positions // 64) * 64), sampling)
        if key not in self._fixed:
            self._fixed[key] = StaticDecoder(self.info, self.provider, rows, capacity=key[1], threads=self._threads,
                                             cuda_graph=self.provider is ProviderKind.cuda, sampling=sampling)
        return self._fixed[key]

    def past_from_numpy(self, arrays: list[np.ndarray]):
        return (InPlaceCache if self.in_place_kv else GrowingCache).from_numpy(self, arrays)

    def past_buffers(self, batch: int, length: int, dtype):
        """The in-place cache's new buffers to write a past of `dtype` into (base.past_to_fill), where it stores that
        dtype; None otherwise (the growing cache's tensors are ONNX Runtime's)."""
        if not self.in_place_kv or np.dtype(dtype) != np.dtype(self.kv_dtype):
            return None
        return InPlaceCache.to_fill(self, batch, length)

    def peak_device_memory_mb(self) -> float | None:
        """None: ONNX Runtime's arena is not exposed to Python."""
        return None

    # -- running

    def run(self, input_ids: np.ndarray, attention_mask: np.ndarray, position_ids: np.ndarray, past):
        return self._forward(input_ids, attention_mask, position_ids, past, keep=0)

    def step(self, input_ids, attention_mask, position_ids, past):
        B, T = input_ids.shape
        if self.prefill_runtime(T, B, 0 if past is None else past.length) == PrefillChoice.openvino.value:
            return self._openvino_step(input_ids, attention_mask, position_ids, past)
        logits, present = self._forward(input_ids, attention_mask, position_ids, past, keep=1)
        return logits[:, -1], present

    def _openvino_step(self, input_ids, attention_mask, position_ids, past: InPlaceCache | None):
        """A prompt on OpenVINO's prefill graph, which writes its presents straight into this backend's cache form (the
        in-place buffers, with room to grow as from_numpy's, or a growing cache's arrays); on a past, it reads the
        in-place buffers' filled positions and writes the new ones after them."""
        B, T = input_ids.shape
        prefill = self._openvino_prefill
        length = 0 if past is None else past.length
        if attention_mask.shape != (B, length + T):
            raise ValueError(f"attention_mask has shape {attention_mask.shape}; the cache holds {length} positions "
                             f"and the step {T} new ones for {B} rows")
        if past is not None:
            if past.rows != B:
                raise ValueError(f"the KV cache holds {past.rows} rows; the step has {B}")
            buffers = past.buffers_for_step(B, T)
            logits = prefill(input_ids, attention_mask, position_ids, buffers.arrays, past=length)
            buffers.length = length + T
            return logits, InPlaceCache(buffers, length + T, self)
        if self.in_place_kv:
            buffers = buffers_for_step(None, B, T, self.n_positions, InPlaceCache.capacity_step,
                                       lambda b, c, k: InPlaceCache.allocate(self, b, c, k))
            logits = prefill(input_ids, attention_mask, position_ids, buffers.arrays)
            buffers.length = T
            return logits, InPlaceCache(buffers, T, self)
        arrays = [np.empty((B, self.cfg.n_head, T, self.cfg.head_dim), self.kv_dtype) for _ in range(2 * self.cfg.n_layer)]
        logits = prefill(input_ids, attention_mask, position_ids, arrays)
        return logits, GrowingCache(self, [ort.OrtValue.ortvalue_from_numpy(a) for a in arrays])  # shared: no copy

    def step_greedy(self, input_ids, attention_mask, position_ids, past):
        """On CUDA a one-node ArgMax graph (first of equal maxima, as NumPy's) sends only the tokens back."""
        if self.device == "cpu":
            logits, present = self.step(input_ids, attention_mask, position_ids, past)
            return logits.argmax(axis=-1).astype(np.int64), present
        cache = GrowingCache.empty(self, input_ids.shape[0]) if past is None else past
        return cache.forward_greedy(input_ids, attention_mask, position_ids)

    def _forward(self, input_ids, attention_mask, position_ids, past, keep: int):
        if past is not None:
            return past.forward(input_ids, attention_mask, position_ids, keep)
        if self.in_place_kv:
            return InPlaceCache.first(self, input_ids, attention_mask, position_ids, keep)
        return GrowingCache.empty(self, input_ids.shape[0]).forward(input_ids, attention_mask, position_ids, keep)

    # -- what the cache forms bind and run

    def bind_inputs(self, binding, input_ids, attention_mask, position_ids, past_values: list, keep: int) -> None:
        for name, arr in ((io.INPUT_IDS, input_ids), (io.ATTENTION_MASK, attention_mask), (io.POSITION_IDS, position_ids)):
            binding.bind_cpu_input(name, np.ascontiguousarray(arr, dtype=np.int64))
        if self.logits_to_keep is not None:  # always bound: an in-place binding is reused across steps
            binding.bind_ortvalue_input(io.LOGITS_TO_KEEP, self.logits_to_keep[keep])
        for name, value in zip(self.names_in[3:], past_values):
            binding.bind_ortvalue_input(name, value)

    def bind_in_place(self, values: list, session):
        binding = session.io_binding()
        bind_past_and_present(binding, values)
        return binding

    def _helper(self, kind: str):
        if kind not in self._helpers:
            model = {"reorder": lambda: gather_model(self.kv_dtype), "truncate": lambda: slice_positions_model(self.kv_dtype),
                     "argmax": last_argmax_model}[kind]()
            self._helpers[kind] = create_session(model, self.provider)
        return self._helpers[kind]

    def each_on_device(self, kind: str, values: list, name: str, value) -> list:
        """A one-node graph (`kind`: reorder or truncate) run on every cache tensor; outputs stay on the device."""
        session = self._helper(kind)
        out = []
        for v in values:
            binding = session.io_binding()
            binding.bind_ortvalue_input("x", v)
            binding.bind_ortvalue_input(name, value)
            binding.bind_output("y", self.device)
            session.run_with_iobinding(binding)
            out.append(binding.get_outputs()[0])
        return out

    def argmax_on_device(self, logits) -> np.ndarray:
        """Each row's argmax at its last position of a logits OrtValue (B, T, V), on its device."""
        session = self._helper("argmax")
        binding = session.io_binding()
        binding.bind_ortvalue_input("x", logits)
        binding.bind_output("y", "cpu")
        session.run_with_iobinding(binding)
        return binding.get_outputs()[0].numpy()[:, 0]
