"""The logits processors against transformers' own (TemperatureLogitsWarper, TopKLogitsWarper,
TopPLogitsWarper, applied in generate's order) on the same logits, and the order the sampler applies."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from transformers.generation.logits_process import TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

from gpt2x.generation.processors import Temperature, TopK, TopP, processors_for
from gpt2x.generation.sampling import Sampler
from gpt2x.generation.settings import SamplingSettings


def transformers_scores(logits: np.ndarray, temperature: float, top_k: int, top_p: float) -> np.ndarray:
    scores = torch.from_numpy(logits)
    ids = torch.zeros((logits.shape[0], 1), dtype=torch.long)
    if temperature != 1.0:
        scores = TemperatureLogitsWarper(temperature)(ids, scores)
    if top_k:
        scores = TopKLogitsWarper(top_k)(ids, scores)
    if top_p < 1.0:
        scores = TopPLogitsWarper(top_p)(ids, scores)
    return scores.numpy()


@pytest.mark.parametrize("temperature,top_k,top_p", [
    (1.0, 0, 1.0), (0.7, 0, 1.0), (1.3, 40, 1.0), (1.0, 0, 0.9), (0.8, 50, 0.95), (1.0, 5, 0.5), (2.0, 1, 1.0),
])
def test_the_chain_keeps_and_scales_what_transformers_does(temperature, top_k, top_p):
    rng = np.random.default_rng(0)
    logits = rng.normal(size=(4, 1000)) * 3  # float64: no ties, rounding far from every threshold
    settings = SamplingSettings(temperature=temperature, top_k=top_k, top_p=top_p)
    ours = logits
    for process in processors_for(settings):
        ours = process(ours)
    theirs = transformers_scores(logits, temperature, top_k, top_p)
    assert np.array_equal(np.isinf(ours), np.isinf(theirs))
    kept = ~np.isinf(theirs)
    np.testing.assert_allclose(ours[kept], theirs[kept], rtol=1e-12)
    p = Sampler(settings).probabilities(logits)
    want = torch.softmax(torch.from_numpy(theirs), dim=-1).numpy()
    np.testing.assert_allclose(p, want, rtol=1e-9, atol=1e-15)


def test_the_order_and_what_is_left_out():
    s = SamplingSettings(temperature=0.5, top_k=3, top_p=0.9)
    assert [type(p) for p in processors_for(s)] == [Temperature, TopK, TopP]
    assert processors_for(SamplingSettings()) == []  # OpenAI's defaults change nothing
    assert processors_for(SamplingSettings(greedy=True, top_k=3)) == []  # greedy draws nothing


def test_hand_computed_cases():
    x = np.log(np.array([[0.5, 0.3, 0.15, 0.05]]))
    assert np.isinf(TopP(0.75)(x)).tolist() == [[False, False, True, True]]  # 0.5 + 0.3 reach 0.75
    assert np.isinf(TopP(0.85)(x)).tolist() == [[False, False, False, True]]  # 0.8 before 0.15; 0.95 before 0.05
    assert np.isinf(TopK(2)(x)).tolist() == [[False, False, True, True]]
    np.testing.assert_allclose(Temperature(0.5)(x), 2 * x)
