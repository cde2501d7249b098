"""Measures shared by parity, the bench and the tests: logit statistics, KL divergence, cross-entropy
and perplexity, latency percentiles; and the held-out text perplexity is measured on."""

from __future__ import annotations

import math
from collections.abc import Callable
from importlib import resources

import numpy as np

from ..numerics import target_log_probs


def heldout_text() -> str:
    """The held-out Tiny Shakespeare excerpt shipped in the package (never trained on)."""
    return (resources.files("gpt2x") / "data" / "heldout_shakespeare.txt").read_text(encoding="utf-8")


def kl_divergence(p_logits: np.ndarray, q_logits: np.ndarray) -> np.ndarray:
    """KL(softmax(p) || softmax(q)) per row, in nats, computed in float64 as sum p (x - y) - lse(x) + lse(y) on the
    logits x, y less their row maxima: two vocabulary-wide exponentials, not three (a float64 exp is a scalar loop
    without AVX-512, and this is most of a parity gate's statistics)."""
    x = np.array(p_logits, dtype=np.float64)
    x -= x.max(axis=-1, keepdims=True)
    y = np.array(q_logits, dtype=np.float64)
    y -= y.max(axis=-1, keepdims=True)
    e = np.exp(x)
    total = e.sum(axis=-1)
    lse_q = np.log(np.exp(y).sum(axis=-1))
    x -= y  # x - y, in place: one vocabulary-wide array fewer
    return (e * x).sum(axis=-1) / total - np.log(total) + lse_q


def logit_stats(ref: np.ndarray, got: np.ndarray) -> dict[str, float]:
    """ref, got (N, V): max and p99 |Δ|, the relative max error, top-1 agreement, mean KL(ref || got)."""
    diff = np.abs(ref.astype(np.float64) - got.astype(np.float64))
    per_row_max = diff.max(axis=-1)
    kl = kl_divergence(ref, got)
    scale = float(np.abs(ref).max())
    return {
        "positions": int(ref.shape[0]),
        "max_abs": float(diff.max()),
        "p99_abs": float(np.percentile(diff, 99)),
        "scale": scale,
        "max_rel": float(diff.max() / max(scale, 1e-12)),
        "worst_row_max_abs": float(per_row_max.max()),
        "top1_agreement": float((ref.argmax(-1) == got.argmax(-1)).mean()),
        "mean_kl": float(kl.mean()),
    }


def percentile(values, q: float) -> float:
    """Linear-interpolation percentile (numpy's default), q in [0, 100]."""
    return float(np.percentile(np.asarray(values, dtype=np.float64), q))


def summarize_latencies(seconds: list[float]) -> dict[str, float]:
    ms = [s * 1e3 for s in seconds]
    return {"p50_ms": percentile(ms, 50), "p90_ms": percentile(ms, 90), "p99_ms": percentile(ms, 99),
            "mean_ms": float(np.mean(ms))}


def cross_entropy(logits: np.ndarray, targets: np.ndarray) -> float:
    """Mean -log softmax(logits)[target] over rows, in nats (float64)."""
    return float(-target_log_probs(logits, targets).mean())


def perplexity(full_logits: Callable[[np.ndarray], np.ndarray], ids: list[int], window: int) -> float:
    """exp(mean cross-entropy) over non-overlapping windows of `window` tokens (each predicts its next)."""
    total, count = 0.0, 0
    for start in range(0, len(ids) - 1, window):
        chunk = np.asarray(ids[start : start + window + 1], dtype=np.int64)
        if len(chunk) < 2:
            break
        x, y = chunk[:-1][None], chunk[1:]
        logits = full_logits(x)[0]
        total += cross_entropy(logits, y) * len(y)
        count += len(y)
    return math.exp(total / count)


