"""Greedy decoding with every buffer fixed, for ONNX Runtime on CUDA (and the CPU, where it is tested): the in-place KV
cache at a fixed capacity on the device, a decode step whose next token is taken in the graph (only the tokens come
back to the host), and on CUDA that step captured once in a CUDA graph and replayed (docs/results/cuda.md)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

import numpy as np
import onnxruntime as ort

from ..choices import Precision, ProviderKind
from ..errors import ProviderError
from ..numerics import positions
from ..onnx import names as io
from ..onnx.artifact import ExportInfo, weights_beside
from ..onnx.graph_cache import InMemoryGraph, graph_key, kept_or_made, recorded_file
from ..onnx.kvcache import dequantize, quantize
from ..onnx.mapped import mapped_model
from .base import BF16_BITS, Capabilities, Closable, Released, bf16_bits, bf16_values
from .kvbuffers import small_page_arrays
from .kvdtype import asked as asked_kv_dtype
from .kvdtype import int8_kv_scales, scales_digest
from .prefill import PrefillChoice, estimate_ms, openvino_from, openvino_past_from
from .prefill import asked as asked_prefill
from .providers import batched_from, bind_past_and_present, cpu_mixed_chunk_base, create_session, refuse_fp16_on_cpu

# Runs until a CUDA graph replays: ONNX Runtime runs a session once as usual, captures on the next run and replays after.
CAPTURE_RUNS = 3
# The most steps StaticDecoder.steps runs as one block, the host reading their tokens once (a caller checking stop
# tokens reads every BLOCK_STEPS tokens: what a block decodes past a row's end is discarded).
BLOCK_STEPS = 16


# What a StaticDecoder is called where its figures or its tokens are shown (bench rows, generate's --json).
FIXED_CACHE, FIXED_CACHE_GRAPH = "fixed cache", "fixed cache + CUDA graph"


def fixed_cache_refusal(provider: ProviderKind, precision: Precision) -> str | None:
    """Why StaticDecoder cannot run `precision` on `provider`, or None: ONNX Runtime's GroupQueryAttention runs fp16
    on CUDA and fp32 on the CPU (its int8 and int4 graphs are not rewritten)."""
    runs = Precision.fp16 if provider is ProviderKind.cuda else Precision.fp32
    if precision is runs:
        return None
    return (f"the fixed-capacity cache on {provider.value} needs an {runs.value} export (ONNX Runtime's "
            f"GroupQueryAttention on {provider.value}), not {precision.value}")


# The fixed slots' precisions: the CPU's GroupQueryAttention graphs (fp32's twin on a float cache, int8's and int4's own
# on an int8 or a float cache, as runtime.kvdtype chooses), and fp16 on CUDA.
SLOT_PRECISIONS = {ProviderKind.cpu: (Precision.fp32, Precision.int8, Precision.int4), ProviderKind.cuda: (Precision.fp16,)}


def slots_by_default(info: ExportInfo, provider: ProviderKind) -> bool:
    """Whether `gpt2x serve --kv-cache auto` serves the export on the fixed slots: every fp32, int8 and int4 export on
    the CPU whose graph keeps its weights inside it (a data file's has no fixed-shape forms). Their steps run the
    joining prompts' chunks in the decode step's forward, where the in-place cache stops every row for a joiner's
    prefill (docs/results/serving.md)."""
    if provider is not ProviderKind.cpu or info.precision not in SLOT_PRECISIONS[provider]:
        return False
    path = info.batched_path if batched_from(info, None, True) is not None else info.model_path
    return not weights_beside(path)


def held_from_start(info: ExportInfo, provider: ProviderKind, rows: int) -> int:
    """How many slots a server writes at its start (SlotBackend's `resident`): its batch's `rows` where the slots hold
    an int8 cache (0.3 GB for 16 rows of GPT-2 124M: no step then faults their pages in), none for a float one (1.2 GB
    of fp32 at 1024 positions: its pages come as rows use them, as the in-place cache grows)."""
    return rows if int8_kv_scales(info, asked_kv_dtype(None), provider is ProviderKind.cpu) is not None else 0


def slots_refusal(provider: ProviderKind, precision: Precision) -> str | None:
    """Why SlotDecoder cannot run `precision` on `provider`, or None."""
    runs = SLOT_PRECISIONS[provider]
    if precision in runs:
        return None
    return (f"the fixed slots on {provider.value} run {', '.join(p.value for p in runs)} exports (ONNX Runtime's "
            f"GroupQueryAttention there), not {precision.value}")


def _consecutive(slots: np.ndarray) -> bool:
    """Whether `slots` are consecutive, in order: their rows are one region of the slots' buffers."""
    return bool((slots == slots[0] + np.arange(len(slots))).all())


def bind_prompts(binding, ids: np.ndarray, keep_last: ort.OrtValue | None, mask: np.ndarray | None = None) -> None:
    """Prompts `ids` [B, T] with no past bound as a prefill graph's inputs, left-padded where `mask` [B, T] says so
    (default: no padding, the mask all ones, positions 0 .. T - 1), and `keep_last` as its logits_to_keep where the
    graph takes one (the last position's logits alone)."""
    B, T = ids.shape
    binding.bind_cpu_input(io.INPUT_IDS, ids)
    if mask is None:
        binding.bind_cpu_input(io.ATTENTION_MASK, np.ones((B, T), np.int64))
        binding.bind_cpu_input(io.POSITION_IDS, np.broadcast_to(np.arange(T, dtype=np.int64), (B, T)).copy())
    else:
        binding.bind_cpu_input(io.ATTENTION_MASK, mask)
        binding.bind_cpu_input(io.POSITION_IDS, positions(mask, T))
    if keep_last is not None:
        binding.bind_ortvalue_input(io.LOGITS_TO_KEEP, keep_last)


class StaticDecoder(Closable):
    """`rows` prompts of one length (no padding) decoded greedily into one fixed-capacity cache of `capacity`
    positions (default: the model's). The prompt runs on the export's GroupQueryAttention graph (the fp32 and fp16
    exports' twin made in memory), the steps on its fixed-shape decode form; `cuda_graph` captures the step when the
    decoder is made and replays it at every step (CUDA only). `sampling`: the step draws each row's token at its
    temperature from a uniform the caller gives (the sampler's draw on the device: generation.static_decoding); else
    it takes the argmax. ONNX Runtime's GroupQueryAttention runs fp16 (and bf16) on CUDA, fp32 on the CPU."""

    def __init__(self, info: ExportInfo, provider: ProviderKind = ProviderKind.cuda, rows: int = 1,
                 capacity: int | None = None, cuda_graph: bool = False, threads: int | None = None,
                 sampling: bool = False, block: int = BLOCK_STEPS):
        refuse_fp16_on_cpu(info, provider)
        if cuda_graph and provider is not ProviderKind.cuda:
            raise ProviderError("a CUDA graph needs the cuda provider")
        why = fixed_cache_refusal(provider, info.precision)
        if why:
            raise ProviderError(f"{info.folder}: {why}")
        cfg = info.config
        self.rows, self.capacity = rows, capacity or cfg.n_positions
        if not 1 < self.capacity <= cfg.n_positions:
            raise ValueError(f"capacity must be 2..{cfg.n_positions}, not {self.capacity}")
        if block < 1:
            raise ValueError(f"block must be at least 1, not {block}")
        from ..onnx.optimize import static_forms  # onnx's rewrite: imported by the decoders that need it

        forms = static_forms(info.model_path, sampling, steps=True)
        if forms is None:
            raise ProviderError(f"{info.folder}: no fixed-shape decode graph for this export (weights in a data file)")
        self.device = "cuda" if provider is ProviderKind.cuda else "cpu"
        self.cuda_graph = cuda_graph
        prefill, decode = forms
        self._prefill = create_session(prefill.graph, provider, threads, weights=prefill.weights)
        overridable = {i.name for i in self._prefill.get_overridable_initializers()}
        # The prompt's logits at its last position only (exports older than logits_to_keep unembed every position).
        self._keep_last = ort.OrtValue.ortvalue_from_numpy(np.array(1, np.int64)) if io.LOGITS_TO_KEEP in overridable else None
        self._decode = create_session(
            decode.graph, provider, threads, weights=decode.weights,
            provider_options={"enable_cuda_graph": "1"} if cuda_graph else None,
            dims={io.BATCH: rows, io.PAST: self.capacity, io.TOTAL: self.capacity, io.LOGITS_SEQUENCE: 1,
                  io.STEPS: block})
        dtype = np.float16 if info.precision is Precision.fp16 else np.float32
        shape = (rows, cfg.n_head, self.capacity, cfg.head_dim)
        # One buffer per layer and K/V, bound as both past and present in every session: nothing is copied. Zeroed, not
        # left as allocated: what an earlier tensor left there (NaN, inf) must not reach an attention kernel that reads
        # positions not yet written (docs/results/cuda.md).
        # (An array each: on the CPU an OrtValue holds the array's own memory.)
        self._kv = [ort.OrtValue.ortvalue_from_numpy(np.zeros(shape, dtype), self.device, 0) for _ in range(2 * cfg.n_layer)]
        # The step's input ids and its output next_token are one buffer: a step's token feeds the next step where it
        # is (its ArgMax runs after every read of the ids). Positions come from seqlens_k in the graph.
        self._tokens = ort.OrtValue.ortvalue_from_numpy(np.zeros((rows, 1), np.int64), self.device, 0)
        self._seqlens = ort.OrtValue.ortvalue_from_numpy(np.zeros(rows, np.int32), self.device, 0)
        self._total = ort.OrtValue.ortvalue_from_numpy(np.array([self.capacity], np.int32))  # read on the host
        # A block's steps (steps()): the step's index in it and each step's tokens, advanced and written by the graph.
        self.block = block
        self._step = ort.OrtValue.ortvalue_from_numpy(np.zeros(1, np.int64), self.device, 0)
        self._block_tokens = ort.OrtValue.ortvalue_from_numpy(np.zeros((rows, block), np.int64), self.device, 0)
        # The steps of a block but its last run without waiting for the device: the last one's wait covers them all.
        self._no_wait = ort.RunOptions()
        self._no_wait.add_run_config_entry("disable_synchronize_execution_providers", "1")
        self.sampling = sampling
        if sampling:  # each row's temperature (0: argmax) and the uniforms its draws read, written before each block
            self._temperature = ort.OrtValue.ortvalue_from_numpy(np.zeros(rows, np.float64), self.device, 0)
            self._uniforms = ort.OrtValue.ortvalue_from_numpy(np.zeros((rows, block), np.float64), self.device, 0)
        self._binding = self._decode_binding()
        if cuda_graph:
            self._capture()
        self.length = 0  # positions in the cache
        self._pending, self._host_tokens = None, False  # the first tokens after a prefill, chosen on the host
        self._device_tokens = False  # whether the bound ids hold the tokens of the next position (a step's choice)
        self.runs = 0  # decode runs on this decoder (a CUDA graph is captured on one of the first)

    @property
    def name(self) -> str:
        return FIXED_CACHE_GRAPH if self.cuda_graph else FIXED_CACHE

    @property
    def providers(self) -> list[str]:
        """The execution providers of the decode session, first the one it runs on (a caller checks it is CUDA's)."""
        return self._decode.get_providers()

    def _capture(self) -> None:
        """Dummy steps (token 0 at position 0, which a prefill overwrites) until ONNX Runtime has captured the CUDA
        graph, so that every step of a generation is a replay and none pays for the capture."""
        for _ in range(CAPTURE_RUNS):
            self._step.update_inplace(np.zeros(1, np.int64))  # each within the block's columns
            self._decode.run_with_iobinding(self._binding)

    def _decode_binding(self):
        binding = self._decode.io_binding()
        for name, value in ((io.INPUT_IDS, self._tokens), (io.SEQLENS_K, self._seqlens), (io.TOTAL_SEQUENCE_LENGTH, self._total),
                            (io.STEP, self._step), (io.TOKENS, self._block_tokens)):
            binding.bind_ortvalue_input(name, value)
        if self.sampling:
            binding.bind_ortvalue_input(io.TEMPERATURE, self._temperature)
            binding.bind_ortvalue_input(io.UNIFORMS, self._uniforms)
        bind_past_and_present(binding, self._kv)
        # Each written where it was read: the next step reads what this one wrote (optimize.with_device_steps).
        for name, value in ((io.NEXT_TOKEN, self._tokens), (io.SEQLENS_K_NEXT, self._seqlens), (io.STEP_NEXT, self._step),
                            (io.TOKENS_NEXT, self._block_tokens)):
            binding.bind_ortvalue_output(name, value)
        return binding

    def prefill(self, prompt_ids: np.ndarray) -> np.ndarray:
        """Fill the cache with `prompt_ids` [rows, T] (replacing what it held); each row's first new token (argmax)."""
        return self.prefill_tokens(self.prefill_logits(prompt_ids).argmax(axis=-1).astype(np.int64))

    def prefill_logits(self, prompt_ids: np.ndarray) -> np.ndarray:
        """Fill the cache with `prompt_ids` [rows, T]; the last position's logits [rows, vocab], for a sampler on the
        host to choose the first tokens (then prefill_tokens)."""
        prompt_ids = np.ascontiguousarray(prompt_ids, dtype=np.int64)
        B, T = prompt_ids.shape
        if B != self.rows or not 0 < T < self.capacity:
            raise ValueError(f"prompts must be {self.rows} rows of 1..{self.capacity - 1} tokens, not {B} x {T}")
        binding = self._prefill.io_binding()
        bind_prompts(binding, prompt_ids, self._keep_last)
        binding.bind_output(io.LOGITS, "cpu")  # first: get_outputs follows the order of binding
        bind_past_and_present(binding, self._kv)
        self._prefill.run_with_iobinding(binding)
        self.length = T
        self._pending, self._host_tokens, self._device_tokens = None, False, False
        return binding.get_outputs()[0].numpy()[:, -1]

    def prefill_tokens(self, tokens: np.ndarray) -> np.ndarray:
        """The first tokens after a prefill_logits, chosen on the host: the next step copies them to the device."""
        if self.length == 0:
            raise ValueError("prefill a prompt first")
        self._pending = np.ascontiguousarray(tokens, dtype=np.int64).reshape(self.rows)
        self._host_tokens = True
        return self._pending

    def set_temperature(self, temperature: float | np.ndarray) -> None:
        """Each row's temperature for the sampling steps (0: the argmax)."""
        if not self.sampling:
            raise ValueError("this decoder takes the argmax: make it with sampling=True to draw")
        t = np.broadcast_to(np.asarray(temperature, np.float64), (self.rows,))
        if (t < 0).any() or not np.isfinite(t).all():
            raise ValueError(f"temperatures must be finite and >= 0, not {t.tolist()}")
        self._temperature.update_inplace(np.ascontiguousarray(t))

    def step(self, tokens: np.ndarray | None = None, uniform: np.ndarray | None = None) -> np.ndarray:
        """Append `tokens` [rows] at the next position (None: the tokens the last step chose, already on the device);
        each row's next token: the argmax (first of equal maxima), or on a sampling decoder the draw at the row's
        temperature that `uniform` [rows] in [0, 1) picks by inverse CDF. A block of one step."""
        uniforms = None if uniform is None else np.broadcast_to(np.asarray(uniform, np.float64), (self.rows,))[:, None]
        return self.steps(1, tokens, uniforms)[:, 0]

    def steps(self, k: int, tokens: np.ndarray | None = None, uniforms: np.ndarray | None = None) -> np.ndarray:
        """`k` steps (at most `block`) as step() would run them one by one, each row's k tokens [rows, k], with the host
        off their path: the positions and the tokens advance on the device, the steps run back to back without the
        host waiting for any but the last, and their tokens come back in one read. `tokens` as step()'s; a sampling
        decoder takes each step's uniforms [rows, k]."""
        if self.length == 0:
            raise ValueError("prefill a prompt first")
        if not 1 <= k <= self.block:
            raise ValueError(f"a block runs 1..{self.block} steps, not {k}")
        if self.length + k > self.capacity:
            raise ValueError(f"the cache is full ({self.capacity} positions)")
        if self.sampling != (uniforms is not None):
            raise ValueError("a sampling decoder's step takes a uniform per row; an argmax decoder's takes none")
        if uniforms is not None:
            drawn = np.zeros((self.rows, self.block), np.float64)
            drawn[:, :k] = np.broadcast_to(uniforms, (self.rows, k))
            self._uniforms.update_inplace(drawn)
        if tokens is None and not (self._host_tokens or self._device_tokens):
            raise ValueError("no tokens for the next position: pass them, or choose the first ones with prefill_tokens")
        if tokens is not None or self._host_tokens:
            chosen = self._pending if tokens is None else tokens
            self._tokens.update_inplace(np.ascontiguousarray(chosen, dtype=np.int64).reshape(self.rows, 1))
            self._host_tokens = False
        # Written into the bound buffers once a block: a replayed CUDA graph reads them where it was captured, and each
        # step advances them for the next.
        self._seqlens.update_inplace(np.full(self.rows, self.length, np.int32))
        self._step.update_inplace(np.zeros(1, np.int64))
        for i in range(k):
            self._decode.run_with_iobinding(self._binding, self._no_wait if i < k - 1 else None)
        self.runs += k
        self.length += k
        self._device_tokens = True
        return self._block_tokens.numpy()[:, :k].copy()

    def generate(self, prompt_ids: np.ndarray, new_tokens: int) -> np.ndarray:
        """Greedy: `new_tokens` tokens per row [rows, new_tokens] after `prompt_ids` [rows, T] (an argmax decoder's;
        a sampling decoder's generation: generation.static_decoding)."""
        if self.sampling:
            raise ValueError("a sampling decoder generates through generation.static_decoding (its sampler's uniforms)")
        prompt_ids = np.asarray(prompt_ids)
        if prompt_ids.ndim != 2 or prompt_ids.shape[1] + new_tokens > self.capacity:
            raise ValueError(f"a prompt of {prompt_ids.shape[-1]} tokens and {new_tokens} new ones do not fit "
                             f"{self.capacity} positions")
        out = np.empty((self.rows, new_tokens), np.int64)
        if new_tokens == 0:
            return out
        out[:, 0] = self.prefill(prompt_ids)
        for i in range(1, new_tokens, self.block):
            k = min(self.block, new_tokens - i)
            out[:, i:i + k] = self.steps(k)
        return out

    def close(self) -> None:
        self._prefill = self._decode = Released("static decoder")
        self._kv = []


class SlotDecoder(Closable):
    """The serving engine's fixed slots: one cache of `slots` rows x `capacity` positions (default: the model's), in
    which each row is a sequence of its own, at its own length. A row joins by `prefill` into a free slot (its prompt, or
    the next chunk of it after what the slot holds), run on that slot's rows of the buffers alone; `step` decodes the
    slots up to the highest one held, each at its own length (GroupQueryAttention's seqlens_k), a free one among them on
    token 0 at position 0, which its next prefill overwrites; `release` frees a slot. No row's cache is ever moved or copied: rows join and leave without a
    merge. The logits come back to the host, for the serving engine's samplers. The graphs are StaticDecoder's, the
    decode step's head the logits (onnx.optimize.static_forms): on the CPU fp32 exports (their GroupQueryAttention twin)
    on a float cache, and int8 and int4 ones on an int8 cache where the export's record chose one (`kv_scales`: the
    graphs rewritten by onnx.kvcache.with_int8_kv, as the ort backend's) or a float one; fp16 on CUDA. An int8
    export's graphs are its batched decode graph's where the ort backend would run one (`batched`, as OrtBackend's; its
    record's rows threshold aside: one graph for every step, whose mixed steps' many tokens are where its matmuls gain
    most: docs/results/serving.md).

    On model.onnx a row's logits never depend on what the other slots hold (tests/runtime/test_slots.py), but an int8
    graph's may on how many slots a step runs: its MatMulNBits quantizes each row's activations alone, yet rounds a row
    of a one-row step and of a several-row one ~1e-7 apart (its row tiling), which the next activation's int8 rounding
    can turn into ~3e-2 of the logits (measured on AVX-512 VNNI). The batched graph quantizes a step's activations with
    one scale for all its rows, so there they do depend on the other rows, as in the ort backend's batched steps.
    """

    def __init__(self, info: ExportInfo, provider: ProviderKind = ProviderKind.cpu, slots: int = 4,
                 capacity: int | None = None, threads: int | None = None, resident: int | None = None,
                 mixed_prefill: bool = False, batched: bool | None = None, prefill_choice: str | None = None):
        refuse_fp16_on_cpu(info, provider)
        why = slots_refusal(provider, info.precision)
        if why:
            raise ProviderError(f"{info.folder}: {why}")
        cfg = info.config
        self.slots, self.capacity = slots, capacity or cfg.n_positions
        if slots < 1 or not 1 < self.capacity <= cfg.n_positions:
            raise ValueError(f"slots must be >= 1 and capacity 2..{cfg.n_positions}, not {slots} and {self.capacity}")
        self.device = "cuda" if provider is ProviderKind.cuda else "cpu"
        # An int8 cache where the export's record (or --kv-cache-dtype) chooses one: a quarter of a float cache's bytes,
        # and the attention reads them so (the ort backend's choice, runtime.kvdtype).
        self.kv_scales = int8_kv_scales(info, asked_kv_dtype(None), provider is ProviderKind.cpu)
        self._scales_digest = scales_digest(self.kv_scales)
        self.batched = batched_from(info, batched, provider is ProviderKind.cpu) is not None
        path = info.batched_path if self.batched else info.model_path
        # The mixed step's session, made at its first use: (the file, provider and threads to make it)
        self._mixed, self._path, self._provider, self._threads, self._info = None, path, provider, threads, info
        # On the CPU the prompt's graph keeps its attention bias: a wave's prompts of several lengths, left-padded, run
        # in one forward there (prefill_rows).
        padded = provider is ProviderKind.cpu

        def static_forms():
            from ..onnx.optimize import static_forms  # onnx's rewrite: imported where no earlier process kept it

            return static_forms(path, logits=True, padded=padded)

        forms = self._kept(("prefill-padded" if padded else "prefill", "decode"), static_forms)
        if forms is None:
            raise ProviderError(f"{info.folder}: no fixed-shape decode graph for this export (weights in a data file)")
        prefill, decode = forms
        # `mixed_prefill` (the CPU's): a lone row's prefill runs as a mixed step, its chunk beside a dummy decode row in
        # a scratch slot of its own (the buffers' last row, which no row holds), and the prefill session is made only
        # for prompts that start together (prefill_rows: open_prefill). Each session holds ONNX Runtime's own copy of
        # the weights (about 0.6 GB for 124M fp32); a decode step keeps its own graph (as a mixed step it took 1.5% longer
        # at 15 rows, 13% at 2, fp32).
        self.mixed_prefill = mixed_prefill and self.device == "cpu"
        self._prefill = self._keep_last = None
        # The prefill's graph alone, its weights mapped again where its session is made: a session copies its weights
        # (ONNX Runtime's AddExternalInitializers), so no array of the mapped file outlives the sessions made now.
        self._prefill_form = replace(prefill, weights=dict.fromkeys(prefill.weights))
        # Fresh prompts of at least this many tokens (rows x tokens) on the export's OpenVINO prefill graph, as the ort
        # backend runs them (`prefill_choice`: runtime.prefill.PrefillChoice), written straight into their slots.
        self.openvino_from = openvino_from(info, asked_prefill(prefill_choice), self.device == "cpu")
        # And rows' next tokens after what their slots hold from this many on (its graph on a past, where it takes one).
        self.openvino_past_from = openvino_past_from(info, asked_prefill(prefill_choice), self.openvino_from)
        self._openvino = None
        if self.mixed_prefill:
            self.open_mixed()
        else:
            self.open_prefill()
        # The decode step's rows are the slots up to the highest one held (free ones below it on a dummy token): its
        # batch dimension stays free, the rows bound by address like a prefill's.
        self._decode = create_session(decode.graph, provider, threads, weights=decode.weights,
                                      dims={io.PAST: self.capacity, io.TOTAL: self.capacity, io.LOGITS_SEQUENCE: 1})
        self.dtype = np.int8 if self.kv_scales is not None else np.float16 if info.precision is Precision.fp16 else np.float32
        self._row_shape = (1, cfg.n_head, self.capacity, cfg.head_dim)
        self._row_bytes = cfg.n_head * self.capacity * cfg.head_dim * np.dtype(self.dtype).itemsize
        # One buffer per layer and K/V, zeroed (an attention kernel must never meet NaN left in memory); a slot's rows
        # are bound by address, so a prefill writes that slot and nothing else. The first `resident` slots (default:
        # all) are written now, in huge pages where the kernel gives them: the server holds their memory from the start,
        # no step faults their pages in, and the attention's walk through them misses the TLB less (9% of a 16-row int8
        # step). The rest stay the kernel's zero pages, resident only once a row uses them, in small pages: a huge
        # page made a fresh slot's first write wait on the kernel's memory compaction (180 ms to copy 17 positions into
        # an fp32 slot, against 1 ms: docs/results/serving.md).
        self._scratch = slots  # mixed_prefill's dummy decode row
        rows = slots + 1 if self.mixed_prefill else slots
        self._arrays = small_page_arrays((rows, *self._row_shape[1:]), 2 * cfg.n_layer, self.dtype,
                                         held=slots if resident is None else resident)
        # (On the CPU an OrtValue holds its array's own memory: a slot's rows are also read and copied through them.)
        self._kv = [ort.OrtValue.ortvalue_from_numpy(a, self.device, 0) for a in self._arrays]
        self._names = (io.input_names(cfg.n_layer)[3:], io.output_names(cfg.n_layer)[1:])
        self._chunk_names = ([n for i in range(cfg.n_layer) for n in (io.chunk_past_key(i), io.chunk_past_value(i))],
                             [n for i in range(cfg.n_layer) for n in (io.chunk_present_key(i), io.chunk_present_value(i))])
        self.lengths = np.zeros(slots, np.int64)  # positions each slot holds (0: free)
        self.vocab_size = cfg.vocab_size
        self._total = ort.OrtValue.ortvalue_from_numpy(np.array([self.capacity], np.int32))  # read on the host
        self._steps: dict[int, tuple] = {}  # rows -> the decode step's binding over slots [0, rows) and its buffers
        self.mixed_runs = 0  # step_mixed's forwards

    def _kept(self, kinds: tuple[str, ...], make: Callable[[], tuple[InMemoryGraph, ...] | None]) -> tuple[InMemoryGraph, ...] | None:
        """The graphs `make` rewrites from the slots' graph file (onnx.optimize), each reading the int8 cache where the
        slots hold one: those an earlier process kept on disk where it did (onnx.graph_cache: then no onnx is imported,
        about a second of a server's start), else made here and kept. None where `make` has none."""
        if weights_beside(self._path):
            return None  # optimize's rewrites hold the weights of the graph's own file
        inputs = {"file": recorded_file(self._info, self._path), "scales": self._scales_digest}

        def made() -> tuple[InMemoryGraph, ...] | None:
            graphs = make()
            return None if graphs is None else tuple(self._with_kv_dtype(graph) for graph in graphs)

        return kept_or_made([graph_key(f"slots-{kind}", inputs) for kind in kinds], mapped_model(self._path)[1], made)

    def _with_kv_dtype(self, form: InMemoryGraph) -> InMemoryGraph:
        """`form` reading and writing the int8 cache, where the slots hold one."""
        if self.kv_scales is None:
            return form
        import onnx  # rewriting a graph: onnx's, where the cache is int8

        from ..onnx.kvcache import with_int8_kv

        proto = onnx.load_from_string(form.graph)
        with_int8_kv(proto, self.kv_scales)
        return replace(form, graph=proto.SerializeToString())

    def _bind_slots(self, binding, first: int, rows: int, names: tuple[list[str], list[str]] | None = None) -> None:
        """Slots [first, first + rows) of every buffer bound as past and present (`names`: the past's and present's
        input and output names, default the export's), by address: no copy."""
        shape = [rows, *self._row_shape[1:]]
        past, present = names or self._names
        for names, bind in ((past, binding.bind_input), (present, binding.bind_output)):
            for name, value in zip(names, self._kv):
                bind(name, self.device, 0, self.dtype, shape, value.data_ptr() + first * self._row_bytes)

    def _step_binding(self, rows: int) -> tuple:
        if rows not in self._steps:
            tokens = ort.OrtValue.ortvalue_from_numpy(np.zeros((rows, 1), np.int64), self.device, 0)
            seqlens = ort.OrtValue.ortvalue_from_numpy(np.zeros(rows, np.int32), self.device, 0)
            binding = self._decode.io_binding()
            for name, value in ((io.INPUT_IDS, tokens), (io.SEQLENS_K, seqlens), (io.TOTAL_SEQUENCE_LENGTH, self._total)):
                binding.bind_ortvalue_input(name, value)
            self._bind_slots(binding, 0, rows)
            self._steps[rows] = binding, tokens, seqlens
        return self._steps[rows]

    def _check_slot(self, slot: int) -> None:
        if not 0 <= slot < self.slots:
            raise ValueError(f"slot {slot} is not one of 0..{self.slots - 1}")

    def prefill(self, slot: int, ids: np.ndarray, every: bool = False) -> np.ndarray:
        """Append `ids` [T] to what `slot` holds (a prompt into a free slot, or the next chunk of one) in one forward on
        that slot's rows; the last position's logits [vocab], or with `every` each position's [T, vocab] (a prompt's
        logprobs)."""
        self._check_slot(slot)
        ids = np.ascontiguousarray(ids, dtype=np.int64).reshape(1, -1)
        past, T = int(self.lengths[slot]), ids.shape[1]
        if T == 0 or past + T > self.capacity:
            raise ValueError(f"slot {slot} holds {past} positions of {self.capacity}: {T} more do not fit")
        if not past and not every:
            logits = self._on_openvino(np.array([slot]), ids)
            if logits is not None:
                return logits[0]
        if self.mixed_prefill:  # beside the scratch slot's dummy token
            logits = self._run_mixed(self._scratch, 1, np.zeros(1, np.int64), np.zeros(1, np.int32), slot, ids[0], every)
            self.lengths[slot] = past + T
            return logits[1:] if every else logits[1]
        binding = self._prefill.io_binding()
        binding.bind_cpu_input(io.INPUT_IDS, ids)
        binding.bind_cpu_input(io.ATTENTION_MASK, np.ones((1, past + T), np.int64))
        binding.bind_cpu_input(io.POSITION_IDS, np.arange(past, past + T, dtype=np.int64)[None])
        if self._keep_last is not None and not every:  # else the graph's default: every position's
            binding.bind_ortvalue_input(io.LOGITS_TO_KEEP, self._keep_last)
        binding.bind_output(io.LOGITS, "cpu")
        self._bind_slots(binding, slot, 1)  # this slot's rows alone
        self._prefill.run_with_iobinding(binding)
        self.lengths[slot] = past + T
        logits = binding.get_outputs()[0].numpy()[0]
        return logits if every else logits[-1]

    def step(self, tokens: np.ndarray, active: np.ndarray | None = None, take: np.ndarray | None = None) -> np.ndarray:
        """Append each held slot's token of `tokens` [slots] at its own next position (a free slot's is ignored); the
        logits [slots, vocab] (a free slot's are meaningless), or with `take` only those slots' [len(take), vocab] (a
        16-row step's caller reads 3 MB, not the 6 MB of 32 slots zeroed and copied, and where it takes slots 0 up to
        the highest one stepped, in order, the step's own output). The step runs slots 0 up to the highest one held.
        `active` [slots] bool: only those slots advance (default: every held one); another held slot runs a dummy
        token at its next position without advancing, which its own next token or chunk overwrites before it is read."""
        tokens = np.ascontiguousarray(tokens, dtype=np.int64).reshape(self.slots)
        held = self.lengths > 0
        if active is not None:
            held = held & np.asarray(active, dtype=bool)
        if not held.any():
            raise ValueError("no slot holds a sequence: prefill one first")
        if (self.lengths[held] >= self.capacity).any():
            raise ValueError(f"slot {int(np.flatnonzero(held & (self.lengths >= self.capacity))[0])} is full "
                             f"({self.capacity} positions)")
        rows = int(np.flatnonzero(self.lengths > 0)[-1]) + 1
        binding, ids, seqlens = self._step_binding(rows)
        ids.update_inplace(np.where(held, tokens, 0)[:rows].reshape(rows, 1))
        seqlens.update_inplace(self.lengths[:rows].astype(np.int32))  # a free slot's 0: its token goes to position 0
        # fresh memory each step, as the caller may keep what a step gave: never copied again where it reads every row
        logits = np.empty((rows, 1, self.vocab_size), np.float32)
        binding.bind_output(io.LOGITS, "cpu", 0, np.float32, list(logits.shape), logits.ctypes.data)
        self._decode.run_with_iobinding(binding)
        self.lengths[held] += 1
        if take is not None:
            take = np.asarray(take)
            return logits[:, 0] if np.array_equal(take, np.arange(rows)) else logits[take, 0]
        out = np.zeros((self.slots, self.vocab_size), np.float32)
        out[:rows] = logits[:, 0]
        return out

    @property
    def prompts_on_prefill_graph(self) -> bool:
        """Whether fresh prompts that OpenVINO does not take run together on the prefill's session (left-padded: its
        graph keeps the attention bias): without an OpenVINO prefill, or where prefills are not mixed steps (that
        session is open anyway). With one, prompts too short for it each run alone, and the session is not held (0.3 GB
        for GPT-2 124M int8: docs/results/serving.md)."""
        return self.openvino_from is None or not self.mixed_prefill

    def open_prefill(self) -> None:
        """Open the prefill's session now (where prefills are mixed steps, prompts starting together run on it)."""
        if self._prefill is None:
            mapped = mapped_model(self._path)[1]
            form = replace(self._prefill_form, weights={n: mapped[n] for n in self._prefill_form.weights})
            self._prefill = create_session(form.graph, self._provider, self._threads, weights=form.weights)
            if io.LOGITS_TO_KEEP in {i.name for i in self._prefill.get_overridable_initializers()}:
                self._keep_last = ort.OrtValue.ortvalue_from_numpy(np.array(1, np.int64))

    def open_openvino(self) -> None:
        """Open and warm the OpenVINO prefill now, where fresh prompts run there (its first inference lays its weights
        out: seconds)."""
        if self.openvino_from is not None and self._openvino is None:
            try:
                from .openvino_prefill import OpenVinoPrefill
            except ImportError as e:
                raise ProviderError(f"{self._info.folder}: cannot run the prefill on OpenVINO: openvino does not import "
                                    f"({e})") from None
            self._openvino = OpenVinoPrefill(self._info, self._threads, self.kv_scales)
            self._openvino.warm_up(past=self.openvino_past_from is not None)

    def _on_openvino(self, slots: np.ndarray, ids: np.ndarray, mask: np.ndarray | None = None) -> np.ndarray | None:
        """Fresh prompts `ids` [B, T], left-padded where `mask` [B, T] says so, into the free `slots` [B] on OpenVINO:
        its presents written into the slots' own memory where they are consecutive (else into fresh arrays, then
        copied), each padded row's positions then moved to the front of its slot. Their last logits [B, vocab]; None
        where the export's record runs B x T tokens on ONNX Runtime."""
        B, T = ids.shape
        if self.openvino_from is None or T < 2 or B * T < self.openvino_from or self.device != "cpu":
            return None
        self.open_openvino()
        mask = np.ones((B, T), np.int64) if mask is None else np.ascontiguousarray(mask, dtype=np.int64)
        held = mask.sum(axis=1)
        first = int(slots[0])
        in_place = _consecutive(slots)
        if in_place:
            presents = [a[first: first + B] for a in self._arrays]  # C-contiguous views: OpenVINO writes into them
        else:
            presents = [np.empty((B, a.shape[1], T, a.shape[3]), a.dtype) for a in self._arrays]
        logits = self._openvino(ids, mask, positions(mask, T), presents)
        self._to_fronts(slots, presents, held, T, in_place)
        return logits

    def _to_fronts(self, slots: np.ndarray, presents: list[np.ndarray], held: np.ndarray, T: int,
                   in_place: bool = False) -> None:
        """Fresh prompts' presents, T positions each (left-padded: row b's own positions its last held[b]), written to
        the front of their slots, which then hold that many; `in_place`: the presents are the slots' own rows, where only
        a padded row moves (through a copy: its source and target overlap)."""
        for b, slot in enumerate(slots.tolist()):
            n = int(held[b])
            if n < T or not in_place:  # a slot's row starts at its position 0
                for a, p in zip(self._arrays, presents):
                    a[slot, :, :n] = p[b, :, T - n: T].copy() if in_place else p[b, :, T - n: T]
        self.lengths[slots] = held

    def prefill_fresh(self, slots: np.ndarray, ids: np.ndarray, mask: np.ndarray) -> np.ndarray | None:
        """Fresh prompts `ids` [B, T], left-padded as `mask` says, into the free `slots` [B] in one forward on the
        export's OpenVINO prefill (its graph reads the mask), where the export's record runs prompts of B x T tokens
        there: their last logits [B, vocab]; else None, nothing run."""
        slots = np.asarray(slots, dtype=np.int64)
        if len(set(slots.tolist())) != len(slots) or self.lengths[slots].any() or not 0 < ids.shape[1] <= self.capacity:
            raise ValueError(f"slots {slots.tolist()} are not all distinct and free, or {ids.shape[1]} positions do not "
                             f"fit their {self.capacity}")
        return self._on_openvino(slots, np.ascontiguousarray(ids, dtype=np.int64), mask)

    def prefill_held(self, slots: np.ndarray, rows: list[np.ndarray]) -> np.ndarray | None:
        """Each slot's next tokens `rows[b]` after what it holds, in one forward on the export's OpenVINO prefill graph
        on a past, where its record runs that many new tokens (rows x the longest) on a past there: their last logits
        [B, vocab]; else None, nothing run. Slots holding one length, consecutive, with rows of one length run in the
        slots' own memory; any others in fresh arrays, each slot's past right-aligned before the new columns and its
        tokens left-padded in them (the mask's zeros between), then copied back after what the slot holds."""
        slots = np.asarray(slots, dtype=np.int64)
        B, T = len(slots), max(len(r) for r in rows)
        held = self.lengths[slots].copy()
        start = self.openvino_past_from
        if start is None or T < 2 or B * T < start or self.device != "cpu" or not held.all() \
                or len(set(slots.tolist())) != B or held.max() + T > self.capacity:
            return None
        self.open_openvino()
        P, first = int(held.max()), int(slots[0])
        ids = np.zeros((B, T), np.int64)
        for b, r in enumerate(rows):
            ids[b, T - len(r):] = r
        if _consecutive(slots) and (held == P).all() and all(len(r) == T for r in rows):
            mask = np.ones((B, P + T), np.int64)
            logits = self._openvino(ids, mask, positions(mask, T), [a[first: first + B] for a in self._arrays], past=P)
            self.lengths[slots] = P + T
            return logits
        mask = np.zeros((B, P + T), np.int64)
        buffers = [np.zeros((B, a.shape[1], P + T, a.shape[3]), a.dtype) for a in self._arrays]
        for b, slot in enumerate(slots.tolist()):
            n = int(held[b])
            mask[b, P - n: P] = mask[b, P + T - len(rows[b]):] = 1
            for a, buffer in zip(self._arrays, buffers):
                buffer[b, :, P - n: P] = a[slot, :, :n]
        logits = self._openvino(ids, mask, positions(mask, T), buffers, past=P)
        for b, slot in enumerate(slots.tolist()):
            n, t = int(held[b]), len(rows[b])
            for a, buffer in zip(self._arrays, buffers):
                a[slot, :, n: n + t] = buffer[b, :, P + T - t:]
            self.lengths[slot] = n + t
        return logits

    def prefill_rows(self, slots: np.ndarray, ids: np.ndarray, mask: np.ndarray | None = None) -> np.ndarray:
        """Prompts `ids` [B, T], left-padded where `mask` [B, T] says so (default: none), into the free `slots` [B] in
        one forward on ONNX Runtime: the prefill graph on an empty past (its GroupQueryAttention runs several tokens of
        several rows only there; its attention bias masks the padding), its presents then written into the slots, each
        row's positions at the front of its own. Each row's last logits [B, vocab]. On the CPU. (Where the export's
        record runs the prompts on OpenVINO, SlotBackend has run them there first: prefill_fresh.)"""
        slots = np.asarray(slots, dtype=np.int64)
        ids = np.ascontiguousarray(ids, dtype=np.int64)
        (B, T), (_, heads, _, dim) = ids.shape, self._row_shape
        mask = np.ones((B, T), np.int64) if mask is None else np.ascontiguousarray(mask, dtype=np.int64)
        for slot in slots.tolist():
            self._check_slot(slot)
        if len(set(slots.tolist())) != B or self.lengths[slots].any() or not 0 < T < self.capacity:
            raise ValueError(f"{B} prompts of {T} tokens go into as many distinct free slots of {self.capacity} positions")
        if self.device != "cpu":
            raise ProviderError("prompts are prefilled together into the slots on the CPU provider only")
        self.open_prefill()
        binding = self._prefill.io_binding()
        bind_prompts(binding, ids, self._keep_last, mask)
        empty = np.zeros((B, heads, 0, dim), self.dtype)
        for name in self._names[0]:
            binding.bind_cpu_input(name, empty)
        binding.bind_output(io.LOGITS, "cpu")
        for name in self._names[1]:
            binding.bind_output(name, "cpu")
        self._prefill.run_with_iobinding(binding)
        logits, *presents = binding.get_outputs()
        self._to_fronts(slots, [p.numpy() for p in presents], mask.sum(axis=1), T)
        return logits.numpy()[:, -1]

    def open_mixed(self) -> None:
        """Open the mixed step's session now (a server's first mixed step would otherwise wait seconds for it)."""
        if self._mixed is None:
            def mixed_form():
                from ..onnx.optimize import mixed_form  # onnx's rewrite: imported where no earlier process kept it

                form = mixed_form(self._path)
                return None if form is None else (form,)

            [form] = self._kept(("mixed",), mixed_form)
            self._mixed = create_session(form.graph, self._provider, self._threads, weights=form.weights,
                                         dims={io.PAST: self.capacity, "capacity": self.capacity, "chunk_rows": 1})

    # One chunk a decode step's forward (ONNX Runtime's GroupQueryAttention runs several tokens on a past for one row
    # at a time); a decoder that takes several has step_mixed_several (runtime.openvino_paged's).
    mixes_several = False

    def mixes(self, active: np.ndarray, slot: int, ids: np.ndarray) -> bool:
        """Whether step_mixed runs these: decode rows, a chunk into a slot that is not one of them, and room in that
        slot for the chunk and a dummy token after it."""
        active = np.asarray(active, dtype=bool)
        return bool(active.any()) and not active[slot] and 0 < len(ids) and self.lengths[slot] + len(ids) < self.capacity

    def step_mixed(self, tokens: np.ndarray, active: np.ndarray, slot: int, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """`step(tokens, active)` and `prefill(slot, ids)` in one forward (the mixed form: onnx.optimize.to_mixed_step),
        where `mixes` says so: the decode logits [slots, vocab] and the chunk's last position's [vocab]. (One chunk row:
        ONNX Runtime's GroupQueryAttention runs several tokens on a past for one row at a time.) The chunk's slot, when
        it is among the decode rows, runs its dummy token after the chunk, where the row's next token overwrites it."""
        self._check_slot(slot)
        active = np.asarray(active, dtype=bool)
        ids = np.ascontiguousarray(ids, dtype=np.int64).reshape(-1)
        if not self.mixes(active, slot, ids):
            raise ValueError(f"a chunk of {len(ids)} into slot {slot} does not mix with this step (SlotDecoder.mixes)")
        self.open_mixed()
        rows = int(np.flatnonzero(active)[-1]) + 1  # the decode group: slots [0, rows)
        past, T = int(self.lengths[slot]), len(ids)
        seqlens = self.lengths[:rows].astype(np.int32)  # a free slot's 0: its dummy token goes to position 0
        if slot < rows:
            seqlens[slot] = past + T
        tokens = np.ascontiguousarray(tokens, dtype=np.int64).reshape(self.slots)
        logits = self._run_mixed(0, rows, np.where(active, tokens, 0)[:rows], seqlens, slot, ids)  # [rows + 1, vocab]
        self.mixed_runs += 1
        self.lengths[active] += 1
        self.lengths[slot] = past + T
        out = np.zeros((self.slots, self.vocab_size), np.float32)
        out[:rows] = logits[:rows]
        return out, logits[rows]

    def _run_mixed(self, first: int, rows: int, tokens: np.ndarray, seqlens: np.ndarray, slot: int, ids: np.ndarray,
                   every: bool = False) -> np.ndarray:
        """One forward of the mixed step: `rows` decode rows on slots [first, first + rows) (the scratch slot's one,
        beside a prefill), each token of `tokens` at its position `seqlens`, and `ids` appended to what `slot` holds.
        The logits of the decode rows, then of the chunk's last position (`every`: each position's)."""
        self.open_mixed()
        past, T = int(self.lengths[slot]), len(ids)
        binding = self._mixed.io_binding()
        binding.bind_cpu_input(io.INPUT_IDS, np.concatenate([tokens, ids]).astype(np.int64)[None])
        binding.bind_cpu_input(io.POSITION_IDS, np.concatenate([seqlens.astype(np.int64), past + np.arange(T)])[None])
        binding.bind_cpu_input(io.SEQLENS_K, seqlens)
        binding.bind_ortvalue_input(io.TOTAL_SEQUENCE_LENGTH, self._total)
        binding.bind_cpu_input(io.CHUNK_SEQLENS_K, np.array([past + T - 1], np.int32))
        binding.bind_ortvalue_input(io.CHUNK_TOTAL, self._total)
        chunk = rows + (np.arange(T) if every else np.array([T - 1]))
        binding.bind_cpu_input(io.KEEP, np.concatenate([np.arange(rows), chunk]).astype(np.int64))
        binding.bind_output(io.LOGITS, "cpu")
        self._bind_slots(binding, first, rows)
        self._bind_slots(binding, slot, 1, self._chunk_names)
        self._mixed.run_with_iobinding(binding)
        return binding.get_outputs()[0].numpy()[0]

    def release(self, slot: int) -> None:
        """Free `slot`: its next prefill starts a new sequence there (nothing is cleared or moved)."""
        self._check_slot(slot)
        self.lengths[slot] = 0

    def copy(self, source: int, target: int) -> None:
        """`target` holds what `source` holds (one row's positions copied: two rows of one prompt). On the CPU."""
        if self.device != "cpu":
            raise ProviderError("a slot is copied on the CPU provider only")
        n = int(self.lengths[source])
        for a in self._arrays:
            a[target, :, :n] = a[source, :, :n]
        self.lengths[target] = n

    def write(self, slot: int, kv: list[np.ndarray]) -> None:
        """`slot` holds `kv` (2 * n_layer arrays (H, n, D), key then value per layer, in the slots' dtype: a past made
        elsewhere, such as the prefix cache's blocks) at its positions 0 .. n - 1. On the CPU."""
        self._check_slot(slot)
        if self.device != "cpu":
            raise ProviderError("a slot is written on the CPU provider only")
        n = kv[0].shape[1]
        if not 0 < n < self.capacity:
            raise ValueError(f"slot {slot} holds at most {self.capacity - 1} positions of a past, not {n}")
        for a, values in zip(self._arrays, kv):
            a[slot, :, :n] = values
        self.lengths[slot] = n

    def views(self, first: int, rows: int, length: int) -> list[np.ndarray]:
        """Positions 0 .. length - 1 of slots [first, first + rows): 2 * n_layer arrays (rows, H, length, D), views of
        the slots' memory (read them before those positions are written again). On the CPU."""
        if self.device != "cpu":
            raise ProviderError("the slots are read on the CPU provider only")
        return [a[first: first + rows, :, :length] for a in self._arrays]

    def read(self, slot: int) -> list[np.ndarray]:
        """What `slot` holds: 2 * n_layer arrays (H, length, D) in the slots' dtype, copies. On the CPU."""
        if self.device != "cpu":
            raise ProviderError("a slot is read on the CPU provider only")
        return [a[slot, :, : int(self.lengths[slot])].copy() for a in self._arrays]

    def close(self) -> None:
        self._prefill = self._decode = self._mixed = Released("slot decoder")
        self._openvino = None
        self._kv, self._arrays = [], []


@dataclass(eq=False)
class SlotCache:
    """A batch's rows in a SlotBackend: the slots it holds, row i in slots[i]. Each slot has one holder: `merge` and
    `reorder` hand the slots kept to the cache they return (the ones before hold none after), a row that leaves frees
    its slot, and a cache let go (a batch's end, joiners dropped) frees what it holds. Nothing of a row's cache moves."""

    owner: SlotBackend
    slots: np.ndarray  # (B,): row i is in slot slots[i]
    # A past made elsewhere (past_from_numpy: 2 * n_layer arrays (B, H, P, D), each row right-aligned), written into
    # the slots at the first step, whose attention mask says how many of its positions are each row's.
    staged: list[np.ndarray] | None = None

    def _handed(self) -> np.ndarray:
        if self.staged is not None:
            raise RuntimeError("a past made elsewhere is written into its slots by a step before its rows move")
        slots, self.slots = self.slots, np.zeros(0, np.int64)
        return slots

    def merge(self, rows: np.ndarray, joiner: SlotCache | None, width: int) -> SlotCache:
        """`width` goes unused: each row keeps its own length, and nothing is aligned."""
        pool = self._handed() if joiner is None else np.concatenate([self._handed(), joiner._handed()])
        return SlotCache(self.owner, self.owner.gathered(pool, np.asarray(rows)))

    def truncate(self, length: int) -> SlotCache:
        """The rows' first `length` positions of the longest one's, each row right-aligned to it (speculative decoding's
        rejected tokens dropped): each slot holds that many fewer positions, nothing moved."""
        if self.staged is not None:
            raise RuntimeError("a past made elsewhere is written into its slots by a step before it is cut")
        self.owner.flush()
        lengths = self.owner.decoder.lengths
        drop = int(lengths[self.slots].max()) - length
        if drop < 0 or (lengths[self.slots] <= drop).any():
            raise ValueError(f"cannot keep {length} positions of rows holding {lengths[self.slots].tolist()}")
        lengths[self.slots] -= drop
        return self

    def reorder(self, rows: np.ndarray) -> SlotCache:
        """The rows gathered by `rows`: a row taken twice is copied into a free slot (two rows of one prompt)."""
        return SlotCache(self.owner, self.owner.gathered(self._handed(), np.asarray(rows)))

    def __del__(self) -> None:
        for slot in self.slots.tolist():
            self.owner.free(slot)

    def to_numpy(self) -> list[np.ndarray]:
        """2 * n_layer float arrays (B, H, P, D), each row right-aligned to the longest (zeros before a shorter one); an
        int8 cache's dequantized."""
        scales = self.owner.decoder.kv_scales
        stored = self.stored()
        if stored[0].dtype == BF16_BITS:  # a bf16 cache's (runtime.openvino_paged)
            return [bf16_values(a) for a in stored]
        return stored if scales is None else [dequantize(a, s) for a, s in zip(stored, scales)]

    def stored(self) -> list[np.ndarray]:
        """As to_numpy, in the dtype the slots hold (int8 for an int8 cache): what the prefix cache keeps. Views of the
        slots where the rows hold one length in consecutive slots (a wave's prompts: no copy before its first step),
        else copies."""
        if self.staged is not None:
            return [a.copy() for a in self.staged]
        self.owner.flush()
        decoder, first = self.owner.decoder, int(self.slots[0])
        lengths = decoder.lengths[self.slots]
        if _consecutive(self.slots) and (lengths == lengths[0]).all():
            return decoder.views(first, len(self.slots), int(lengths[0]))
        rows = [decoder.read(int(s)) for s in self.slots]
        P = max(r[0].shape[1] for r in rows)
        out = []
        for layer in range(len(rows[0])):
            a = np.zeros((len(rows), *rows[0][layer].shape[:1], P, rows[0][layer].shape[2]), rows[0][layer].dtype)
            for b, r in enumerate(rows):
                a[b, :, P - r[layer].shape[1]:] = r[layer]
            out.append(a)
        return out


class SlotBackend(Closable):
    """A SlotDecoder behind the Backend protocol, for the serving engine: a prefill takes a free slot per row (the
    lowest, so that steps run few slots) and runs each row's own tokens there (a left-padded row's padding dropped);
    a one-token step of a batch is one decode step of its slots; rows join and leave through SlotCache.merge. The
    attention mask's columns only say which tokens are a row's: every row runs at its own length. A past made
    elsewhere (the prefix cache's blocks: past_from_numpy) is written into the rows' slots at their first step, each
    row's positions as its mask counts them (CPU only). `run` gives every position's logits (a prompt's logprobs, a
    draft's verification), and a cache rolls back by its slots' lengths alone (SlotCache.truncate)."""

    name = "ort"
    capabilities = Capabilities(runtime="ONNX Runtime, fixed slots", precisions_by_provider=SLOT_PRECISIONS,
                                takes_past=True, joins_rows=True, frees_rows=True, rolls_back=True, mixes_chunks=True,
                                warms_up=True, stores_kv_dtype=True, estimates_prefill=True, past_rows_apart=True)
    cache_forms = (SlotCache,)

    def __init__(self, info: ExportInfo, provider: ProviderKind = ProviderKind.cpu, threads: int | None = None,
                 slots: int = 16, capacity: int | None = None, mix_chunks: bool = True, resident: int | None = None,
                 batched: bool | None = None, prefill: str | None = None):
        # Mixing chunks, a lone row's prefill is a mixed step too (SlotDecoder.mixed_prefill).
        self._hold(SlotDecoder(info, provider, slots, capacity, threads, resident, mixed_prefill=mix_chunks,
                               batched=batched, prefill_choice=prefill), info, provider)
        if not mix_chunks:  # each chunk in a forward of its own (what the mixed step is measured against)
            self.capabilities = replace(self.capabilities, mixes_chunks=False)
        elif provider is ProviderKind.cpu:  # the chunk's base for this CPU's kernels (elsewhere the scheduler's)
            self.capabilities = replace(self.capabilities, mixed_chunk_base=cpu_mixed_chunk_base(info.precision))

    def _hold(self, decoder, info: ExportInfo, provider: ProviderKind) -> None:
        """The backend on `decoder` (a SlotDecoder, or one with its interface: runtime.openvino_paged's), every slot free."""
        self.decoder = decoder
        self.info, self.provider = info, provider
        self.n_positions, self.vocab_size = decoder.capacity, info.config.vocab_size
        self.kv_dtype = decoder.dtype
        self.model_name = info.meta["model"]["name"]
        self._free = list(range(decoder.slots))
        # step_later's chunks, not yet run: (slot, ids), each run in the next decode step's forward or alone before
        # anything else reads the slots; and the last logits [vocab] of each slot's chunk that ran, for later_logits
        self._pending: list[tuple[int, np.ndarray]] = []
        self._ran: dict[int, np.ndarray] = {}

    def warm_up(self) -> None:
        """Open the sessions the server runs: the mixed step's, where chunks mix, and on the CPU the OpenVINO prefill,
        where the export's record runs fresh prompts there, and the prefill's where prompts run together on it
        (SlotDecoder.prompts_on_prefill_graph)."""
        if self.capabilities.mixes_chunks:
            self.decoder.open_mixed()
        if self.decoder.device == "cpu":
            self.decoder.open_openvino()
            if self.decoder.prompts_on_prefill_graph:
                self.decoder.open_prefill()

    def take(self) -> int:
        """The lowest free slot, now taken."""
        if not self._free:
            raise RuntimeError(f"every one of the {self.decoder.slots} slots is held: serve at most as many rows")
        self._free.sort()
        return self._free.pop(0)

    def free(self, slot: int) -> None:
        self._pending = [(s, ids) for s, ids in self._pending if s != slot]  # a row that leaves runs nothing more
        self._ran.pop(slot, None)
        self.decoder.release(slot)
        self._free.append(slot)

    def flush(self, but: tuple[int, ...] = ()) -> None:
        """Run the chunks step_later holds (`but`: those at these indices left pending): the whole prompts into free
        slots together (`_together_first`), each other alone."""
        kept = [p for i, p in enumerate(self._pending) if i in but]
        run = [p for i, p in enumerate(self._pending) if i not in but]
        self._pending = kept
        ran = self._together_first([(slot, ids) for slot, ids in run if not self.decoder.lengths[slot]])
        ran.update(self._together_on_past([(slot, ids) for slot, ids in run if slot not in ran and self.decoder.lengths[slot]]))
        for slot, ids in run:
            if slot not in ran:
                ran[slot] = self.decoder.prefill(slot, ids)
        self._ran.update(ran)

    def later_logits(self, past: SlotCache) -> np.ndarray:
        """The last position's logits [B, vocab] of the chunk step_later held for each row of `past`, which ran in a
        decode step's forward or, where still held, runs now alone."""
        if {slot for slot, _ in self._pending} & set(past.slots.tolist()):
            self.flush()
        return np.stack([self._ran.pop(slot) for slot in past.slots.tolist()])

    def _together_first(self, fresh: list[tuple[int, np.ndarray]]) -> dict[int, np.ndarray]:
        """Whole prompts (slot, ids) into free slots, run together where they can be (on the CPU): on OpenVINO,
        left-padded, where the export's record runs them there (SlotDecoder.prefill_fresh), else on ONNX Runtime's
        prefill graph, left-padded too, where they run there (prefill_rows: SlotDecoder.prompts_on_prefill_graph). The
        last logits [vocab] of each slot that ran."""
        if len(fresh) < 2 or self.decoder.device != "cpu":
            return {}
        slots = np.array([slot for slot, _ in fresh])
        T = max(len(ids) for _, ids in fresh)
        mask = np.array([[0] * (T - len(ids)) + [1] * len(ids) for _, ids in fresh], np.int64)
        padded = np.array([np.concatenate([np.zeros(T - len(ids), np.int64), ids]) for _, ids in fresh])
        logits = self.decoder.prefill_fresh(slots, padded, mask)
        if logits is None and self.decoder.prompts_on_prefill_graph:
            logits = self.decoder.prefill_rows(slots, padded, mask)
        return {} if logits is None else dict(zip(slots.tolist(), logits))

    def _together_on_past(self, held: list[tuple[int, np.ndarray]]) -> dict[int, np.ndarray]:
        """Rows' next tokens (slot, ids) after what their slots hold (a prompt's rest after the prefix cache's blocks,
        a chunk; each slot holding some), run together on OpenVINO where the export's record runs that many there (SlotDecoder.prefill_held).
        The last logits [vocab] of each slot that ran."""
        if not held or len({slot for slot, _ in held}) != len(held):
            return {}
        slots = np.array([slot for slot, _ in held])
        logits = self.decoder.prefill_held(slots, [ids for _, ids in held])
        return {} if logits is None else dict(zip(slots.tolist(), logits))

    def _slots_for(self, B: int, past: SlotCache | None) -> np.ndarray:
        if past is not None:
            return past.slots
        if len(self._free) < B:  # refused before any is taken: none is left held by no cache
            raise RuntimeError(f"{B} rows need a slot each and {len(self._free)} of {self.decoder.slots} are free")
        return np.asarray([self.take() for _ in range(B)], dtype=np.int64)

    def past_from_numpy(self, arrays: list[np.ndarray]) -> SlotCache:
        """A slot per row, which its first step fills with its part of `arrays` (SlotCache.staged): float arrays, or
        for an int8 cache int8 ones as `stored` gives them (float ones quantized as the cache stores them)."""
        scales = self.decoder.kv_scales
        if scales is not None and arrays[0].dtype != np.int8:
            arrays = [quantize(a, s) for a, s in zip(arrays, scales)]
        elif self.decoder.dtype == BF16_BITS:  # float arrays rounded as a bf16 cache holds them
            arrays = [a if a.dtype == BF16_BITS else bf16_bits(a) for a in arrays]
        elif scales is None:
            arrays = [np.asarray(a, dtype=self.decoder.dtype) for a in arrays]
        return SlotCache(self, self._slots_for(arrays[0].shape[0], None), staged=list(arrays))

    def _write_staged(self, past: SlotCache | None, attention_mask: np.ndarray, T: int) -> None:
        """A staged past written into its slots: row b's last n_b positions, n_b its mask's past columns held."""
        if past is None or past.staged is None:
            return
        staged, past.staged = past.staged, None
        P = staged[0].shape[2]
        held = attention_mask[:, : attention_mask.shape[1] - T].sum(axis=1)
        for b, slot in enumerate(past.slots.tolist()):
            n = int(held[b])
            if n > P:
                raise ValueError(f"row {b}'s mask holds {n} past positions; its past has {P}")
            if n:
                self.decoder.write(slot, [a[b, :, P - n:] for a in staged])

    def step_later(self, input_ids: np.ndarray, attention_mask: np.ndarray, position_ids: np.ndarray,
                   past: SlotCache | None) -> SlotCache:
        """`step` for a prefill chunk whose logits are not read: each row's tokens held, to run in the forward of the
        next decode step (SlotDecoder.step_mixed, one chunk at a time) or alone before anything else reads a slot."""
        self._write_staged(past, attention_mask, input_ids.shape[1])
        slots = self._slots_for(len(input_ids), past)
        if set(slots.tolist()) & {s for s, _ in self._pending}:
            self.flush()  # a row's chunks run in order
        new = attention_mask[:, -input_ids.shape[1]:].astype(bool)
        self._pending += [(int(slots[b]), input_ids[b][new[b]]) for b in range(len(slots)) if new[b].any()]
        return SlotCache(self, slots) if past is None else past

    def gathered(self, slots: np.ndarray, rows: np.ndarray) -> np.ndarray:
        """slots[rows]: the slots not taken freed first, then a slot taken a second time copied into a free one."""
        for slot in set(slots.tolist()) - set(slots[rows].tolist()):
            self.free(slot)
        out, seen = [], set()
        for slot in slots[rows].tolist():
            if slot in seen:
                self.flush()  # what the copy reads has run
                copy = self.take()
                self.decoder.copy(slot, copy)
                slot = copy
            seen.add(slot)
            out.append(slot)
        return np.asarray(out, dtype=np.int64)

    def step(self, input_ids: np.ndarray, attention_mask: np.ndarray, position_ids: np.ndarray,
             past: SlotCache | None) -> tuple[np.ndarray, SlotCache]:
        """The last position's logits (B, V) of each row's new tokens (the mask's last T columns that are 1), run on
        what its slot holds: a batch of one-token rows on held slots is one decode step; any other, a prefill per row."""
        B, T = input_ids.shape
        self._write_staged(past, attention_mask, T)
        slots = self._slots_for(B, past)
        new = attention_mask[:, -T:].astype(bool)  # which of the T columns are each row's own tokens
        if T == 1 and past is not None and new.all() and (self.decoder.lengths[slots] > 0).all():
            tokens = np.zeros(self.decoder.slots, np.int64)
            tokens[slots] = input_ids[:, 0]
            active = np.zeros(self.decoder.slots, bool)
            active[slots] = True
            # the chunks this step's forward takes: one (ONNX Runtime's slots), or every one that fits (a decoder that
            # mixes several: the paged slots')
            mixed = tuple(i for i, (s, ids) in enumerate(self._pending) if self.decoder.mixes(active, s, ids))
            mixed = mixed if self.decoder.mixes_several else mixed[:1]
            self.flush(but=mixed)
            if not mixed:
                return self.decoder.step(tokens, active, take=slots), past
            chunks, self._pending = self._pending, []
            if self.decoder.mixes_several:
                logits, ran = self.decoder.step_mixed_several(tokens, active, chunks)
                self._ran.update(ran)
            else:
                (slot, ids), = chunks
                logits, self._ran[slot] = self.decoder.step_mixed(tokens, active, slot, ids)
            return logits[slots], past
        return self._prefill(input_ids, new, slots, past, every=False)

    def run(self, input_ids: np.ndarray, attention_mask: np.ndarray, position_ids: np.ndarray,
            past: SlotCache | None) -> tuple[np.ndarray, SlotCache]:
        """Every position's logits (B, T, V) of each row's new tokens (a padding column's zeros), each row prefilled
        into its slot."""
        T = input_ids.shape[1]
        self._write_staged(past, attention_mask, T)
        slots = self._slots_for(len(input_ids), past)
        return self._prefill(input_ids, attention_mask[:, -T:].astype(bool), slots, past, every=True)

    def _prefill(self, input_ids: np.ndarray, new: np.ndarray, slots: np.ndarray, past: SlotCache | None,
                 every: bool) -> tuple[np.ndarray, SlotCache]:
        """Each row's new tokens (`new`: which of the T columns are its own) appended to its slot: the whole prompts
        into free slots together where they can be (`_together_first`: a wave of requests), every other row in a
        forward of its own. The last position's logits (B, V), or with `every` each position's (B, T, V)."""
        self.flush()
        B, T = input_ids.shape
        logits = np.zeros((B, T, self.vocab_size) if every else (B, self.vocab_size), np.float32)
        rows = [(int(slots[b]), input_ids[b][new[b]]) for b in range(B)]
        together = {} if every else self._together_first([(s, ids) for s, ids in rows
                                                           if len(ids) and not self.decoder.lengths[s]])
        if not every:
            together.update(self._together_on_past([(s, ids) for s, ids in rows
                                                    if len(ids) and s not in together and self.decoder.lengths[s]]))
        for b, (slot, ids) in enumerate(rows):  # a prompt, or its next chunk, into each row's own slot
            if slot in together:
                logits[b] = together[slot]
            elif len(ids):
                out = self.decoder.prefill(slot, ids, every)
                if every:
                    logits[b, new[b]] = out
                else:
                    logits[b] = out
        return logits, SlotCache(self, slots) if past is None else past

    def prefill_ms(self, rows: int, new_tokens: int, past_tokens: int = 0) -> float | None:
        """The estimated ms of a prefill of `rows` x `new_tokens` on a past of `past_tokens`, from the export's record
        (runtime.prefill.estimate_ms), as the slots run it: fresh prompts together, on OpenVINO where the record runs
        that many tokens there; on a past together on OpenVINO likewise (its record's `past` timing), else each row
        alone on ONNX Runtime. None without an OpenVINO prefill."""
        start = self.decoder.openvino_from
        if start is None:
            return None
        timing = self.info.prefill.get("timing") or {}
        if past_tokens:
            on_past = self.decoder.openvino_past_from
            if on_past is not None and new_tokens > 1 and rows * new_tokens >= on_past:
                return estimate_ms(timing.get("past") or timing, PrefillChoice.openvino, rows * new_tokens)
            one = estimate_ms(timing.get("past") or timing, PrefillChoice.onnxruntime, new_tokens)
            return None if one is None else rows * one
        fresh = PrefillChoice.openvino if new_tokens > 1 and rows * new_tokens >= start else PrefillChoice.onnxruntime
        return estimate_ms(timing, fresh, rows * new_tokens)

    def peak_device_memory_mb(self) -> float | None:
        return None

    def close(self) -> None:
        self.decoder.close()
