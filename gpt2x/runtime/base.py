"""The Backend protocol: what generation, evaluation and the bench ask of a runtime, and all they ask.

A backend runs forward steps on int64 numpy arrays and keeps its KV cache in whatever form suits it
(torch tensors on the model's device, OrtValues on the provider's device, a shared in-place buffer);
the cache is opaque to callers except through `reorder`, `merge`, `past_from_numpy` and
`present_to_numpy`. Position ids come from the attention mask (gpt2x.numerics.positions) for every
backend.

`merge_on_host` is `merge` for any backend, through host arrays (a copy of the whole cache): the
backends whose cache is not in fixed-capacity buffers use it; those whose cache is (kvbuffers.py)
move only the rows that move, inside their buffers.
"""

from __future__ import annotations

from typing import Any, Protocol

import numpy as np

from ..choices import ProviderKind
from .kvbuffers import write_right_aligned


class Backend(Protocol):
    name: str  # "torch" or "ort": the runtime (BackendKind's values)
    provider: ProviderKind  # where it runs
    n_positions: int  # the model's context length
    vocab_size: int  # columns of the logits
    model_name: str  # the model it runs, as the user named it (an export records it)
    # Whether past_from_numpy can hand it a cache made elsewhere; a backend that owns its cache (such
    # as onnxruntime-genai's generator) is compared on whole sequences instead.
    accepts_past: bool
    # Whether `truncate` can drop a cache's last positions (speculative decoding's rollback).
    rolls_back: bool

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

    def merge(self, past: Any, rows: np.ndarray, joiner: Any | None, width: int) -> Any:
        """Rows leaving and joining a batch (serving): the cache whose row i is row `rows[i]` of `past`'s
        rows and `joiner`'s (another cache of this backend, or None) stacked, joiner's numbered after
        past's, every row right-aligned to `width` positions: zeros (to be masked out) before a
        shorter row, and positions further than `width` from the end dropped (the caller drops only
        positions masked out in every row it keeps). `past` must not be used afterwards (a backend
        may reuse its buffers); `joiner` may be."""
        ...

    def truncate(self, past: Any, length: int) -> Any:
        """The cache holding only its first `length` positions (speculative decoding drops the positions
        of rejected draft tokens), copying no more than the backend's cache layout needs: the in-place
        buffers only set their length back. `past` must not be used afterwards."""
        ...

    def past_from_numpy(self, arrays: list[np.ndarray]) -> Any:
        """A cache from 2 * n_layer arrays (B, H, P, D), key then value per layer."""
        ...

    def present_to_numpy(self, present: Any) -> list[np.ndarray]:
        """The cache as 2 * n_layer float32 arrays (B, H, P, D), key then value per layer."""
        ...

    def peak_device_memory_mb(self) -> float | None:
        """Peak accelerator memory the backend allocated, where it can tell (None otherwise)."""
        ...


# A backend may also have `step_greedy(input_ids, attention_mask, position_ids, past) -> (tokens (B,)
# int64, cache)`: `step`'s argmax (NumPy's: the first of equal maxima) taken where the logits are, so
# that greedy decoding moves one token per row instead of the logits (the web backend: from the page).
# The decode loop uses it for greedy sampling (greedy_step).


def greedy_step(backend: Backend):
    """The backend's step_greedy, or a step followed by NumPy's argmax. Only a step_greedy of the
    backend's own class counts: a wrapper that changes `step` and hands other attributes on to the
    backend it wraps (__getattr__) must not have its `step` bypassed."""
    if getattr(type(backend), "step_greedy", None) is not None:
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
