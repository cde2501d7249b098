"""The PyTorch backend: gpt2x's own model as the reference the other backends are checked against."""

from __future__ import annotations

import numpy as np
import torch

from ..choices import ProviderKind
from ..model.gpt2 import GPT2, KVCache
from .base import TORCH_CAPABILITIES, Closable


class TorchCache:
    """The model's (key, value) tensors per layer on its device; never written in place (operations return new
    ones or views)."""

    __slots__ = ("owner", "layers")

    def __init__(self, owner: TorchBackend, layers: KVCache):
        self.owner = owner
        self.layers = layers

    @property
    def rows(self) -> int:
        return self.layers[0][0].shape[0]

    @property
    def length(self) -> int:
        return self.layers[0][0].shape[2]

    def to_numpy(self) -> list[np.ndarray]:
        return [t.float().cpu().numpy() for kv in self.layers for t in kv]

    stored = to_numpy

    def truncate(self, length: int) -> TorchCache:
        """Views of the first `length` positions (no copy; the next step concatenates)."""
        if not 0 <= length <= self.length:
            raise ValueError(f"cannot keep {length} positions of a cache holding {self.length}")
        return TorchCache(self.owner, [(k[:, :, :length], v[:, :, :length]) for k, v in self.layers])

    def reorder(self, rows: np.ndarray) -> TorchCache:
        idx = self.owner.tensor(rows)
        return TorchCache(self.owner, [(k.index_select(0, idx), v.index_select(0, idx)) for k, v in self.layers])

    @torch.inference_mode()
    def merge(self, rows: np.ndarray, joiner: TorchCache | None, width: int) -> TorchCache:
        """With torch ops on the model's device."""
        def fit(t: torch.Tensor) -> torch.Tensor:
            P = t.shape[2]
            return t[:, :, P - width :] if P >= width else torch.nn.functional.pad(t, (0, 0, width - P, 0))

        idx = self.owner.tensor(np.asarray(rows, dtype=np.int64))
        parts = [self.layers] + ([] if joiner is None else [joiner.layers])
        return TorchCache(self.owner, [tuple(torch.cat([fit(p[layer][j]) for p in parts]).index_select(0, idx) for j in (0, 1))
                                       for layer in range(len(self.layers))])


class TorchBackend(Closable):
    """The PyTorch reference: our GPT2 module with its tensor KV cache kept on the model's device."""

    name = "torch"
    # fp16 is a half-precision copy of the model, on CUDA only; int8 and int4 exist only as exports.
    capabilities = TORCH_CAPABILITIES
    cache_forms = (TorchCache,)

    def __init__(self, model: GPT2, device: str = "cpu", model_name: str = "model"):
        self.model = model.to(device).eval()
        self.model_name = model_name
        self.device = torch.device(device)
        self.provider = ProviderKind.cuda if self.device.type == "cuda" else ProviderKind.cpu
        self.n_positions = model.config.n_positions
        self.vocab_size = model.config.vocab_size

    def tensor(self, a: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(np.ascontiguousarray(a)).to(self.device)

    @torch.inference_mode()
    def run(self, input_ids, attention_mask, position_ids, past: TorchCache | None):
        logits, present = self.model(self.tensor(input_ids), self.tensor(attention_mask), self.tensor(position_ids),
                                      None if past is None else past.layers)
        return logits.float().cpu().numpy(), TorchCache(self, present)

    @torch.inference_mode()
    def step(self, input_ids, attention_mask, position_ids, past: TorchCache | None):
        logits, present = self.model(self.tensor(input_ids), self.tensor(attention_mask), self.tensor(position_ids),
                                      None if past is None else past.layers, logits_to_keep=1)
        return logits[:, -1].float().cpu().numpy(), TorchCache(self, present)

    def past_from_numpy(self, arrays: list[np.ndarray]) -> TorchCache:
        dtype = self.model.wte.weight.dtype
        t = [torch.from_numpy(np.ascontiguousarray(a)).to(self.device, dtype) for a in arrays]
        return TorchCache(self, list(zip(t[0::2], t[1::2])))

    def peak_device_memory_mb(self) -> float | None:
        """Peak CUDA memory PyTorch allocated (None on the CPU)."""
        return torch.cuda.max_memory_allocated(self.device) / 2**20 if self.device.type == "cuda" else None
