"""The prefix cache's disk tier (`--prefix-cache-dir`): its blocks kept across restarts, as llama-server's slot
save/restore and vLLM's KV offload keep them, so that a restarted server's first prompts that begin as earlier ones
did skip their prefill.

A block is a safetensors file named by the SHA-256 of the export's key and every token up to the block's end (a
block's KV depends on every token before it), in a folder of the export's key (`cache_key`: its files' digests,
the backend and the cache's dtype), so a different export never reads another's blocks. Each file holds the block's
KV and, in its metadata, the key, its digest, its tokens, and the XXH3-128 checksum of its bytes (a check against damage,
not tampering: whoever can write the file can write its checksum); a file that does not check out (truncated, corrupt,
another export's, renamed, of an earlier format) is skipped, reported, and deleted, never used.

Writes go through one background thread (the engine's thread hands a block over and goes on: a decode step never
waits for the disk), each to a temporary file renamed into place, so no reader sees half a block. The folder is
bounded (`budget_bytes`): the least recently used files go first, used meaning written or read (their mtime, so
the order survives a restart). Reads are on the engine's thread, in place of the prefill they save.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import queue
import threading
from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import xxhash
from safetensors import safe_open
from safetensors.numpy import save_file

from ...errors import OutputError

log = logging.getLogger(__name__)

FORMAT = "gpt2x-prefix-block"
FORMAT_VERSION = "2"  # 2: XXH3-128 checksums (1: SHA-256)
SUFFIX = ".safetensors"
DEFAULT_PREFIX_CACHE_DISK_MB = 4096  # about 58,000 tokens of GPT-2 124M in float32
PENDING_WRITES = 256  # blocks handed to the writer and not yet written; more are dropped (counted), never waited for


@dataclass(frozen=True)
class BlockIdentity:
    """What a block's KV depends on besides its tokens: the export's files (their SHA-256s, as gpt2x.json records
    them), the backend that computed it and the dtype its cache stores (numpy's name)."""

    files: dict[str, str]
    backend: str
    kv_dtype: str

    def key(self, block_tokens: int) -> str:
        ident = {"files": self.files, "backend": self.backend, "kv_dtype": self.kv_dtype, "block_tokens": block_tokens}
        return hashlib.sha256(json.dumps(ident, sort_keys=True).encode()).hexdigest()


class PrefixChain:
    """The digests of a prompt's blocks, one after the other: block j's is the SHA-256 of the key and the prompt's
    tokens up to its end."""

    def __init__(self, key: str, block_tokens: int):
        self._hash = hashlib.sha256(key.encode())
        self.block_tokens = block_tokens

    def next(self, block: Iterable[int]) -> str:
        self._hash.update(np.asarray(list(block), dtype="<i4").tobytes())
        return self._hash.copy().hexdigest()


class DiskBlocks:
    """The blocks of one export (`identity`) in a folder of its key under `folder` (made if missing), at most
    `budget_bytes` of them. The engine's thread calls `load`, `has` and `put`; one writer thread writes. `loaded`:
    blocks read; `errors`: files that did not check out; `dropped`: blocks not written because the writer was behind."""

    def __init__(self, folder: Path, identity: BlockIdentity, budget_bytes: int, block_tokens: int):
        self.key = identity.key(block_tokens)
        self.folder = Path(folder) / self.key
        self.dtype = np.dtype(identity.kv_dtype)
        self.budget_bytes = budget_bytes
        self.block_tokens = block_tokens
        self._shape: tuple[int, ...] | None = None  # a block's, once one is read or written
        try:
            self.folder.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise OutputError(f"the prefix cache's folder {self.folder} cannot be made: {e.strerror or e}") from None
        if not os.access(self.folder, os.W_OK):
            raise OutputError(f"the prefix cache's folder {self.folder} is not writable")
        self._lock = threading.Lock()
        self._files: OrderedDict[str, int] = OrderedDict()  # digest -> bytes, least recently used first
        self.bytes = 0
        self.errors = 0
        self.dropped = 0
        self.loaded = 0
        self._scan()
        self._queue: queue.Queue = queue.Queue(PENDING_WRITES)
        self._writer = threading.Thread(target=self._write_loop, name="gpt2x-prefix-disk", daemon=True)
        self._writer.start()

    def chain(self) -> PrefixChain:
        return PrefixChain(self.key, self.block_tokens)

    def has(self, digest: str) -> bool:
        with self._lock:
            return digest in self._files

    def load(self, digest: str, tokens: list[int]) -> np.ndarray | None:
        """The block's KV, where its file holds these tokens of this export, whole, in the cache's dtype and a block's
        shape (2 * n_layer, H, block_tokens, D); None where it is not held, or is and does not check out (then
        reported, counted and deleted)."""
        if not self.has(digest):
            return None
        path = self._path(digest)
        try:
            with safe_open(str(path), framework="numpy") as f:
                meta = f.metadata() or {}
                kv = f.get_tensor("kv")
        except FileNotFoundError:  # evicted meanwhile
            self._forget(digest)
            return None
        except Exception as e:  # safetensors' own errors for a truncated or corrupt file, OSError, ...
            return self._bad(digest, f"unreadable ({type(e).__name__}: {str(e).splitlines()[0][:120] if str(e) else ''})")
        why = _mismatch(meta, kv, self.key, digest, tokens, self.dtype, self.block_tokens, self._shape)
        if why is not None:
            return self._bad(digest, why)
        with self._lock:  # blocks are read on several threads at once (PrefixCache._read_in)
            self._shape = kv.shape
            self.loaded += 1
        self._touch(digest)
        return kv

    def put(self, digest: str, tokens: list[int], kv: np.ndarray) -> None:
        """Hand a block to the writer (`kv` is the caller's own copy, not written to afterwards); a block held already
        or a writer behind by PENDING_WRITES blocks: nothing (counted in `dropped`)."""
        self._shape = self._shape or kv.shape
        if self.has(digest):
            self._touch(digest)
            return
        try:
            self._queue.put_nowait((digest, list(tokens), kv))
        except queue.Full:
            self.dropped += 1

    def flush(self, timeout: float = 30.0) -> bool:
        """Wait for the blocks handed over so far to be written (a server's stop, tests). True once they are."""
        done = threading.Event()
        try:
            self._queue.put((None, None, done), timeout=timeout)
        except queue.Full:
            return False
        return done.wait(timeout)

    # -- inside

    def _path(self, digest: str) -> Path:
        return self.folder / f"{digest}{SUFFIX}"

    def _scan(self) -> None:
        """The folder's blocks, least recently used first (by mtime); temporary files a stopped writer left, gone."""
        found = []
        for path in self.folder.iterdir():
            if path.name.endswith(".tmp"):
                path.unlink(missing_ok=True)
            elif path.suffix == SUFFIX:
                stat = path.stat()
                found.append((stat.st_mtime_ns, path.stem, stat.st_size))
        for _, digest, size in sorted(found):
            self._files[digest] = size
            self.bytes += size

    def touch(self, digest: str) -> None:
        """A block used (held here or not): the last to be evicted."""
        if self.has(digest):
            self._touch(digest)

    def _touch(self, digest: str) -> None:
        with self._lock:
            if digest in self._files:
                self._files.move_to_end(digest)
        try:
            os.utime(self._path(digest))  # the order of use, kept for the next process
        except OSError:
            pass  # evicted meanwhile

    def _forget(self, digest: str) -> None:
        with self._lock:
            size = self._files.pop(digest, None)
            if size is not None:
                self.bytes -= size

    def _bad(self, digest: str, why: str) -> None:
        with self._lock:
            self.errors += 1
        log.warning("prefix cache: skipped %s: %s", self._path(digest), why)
        self._forget(digest)
        self._path(digest).unlink(missing_ok=True)
        return None

    def _write_loop(self) -> None:
        while True:
            digest, tokens, kv = self._queue.get()
            if digest is None:  # a flush's marker: every block before it is written
                kv.set()
                continue
            try:
                self._write(digest, tokens, kv)
            except OSError as e:  # a full or read-only disk: the block stays in memory only
                log.warning("prefix cache: could not write a block to %s: %s", self.folder, e)

    def _write(self, digest: str, tokens: list[int], kv: np.ndarray) -> None:
        if self.has(digest) or kv.nbytes > self.budget_bytes:
            return
        kv = np.ascontiguousarray(kv)
        meta = {"format": FORMAT, "format_version": FORMAT_VERSION, "key": self.key, "digest": digest,
                "tokens": json.dumps(tokens), "xxh3_128": _checksum(kv)}
        tmp = self.folder / f"{digest}.{threading.get_ident()}.tmp"
        save_file({"kv": kv}, str(tmp), metadata=meta)
        size = tmp.stat().st_size
        self._make_room(size)
        os.replace(tmp, self._path(digest))
        with self._lock:
            self._files[digest] = size
            self.bytes += size

    def _make_room(self, size: int) -> None:
        while True:
            with self._lock:
                if self.bytes + size <= self.budget_bytes or not self._files:
                    return
                oldest, freed = self._files.popitem(last=False)
                self.bytes -= freed
            self._path(oldest).unlink(missing_ok=True)


def _mismatch(meta: dict, kv: np.ndarray, key: str, digest: str, tokens: list[int], dtype: np.dtype, block_tokens: int,
              shape: tuple[int, ...] | None) -> str | None:
    """Why a block's file is not the block asked for (None: it is): `shape` the blocks' seen so far (None: none)."""
    if meta.get("format") != FORMAT or meta.get("format_version") != FORMAT_VERSION:
        return f"not a {FORMAT} file of version {FORMAT_VERSION}"
    if meta.get("key") != key or meta.get("digest") != digest:
        return "another export's block, or a block under another name"
    if meta.get("tokens") != json.dumps(list(tokens)):
        return "its tokens are not the prompt's"
    if kv.dtype != dtype or kv.ndim != 4 or kv.shape[2] != block_tokens or shape not in (None, kv.shape):
        return f"its KV is {kv.dtype}{list(kv.shape)}, not a block of {block_tokens} tokens in {dtype}"
    if _checksum(kv) != meta.get("xxh3_128"):
        return "its bytes do not match their checksum"
    return None


def _checksum(kv: np.ndarray) -> str:
    """The XXH3-128 of an array's bytes, read in place (no copy)."""
    return xxhash.xxh3_128_hexdigest(memoryview(np.ascontiguousarray(kv)).cast("B"))
