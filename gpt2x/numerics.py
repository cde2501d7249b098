"""Numerical helpers on numpy arrays shared by every layer (the sampler, beam search, parity, perplexity)."""

from __future__ import annotations

import numpy as np


def log_softmax(logits: np.ndarray) -> np.ndarray:
    """log softmax over the last axis, computed in float64 (returned as float64)."""
    x = np.array(logits, dtype=np.float64)  # a copy, changed in place below (two vocabulary-wide arrays, not four)
    x -= x.max(axis=-1, keepdims=True)
    x -= np.log(np.exp(x).sum(axis=-1, keepdims=True))
    return x


def log_sum_exp(logits: np.ndarray) -> np.ndarray:
    """log sum exp over the last axis of float32 `logits` (N, V), as float64 (N,): log softmax(logits)[i, t] is
    logits[i, t] - this, in float64 (exact differences). The exponentials are float32's (numpy vectorises them; its
    float64 exp is a scalar loop without AVX-512: 4x slower), their sums and logs float64's: within 1e-6 of the
    all-float64 computation."""
    top = logits.max(axis=-1, keepdims=True)
    shifted = np.subtract(logits, top)
    np.exp(shifted, out=shifted)  # in place: a second vocabulary-wide array costs as much as the exponentials
    return top[:, 0] + np.log(shifted.sum(axis=-1, dtype=np.float64))


def target_log_probs(logits: np.ndarray, targets: np.ndarray) -> np.ndarray:
    """log softmax(logits)[i, targets[i]] for each row of `logits` (N, V), as float64, without the (N, V) result
    (perplexity and scoring need one entry per row); through log_sum_exp."""
    x = np.asarray(logits, dtype=np.float32)
    return x[np.arange(len(targets)), targets].astype(np.float64) - log_sum_exp(x)


def positions(mask: np.ndarray, seq_len: int) -> np.ndarray:
    """Position ids (B, seq_len) of a mask's last slots: real tokens before each, so left padding shifts nothing."""
    return np.maximum(np.cumsum(mask, axis=-1) - 1, 0)[:, mask.shape[1] - seq_len :].astype(np.int64)


# The relative error of NumPy's float32 exp, bounded (measured: 2.6e-7 on [-88, 0], AVX2; tests/generation/test_draw.py
# measures it on the machine it runs on), for the masses the draw (generation.sampling) and TopP take in float32. With
# the rounding of a score less the row's maximum to float32 (its distance below the maximum times 2**-24, float32's exp
# underflowing past 104), it bounds the error of each token's mass from float32, relative to that mass. A mass below
# float32's smallest normal (1.2e-38) is off by less than that, and the float64 sums of both ways by ~1e-13 of the total.
EXP32_ERROR = 5e-7
UNDERFLOW = 104.0
TINY = 1.2e-38


def float32_mass_error(spread: np.ndarray) -> np.ndarray:
    """The bound above, relative to each mass, for rows whose scores spread `spread` below their maximum (+inf where
    a token was removed: its mass is 0 both ways, and float32's exp underflows past UNDERFLOW)."""
    return np.minimum(spread, UNDERFLOW) * 2.0**-24 + EXP32_ERROR


# The inverse CDF's blocks, on the host (generation.sampling) and the device (onnx.optimize.sampling_head): a running
# sum over a whole row goes one token at a time (on CUDA, ONNX Runtime's CumSum sums every prefix again), block sums do
# not, and then only one block is summed in order (benchmarks/results/sampling-speed-blocked-cdf-cpu-2core).
CDF_BLOCK = 512


def block_reduce(reduce: np.ufunc, a: np.ndarray, block: int, dtype: type | None = None) -> np.ndarray:
    """`reduce` (np.add, np.maximum) over each run of `block` columns of a (rows, n) array, the last run shorter
    where n is not a multiple of it: (rows, ceil(n / block)); in `dtype` (default: a's)."""
    rows, n = a.shape
    full = n // block
    out = np.empty((rows, -(-n // block)), dtype=dtype or a.dtype)
    out[:, :full] = reduce.reduce(a[:, : full * block].reshape(rows, full, block), axis=-1, dtype=out.dtype)
    if full < out.shape[1]:
        out[:, full] = reduce.reduce(a[:, full * block :], axis=-1, dtype=out.dtype)
    return out


def kth_block_peak(a: np.ndarray, k: np.ndarray, block: int) -> np.ndarray | None:
    """Each row's k-th largest maximum over `block` columns of a (rows, n) array, k (rows,) each: at or below the row's
    k-th largest value (k blocks reach it), so the values at or above it hold the row's k largest, without partitioning
    the whole row. None where k is above the number of blocks, or a NaN is there (np.partition's order puts it last)."""
    peaks = block_reduce(np.maximum, a, block)
    blocks = peaks.shape[1]
    if k.max() > blocks or np.isnan(peaks).any():
        return None
    at = blocks - k
    return np.partition(peaks, np.unique(at), axis=-1)[np.arange(len(a)), at]
