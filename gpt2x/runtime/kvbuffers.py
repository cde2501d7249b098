"""Fixed-capacity KV buffers on the host, shared by the backends that keep their cache that way (ONNX
Runtime's in-place cache for GroupQueryAttention graphs, OpenVINO's cache): one (B, H, capacity, D)
array per layer and key/value, views of their filled positions, and the policy that grows them.

A step writes positions `length` onward into the buffers and returns a new view; the view it was
given is then stale, and stepping from it again is refused (it would overwrite positions the newer
view holds). When a step would overflow, the cache moves to larger buffers (doubling, by at least
`capacity_step`, never past the context) and every view of the old ones becomes stale."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

KV_CAPACITY_STEP = 256  # positions a cache holds beyond its first step, and grows by at least


class KVBuffers:
    """The arrays and how many positions of them are written (-1 once the cache moved to larger ones)."""

    def __init__(self, arrays: list[np.ndarray], length: int = 0):
        self.arrays = arrays
        self.length = length

    @property
    def capacity(self) -> int:
        return self.arrays[0].shape[2]

    @property
    def batch(self) -> int:
        return self.arrays[0].shape[0]


class KVCacheView:
    """A view of KV buffers holding positions [0, length)."""

    def __init__(self, buffers: KVBuffers, length: int):
        self.buffers = buffers
        self.length = length

    @property
    def capacity(self) -> int:
        return self.buffers.capacity

    @property
    def arrays(self) -> list[np.ndarray]:
        return self.buffers.arrays

    @property
    def stale(self) -> bool:
        return self.buffers.length != self.length

    def filled(self) -> list[np.ndarray]:
        return [a[:, :, : self.length] for a in self.buffers.arrays]


def zeroed_arrays(shape: tuple[int, ...], count: int, dtype, keep: KVCacheView | None = None) -> list[np.ndarray]:
    """`count` zeroed arrays of `shape`, holding `keep`'s filled positions if given."""
    arrays = [np.zeros(shape, dtype=dtype) for _ in range(count)]
    if keep is not None:
        for new, old in zip(arrays, keep.filled()):
            new[:, :, : keep.length] = old
    return arrays


def buffers_holding(arrays: list[np.ndarray], capacity: int, allocate: Callable[[int, int], KVBuffers]) -> KVBuffers:
    """Buffers of `capacity` positions from `allocate(batch, capacity)`, holding `arrays` (B, H, P, D)
    as their first P positions: a cache made elsewhere (past_from_numpy) or gathered rows (reorder),
    copied once, filled positions only."""
    batch, length = arrays[0].shape[0], arrays[0].shape[2]
    buffers = allocate(batch, capacity)
    for buf, a in zip(buffers.arrays, arrays):
        buf[:, :, :length] = a
    buffers.length = length
    return buffers


def refuse_stale(cache: KVCacheView | None) -> None:
    if cache is not None and cache.stale:
        raise ValueError("this KV cache was already stepped from (or grown into new buffers); "
                         "step from the cache the last step returned")


def buffers_for_step(cache: KVCacheView | None, seq: int, n_positions: int, capacity_step: int,
                     allocate: Callable[[int, KVCacheView | None], KVBuffers]) -> KVBuffers:
    """The buffers a step of `seq` new positions on `cache` writes into: new ones for the first step,
    larger ones (made by `allocate(capacity, keep)`) when the step would overflow, else the cache's."""
    length = 0 if cache is None else cache.length
    if length + seq > n_positions:
        raise ValueError(f"{length} + {seq} positions exceed the model's context ({n_positions})")
    if cache is None:
        return allocate(min(n_positions, seq + capacity_step), None)
    if length + seq > cache.capacity:
        grown = max(length + seq, min(n_positions, cache.capacity + max(capacity_step, cache.capacity)))
        buffers = allocate(grown, cache)
        cache.buffers.length = -1  # retired: every view of the old buffers is stale now
        return buffers
    return cache.buffers
