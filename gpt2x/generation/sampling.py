"""The sampler: last-position logits through the processors to next tokens, in NumPy with one seeded generator,
so that every backend gives the same tokens for the same seed wherever their logits agree."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import numpy.random  # noqa: F401  loaded here, not by the first Sampler a request makes (NumPy 2 loads it lazily: ~6.5 ms)

from ..numerics import CDF_BLOCK, TINY, block_reduce, float32_mass_error
from .processors import ORDER, History, LogitsProcessor, processors_for, softmax
from .settings import SamplingSettings


class Sampler:
    """Turns last-position logits into next tokens with one seeded numpy generator."""

    def __init__(self, settings: SamplingSettings):
        self.s = settings
        self.rng = np.random.default_rng(settings.seed)
        self.processors = processors_for(settings)
        self.reads_history = any(p.reads_history for p in self.processors)

    @property
    def argmax_only(self) -> bool:
        """Greedy with nothing that moves the argmax: a backend may take it where the logits are."""
        return self.s.greedy and not self.processors

    def scores(self, logits: np.ndarray, rows: Sequence[History] | None = None, dtype: type = np.float64) -> np.ndarray:
        """The logits through the processors, in float64 (`rows` None only where no processor reads one); `dtype`
        another (masking_dtype's, for an argmax)."""
        scores = logits.astype(dtype)  # its own copy: the processors may write in place
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
        return softmax(self.scores(logits, rows))

    def greedy(self, logits: np.ndarray, rows: Sequence[History] | None = None) -> np.ndarray:
        if not self.processors:
            return logits.argmax(axis=-1).astype(np.int64)
        return self.scores(logits, rows, masking_dtype(logits, [self])).argmax(axis=-1).astype(np.int64)

    def __call__(self, logits: np.ndarray, rows: Sequence[History] | None = None) -> np.ndarray:
        if self.s.greedy:
            return self.greedy(logits, rows)
        scores = self.scores(logits, rows)
        return draw_scores(scores, self.rng.random(scores.shape[0]))

    def draw(self, p: np.ndarray) -> np.ndarray:
        """One token per row of `p` (unnormalised is fine), by inverse CDF, one uniform per row in row order."""
        return _inverse_cdf(p, self.rng.random(p.shape[0]))


def _inverse_cdf(p: np.ndarray, u: np.ndarray) -> np.ndarray:
    """Row i's first index whose cumulative mass reaches u[i] of its total (p: rows of non-negative masses, each
    row's total > 0; left as it is): the block where the cumulative block sums reach it, then the index in that block."""
    rows, n = p.shape
    if n <= CDF_BLOCK:  # one block: its running sum is the row's, without the blocks' bookkeeping
        cdf = np.cumsum(p, axis=-1)
        return np.minimum((cdf >= (u * cdf[:, -1])[:, None]).argmax(axis=-1), n - 1).astype(np.int64)
    ends = np.cumsum(block_reduce(np.add, p, CDF_BLOCK), axis=-1)  # the mass up to each block's end
    block, mass, cdf, reached, i = _cut_in_blocks(p, ends, u * ends[:, -1])
    # Summed in another order, a block's running sum can end a rounding error short of its block sum: the cut is
    # then at the block's end, its last token with mass.
    short = ~reached[np.arange(rows), i]
    if short.any():
        i[short] = [np.flatnonzero(mass[k])[-1] for k in np.flatnonzero(short)]
    return np.minimum(block * CDF_BLOCK + i, n - 1).astype(np.int64)


def _cut_in_blocks(p: np.ndarray, ends: np.ndarray, cut: np.ndarray) -> tuple[np.ndarray, ...]:
    """Where each row's cumulative mass reaches its `cut`, given `ends` (the float64 mass up to each CDF_BLOCK's end):
    the block, its masses (float64, 0 past the row), their running sum from the mass before the block, where that
    reaches the cut, and the first index in the block that does (0 where none)."""
    n = p.shape[1]
    block = (ends >= cut[:, None]).argmax(axis=-1)
    columns = block[:, None] * CDF_BLOCK + np.arange(CDF_BLOCK)
    mass = np.take_along_axis(p, np.minimum(columns, n - 1), axis=-1).astype(np.float64, copy=False)
    mass[columns >= n] = 0.0  # the last block's columns past the row
    cdf = np.where(block > 0, ends[np.arange(len(p)), block - 1], 0.0)[:, None] + np.cumsum(mass, axis=-1)
    reached = cdf >= cut[:, None]
    return block, mass, cdf, reached, reached.argmax(axis=-1)


def draw_scores(scores: np.ndarray, u: np.ndarray) -> np.ndarray:
    """The token `_inverse_cdf(softmax(scores), u)` draws from float64 `scores` (rows, n), the same token always, with
    the masses computed in float32 first: NumPy's float64 exp is scalar on CPUs without AVX-512 (9 ns a token, 7 ms a
    16-row step over GPT-2's 50,257), its float32 exp vectorised (2 ns). A row whose cut lies too near either end of
    the token it falls in for the float32 masses to tell (a token of little mass: a few draws in a hundred from a
    trained model) is drawn again the float64 way."""
    rows, n = scores.shape
    top = scores.max(axis=-1, keepdims=True)
    if n <= CDF_BLOCK or not np.isfinite(top).all():  # one block (cheap), or a row of +inf, NaN or nothing left
        return _inverse_cdf(softmax(scores), u)
    spread = top[:, 0] - scores.min(axis=-1)  # +inf where a token was removed (its mass is 0 both ways)
    mass32 = np.empty(scores.shape, dtype=np.float32)
    np.subtract(scores, top, out=mass32, casting="same_kind")  # in float64, rounded once to float32
    np.exp(mass32, out=mass32)
    ends = np.cumsum(block_reduce(np.add, mass32, CDF_BLOCK, np.float64), axis=-1)
    total = ends[:, -1]
    cut = u * total
    block, mass, cdf, reached, i = _cut_in_blocks(mass32, ends, cut)
    r = np.arange(rows)
    low = np.where(i > 0, cdf[r, np.maximum(i - 1, 0)], np.where(block > 0, ends[r, block - 1], 0.0))  # before the token
    # Each mass within eps of itself, so the cut and both ends within eps of the total: 3 x that apart is certain.
    eps = float32_mass_error(spread)
    margin = 3 * eps * total + 3 * n * TINY
    sure = reached[r, i] & (cut - low > margin) & (cdf[r, i] - cut > margin)
    out = np.minimum(block * CDF_BLOCK + i, n - 1).astype(np.int64)
    if not sure.all():
        unsure = ~sure
        out[unsure] = _inverse_cdf(softmax(scores[unsure]), u[unsure])
    return out


def masking_dtype(logits: np.ndarray, samplers: Sequence[Sampler]) -> type:
    """The dtype the samplers' processors may run in: the logits' own (at least float32) where every sampler is greedy
    and every processor only masks (min_tokens, allowed tokens, a constraint), since -inf masks and an argmax are exact
    in it; float64 otherwise. Half the bytes of float64 to copy and scan (a 16-row serving step's sampling)."""
    if all(s.s.greedy and all(getattr(p, "masks_only", False) for p in s.processors) for s in samplers):
        return np.result_type(logits.dtype, np.float32)
    return np.float64


def _by_kind(sampler: Sampler) -> dict[type, LogitsProcessor] | None:
    """The sampler's processors by type, or None for one that must sample alone (a subclass, or a processor
    outside ORDER, whose place among other rows' processors is unknown)."""
    if type(sampler) is not Sampler:
        return None
    kinds = {type(p): p for p in sampler.processors}
    if len(kinds) != len(sampler.processors) or not all(k in ORDER for k in kinds):
        return None
    return kinds


class BatchProcessors:
    """A batch's logits processors, kept across its steps (vLLM v1's persistent batch state): each kind any of the rows
    sampled together has, once for them all (`for_rows`), made again only when those rows change (`update_state`:
    a row ended, or the batch is another). A decode loop's Batch holds one."""

    def __init__(self) -> None:
        self._rows: tuple[int, ...] | None = None
        self._chain: list[LogitsProcessor] = []

    def update_state(self, samplers: Sequence[Sampler], chains: Sequence[dict]) -> list[LogitsProcessor]:
        """The processors of the rows `samplers` (each with its processors by kind, `chains`): this step's."""
        rows = tuple(map(id, samplers))  # the batch holds its rows, so a row's sampler keeps its id while it runs
        if rows != self._rows:
            self._rows = rows
            self._chain = [kind.for_rows([c.get(kind) for c in chains]) for kind in ORDER if any(kind in c for c in chains)]
        return self._chain


def _sample_batch(samplers: Sequence[Sampler], chains: Sequence[dict], logits: np.ndarray,
                  rows: Sequence[History], state: BatchProcessors | None = None, overwrite: bool = False) -> np.ndarray:
    """Each processor type any row has, applied once with per-row parameters (kept in `state` across a batch's
    steps); one argmax over the greedy rows, one softmax and inverse CDF over the others. `overwrite`: `logits` may be
    processed in place where they are in the dtype the processors run in (sample_many)."""
    scores = logits.astype(masking_dtype(logits, samplers), copy=not overwrite)
    if len(samplers) == 1:  # the batch of one: its own list
        batch = samplers[0].processors
    else:
        batch = (state or BatchProcessors()).update_state(samplers, chains)
    for process in batch:
        scores = process(scores, rows)
    greedy = [i for i, s in enumerate(samplers) if s.s.greedy]
    drawn = [i for i, s in enumerate(samplers) if not s.s.greedy]
    out = np.empty(len(samplers), dtype=np.int64)
    if greedy:
        out[greedy] = (scores[greedy] if drawn else scores).argmax(axis=-1)
    if drawn:
        u = np.array([samplers[i].rng.random(1)[0] for i in drawn])  # one uniform per row from its own stream
        p = scores[drawn] if greedy else scores  # `scores` is this function's own (astype copies)
        out[drawn] = draw_scores(p, u)
    return out


def sample_many(samplers: Sequence[Sampler], logits: np.ndarray, rows: Sequence[History],
                state: BatchProcessors | None = None, overwrite: bool = False) -> np.ndarray:
    """Row i drawn by its own distinct `samplers[i]`: the same token and stream as `samplers[i](logits[i:i+1],
    [rows[i]])`, but the rows share the NumPy work (the serving engine's batch: a Sampler per request) and, given
    the batch's `state`, its processors across steps. `overwrite`: nothing reads `logits` afterwards, so greedy rows
    whose processors only mask run them on `logits` itself (float32), not a copy: 3 MB a 16-row step of GPT-2."""
    out = np.empty(len(samplers), dtype=np.int64)
    plain, batch, chains = [], [], []
    for i, s in enumerate(samplers):
        kinds = None if s.argmax_only else _by_kind(s)
        if s.argmax_only:
            plain.append(i)
        elif kinds is None:
            out[i] = s(logits[i : i + 1], [rows[i]])[0]
        else:
            batch.append(i)
            chains.append(kinds)
    if plain:  # nothing moves their argmax: the logits' own, without a float64 copy
        out[plain] = (logits if len(plain) == len(logits) else logits[plain]).argmax(axis=-1)
    if batch:
        group = logits if len(batch) == len(logits) else logits[batch]  # all rows: no copy
        out[batch] = _sample_batch([samplers[i] for i in batch], chains, group, [rows[i] for i in batch], state,
                                   overwrite or group is not logits)  # a subset of the rows is a copy already
    return out
