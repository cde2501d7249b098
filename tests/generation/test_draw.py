"""sampling.draw_scores: the token of the float64 inverse CDF (softmax, then `_inverse_cdf`) always, from masses
computed in float32 first, the rows within their rounding of a boundary drawn again in float64."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from gpt2x import numerics
from gpt2x.generation import sampling
from gpt2x.generation.processors import History, softmax
from gpt2x.generation.settings import SamplingSettings
from gpt2x.numerics import CDF_BLOCK

V = 50257  # GPT-2's vocabulary: 49 blocks and a short one
INVERSE_CDF = sampling._inverse_cdf


def float64_way(scores: np.ndarray, u: np.ndarray) -> np.ndarray:
    return INVERSE_CDF(softmax(scores), u)


@pytest.fixture
def redrawn(monkeypatch):
    """The rows draw_scores draws again the float64 way, counted."""
    count = [0]

    def counted(p, u):
        count[0] += len(u)
        return INVERSE_CDF(p, u)

    monkeypatch.setattr(sampling, "_inverse_cdf", counted)
    return count


def cases(rng):
    """(scores, uniforms): peaked and flat rows, masked tokens, a short last block, one row and sixteen."""
    for rows, n, spread, masked in [(1, V, 3.0, 0.0), (16, V, 3.0, 0.0), (16, V, 10.0, 0.0), (8, V, 0.3, 0.0),
                                    (16, V, 3.0, 0.9), (4, 3 * CDF_BLOCK + 7, 2.0, 0.5), (3, CDF_BLOCK + 1, 1.0, 0.0)]:
        scores = rng.standard_normal((rows, n)) * spread + 20.0  # not centred: the maximum is taken off
        scores[rng.random(scores.shape) < masked] = -np.inf
        scores[:, 0] = 25.0  # every row keeps a token
        yield scores, rng.random(rows)


def test_the_same_token_as_the_float64_way_at_random_cuts_and_most_rows_decided_in_float32(redrawn):
    rng = np.random.default_rng(0)
    for scores, _ in cases(rng):
        before = redrawn[0]
        for _ in range(20):
            u = rng.random(len(scores))
            np.testing.assert_array_equal(sampling.draw_scores(scores, u), float64_way(scores, u))
        if scores.shape == (16, V) and np.isfinite(scores).all() and scores.std() > 5:
            # peaked rows: the cut lands in a token of far more mass than the rounding, decided in float32 (a row
            # whose mass is spread over many small tokens is drawn again more often: 10 to 20% of the flat ones here)
            assert redrawn[0] - before <= 0.01 * 20 * 16, redrawn[0] - before


def test_cuts_on_a_boundary_are_drawn_again_and_give_the_float64_token(redrawn):
    """u exactly at a token's end (float64's cumulative mass there), at 0 and just past an end: the float32 masses
    cannot tell which side, so the row is drawn again, and the token is float64's."""
    rng = np.random.default_rng(1)
    for scores, _ in cases(rng):
        rows, n = scores.shape
        cdf = np.cumsum(softmax(scores), axis=-1)
        ends = cdf[np.arange(rows), rng.integers(0, n, rows)] / cdf[:, -1]
        for u in (ends, np.nextafter(ends, 2.0), np.zeros(rows)):
            before = redrawn[0]
            np.testing.assert_array_equal(sampling.draw_scores(scores, u), float64_way(scores, u))
            assert redrawn[0] - before == rows  # every row drawn again


def test_hand_computed_draws_and_the_rows_float64_takes_whole():
    """Masses 0.5, 0.3, 0.2 on tokens 3, 1500 and 4000 of 5000 (the rest removed): cuts 0.1, 0.6 and 0.95 fall in
    them. A row of +inf scores, a row with nothing left and a one-block vocabulary go the float64 way whole."""
    scores = np.full((3, 5000), -np.inf)
    scores[:, [3, 1500, 4000]] = np.log([0.5, 0.3, 0.2]) + 7.0
    assert sampling.draw_scores(scores, np.array([0.1, 0.6, 0.95])).tolist() == [3, 1500, 4000]
    inf = np.zeros((2, 5000))
    inf[0, [10, 20]] = np.inf
    assert sampling.draw_scores(inf, np.array([0.2, 0.5]))[0] == 10
    small = np.log(np.array([[0.25, 0.25, 0.5]]))
    assert sampling.draw_scores(small, np.array([0.6])).tolist() == [2]


def test_the_sampler_and_a_batch_draw_the_float64_tokens():
    """Sampler() and sample_many, which draw through it, give the tokens of the float64 way for the same stream."""
    rng = np.random.default_rng(2)
    logits = (rng.standard_normal((6, V)) * 3).astype(np.float32)
    settings = SamplingSettings(temperature=0.8, top_p=0.95, seed=5)
    reference, stream = sampling.Sampler(settings), np.random.default_rng(5)
    want = [int(float64_way(reference.scores(logits[i : i + 1]), stream.random(1))[0]) for i in range(6)]
    one = sampling.Sampler(settings)
    assert [int(one(logits[i : i + 1])[0]) for i in range(6)] == want
    rows = [History([1], []) for _ in range(6)]
    samplers = [sampling.Sampler(replace(settings, seed=5 + i)) for i in range(6)]
    streams = [np.random.default_rng(5 + i) for i in range(6)]
    want = [int(float64_way(reference.scores(logits[i : i + 1]), streams[i].random(1))[0]) for i in range(6)]
    assert sampling.sample_many(samplers, logits, rows).tolist() == want


def test_numpys_float32_exp_is_within_the_bound_the_draw_assumes():
    """numerics.EXP32_ERROR, checked on this machine's NumPy (its float32 exp kernel differs by CPU): every float32
    in [-104, 0] a step apart, against float64's exp of the same value."""
    x = np.linspace(-numerics.UNDERFLOW, 0.0, 4_000_001, dtype=np.float32)
    got, want = np.exp(x).astype(np.float64), np.exp(x.astype(np.float64))
    normal = want >= np.finfo(np.float32).tiny
    assert (np.abs(got - want)[normal] <= numerics.EXP32_ERROR * want[normal]).all()
    assert (np.abs(got - want)[~normal] <= numerics.TINY).all()
