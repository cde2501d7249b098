"""OpenVINO's CPU runtime on the export's model.onnx (no torch). The KV cache is a fixed-capacity buffer the
graph reads whole, empty slots masked, so decode steps keep one input shape until it grows (the layout and
why: docs/backends.md, the OpenVINO backend). A bf16 export's prompts run on its OpenVINO prefill graph, whose
presents are widened into that buffer (runtime/openvino_prefill.py).
"""

from __future__ import annotations

import numpy as np
import openvino as ov

from ..choices import Precision, ProviderKind
from ..errors import ArtifactError, ProviderError
from ..onnx import names as io
from ..onnx.artifact import BF16, F32, ExportInfo
from .base import OPENVINO_CAPABILITIES, Closable, Released, bf16_bits, bf16_values
from .kvbuffers import BufferCache, KVBuffers, KVCacheView, buffers_for_step, refuse_stale, rows_to_keep, zeroed_arrays
from .openvino_prefill import BF16_BITS, OpenVinoPrefill, bf16_io, refuse_bf16_without_cpu, tensor_of
from .providers import physical_cores, refuse_fp16_on_cpu

DEVICE = "CPU"
OPENVINO_CAPACITY_STEP = 64  # positions the cache holds beyond its first step (it then doubles)


def _first_line(e: Exception) -> str:
    """The informative line of an OpenVINO exception (its text starts with source locations)."""
    lines = [ln.strip() for ln in str(e).splitlines() if ln.strip()]
    useful = [ln for ln in lines if not ln.startswith(("Exception from ", "Check '"))]
    return (useful or lines or [type(e).__name__])[-1]


def presents_of_new_positions(model: ov.Model, n_layer: int) -> bool:
    """The graph's presents given out as the step's new positions alone, where it concatenates them to the past
    (model.onnx's MultiHeadAttention form): the whole concatenation, as long as the cache, had been given out at every
    step (at bf16 converted back to f32) for its last positions to be copied into the cache. Whether it did so (a
    GroupQueryAttention graph writes its presents in place: unchanged)."""
    changed, presents = False, set(io.output_names(n_layer)[1:])
    for result in model.get_results():
        source = result.input_value(0)
        concat = source.get_node()
        if concat.get_type_name() != "Concat" or not source.get_names() & presents:
            continue
        past, new = concat.input_values()
        if past.get_node().get_type_name() != "Parameter" or concat.get_attributes().get("axis") not in (2, -2):
            continue
        names = source.get_names()
        source.get_tensor().set_names(set())  # the output's names move to what it now gives out
        new.get_tensor().set_names(names)
        result.input(0).replace_source_output(new)
        changed = True
    model.validate_nodes_and_infer_types()
    return changed


class OpenVinoKVCache(BufferCache):
    """The cache's buffers holding positions [0, length)."""

    # The graph reads the whole capacity every step (its attention and the presents' concatenation), so room held ahead
    # costs every step, where a growth (doubling) costs once.
    capacity_step = OPENVINO_CAPACITY_STEP

    @classmethod
    def allocate(cls, owner: OpenVinoBackend, batch: int, capacity: int, keep: KVCacheView | None) -> KVBuffers:
        """Zeroed, not left unset: the graph reads the whole capacity, and a masked slot must be finite. In the
        backend's kv_dtype: float32, or bf16 bits at bf16 compute."""
        batch, rows = rows_to_keep(batch, keep)
        shape = (batch, owner.cfg.n_head, capacity, owner.cfg.head_dim)
        return KVBuffers(zeroed_arrays(shape, 2 * owner.cfg.n_layer, owner.kv_dtype, keep), keep.length if keep else 0,
                         rows)

    @classmethod
    def from_numpy(cls, owner: OpenVinoBackend, arrays: list[np.ndarray]):
        """float32 arrays (or the cache's own bf16 bits) into a cache; into a bf16 one rounded to bf16 (to the nearest,
        ties to even), which a past this backend computed holds exactly already."""
        if owner.kv_dtype == BF16_BITS:
            arrays = [a if a.dtype == BF16_BITS else bf16_bits(a) for a in arrays]
        return super().from_numpy(owner, arrays)

    def to_numpy(self) -> list[np.ndarray]:
        if self.owner.kv_dtype != BF16_BITS:
            return super().to_numpy()
        return [bf16_values(a) for a in self.filled()]

    # stored: the buffers' own (BufferCache's), bf16 bits at bf16, which from_numpy takes back as they are


class OpenVinoBackend(Closable):
    """One export compiled by OpenVINO for the CPU; it reads the cache's host arrays without a copy."""

    name = "openvino"
    # bf16: a bf16 export's f32 graph computed at INFERENCE_PRECISION_HINT bf16, prefill and decode alike.
    capabilities = OPENVINO_CAPABILITIES
    cache_forms = (OpenVinoKVCache,)

    def __init__(self, info: ExportInfo, provider: ProviderKind = ProviderKind.cpu, threads: int | None = None,
                 prefill_graph: bool | None = None):
        """`prefill_graph`: whether steps run on the export's OpenVINO prefill graph (None: a bf16 or fp32 export's,
        where it kept one; True: refused where the export has none; False: model.onnx for all): those of more than one token,
        and where it takes a past and computes at the backend's precision, the decode steps too."""
        refused = self.capabilities.refuse_provider(self.name, provider)
        if refused is not None:
            raise refused
        refuse_fp16_on_cpu(info, provider, f"the {self.name} backend runs {self.capabilities.describe_runs()}")
        refuse_bf16_without_cpu(info)
        self.inference_precision = BF16 if info.precision is Precision.bf16 else F32
        # At bf16 the cache holds bf16 (its bits), as the graph computes it: read and written as it is, every step.
        self.kv_dtype = BF16_BITS if self.inference_precision == BF16 else np.float32
        self.info = info
        self.model_name = info.meta["model"]["name"]
        self.cfg = info.config
        self.n_positions = self.cfg.n_positions
        self.vocab_size = self.cfg.vocab_size
        self.provider = provider
        self.threads = threads or physical_cores()
        if prefill_graph is None:
            # bf16's and fp32's: model.onnx at bf16 prefills 1.5-2.2x slower (benchmarks/results/bf16-prefill-cpu-2core.md),
            # and decodes slower at both (above); an int8 graph's weights are nncf's, not model.onnx's.
            prefill_graph = info.precision in (Precision.bf16, Precision.fp32) and info.prefill is not None
        if prefill_graph and info.prefill is None:
            raise ArtifactError(f"{info.folder} has no OpenVINO prefill graph (a bf16, fp32 or int8 export made with the "
                                "openvino extra installed has one)")
        # A prefill graph that takes a past runs the decode steps too, on the whole buffer as its past, its attention
        # there apart over the past and the new positions: OpenVINO's own conversion of the model attends without
        # transposing and scaling every cached key at every step, as its ONNX reader's MultiHeadAttention does, and
        # apart without copying the cache (docs/backends.md). model.onnx then runs only what needs every position's
        # logits (run), compiled at its first use.
        graph = OpenVinoPrefill(info, self.threads, bf16_cache=self.kv_dtype == BF16_BITS) if prefill_graph else None
        self.decodes_on_graph = graph is not None and graph.takes_past and \
            graph.inference_precision == self.inference_precision
        if graph is not None:
            graph.decodes = self.decodes_on_graph
        self.prefill_graph = graph
        if self.prefill_graph is not None:  # compiled while model.onnx is, not at the first prompt
            self.prefill_graph.prepare(bf16=True, past=self.decodes_on_graph)
        core = ov.Core()
        if DEVICE not in core.available_devices:
            raise ProviderError(f"OpenVINO {ov.__version__} finds no CPU device")
        self._full: _Steps | None = None  # model.onnx's
        self._decoding: _Steps | None = None  # the prefill graph's, on a past
        if not self.decodes_on_graph:
            self._full = self._compile_full()
        self.prefill_steps = 0  # steps run on it

    def _compile_full(self) -> _Steps:
        """model.onnx compiled, at the export's compute precision, and its steps' request."""
        config = {
            "INFERENCE_NUM_THREADS": self.threads,
            # The export's: OpenVINO computes in bf16 by default on CPUs that have it, which fails the fp32 gate.
            "INFERENCE_PRECISION_HINT": self.inference_precision,
            "PERFORMANCE_HINT": "LATENCY",
            # Pinned threads wait for their core on a busy host: up to 2x the step time measured on 2 cores.
            "ENABLE_CPU_PINNING": False,
        }
        try:
            model = ov.Core().read_model(str(self.info.model_path))
            new_presents = presents_of_new_positions(model, self.cfg.n_layer)
            if self.kv_dtype == BF16_BITS:
                model = bf16_io(model, self.cfg.n_layer)
            compiled = ov.Core().compile_model(model, DEVICE, config)
        except Exception as e:  # OpenVINO raises RuntimeError (and its own types) for unreadable graphs
            raise ArtifactError(f"OpenVINO {ov.__version__} cannot load {self.info.model_path}: {_first_line(e)}") from None
        # OpenVINO's GroupQueryAttention (int8, int4) runs one batch row per inference.
        return _Steps(compiled, self.cfg.n_layer, new_presents, rows_only=io.in_place_kv(self.info.attention))

    @property
    def rows_only(self) -> bool:
        """Whether its decode steps run one batch row per inference."""
        return self._steps(every_position=False).rows_only

    @property
    def compiled(self) -> ov.CompiledModel:
        """The compiled graph its decode steps run on."""
        return self._steps(every_position=False).compiled

    @property
    def request(self) -> ov.InferRequest:
        """Its decode steps' infer request."""
        return self._steps(every_position=False).request

    def _steps(self, every_position: bool) -> _Steps:
        """The request a step runs on: the prefill graph's where it decodes (but for every position's logits)."""
        if self.decodes_on_graph and not every_position:
            if self._decoding is None:
                self._decoding = _Steps(self.prefill_graph.compiled_on_past, self.cfg.n_layer, True)
            return self._decoding
        if self._full is None:
            self._full = self._compile_full()
        return self._full

    # -- the KV cache

    def past_from_numpy(self, arrays: list[np.ndarray]) -> OpenVinoKVCache:
        return OpenVinoKVCache.from_numpy(self, arrays)

    def peak_device_memory_mb(self) -> float | None:
        """None: OpenVINO runs on the host here."""
        return None

    def close(self) -> None:
        self._full = self._decoding = Released(self.name)
        self.decodes_on_graph = False  # steps then reach the released request
        self.prefill_graph = None

    # -- running

    def run(self, input_ids: np.ndarray, attention_mask: np.ndarray, position_ids: np.ndarray,
            past: OpenVinoKVCache | None) -> tuple[np.ndarray, OpenVinoKVCache]:
        return self._forward(input_ids, attention_mask, position_ids, past, last_only=False)

    def step(self, input_ids, attention_mask, position_ids, past):
        graph = self.prefill_graph
        if graph is not None and np.shape(input_ids)[1] > 1 and (past is None or graph.takes_past):
            return self._prefill_step(input_ids, attention_mask, position_ids, past)
        return self._forward(input_ids, attention_mask, position_ids, past, last_only=True)

    def _prefill_step(self, input_ids, attention_mask, position_ids, cache: OpenVinoKVCache | None):
        """A prompt (or its next chunk) on the prefill graph: it reads the buffers' filled positions as its past and
        its presents are widened into the positions after them (OpenVinoPrefill), so decode steps go on in place."""
        input_ids = np.ascontiguousarray(input_ids, dtype=np.int64)
        attention_mask = np.ascontiguousarray(attention_mask, dtype=np.int64)
        B, T = input_ids.shape
        buffers = self._prepare(B, T, attention_mask, cache)
        length = 0 if cache is None else cache.length
        logits = self.prefill_graph(input_ids, attention_mask, position_ids, buffers.arrays, past=length)
        buffers.length = length + T
        self.prefill_steps += 1
        return logits, OpenVinoKVCache(buffers, length + T, self)

    def _prepare(self, batch: int, seq: int, attention_mask: np.ndarray, cache: OpenVinoKVCache | None) -> KVBuffers:
        """Check the step against the cache; the buffers it writes into (grown when it would overflow)."""
        length = 0 if cache is None else cache.length
        refuse_stale(cache)
        if attention_mask.shape != (batch, length + seq):
            raise ValueError(f"attention_mask has shape {attention_mask.shape}; the cache holds {length} positions "
                             f"and the step {seq} new ones for {batch} rows")
        if cache is None:
            return buffers_for_step(None, batch, seq, self.n_positions, OpenVinoKVCache.capacity_step,
                                    lambda b, c, k: OpenVinoKVCache.allocate(self, b, c, k))
        if cache.rows != batch:
            raise ValueError(f"the KV cache holds {cache.rows} rows; the step has {batch}")
        return cache.buffers_for_step(batch, seq)

    def _forward(self, input_ids, attention_mask, position_ids, cache: OpenVinoKVCache | None, last_only: bool):
        input_ids = np.ascontiguousarray(input_ids, dtype=np.int64)
        attention_mask = np.asarray(attention_mask, dtype=np.int64)
        position_ids = np.ascontiguousarray(position_ids, dtype=np.int64)
        B, T = input_ids.shape
        steps = self._steps(every_position=not last_only)
        buffers = self._prepare(B, T, attention_mask, cache)
        length, capacity = (0 if cache is None else cache.length), buffers.capacity
        # The mask over the whole buffer: filled slots as given, empty slots masked, then the new tokens.
        mask = np.zeros((B, capacity + T), dtype=np.int64)
        mask[:, :length] = attention_mask[:, :length]
        mask[:, capacity:] = attention_mask[:, length:]
        logits = np.empty((B, self.vocab_size) if last_only else (B, T, self.vocab_size), dtype=np.float32)
        if steps.rows_only and B > 1:
            for r in range(B):
                logits[r : r + 1] = steps.infer(buffers, r, input_ids[r : r + 1], mask[r : r + 1],
                                                position_ids[r : r + 1], length, last_only)
        else:
            logits[:] = steps.infer(buffers, None, input_ids, mask, position_ids, length, last_only)
        buffers.length = length + T
        return logits, OpenVinoKVCache(buffers, length + T, self)


class _Steps:
    """One compiled graph's infer request for steps on the whole buffer (its past inputs), the new positions written
    into it after each: its ports, which buffers its past is set to, and its presents' output memory, kept from step to
    step for one shape (OpenVINO would otherwise allocate the presents afresh at every inference, and fault in their
    pages every step)."""

    def __init__(self, compiled: ov.CompiledModel, n_layer: int, new_presents: bool, rows_only: bool = False):
        self.compiled = compiled
        self.request = compiled.create_infer_request()
        self.ids = [compiled.input(name) for name in (io.INPUT_IDS, io.ATTENTION_MASK, io.POSITION_IDS)]
        self.past = [compiled.input(name) for name in io.input_names(n_layer)[3:]]
        self.presents = [compiled.output(name) for name in io.output_names(n_layer)[1:]]
        self.logits = compiled.output(io.LOGITS)
        self.new_presents = new_presents  # its presents the step's new positions alone, else past and new
        self.rows_only = rows_only  # one batch row per inference
        self._bound: tuple | None = None
        self._presents_out: tuple[tuple, list[np.ndarray]] | None = None

    def infer(self, buffers: KVBuffers, row: int | None, input_ids, mask, position_ids, length: int,
              last_only: bool) -> np.ndarray:
        """One inference over `buffers` (or one row); writes the new positions into them and returns a view
        of the logits, valid until the next inference."""
        request = self.request
        for port, arr in zip(self.ids, (input_ids, mask, position_ids)):
            request.set_tensor(port, ov.Tensor(arr))
        rows = slice(0, buffers.rows) if row is None else slice(row, row + 1)
        if self._bound != (buffers, row, buffers.rows):
            # Contiguous row slices of the buffers themselves: no copy.
            for port, buf in zip(self.past, buffers.arrays):
                request.set_tensor(port, tensor_of(buf[rows]))
            self._bound = (buffers, row, buffers.rows)
        B, H, capacity, D = buffers.arrays[0][rows].shape
        T = input_ids.shape[1]
        shape = (B, H, T + (0 if self.new_presents else capacity), D)
        if self._presents_out is None or self._presents_out[0] != shape:
            arrays = [np.empty(shape, buffers.arrays[0].dtype) for _ in self.presents]
            for port, arr in zip(self.presents, arrays):
                request.set_tensor(port, tensor_of(arr))
            self._presents_out = (shape, arrays)
        request.infer()
        new = slice(0 if self.new_presents else capacity, None)
        for present, buf in zip(self._presents_out[1], buffers.arrays):
            buf[rows, :, length : length + T] = present[:, :, new]
        out = request.get_tensor(self.logits).data
        return out[:, -1] if last_only else out
