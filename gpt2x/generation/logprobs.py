"""Token log-probabilities as the API's `logprobs` tells them: under the raw distribution, log_softmax of the
logits before any processor (vLLM's `raw_logprobs`)."""

from __future__ import annotations

import numpy as np

from ..numerics import log_softmax

# One token told: its id, its log-probability (None for a prompt's first token) and the k most likely
# tokens with theirs, most likely first (None for a prompt's first token).
LogprobEntry = tuple[int, float | None, list[tuple[int, float]] | None]
SCORE_CHUNK = 64  # positions whose log_softmax is computed at once (float64, vocab wide)


def token_logprobs(logits: np.ndarray, chosen: list[int], k: int) -> list[LogprobEntry]:
    """For each row of `logits` (T, V) and its chosen token, its LogprobEntry."""
    out: list[LogprobEntry] = []
    for start in range(0, len(chosen), SCORE_CHUNK):
        lp = log_softmax(logits[start : start + SCORE_CHUNK])
        for row, tok in zip(lp, chosen[start : start + SCORE_CHUNK]):
            top: list[tuple[int, float]] = []
            if k:
                best = np.argpartition(-row, k - 1)[:k]
                best = best[np.argsort(-row[best], kind="stable")]
                top = [(int(t), float(row[t])) for t in best]
            out.append((int(tok), float(row[tok]), top))
    return out
