"""Greedy decoding's argmax taken where the logits are (runtime.base.greedy_step): ONNX Runtime's
one-node ArgMax graph (what runs on the CUDA device, run here on the CPU provider) against NumPy's
argmax, ties included, and the decode loop's greedy path against the sampler's."""

from __future__ import annotations

import numpy as np
import onnxruntime as ort
import pytest

from gpt2x.generation.decode import Sequence, decode_steps
from gpt2x.generation.sampling import Sampler
from gpt2x.generation.settings import SamplingSettings
from gpt2x.numerics import positions
from gpt2x.runtime.base import greedy_step
from gpt2x.runtime.ort import OrtBackend
from gpt2x.runtime.providers import create_session, last_argmax_model
from gpt2x.runtime.pytorch import TorchBackend

from ..helpers import check_step_greedy


@pytest.fixture(scope="module")
def tiny(tiny_export):
    model, _, info = tiny_export(n_positions=64)
    return model, info




def test_the_argmax_graph_is_numpys_ties_included():
    from gpt2x.choices import ProviderKind

    session = create_session(last_argmax_model(), ProviderKind.cpu)
    rng = np.random.default_rng(0)
    for shape in ((1, 1, 50257), (3, 5, 50257), (2, 2, 7)):
        x = rng.standard_normal(shape).astype(np.float32)
        x[0, -1, 3] = x[0, -1, shape[2] - 1] = x.max() + 1  # two equal maxima: the first wins
        [y] = session.run(None, {"x": x})
        assert y.shape == (shape[0], 1) and y.dtype == np.int64
        assert np.array_equal(y[:, 0], x[:, -1].argmax(axis=-1))


def test_ort_argmax_on_device_equals_step_argmax(tiny):
    _, info = tiny
    backend = OrtBackend(info)
    ids = np.random.default_rng(1).integers(0, 50257, (3, 5))
    mask = np.ones_like(ids)
    mask[0, :2] = 0
    logits, _ = backend.run(ids, mask, positions(mask, 5), None)  # (B, T, V): every position
    value = ort.OrtValue.ortvalue_from_numpy(np.ascontiguousarray(logits))
    assert np.array_equal(backend.argmax_on_device(value), logits[:, -1].argmax(axis=-1))
    check_step_greedy(backend)


@pytest.mark.parametrize("kind", ["torch", "ort"])
def test_greedy_decode_loop_equals_the_samplers_argmax(tiny, kind):
    """The decode loop's greedy path (greedy_step) against a loop of step + Sampler(greedy)."""
    model, info = tiny
    backend = TorchBackend(model) if kind == "torch" else OrtBackend(info)
    assert (getattr(backend, "step_greedy", None) is not None) is (kind == "ort")
    ids = np.random.default_rng(2).integers(0, 50257, (2, 4))
    mask = np.ones_like(ids)
    sampler = Sampler(SamplingSettings(greedy=True, max_new_tokens=12))
    seqs = [Sequence(row.tolist(), SamplingSettings(greedy=True, max_new_tokens=12, ignore_eos=True)) for row in ids]
    list(decode_steps(backend, seqs))
    got = np.array([s.tokens for s in seqs])
    want = []
    logits, past = backend.step(ids, mask, positions(mask, 4), None)
    for _ in range(12):
        nxt = sampler(logits)
        want.append(nxt)
        mask = np.concatenate([mask, np.ones((2, 1), dtype=np.int64)], axis=1)
        logits, past = backend.step(nxt[:, None], mask, positions(mask, 1), past)
    assert np.array_equal(got, np.stack(want, axis=1))
    one = greedy_step(backend)(ids[:1], np.ones((1, 4), dtype=np.int64), positions(np.ones((1, 4), dtype=np.int64), 4), None)[0]
    assert np.array_equal(one, backend.step(ids[:1], np.ones((1, 4), dtype=np.int64), positions(np.ones((1, 4), dtype=np.int64), 4),
                                            None)[0].argmax(axis=-1))


def test_a_wrapper_that_changes_step_is_not_bypassed(tiny):
    """A wrapper that changes `step` and hands the rest on (__getattr__) keeps greedy decoding on its
    own `step`, not on the wrapped backend's step_greedy."""
    _, info = tiny

    class Forced:
        def __init__(self, inner):
            self.inner = inner

        def __getattr__(self, name):
            return getattr(self.inner, name)

        def step(self, ids, mask, pos, past):
            logits, past = self.inner.step(ids, mask, pos, past)
            logits[:, 11] = logits.max() + 1
            return logits, past

    seq = Sequence([5, 6, 7], SamplingSettings(greedy=True, max_new_tokens=3))
    list(decode_steps(Forced(OrtBackend(info)), [seq]))
    assert seq.tokens == [11, 11, 11]
