"""The PyTorch backend: gpt2x's own model as the reference the other backends are checked against."""

from __future__ import annotations

import numpy as np
import torch

from ..choices import ProviderKind
from ..model.gpt2 import GPT2, KVCache
from .base import Capabilities, Closable


class TorchBackend(Closable):
    """The PyTorch reference: our GPT2 module with its tensor KV cache kept on the model's device."""

    name = "torch"
    capabilities = Capabilities(takes_past=True, joins_rows=True, rolls_back=True)

    def __init__(self, model: GPT2, device: str = "cpu", model_name: str = "model"):
        self.model = model.to(device).eval()
        self.model_name = model_name
        self.device = torch.device(device)
        self.provider = ProviderKind.cuda if self.device.type == "cuda" else ProviderKind.cpu
        self.n_positions = model.config.n_positions
        self.vocab_size = model.config.vocab_size

    def _t(self, a: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(np.ascontiguousarray(a)).to(self.device)

    @torch.inference_mode()
    def run(self, input_ids, attention_mask, position_ids, past: KVCache | None):
        """All logits (B, T, V) as float32 numpy, and the new cache (tensors on the device)."""
        logits, present = self.model(self._t(input_ids), self._t(attention_mask), self._t(position_ids), past)
        return logits.float().cpu().numpy(), present

    @torch.inference_mode()
    def step(self, input_ids, attention_mask, position_ids, past: KVCache | None):
        logits, present = self.model(self._t(input_ids), self._t(attention_mask), self._t(position_ids), past,
                                     logits_to_keep=1)
        return logits[:, -1].float().cpu().numpy(), present

    def past_from_numpy(self, arrays: list[np.ndarray]) -> KVCache:
        dtype = self.model.wte.weight.dtype
        t = [torch.from_numpy(np.ascontiguousarray(a)).to(self.device, dtype) for a in arrays]
        return list(zip(t[0::2], t[1::2]))

    @staticmethod
    def present_to_numpy(present: KVCache) -> list[np.ndarray]:
        return [t.float().cpu().numpy() for kv in present for t in kv]

    def peak_device_memory_mb(self) -> float | None:
        """Peak CUDA memory PyTorch allocated (None on the CPU)."""
        return torch.cuda.max_memory_allocated(self.device) / 2**20 if self.device.type == "cuda" else None

    def truncate(self, past: KVCache, length: int) -> KVCache:
        """Backend.truncate: views of the first `length` positions (no copy; the next step concatenates)."""
        held = past[0][0].shape[2]
        if not 0 <= length <= held:
            raise ValueError(f"cannot keep {length} positions of a cache holding {held}")
        return [(k[:, :, :length], v[:, :, :length]) for k, v in past]

    def reorder(self, past: KVCache, rows: np.ndarray) -> KVCache:
        idx = self._t(rows)
        return [(k.index_select(0, idx), v.index_select(0, idx)) for k, v in past]

    @torch.inference_mode()
    def merge(self, past: KVCache, rows: np.ndarray, joiner: KVCache | None, width: int) -> KVCache:
        """Backend.merge with torch ops on the model's device: each cache right-aligned to `width`
        positions (zeros before, or its first positions dropped), stacked, and `rows` gathered."""
        def fit(t: torch.Tensor) -> torch.Tensor:
            P = t.shape[2]
            return t[:, :, P - width :] if P >= width else torch.nn.functional.pad(t, (0, 0, width - P, 0))

        idx = self._t(np.asarray(rows, dtype=np.int64))
        parts = [past] + ([] if joiner is None else [joiner])
        return [tuple(torch.cat([fit(p[layer][j]) for p in parts]).index_select(0, idx) for j in (0, 1))
                for layer in range(len(past))]
