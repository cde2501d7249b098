"""The Backend and KVCache protocols and the Capabilities record: all that generation, evaluation, the
bench and the serving engine ask of a runtime. Callers read `capabilities`, never the backend's name, and
never look inside a cache (docs/architecture.md).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np

from ..choices import Precision, ProviderKind
from ..errors import ProviderError, UsageError
from .kvbuffers import write_right_aligned

# The precisions an export runs in on the CPU: fp16's kernels are the GPU's; bf16 is computed by the backends that
# declare it (ONNX Runtime's CPU provider has no bf16 MatMul on x86: docs/backends.md).
CPU_PRECISIONS = (Precision.fp32, Precision.int8, Precision.int4)
BF16_BITS = np.uint16  # a bf16 array on the host: its bits (NumPy has no bf16)
# The openvino backend's paged slots (runtime.openvino_paged): the prefill graphs whose weights it computes as gated
# (fp32 at f32, bf16 at bf16).
PAGED_PRECISIONS = (Precision.fp32, Precision.bf16)


def bf16_bits(a: np.ndarray) -> np.ndarray:
    """float32 values rounded to bf16 (to the nearest, ties to even), as their bits."""
    bits = np.ascontiguousarray(a, dtype=np.float32).view(np.uint32)
    return ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(BF16_BITS)


def bf16_values(a: np.ndarray) -> np.ndarray:
    """bf16 bits as the float32 values they are (a bf16 is a float32's upper half)."""
    return (a.astype(np.uint32) << 16).view(np.float32)


def kv_dtype_name(dtype) -> str:
    """A KV cache's dtype by name: NumPy's, bfloat16 for bf16's bits."""
    return "bfloat16" if np.dtype(dtype) == BF16_BITS else np.dtype(dtype).name
CUDA_PRECISIONS = (Precision.fp32, Precision.fp16, Precision.int8, Precision.int4)


def spoken(names: Iterable[str], last: str = "or") -> str:
    """Names as a message lists them: "a, b or c"."""
    names = list(names)
    return ", ".join(names[:-1]) + f" {last} " + names[-1] if len(names) > 1 else "".join(names)


@dataclass(frozen=True)
class Capabilities:
    """What a backend is, and what it and its caches can do beyond `run`, `step`, `close`, `reorder` and
    `to_numpy`: each capability comes with its method(s), which a backend has exactly when it declares it."""

    # -- identity: read before one is opened (registry.capabilities_of) and by every refusal message.
    runtime: str = ""  # the runtime's name, as messages give it
    precisions_by_provider: Mapping[ProviderKind, tuple[Precision, ...]] = field(
        default_factory=lambda: {ProviderKind.cpu: (Precision.fp32,)})
    # PyTorch on the model: what every export is measured against; it opens no export.
    reference: bool = False
    # ONNX Runtime: what the exports are made for, the others' speed is compared with, the reference's drafts run on.
    native: bool = False

    # -- what it can do
    # `Backend.past_from_numpy`: takes a cache made elsewhere. One that owns its cache (genai) is compared
    # on whole sequences.
    takes_past: bool = False
    joins_rows: bool = False  # `KVCache.merge`: continuous batching; else static batches
    # `KVCache.merge` moves no row's cache (fixed slots): a finished row leaves the batch at its next step, where
    # otherwise finished rows ride along, masked, until half the batch has finished (a merge copies the cache).
    frees_rows: bool = False
    rolls_back: bool = False  # `KVCache.truncate`: speculative decoding's rollback
    # `step_greedy`: the argmax taken where the logits are (device, page); one token per row comes back.
    argmax_where_logits_are: bool = False
    # `fixed_refusal()` and `fixed_decoder(rows, sampling)`: a runtime.static_decode.StaticDecoder on the backend's
    # export (one fixed-capacity cache, the step's token chosen in the graph, the step a CUDA graph on CUDA), where
    # fixed_refusal says None.
    decodes_fixed: bool = False
    # `page_ms`, `page_info`, `page_memory_mb()`, `reset_page_memory()`: forwards run in a browser page,
    # which times them and measures its own memory.
    page: bool = False
    # The most rows one batch of the runtime takes where it is fastest (None: any); the bench measures no more.
    max_batch: int | None = None
    # `prefill_ms(rows, new_tokens, past_tokens)`: a prefill's estimated time (None where the backend cannot tell),
    # for a caller choosing between prefills that compute more or fewer tokens on different runtimes.
    estimates_prefill: bool = False
    # Several rows' tokens on a past each run a forward of their own where no estimate says otherwise (the fixed slots:
    # ONNX Runtime's GroupQueryAttention takes several tokens on a past for one row at a time).
    past_rows_apart: bool = False
    # `warm_up()`: opens now what its first steps of each kind would open (graphs, sessions), for a server, whose first
    # requests would otherwise wait for it.
    warms_up: bool = False
    # `step_later(input_ids, attention_mask, position_ids, past) -> past`: a prefill chunk the backend may run in the
    # forward of its next decode step (one forward for both, docs/serving/index.md); `later_logits(past)`: its last
    # position's logits (B, V), once run (run now where it is still held).
    mixes_chunks: bool = False
    # Where chunks mix: a joiners' chunk by default, in tokens (the paged slots' 64); where None, `mixed_chunk_base` and
    # one more per row running (ONNX Runtime's slots': providers.cpu_mixed_chunk_base; None: providers.MIXED_PREFILL_CHUNK).
    mixed_chunk: int | None = None
    mixed_chunk_base: int | None = None
    # Its caches store `kv_dtype` (ONNX Runtime's, in place, growing or in slots: int8 where it chose the int8 cache;
    # OpenVINO's: bf16's bits at bf16), as `KVCache.stored` gives it; the others' give float32. (The prefix cache's
    # blocks and /health say which.)
    stores_kv_dtype: bool = False
    # Where its cache holds another dtype than `kv_dtype`, which it is read and written as: that dtype's name (OpenVINO's
    # u8 cache on the paged slots, its positions float32). /health says it; the prefix cache's blocks are kept apart.
    kv_cache_dtype: str | None = None
    # An int8 KV cache with the export's gated scales, as runtime.kvdtype chooses it (--kv-cache-dtype, the native
    # backend's option); the others keep their cache in the export's float dtype and refuse --kv-cache-dtype int8.
    holds_int8_kv: bool = False

    @property
    def providers(self) -> tuple[ProviderKind, ...]:
        return tuple(self.precisions_by_provider)

    def runs(self, precision: Precision, provider: ProviderKind | None = None) -> bool:
        """Whether it runs `precision` on `provider` (on any of its providers when None)."""
        where = self.providers if provider is None else (provider,)
        return any(precision in self.precisions_by_provider.get(p, ()) for p in where)

    def describe_runs(self) -> str:
        """What it runs where, for a message: "fp32 on cpu; fp32 or fp16 on cuda"."""
        return "; ".join(f"{spoken(x.value for x in ps)} on {p.value}" for p, ps in self.precisions_by_provider.items())

    def refuse_export(self, name: str, folder: object, precision: Precision, provider: ProviderKind) -> UsageError | None:
        """Why the `name` backend cannot run the `precision` export in `folder` on `provider` (its class's own check, for
        an export opened past registry.unsupported's: an --onnx folder of another precision), or None when it can."""
        if self.runs(precision, provider):
            return None
        return UsageError(f"{folder} is a {precision.value} export, which the {name} backend does not run on "
                          f"{provider.value} (it runs {self.describe_runs()})")

    def refuse_provider(self, name: str, provider: ProviderKind) -> ProviderError | None:
        """Why the `name` backend cannot run on `provider`, or None when it can."""
        if provider in self.providers:
            return None
        return ProviderError(f"{self.runtime} has no {provider.value.upper()} device here: the {name} backend has no "
                             f"{provider.value} provider (it runs on {spoken(p.value for p in self.providers)})")


# Each backend class's record (its `capabilities`), here so that runtime.registry reads them without importing the classes.
TORCH_CAPABILITIES = Capabilities(runtime="PyTorch", reference=True,
                                  precisions_by_provider={ProviderKind.cpu: (Precision.fp32,),
                                                          ProviderKind.cuda: (Precision.fp32, Precision.fp16)},
                                  takes_past=True, joins_rows=True, rolls_back=True)
ORT_CAPABILITIES = Capabilities(runtime="ONNX Runtime", native=True,
                                precisions_by_provider={ProviderKind.cpu: CPU_PRECISIONS, ProviderKind.cuda: CUDA_PRECISIONS},
                                takes_past=True, joins_rows=True, rolls_back=True, argmax_where_logits_are=True,
                                decodes_fixed=True, estimates_prefill=True, warms_up=True, stores_kv_dtype=True,
                                holds_int8_kv=True)
OPENVINO_CAPABILITIES = Capabilities(runtime="OpenVINO", precisions_by_provider={ProviderKind.cpu: (*CPU_PRECISIONS, Precision.bf16)},
                                     takes_past=True, joins_rows=True, rolls_back=True, stores_kv_dtype=True)
# onnxruntime-genai 0.18's generators refuse a batch_size above 32 ("must be in [1, 32]", on the CPU and CUDA alike):
# a larger batch runs as one single-row generator per row, as a padded one does.
GENAI_MAX_BATCH = 32
GENAI_CAPABILITIES = Capabilities(runtime="onnxruntime-genai", max_batch=GENAI_MAX_BATCH,
                                  precisions_by_provider={ProviderKind.cpu: CPU_PRECISIONS, ProviderKind.cuda: CUDA_PRECISIONS})
WEB_CAPABILITIES = Capabilities(runtime="onnxruntime-web's WebAssembly build", precisions_by_provider={ProviderKind.cpu: CPU_PRECISIONS},
                                takes_past=True, joins_rows=True, rolls_back=True, argmax_where_logits_are=True, page=True)


class Closable:
    """`close()` (idempotent; overridden by a backend with something to release) and the context manager."""

    def close(self) -> None:
        """Release what the backend holds. Idempotent."""

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class Released:
    """A closed backend's stand-in for its session: any use is one clear error, so steps need no check."""

    def __init__(self, backend: str):
        self._backend = backend

    def __getattr__(self, name: str):
        raise ProviderError(f"this {self._backend} backend is closed")


class KVCache(Protocol):
    """A backend's KV cache, in its own form. Every operation returns the cache to use next; the one it was
    called on may be stale afterwards (an in-place form refuses a stale one), except where a method says so."""

    rows: int  # batch rows
    length: int  # positions held (the attention mask's width)

    def reorder(self, rows: np.ndarray) -> KVCache:
        """The cache with its batch rows gathered by `rows` (beam search); this one stays usable, except
        onnxruntime-genai's, whose generator holds one state: a cache used twice is a ValueError."""
        ...

    def to_numpy(self) -> list[np.ndarray]:
        """The cache as 2 * n_layer float32 arrays (B, H, P, D), key then value per layer: copies, or views of the
        cache's own memory where it holds float32 on the host, so read them before its next step and never write them."""
        ...

    def stored(self) -> list[np.ndarray]:
        """As to_numpy, in the dtype the cache stores (int8 for the ort backend's int8 cache, else to_numpy's), which
        Backend.past_from_numpy takes back as it is: what a copy kept for later (the prefix cache) holds."""
        ...

    # -- with capabilities.rolls_back

    def truncate(self, length: int) -> KVCache:
        """The cache holding only its first `length` positions (rejected draft tokens dropped)."""
        ...

    # -- with capabilities.joins_rows

    def merge(self, rows: np.ndarray, joiner: KVCache | None, width: int) -> KVCache:
        """Rows leaving and joining a batch: row i is row `rows[i]` of this cache's rows and `joiner`'s
        stacked (joiner's numbered after), right-aligned to `width` positions: zeros before a shorter row,
        older positions dropped (the caller drops only ones masked in every row). `joiner` stays usable."""
        ...


class Backend(Protocol):
    name: str  # the runtime (BackendKind's values), for reports; never to decide what it can do
    provider: ProviderKind  # where it runs
    n_positions: int  # the model's context length
    vocab_size: int  # columns of the logits
    model_name: str  # the model it runs, as the user named it (an export records it)
    capabilities: Capabilities  # what else it can do (above)
    cache_forms: tuple[type, ...]  # the KVCache classes its steps return

    def run(self, input_ids: np.ndarray, attention_mask: np.ndarray, position_ids: np.ndarray,
            past: KVCache | None) -> tuple[np.ndarray, KVCache]:
        """input_ids (B, T), attention_mask (B, P+T), position_ids (B, T), past (None at first)
        -> all logits (B, T, V) float32 on the host, and the new cache (P+T positions)."""
        ...

    def step(self, input_ids: np.ndarray, attention_mask: np.ndarray, position_ids: np.ndarray,
             past: KVCache | None) -> tuple[np.ndarray, KVCache]:
        """As run, but only the last position's logits (B, V)."""
        ...

    def close(self) -> None: ...

    def peak_device_memory_mb(self) -> float | None:
        """Peak accelerator memory the backend allocated, where it can tell (None otherwise)."""
        ...

    # -- with capabilities.takes_past

    def past_from_numpy(self, arrays: list[np.ndarray]) -> KVCache:
        """A cache from 2 * n_layer arrays (B, H, P, D), key then value per layer."""
        ...


# With capabilities.argmax_where_logits_are: `step_greedy(input_ids, attention_mask, position_ids, past)
# -> (tokens (B,) int64, cache)`, `step`'s argmax (NumPy's: the first of equal maxima) where the logits are.


def greedy_step(backend: Backend):
    """The backend's step_greedy where it declares one, else a step and NumPy's argmax. Only its class's
    step_greedy counts: a wrapper that changes `step` and forwards the rest (__getattr__) keeps its `step`."""
    if backend.capabilities.argmax_where_logits_are and getattr(type(backend), "step_greedy", None) is not None:
        return backend.step_greedy

    def step(input_ids, attention_mask, position_ids, past):
        logits, present = backend.step(input_ids, attention_mask, position_ids, past)
        return logits.argmax(axis=-1).astype(np.int64), present

    return step


# A backend may also declare `past_buffers(batch, length, dtype) -> (arrays, finish) | None`: 2 * n_layer writable
# arrays (batch, H, length, D) inside the buffers its next cache will hold, and `finish()`, that cache once they are
# written; None where its cache does not store `dtype` in buffers of its own.


def kv_cache_name(backend: Backend) -> str | None:
    """The dtype a backend's cache holds, by name (Capabilities.kv_cache_dtype where it is another than its kv_dtype,
    else kv_dtype_name's), where it says (Capabilities.stores_kv_dtype); else None."""
    caps = backend.capabilities
    return (caps.kv_cache_dtype or kv_dtype_name(backend.kv_dtype)) if caps.stores_kv_dtype else None


def past_to_fill(backend: Backend, shape: tuple[int, int, int, int], count: int,
                 dtype) -> tuple[list[np.ndarray], Callable[[], KVCache]]:
    """`count` arrays of `shape` (B, H, P, D) to write a past into, and what makes them a cache once written: the
    backend's own buffers where it offers them (past_buffers: nothing copied again), else new arrays that
    past_from_numpy takes. Their contents are unset: the caller writes every position."""
    offer = getattr(type(backend), "past_buffers", None)
    given = offer(backend, shape[0], shape[2], dtype) if offer is not None else None
    if given is not None:
        return given
    arrays = [np.empty(shape, dtype=dtype) for _ in range(count)]
    return arrays, lambda: backend.past_from_numpy(arrays)


def right_aligned_rows(parts: list[list[np.ndarray]], rows: np.ndarray, width: int) -> list[np.ndarray]:
    """`merge` on host arrays: per cache tensor, the parts (B_k, H, P_k, D) stacked and right-aligned to
    `width`, rows `rows` of that stack as new arrays (len(rows), H, width, D)."""
    rows = np.asarray(rows, dtype=np.int64)
    out = []
    for arrays in zip(*parts):
        first = arrays[0]
        merged = np.zeros((len(rows), first.shape[1], width, first.shape[3]), dtype=first.dtype)
        write_right_aligned(merged, np.arange(len(rows)), rows, list(arrays), width)
        out.append(merged)
    return out


def merge_on_host(cache: KVCache, rows: np.ndarray, joiner: KVCache | None, width: int,
                  from_numpy: Callable[[list[np.ndarray]], KVCache]) -> KVCache:
    """`KVCache.merge` for forms not in fixed-capacity buffers: copied out, merged, copied back (`from_numpy`)."""
    parts = [cache.to_numpy()] + ([] if joiner is None else [joiner.to_numpy()])
    return from_numpy(right_aligned_rows(parts, rows, width))
