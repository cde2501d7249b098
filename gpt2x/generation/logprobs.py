"""Token log-probabilities as the API's `logprobs` tells them: under the raw distribution, log_softmax of the
logits before any processor (vLLM's `raw_logprobs`)."""

from __future__ import annotations

import numpy as np

from ..numerics import kth_block_peak, log_sum_exp

# One token told: its id, its log-probability (None for a prompt's first token) and the k most likely
# tokens with theirs, most likely first (None for a prompt's first token).
LogprobEntry = tuple[int, float | None, list[tuple[int, float]] | None]
# Positions scored at once: their float32 exponentials (8 x 50,257 x 4 bytes) stay in memory malloc reuses; 64 rows
# took fresh pages each time, and were 2x slower on a 1,023-token prompt.
SCORE_CHUNK = 8
PEAK_BLOCK = 512  # the top k are looked for among the tokens at or above the k-th largest of these blocks' maxima


def token_logprobs(logits: np.ndarray, chosen: list[int], k: int) -> list[LogprobEntry]:
    """For each row of `logits` (T, V) and its chosen token, its LogprobEntry. A token's log-probability is its
    logit less the row's log_sum_exp, in float64; only the tokens told are computed (a rank by the logits is the
    rank by log_softmax), not the whole row's (float64 exponentials: most of a long prompt's scoring). The k most
    likely are the largest logits, equal ones in id order."""
    out: list[LogprobEntry] = []
    for start in range(0, len(chosen), SCORE_CHUNK):
        x = np.asarray(logits[start : start + SCORE_CHUNK], dtype=np.float32)
        floor = kth_block_peak(x, np.full(len(x), k), PEAK_BLOCK) if k else None
        for i, (tok, lse) in enumerate(zip(chosen[start : start + SCORE_CHUNK], log_sum_exp(x).tolist())):
            row = x[i]
            top: list[tuple[int, float]] = []
            if k:
                # the candidates: the tokens at or above the floor (at least k), else (a NaN) the whole row
                head = np.flatnonzero(row >= floor[i]) if floor is not None else np.arange(len(row))
                best = head[np.argsort(-row[head], kind="stable")[:k]]
                top = [(int(t), float(row[t]) - lse) for t in best]
            out.append((int(tok), float(row[tok]) - lse, top))
    return out
