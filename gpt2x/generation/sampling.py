"""The sampler: last-position logits to next tokens, in numpy with one seeded generator, so that every
backend produces the same tokens for the same seed wherever their logits agree. The logits pass
through the settings' ordered list of logits processors (processors.py) before the draw, or, greedy,
before the argmax: each call gives the rows' histories (processors.History), which the penalties
and min_tokens read."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import numpy.random  # noqa: F401  loaded here, not by the first Sampler a request makes (NumPy 2 loads it lazily: ~6.5 ms)

from .processors import History, MinP, Temperature, TopK, TopP, processors_for, softmax
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
        return _inverse_cdf(p.copy(), self.rng.random(p.shape[0]))


def _inverse_cdf(p: np.ndarray, u: np.ndarray) -> np.ndarray:
    """Row i's token (B,) int64 of the distributions `p` (B, V) (unnormalised is fine; overwritten by
    its cumsum) for the uniform u[i]: the first index whose cumulative mass reaches u[i] of the row's
    total, i.e. the count of those below it (a cumsum never decreases), found by bisection."""
    cdf = np.cumsum(p, axis=-1, out=p)
    cut = u * cdf[:, -1]
    picked = [np.searchsorted(row, c, side="left") for row, c in zip(cdf, cut)]
    return np.minimum(np.asarray(picked, dtype=np.int64), p.shape[-1] - 1)


# The warpers sample_many applies to a group at once, with each row's parameter as a column.
_ROWWISE = (Temperature, TopK, TopP, MinP)


def _rowwise(kind: type, chain: Sequence, scores: np.ndarray) -> np.ndarray:
    """One warper type over a group's scores (n, V), each row with its own processor's parameter:
    the same per-row arithmetic as the processor itself (processors.py), so the scores are the same."""
    if kind is Temperature:
        with np.errstate(over="ignore"):
            return scores / np.array([[p.temperature] for p in chain], dtype=np.float64)
    if kind is MinP:
        probs = softmax(scores)
        floor = np.array([[p.min_p] for p in chain], dtype=np.float64) * probs.max(axis=-1, keepdims=True)
        return np.where(probs < floor, -np.inf, scores)
    if kind is TopK:
        v = scores.shape[-1]
        ks = np.array([p.k for p in chain], dtype=np.int64)
        live = ks < v  # k >= V keeps the whole row, as TopK does
        if not live.any():
            return scores
        # one partition puts every asked k-th largest in its sorted place (the same value TopK reads)
        kth_at = v - ks[live]
        part = np.partition(scores[live], np.unique(kth_at), axis=-1)
        kth = np.full((len(scores), 1), -np.inf)
        kth[live, 0] = part[np.arange(len(kth_at)), kth_at]
        return np.where(scores < kth, -np.inf, scores)
    probs = softmax(scores)  # TopP
    keep = np.zeros(scores.shape, dtype=bool)
    for i, proc in enumerate(chain):
        _top_p_keep(probs[i], proc.p, keep[i])
    return np.where(keep, scores, -np.inf)


_MARGIN = 1e-6  # the head's mass must pass p by this much (far above cumsum's rounding, ~1e-11)


def _top_p_keep(probs: np.ndarray, p: float, keep: np.ndarray) -> None:
    """TopP's kept tokens of one row (V,) into `keep`, sorting only the head of the distribution:
    the tokens at or above the m-th largest probability (ties included) are a prefix of TopP's stable
    order, so their sorted order, cumsum and `before < p` are TopP's own; once the head's mass is
    past p (with a margin), every token after it has `before` >= p too, removed as in TopP. The head
    doubles until it is; the full sort is the last resort. (TopP's full argsort is most of its cost.)"""
    v = len(probs)
    m = 256
    while m < v:
        head = np.flatnonzero(probs >= np.partition(probs, v - m)[v - m])  # index order: the stable tie-break
        sorted_p = probs[head]
        order = np.argsort(-sorted_p, kind="stable")
        sorted_p = sorted_p[order]
        cum = np.cumsum(sorted_p)
        if len(cum) and cum[-1] >= p + _MARGIN:  # (a row of NaN, all removed: no head)
            keep[head[order]] = cum - sorted_p < p
            return
        m *= 4
    order = np.argsort(-probs, kind="stable")
    sorted_p = probs[order]
    keep[order] = np.cumsum(sorted_p) - sorted_p < p


def _shape(sampler: Sampler) -> tuple | None:
    """The key under which samplers can sample together (greedy, their processor types in order), or
    None for one that must sample alone (a subclass)."""
    if type(sampler) is not Sampler:
        return None
    return (sampler.s.greedy, tuple(type(p) for p in sampler.processors))


def _sample_group(samplers: Sequence[Sampler], logits: np.ndarray, rows: Sequence[History]) -> np.ndarray:
    """samplers of one _shape, one row of `logits` (n, V) each: the warpers applied to all rows at once
    (per-row parameters), the others (penalties, bias, min_tokens, a constraint) by each row's own
    processor on its row; then one softmax and cumsum, or one argmax, over the group."""
    first = samplers[0]
    if first.argmax_only:
        return logits.argmax(axis=-1).astype(np.int64)
    scores = logits.astype(np.float64)
    for j, proc in enumerate(first.processors):
        chain = [s.processors[j] for s in samplers]
        if type(proc) in _ROWWISE:
            scores = _rowwise(type(proc), chain, scores)
        else:
            for i, p in enumerate(chain):
                scores[i : i + 1] = p(scores[i : i + 1], [rows[i]])
    if first.s.greedy:
        return scores.argmax(axis=-1).astype(np.int64)
    u = np.array([s.rng.random(1)[0] for s in samplers])  # one uniform per row from its own stream
    return _inverse_cdf(softmax(scores, inplace=True), u)  # `scores` is this function's own (astype copies)


def sample_many(samplers: Sequence[Sampler], logits: np.ndarray, rows: Sequence[History]) -> np.ndarray:
    """One token (B,) int64 per row of `logits` (B, V), row i drawn by its own `samplers[i]` (distinct
    samplers) given `rows[i]`: the same token as `samplers[i](logits[i:i+1], [rows[i]])`, its stream
    moved alike, but rows whose samplers are of one shape (processor types) share the NumPy work
    (the serving engine's batch: a Sampler per request)."""
    out = np.empty(len(samplers), dtype=np.int64)
    groups: dict[tuple, list[int]] = {}
    for i, s in enumerate(samplers):
        key = _shape(s)
        if key is None:
            out[i] = s(logits[i : i + 1], [rows[i]])[0]
        else:
            groups.setdefault(key, []).append(i)
    for members in groups.values():
        group = logits if len(members) == len(logits) else logits[members]  # all rows: no copy
        out[members] = _sample_group([samplers[i] for i in members], group, [rows[i] for i in members])
    return out
