"""The numerical helpers and the API's token logprobs against PyTorch's float64 log-softmax (an independent
implementation)."""

from __future__ import annotations

import numpy as np
import torch

from gpt2x.generation.logprobs import SCORE_CHUNK, token_logprobs
from gpt2x.numerics import log_softmax, target_log_probs


def test_log_softmax_and_target_log_probs_are_torchs_float64_log_softmax():
    rng = np.random.default_rng(0)
    logits = (rng.standard_normal((7, 50257)) * 8).astype(np.float32)
    logits[3, 17] = 60.0  # one token far ahead of the others: its log-probability is about 0
    targets = rng.integers(0, 50257, 7)
    targets[3] = 17
    reference = torch.log_softmax(torch.from_numpy(logits).double(), dim=-1).numpy()
    kept = logits.copy()
    np.testing.assert_allclose(log_softmax(logits), reference, rtol=0, atol=1e-12)
    got = target_log_probs(logits, targets)
    assert got.dtype == np.float64 and got.shape == (7,)
    np.testing.assert_allclose(got, reference[np.arange(7), targets], rtol=0, atol=1e-6)
    assert (logits == kept).all()  # the input is left as it was


def test_token_logprobs_are_torchs_float64_log_softmax_and_topk():
    """A prompt's worth of rows, more than one chunk: each chosen token's log-probability and the k most likely, in
    order, as torch's float64 log_softmax and topk give them (distinct logits: topk's order of ties is its own)."""
    rng = np.random.default_rng(1)
    logits = (rng.standard_normal((SCORE_CHUNK + 9, 50257)) * 4).astype(np.float32)
    logits[2, 5] = 70.0  # nearly all of a row's mass on one token
    chosen = rng.integers(0, 50257, len(logits)).tolist()
    reference = torch.log_softmax(torch.from_numpy(logits).double(), dim=-1)
    values, ids = reference.topk(3, dim=-1)
    entries = token_logprobs(logits, chosen, 3)
    assert [e[0] for e in entries] == chosen
    np.testing.assert_allclose([e[1] for e in entries], reference[np.arange(len(chosen)), chosen].numpy(), rtol=0, atol=1e-6)
    assert [[t for t, _ in e[2]] for e in entries] == ids.tolist()
    np.testing.assert_allclose([[v for _, v in e[2]] for e in entries], values.numpy(), rtol=0, atol=1e-6)
    assert token_logprobs(logits[:1], chosen[:1], 0)[0][2] == []  # k 0: none listed
    tied = logits[:2].copy()
    tied[1, [2000, 10, 300]] = 50.0  # equal logits, the largest: listed in id order
    tied[1, 7] = 49.0
    assert [t for t, _ in token_logprobs(tied, chosen[:2], 4)[1][2]] == [10, 300, 2000, 7]
    # many ties at the floor: an all-equal row lists its first k ids
    assert [t for t, _ in token_logprobs(np.zeros((1, 50257), np.float32), [3], 5)[0][2]] == [0, 1, 2, 3, 4]
