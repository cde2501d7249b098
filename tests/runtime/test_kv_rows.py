"""Rows leaving and joining a batch's KV cache (`Backend.merge`): inside fixed-capacity buffers
(kvbuffers.merge_rows, ONNX Runtime's in-place cache and OpenVINO's), through host arrays (ONNX
Runtime's growing cache) and with torch ops, each against the plain NumPy reference the engine used
before (stack both caches right-aligned, then take rows); and the serving engine on the in-place
cache, rows leaving and joining (narrower and wider prompts, holes, compaction, leading columns
dropped), against each row generated alone and against the growing cache."""

from __future__ import annotations

import ctypes
import mmap
import threading
import time
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given
from hypothesis import settings as hsettings
from hypothesis import strategies as st

from gpt2x.generation.generate import generate, left_pad
from gpt2x.generation.settings import SamplingSettings
from gpt2x.numerics import positions
from gpt2x.runtime.base import right_aligned_rows
from gpt2x.runtime.kvbuffers import MERGE_MIN_ROWS, KVBuffers, KVCacheView, merge_rows, refuse_stale
from gpt2x.runtime.ort import InPlaceCache, OrtBackend
from gpt2x.runtime.pytorch import TorchBackend
from gpt2x.serve.core.engine import Engine, EngineSettings, Row
from gpt2x.serve.core.outputs import Finished, TokenOut
from gpt2x.serve.core.scheduler import layout
from gpt2x.tokenizer import encode

from ..helpers import REPO


def stack_right_aligned(a: np.ndarray, b: np.ndarray, width: int) -> np.ndarray:
    """The engine's former host path, verbatim: a (Ba, H, Ta, D) and b (Bb, H, Tb, D) stacked into
    (Ba + Bb, H, width, D), each right-aligned (zeros before, positions beyond `width` dropped)."""
    out = np.zeros((a.shape[0] + b.shape[0], a.shape[1], width, a.shape[3]), dtype=a.dtype)
    for rows, x in ((slice(0, a.shape[0]), a), (slice(a.shape[0], None), b)):
        keep = min(width, x.shape[2])
        out[rows, :, width - keep :] = x[:, :, x.shape[2] - keep :]
    return out


def reference(cache: list[np.ndarray], joiner: list[np.ndarray] | None, rows, width: int) -> list[np.ndarray]:
    if joiner is None:
        joiner = [a[:0] for a in cache]
    return [stack_right_aligned(a, b, width)[np.asarray(rows)] for a, b in zip(cache, joiner)]


# ------------------------------------------------------------------ the row operations on arrays


class Recording(np.ndarray):
    """An array that records which of its rows (first index) are written."""

    def __setitem__(self, index, value):
        first = index[0] if isinstance(index, tuple) else index
        rows = range(*first.indices(self.shape[0])) if isinstance(first, slice) else np.atleast_1d(first).tolist()
        self.__dict__.setdefault("written", set()).update(int(r) for r in rows)
        super().__setitem__(index, value)


H, D, COUNT = 2, 3, 4  # heads, head size, cache tensors (2 layers)


def garbage(batch: int, capacity: int, keep=None) -> KVBuffers:
    """Buffers as ONNX Runtime's spare ones: nothing set (NaN here, so unset values show)."""
    return KVBuffers([np.full((batch, H, capacity, D), np.nan, dtype=np.float32).view(Recording) for _ in range(COUNT)])


@st.composite
def merges(draw):
    n = draw(st.integers(1, 5))
    batch = draw(st.integers(n, 7))
    length = draw(st.integers(1, 9))
    capacity = draw(st.integers(length, 12))
    joined = draw(st.integers(0, 3))
    joiner_length = draw(st.integers(1, 11))
    size = draw(st.integers(1, 8))
    rows = draw(st.lists(st.integers(0, n + joined - 1), min_size=size, max_size=size))
    if draw(st.booleans()):  # distinct rows, as the engine's layouts have
        rows = list(dict.fromkeys(rows))
    width = draw(st.integers(1, 14))
    return n, batch, length, capacity, joined, joiner_length, rows, width, draw(st.integers(0, 2**31 - 1))


@hsettings(max_examples=300, deadline=None)
@given(merges(), st.booleans())
def test_merge_rows_equals_the_host_reference(case, whole_context):
    n, batch, length, capacity, joined, joiner_length, rows, width, seed = case
    rng = np.random.default_rng(seed)
    buffers = garbage(batch, capacity)
    for a in buffers.arrays:
        a[:n, :, :length] = rng.standard_normal((n, H, length, D))
    buffers.length, buffers.rows = length, n
    for a in buffers.arrays:
        a.__dict__.pop("written", None)
    cache = KVCacheView(buffers, length)
    before = [a.copy() for a in cache.filled()]
    joiner = [rng.standard_normal((joined, H, joiner_length, D)).astype(np.float32) for _ in range(COUNT)] if joined else None
    allocated: list[KVBuffers] = []

    def allocate(b: int, c: int, keep) -> KVBuffers:
        assert keep is None  # merge_rows copies the rows itself
        allocated.append(garbage(b, c))
        return allocated[-1]

    out = merge_rows(cache, np.asarray(rows), joiner, width, allocate, n_positions=16, capacity_step=4,
                     whole_context=whole_context)
    want = reference(before, joiner, rows, width)
    got = KVCacheView(out, out.length).filled()
    assert all(np.array_equal(g, w) for g, w in zip(got, want))  # no NaN: every position written or kept
    assert out.rows == len(rows) and out.length == width
    with pytest.raises(ValueError, match="already stepped from"):
        refuse_stale(cache)
    fits = len(rows) <= batch and width <= capacity
    assert (out is buffers) is fits and len(allocated) == (0 if fits else 1)
    if fits:  # only the rows that move are written
        moving = {i for i, r in enumerate(rows) if r != i or r >= n or width != length}
        assert all(a.__dict__.get("written", set()) == moving for a in out.arrays)
    else:
        assert buffers.retired and cache.stale
        assert out.capacity == 16 if whole_context else out.capacity >= width
        assert out.batch == (batch if len(rows) <= batch else max(len(rows), 2 * batch, MERGE_MIN_ROWS))


def test_merge_rows_refuses_rows_it_does_not_have():
    buffers = garbage(2, 4)
    buffers.length = 2
    cache = KVCacheView(buffers, 2)
    for rows in ([2], [], [-1]):
        with pytest.raises(ValueError, match="rows must pick"):
            merge_rows(cache, np.asarray(rows, dtype=np.int64), None, 2, garbage, 8)
    with pytest.raises(ValueError, match="outside the model's context"):
        merge_rows(cache, np.asarray([0]), None, 9, garbage, 8)


def test_a_view_made_before_a_merge_is_stale_even_at_the_same_shape():
    """One row leaves, one joins at the same width: the rows and length are what they were, but the
    view from before reads a row that is no longer its own."""
    buffers = garbage(2, 4)
    buffers.length = 3
    cache = KVCacheView(buffers, 3)
    joiner = [np.ones((1, H, 3, D), dtype=np.float32)] * COUNT
    merged = merge_rows(cache, np.asarray([0, 2]), joiner, 3, garbage, 8)
    assert merged is buffers and merged.rows == 2 and merged.length == 3
    assert cache.stale and not KVCacheView(merged, 3).stale


@hsettings(max_examples=100, deadline=None)
@given(merges())
def test_the_host_path_equals_the_reference(case):
    n, _, length, _, joined, joiner_length, rows, width, seed = case
    rng = np.random.default_rng(seed)
    cache = [rng.standard_normal((n, H, length, D)).astype(np.float32) for _ in range(COUNT)]
    joiner = [rng.standard_normal((joined, H, joiner_length, D)).astype(np.float32) for _ in range(COUNT)] if joined else None
    parts = [cache] + ([joiner] if joiner else [])
    got = right_aligned_rows(parts, np.asarray(rows), width)
    assert all(np.array_equal(g, w) for g, w in zip(got, reference(cache, joiner, rows, width)))


def test_layouts_keep_live_rows_in_place_and_fill_holes():
    # rows 1 and 3 left; two join: they take the holes, nothing else moves
    assert layout([0, 2, 4], 5, [5, 6]).tolist() == [0, 5, 2, 6, 4]
    # rows 0 and 1 left, nobody joins: the last live rows move into the holes
    assert layout([2, 3, 4, 5], 6, []).tolist() == [4, 5, 2, 3]
    # more join than left: the holes, then new rows at the end
    assert layout([0, 2], 3, [3, 4, 5]).tolist() == [0, 3, 2, 4, 5]
    # a joiner that ended at its first token (not in joining) leaves its number unused
    assert layout([1], 2, [3]).tolist() == [3, 1]


# ------------------------------------------------------------------ backends


@pytest.fixture(scope="module")
def tiny(tiny_export):
    """A tiny model, its fp32 export and that export rewritten to GroupQueryAttention (the int8
    graph's attention with fp32 weights: the in-place cache, batch-invariant like fp32)."""
    model, _, info = tiny_export(n_positions=128)
    return model, info, tiny_export(n_positions=128, gqa=True)[2]


PROMPT_TEXTS = ("ROMEO:", "The king is dead, and long live the king", "What light", "O",
                "Now is the winter of our discontent made glorious summer by this sun of York")
PROMPT_IDS = [encode(t) for t in PROMPT_TEXTS]


def prefill(backend, prompts):
    ids, mask = left_pad(prompts)
    logits, past = backend.step(ids, mask, positions(mask, ids.shape[1]), None)
    return mask, logits, past


def decode(backend, mask, tokens, past, steps: int):
    """`steps` greedy steps from `tokens`; returns the mask, every step's logits and the cache."""
    out = []
    for _ in range(steps):
        mask = np.concatenate([mask, np.ones((len(mask), 1), dtype=np.int64)], axis=1)
        logits, past = backend.step(tokens[:, None], mask, positions(mask, 1), past)
        out.append(logits)
        tokens = logits.argmax(-1)
    return mask, out, past


def fit(mask: np.ndarray, width: int) -> np.ndarray:
    T = mask.shape[1]
    return mask[:, T - width :] if T >= width else np.pad(mask, [(0, 0), (width - T, 0)])


# (batch prompts, joiner prompts, rows of [batch; joiners], width as "narrow" / "wide" / "same")
SCENARIOS = {
    "joiners narrower, a hole filled": ([0, 1, 2], [3, 2], [0, 3, 2, 4], "same"),
    "a joiner wider: every row moves right": ([0, 2], [4], [2, 1, 0], "wide"),
    "rows leave, leading columns dropped": ([1, 0, 3], None, [2, 1], "narrow"),
    "more rows than the buffers have": ([2], [0, 1, 3, 4], [0, 1, 2, 3, 4], "wide"),
}


@pytest.mark.parametrize("scenario", list(SCENARIOS))
def test_backends_merge_as_the_reference_and_decode_on(tiny, scenario):
    """The same merge on ONNX Runtime's in-place cache, its growing cache, PyTorch and (where it
    loads) OpenVINO: the merged cache equals the reference built from the caches before, and decoding
    on from it gives the same logits on every backend."""
    model, mha, gqa = tiny
    batch, joiners, rows, how = SCENARIOS[scenario]
    backends = {"in-place": OrtBackend(gqa, in_place_kv=True), "growing": OrtBackend(gqa, in_place_kv=False),
                "mha": OrtBackend(mha), "torch": TorchBackend(model)}
    try:
        from gpt2x.runtime.openvino import OpenVinoBackend

        backends["openvino-mha"] = OpenVinoBackend(mha, threads=1)
        backends["openvino-gqa"] = OpenVinoBackend(gqa, threads=1)
    except ImportError:
        pass
    results = {}
    for name, b in backends.items():
        mask, logits, past = prefill(b, [PROMPT_IDS[i] for i in batch])
        mask, _, past = decode(b, mask, logits.argmax(-1), past, 3)
        masks, caches, tokens = [mask], [past.to_numpy()], [np.full(len(batch), 7)]
        jpast = None
        if joiners:
            jmask, jlogits, jpast = prefill(b, [PROMPT_IDS[i] for i in joiners])
            masks.append(jmask)
            caches.append(jpast.to_numpy())
            tokens.append(jlogits.argmax(-1))
        kept = mask[[r for r in rows if r < len(batch)]]
        used = kept.shape[1] - int(np.argmax(kept.any(0)))  # the columns the kept rows use
        width = {"same": mask.shape[1], "wide": max(mask.shape[1], jmask.shape[1] if joiners else 0) + 2, "narrow": used}[how]
        merged = past.merge(np.asarray(rows), jpast, width)
        if name == "in-place":
            assert isinstance(merged, InPlaceCache) and merged.length == width
            assert past.stale and (jpast is None or not jpast.stale)
        want = reference(caches[0], caches[1] if joiners else None, rows, width)
        assert all(np.array_equal(g, w) for g, w in zip(merged.to_numpy(), want))
        merged_mask = np.concatenate([fit(m, width) for m in masks])[rows]
        _, logits, _ = decode(b, merged_mask, np.concatenate(tokens)[rows], merged, 4)
        results[name] = np.stack(logits)
    assert np.array_equal(results["in-place"].argmax(-1), results["growing"].argmax(-1))
    for name, got in results.items():
        np.testing.assert_allclose(got, results["torch"], rtol=0, atol=2e-4, err_msg=name)


# ------------------------------------------------------------------ the engine on the in-place cache


class Recorded:
    """A backend whose caches' merges are recorded: (rows before, width before, rows picked, width,
    rows the buffers had), the last only for the in-place cache. Its steps hand out the backend's
    caches wrapped (RecordedCache), which the backend steps from as its own."""

    def __init__(self, inner):
        self.inner, self.merges = inner, []

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def step(self, input_ids, attention_mask, position_ids, past):
        logits, cache = self.inner.step(input_ids, attention_mask, position_ids, past)
        return logits, RecordedCache(self, cache)


class RecordedCache:
    def __init__(self, recorded: Recorded, cache):
        self.recorded, self.cache = recorded, cache

    def __getattr__(self, name):
        return getattr(self.cache, name)

    def merge(self, rows, joiner, width):
        c = self.cache
        self.recorded.merges.append((c.rows, c.length, rows.tolist(), width, c.buffers.batch if isinstance(c, InPlaceCache) else None))
        return RecordedCache(self.recorded, c.merge(rows, None if joiner is None else joiner.cache, width))


LINES = [line for line in (REPO / "tests/data/tinyshakespeare.txt").read_text().splitlines() if len(line) > 12]


def scenario_rows():
    """(prompt ids, settings, submitted with): a long row first, then joiners narrower than the batch
    and one wider, rows that leave early (holes), sampled and greedy."""
    def ids(i: int, n: int) -> list[int]:
        return encode(" ".join(LINES[i : i + 20]))[:n]

    return {
        "A": (ids(0, 30), SamplingSettings(max_new_tokens=20, greedy=True), None),
        "B": (ids(10, 5), SamplingSettings(max_new_tokens=6, greedy=True), ("A", 2)),
        "C": (ids(20, 12), SamplingSettings(max_new_tokens=30, seed=3, top_p=0.9), ("A", 2)),
        "D": (ids(30, 80), SamplingSettings(max_new_tokens=10, greedy=True), ("C", 8)),
        "E": (ids(40, 3), SamplingSettings(max_new_tokens=5, seed=5), ("D", 3)),
        "F": (ids(50, 20), SamplingSettings(max_new_tokens=24, greedy=True), ("D", 3)),
        "G": (ids(60, 2), SamplingSettings(max_new_tokens=4, greedy=True), ("F", 16)),
    }


def run_scenario(backend) -> tuple[dict[str, list[int]], Recorded, dict]:
    """The scenario on an engine (batches of up to 4): each group is submitted, together, from the
    callback of the row it waits for, so every join happens at the same step on every backend."""
    plan = scenario_rows()
    recorded = Recorded(backend)
    engine = Engine(recorded, EngineSettings(max_batch_size=4, max_join_delay_s=0, batch_wait_s=0)).start()
    tokens: dict[str, list[int]] = {name: [] for name in plan}
    done = {name: threading.Event() for name in plan}

    def submit(names: list[str]) -> None:
        engine.submit([Row(plan[n][0], plan[n][1], sink(n)) for n in names])

    def sink(name: str):
        def on(out):
            if isinstance(out, TokenOut):
                tokens[name].append(out.token)
                waiting = [n for n, (_, _, after) in plan.items() if after == (name, len(tokens[name]))]
                if waiting:
                    submit(waiting)
            else:
                assert isinstance(out, Finished), out
                done[name].set()
        return on

    try:
        submit(["A"])
        deadline = time.time() + 120
        while time.time() < deadline and not all(e.is_set() for e in done.values()):
            time.sleep(0.01)
        assert all(e.is_set() for e in done.values()), {n: len(t) for n, t in tokens.items()}
        return tokens, recorded, engine.stats()
    finally:
        engine.close()


def test_rows_leave_and_join_inside_the_in_place_cache(tiny):
    """Each row's tokens are those it gets alone (greedy and sampled: the GroupQueryAttention graph
    with fp32 weights), and those of the same scenario on the growing cache; the scenario went
    through every kind of merge."""
    _, _, gqa = tiny
    in_place = OrtBackend(gqa, threads=1, in_place_kv=True)
    got, recorded, stats = run_scenario(in_place)
    for name, (ids, settings, _) in scenario_rows().items():
        alone = generate(in_place, [""], settings, prompt_ids=[ids])[0].tokens
        assert got[name] == alone, name
        assert len(got[name]) == settings.max_new_tokens  # random weights: no row ends early
    growing, growing_recorded, _ = run_scenario(OrtBackend(gqa, threads=1, in_place_kv=False))
    assert growing == got
    assert [m[2:4] for m in growing_recorded.merges] == [m[2:4] for m in recorded.merges]
    assert stats["joins"] >= 4 and stats["compactions"] >= 1 and stats["errors"] == 0
    merges = recorded.merges
    assert any(width > before for _, before, _, width, _ in merges)  # a wider joiner: rows moved right
    assert any(width < before for _, before, _, width, _ in merges)  # leading columns dropped
    assert any(len(rows) > batch for _, _, rows, _, batch in merges)  # the buffers needed more rows
    # a joiner took the place of a row that left, inside the batch
    assert any(any(r >= n and i < n for i, r in enumerate(rows)) for n, _, rows, _, _ in merges)


def test_idle_buffers_hand_out_only_memory_nothing_references():
    """IdleBuffers: a block is handed out again only once no array, view or OrtValue of it is left, only for
    a size it fits (at most twice it), and at most keep_bytes of idle blocks are kept (the newest)."""
    import onnxruntime as ort

    from gpt2x.runtime.kvbuffers import IdleBuffers, small_page_arrays

    shape = (2, 3, 8, 4)  # 768 bytes in float32
    pool = IdleBuffers(keep_bytes=4 * 768)
    arrays = pool.adopt(small_page_arrays(shape, 2, np.float32))
    where = [a.ctypes.data for a in arrays]
    assert pool.take(shape, 1, np.float32) is None  # both still held
    view = arrays[0][:1, :, 2:]
    value = ort.OrtValue.ortvalue_from_numpy(arrays[1][:1])
    del arrays
    assert pool.take(shape, 1, np.float32) is None  # a view of one, an OrtValue over the other
    del value
    again = pool.take(shape, 1, np.float32)
    assert again is not None and again[0].ctypes.data == where[1] and again[0].shape == shape
    assert pool.take(shape, 1, np.float32) is None  # the other is still seen through `view`
    del view, again
    assert sorted(a.ctypes.data for a in pool.take(shape, 2, np.float32)) == sorted(where)  # both idle
    assert pool.take((2, 3, 3, 4), 1, np.float32) is None  # 288 bytes: a 768-byte block is over twice that
    assert pool.take((2, 3, 5, 4), 1, np.float32)[0].ctypes.data in where  # 480 bytes: it fits
    pool.adopt(small_page_arrays(shape, 6, np.float32))  # dropped at once: 8 idle blocks
    held = pool.adopt(small_page_arrays(shape, 1, np.float32))  # trims them to the 4 newest idle ones
    assert len(pool._blocks) == 5 and not {b.ctypes.data for b in pool._blocks} & set(where)
    assert held[0].ctypes.data in {b.ctypes.data for b in pool._blocks}


def _vm_flags(address: int) -> set[str]:
    """The VmFlags of the mapping (/proc/self/smaps) that holds `address`."""
    lines, inside = Path("/proc/self/smaps").read_text().splitlines(), False
    for line in lines:
        first = line.split()[0]
        if "-" in first and ":" not in first:
            start, end = (int(x, 16) for x in first.split("-"))
            inside = start <= address < end
        elif inside and line.startswith("VmFlags:"):
            return set(line.split()[1:])
    raise AssertionError(f"no mapping holds {address:#x}")


@pytest.mark.skipif(not Path("/proc/self/smaps").exists() or not Path("/sys/kernel/mm/transparent_hugepage").exists(),
                    reason="reads Linux's /proc/self/smaps, on a kernel with transparent huge pages")
def test_small_page_arrays_hold_their_first_rows_in_huge_pages_written_and_the_rest_in_small_pages_unwritten():
    """kvbuffers.small_page_arrays(held=k): rows 0..k-1 advised huge pages (VmFlags hg) and zeroed now, the rest
    advised small pages (nh) and left to the kernel's zero pages (not resident until written)."""
    from gpt2x.runtime.kvbuffers import small_page_arrays

    row = 4 << 20  # 4 MiB a row
    a, = small_page_arrays((4, row), 1, np.uint8, held=2)
    assert "hg" in _vm_flags(a[0].ctypes.data) and "hg" in _vm_flags(a[1].ctypes.data + row - 1)
    assert "nh" in _vm_flags(a[2].ctypes.data) and "hg" not in _vm_flags(a[3].ctypes.data)
    resident = np.zeros((a.nbytes + mmap.PAGESIZE - 1) // mmap.PAGESIZE, np.uint8)
    libc = ctypes.CDLL(None)
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    assert libc.mincore(a.ctypes.data, a.nbytes, resident.ctypes.data) == 0
    pages = row // mmap.PAGESIZE
    assert resident[: 2 * pages].all() and not resident[2 * pages:].any()
    assert not a.any()  # (read after: reading maps the kernel's zero page)


def test_the_in_place_cache_reuses_a_finished_generations_memory_and_decodes_as_before(tiny):
    """The in-place cache's buffers after a generation that filled them: the next generation takes their memory
    (unset: what they held stays until written) and gives the tokens and logits of a backend that never ran."""
    _, _, gqa = tiny
    used, fresh = OrtBackend(gqa, in_place_kv=True), OrtBackend(gqa, in_place_kv=True)
    settings = SamplingSettings(max_new_tokens=12, greedy=True)
    generate(used, [PROMPT_TEXTS[4]], settings)  # the longest prompt: every buffer written well past the next one's
    assert used.idle.reused == 0
    for text in (PROMPT_TEXTS[0], PROMPT_TEXTS[2]):
        a, b = generate(used, [text], settings)[0], generate(fresh, [text], settings)[0]
        assert a.tokens == b.tokens
    assert used.idle.reused > 0
    mask = np.ones((1, len(PROMPT_IDS[1])), dtype=np.int64)
    ids = np.asarray([PROMPT_IDS[1]])
    got, _ = used.step(ids, mask, positions(mask, ids.shape[1]), None)
    want, _ = fresh.step(ids, mask, positions(mask, ids.shape[1]), None)
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-5)
