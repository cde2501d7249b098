"""Fixed-capacity KV buffers on the host (ONNX Runtime's in-place cache, OpenVINO's) and `BufferCache`, the
cache over them. A cache is the first `rows` rows and `length` positions; a step binds `a[:rows]` (contiguous:
no copy), so rows can join without new buffers. Every write starts a new generation, and stepping or merging
from an older view is refused: it would overwrite what the newer view holds.
"""

from __future__ import annotations

import mmap
import sys
import threading
from collections.abc import Callable
from typing import Any

import numpy as np

KV_CAPACITY_STEP = 256  # positions a cache holds beyond its first step, and grows by at least
# Idle KV memory a backend keeps for its next buffers (IdleBuffers): one GPT-2 124M row of 768 positions is 57 MB.
IDLE_KEEP_BYTES = 512 << 20
# Rows a merge that outgrows its buffers makes the new ones with, at least (and the whole context, for a form whose
# kernels read only the positions held): positions not yet written are address space, not memory (their pages are
# faulted in when first written), so a serving batch filling up to 16 rows moves every row once, not at 2, 4 and 8
# rows and again when its width outgrows the buffers (a move of 4 rows of 575 positions took 80-130 ms of a decode
# step's gap, of 11 rows of 800 positions 364 ms, 512-token prompts joining; an in-place decode step of 8 rows takes
# as long in buffers of 640 or 1024 positions).
MERGE_MIN_ROWS = 16


class KVBuffers:
    """The arrays, the rows and positions the cache holds, and their generation (new at every write)."""

    def __init__(self, arrays: list[np.ndarray], length: int = 0, rows: int | None = None):
        self.arrays = arrays
        self.generation = 0
        self.retired = False  # the cache moved to other buffers (retire)
        self._length = length
        self._rows = arrays[0].shape[0] if rows is None else rows

    def retire(self) -> None:
        """The cache has moved to other buffers: every view of these is stale from now on."""
        self.retired = True
        self.generation += 1

    @property
    def length(self) -> int:
        """Positions written."""
        return self._length

    @length.setter
    def length(self, value: int) -> None:
        self._length = value
        self.generation += 1

    @property
    def rows(self) -> int:
        """Rows in use: the first `rows` of the batch dimension."""
        return self._rows

    @rows.setter
    def rows(self, value: int) -> None:
        changed = value != self._rows
        self._rows = value
        self.generation += 1
        if changed:
            self.rows_changed()

    def rows_changed(self) -> None:
        """Called when the rows in use change: subclasses that hold views of them make them again."""

    @property
    def capacity(self) -> int:
        return self.arrays[0].shape[2]

    @property
    def batch(self) -> int:
        """Rows the buffers can hold."""
        return self.arrays[0].shape[0]


class KVCacheView:
    """Rows [0, rows) and positions [0, length) of KV buffers, as they were when the view was made."""

    def __init__(self, buffers: KVBuffers, length: int):
        self.buffers = buffers
        self.length = length
        self.rows = buffers.rows
        self.generation = buffers.generation

    @property
    def capacity(self) -> int:
        return self.buffers.capacity

    @property
    def arrays(self) -> list[np.ndarray]:
        return self.buffers.arrays

    @property
    def stale(self) -> bool:
        return self.buffers.generation != self.generation

    def filled(self) -> list[np.ndarray]:
        """Views (no copy) of the rows and positions the cache holds, (rows, H, length, D) each."""
        return [a[: self.rows, :, : self.length] for a in self.buffers.arrays]


# allocate(batch, capacity, keep) -> KVBuffers holding `keep`'s filled rows and positions when given. Whether the
# rest is zeroed is the allocator's: its cache form knows what its kernels read.
Allocate = Callable[[int, int, "KVCacheView | None"], KVBuffers]


def holding(arrays: list[np.ndarray], keep: KVCacheView | None) -> list[np.ndarray]:
    """`arrays` (new buffers, larger than `keep`'s) with `keep`'s filled rows and positions copied in, if given."""
    if keep is not None:
        for new, old in zip(arrays, keep.filled()):
            new[: old.shape[0], :, : keep.length] = old
    return arrays


def zeroed_arrays(shape: tuple[int, ...], count: int, dtype, keep: KVCacheView | None = None) -> list[np.ndarray]:
    """`count` zeroed arrays of `shape`, holding `keep`'s filled rows and positions if given."""
    return holding([np.zeros(shape, dtype=dtype) for _ in range(count)], keep)


class IdleBuffers:
    """The memory of a backend's KV buffers, kept once nothing references it, for its next buffers of about that size:
    a fresh buffer's first writes fault its pages in one by one, a reused one's do not (a 512-token first token of
    GPT-2 124M 1-4% sooner here: git show 3e30193:benchmarks/idle_buffers.py). Only for buffers that may be left unset (what they held before
    is not cleared). A block is idle when this pool holds its only reference: every array, view and OrtValue made
    from it holds one (through NumPy's `base`), so memory still seen anywhere is never handed out again. At most
    `keep_bytes` of idle blocks are kept, the most recently adopted."""

    def __init__(self, keep_bytes: int = IDLE_KEEP_BYTES):
        self.keep_bytes = keep_bytes
        self.reused = 0  # arrays handed out again (read by the tests)
        self._blocks: list[np.ndarray] = []  # oldest first
        self._lock = threading.Lock()

    def take(self, shape: tuple[int, ...], count: int, dtype) -> list[np.ndarray] | None:
        """`count` arrays of `shape` over idle blocks of at least their size and at most twice it, or None."""
        need = int(np.prod(shape)) * np.dtype(dtype).itemsize
        with self._lock:
            fits = sorted((self._blocks[i].nbytes, i) for i in self._idle() if need <= self._blocks[i].nbytes <= 2 * need)
            if need == 0 or len(fits) < count:
                return None
            self.reused += count
            return [self._blocks[i].reshape(-1).view(np.uint8)[:need].view(dtype).reshape(shape) for _, i in fits[:count]]

    def adopt(self, arrays: list[np.ndarray]) -> list[np.ndarray]:
        """`arrays` (fresh, C-contiguous), their memory kept for reuse once they and their views are gone."""
        with self._lock:
            for a in arrays:
                block = a.base if isinstance(a.base, np.ndarray) else a  # views of `a` reference its base array
                if block.flags.c_contiguous and not any(b is block for b in self._blocks):
                    self._blocks.append(block)
            idle = self._idle()
            kept = sum(self._blocks[i].nbytes for i in idle)
            for i in idle:  # oldest first
                if kept <= self.keep_bytes:
                    break
                kept -= self._blocks[i].nbytes
                self._blocks[i] = None  # type: ignore[call-overload]
            self._blocks = [b for b in self._blocks if b is not None]
        return arrays

    def _idle(self) -> list[int]:
        # The list's reference and getrefcount's argument: nothing else holds the block.
        return [i for i in range(len(self._blocks)) if sys.getrefcount(self._blocks[i]) == 2]


def small_page_arrays(shape: tuple[int, ...], count: int, dtype, held: int = 0) -> list[np.ndarray]:
    """`count` zeroed arrays in anonymous memory with small pages only (MADV_NOHUGEPAGE where available).
    A KV buffer's first writes are spread over its whole size, so under huge pages a fresh buffer costs a
    full zeroing: a serving merge 352 ms against 31 ms (docs/results/other.md, kv-buffers-in-small-pages).
    `held`: the first rows (of the first axis) are in huge pages where the kernel gives them (MADV_HUGEPAGE), and
    written now, so that no later write waits on them: rows every step reads, whose attention walks one row at a time
    through many heads' positions (a 16-row int8 decode step on 1024-position fixed slots 11.9 against 13.1 ms in
    small pages, the 2-core Xeon, scratch)."""
    size = int(np.prod(shape)) * np.dtype(dtype).itemsize
    held_bytes = size // shape[0] * held if size else 0
    out = []
    for _ in range(count):
        if size == 0 or not hasattr(mmap, "MADV_NOHUGEPAGE"):
            out.append(np.zeros(shape, dtype=dtype))
            continue
        m = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        m.madvise(mmap.MADV_NOHUGEPAGE)
        if held_bytes:
            try:
                m.madvise(mmap.MADV_HUGEPAGE, 0, held_bytes)
            except OSError:  # a kernel without transparent huge pages: advice only
                pass
        a = np.frombuffer(m, dtype=dtype).reshape(shape)  # the array holds the mapping
        a[:held].fill(0)
        out.append(a)
    return out


def rows_to_keep(batch: int, keep: KVCacheView | None) -> tuple[int, int | None]:
    """The batch dimension of the buffers a growing cache moves to, and the rows it then holds (None: all)."""
    return (batch, None) if keep is None else (max(batch, keep.buffers.batch), keep.rows)


def buffers_holding(arrays: list[np.ndarray], capacity: int, allocate: Allocate) -> KVBuffers:
    """New buffers of `capacity` positions holding `arrays` (B, H, P, D) as their first P positions."""
    batch, length = arrays[0].shape[0], arrays[0].shape[2]
    buffers = allocate(batch, capacity, None)
    for buf, a in zip(buffers.arrays, arrays):
        buf[:, :, :length] = a
    buffers.length = length
    return buffers


def refuse_stale(cache: KVCacheView | None) -> None:
    if cache is not None and cache.stale:
        raise ValueError("this KV cache was already stepped from (or merged, or grown into new buffers); "
                         "use the cache the last step or merge returned")


def truncated(cache: KVCacheView, length: int) -> KVBuffers:
    """The buffers' length set back to `length` (nothing copied: the next step overwrites the rest)."""
    refuse_stale(cache)
    if not 0 <= length <= cache.length:
        raise ValueError(f"cannot keep {length} positions of a cache holding {cache.length}")
    cache.buffers.length = length
    return cache.buffers


def grown_capacity(capacity: int, needed: int, n_positions: int, capacity_step: int) -> int:
    """Doubled, by at least `capacity_step`, never past the context (unless `needed` is)."""
    return max(needed, min(n_positions, capacity + max(capacity_step, capacity)))


def buffers_for_step(cache: KVCacheView | None, batch: int, seq: int, n_positions: int, capacity_step: int,
                     allocate: Allocate, first_room: int | None = None) -> KVBuffers:
    """The buffers a step of `seq` new positions writes into: new ones for the first step (`first_room`
    spare positions), larger ones holding the cache when it would overflow, else the cache's."""
    length = 0 if cache is None else cache.length
    if length + seq > n_positions:
        raise ValueError(f"{length} + {seq} positions exceed the model's context ({n_positions})")
    if cache is None:
        return allocate(batch, min(n_positions, seq + (capacity_step if first_room is None else first_room)), None)
    if length + seq > cache.capacity:
        buffers = allocate(batch, grown_capacity(cache.capacity, length + seq, n_positions, capacity_step), cache)
        cache.buffers.retire()
        return buffers
    return cache.buffers


def write_right_aligned(out: np.ndarray, where: np.ndarray, rows: np.ndarray, parts: list[np.ndarray], width: int) -> None:
    """out[where[j]] = row rows[where[j]] of `parts` stacked, right-aligned to `width`. Source rows are
    gathered (a copy) before anything is written, so `out` may be one of the parts' buffers."""
    start = 0
    for part in parts:
        mine = where[(rows[where] >= start) & (rows[where] < start + part.shape[0])]
        if len(mine):
            keep = min(width, part.shape[2])
            out[mine, :, width - keep : width] = part[rows[mine] - start, :, part.shape[2] - keep :]
            if keep < width:
                out[mine, :, : width - keep] = 0
        start += part.shape[0]


def merge_rows(cache: KVCacheView, rows: np.ndarray, joiner: list[np.ndarray] | None, width: int,
               allocate: Allocate, n_positions: int, capacity_step: int = KV_CAPACITY_STEP,
               whole_context: bool = False) -> KVBuffers:
    """`KVCache.merge` inside fixed-capacity buffers. In the cache's own buffers when they fit, writing only
    the rows that move (rows or width change); else in larger ones (twice the rows and MERGE_MIN_ROWS at least;
    the whole context where `whole_context`, a form whose kernels read only the positions held, else doubled capacity)."""
    refuse_stale(cache)
    rows = np.asarray(rows, dtype=np.int64)
    n, length, buffers = cache.rows, cache.length, cache.buffers
    joined = 0 if joiner is None else joiner[0].shape[0]
    if rows.ndim != 1 or not len(rows) or rows.min() < 0 or rows.max() >= n + joined:
        raise ValueError(f"rows must pick among the {n} cached and {joined} joining rows, got {rows.tolist()}")
    if not 0 < width <= n_positions:
        raise ValueError(f"a width of {width} positions is outside the model's context ({n_positions})")
    if len(rows) > buffers.batch or width > buffers.capacity:
        batch = max(len(rows), 2 * buffers.batch, MERGE_MIN_ROWS) if len(rows) > buffers.batch else buffers.batch
        capacity = n_positions if whole_context else buffers.capacity if width < buffers.capacity else \
            grown_capacity(buffers.capacity, min(width + 1, n_positions), n_positions, capacity_step)
        target = allocate(batch, capacity, None)
        moving = np.ones(len(rows), dtype=bool)
    else:
        target = buffers
        moving = (rows != np.arange(len(rows))) | (rows >= n) | (width != length)
    dst = np.flatnonzero(moving)
    for i, out in enumerate(target.arrays):
        parts = [buffers.arrays[i][:n, :, :length]] + ([] if joiner is None else [joiner[i]])
        write_right_aligned(out, dst, rows, parts, width)
    if target is not buffers:
        buffers.retire()
    target.rows = len(rows)
    target.length = width
    return target


class BufferCache(KVCacheView):
    """A KV cache (base.KVCache) in fixed-capacity buffers. A form subclasses it with `allocate` and its step;
    `owner` is the backend."""

    capacity_step = KV_CAPACITY_STEP
    # Whether a merge that moves the cache makes its new buffers as long as the context (its kernels read only the
    # positions held) rather than doubled
    merges_to_context = False

    def __init__(self, buffers: KVBuffers, length: int, owner: Any):
        super().__init__(buffers, length)
        self.owner = owner

    @classmethod
    def allocate(cls, owner: Any, batch: int, capacity: int, keep: KVCacheView | None) -> KVBuffers:
        """An Allocate."""
        raise NotImplementedError

    @classmethod
    def to_fill(cls, owner: Any, batch: int, length: int) -> tuple[list[np.ndarray], Callable[[], BufferCache]]:
        """New buffers' first `length` positions, (batch, H, length, D) each, to write a past into, and the cache
        holding them once written: from_numpy without its copy (Backend.past_buffers)."""
        capacity = min(owner.n_positions, length + cls.capacity_step)
        buffers = cls.allocate(owner, batch, capacity, None)

        def finish() -> BufferCache:
            buffers.length = length
            return cls(buffers, length, owner)

        return [a[:, :, :length] for a in buffers.arrays], finish

    @classmethod
    def from_numpy(cls, owner: Any, arrays: list[np.ndarray]):
        """A cache holding `arrays` (B, H, P, D), with room to grow (Backend.past_from_numpy)."""
        capacity = min(owner.n_positions, arrays[0].shape[2] + cls.capacity_step)
        buffers = buffers_holding(arrays, capacity, lambda b, c, k: cls.allocate(owner, b, c, k))
        return cls(buffers, buffers.length, owner)

    def buffers_for_step(self, batch: int, seq: int) -> KVBuffers:
        """The buffers a step of `seq` new positions writes into; stale views refused."""
        refuse_stale(self)
        return buffers_for_step(self, batch, seq, self.owner.n_positions, self.capacity_step, self._allocate)

    def _allocate(self, batch: int, capacity: int, keep: KVCacheView | None) -> KVBuffers:
        return self.allocate(self.owner, batch, capacity, keep)

    def to_numpy(self) -> list[np.ndarray]:
        return [a.astype(np.float32, copy=False) for a in self.filled()]  # views of float32 buffers

    def stored(self) -> list[np.ndarray]:
        """Views of the filled positions, in the buffers' dtype."""
        return self.filled()

    def reorder(self, rows: np.ndarray):
        """New buffers with the rows gathered by `rows` (filled positions only)."""
        rows = np.asarray(rows, dtype=np.int64)
        return type(self)(buffers_holding([a[rows] for a in self.filled()], self.capacity, self._allocate),
                          self.length, self.owner)

    def truncate(self, length: int):
        return type(self)(truncated(self, length), length, self.owner)

    def merge(self, rows: np.ndarray, joiner: BufferCache | None, width: int):
        buffers = merge_rows(self, rows, None if joiner is None else joiner.filled(), width, self._allocate,
                             self.owner.n_positions, self.capacity_step, self.merges_to_context)
        return type(self)(buffers, buffers.length, self.owner)
