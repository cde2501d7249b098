"""Automatic prefix caching and chunked prefill in the serving engine (serve/core/prefix_cache.py,
runner.Runner.begin/advance): the prefix cache's blocks, lookups and eviction on hand-made cases;
then, on every backend that serves with a cache it can be handed (ONNX Runtime's growing cache and
in-place cache, OpenVINO's), rows whose prompts' prefixes come from the cache, and rows prefilled in
chunks while a batch runs, give the tokens of gpt2x's generation code run on that prompt alone, with
no cache (the reference); onnxruntime-genai, whose generator owns its cache, serves without one."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

from gpt2x.choices import Precision
from gpt2x.generation.generate import generate
from gpt2x.generation.settings import SamplingSettings
from gpt2x.onnx.artifact import read_export
from gpt2x.runtime.ort import OrtBackend
from gpt2x.serve.core.engine import Engine, EngineSettings, Row
from gpt2x.serve.core.outputs import Failed, Finished, Output, TokenOut
from gpt2x.serve.core.prefix_cache import PrefixCache
from gpt2x.serve.core.scheduler import Scheduler
from gpt2x.tokenizer import encode

from ..helpers import REPO, with_int8_kv

TEXT = " ".join(line for line in (REPO / "tests/data/tinyshakespeare.txt").read_text().splitlines()[400:520] if line)
SHARED = encode(TEXT)[:100]  # a prefix of 100 tokens: six whole blocks of 16
SUFFIXES = [encode(" " + w) for w in ("ROMEO: I", "JULIET: Ay me! What says the", "First Citizen:",
                                         "KING HENRY: Now, by my sceptre and my crown, I swear")]


# ------------------------------------------------------------------ the cache itself


def kv_of(ids: list[int], layers: int = 2, heads: int = 1, dim: int = 1) -> list[np.ndarray]:
    """A made-up cache (1 row) whose value at position p is the token there, and its layer."""
    return [np.array(ids, dtype=np.float32)[None, None, :, None] + 1000 * t + np.zeros((1, heads, 1, dim), np.float32)
            for t in range(2 * layers)]


def test_lookup_finds_whole_blocks_of_the_same_tokens_and_leaves_the_last_token():
    cache = PrefixCache(10**6, block_tokens=4)
    a = list(range(10))  # blocks [0..3], [4..7]; 8, 9 not a whole block
    cache.store(a, kv_of(a), 0, 10)
    assert len(cache) == 2
    assert len(cache.lookup(a)) == 2  # 8 tokens; 2 left to run
    assert len(cache.lookup(a[:8])) == 1  # its last token must run: (8 - 1) // 4 = 1 block
    assert len(cache.lookup(a[:9])) == 2
    assert len(cache.lookup([0, 1, 2, 3, 4, 5, 99, 7, 8])) == 1  # differs in the second block
    assert len(cache.lookup([1, 2, 3, 4, 5])) == 0  # the same tokens elsewhere are another prefix
    assert (cache.queries, cache.hits) == (10 + 8 + 9 + 9 + 5, 4 * (2 + 1 + 2 + 1))
    # gather writes the tokens' KV right-aligned, zeros before them untouched
    out = np.zeros((4, 2, 1, 7, 1), np.float32)
    cache.gather(cache.lookup(a), 6, out, 1)
    assert out[3][1, 0, :, 0].tolist() == [0] + [3000 + t for t in range(6)]
    assert not out[0][0].any()


def test_blocks_kept_later_are_copied_on_the_caches_thread_and_every_lookup_waits_for_them(caplog):
    """keep_later returns while the copy runs (held here until the test lets it go), on a thread other than the
    caller's; a lookup then waits for it and finds the blocks, their values the prompt's. A copy that fails is logged,
    its blocks not kept, and the cache goes on."""
    cache = PrefixCache(10**6, block_tokens=4)
    a, b = list(range(10)), list(range(50, 59))
    go, threads = threading.Event(), []
    store = cache._store

    def held_back(ids, kv, row, end):
        threads.append(threading.current_thread())
        assert go.wait(10)
        store(ids, kv, row, end)

    cache._store = held_back
    rows = [np.concatenate([x, y]) for x, y in zip(kv_of(a[:9]), kv_of(b))]  # two rows of 9 positions
    cache.keep_later([(0, a[:9]), (1, b)], rows, 9)
    assert len(cache._blocks) == 0  # not yet: the copy waits
    go.set()
    found = cache.lookup(a[:9] + [99])
    assert threads and threading.current_thread() not in threads
    assert len(found) == 2 and len(cache.lookup(b + [7])) == 2
    assert found[1].kv[3, 0, :, 0].tolist() == [3000 + t for t in range(4, 8)]
    cache._store = store
    cache.keep_later([(1, list(range(200, 209)))], kv_of(list(range(200, 209))), 9)  # row 1 of a 1-row cache
    with caplog.at_level("ERROR"):
        assert cache.lookup(list(range(200, 210))) == []
    assert "keeping prompts' blocks in the prefix cache failed" in caplog.text
    assert len(cache.lookup(a[:9] + [99])) == 2
    cache.close()


def test_store_takes_the_rows_positions_where_its_prompt_ends():
    cache = PrefixCache(10**6, block_tokens=2)
    a, b = [5, 6, 7], [8, 9, 10, 11, 12]
    kv = [np.concatenate([np.pad(x, [(0, 0), (0, 0), (5 - x.shape[2], 0), (0, 0)]) for x in (ka, kb)])
          for ka, kb in zip(kv_of(a), kv_of(b))]  # two rows, left-padded to 5
    cache.store(a, kv, 0, 5)
    cache.store(b, kv, 1, 5)
    out = np.zeros((4, 1, 1, 4, 1), np.float32)
    cache.gather(cache.lookup(b), 4, out, 0)
    assert out[1][0, 0, :, 0].tolist() == [1008, 1009, 1010, 1011]
    out = np.zeros((4, 1, 1, 2, 1), np.float32)
    cache.gather(cache.lookup(a), 2, out, 0)
    assert out[2][0, 0, :, 0].tolist() == [2005, 2006]
    assert not cache.lacks(b) and cache.lacks(b + [13])


def test_the_budget_evicts_the_least_recently_used_chain_ends_first():
    block_bytes = 4 * 4 * 4  # 2 layers x key, value; 4 tokens of 1 float32
    cache = PrefixCache(3 * block_bytes, block_tokens=4)
    a, b = list(range(9)), list(range(100, 109))
    cache.store(a, kv_of(a), 0, 9)  # a1, a2
    cache.store(b, kv_of(b), 0, 9)  # b1 fits; b2 evicts a2 (a's end), not a1
    assert cache.bytes == 3 * block_bytes and len(cache) == 3
    assert len(cache.lookup(a)) == 1 and len(cache.lookup(b)) == 2
    c = list(range(200, 209))
    cache.store(c, kv_of(c), 0, 9)  # the oldest now: a1, then b2 (b's end before its start)
    assert len(cache.lookup(a)) == 0 and len(cache.lookup(b)) == 1 and len(cache.lookup(c)) == 2
    assert cache.bytes == 3 * block_bytes
    tiny = PrefixCache(block_bytes - 1, block_tokens=4)  # not one block fits: nothing kept, nothing breaks
    tiny.store(a, kv_of(a), 0, 9)
    assert len(tiny) == 0 and tiny.bytes == 0


def test_a_joiner_prefilled_in_chunks_fits_the_context_when_it_joins():
    """Hand-computed: a running row at width 50 with 10 tokens to go; a joiner of 40 prompt tokens and
    45 to generate (its first from its prefill: 44 more positions). Whole, it joins at width 50:
    50 + 44 <= 100. In chunks of 8 tokens it joins 4 steps later (5 chunks), at width 54: 98, fits;
    in chunks of 4, 9 steps later, at 59: 103, it does not."""
    def fits(chunk: int) -> bool:
        scheduler = Scheduler(EngineSettings(prefill_chunk=chunk), 100)
        running = Row(list(range(50)), SamplingSettings(max_new_tokens=10), print)
        joiner = Row(list(range(40)), SamplingSettings(max_new_tokens=45), print)
        return scheduler._fits([running], [joiner], 50)

    assert fits(0) and fits(8) and not fits(4)


# ------------------------------------------------------------------ the engine, on every backend that serves


@pytest.fixture(scope="module")
def exports(bundled_export, tmp_path_factory):
    out = {p: bundled_export(p) for p in (Precision.fp32, Precision.int8)}
    out["int8-kv"] = with_int8_kv(out[Precision.int8], tmp_path_factory.mktemp("kv8") / "export")
    return out


def open_backend(kind: str, exports):
    if kind == "int8-int8-kv":  # the prefix cache's blocks in int8, as the cache stores them
        backend = OrtBackend(exports["int8-kv"], threads=1, kv_cache_dtype="int8")
        assert backend.kv_dtype == np.int8
        return backend
    if kind == "openvino":
        from gpt2x.runtime.openvino import OpenVinoBackend

        return OpenVinoBackend(exports[Precision.fp32], threads=1)
    precision = Precision.fp32 if kind == "fp32" else Precision.int8
    backend = OrtBackend(read_export(exports[precision].folder), threads=1, in_place_kv=False if kind != "int8-in-place" else None)
    assert backend.in_place_kv == (kind == "int8-in-place")
    return backend


class Collect:
    def __init__(self, clock: list[int] | None = None):
        self.tokens: list[int] = []
        self.ticks: list[int] = []  # the engine-wide count of tokens told when each of this row's came
        self.clock = clock
        self.end = None
        self.done = threading.Event()

    def __call__(self, out: Output) -> None:
        if isinstance(out, TokenOut):
            self.tokens.append(out.token)
            if self.clock is not None:
                self.clock[0] += 1
                self.ticks.append(self.clock[0])
        elif isinstance(out, (Finished, Failed)):
            self.end = ("done", out.reason) if isinstance(out, Finished) else ("error", out.message)
            self.done.set()


def run_rows(engine: Engine, prompts, settings, clock=None, wait: float = 120) -> list[tuple[Collect, Row]]:
    out = []
    for ids, s in zip(prompts, settings):
        sink = Collect(clock)
        row = Row(ids, s, sink)
        out.append((sink, row))
    engine.submit([r for _, r in out])
    for sink, _ in out:
        assert sink.done.wait(wait) and sink.end[0] == "done", sink.end
    return out


def reference(backend, ids, s) -> list[int]:
    return generate(backend, [""], s, prompt_ids=[ids])[0].tokens


@pytest.mark.parametrize("kind", ["fp32", "int8-in-place", "int8-growing", "openvino", "int8-int8-kv"])
def test_cached_prefixes_give_the_uncached_tokens(kind, exports):
    """A first request leaves its prompt's blocks; then four prompts that begin with the same 100
    tokens, together (one batch, rests of different lengths: 96 of them found in the cache) and one by
    one (all their own whole blocks found), take their prefixes from the cache and give the tokens of
    each prompt alone with no cache: greedy everywhere, and seeded sampling where the runtime is batch-
    invariant (fp32; int8's dynamic quantization scales each forward's activations as a whole, so a
    row's logits move with what it is computed beside)."""
    backend = open_backend(kind, exports)
    exact = kind in ("fp32", "openvino")
    engine = Engine(backend, EngineSettings(max_batch_size=8, batch_wait_s=0.05)).start()
    try:
        first = run_rows(engine, [SHARED + SUFFIXES[0]], [SamplingSettings(max_new_tokens=4, greedy=True)])
        assert first[0][1].cached_tokens == 0
        prompts = [SHARED + s for s in SUFFIXES]
        settings = [SamplingSettings(max_new_tokens=10, greedy=not exact or i % 2 == 0, temperature=0.9, seed=i)
                    for i in range(len(prompts))]
        together = run_rows(engine, prompts, settings)
        alone = [run_rows(engine, [p], [s])[0] for p, s in zip(prompts, settings)]
        for (ids, s), (sink, row), (sink1, row1) in zip(zip(prompts, settings), together, alone):
            want = reference(backend, ids, s)
            assert sink.tokens == want and sink1.tokens == want
            # Together, each feeds the longest rest (up to 15 of the shared blocks' tokens again); alone, every
            # whole block of its own prompt (stored by the batch before) but the one holding its last token.
            assert 96 - 16 <= row.cached_tokens <= 96 and row1.cached_tokens == (len(ids) - 1) // 16 * 16
        stats = engine.stats()
        assert stats["prefix_cache_hits"] >= 96 * 8 and stats["errors"] == 0
    finally:
        engine.close()
        backend.close()


@pytest.mark.parametrize("fresh_sooner", [True, False])
def test_the_cache_is_taken_where_the_backend_estimates_it_sooner(exports, monkeypatch, fresh_sooner):
    """A backend that estimates its prefills (capabilities.estimates_prefill): where a whole prompt is estimated
    sooner than its rest on the cached blocks (another runtime runs it), the prompt is prefilled whole, counted as a
    query without a hit; else the cache gives its blocks. The tokens are the uncached ones either way."""
    backend = open_backend("int8-growing", exports)
    seen = []

    def prefill_ms(rows, new_tokens, past_tokens):
        seen.append((rows, new_tokens, past_tokens))
        return (1.0 if past_tokens == 0 else 100.0) if fresh_sooner else float(new_tokens)

    monkeypatch.setattr(backend, "prefill_ms", prefill_ms, raising=False)
    engine = Engine(backend, EngineSettings(max_batch_size=4, batch_wait_s=0.05)).start()
    try:
        s = SamplingSettings(max_new_tokens=6, greedy=True)
        ids = SHARED + SUFFIXES[0]
        run_rows(engine, [ids], [s])  # leaves its blocks
        assert seen == []  # nothing held yet: no estimate asked
        (sink, row), = run_rows(engine, [ids], [s])
        held = (len(ids) - 1) // 16 * 16
        assert seen == [(1, len(ids) - held, held), (1, len(ids), 0)]
        assert sink.tokens == reference(backend, ids, s)
        stats = engine.stats()
        assert row.cached_tokens == (0 if fresh_sooner else held)
        assert stats["prefix_cache_hits"] == (0 if fresh_sooner else held)
        assert stats["prefix_cache_queries"] == 2 * len(ids)
    finally:
        engine.close()
        backend.close()


@pytest.mark.parametrize("kind", ["fp32", "int8-in-place", "int8-growing"])
def test_a_batch_sharing_a_prefix_computes_it_once(kind, exports):
    """Four prompts that begin with the same 100 tokens arrive together, the cache empty: the first is
    prefilled, the others wait for its blocks and find 96 tokens each in the cache (one batch
    still: their rows merged), and every row gives its tokens alone with no cache."""
    backend = open_backend(kind, exports)
    engine = Engine(backend, EngineSettings(max_batch_size=8, batch_wait_s=0.2)).start()
    try:
        prompts = [SHARED + s for s in SUFFIXES]
        settings = [SamplingSettings(max_new_tokens=8, greedy=True) for _ in prompts]
        rows = run_rows(engine, prompts, settings)
        cached = [row.cached_tokens for _, row in rows]  # the three together feed their longest rest
        assert cached[0] == 0 and all(96 - 16 <= c <= 96 for c in cached[1:])
        for ids, s, (sink, _) in zip(prompts, settings, rows):
            assert sink.tokens == reference(backend, ids, s)
        stats = engine.stats()
        assert stats["batches"] == 1 and stats["prefix_cache_hits"] == 3 * 96 and stats["errors"] == 0
    finally:
        engine.close()
        backend.close()


@pytest.mark.parametrize("kind", ["fp32", "int8-in-place"])
def test_a_long_prompt_joins_in_chunks_while_the_batch_streams(kind, exports):
    """A 150-token prompt joins a running row and is prefilled 16 tokens a step: the running row
    receives tokens while it is prefilled (9 chunks, 8 of them beside a decode step), and both rows
    give their tokens alone. With its prefix cached, the same prompt's prefill is shorter still."""
    backend = open_backend(kind, exports)
    engine = Engine(backend, EngineSettings(max_batch_size=4, prefill_chunk=16, max_join_delay_s=0,
                                            prefix_cache_mb=0)).start()
    clock = [0]
    long = encode(TEXT)[200:350]
    try:
        runner_sink = Collect(clock)
        running = Row(encode("ROMEO:"), SamplingSettings(max_new_tokens=60, greedy=True), runner_sink)
        engine.submit([running])
        deadline = time.time() + 60
        while len(runner_sink.tokens) < 3 and time.time() < deadline:
            time.sleep(0.005)
        joined = run_rows(engine, [long], [SamplingSettings(max_new_tokens=8, greedy=True)], clock)
        assert runner_sink.done.wait(60)
        [(jsink, _)] = joined
        during = [t for t in runner_sink.ticks if t < jsink.ticks[0]]
        assert len(during) >= 3 + 8  # the prefill's chunks ran between the running row's steps
        assert runner_sink.tokens == reference(backend, encode("ROMEO:"), SamplingSettings(max_new_tokens=60, greedy=True))
        assert jsink.tokens == reference(backend, long, SamplingSettings(max_new_tokens=8, greedy=True))
    finally:
        engine.close()
        backend.close()


@pytest.mark.parametrize("joins", [False, True], ids=["new-batch", "joining"])
def test_a_prompts_blocks_are_kept_once_its_first_token_is_told_while_the_batch_decodes_on(exports, joins):
    """The prefix cache copies a prompt's whole blocks (37 MB for 512 tokens of 124M fp32) only after the prompt's
    first token has been told, whether it starts a batch or joins one, and on the cache's own thread: the batch's
    next decode step does not wait for the copy (the copy here waits for that step's token, which an inline copy
    would never see). A later request for the same prompt still finds them."""
    backend = open_backend("int8-in-place", exports)
    engine = Engine(backend, EngineSettings(max_batch_size=4, batch_wait_s=0, max_join_delay_s=0)).start()
    ids = SHARED + SUFFIXES[0]
    sink = Collect()
    running = Collect()
    handed, told_at_store, stepped_meanwhile = [], [], []
    checked = threading.Event()  # the cache's thread may still be waiting when the row has finished
    keep_later, store = engine.prefix_cache.keep_later, engine.prefix_cache._store

    def handing(prompts, kv, end):
        if any(p == ids for _, p in prompts):
            handed.append(len(running.tokens) if joins else len(sink.tokens))
        return keep_later(prompts, kv, end)

    def storing(prompt, kv, row, end):
        if prompt == ids:
            told_at_store.append(len(sink.tokens))
            watched = running if joins else sink  # the next decode step's token: the running row's, or its own
            deadline = time.time() + 10
            while len(watched.tokens) <= handed[-1] and time.time() < deadline:
                time.sleep(0.005)
            stepped_meanwhile.append(len(watched.tokens) > handed[-1] and threading.current_thread() is not engine._thread)
            checked.set()
        return store(prompt, kv, row, end)

    engine.prefix_cache.keep_later, engine.prefix_cache._store = handing, storing
    try:
        if joins:  # a row decoding (its prompt shorter than a block: nothing to keep) that the prompt joins
            engine.submit([Row(encode("ROMEO:"), SamplingSettings(max_new_tokens=200, greedy=True), running)])
            deadline = time.time() + 60
            while len(running.tokens) < 3 and time.time() < deadline:
                time.sleep(0.005)
        row = Row(ids, SamplingSettings(max_new_tokens=12, greedy=True), sink)
        engine.submit([row])
        assert sink.done.wait(120) and sink.end[0] == "done"
        assert told_at_store and min(told_at_store) >= 1  # stored after the first token, never before
        assert checked.wait(15) and stepped_meanwhile == [True]
        assert engine.stats()["joins"] == (1 if joins else 0)
        (again, again_row), = run_rows(engine, [ids], [SamplingSettings(max_new_tokens=12, greedy=True)])
        assert again_row.cached_tokens == (len(ids) - 1) // 16 * 16 and again.tokens == sink.tokens
    finally:
        engine.close()
        backend.close()


def test_genai_serves_without_a_prefix_cache(bundled_export):
    """onnxruntime-genai's generator owns its cache (capabilities.takes_past False): the engine keeps
    no prefix cache there, says none was used, and serves the same tokens."""
    from gpt2x.runtime.genai import GenaiBackend

    backend = GenaiBackend(bundled_export(Precision.fp32), threads=1)
    engine = Engine(backend, EngineSettings(max_batch_size=4)).start()
    try:
        assert engine.prefix_cache is None
        s = SamplingSettings(max_new_tokens=6, greedy=True)
        rows = [run_rows(engine, [SHARED + SUFFIXES[0]], [s])[0] for _ in range(2)]
        assert rows[1][1].cached_tokens == 0 and rows[0][0].tokens == rows[1][0].tokens
        assert "prefix_cache_hits" not in engine.stats()
    finally:
        engine.close()
        backend.close()
