"""OpenVINO's paged attention on an export's OpenVINO prefill graph, behind the fixed slots (no torch).

The prefill graph (onnx/openvino_prefill.py) is rewritten in memory for OpenVINO's PagedAttentionExtension, the op
OpenVINO GenAI's continuous batching runs: its key and value caches are blocks of positions that the op reads and
writes in place, and one forward runs any mix of sequences, each its own number of new tokens on its own past (fresh
prompts, a prompt's next chunk, decode steps), packed one after another, nothing padded. Each slot owns a fixed range
of blocks, so a row joins and leaves without moving anyone's cache. Why and what it measured: docs/backends.md.
"""

from __future__ import annotations

import functools
from dataclasses import replace

import numpy as np
import openvino as ov
import openvino.opset13 as ops

from ..choices import Precision, ProviderKind
from ..errors import ArtifactError, ProviderError
from ..onnx import names as io
from ..onnx.artifact import BF16, ExportInfo
from .base import BF16_BITS, PAGED_PRECISIONS, Capabilities
from .kvbuffers import small_page_arrays
from .kvdtype import KvDtypeChoice
from .kvdtype import asked as asked_kv_dtype
from .openvino_prefill import compute_precision, read_prefill_graph, refuse_bf16_without_cpu, tensor_of
from .prefill import takes_past
from .providers import physical_cores, x86_flags
from .static_decode import SlotBackend

# The paged graph's inputs beside input_ids and position_ids (OpenVINO's names), and the one added here: which of the
# packed tokens' logits come out (the unembedding runs on those alone).
PAST_LENS, BEGINS, BLOCKS, BLOCK_BEGINS, MAX_CONTEXT = (
    "past_lens", "subsequence_begins", "block_indices", "block_indices_begins", "max_context_len")
SAMPLED = "sampled_indices"
QUANTIZED_KV = "u8"  # OpenVINO's quantized KV cache (KV_CACHE_PRECISION), its CPU plugin's default
# A joiner's chunk in a decode step's forward by default, in tokens: a packed forward takes a chunk at the cost of its
# tokens alone. 545-token prompts joining 1.5 a second (bf16, the 2-core Xeon with AMX, benchmarks/engine_joins.py): first
# token p50 290 ms and ITL p99 2.16x its median at 64, against 509 ms and 1.69x at the ort slots' 24 and a token per
# row, and 223 ms and 3.06x at 128 (docs/results/serving.md).
PAGED_MIXED_CHUNK = 64
# The same on a CPU without AMX's bf16 tiles, where a chunk's token costs the step about 0.5 ms (AVX-512 BF16: 16 rows
# 20.6 ms, with 64 tokens on a 512-token past 55.6, scratch): on the 2-core AMD EPYC, ITL p99 4.25x its median at 64,
# 2.15x at 40 (first token 499 against 491 ms), 1.38x at 32 (524 ms), 1.35x at 24 (941 ms).
PAGED_NARROW_MIXED_CHUNK = 40
# An fp32 export's, on any CPU (f32 compute uses no bf16 tiles): 545-token prompts joining 0.5 a second on the 2-core AMD
# EPYC, ITL p99 4.18x its median at 40, 2.57x at 24 (first token p50 662 and 680 ms; the ort slots' default 2.85x, 607 ms).
PAGED_FP32_MIXED_CHUNK = 24
AMX_BF16_FLAGS = ("amx_bf16",)


@functools.cache
def paged_mixed_chunk(precision: Precision = Precision.bf16) -> int:
    """PAGED_FP32_MIXED_CHUNK for an fp32 export; for bf16 PAGED_MIXED_CHUNK on a CPU with AMX's bf16 tiles (or another
    architecture), else PAGED_NARROW_MIXED_CHUNK: chosen by the precision and the CPU's flags, never by a timing."""
    if precision is Precision.fp32:
        return PAGED_FP32_MIXED_CHUNK
    flags = x86_flags()
    return PAGED_MIXED_CHUNK if flags is None or any(f in flags for f in AMX_BF16_FLAGS) else PAGED_NARROW_MIXED_CHUNK


@functools.cache
def has_paged_attention() -> bool:
    """Whether this OpenVINO rewrites a graph for its paged attention (its offline transformations' entry)."""
    try:
        from openvino._offline_transformations import paged_attention_transformation  # noqa: F401
    except ImportError:
        return False
    return True


def paged_refusal(info: ExportInfo, provider: ProviderKind) -> str | None:
    """Why the paged slots cannot serve the export, or None."""
    if provider is not ProviderKind.cpu:
        return f"OpenVINO's paged attention runs on the CPU here, not {provider.value}"
    if info.precision not in PAGED_PRECISIONS:
        return f"the paged slots run {' and '.join(p.value for p in PAGED_PRECISIONS)} exports, not {info.precision.value}"
    if info.prefill is None:
        return f"{info.folder} has no OpenVINO prefill graph (an export made with the openvino extra installed has one)"
    if not takes_past(info):
        return f"{info.folder}'s OpenVINO prefill graph takes no past (an earlier gpt2x made it): export it again"
    if not has_paged_attention():
        return f"OpenVINO {ov.__version__} has no paged attention transformation"
    return None


def paged_by_default(info: ExportInfo, provider: ProviderKind) -> bool:
    """Whether `gpt2x serve --backend openvino` with --kv-cache auto serves the export on the paged slots rather than
    the openvino backend's own cache: wherever they run it (paged_refusal)."""
    return paged_refusal(info, provider) is None


def paged_over_ort(info: ExportInfo, provider: ProviderKind) -> bool:
    """Whether a server with no --backend and --kv-cache auto serves the export on the paged slots rather than the ort
    backend's: a bf16 or fp32 export on the CPU whose prefill graph takes a past (bf16 decode steps of 16 rows 14
    against 16.3 ms; fp32 16 prompts faster than on the ort backend's slots in a third of the memory: docs/backends.md),
    but an fp32 export that keeps an int8 KV cache (--int8-kv) where the paged slots hold none for it: there the ort
    backend's slots hold its int8 cache (where they do, OpenVINO's u8 cache: 16 prompts 1.04x the ort slots' int8, in
    43% of the memory)."""
    if info.precision is Precision.fp32 and info.int8_kv is not None and info.int8_kv.get("use") \
            and info.paged_int8_kv is None:
        return False
    return paged_by_default(info, provider)


def paged_kv_precision(info: ExportInfo, choice: KvDtypeChoice | str | None = None) -> str | None:
    """The paged slots' cache for the export, as --kv-cache-dtype (`choice`, else GPT2X_KV_CACHE_DTYPE's) asks:
    QUANTIZED_KV where the export's u8 cache passed its gate (ExportInfo.paged_int8_kv) and auto or int8 is asked,
    else None (the compute precision's). int8 where it did not: one ProviderError line."""
    choice = asked_kv_dtype(choice)
    if choice is KvDtypeChoice.float:
        return None
    if info.paged_int8_kv is not None and (choice is KvDtypeChoice.int8 or (info.int8_kv or {}).get("use")):
        return QUANTIZED_KV
    if choice is KvDtypeChoice.int8:
        raise ProviderError(f"{info.folder}: OpenVINO's paged slots cannot hold an int8 KV cache: only an fp32 export "
                            "made with --int8-kv and --openvino-prefill holds one, where its own gate passed (its "
                            "gpt2x.json's kv_cache.paged says)")
    return None


def _attention_as_sdpa(model: ov.Model) -> None:
    """The attention the converter left as two MatMuls (the last layer's, whose query is its last position alone)
    made one ScaledDotProductAttention, the only form the paged rewrite replaces. Its query comes scaled."""
    for softmax in [n for n in model.get_ordered_ops() if n.get_type_name() == "Softmax"]:
        add = softmax.input_value(0).get_node()
        if add.get_type_name() != "Add":
            continue
        scores, mask = add.input_values()
        if scores.get_node().get_type_name() != "MatMul":
            scores, mask = mask, scores
        weighted = [t.get_node() for t in softmax.output(0).get_target_inputs()]
        if scores.get_node().get_type_name() != "MatMul" or len(weighted) != 1 or weighted[0].get_type_name() != "MatMul":
            continue
        q, keys = scores.get_node().input_values()
        values = weighted[0].input_value(1)
        attention = ops.scaled_dot_product_attention(q, keys, values, mask, ops.constant(np.float32(1.0)))
        weighted[0].output(0).replace(attention.output(0))
    model.validate_nodes_and_infer_types()


def paged_model(model: ov.Model, n_layer: int, n_head: int, head_dim: int) -> ov.Model:
    """The prefill graph (inputs ids, mask, positions and every layer's past; outputs the last position's logits and
    the new positions' presents) as OpenVINO's paged graph: its pasts made state, the form the paged rewrite reads
    (read with a batch gather, as an optimum-intel export's), then rewritten; and the unembedding run on the packed
    tokens that SAMPLED names. Inputs: input_ids and position_ids [tokens], the paged inputs, key_cache.i and
    value_cache.i; output the logits [len(SAMPLED), 1, vocab]."""
    from openvino._offline_transformations import apply_make_stateful_transformation, paged_attention_transformation

    model = model.clone()
    _attention_as_sdpa(model)
    pasts = io.input_names(n_layer)[3:]
    beam = ops.parameter([-1], ov.Type.i32, name="beam_idx")
    for param in model.get_parameters():
        if param.output(0).get_names() & set(pasts):
            readers = list(param.output(0).get_target_inputs())
            gathered = ops.gather(param, beam, ops.constant(np.int64(0)))
            for reader in readers:
                reader.replace_source_output(gathered.output(0))
    model.add_parameters([beam])
    model.validate_nodes_and_infer_types()
    apply_make_stateful_transformation(model, dict(zip(pasts, io.output_names(n_layer)[1:])))
    ids = model.input(io.INPUT_IDS)
    batch = ops.gather(ops.shape_of(ids, output_type="i64"), ops.constant(np.array([0], np.int64)),
                       ops.constant(np.int64(0)))
    empty = ops.concat([batch, ops.constant(np.array([n_head, 0, head_dim], np.int64))], 0)
    for op in model.get_ops():
        if op.get_type_name() == "ReadValue":  # an empty past to start from
            op.set_arguments([ops.broadcast(ops.constant(np.float32(0)).output(0), empty)])
    model.validate_nodes_and_infer_types()
    paged_attention_transformation(model)
    unembed = model.output(io.LOGITS).get_node().input_value(0).get_node()
    while unembed.get_type_name() != "MatMul":
        unembed = unembed.input_value(0).get_node()
    sampled = ops.parameter([-1], ov.Type.i64, name=SAMPLED)
    sampled.output(0).get_tensor().set_names({SAMPLED})
    unembed.input(0).replace_source_output(ops.gather(unembed.input_value(0), sampled, ops.constant(np.int64(0))).output(0))
    model.add_parameters([sampled])
    model.validate_nodes_and_infer_types()
    if sum(op.get_type_name() == "PagedAttentionExtension" for op in model.get_ops()) != n_layer:
        raise RuntimeError("its paged rewrite did not take every layer's attention")
    return model


# OpenVINO's u8 cache block (its CPU plugin's layout, read from the blocks it writes: tests/runtime/test_openvino_paged.py
# checks it): a key block (H, U8_SCALE_BYTES + block, D) is quantized per channel over the block's positions, its
# float32 scales then zero points in the first rows; a value block (H, block, U8_SCALE_BYTES + D) per position over
# the channels, each position's scale and zero point first. A value is (code - zero point) * scale.
U8_SCALE_BYTES = 8  # a float32 scale and a float32 zero point per channel (key) or position (value)
# The key's quantization, asked for (the CPU plugin's own choice on the AMD EPYC), not left to the plugin on each CPU
U8_KEY_MODE, U8_KEY_BY = "KEY_CACHE_QUANT_MODE", "BY_CHANNEL"


def _quantized(x: np.ndarray, axis: int, keep: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """`x`'s u8 codes, scales and zero points along `axis`, asymmetric over its range there (`keep`: the entries that
    count towards the range; the others' codes are 0)."""
    lo = np.min(x if keep is None else np.where(keep, x, np.inf), axis=axis, keepdims=True)
    hi = np.max(x if keep is None else np.where(keep, x, -np.inf), axis=axis, keepdims=True)
    scale = (hi - lo) / 255
    scale = np.where(scale > 0, scale, 1.0).astype(np.float32)
    zero = (-lo / scale).astype(np.float32)
    codes = np.clip(np.rint(x / scale + zero), 0, 255)
    return (codes if keep is None else np.where(keep, codes, 0)).astype(np.uint8), scale, zero


def u8_blocks(values: np.ndarray, last: int, key: bool) -> np.ndarray:
    """Float blocks (count, H, block, D), `last` positions of the last one filled, in OpenVINO's u8 layout."""
    count, heads, block, dim = values.shape
    if key:
        keep = np.arange(block)[None, None, :, None] < np.where(np.arange(count) == count - 1, last, block)[:, None, None, None]
        codes, scale, zero = _quantized(values, 2, keep)  # scales (count, H, 1, D)
        head = np.concatenate([scale, zero], axis=2).view(np.uint8).reshape(count, heads, U8_SCALE_BYTES, dim)
        return np.concatenate([head, codes], axis=2)
    codes, scale, zero = _quantized(values, 3)  # scales (count, H, block, 1)
    return np.concatenate([np.concatenate([scale, zero], axis=3).view(np.uint8), codes], axis=3)


def u8_values(blocks: np.ndarray, key: bool) -> np.ndarray:
    """OpenVINO's u8 blocks (..., H, rows, columns) as float32 values (..., H, block, D)."""
    if key:
        head = np.ascontiguousarray(blocks[..., :U8_SCALE_BYTES, :])
        scales = head.reshape(*head.shape[:-2], -1).view(np.float32).reshape(*head.shape[:-2], 2, 1, head.shape[-1])
        return (blocks[..., U8_SCALE_BYTES:, :] - scales[..., 1, :, :]) * scales[..., 0, :, :]
    scales = np.ascontiguousarray(blocks[..., :U8_SCALE_BYTES]).view(np.float32)  # (..., block, 2)
    return (blocks[..., U8_SCALE_BYTES:] - scales[..., 1:]) * scales[..., :1]


class PagedDecoder:
    """`slots` sequences of at most `capacity` positions in OpenVINO's paged caches, slot s in blocks
    [s * per_slot, (s + 1) * per_slot): SlotDecoder's interface, each call one forward of packed sequences. The caches
    are in the backend's compute precision (bf16's bits at bf16, float32 at f32), in small pages, resident only as
    rows write them; with `kv_cache_precision` "u8", OpenVINO's quantized cache instead (its own scales in each block:
    the key's per channel, the value's per position: U8_SCALE_BYTES), OpenVINO GenAI's default on a CPU, whose
    positions are read and written from outside as float32 (u8_values, u8_blocks)."""

    def __init__(self, info: ExportInfo, slots: int = 16, capacity: int | None = None, threads: int | None = None,
                 kv_cache_precision: str | None = None):
        cfg = info.config
        self.slots, self.capacity = slots, capacity or cfg.n_positions
        if slots < 1 or not 1 < self.capacity <= cfg.n_positions:
            raise ValueError(f"slots must be >= 1 and capacity 2..{cfg.n_positions}, not {slots} and {self.capacity}")
        refuse_bf16_without_cpu(info)
        why = paged_refusal(info, ProviderKind.cpu)
        if why:
            raise ProviderError(why)
        self.device, self.kv_scales, self.vocab_size = "cpu", None, cfg.vocab_size
        precision = compute_precision(info)
        if kv_cache_precision not in (None, QUANTIZED_KV):
            raise ValueError(f"kv_cache_precision: {QUANTIZED_KV} or None (the compute precision's), not {kv_cache_precision!r}")
        self.quantized_kv = kv_cache_precision == QUANTIZED_KV
        # what its positions are read and written as (a u8 cache's dequantized), and what its blocks hold
        self.dtype = np.float32 if self.quantized_kv else BF16_BITS if precision == BF16 else np.float32
        self.storage = np.uint8 if self.quantized_kv else self.dtype
        graph = read_prefill_graph(info)
        config = {"INFERENCE_NUM_THREADS": threads or physical_cores(), "INFERENCE_PRECISION_HINT": precision,
                  "KV_CACHE_PRECISION": kv_cache_precision or precision, "PERFORMANCE_HINT": "LATENCY",
                  "ENABLE_CPU_PINNING": False, **({U8_KEY_MODE: U8_KEY_BY} if self.quantized_kv else {})}
        try:
            paged = paged_model(graph, cfg.n_layer, cfg.n_head, cfg.head_dim)
        except RuntimeError as e:  # OpenVINO's passes raise RuntimeError for a graph they do not take
            raise ArtifactError(f"OpenVINO {ov.__version__} cannot run {info.prefill_path} with paged attention "
                                f"({str(e).strip().splitlines()[-1]}): serve it with --kv-cache in-place") from None
        try:
            self.compiled = ov.Core().compile_model(paged, "CPU", config)
        except RuntimeError:
            if U8_KEY_MODE not in config:
                raise
            # an OpenVINO without the property: the plugin's own layout, which the check below reads or refuses
            del config[U8_KEY_MODE]
            self.compiled = ov.Core().compile_model(paged, "CPU", config)
        self.request = self.compiled.create_infer_request()
        ports = [f"{kind}.{i}" for i in range(cfg.n_layer) for kind in ("key_cache", "value_cache")]
        # (blocks, H, block, D) per layer, key then value, as the ports name them; a u8 key's block has its per-channel
        # scales as rows above its positions, a u8 value's its per-position scales as columns beside them
        shapes = {name: [d.get_length() for d in list(self.compiled.input(name).get_partial_shape())[1:]] for name in ports}
        self.block = shapes["value_cache.0"][1]
        if self.quantized_kv:  # the layout u8_values and u8_blocks read and write, or one line
            key, value = shapes["key_cache.0"], shapes["value_cache.0"]
            if key[1:] != [self.block + U8_SCALE_BYTES, cfg.head_dim] or value[2] != cfg.head_dim + U8_SCALE_BYTES:
                raise ProviderError(f"OpenVINO {ov.__version__} lays its u8 KV cache out as {key} and {value} per block, "
                                    "not as gpt2x reads it: serve this export with --kv-cache-dtype float")
        self.per_slot = -(-self.capacity // self.block)
        self._table = np.arange(slots * self.per_slot, dtype=np.int32).reshape(slots, self.per_slot)  # slot -> its blocks
        self._arrays = [small_page_arrays((slots * self.per_slot, *shapes[name]), 1, self.storage)[0] for name in ports]
        for name, a in zip(ports, self._arrays):
            self.request.set_tensor(name, tensor_of(a))
        self.lengths = np.zeros(slots, np.int64)  # positions each slot holds (0: free)
        self.mixed_runs = 0  # step_mixed's forwards

    # -- SlotDecoder's interface: what SlotBackend calls

    prompts_on_prefill_graph = False  # fresh prompts run together in prefill_fresh

    def warm_up(self) -> None:
        """One forward of two tokens in the last slot, then freed: OpenVINO lays its weights out at a graph's first
        inference (a request's first token would wait for it)."""
        slot = self.slots - 1
        self.prefill(slot, np.zeros(2, np.int64))
        self.release(slot)

    def _check_slot(self, slot: int) -> None:
        if not 0 <= slot < self.slots:
            raise ValueError(f"slot {slot} is not one of 0..{self.slots - 1}")

    def _forward(self, rows: list[tuple[int, np.ndarray]], every: bool = False) -> np.ndarray:
        """Each (slot, ids) appended to what its slot holds, all in one forward: the last position's logits of each
        [len(rows), vocab], or with `every` each position's of each, one after another [tokens, vocab]."""
        slots = np.array([slot for slot, _ in rows], np.int64)
        ids = [np.asarray(i, np.int64).reshape(-1) for _, i in rows]
        if ((slots < 0) | (slots >= self.slots)).any():
            raise ValueError(f"slots {slots.tolist()} are not all among 0..{self.slots - 1}")
        past, new = self.lengths[slots], np.array([len(i) for i in ids], np.int64)
        full = (new < 1) | (past + new > self.capacity)
        if full.any():
            b = int(np.flatnonzero(full)[0])
            raise ValueError(f"slot {slots[b]} holds {past[b]} positions of {self.capacity}: {new[b]} more do not fit")
        begins = np.concatenate([[0], np.cumsum(new)])
        held = -(-(past + new) // self.block)  # blocks each row's positions take after the forward
        feeds = {io.INPUT_IDS: np.concatenate(ids),
                 io.POSITION_IDS: np.arange(begins[-1], dtype=np.int64) + np.repeat(past - begins[:-1], new),
                 PAST_LENS: past.astype(np.int32), BEGINS: begins.astype(np.int32),
                 BLOCKS: self._table[slots][np.arange(self.per_slot) < held[:, None]],
                 BLOCK_BEGINS: np.concatenate([[0], np.cumsum(held)]).astype(np.int32),
                 MAX_CONTEXT: np.array(int((past + new).max()), np.int32),
                 SAMPLED: np.arange(begins[-1], dtype=np.int64) if every else begins[1:] - 1}
        for name, value in feeds.items():
            self.request.set_tensor(name, ov.Tensor(value, list(value.shape)))
        # fresh memory each forward, as the caller may keep what a step gave
        logits = np.empty((len(feeds[SAMPLED]), 1, self.vocab_size), np.float32)
        self.request.set_tensor(io.LOGITS, ov.Tensor(logits, shared_memory=True))
        self.request.infer()
        self.lengths[slots] = past + new
        return logits[:, 0]

    def prefill(self, slot: int, ids: np.ndarray, every: bool = False) -> np.ndarray:
        """Append `ids` [T] to what `slot` holds; the last position's logits [vocab], or with `every` each position's
        [T, vocab]."""
        logits = self._forward([(slot, np.asarray(ids, np.int64).reshape(-1))], every)
        return logits if every else logits[0]

    def prefill_fresh(self, slots: np.ndarray, ids: np.ndarray, mask: np.ndarray) -> np.ndarray:
        """Fresh prompts `ids` [B, T], left-padded as `mask` says, into the free `slots` [B]: their last logits
        [B, vocab] (the padding is not run)."""
        slots = np.asarray(slots, dtype=np.int64)
        if len(set(slots.tolist())) != len(slots) or self.lengths[slots].any():
            raise ValueError(f"slots {slots.tolist()} are not all distinct and free")
        keep = np.asarray(mask, bool)
        return self._forward([(int(s), np.asarray(row)[k]) for s, row, k in zip(slots, ids, keep)])

    def prefill_held(self, slots: np.ndarray, rows: list[np.ndarray]) -> np.ndarray:
        """Each slot's next tokens `rows[b]` after what it holds: their last logits [B, vocab]."""
        if len(set(np.asarray(slots).tolist())) != len(rows):
            raise ValueError("each row's tokens go into a slot of its own")
        return self._forward([(int(s), np.asarray(r, np.int64)) for s, r in zip(slots, rows)])

    def step(self, tokens: np.ndarray, active: np.ndarray | None = None, take: np.ndarray | None = None) -> np.ndarray:
        """Append each held slot's token of `tokens` [slots] (only `active` ones where given): the logits [slots,
        vocab] (a slot not stepped: zeros), or with `take` only those slots' [len(take), vocab]."""
        held = self.lengths > 0
        if active is not None:
            held &= np.asarray(active, dtype=bool)
        if not held.any():
            raise ValueError("no slot holds a sequence: prefill one first")
        stepped = np.flatnonzero(held)
        tokens = np.asarray(tokens, np.int64).reshape(self.slots)
        logits = self._forward([(int(s), tokens[s: s + 1]) for s in stepped])
        return self._placed(stepped, logits, take)

    def _placed(self, stepped: np.ndarray, logits: np.ndarray, take: np.ndarray | None) -> np.ndarray:
        if take is not None:
            take = np.asarray(take)
            return logits if np.array_equal(take, stepped) else logits[np.searchsorted(stepped, take)]
        out = np.zeros((self.slots, self.vocab_size), np.float32)
        out[stepped] = logits
        return out

    def mixes(self, active: np.ndarray, slot: int, ids: np.ndarray) -> bool:
        """Whether step_mixed runs these: decode rows, and a chunk into a slot that is not one of them with room."""
        active = np.asarray(active, dtype=bool)
        return bool(active.any()) and not active[slot] and 0 < len(ids) and self.lengths[slot] + len(ids) <= self.capacity

    mixes_several = True  # step_mixed_several: every joiner's chunk in one decode step's forward

    def step_mixed(self, tokens: np.ndarray, active: np.ndarray, slot: int, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """`step(tokens, active)` and `prefill(slot, ids)` in one forward: the decode logits [slots, vocab] and the
        chunk's last position's [vocab]."""
        out, ran = self.step_mixed_several(tokens, active, [(slot, ids)])
        return out, ran[slot]

    def step_mixed_several(self, tokens: np.ndarray, active: np.ndarray,
                           chunks: list[tuple[int, np.ndarray]]) -> tuple[np.ndarray, dict[int, np.ndarray]]:
        """`step(tokens, active)` and `prefill(slot, ids)` for each (slot, ids) of `chunks` (distinct slots) in one
        forward: the decode logits [slots, vocab] and each chunk's last position's [vocab], by slot."""
        for slot, ids in chunks:
            if not self.mixes(active, slot, ids):
                raise ValueError(f"a chunk of {len(ids)} into slot {slot} does not mix with this step (PagedDecoder.mixes)")
        if len({slot for slot, _ in chunks}) != len(chunks):
            raise ValueError("each chunk goes into a slot of its own")
        stepped = np.flatnonzero(np.asarray(active, bool) & (self.lengths > 0))
        tokens = np.asarray(tokens, np.int64).reshape(self.slots)
        logits = self._forward([(int(s), tokens[s: s + 1]) for s in stepped] +
                               [(slot, np.asarray(ids, np.int64)) for slot, ids in chunks])
        self.mixed_runs += 1
        ran = {slot: logits[len(stepped) + i] for i, (slot, _) in enumerate(chunks)}
        return self._placed(stepped, logits[: len(stepped)], None), ran

    def release(self, slot: int) -> None:
        """Free `slot`: its next prefill starts a new sequence there (nothing is cleared or moved)."""
        self._check_slot(slot)
        self.lengths[slot] = 0

    def _blocks(self, slot: int, n: int) -> slice:
        return slice(slot * self.per_slot, slot * self.per_slot + -(-n // self.block))

    def copy(self, source: int, target: int) -> None:
        """`target` holds what `source` holds (two rows of one prompt)."""
        n = int(self.lengths[source])
        for a in self._arrays:
            a[self._blocks(target, n)] = a[self._blocks(source, n)]
        self.lengths[target] = n

    def write(self, slot: int, kv: list[np.ndarray]) -> None:
        """`slot` holds `kv` (2 * n_layer arrays (H, n, D), key then value per layer, in the slots' dtype: a past made
        elsewhere, such as the prefix cache's blocks) at its positions 0 .. n - 1; a u8 cache's quantized as OpenVINO
        quantizes its own (u8_blocks)."""
        self._check_slot(slot)
        n = kv[0].shape[1]
        if not 0 < n < self.capacity:
            raise ValueError(f"slot {slot} holds at most {self.capacity - 1} positions of a past, not {n}")
        blocks = self._blocks(slot, n)
        count = blocks.stop - blocks.start
        for i, (a, values) in enumerate(zip(self._arrays, kv)):
            padded = np.zeros((values.shape[0], count * self.block, values.shape[2]), self.dtype)
            padded[:, :n] = values
            padded = padded.reshape(values.shape[0], count, self.block, -1).transpose(1, 0, 2, 3)  # (count, H, block, D)
            a[blocks] = u8_blocks(padded, n - (count - 1) * self.block, key=i % 2 == 0) if self.quantized_kv else padded
        self.lengths[slot] = n

    def read(self, slot: int) -> list[np.ndarray]:
        """What `slot` holds: 2 * n_layer arrays (H, length, D) in the slots' dtype, copies."""
        return [a[0].copy() for a in self.views(slot, 1, int(self.lengths[slot]))]

    def views(self, first: int, rows: int, length: int) -> list[np.ndarray]:
        """Positions 0 .. length - 1 of slots [first, first + rows): 2 * n_layer arrays (rows, H, length, D), copies
        where they span several blocks or a u8 cache's dequantized (u8_values), else views of one block each (read
        them before those positions are written again)."""
        count = -(-length // self.block)
        out = []
        for i, a in enumerate(self._arrays):
            blocks = a.reshape(self.slots, self.per_slot, *a.shape[1:])[first: first + rows, :count]  # (rows, count, H, block, D)
            if self.quantized_kv:  # (rows, count, H, block, D) float32, new arrays
                blocks = u8_values(blocks, key=i % 2 == 0)
            out.append(blocks.transpose(0, 2, 1, 3, 4).reshape(rows, a.shape[1], count * self.block, -1)[:, :, :length])
        return out

    def close(self) -> None:
        self.request = self.compiled = None
        self._arrays = []


class PagedSlotBackend(SlotBackend):
    """The fixed slots on OpenVINO's paged attention (PagedDecoder): SlotBackend's protocol, every forward one of
    packed sequences, a joining prompt's chunk in the decode step's own forward, several rows' tokens on their pasts
    in one."""

    name = "openvino"
    capabilities = Capabilities(runtime="OpenVINO, paged attention",
                                precisions_by_provider={ProviderKind.cpu: PAGED_PRECISIONS}, takes_past=True,
                                joins_rows=True, frees_rows=True, rolls_back=True, mixes_chunks=True,
                                mixed_chunk=paged_mixed_chunk(), warms_up=True, stores_kv_dtype=True)

    def __init__(self, info: ExportInfo, provider: ProviderKind = ProviderKind.cpu, threads: int | None = None,
                 slots: int = 16, capacity: int | None = None, kv_cache_precision: str | None = None):
        why = paged_refusal(info, provider)
        if why:
            raise ProviderError(why)
        self._hold(PagedDecoder(info, slots, capacity, threads, kv_cache_precision), info, provider)
        quantized = self.decoder.quantized_kv  # read and written as float32 (the prefix cache's blocks): u8_values
        self.capabilities = replace(self.capabilities, mixed_chunk=paged_mixed_chunk(info.precision),
                                    holds_int8_kv=quantized, kv_cache_dtype="uint8" if quantized else None)

    def warm_up(self) -> None:
        self.decoder.warm_up()

    def prefill_ms(self, rows: int, new_tokens: int, past_tokens: int = 0) -> float | None:
        return None

