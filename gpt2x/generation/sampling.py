"""The sampler: last-position logits to next tokens, in numpy with one seeded generator, so that every
backend produces the same tokens for the same seed wherever their logits agree. The logits pass
through the settings' ordered list of logits processors (processors.py) before the draw."""

from __future__ import annotations

import numpy as np

from .processors import processors_for, softmax
from .settings import SamplingSettings


class Sampler:
    """Turns last-position logits into next tokens with one seeded numpy generator."""

    def __init__(self, settings: SamplingSettings):
        self.s = settings
        self.rng = np.random.default_rng(settings.seed)
        self.processors = processors_for(settings)  # applied in order to every step's logits

    def probabilities(self, logits: np.ndarray) -> np.ndarray:
        """The next-token distributions (B, V) in float64: the logits through the processors, softmaxed."""
        scores = logits.astype(np.float64)
        for process in self.processors:
            scores = process(scores)
        return softmax(scores)

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
