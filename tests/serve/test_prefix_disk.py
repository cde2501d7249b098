"""The prefix cache's disk tier (serve/core/prefix_disk.py, --prefix-cache-dir): blocks written by one process read
back by the next, as made-up arrays whose values say their token and layer; another export's blocks never read; a
truncated, corrupt, renamed or foreign file skipped, reported and deleted, never used; the folder bounded, least
recently used first; writes that never hold up the engine's thread; and a served prompt's tokens after a restart
equal to gpt2x's generation of it with no cache, its prefix read from the disk."""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import os
import threading
import time

import numpy as np
import pytest
import xxhash
from safetensors import safe_open
from safetensors.numpy import save_file

from gpt2x.errors import OutputError, UsageError
from gpt2x.generation.generate import generate
from gpt2x.generation.settings import SamplingSettings
from gpt2x.onnx.artifact import read_export
from gpt2x.runtime.ort import OrtBackend
from gpt2x.serve.core.engine import EngineSettings
from gpt2x.serve.core.prefix_cache import PrefixCache
from gpt2x.serve.core.prefix_disk import SUFFIX, BlockIdentity, DiskBlocks
from gpt2x.serve.openai.service import CompletionService
from gpt2x.serve.replica import block_identity
from gpt2x.tokenizer import encode

from ..helpers import REPO
from .test_prefix_cache import kv_of

IDENTITY = BlockIdentity({"model.onnx": "a" * 64}, "ort", "float32")
B = 4  # tokens a block
PROMPT = list(range(100, 114))  # blocks [100..103], [104..107], [108..111]; 112, 113 not a whole block


def disk(folder, identity=IDENTITY, mb: float = 1.0) -> DiskBlocks:
    return DiskBlocks(folder, identity, int(mb * 2**20), B)


def cache(folder, identity=IDENTITY, mb: float = 1.0) -> PrefixCache:
    return PrefixCache(10**6, block_tokens=B, disk=disk(folder, identity, mb))


def stored(folder, ids=PROMPT) -> PrefixCache:
    """A process that prefilled `ids` (its cache holds them right-aligned at 20 columns) and stopped."""
    first = cache(folder)
    first.store(ids, kv_of([0] * (20 - len(ids)) + ids), 0, 20)
    assert first.disk.flush()
    return first


def gathered(c: PrefixCache, ids: list[int]) -> list[float]:
    blocks = c.lookup(ids)
    n = len(blocks) * B
    out = np.zeros((4, 1, 1, n, 1), np.float32)
    c.gather(blocks, n, out, 0)
    return out[3][0, 0, :, 0].tolist()  # the last layer's value: 3000 + the token at each position


def test_a_later_process_reads_the_blocks_back(tmp_path):
    first = stored(tmp_path)
    assert len(list((tmp_path / first.disk.key).glob(f"*{SUFFIX}"))) == 3
    later = cache(tmp_path)  # a restart: nothing held in memory
    assert len(later) == 0 and later.held(PROMPT) == 12
    assert gathered(later, PROMPT) == [3000.0 + t for t in PROMPT[:12]]
    assert (later.hits, later.disk.loaded, later.disk.errors) == (12, 3, 0)
    assert len(later) == 3  # held in memory now: the next lookup reads nothing
    assert gathered(later, PROMPT[:10]) == [3000.0 + t for t in PROMPT[:8]] and later.disk.loaded == 3
    other = list(PROMPT[:4]) + [7, 7, 7, 7, 7]  # the same first block, then another text
    assert len(cache(tmp_path).lookup(other)) == 1


def test_another_export_never_reads_them(tmp_path):
    stored(tmp_path)
    for identity in (BlockIdentity({"model.onnx": "b" * 64}, "ort", "float32"), BlockIdentity(IDENTITY.files, "openvino", "float32"),
                     BlockIdentity(IDENTITY.files, "ort", "int8")):
        other = cache(tmp_path, identity)
        assert other.held(PROMPT) == 0 and other.lookup(PROMPT) == [] and other.disk.errors == 0


@pytest.mark.parametrize("damage,why", [
    ("truncate", "unreadable"), ("flip", "checksum"), ("swap", "another export's block"), ("tokens", "tokens"),
    ("earlier format", "of version 2"),
])
def test_a_damaged_block_is_skipped_reported_and_deleted(tmp_path, caplog, damage, why):
    first = stored(tmp_path)
    folder = tmp_path / first.disk.key
    chain = first.disk.chain()
    digests = [chain.next(PROMPT[j * B : (j + 1) * B]) for j in range(3)]
    second = folder / f"{digests[1]}{SUFFIX}"
    data = second.read_bytes()
    if damage == "truncate":
        second.write_bytes(data[: len(data) - 7])
    elif damage == "flip":  # one byte of the KV: the file reads, its checksum does not match
        second.write_bytes(data[:-1] + bytes([data[-1] ^ 1]))
    elif damage == "swap":  # another block's file under this block's name
        os.replace(folder / f"{digests[2]}{SUFFIX}", second)
    elif damage == "tokens":  # a file whose checksum matches, of other tokens, under this name
        kv = np.zeros((4, 1, B, 1), np.float32)
        save_file({"kv": kv}, str(second), metadata={
            "format": "gpt2x-prefix-block", "format_version": "2", "key": first.disk.key, "digest": digests[1],
            "tokens": json.dumps([1, 2, 3, 4]), "xxh3_128": xxhash.xxh3_128_hexdigest(kv.tobytes())})
    else:  # the block as version 1 wrote it: a SHA-256 checksum
        with safe_open(str(second), framework="numpy") as f:
            meta, kv = f.metadata(), f.get_tensor("kv")
        meta["format_version"] = "1"
        meta["sha256"] = hashlib.sha256(kv.tobytes()).hexdigest()
        del meta["xxh3_128"]
        save_file({"kv": kv}, str(second), metadata=meta)
    later = cache(tmp_path)
    with caplog.at_level(logging.WARNING):
        got = gathered(later, PROMPT)
    assert got == [3000.0 + t for t in PROMPT[:4]]  # the first block only: never the damaged one, nor what follows
    assert later.disk.errors == 1 and not second.exists()
    assert [r for r in caplog.records if why in r.getMessage() and str(second) in r.getMessage()]


def test_the_folder_is_bounded_least_recently_used_first(tmp_path):
    one = stored(tmp_path, list(range(0, 5)))  # one block each
    size = one.disk.bytes
    assert size > 0
    for start in (10, 20):
        time.sleep(0.02)  # distinct mtimes: the order of use outlives the process
        stored(tmp_path, list(range(start, start + 5)))
    time.sleep(0.02)
    c = PrefixCache(10**6, block_tokens=B, disk=disk(tmp_path, mb=3.5 * size / 2**20))  # room for three blocks
    assert len(c.lookup(list(range(0, 5)))) == 1  # the oldest block, used: now the newest
    c.store(list(range(30, 35)), kv_of(list(range(30, 35))), 0, 5)
    assert c.disk.flush()
    fresh = cache(tmp_path)
    held = [fresh.held(list(range(s, s + 5))) for s in (0, 10, 20, 30)]
    assert held == [4, 0, 4, 4] and fresh.disk.bytes <= 3.5 * size


def test_a_slow_disk_never_holds_up_the_engines_thread(tmp_path, monkeypatch):
    d = disk(tmp_path)
    stuck = threading.Event()
    monkeypatch.setattr(d, "_write", lambda *a: stuck.wait(30))
    c = PrefixCache(10**6, block_tokens=B, disk=d)
    began = time.perf_counter()
    for start in range(0, 300 * 10, 10):  # 300 prompts of one block each, the writer stuck on the first
        c.store(list(range(start, start + 5)), kv_of(list(range(start, start + 5))), 0, 5)
    took = time.perf_counter() - began
    stuck.set()
    assert took < 2.0 and d.dropped > 0 and len(c) == 300  # every block held in memory, the excess writes dropped


def test_an_unwritable_folder_and_a_disk_tier_without_the_cache_are_one_line(tmp_path):
    blocked = tmp_path / "file"
    blocked.write_text("")
    with pytest.raises(OutputError, match="cannot be made"):
        disk(blocked / "sub")
    with pytest.raises(UsageError, match="needs the prefix cache itself") as e:
        EngineSettings(prefix_cache_dir=str(tmp_path), prefix_cache_mb=0)
    assert e.value.option == "prefix_cache_dir"


def test_a_restarted_server_serves_a_seen_prefix_from_the_disk_with_the_tokens_of_no_cache(tmp_path, export_dir, reference):
    text = " ".join(line for line in (REPO / "tests/data/tinyshakespeare.txt").read_text().splitlines()[200:260] if line)
    prefix = encode(text)[:96]  # six whole blocks of 16
    prompts = [prefix + encode(" ROMEO: I"), prefix + encode(" JULIET: Ay me")]
    settings = EngineSettings(max_batch_size=2, prefix_cache_dir=str(tmp_path))
    info = read_export(export_dir)

    def serve_once(ids: list[int]) -> tuple[list[int], int, dict]:
        backend = OrtBackend(info, threads=1)
        service = CompletionService(backend, settings, "shakespeare", blocks=block_identity(info, backend))
        try:
            req = service.request({"prompt": ids, "max_tokens": 8, "temperature": 0})

            async def run():
                pending = service.submit(req)
                body = await service.complete(pending)
                return pending.rows[0].tokens, body.usage.prompt_tokens_details.cached_tokens

            tokens, cached = asyncio.run(run())
            return tokens, cached, service.engine.stats()
        finally:
            service.close()
            backend.close()

    _, cached, stats = serve_once(prompts[0])  # the first server: nothing on disk yet
    assert cached == 0 and stats["prefix_cache_disk_reads"] == 0
    tokens, cached, stats = serve_once(prompts[1])  # restarted: the shared prefix read back
    assert cached == 96 and stats["prefix_cache_disk_reads"] == 6 and stats["prefix_cache_disk_errors"] == 0
    want = generate(reference, [""], SamplingSettings(max_new_tokens=8, greedy=True), prompt_ids=[prompts[1]])[0]
    assert tokens == want.tokens


def test_a_backend_that_keeps_its_own_cache_refuses_the_disk_tier(bundled_export, tmp_path):
    """onnxruntime-genai's generator owns its cache (capabilities.takes_past False): asked for blocks on disk, the engine
    refuses in one line naming the option rather than serving without them."""
    from gpt2x.choices import Precision
    from gpt2x.runtime.genai import GenaiBackend
    from gpt2x.serve.core.engine import Engine

    backend = GenaiBackend(bundled_export(Precision.fp32), threads=1)
    try:
        with pytest.raises(UsageError, match="keeps its own cache") as e:
            Engine(backend, EngineSettings(prefix_cache_dir=str(tmp_path)), blocks=IDENTITY)
        assert e.value.option == "prefix_cache_dir" and not any(tmp_path.iterdir())
    finally:
        backend.close()
