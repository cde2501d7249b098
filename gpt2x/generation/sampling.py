"""The sampler: last-position logits to next tokens, in numpy with one seeded generator, so that every
backend produces the same tokens for the same seed wherever their logits agree."""

from __future__ import annotations

import numpy as np

from .settings import SamplingSettings


class Sampler:
    """Turns last-position logits into next tokens with one seeded numpy generator."""

    def __init__(self, settings: SamplingSettings):
        self.s = settings
        self.rng = np.random.default_rng(settings.seed)

    def probabilities(self, logits: np.ndarray) -> np.ndarray:
        """Filtered, renormalised next-token distributions (B, V) in float64."""
        x = logits.astype(np.float64) / self.s.temperature
        if self.s.top_k and self.s.top_k < x.shape[-1]:
            kth = np.partition(x, -self.s.top_k, axis=-1)[:, -self.s.top_k][:, None]
            x = np.where(x < kth, -np.inf, x)
        x = x - x.max(axis=-1, keepdims=True)
        p = np.exp(x)
        p /= p.sum(axis=-1, keepdims=True)
        if self.s.top_p < 1.0:
            order = np.argsort(-p, axis=-1, kind="stable")
            sorted_p = np.take_along_axis(p, order, axis=-1)
            before = np.cumsum(sorted_p, axis=-1) - sorted_p  # mass strictly before each token
            keep_sorted = before < self.s.top_p  # always keeps the most likely token
            keep = np.zeros_like(keep_sorted)
            np.put_along_axis(keep, order, keep_sorted, axis=-1)
            p = np.where(keep, p, 0.0)
            p /= p.sum(axis=-1, keepdims=True)
        return p

    def __call__(self, logits: np.ndarray) -> np.ndarray:
        if self.s.greedy:
            return logits.argmax(axis=-1).astype(np.int64)
        return self.draw(self.probabilities(logits))

    def draw(self, p: np.ndarray) -> np.ndarray:
        """One token per row of the distributions `p` (B, V) (unnormalised is fine), by inverse CDF with
        one uniform per row, consumed in row order."""
        u = self.rng.random(p.shape[0])[:, None]
        cdf = np.cumsum(p, axis=-1)
        return np.minimum((cdf < u * cdf[:, -1:]).sum(axis=-1), p.shape[-1] - 1).astype(np.int64)
