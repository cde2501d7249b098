"""The sampler: last-position logits to next tokens, in numpy with one seeded generator, so that every
backend produces the same tokens for the same seed wherever their logits agree. The logits pass
through the settings' ordered list of logits processors (processors.py) before the draw, or, greedy,
before the argmax: each call gives the rows' histories (processors.History), which the penalties
and min_tokens read."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from .processors import History, processors_for, softmax
from .settings import SamplingSettings


class Sampler:
    """Turns last-position logits into next tokens with one seeded numpy generator."""

    def __init__(self, settings: SamplingSettings):
        self.s = settings
        self.rng = np.random.default_rng(settings.seed)
        self.processors = processors_for(settings)  # applied in order to every step's logits
        self.reads_history = any(p.reads_history for p in self.processors)  # whether calls need the rows' histories

    @property
    def argmax_only(self) -> bool:
        """Greedy with nothing that moves the argmax: the plain argmax of the logits (a backend may
        take it where the logits are, runtime.base.greedy_step)."""
        return self.s.greedy and not self.processors

    def scores(self, logits: np.ndarray, rows: Sequence[History] | None = None) -> np.ndarray:
        """The logits (B, V) through the processors, in float64. `rows`: each row's History (None
        only where no processor reads one)."""
        scores = logits.astype(np.float64)  # its own copy: the processors may write in place
        if not self.processors:
            return scores
        if rows is None:
            if self.reads_history:
                raise ValueError("these sampling settings read each row's history (penalties, min_tokens): pass rows")
            rows = ()
        elif len(rows) != len(scores):
            raise ValueError(f"{len(rows)} histories for {len(scores)} rows of logits")
        for process in self.processors:
            scores = process(scores, rows)
        return scores

    def probabilities(self, logits: np.ndarray, rows: Sequence[History] | None = None) -> np.ndarray:
        """The next-token distributions (B, V) in float64: the logits through the processors, softmaxed."""
        return softmax(self.scores(logits, rows))

    def greedy(self, logits: np.ndarray, rows: Sequence[History] | None = None) -> np.ndarray:
        """The argmax (B,) int64 of each row's processed scores (of the logits themselves when nothing
        moves it)."""
        if not self.processors:
            return logits.argmax(axis=-1).astype(np.int64)
        return self.scores(logits, rows).argmax(axis=-1).astype(np.int64)

    def __call__(self, logits: np.ndarray, rows: Sequence[History] | None = None) -> np.ndarray:
        if self.s.greedy:
            return self.greedy(logits, rows)
        return self.draw(self.probabilities(logits, rows))

    def draw(self, p: np.ndarray) -> np.ndarray:
        """One token per row of the distributions `p` (B, V) (unnormalised is fine), by inverse CDF with
        one uniform per row, consumed in row order."""
        u = self.rng.random(p.shape[0])[:, None]
        cdf = np.cumsum(p, axis=-1)
        return np.minimum((cdf < u * cdf[:, -1:]).sum(axis=-1), p.shape[-1] - 1).astype(np.int64)
