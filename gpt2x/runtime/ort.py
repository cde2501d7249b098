"""Running an export on ONNX Runtime (no torch): IO binding with the KV cache kept as OrtValues on the
device between steps, and device-side cache reordering for beam search.

Two ways to hold the cache, chosen from the export's metadata:
- growing (every export): each step's present outputs, one position longer, are the next step's
  past, as in Optimum. ONNX Runtime allocates them and copies the whole cache into them every step.
- in place (`in_place_kv`; exports whose attention is GroupQueryAttention, i.e. int8 and int4): a
  fixed-capacity buffer per layer is bound as both past and present, and each step writes only its
  new positions into it.
  A serving batch's rows leave and join inside those buffers (`merge`, kvbuffers.merge_rows).
"""

from __future__ import annotations

import warnings

import numpy as np
import onnxruntime as ort

from ..choices import Precision, ProviderKind
from ..errors import ProviderError
from ..onnx import names as io
from ..onnx.artifact import ExportInfo
from .base import Capabilities, Closable, Released, merge_on_host
from .kvbuffers import (
    KV_CAPACITY_STEP,
    KVBuffers,
    KVCacheView,
    buffers_for_step,
    buffers_holding,
    holding,
    merge_rows,
    refuse_stale,
    rows_to_keep,
    truncated,
    zeroed_arrays,
)
from .providers import create_session, gather_model, last_argmax_model, refuse_fp16_on_cpu, slice_positions_model


class _KVBuffers(KVBuffers):
    """KV buffers with OrtValues over the rows in use (`a[:rows]`: the same memory), and the IO binding
    that binds them as past and present; both are made again when the rows in use change."""

    def __init__(self, arrays: list[np.ndarray], length: int = 0, rows: int | None = None):
        super().__init__(arrays, length, rows)
        self.rows_changed()

    def rows_changed(self) -> None:
        self.values = [ort.OrtValue.ortvalue_from_numpy(a[: self.rows]) for a in self.arrays]  # no copy
        self.binding = None  # an IOBinding with these buffers bound as past and present, reused


class InPlaceKVCache(KVCacheView):
    """A view of the in-place KV buffers a GroupQueryAttention graph reads as past and writes as present
    (kvbuffers.py: stepping from a stale view is refused)."""

    @property
    def values(self) -> list:
        return self.buffers.values


class OrtBackend(Closable):
    """One export on one provider. The KV cache is a list of OrtValues that stay where ONNX Runtime
    produced them (host memory on CPU, device memory on CUDA), or an InPlaceKVCache for graphs that
    update it in place (`in_place_kv`); only logits come back to the host.

    `in_place_kv`: None uses the in-place cache wherever the export allows it (GroupQueryAttention on
    the CPU), False keeps the growing one, True requires the in-place one. `shared_kv` is its former
    name, accepted for one release with a DeprecationWarning."""

    name = "ort"
    # step_greedy takes the argmax on the device on CUDA (on the CPU, NumPy's on the host).
    capabilities = Capabilities(takes_past=True, joins_rows=True, rolls_back=True, argmax_where_logits_are=True)

    def __init__(self, info: ExportInfo, provider: ProviderKind = ProviderKind.cpu, threads: int | None = None,
                 in_place_kv: bool | None = None, *, shared_kv: bool | None = None):
        if shared_kv is not None:
            warnings.warn("OrtBackend(shared_kv=...) is deprecated; use in_place_kv=...", DeprecationWarning, stacklevel=2)
            if in_place_kv is None:
                in_place_kv = shared_kv
        refuse_fp16_on_cpu(info, provider)
        self.info = info
        self.model_name = info.meta["model"]["name"]  # the model the export was made from
        self.cfg = info.config
        self.n_positions = self.cfg.n_positions
        self.vocab_size = self.cfg.vocab_size
        self.provider = provider
        self.session = create_session(info.model_path, provider, threads)
        self.device = "cuda" if provider is ProviderKind.cuda else "cpu"
        self.kv_dtype = np.float16 if info.precision is Precision.fp16 else np.float32
        self.names_in = io.input_names(self.cfg.n_layer)
        self.names_out = io.output_names(self.cfg.n_layer)
        self._reorder_session = None
        self._truncate_session = None
        self._argmax_session = None
        # The graph's optional logits_to_keep input (exports made before it existed lack it): bound to 1
        # by `step`, so a prefill unembeds its last position only, and to 0 (every position) by `run`.
        overridable = {i.name for i in self.session.get_overridable_initializers()}
        self._logits_to_keep = {k: ort.OrtValue.ortvalue_from_numpy(np.array(k, dtype=np.int64)) for k in (0, 1)} \
            if io.LOGITS_TO_KEEP in overridable else None
        layout = info.attention
        self.batched_multi_token_past = layout["batched_multi_token_past"]
        # In-place cache updates: GroupQueryAttention graphs on the CPU (int8, int4), unless turned off.
        can = io.in_place_kv(layout) and provider is ProviderKind.cpu
        if in_place_kv and not can:
            raise ProviderError(f"{info.folder}: this export's attention cannot update its KV cache in place on {provider.value}")
        self.in_place_kv = can if in_place_kv is None else in_place_kv

    @property
    def shared_kv(self) -> bool:
        """Deprecated: `in_place_kv`'s former name (for one release)."""
        warnings.warn("OrtBackend.shared_kv is deprecated; use in_place_kv", DeprecationWarning, stacklevel=2)
        return self.in_place_kv

    def close(self) -> None:
        """Release the sessions and the spare cache buffers; a later step is one ProviderError."""
        self.session = Released(self.name)
        self._reorder_session = self._truncate_session = self._argmax_session = None

    # -- the KV cache as OrtValues

    def empty_past(self, batch: int) -> list:
        shape = (batch, self.cfg.n_head, 0, self.cfg.head_dim)
        return [ort.OrtValue.ortvalue_from_shape_and_type(shape, self.kv_dtype, self.device, 0)
                for _ in range(2 * self.cfg.n_layer)]

    def past_from_numpy(self, arrays: list[np.ndarray]):
        """The cache in the form this backend steps from: in-place buffers (room to grow) for graphs that
        update it in place, else OrtValues on the device."""
        if self.in_place_kv:
            capacity = min(self.n_positions, arrays[0].shape[2] + KV_CAPACITY_STEP)
            buffers = buffers_holding(arrays, capacity, self._spare_buffers)
            return InPlaceKVCache(buffers, buffers.length)
        return [ort.OrtValue.ortvalue_from_numpy(np.ascontiguousarray(a, dtype=self.kv_dtype), self.device, 0)
                for a in arrays]

    def present_to_numpy(self, present) -> list[np.ndarray]:
        if isinstance(present, InPlaceKVCache):
            return [a.astype(np.float32) for a in present.filled()]
        return [v.numpy().astype(np.float32) for v in present]

    def merge(self, past, rows: np.ndarray, joiner, width: int):
        """Backend.merge: inside the buffers of the in-place cache (kvbuffers.merge_rows: only
        the rows that move are copied, into rows the buffers already have where they fit; `past` is
        stale afterwards), through host arrays for the growing one."""
        if not isinstance(past, InPlaceKVCache):
            return merge_on_host(self, past, rows, joiner, width)
        arrays = None if joiner is None else joiner.filled() if isinstance(joiner, InPlaceKVCache) else self.present_to_numpy(joiner)
        buffers = merge_rows(past, rows, arrays, width, self._spare_buffers, self.n_positions, KV_CAPACITY_STEP)
        return InPlaceKVCache(buffers, buffers.length)

    def truncate(self, past, length: int):
        """Backend.truncate: the in-place cache sets its length back (nothing copied; the next step
        overwrites the dropped positions); the growing cache keeps its first `length` positions as new
        tensors (one copy of the kept positions: a (B, H, P, D) tensor's first positions are not
        contiguous), on the host for the CPU and with a one-node Slice graph on CUDA."""
        if isinstance(past, InPlaceKVCache):
            return InPlaceKVCache(truncated(past, length), length)
        held = past[0].shape()[2]
        if not 0 <= length <= held:
            raise ValueError(f"cannot keep {length} positions of a cache holding {held}")
        if length == held:
            return past
        if self.device == "cpu":
            return [ort.OrtValue.ortvalue_from_numpy(np.ascontiguousarray(v.numpy()[:, :, :length])) for v in past]
        if self._truncate_session is None:
            self._truncate_session = create_session(slice_positions_model(self.kv_dtype), self.provider)
        ends = ort.OrtValue.ortvalue_from_numpy(np.array([length], dtype=np.int64))  # a shape input: on the host
        return self._each_on_device(self._truncate_session, past, "ends", ends)

    def _each_on_device(self, session, past: list, name: str, value) -> list:
        """A one-node graph (x, `name` -> y) run on every cache tensor, with `value` bound as `name`:
        the outputs stay on the device."""
        out = []
        for v in past:
            binding = session.io_binding()
            binding.bind_ortvalue_input("x", v)
            binding.bind_ortvalue_input(name, value)
            binding.bind_output("y", self.device)
            session.run_with_iobinding(binding)
            out.append(binding.get_outputs()[0])
        return out

    def peak_device_memory_mb(self) -> float | None:
        """Not tracked for ONNX Runtime (its arena is not exposed to Python)."""
        return None

    # -- running

    def run(self, input_ids: np.ndarray, attention_mask: np.ndarray, position_ids: np.ndarray, past):
        """All logits (B, T, V) on the host, and the new cache: presents as device-resident OrtValues,
        or the InPlaceKVCache, now `T` positions longer."""
        return self._forward(input_ids, attention_mask, position_ids, past, keep=0)

    def step(self, input_ids, attention_mask, position_ids, past):
        """As run, but only the last position's logits (B, V), the only ones the graph computes."""
        logits, present = self._forward(input_ids, attention_mask, position_ids, past, keep=1)
        return logits[:, -1], present

    def step_greedy(self, input_ids, attention_mask, position_ids, past):
        """Greedy decoding's step (base.greedy_step): each row's most likely next token (B,) int64. On
        CUDA the logits stay on the device and a one-node ArgMax graph there (the first of equal
        maxima, as NumPy's) sends only the tokens to the host; on the CPU, NumPy's argmax of `step`."""
        if self.device == "cpu":
            logits, present = self.step(input_ids, attention_mask, position_ids, past)
            return logits.argmax(axis=-1).astype(np.int64), present
        if past is None:
            past = self.empty_past(input_ids.shape[0])
        binding = self.session.io_binding()
        self._bind_inputs(binding, input_ids, attention_mask, position_ids, past, keep=1)
        for name in self.names_out:
            binding.bind_output(name, self.device)  # the logits too: they stay on the device
        self.session.run_with_iobinding(binding)
        outputs = binding.get_outputs()
        return self.argmax_on_device(outputs[0]), list(outputs[1:])

    def argmax_on_device(self, logits) -> np.ndarray:
        """Each row's argmax at its last position (B,) int64 of a logits OrtValue (B, T, V), computed
        where the logits are (ORT's ArgMax on this backend's provider); only the tokens come back."""
        if self._argmax_session is None:
            self._argmax_session = create_session(last_argmax_model(), self.provider)
        binding = self._argmax_session.io_binding()
        binding.bind_ortvalue_input("x", logits)
        binding.bind_output("y", "cpu")
        self._argmax_session.run_with_iobinding(binding)
        return binding.get_outputs()[0].numpy()[:, 0]

    def _forward(self, input_ids, attention_mask, position_ids, past, keep: int):
        """Logits of the last `keep` positions (0: every position), where the graph has logits_to_keep
        (else every position), and the new cache."""
        if isinstance(past, InPlaceKVCache) or (past is None and self.in_place_kv):
            return self._step_in_place(input_ids, attention_mask, position_ids, past, keep)
        if past is None:
            past = self.empty_past(input_ids.shape[0])
        if self._needs_rows(input_ids, attention_mask):
            return self._run_rows(input_ids, attention_mask, position_ids, past, keep)
        return self._run_growing(input_ids, attention_mask, position_ids, past, keep)

    def _needs_rows(self, input_ids: np.ndarray, attention_mask: np.ndarray) -> bool:
        """A step of several tokens on top of a past for a batch, which GroupQueryAttention's CPU
        kernel refuses: such steps run one row at a time."""
        B, T = input_ids.shape
        return B > 1 and T > 1 and attention_mask.shape[1] > T and not self.batched_multi_token_past

    def _bind_inputs(self, binding, input_ids, attention_mask, position_ids, past_values, keep: int) -> None:
        for name, arr in ((io.INPUT_IDS, input_ids), (io.ATTENTION_MASK, attention_mask), (io.POSITION_IDS, position_ids)):
            binding.bind_cpu_input(name, np.ascontiguousarray(arr, dtype=np.int64))
        if self._logits_to_keep is not None:  # always bound: an in-place binding is reused across steps
            binding.bind_ortvalue_input(io.LOGITS_TO_KEEP, self._logits_to_keep[keep])
        for name, value in zip(self.names_in[3:], past_values):
            binding.bind_ortvalue_input(name, value)

    def _run_growing(self, input_ids, attention_mask, position_ids, past: list, keep: int):
        binding = self.session.io_binding()
        self._bind_inputs(binding, input_ids, attention_mask, position_ids, past, keep)
        binding.bind_output(io.LOGITS, "cpu")
        for name in self.names_out[1:]:
            binding.bind_output(name, self.device)
        self.session.run_with_iobinding(binding)
        outputs = binding.get_outputs()
        return outputs[0].numpy(), list(outputs[1:])

    def _run_rows(self, input_ids, attention_mask, position_ids, past: list, keep: int):
        """The growing cache, one row at a time (CPU only: GroupQueryAttention graphs are int8 and int4)."""
        host = [v.numpy() for v in past]
        logits, presents = [], []
        for r in range(input_ids.shape[0]):
            row_past = [ort.OrtValue.ortvalue_from_numpy(np.ascontiguousarray(a[r : r + 1])) for a in host]
            lg, pr = self._run_growing(input_ids[r : r + 1], attention_mask[r : r + 1], position_ids[r : r + 1], row_past, keep)
            logits.append(lg)
            presents.append([v.numpy() for v in pr])
        merged = [ort.OrtValue.ortvalue_from_numpy(np.concatenate(parts)) for parts in zip(*presents)]
        return np.concatenate(logits), merged

    def _in_place_buffers(self, batch: int, capacity: int, keep: InPlaceKVCache | None = None) -> _KVBuffers:
        """Zeroed buffers of `capacity` positions, holding `keep`'s filled rows and positions if given
        (with at least as many rows as its buffers had: rows may join it later)."""
        batch, rows = rows_to_keep(batch, keep)
        shape = (batch, self.cfg.n_head, capacity, self.cfg.head_dim)
        return _KVBuffers(zeroed_arrays(shape, 2 * self.cfg.n_layer, self.kv_dtype, keep), keep.length if keep else 0, rows)

    def _spare_buffers(self, batch: int, capacity: int, keep: InPlaceKVCache | None = None) -> _KVBuffers:
        """Buffers of `capacity` positions for a cache the caller fills (positions below its length, of
        the rows it uses), holding `keep`'s filled rows and positions if given. The spare capacity (and
        rows) is left unset, not zeroed: GroupQueryAttention writes each position before it reads it,
        and zeroing capacity nobody reads was most of the cost of moving a cache."""
        shape = (batch, self.cfg.n_head, capacity, self.cfg.head_dim)
        arrays = holding([np.empty(shape, dtype=self.kv_dtype) for _ in range(2 * self.cfg.n_layer)], keep)
        return _KVBuffers(arrays) if keep is None else _KVBuffers(arrays, keep.length, keep.rows)

    def _step_in_place(self, input_ids, attention_mask, position_ids, cache: InPlaceKVCache | None, keep: int):
        B, T = input_ids.shape
        length = 0 if cache is None else cache.length
        refuse_stale(cache)
        if attention_mask.shape[1] != length + T:
            raise ValueError(f"attention_mask covers {attention_mask.shape[1]} positions; the cache holds {length} + {T} new")
        # A batch's prefill gets no spare positions: GroupQueryAttention's multi-token step over an in-place
        # buffer grows with its capacity, and the first decode step's move into larger buffers copies
        # only the prompt's positions. A single row's prefill keeps its room: there the spare positions
        # cost little and the move more. Both measured by benchmarks/engine_load.py.
        buffers = buffers_for_step(cache, B, T, self.n_positions, KV_CAPACITY_STEP, self._in_place_buffers,
                                   first_room=0 if B > 1 else None)
        if self._needs_rows(input_ids, attention_mask):
            logits = np.concatenate([
                self._run_in_place(buffers, [a[r : r + 1] for a in buffers.arrays], input_ids[r : r + 1],
                                   attention_mask[r : r + 1], position_ids[r : r + 1], keep)
                for r in range(B)
            ])
        else:
            logits = self._run_in_place(buffers, None, input_ids, attention_mask, position_ids, keep)
        buffers.length = length + T
        return logits, InPlaceKVCache(buffers, length + T)

    def _run_in_place(self, buffers: _KVBuffers, row_views: list[np.ndarray] | None, input_ids, attention_mask,
                      position_ids, keep: int) -> np.ndarray:
        """One run with `buffers` bound as past and present, or with `row_views` (one batch row of
        each buffer: contiguous, the same memory) for a row run. Returns the logits."""
        if row_views is None:
            if buffers.binding is None:
                buffers.binding = self._bind_in_place(buffers.values)
            binding = buffers.binding
        else:
            binding = self._bind_in_place([ort.OrtValue.ortvalue_from_numpy(a) for a in row_views])
        self._bind_inputs(binding, input_ids, attention_mask, position_ids, [], keep)
        # A fresh host array for the logits each step, written by ONNX Runtime directly.
        B, T = input_ids.shape
        kept = min(keep, T) if keep and self._logits_to_keep is not None else T
        logits = np.empty((B, kept, self.cfg.vocab_size), dtype=np.float32)
        binding.bind_output(io.LOGITS, "cpu", 0, np.float32, list(logits.shape), logits.ctypes.data)
        self.session.run_with_iobinding(binding)
        return logits

    def _bind_in_place(self, values: list):
        binding = self.session.io_binding()
        for name, value in zip(self.names_in[3:], values):
            binding.bind_ortvalue_input(name, value)
        for name, value in zip(self.names_out[1:], values):
            binding.bind_ortvalue_output(name, value)  # the same buffers: written in place
        return binding

    def reorder(self, past, rows: np.ndarray):
        """Gather batch rows of every cache tensor, on the device (a one-node Gather graph)."""
        if isinstance(past, InPlaceKVCache):  # only the filled positions are copied, not the spare capacity
            buffers = buffers_holding([a[rows] for a in past.filled()], past.capacity, self._spare_buffers)
            return InPlaceKVCache(buffers, past.length)
        if self.device == "cpu":
            return [ort.OrtValue.ortvalue_from_numpy(np.ascontiguousarray(v.numpy()[rows])) for v in past]
        if self._reorder_session is None:
            self._reorder_session = create_session(gather_model(self.kv_dtype), self.provider)
        idx = ort.OrtValue.ortvalue_from_numpy(np.asarray(rows, dtype=np.int64), self.device, 0)
        return self._each_on_device(self._reorder_session, past, "rows", idx)
