"""The Backend protocol: what generation, evaluation and the bench ask of a runtime, and all they ask.

A backend runs forward steps on int64 numpy arrays and keeps its KV cache in whatever form suits it
(torch tensors on the model's device, OrtValues on the provider's device, a shared in-place buffer);
the cache is opaque to callers except through `reorder`, `past_from_numpy` and `present_to_numpy`.
Position ids come from the attention mask (gpt2x.numerics.positions) for every backend.
"""

from __future__ import annotations

from typing import Any, Protocol

import numpy as np

from ..choices import ProviderKind


class Backend(Protocol):
    name: str  # "torch" or "ort": the runtime (BackendKind's values)
    provider: ProviderKind  # where it runs
    n_positions: int  # the model's context length
    vocab_size: int  # columns of the logits
    model_name: str  # the model it runs, as the user named it (an export records it)
    # Whether past_from_numpy can hand it a cache made elsewhere; a backend that owns its cache (such
    # as onnxruntime-genai's generator) is compared on whole sequences instead.
    accepts_past: bool

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

    def past_from_numpy(self, arrays: list[np.ndarray]) -> Any:
        """A cache from 2 * n_layer arrays (B, H, P, D), key then value per layer."""
        ...

    def present_to_numpy(self, present: Any) -> list[np.ndarray]:
        """The cache as 2 * n_layer float32 arrays (B, H, P, D), key then value per layer."""
        ...

    def peak_device_memory_mb(self) -> float | None:
        """Peak accelerator memory the backend allocated, where it can tell (None otherwise)."""
        ...
