"""The numerical helpers against PyTorch's float64 log-softmax (an independent implementation)."""

from __future__ import annotations

import numpy as np
import torch

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
