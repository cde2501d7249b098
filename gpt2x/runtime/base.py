"""The Backend protocol: what generation, evaluation and the bench ask of a runtime, and all they ask.

A backend runs forward steps on int64 numpy arrays and keeps its KV cache in whatever form suits it
(torch tensors on the model's device, OrtValues on the provider's device, a shared in-place buffer);
the cache is opaque to callers except through `reorder`, `merge`, `past_from_numpy` and
`present_to_numpy`. Position ids come from the attention mask (gpt2x.numerics.positions) for every
backend.

Every backend has `run`, `step`, `reorder`, `present_to_numpy`, `close` (and is a context manager)
and the model's facts. What else it can do it declares in one record, `capabilities`
(`Capabilities`), which every caller reads: no caller asks which backend it holds to decide what the
backend can do. A backend that lacks a capability lacks its method too.

`merge_on_host` is `merge` for any backend, through host arrays (a copy of the whole cache): the
backends whose cache is not in fixed-capacity buffers use it; those whose cache is (kvbuffers.py)
move only the rows that move, inside their buffers.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from ..choices import ProviderKind
from ..errors import ProviderError
from .kvbuffers import write_right_aligned


@dataclass(frozen=True)
class Capabilities:
    """What a backend can do beyond `run`, `step`, `reorder`, `present_to_numpy` and `close`. Each
    capability comes with its method(s); a new capability is a field here, its method in the protocol
    below, and the callers that need it read the field."""

    # `past_from_numpy`: it can be handed a cache made elsewhere (parity's cases with a past). A
    # backend that owns its cache (onnxruntime-genai's generator) is compared on whole sequences.
    takes_past: bool = False
    # `merge`: rows leave and join a running batch's cache (continuous batching); else static batches.
    joins_rows: bool = False
    # `truncate`: a cache's last positions dropped (speculative decoding's rollback).
    rolls_back: bool = False
    # `step_greedy`: a greedy step takes the argmax where the logits are (on the device, in the page),
    # so that one token per row comes back instead of the logits.
    argmax_where_logits_are: bool = False
    # `page_ms`, `page_info`, `page_memory_mb()`, `reset_page_memory()`: its forwards run outside this
    # process (a browser page), which times them and measures its own memory.
    page: bool = False


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


class Backend(Protocol):
    name: str  # the runtime (BackendKind's values), for reports; never to decide what it can do
    provider: ProviderKind  # where it runs
    n_positions: int  # the model's context length
    vocab_size: int  # columns of the logits
    model_name: str  # the model it runs, as the user named it (an export records it)
    capabilities: Capabilities  # what else it can do (above)

    def run(self, input_ids: np.ndarray, attention_mask: np.ndarray, position_ids: np.ndarray,
            past: Any) -> tuple[np.ndarray, Any]:
        """input_ids (B, T), attention_mask (B, P+T), position_ids (B, T), past (None at first)
        -> all logits (B, T, V) float32 on the host, and the new cache (P+T positions)."""
        ...

    def step(self, input_ids: np.ndarray, attention_mask: np.ndarray, position_ids: np.ndarray,
             past: Any) -> tuple[np.ndarray, Any]:
        """As run, but only the last position's logits (B, V)."""
        ...

    def reorder(self, past: Any, rows: np.ndarray) -> Any:
        """The cache with its batch rows gathered by `rows` (beam search)."""
        ...

    def close(self) -> None:
        """Release what it holds; the backend is not used afterwards. Backends are context managers."""
        ...

    # -- with capabilities.joins_rows

    def merge(self, past: Any, rows: np.ndarray, joiner: Any | None, width: int) -> Any:
        """Rows leaving and joining a batch (serving): the cache whose row i is row `rows[i]` of `past`'s
        rows and `joiner`'s (another cache of this backend, or None) stacked, joiner's numbered after
        past's, every row right-aligned to `width` positions: zeros (to be masked out) before a
        shorter row, and positions further than `width` from the end dropped (the caller drops only
        positions masked out in every row it keeps). `past` must not be used afterwards (a backend
        may reuse its buffers); `joiner` may be."""
        ...

    # -- with capabilities.rolls_back

    def truncate(self, past: Any, length: int) -> Any:
        """The cache holding only its first `length` positions (speculative decoding drops the positions
        of rejected draft tokens), copying no more than the backend's cache layout needs: the in-place
        buffers only set their length back. `past` must not be used afterwards."""
        ...

    # -- with capabilities.takes_past

    def past_from_numpy(self, arrays: list[np.ndarray]) -> Any:
        """A cache from 2 * n_layer arrays (B, H, P, D), key then value per layer."""
        ...

    # -- every backend

    def present_to_numpy(self, present: Any) -> list[np.ndarray]:
        """The cache as 2 * n_layer float32 arrays (B, H, P, D), key then value per layer."""
        ...

    def peak_device_memory_mb(self) -> float | None:
        """Peak accelerator memory the backend allocated, where it can tell (None otherwise)."""
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


def merge_on_host(backend: Backend, past: Any, rows: np.ndarray, joiner: Any | None, width: int) -> Any:
    """`Backend.merge` through host arrays: both caches copied out (present_to_numpy), their rows
    gathered and right-aligned, and the result copied back (past_from_numpy)."""
    parts = [backend.present_to_numpy(past)] + ([] if joiner is None else [backend.present_to_numpy(joiner)])
    return backend.past_from_numpy(right_aligned_rows(parts, rows, width))
