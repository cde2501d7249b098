"""base.past_to_fill: a past written straight into the buffers the backend's next cache holds (the prefix cache's
blocks, gathered by the serving runner), or into new arrays for past_from_numpy where the backend offers none."""

from __future__ import annotations

import numpy as np
import pytest

from gpt2x.choices import Precision
from gpt2x.numerics import positions
from gpt2x.runtime.base import past_to_fill
from gpt2x.runtime.ort import InPlaceCache, OrtBackend

IDS = np.array([[5, 9, 2, 7, 1, 3, 8], [4, 4, 6, 1, 2, 9, 3]], dtype=np.int64)
PAST = 5  # the positions written as a past; the other two are stepped on it


def step_after(backend: OrtBackend, cache) -> np.ndarray:
    """Logits (B, V) of the last two tokens run on `cache` (the first PAST tokens' past)."""
    mask = np.ones_like(IDS)
    return backend.step(IDS[:, PAST:], mask, positions(mask, IDS.shape[1])[:, PAST:], cache)[0]


@pytest.mark.parametrize("precision,in_place,kv_dtype", [
    ("fp32", True, None), ("fp32", False, None), ("int8", True, "int8")], ids=["fp32-in-place", "fp32-growing", "int8-kv8"])
def test_a_past_written_into_the_offered_buffers_steps_as_one_taken_from_numpy(tiny_export, precision, in_place, kv_dtype):
    """The in-place cache offers its own buffers (written once: the cache then holds the same memory), the growing
    cache none (new arrays, then past_from_numpy); either way the step after it gives the logits of a past taken by
    past_from_numpy (a copy), and at fp32 those of the no-cache forward of the whole sequence."""
    _, _, info = tiny_export(Precision(precision), int8_kv=kv_dtype is not None)
    backend = OrtBackend(info, threads=1, in_place_kv=in_place, kv_cache_dtype=kv_dtype)
    mask = np.ones_like(IDS[:, :PAST])
    stored = backend.run(IDS[:, :PAST], mask, positions(mask, PAST), None)[1].stored()  # as the prefix cache keeps it
    arrays, finish = past_to_fill(backend, stored[0].shape, len(stored), stored[0].dtype)
    for a, s in zip(arrays, stored):
        a[...] = s
    cache = finish()
    assert isinstance(cache, InPlaceCache) == in_place
    if in_place:  # no copy: the arrays written are the cache's own memory
        assert all(np.shares_memory(a, b) for a, b in zip(arrays, cache.buffers.arrays))
    got = step_after(backend, cache)
    want = step_after(backend, backend.past_from_numpy([s.copy() for s in stored]))
    np.testing.assert_array_equal(got, want)
    if precision == "fp32":
        whole = np.ones_like(IDS)
        reference = backend.run(IDS, whole, positions(whole, IDS.shape[1]), None)[0][:, -1]
        np.testing.assert_allclose(got, reference, atol=1e-4, rtol=1e-4)
