"""The Backend protocol and the KVCache protocol: what generation, evaluation, the bench and the
serving engine ask of a runtime, and all they ask.

A backend runs forward steps on int64 numpy arrays. Its KV cache is an object of the backend's own
(`KVCache`): a growing list of device tensors, fixed-capacity buffers written in place, tensors held
in a web page, a generator's state. Callers never look inside it: they step from it (`Backend.step`
takes it as `past` and returns the next one) and ask it to `reorder` its rows (beam search),
`truncate` its positions (speculative decoding's rollback), `merge` rows leaving and joining (the
serving engine), or give its arrays (`to_numpy`). Position ids come from the attention mask
(gpt2x.numerics.positions) for every backend.

Every backend has `run`, `step`, `close` (and is a context manager) and the model's facts. What it
is (the providers and precisions it runs, whether it is the reference) and what else it and its
caches can do it declares in one record, `capabilities` (`Capabilities`), which every caller reads:
no caller asks which backend it holds to decide what the backend can do. A backend that lacks a
capability lacks its method too.

Where a new cache form goes: a class implementing KVCache beside its backend (runtime/<backend>.py),
listed in the backend's `cache_forms`; caches in fixed-capacity host buffers build on
kvbuffers.BufferCache, which already has the operations. `merge_on_host` is `merge` for any cache,
through host arrays (a copy of the whole cache): the forms whose cache is not in fixed-capacity
buffers use it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np

from ..choices import Precision, ProviderKind
from ..errors import ProviderError
from .kvbuffers import write_right_aligned

# The precisions an export runs in on the CPU: fp16's kernels are the GPU's.
CPU_PRECISIONS = (Precision.fp32, Precision.int8, Precision.int4)


def spoken(names: Iterable[str], last: str = "or") -> str:
    """Names as a message lists them: "a, b or c"."""
    names = list(names)
    return ", ".join(names[:-1]) + f" {last} " + names[-1] if len(names) > 1 else "".join(names)


@dataclass(frozen=True)
class Capabilities:
    """What a backend is and what it (and its caches) can do beyond `run`, `step`, `close` and the
    caches' `reorder` and `to_numpy`. Each capability comes with its method(s); a new capability is a
    field here, its method in the protocols below, and the callers that need it read the field."""

    # -- identity: asked before one is opened (runtime.registry.capabilities_of), and by every
    # message that says what a backend cannot do.
    # The runtime's own name, as messages give it.
    runtime: str = ""
    # The providers it runs on, each with the precisions it runs there.
    precisions_by_provider: Mapping[ProviderKind, tuple[Precision, ...]] = field(
        default_factory=lambda: {ProviderKind.cpu: (Precision.fp32,)})
    # It runs the model itself (PyTorch), which every export is measured against; it opens no export.
    reference: bool = False
    # ONNX Runtime on the export: the runtime the exports are made for, which the others' speed is
    # compared with and the reference's drafts run on.
    native: bool = False

    # -- what it can do
    # `Backend.past_from_numpy`: it can be handed a cache made elsewhere (parity's cases with a past).
    # A backend that owns its cache (onnxruntime-genai's generator) is compared on whole sequences.
    takes_past: bool = False
    # `KVCache.merge`: rows leave and join a running batch's cache (continuous batching); else static
    # batches.
    joins_rows: bool = False
    # `KVCache.truncate`: a cache's last positions dropped (speculative decoding's rollback).
    rolls_back: bool = False
    # `step_greedy`: a greedy step takes the argmax where the logits are (on the device, in the page),
    # so that one token per row comes back instead of the logits.
    argmax_where_logits_are: bool = False
    # `page_ms`, `page_info`, `page_memory_mb()`, `reset_page_memory()`: its forwards run outside this
    # process (a browser page), which times them and measures its own memory.
    page: bool = False

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

    def refuse_provider(self, name: str, provider: ProviderKind) -> ProviderError | None:
        """Why the `name` backend cannot run on `provider`, or None when it can."""
        if provider in self.providers:
            return None
        return ProviderError(f"{self.runtime} has no {provider.value.upper()} device here: the {name} backend has no "
                             f"{provider.value} provider (it runs on {spoken(p.value for p in self.providers)})")


class Closable:
    """`close()` and the context manager every backend has: `with open_backend(...) as b:`. A backend
    with something to release overrides `close` (idempotent)."""

    def close(self) -> None:
        """Release what the backend holds (sessions, a browser, a generator). Idempotent."""

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class Released:
    """What a closed backend holds in place of a session, a compiled model or a generator: any use of
    it is one clear error, and the steps that run it need no check of their own."""

    def __init__(self, backend: str):
        self._backend = backend

    def __getattr__(self, name: str):
        raise ProviderError(f"this {self._backend} backend is closed")


class KVCache(Protocol):
    """A backend's KV cache: `rows` batch rows of `length` positions, in the backend's own form. Every
    operation returns the cache to use next; the one it was called on may be stale afterwards (a form
    that writes in place refuses a stale one in one clear error), except where a method says so."""

    rows: int  # batch rows
    length: int  # positions held (the attention mask's width)

    def reorder(self, rows: np.ndarray) -> KVCache:
        """The cache with its batch rows gathered by `rows` (beam search); this one stays usable."""
        ...

    def to_numpy(self) -> list[np.ndarray]:
        """The cache as 2 * n_layer float32 arrays (B, H, P, D), key then value per layer (copies)."""
        ...

    # -- with capabilities.rolls_back

    def truncate(self, length: int) -> KVCache:
        """The cache holding only its first `length` positions (speculative decoding drops the positions
        of rejected draft tokens), copying no more than the form needs: fixed-capacity buffers only
        set their length back."""
        ...

    # -- with capabilities.joins_rows

    def merge(self, rows: np.ndarray, joiner: KVCache | None, width: int) -> KVCache:
        """Rows leaving and joining a batch (serving): the cache whose row i is row `rows[i]` of this
        cache's rows and `joiner`'s (another cache of the same backend, or None) stacked, joiner's
        numbered after this one's, every row right-aligned to `width` positions: zeros (to be masked
        out) before a shorter row, and positions further than `width` from the end dropped (the
        caller drops only positions masked out in every row it keeps). `joiner` stays usable."""
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

    def close(self) -> None:
        """Release what it holds; the backend is not used afterwards. Backends are context managers."""
        ...

    def peak_device_memory_mb(self) -> float | None:
        """Peak accelerator memory the backend allocated, where it can tell (None otherwise)."""
        ...

    # -- with capabilities.takes_past

    def past_from_numpy(self, arrays: list[np.ndarray]) -> KVCache:
        """A cache from 2 * n_layer arrays (B, H, P, D), key then value per layer."""
        ...


# With capabilities.argmax_where_logits_are, a backend has `step_greedy(input_ids, attention_mask,
# position_ids, past) -> (tokens (B,) int64, cache)`: `step`'s argmax (NumPy's: the first of equal
# maxima) taken where the logits are, so that greedy decoding moves one token per row instead of the
# logits (the web backend: from the page; ONNX Runtime on CUDA: on the device). The decode loop uses
# it for greedy sampling (greedy_step).


def greedy_step(backend: Backend):
    """The backend's step_greedy where it declares one, or a step followed by NumPy's argmax. Only a
    step_greedy of the backend's own class counts: a wrapper that changes `step` and hands other
    attributes (its capabilities too) on to the backend it wraps (__getattr__) must not have its
    `step` bypassed."""
    if backend.capabilities.argmax_where_logits_are and getattr(type(backend), "step_greedy", None) is not None:
        return backend.step_greedy

    def step(input_ids, attention_mask, position_ids, past):
        logits, present = backend.step(input_ids, attention_mask, position_ids, past)
        return logits.argmax(axis=-1).astype(np.int64), present

    return step


def right_aligned_rows(parts: list[list[np.ndarray]], rows: np.ndarray, width: int) -> list[np.ndarray]:
    """`merge` on host arrays: for each cache tensor, the parts' arrays (B_k, H, P_k, D) stacked along
    the batch, each right-aligned to `width` positions (zeros before, positions further from the end
    dropped), and rows `rows` of that stack, as new arrays (len(rows), H, width, D)."""
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
    """`KVCache.merge` through host arrays: both caches copied out (to_numpy), their rows gathered and
    right-aligned, and the result copied back (`from_numpy`, the backend's past_from_numpy)."""
    parts = [cache.to_numpy()] + ([] if joiner is None else [joiner.to_numpy()])
    return from_numpy(right_aligned_rows(parts, rows, width))
