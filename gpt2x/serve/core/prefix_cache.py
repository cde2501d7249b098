"""Automatic prefix caching: the KV of prompts' leading token blocks, kept after their prefill and
reused by a later prompt that starts with the same tokens, whose prefill then runs only on the rest
(as vLLM caches prefixes by default, and llama.cpp's server keeps each slot's prompt).

A prompt is cut into blocks of `block_tokens` tokens; a block is found by its tokens and the block
before it (a chain from the prompt's first token: a block's KV depends on every token before it), so a
lookup walks the prompt block by block and stops at the first block not held. The keys are the
tokens themselves (a dict keyed by (parent block's id, block tokens)), so a hit is never a hash
collision. A hit leaves at least the prompt's last token to run, for its logits.

The blocks live in host memory as the backend's cache stores them (float32, or int8 for an int8 cache), one array
(2 * n_layer, H, block_tokens, D) each (key then value per layer, as KVCache.stored gives them), under a budget in
bytes; when a new block does not
fit, the least recently used blocks go first (a block's descendants with it: they cannot be found
without it). A hit touches its blocks from the last to the first, and a stored chain likewise, so the
blocks at the end of a chain are evicted before its beginning, which more prompts share.

Positions: GPT-2's position ids count a row's real tokens (numerics.positions), so a block's KV is the
same whatever padding or batch it was computed in, up to the runtime's numerics: exact in fp32
(batch-invariant within 1e-5); in int8, whose dynamic quantization scales each forward's activations
as a whole, as exact as a row in a batch is (the serving tests compare greedy tokens there).
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

import numpy as np

from .prefix_disk import DiskBlocks

BLOCK_TOKENS = 16  # vLLM's default block size
READ_THREADS = 2  # blocks read from disk at once: a 512-token prefix's 32 blocks took 50 ms on one thread (fp32 124M)
DEFAULT_PREFIX_CACHE_MB = 512  # about 7,000 tokens of GPT-2 124M in float32 (72 KiB a token)

log = logging.getLogger(__name__)


@dataclass(eq=False)
class _Block:
    key: tuple[int, tuple[int, ...]]  # (the parent block's id, or -1 for a prompt's first block; its tokens)
    id: int
    parent: _Block | None
    kv: np.ndarray  # (2 * n_layer, H, block_tokens, D), as the cache stores it (float32, or int8)
    children: set = field(default_factory=set)


class PrefixCache:
    """Blocks of prompts' KV under a budget of `budget_bytes`, least recently used evicted first.
    Counts, in tokens, the prompt tokens looked up (`queries`) and those found (`hits`), as vLLM's
    prefix_cache_queries and prefix_cache_hits do. Not thread-safe: the engine's thread only, but for the blocks
    `keep_later` copies on the cache's own thread, which every other method waits for first (`settle`)."""

    def __init__(self, budget_bytes: int, block_tokens: int = BLOCK_TOKENS, disk: DiskBlocks | None = None):
        if budget_bytes < 0 or block_tokens < 1:
            raise ValueError(f"a prefix cache needs a budget >= 0 and blocks of >= 1 token, got {budget_bytes}, {block_tokens}")
        self.budget_bytes = budget_bytes
        self.block_tokens = block_tokens
        self._blocks: OrderedDict[tuple[int, tuple[int, ...]], _Block] = OrderedDict()  # least recently used first
        self._next_id = 0
        self.bytes = 0
        self.queries = 0
        self.hits = 0
        # The disk tier (prefix_disk.py): every block kept is written there too, and a prompt's blocks not held here
        # are read from there, so that they outlive the process.
        self.disk = disk
        self._keeper: ThreadPoolExecutor | None = None
        self._keeping: Future | None = None

    def __len__(self) -> int:
        return len(self._blocks)

    def _lookup_blocks(self, ids: list[int]) -> list[_Block]:
        """The held blocks that begin `ids`, at most up to its last token but one: here, then on disk (read in)."""
        most = (len(ids) - 1) // self.block_tokens
        blocks = self._match(ids, most)
        if self.disk is not None and len(blocks) < most:
            self._read_in(ids, blocks, most)
        return blocks

    def held(self, ids: list[int]) -> int:
        """The tokens `lookup` would give `ids`, neither counted nor touched (nor read from disk)."""
        self.settle()
        most = (len(ids) - 1) // self.block_tokens
        n = len(self._match(ids, most))
        if self.disk is not None and n < most:
            chain = self.disk.chain()
            digests = [chain.next(self._tokens(ids, j)) for j in range(most)]
            while n < most and self.disk.has(digests[n]):
                n += 1
        return n * self.block_tokens

    def lookup(self, ids: list[int], use: bool = True) -> list[_Block]:
        """The held blocks that begin `ids`, at most up to its last token but one (whose logits its
        prefill must compute); counted, and touched. `use` False: a query its caller prefills whole
        (counted as one, with no hit)."""
        self.settle()
        self.queries += len(ids)
        if not use:
            return []
        blocks = self._lookup_blocks(ids)
        self.hits += len(blocks) * self.block_tokens
        self._touch(blocks)
        if self.disk is not None:  # the disk's order of use follows this one's: a prefix in use here stays there
            digests = self.disk.chain()
            for j in range(len(blocks)):
                self.disk.touch(digests.next(self._tokens(ids, j)))
        return blocks

    def store(self, ids: list[int], kv: list[np.ndarray], row: int, end: int) -> None:
        """Keep the KV of `ids`' whole blocks: `kv` is a cache as KVCache.stored gives it (2 * n_layer
        arrays (B, H, W, D)), whose row `row` holds `ids`' positions in columns end - len(ids) .. end - 1.
        Blocks held already are only touched."""
        self.settle()
        self._store(ids, kv, row, end)

    def keep_later(self, prompts: Sequence[tuple[int, list[int]]], kv: list[np.ndarray], end: int) -> None:
        """Keep the whole blocks of each prompt (row, ids) (as `store` reads it, blocks held only touched), copied on
        the cache's own thread while the caller goes on to its next decode step: the copy into fresh memory is mostly
        its page faults, and a step that waited for it came that much later (beside it, the step slows by less, except
        where it keeps every core busy: docs/results/serving.md#why-does-a-waves-second-token-come-late). The caller
        writes none of those columns of `kv` until it has called `settle`."""
        self.settle()
        if self._keeper is None:
            self._keeper = ThreadPoolExecutor(1, thread_name_prefix="gpt2x-prefix-keep")
        self._keeping = self._keeper.submit(self._keep, prompts, kv, end)

    def settle(self) -> None:
        """Wait until the blocks `keep_later` copies are kept. Where the copy failed, the log says why and its blocks
        are not kept: a later prompt prefills them again."""
        future, self._keeping = self._keeping, None
        if future is None:
            return
        try:
            future.result()
        except Exception:  # a cache that lacks some blocks is still right
            log.exception("keeping prompts' blocks in the prefix cache failed")

    def close(self) -> None:
        """Settle, and stop the cache's thread."""
        self.settle()
        if self._keeper is not None:
            self._keeper.shutdown()
            self._keeper = None

    def _keep(self, prompts: Sequence[tuple[int, list[int]]], kv: list[np.ndarray], end: int) -> None:
        for row, ids in prompts:
            self._store(ids, kv, row, end)

    def _store(self, ids: list[int], kv: list[np.ndarray], row: int, end: int) -> None:
        n = len(ids) // self.block_tokens
        chain = self._match(ids, n)
        start = end - len(ids)
        digests = self.disk.chain() if self.disk is not None else None
        for j in range(n):
            digest = digests.next(self._tokens(ids, j)) if digests is not None else None
            if j < len(chain):
                block_kv = chain[j].kv
            else:
                a, b = start + j * self.block_tokens, start + (j + 1) * self.block_tokens
                block_kv = np.stack([t[row, :, a:b] for t in kv])
            if digest is not None:  # written (or, held there, touched); block_kv is not written to afterwards
                self.disk.put(digest, self._tokens(ids, j), block_kv)
            if j >= len(chain) and not self._add(chain, self._tokens(ids, j), block_kv):
                break
        self._touch(chain)

    def lacks(self, ids: list[int]) -> bool:
        """Whether some whole block of `ids` is not held (`store` would add it)."""
        self.settle()
        return self._lacks(ids)

    def _lacks(self, ids: list[int]) -> bool:
        n = len(ids) // self.block_tokens
        return len(self._match(ids, n)) < n

    def gather(self, blocks: list[_Block], length: int, out: Sequence[np.ndarray], row: int) -> None:
        """Write the first `length` tokens' KV of `blocks` into row `row` of `out` (2 * n_layer arrays (B, H, W, D),
        as KVCache.stored gives them, or a cache's own buffers), right-aligned: columns W - length .. W - 1."""
        self.settle()
        at = out[0].shape[2] - length
        for j, block in enumerate(blocks):
            n = min(self.block_tokens, length - j * self.block_tokens)
            if n <= 0:
                break
            for layer, a in enumerate(out):
                a[row, :, at : at + n] = block.kv[layer, :, :n]
            at += n

    # -- inside

    def _tokens(self, ids: list[int], j: int) -> list[int]:
        return ids[j * self.block_tokens : (j + 1) * self.block_tokens]

    def _add(self, chain: list[_Block], tokens: list[int], kv: np.ndarray) -> bool:
        """A block after `chain`'s last, held here (appended to `chain`); False where it does not fit."""
        if not self._make_room(kv.nbytes, chain):
            return False
        parent = chain[-1] if chain else None
        block = _Block((-1 if parent is None else parent.id, tuple(tokens)), self._next_id, parent, kv)
        self._next_id += 1
        self._blocks[block.key] = block
        if parent is not None:
            parent.children.add(block)
        self.bytes += kv.nbytes
        chain.append(block)
        return True

    def _read_in(self, ids: list[int], chain: list[_Block], most: int) -> None:
        """The blocks after `chain` (held here) that the disk holds, read and held here too, appended to `chain`: read
        and checked on READ_THREADS threads (file reads and the checksum release the GIL), kept in order up to the first
        that does not check out."""
        digests = self.disk.chain()
        wanted = []
        for j in range(most):
            digest = digests.next(self._tokens(ids, j))
            if j >= len(chain):
                if not self.disk.has(digest):
                    break
                wanted.append((digest, self._tokens(ids, j)))
        if not wanted:
            return
        with ThreadPoolExecutor(min(READ_THREADS, len(wanted)), thread_name_prefix="gpt2x-prefix-read") as pool:
            for (_, tokens), kv in zip(wanted, pool.map(lambda w: self.disk.load(*w), wanted)):
                if kv is None or not self._add(chain, tokens, kv):
                    return

    def _match(self, ids: list[int], most: int) -> list[_Block]:
        blocks: list[_Block] = []
        parent = -1
        for j in range(most):
            block = self._blocks.get((parent, tuple(ids[j * self.block_tokens : (j + 1) * self.block_tokens])))
            if block is None:
                break
            blocks.append(block)
            parent = block.id
        return blocks

    def _touch(self, chain: list[_Block]) -> None:
        for block in reversed(chain):  # the chain's first block ends most recently used
            self._blocks.move_to_end(block.key)

    def _make_room(self, nbytes: int, chain: list[_Block]) -> bool:
        """Evict least recently used blocks until `nbytes` more fit; False (nothing evicted that
        `chain`, the blocks being stored on, needs) when they cannot."""
        if nbytes > self.budget_bytes:
            return False
        keep = {id(b) for b in chain}
        while self.bytes + nbytes > self.budget_bytes:
            oldest = next(iter(self._blocks.values()))
            if id(oldest) in keep:
                return False
            self._evict(oldest)
        return True

    def _evict(self, block: _Block) -> None:
        for child in list(block.children):
            self._evict(child)
        del self._blocks[block.key]
        self.bytes -= block.kv.nbytes
        if block.parent is not None:
            block.parent.children.discard(block)
