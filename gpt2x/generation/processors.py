"""Logits processors: the one ordered list (vLLM's order, `ORDER`) that turns a step's logits into the scores
every decoding path samples from. Each is written once, for a batch: one parameter for every row or one per
row (`for_rows`). They may change `scores` in place: the sampler hands them its own float64 copy, and copying
a (16, 50257) batch per processor would cost more than the penalties do. The order, the argmax-invariant
group and per-row state: docs/architecture.md, "A new logits transform".
"""

from __future__ import annotations

import bisect
import math
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from functools import lru_cache
from itertools import chain
from numbers import Integral
from typing import Any, ClassVar

import numpy as np

from ..errors import Gpt2xError, UsageError
from ..numerics import TINY, float32_mass_error, kth_block_peak
from ..tokenizer import EOT_ID, VOCAB_SIZE, encode, get_encoding
from .constraints import Constraint, ConstraintSpec, mask_rows

# What a processor is given: a generation.settings.SamplingSettings. settings.py imports this module (each processor
# checks its own fields), so the type is named here rather than imported: no import cycle, not even a typing one.
Settings = Any

PENALTY_RANGE = 2.0  # presence and frequency penalties: [-2, 2] (OpenAI's and vLLM's)
BIAS_RANGE = 100.0  # logit_bias values: [-100, 100] (OpenAI's)


@dataclass(frozen=True, slots=True)
class History:
    """One row's prompt ids and generated ids (a live list: a Sequence's own `tokens`), and `row`, the key under
    which a processor keeps per-row state (the Sequence itself in the decode loop)."""

    prompt: Sequence[int]
    output: Sequence[int]
    row: object = None

    def extended(self, tokens: Sequence[int]) -> History:
        """The same row with `tokens` generated after its output (a drafted position)."""
        return History(self.prompt, [*self.output, *tokens], self.row) if tokens else self


class LogitsProcessor:
    """One logits transform, written once for a batch, carrying its own activation and validation: adding one is
    this one class (and its place in ORDER) beside its field in SamplingSettings. vLLM v1's interface, in NumPy.

    `fields`: the SamplingSettings fields it reads. `checked(settings)`: those fields checked, each failure one
    UsageError naming its field, and the values SamplingSettings keeps (normalised). `from_settings(settings)`: the
    processor of one row, or None where its fields leave every score as it is (it is then not run at all).
    `for_rows(procs)`: one processor treating row i as procs[i] would alone (None: left as it is); a batch keeps it
    across steps while its rows stay (BatchProcessors). `__call__(scores (B, V), rows)`: scores float64 (float32 or
    wider where sampling.masking_dtype allows) and each row's History -> scores (removed tokens: -inf), in place
    where it can.

    `sampling_only`: greedy decoding and beam search skip it (temperature and the truncations). `argmax_invariant`: it
    never moves a row's argmax. `masks_only`: it only sets scores to -inf, so greedy rows may run it on float32
    logits, whose argmax is then the float64 one. `reads_history`: without it, `rows` may be None. A stateful
    processor keeps its state per `History.row` and syncs it to each call's histories (roll back what `output` no
    longer holds, consume what is new): speculative decoding calls it at drafted positions, in position order, then
    with what the target accepted; no other hook is needed."""

    fields: ClassVar[tuple[str, ...]] = ()
    sampling_only: ClassVar[bool] = False
    argmax_invariant: ClassVar[bool] = False
    masks_only: ClassVar[bool] = False
    reads_history: ClassVar[bool] = False

    @classmethod
    def checked(cls, settings: Settings) -> dict[str, Any]:
        return {}

    @classmethod
    def from_settings(cls, settings: Settings) -> LogitsProcessor | None:
        raise NotImplementedError

    @classmethod
    def for_rows(cls, procs: Sequence[LogitsProcessor | None]) -> LogitsProcessor:
        raise NotImplementedError

    def __call__(self, scores: np.ndarray, rows: Sequence[History]) -> np.ndarray:
        raise NotImplementedError


def _in_range(settings: Settings, name: str, ok: bool, rule: str) -> dict[str, Any]:
    """Nothing to keep, once the field `name` is checked: a UsageError naming it where not `ok`."""
    if not ok:
        raise UsageError(f"{name} must be {rule}, got {getattr(settings, name)}", option=name)
    return {}


def token_ids(ids: object, option: str) -> tuple[int, ...]:
    """Token ids as a tuple, in order, each once (vLLM drops repeats the same way)."""
    if isinstance(ids, (str, bytes)) or not hasattr(ids, "__iter__"):
        raise UsageError(f"{option} must be a list of token ids, got {ids!r}", option=option)
    return tuple(dict.fromkeys(_token_id(t, option) for t in ids))  # type: ignore[union-attr]


def _token_id(value: object, option: str) -> int:
    if isinstance(value, bool) or not isinstance(value, Integral) or not 0 <= value < VOCAB_SIZE:
        raise UsageError(f"{option} must hold token ids in [0, {VOCAB_SIZE}), got {value!r}", option=option)
    return int(value)


def _per_row(value: float | np.ndarray, n: int, dtype: type = np.float64) -> np.ndarray:
    """A parameter as one value per row (n,): a scalar is every row's."""
    a = np.asarray(value, dtype=dtype)
    if a.ndim == 0:
        return np.full(n, a, dtype=dtype)
    if a.shape != (n,):
        raise ValueError(f"{len(a)} per-row parameters for {n} rows")
    return a


def _on_rows(scores: np.ndarray, param: float | np.ndarray, live, warp) -> np.ndarray:
    """warp(scores of some rows, their parameter) on the rows whose parameter is `live` (not the
    identity): given one parameter for every row, or a column (n, 1) of the rows' own. A new array
    when every row is live (the input left as it is), else written into those rows of `scores` (the
    identity's rows are not touched, not even copied)."""
    if np.ndim(param) == 0:  # one for every row (a Sampler's own list): no per-row arrays
        return warp(scores, param) if live(param) else scores
    param = _per_row(param, len(scores), np.asarray(param).dtype)
    on = live(param)
    if on.all():
        return warp(scores, param[:, None])
    at = np.flatnonzero(on)
    if len(at):
        scores[at] = warp(scores[at], param[at, None])
    return scores


def _stacked(procs: Sequence, attr: str, identity: float) -> np.ndarray:
    """Each row's `attr` of its processor (identity where it has none), as a per-row array."""
    return np.array([identity if p is None else getattr(p, attr) for p in procs])


class Temperature(LogitsProcessor):
    """Scores divided by the temperature (> 0; 0 is greedy decoding, which skips it; 1: left as is)."""

    fields = ("temperature",)  # >= 0, 0 greedy: SamplingSettings' own rule, every entry point's
    sampling_only = argmax_invariant = True

    @classmethod
    def from_settings(cls, settings: Settings) -> Temperature | None:
        return None if settings.temperature == 1.0 else cls(settings.temperature)

    def __init__(self, temperature: float | np.ndarray):
        self.temperature = temperature  # one for every row, or one per row (as every processor's parameters)

    @classmethod
    def for_rows(cls, procs: Sequence[Temperature | None]) -> Temperature:
        return cls(_stacked(procs, "temperature", 1.0))

    def __call__(self, scores: np.ndarray, rows: Sequence[History] = ()) -> np.ndarray:
        def warp(s: np.ndarray, t: float | np.ndarray) -> np.ndarray:
            with np.errstate(over="ignore"):  # a tiny temperature: +inf, which softmax reads as the argmax
                return s / t
        return _on_rows(scores, self.temperature, lambda t: t != 1.0, warp)


class TopK(LogitsProcessor):
    """Only the k highest scores stay (ties with the k-th stay too; k 0 or >= V: every score stays)."""

    fields = ("top_k",)
    sampling_only = argmax_invariant = True

    @classmethod
    def checked(cls, settings: Settings) -> dict[str, Any]:
        return _in_range(settings, "top_k", settings.top_k >= 0, ">= 0")

    @classmethod
    def from_settings(cls, settings: Settings) -> TopK | None:
        return cls(settings.top_k) if settings.top_k else None

    def __init__(self, k: int | np.ndarray):
        # A k past int64's range keeps every score, as any k >= V does (a request may send one: JSON ints are unbounded).
        self.k = min(k, np.iinfo(np.int64).max) if isinstance(k, int) else k

    @classmethod
    def for_rows(cls, procs: Sequence[TopK | None]) -> TopK:
        return cls(_stacked(procs, "k", 0).astype(np.int64))

    def __call__(self, scores: np.ndarray, rows: Sequence[History] = ()) -> np.ndarray:
        v = scores.shape[-1]
        def warp(s: np.ndarray, k: int | np.ndarray) -> np.ndarray:
            ks = np.broadcast_to(np.asarray(k, dtype=np.int64).reshape(-1), (len(s),))
            kth = _kth_largest_by_blocks(s, ks)
            if kth is None:  # one partition puts every row's k-th largest in its sorted place, however many ks
                kth_at = v - ks
                kth = np.partition(s, np.unique(kth_at), axis=-1)[np.arange(len(s)), kth_at]
            return np.where(s < kth[:, None], -np.inf, s)
        return _on_rows(scores, self.k, lambda k: (k > 0) & (k < v), warp)


TOP_K_BLOCK = 512  # see _kth_largest_by_blocks


def _kth_largest_by_blocks(s: np.ndarray, k: np.ndarray) -> np.ndarray | None:
    """Each row's k-th largest score, as np.partition gives it, without partitioning the whole row (np.partition
    over GPT-2's vocabulary is most of a top-k step): only the scores at or above numerics.kth_block_peak are
    partitioned. None where that does not hold (k above the number of blocks, or a NaN)."""
    floor = kth_block_peak(s, k, TOP_K_BLOCK)
    if floor is None:
        return None
    kth = np.empty(len(s))
    for r in range(len(s)):
        head = s[r][s[r] >= floor[r]]
        kth[r] = np.partition(head, len(head) - k[r])[len(head) - k[r]]
    return kth


class TopP(LogitsProcessor):
    """Nucleus: a token stays when the mass of the tokens more likely than it is below p (the most likely
    always stays; p >= 1: every token)."""

    fields = ("top_p",)
    sampling_only = argmax_invariant = True

    @classmethod
    def checked(cls, settings: Settings) -> dict[str, Any]:
        return _in_range(settings, "top_p", 0 < settings.top_p <= 1, "in (0, 1]")

    @classmethod
    def from_settings(cls, settings: Settings) -> TopP | None:
        return cls(settings.top_p) if settings.top_p < 1.0 else None

    def __init__(self, p: float | np.ndarray):
        self.p = p

    @classmethod
    def for_rows(cls, procs: Sequence[TopP | None]) -> TopP:
        return cls(_stacked(procs, "p", 1.0))

    def __call__(self, scores: np.ndarray, rows: Sequence[History] = ()) -> np.ndarray:
        def warp(s: np.ndarray, p: float | np.ndarray) -> np.ndarray:
            keep = np.zeros(s.shape, dtype=bool)
            ps = np.broadcast_to(np.asarray(p, dtype=np.float64).reshape(-1), (len(s),))
            sure = _top_p_keep_float32(s, ps, keep) if s.dtype == np.float64 else np.full(len(s), UNSURE)
            for i in np.flatnonzero(sure != SURE):  # the float64 way: float32 could not tell, or +inf, NaN, nothing;
                # from the whole row's sort where more than the largest head stays
                _top_p_keep(softmax(s[i]), ps[i], keep[i], heads=() if sure[i] == WHOLE else TOP_P_HEADS)
            return np.where(keep, s, -np.inf)
        return _on_rows(scores, self.p, lambda p: p < 1.0, warp)


TOP_P_HEADS = (1024, 8192)  # the largest values sorted first; the whole row's only where their mass stays below p


def _top_p_keep(probs: np.ndarray, p: float, keep: np.ndarray, heads: Sequence[int] = TOP_P_HEADS) -> None:
    """TopP's kept tokens of one row into `keep`: the most likely in the stable descending order (equal ones by id)
    while the mass before each is below p, without sorting indices (a stable argsort of GPT-2's vocabulary is most
    of the cost). The masses in that order are the row's values sorted, whatever the order of equal ones, so their
    running sum says how many stay: k, a prefix of that order (the mass before each, sum - value, never decreases:
    rounding is monotone). The m largest values, sorted, begin the whole row's sort and their running sum the whole
    row's, bit for bit, so where some of them do not stay, k is known; the whole row is sorted only where all of the
    largest TOP_P_HEADS stay. The tokens kept: those above the k-th value, and the lowest ids among those equal to it."""
    v = len(probs)
    for m in (*(h for h in heads if h < v), v):
        top = np.sort(probs if m == v else np.partition(probs, v - m)[v - m :])[::-1]
        k = int(np.count_nonzero(np.cumsum(top) - top < p))
        if k < m:
            break
    if k:  # (none: a row of NaN, all removed)
        last = top[k - 1]
        np.greater(probs, last, out=keep)
        keep[np.flatnonzero(probs == last)[: k - np.count_nonzero(keep)]] = True


SURE, UNSURE, WHOLE = 0, 1, 2  # _top_p_keep_float32's outcomes per row


def _top_p_keep_float32(s: np.ndarray, ps: np.ndarray, keep: np.ndarray) -> np.ndarray:
    """_top_p_keep(softmax(s[i]), ps[i], keep[i]) for float64 scores (rows, n) without the rows' float64 exponentials
    (NumPy's float64 exp is a scalar loop without AVX-512: most of top-p's cost), the same tokens. Per row: SURE (kept
    tokens set), UNSURE (left to the float64 way), WHOLE (as UNSURE, and more than the largest head stays). Each head of
    TOP_P_HEADS is the tokens at or above its m-th score rounded to float32 (rounding is monotone, so nothing outside
    scores as high); its masses are float64's, exactly softmax's numerators. Only the total is not: float32's
    exponentials outside the head, each within numerics.float32_mass_error of itself.
    So the mass before each token is known within that of the tail's mass, and where the count that stays does not
    hang on it (the boundary's masses before farther from p), it is the float64 way's. Ties are equal masses: a row
    with another mass within a few ulps of the last kept one (in the head, or at most exp(t) outside it) is UNSURE (a
    division by the total could make them equal). A head whose float32 mass is below p of the float32 total is passed
    over without its float64 masses (a guess: the next head, or the whole row, decides)."""
    rows, n = s.shape
    out = np.full(rows, UNSURE)
    heads = [h for h in TOP_P_HEADS if h < n]
    if not heads:
        return out
    top = s.max(axis=-1)
    with np.errstate(invalid="ignore"):  # (rows of +inf or -inf: NaN, and the float64 way's)
        eps = float32_mass_error(top - s.min(axis=-1))
    below = np.empty(n, dtype=np.float32)
    mass32 = np.empty(n, dtype=np.float32)
    for i in np.flatnonzero(np.isfinite(top)):
        p = ps[i]
        np.subtract(s[i], top[i], out=below, casting="same_kind")  # in float64, rounded once to float32
        total32 = np.exp(below, out=mass32).sum(dtype=np.float64)
        for m in heads:
            t = np.partition(below, n - m)[n - m]
            head = np.flatnonzero(below >= t if t > -np.inf else below > -np.inf)
            head32 = mass32[head].sum(dtype=np.float64)
            if head32 < p * total32:
                continue
            mass = np.exp(s[i, head] - top[i])  # float64: softmax's numerators
            tail32 = max(total32 - head32, 0.0)
            total = tail32 + mass.sum()
            error = tail32 * eps[i] + n * TINY + 1e-10 * total  # the tail's, and the float64 sums' rounding
            ranked = np.sort(mass)[::-1]
            before = (np.cumsum(ranked) - ranked) / total
            k = int(np.count_nonzero(before < p))
            if k == len(head):
                continue
            out[i] = _top_p_head(keep[i], head, mass, ranked, before, k, p, total / (total + error),
                                 total / (total - error), float(t))
            break
        else:
            out[i] = WHOLE
    return out


def _top_p_head(keep: np.ndarray, head: np.ndarray, mass: np.ndarray, ranked: np.ndarray, before: np.ndarray, k: int,
                p: float, low: float, high: float, t: float) -> int:
    """_top_p_keep_float32's decision on a row's head: SURE (its kept tokens set in `keep`) where the first k stay
    whatever the float64 total is (its ratio to this one in [low, high]) and no mass ties with the last kept one but
    equal ones; UNSURE otherwise."""
    last = ranked[k - 1]
    near = 4 * np.spacing(last)  # masses this close to the last kept one might tie with it in the float64 way
    if before[k - 1] * high >= p or before[k] * low < p or math.exp(t) >= last - near \
            or np.any(np.abs(mass - last)[mass != last] <= near):
        return UNSURE
    kept = head[mass > last]
    keep[kept] = True
    keep[head[mass == last][: k - len(kept)]] = True
    return SURE


class MinP(LogitsProcessor):
    """Removed where p < min_p * max p (transformers' MinPLogitsWarper, vLLM's min_p)."""

    fields = ("min_p",)
    sampling_only = argmax_invariant = True

    @classmethod
    def checked(cls, settings: Settings) -> dict[str, Any]:
        return _in_range(settings, "min_p", 0 <= settings.min_p <= 1, "in [0, 1] (0: off)")

    @classmethod
    def from_settings(cls, settings: Settings) -> MinP | None:
        return cls(settings.min_p) if settings.min_p else None

    def __init__(self, min_p: float | np.ndarray):
        self.min_p = min_p

    @classmethod
    def for_rows(cls, procs: Sequence[MinP | None]) -> MinP:
        return cls(_stacked(procs, "min_p", 0.0))

    def __call__(self, scores: np.ndarray, rows: Sequence[History] = ()) -> np.ndarray:
        def warp(s: np.ndarray, min_p: float | np.ndarray) -> np.ndarray:
            # p < min_p * max p is exp(s - max s) < min_p: s < max s + log min_p, with no exponentials (NumPy's
            # float64 exp is a scalar loop without AVX-512). Rows with +inf, -inf or NaN keep what softmax gave.
            floor = s.max(axis=-1, keepdims=True) + np.log(min_p)
            return np.where(s < floor, -np.inf, s)
        return _on_rows(scores, self.min_p, lambda m: m > 0, warp)


class MinTokens(LogitsProcessor):
    """Until a row has generated `min_tokens` tokens its end tokens get -inf (vLLM's min_tokens). Ids outside the
    vocabulary are left out (as in every processor here)."""

    fields = ("min_tokens",)
    reads_history = masks_only = True

    @classmethod
    def checked(cls, settings: Settings) -> dict[str, Any]:
        m = settings.min_tokens
        _in_range(settings, "min_tokens", m >= 0, ">= 0")
        _in_range(settings, "min_tokens", m <= settings.max_new_tokens, f"at most max_new_tokens ({settings.max_new_tokens})")
        if m and settings.constraint is not None:
            raise UsageError("min_tokens cannot be combined with structured output: the constraint decides "
                             "where a row may end", option="min_tokens")
        return {}

    @classmethod
    def from_settings(cls, settings: Settings) -> MinTokens | None:
        return cls(settings.min_tokens, end_token_ids(settings)) if settings.min_tokens else None

    def __init__(self, min_tokens: int | np.ndarray, end_ids: Iterable[int]):
        self.min_tokens = min_tokens  # 0: left as is
        self.end_ids = np.unique(np.asarray(list(end_ids), dtype=np.int64))
        self.end_rows: np.ndarray | None = None  # for_rows: the row of each end id; None: every row's

    @classmethod
    def for_rows(cls, procs: Sequence[MinTokens | None]) -> MinTokens:
        out = cls(_stacked(procs, "min_tokens", 0).astype(np.int64), ())
        live = [(i, p) for i, p in enumerate(procs) if p is not None]
        if live:
            out.end_ids = np.concatenate([p.end_ids for _, p in live])
        out.end_rows = np.repeat(np.array([i for i, _ in live], dtype=np.int64), [len(p.end_ids) for _, p in live])
        return out

    def __call__(self, scores: np.ndarray, rows: Sequence[History]) -> np.ndarray:
        need = _per_row(self.min_tokens, len(rows), np.int64)
        short = np.flatnonzero([len(h.output) < m for h, m in zip(rows, need)])
        inside = self.end_ids < scores.shape[-1]
        if self.end_rows is None:
            ids = self.end_ids[inside]
            if len(short) and len(ids):
                scores[np.ix_(short, ids)] = -np.inf
        else:
            hit = inside & np.isin(self.end_rows, short)
            scores[self.end_rows[hit], self.end_ids[hit]] = -np.inf
        return scores


class AllowedTokens(LogitsProcessor):
    """Every token but the given ones gets -inf (vLLM's allowed_token_ids)."""

    fields = ("allowed_token_ids",)  # () = every token (vLLM's field)
    masks_only = True

    @classmethod
    def checked(cls, settings: Settings) -> dict[str, Any]:
        return {"allowed_token_ids": token_ids(settings.allowed_token_ids, "allowed_token_ids")}

    @classmethod
    def from_settings(cls, settings: Settings) -> AllowedTokens | None:
        return cls(settings.allowed_token_ids) if settings.allowed_token_ids else None

    def __init__(self, ids: Iterable[int], each: Sequence[AllowedTokens | None] | None = None):
        self.ids = np.unique(np.asarray(list(ids), dtype=np.int64))
        self._banned: np.ndarray | None = None  # the complement, made once for the logits' width
        self._each = each  # for_rows: row i masked by each[i]'s own mask (None: left as is)

    @classmethod
    def for_rows(cls, procs: Sequence[AllowedTokens | None]) -> AllowedTokens:
        return cls((), list(procs))

    def banned(self, vocab: int) -> np.ndarray:
        """The tokens this one removes, as a mask (vocab,), cached for the last width asked."""
        if self._banned is None or self._banned.shape[0] != vocab:
            banned = np.ones(vocab, dtype=bool)
            banned[self.ids[self.ids < vocab]] = False
            self._banned = banned
        return self._banned

    def __call__(self, scores: np.ndarray, rows: Sequence[History] = ()) -> np.ndarray:
        vocab = scores.shape[-1]
        if self._each is None:
            scores[:, self.banned(vocab)] = -np.inf
        for i, own in enumerate(self._each or ()):
            if own is not None:
                scores[i, own.banned(vocab)] = -np.inf
        return scores


class LogitBias(LogitsProcessor):
    """A bias added to given tokens' logits (OpenAI's logit_bias)."""

    fields = ("logit_bias",)

    @classmethod
    def checked(cls, settings: Settings) -> dict[str, Any]:
        """logit_bias as (token id, bias) pairs sorted by id (a dict, or pairs: the last bias of an id wins)."""
        bias = settings.logit_bias
        items = bias.items() if isinstance(bias, Mapping) else bias
        try:
            merged = {_token_id(t, "logit_bias"): float(b) for t, b in items}  # type: ignore[union-attr]
        except (TypeError, ValueError):
            raise UsageError(f"logit_bias must map token ids to biases, got {bias!r}", option="logit_bias") from None
        for token, b in merged.items():
            if not -BIAS_RANGE <= b <= BIAS_RANGE:
                raise UsageError(f"logit_bias must hold biases in [-100, 100], got {b} for token {token}",
                                 option="logit_bias")
        return {"logit_bias": tuple(sorted(merged.items()))}

    @classmethod
    def from_settings(cls, settings: Settings) -> LogitBias | None:
        return cls(settings.logit_bias) if settings.logit_bias else None

    def __init__(self, bias: Mapping[int, float] | Iterable[tuple[int, float]]):
        pairs = sorted(bias.items() if isinstance(bias, Mapping) else bias)
        self.ids = np.asarray([t for t, _ in pairs], dtype=np.int64)
        self.values = np.asarray([b for _, b in pairs], dtype=np.float64)
        self.rows: np.ndarray | None = None  # for_rows: the row of each (id, bias); None: every row's

    @classmethod
    def for_rows(cls, procs: Sequence[LogitBias | None]) -> LogitBias:
        out = cls(())
        live = [(i, p) for i, p in enumerate(procs) if p is not None]
        if live:
            out.ids = np.concatenate([p.ids for _, p in live])
            out.values = np.concatenate([p.values for _, p in live])
        out.rows = np.repeat(np.array([i for i, _ in live], dtype=np.int64), [len(p.ids) for _, p in live])
        return out

    def __call__(self, scores: np.ndarray, rows: Sequence[History] = ()) -> np.ndarray:
        inside = self.ids < scores.shape[-1]
        if self.rows is None:
            scores[:, self.ids[inside]] += self.values[inside]
        else:  # (row, id) pairs are distinct: each row's ids are
            scores[self.rows[inside], self.ids[inside]] += self.values[inside]
        return scores


def _flat_ids(rows: Sequence[History], vocab: int, prompt: bool) -> np.ndarray:
    """row * vocab + token for every token of each row's output (and prompt), in one array."""
    parts = [np.asarray([*h.prompt, *h.output] if prompt else h.output, dtype=np.int64) for h in rows]
    lengths = [len(p) for p in parts]
    if not sum(lengths):
        return np.zeros(0, dtype=np.int64)
    return np.repeat(np.arange(len(rows), dtype=np.int64) * vocab, lengths) + np.concatenate(parts)


class RepetitionPenalty(LogitsProcessor):
    """The CTRL rule, as transformers and vLLM apply it: a prompt or output token's logit divided by the penalty
    where positive, multiplied by it otherwise."""

    fields = ("repetition_penalty",)
    reads_history = True

    @classmethod
    def checked(cls, settings: Settings) -> dict[str, Any]:
        r = settings.repetition_penalty
        return _in_range(settings, "repetition_penalty", r > 0 and math.isfinite(r), "> 0 (1: off)")

    @classmethod
    def from_settings(cls, settings: Settings) -> RepetitionPenalty | None:
        return None if settings.repetition_penalty == 1.0 else cls(settings.repetition_penalty)

    def __init__(self, penalty: float | np.ndarray):
        self.penalty = penalty

    @classmethod
    def for_rows(cls, procs: Sequence[RepetitionPenalty | None]) -> RepetitionPenalty:
        return cls(_stacked(procs, "penalty", 1.0))

    def __call__(self, scores: np.ndarray, rows: Sequence[History]) -> np.ndarray:
        vocab = scores.shape[-1]
        penalty = _per_row(self.penalty, len(rows))
        at = np.flatnonzero(penalty != 1.0)
        row, token = np.divmod(np.unique(_flat_ids([rows[i] for i in at], vocab, prompt=True)), vocab)
        if len(row):
            row = at[row]
            seen, by = scores[row, token], penalty[row]
            with np.errstate(over="ignore", under="ignore"):  # a huge penalty: -inf, a ban (0 where positive)
                scores[row, token] = np.where(seen > 0, seen / by, seen * by)
        return scores


class PresenceFrequencyPenalty(LogitsProcessor):
    """OpenAI's penalties, on generated tokens only: logit[j] -= count[j] * frequency + (count[j] > 0) * presence."""

    fields = ("presence_penalty", "frequency_penalty")
    reads_history = True

    @classmethod
    def checked(cls, settings: Settings) -> dict[str, Any]:
        for name in cls.fields:
            _in_range(settings, name, -PENALTY_RANGE <= getattr(settings, name) <= PENALTY_RANGE, "in [-2, 2]")
        return {}

    @classmethod
    def from_settings(cls, settings: Settings) -> PresenceFrequencyPenalty | None:
        if not (settings.presence_penalty or settings.frequency_penalty):
            return None
        return cls(settings.presence_penalty, settings.frequency_penalty)

    def __init__(self, presence: float | np.ndarray, frequency: float | np.ndarray):
        self.presence = presence
        self.frequency = frequency

    @classmethod
    def for_rows(cls, procs: Sequence[PresenceFrequencyPenalty | None]) -> PresenceFrequencyPenalty:
        return cls(_stacked(procs, "presence", 0.0), _stacked(procs, "frequency", 0.0))

    def __call__(self, scores: np.ndarray, rows: Sequence[History]) -> np.ndarray:
        vocab = scores.shape[-1]
        presence, frequency = _per_row(self.presence, len(rows)), _per_row(self.frequency, len(rows))
        at = np.flatnonzero((presence != 0) | (frequency != 0))
        flat, counts = np.unique(_flat_ids([rows[i] for i in at], vocab, prompt=False), return_counts=True)
        if len(flat):
            row, token = np.divmod(flat, vocab)
            row = at[row]
            scores[row, token] -= counts * frequency[row] + presence[row]  # (row, token) pairs are distinct
        return scores


class NoRepeatNGram(LogitsProcessor):
    """A token that would complete an n-gram already in the row's prompt and output gets -inf (transformers'
    NoRepeatNGramLogitsProcessor, whose input is a decoder's prompt and output too)."""

    fields = ("no_repeat_ngram_size",)
    reads_history = masks_only = True

    @classmethod
    def checked(cls, settings: Settings) -> dict[str, Any]:
        return _in_range(settings, "no_repeat_ngram_size", settings.no_repeat_ngram_size >= 0, ">= 0 (0: off)")

    @classmethod
    def from_settings(cls, settings: Settings) -> NoRepeatNGram | None:
        return cls(settings.no_repeat_ngram_size) if settings.no_repeat_ngram_size else None

    def __init__(self, n: int | np.ndarray):
        # 0: left as is. A size past int64's range bans nothing, as any longer than the row's text does (a request
        # may send one: JSON ints are unbounded; its batch's int64 sizes overflowed, and the batch failed).
        self.n = min(n, np.iinfo(np.int64).max) if isinstance(n, int) else n

    @classmethod
    def for_rows(cls, procs: Sequence[NoRepeatNGram | None]) -> NoRepeatNGram:
        return cls(_stacked(procs, "n", 0).astype(np.int64))

    def __call__(self, scores: np.ndarray, rows: Sequence[History]) -> np.ndarray:
        sizes = _per_row(self.n, len(rows), np.int64)
        vocab = scores.shape[-1]
        for i, (h, n) in enumerate(zip(rows, sizes)):
            if n <= 0:
                continue
            ids = [*h.prompt, *h.output]
            if len(ids) + 1 < n:
                continue
            tail = ids[len(ids) - n + 1 :]
            # every earlier n-gram whose first n - 1 tokens are the row's last n - 1: its last token is banned
            banned = [ids[j + n - 1] for j in range(len(ids) - n + 1) if ids[j : j + n - 1] == tail]
            banned = [t for t in banned if t < vocab]
            if banned:
                scores[i, banned] = -np.inf
        return scores


def bad_word_ids(words: Iterable[str]) -> list[list[int]]:
    """vLLM's token sequences of bad words (SamplingParams.update_from_tokenizer): each word, left-stripped, as it
    begins a text, and with a space before it, as it comes mid-text, the second kept where it is another word of the
    same length in tokens (its first token differs)."""
    out: list[list[int]] = []
    for word in words:
        plain = encode(word.lstrip())
        out.append(plain)
        spaced = encode(" " + word.lstrip())
        if spaced[0] != plain[0] and len(spaced) == len(plain):
            out.append(spaced)
    return out


class BadWords(LogitsProcessor):
    """vLLM's bad_words: a bad word's last token gets -inf where the row's generated tokens end with its other tokens
    (a one-token word: always). Generated tokens only, as vLLM's past tokens."""

    fields = ("bad_words",)
    reads_history = masks_only = True

    @classmethod
    def checked(cls, settings: Settings) -> dict[str, Any]:
        words = settings.bad_words
        if isinstance(words, str) or not all(isinstance(w, str) and w.strip() for w in words):
            raise UsageError(f"bad_words must be a list of words (non-blank strings), got {words!r}", option="bad_words")
        return {"bad_words": tuple(words)}

    @classmethod
    def from_settings(cls, settings: Settings) -> BadWords | None:
        return cls(bad_word_ids(settings.bad_words)) if settings.bad_words else None

    def __init__(self, ids: Sequence[Sequence[int]], each: Sequence[BadWords | None] | None = None):
        self.ids = [list(w) for w in ids]
        self._each = each  # for_rows: row i masked by each[i]'s words (None: left as is)

    @classmethod
    def for_rows(cls, procs: Sequence[BadWords | None]) -> BadWords:
        return cls((), list(procs))

    def _mask(self, row: np.ndarray, output: Sequence[int]) -> None:
        for word in self.ids:
            prefix = len(word) - 1
            if prefix > len(output) or word[-1] >= row.shape[-1]:
                continue
            if not prefix or list(output[len(output) - prefix :]) == word[:-1]:
                row[word[-1]] = -np.inf

    def __call__(self, scores: np.ndarray, rows: Sequence[History]) -> np.ndarray:
        for i, h in enumerate(rows):
            own = self if self._each is None else self._each[i]
            if own is not None:
                own._mask(scores[i], h.output)
        return scores


DRY_BREAKERS = ("\n", ":", "\"", "*")  # llama-server's default dry_sequence_breakers
DRY_BREAKER_BYTES = 40  # llama.cpp's MAX_CHAR_LEN: a longer breaker is cut to its first 40 bytes
DRY_TAIL_TOKENS = 20  # llama.cpp's MAX_SEQ_LEN: a breaker's tokens after its first, at most
_FLOAT32_MAX_LOG = 88.7228391  # ln of float32's largest value: llama.cpp keeps base ** exponent below it
_DRY_SNAPSHOTS = 40  # a row's match arrays kept per length: a speculative round (K <= 32) rolls back within them
_NO_PENALTY = (np.zeros(0, dtype=np.int64), np.zeros(0))


def _is_int(value: object) -> bool:
    return isinstance(value, Integral) and not isinstance(value, bool)


def _suffix_matches(ids: np.ndarray) -> np.ndarray:
    """(len(ids) - 1,): at j, the length of the longest common suffix of ids[:j + 1] and ids (the Z-array of the
    reversed ids, llama.cpp's dry_repeat_count), found by extending every match one token back at a time."""
    last = len(ids) - 1
    out = np.zeros(max(last, 0), dtype=np.int32)
    ends = np.flatnonzero(ids[:last] == ids[last]) if last > 0 else out[:0]
    n = 0
    while len(ends):
        n += 1
        out[ends] = n
        ends = ends[ends >= n]
        ends = ends[ids[ends - n] == ids[last - n]]
    return out


@dataclass(frozen=True)
class _VocabText:
    """Every token's text as bytes (<|endoftext|> as its text, as llama.cpp detokenizes special tokens here), all in
    one string to search (`blob`: token t at starts[t]:starts[t + 1]), and reversed, sorted, to find by their ends."""

    words: tuple[bytes, ...]
    blob: bytes
    starts: np.ndarray
    reversed_words: list[bytes]  # sorted
    reversed_ids: list[int]

    def holding(self, part: bytes) -> list[int]:
        """The tokens whose text holds `part`: one search of the blob (a scan token by token costs ten times more)."""
        at = np.array([m.start() for m in re.finditer(b"(?=" + re.escape(part) + b")", self.blob)], dtype=np.int64)
        token = np.searchsorted(self.starts, at, side="right") - 1
        return np.unique(token[at + len(part) <= self.starts[token + 1]]).tolist()

    def ending_with(self, end: bytes) -> list[int]:
        """The tokens whose text ends with `end`: a run of the reversed texts, sorted."""
        key, out = end[::-1], []
        for i in range(bisect.bisect_left(self.reversed_words, key), len(self.reversed_words)):
            if not self.reversed_words[i].startswith(key):
                break
            out.append(self.reversed_ids[i])
        return out


@lru_cache(maxsize=1)
def _vocab_text() -> _VocabText:
    enc = get_encoding()
    words = tuple(enc.decode_single_token_bytes(t) for t in range(VOCAB_SIZE))
    by_end = sorted((w[::-1], t) for t, w in enumerate(words))
    starts = np.concatenate(([0], np.cumsum([len(w) for w in words])))
    return _VocabText(words, b"".join(words), starts, [w for w, _ in by_end], [t for _, t in by_end])


def _bpe_bytes(data: bytes) -> list[int]:
    """`data` as GPT-2's BPE encodes it, special tokens read as text (llama.cpp's tokenize(parse_special=false)); bytes
    that are not UTF-8 (a breaker cut inside a character) as their one-byte tokens."""
    enc, out = get_encoding(), []
    while data:
        try:
            return out + enc.encode_ordinary(data.decode("utf-8"))
        except UnicodeDecodeError as e:
            out += enc.encode_ordinary(data[: e.start].decode("utf-8"))
            out += [enc.encode_single_token(data[i : i + 1]) for i in range(e.start, e.end)]
            data = data[e.end :]
    return out


@lru_cache(maxsize=256)
def dry_breaker_sequences(breaker: str) -> tuple[tuple[int, tuple[int, ...]], ...]:
    """llama.cpp's token sequences of one DRY sequence breaker over GPT-2's vocabulary (get_overlapping_token_sequences):
    (token, ()) for every token whose text holds the breaker, a breaker by itself; (token, tail) for every other token
    whose text ends with a proper prefix of it, `tail` the rest of the breaker as BPE encodes it (at most 20 tokens).
    Bytes compared, as llama.cpp compares them; a breaker is cut to its first 40 bytes."""
    b = breaker.encode("utf-8", "surrogatepass")[:DRY_BREAKER_BYTES]  # (a JSON string may hold a lone surrogate)
    vocab = _vocab_text()
    out: list[tuple[int, tuple[int, ...]]] = [(t, ()) for t in vocab.holding(b)]
    whole = {t for t, _ in out}
    for k in range(1, len(b)):  # tokens ending with the breaker's first k bytes
        tail = tuple(_bpe_bytes(b[k:])[:DRY_TAIL_TOKENS])
        out += [(t, tail) for t in vocab.ending_with(b[:k]) if t not in whole]
    return tuple(dict.fromkeys(out))


@dataclass(frozen=True)
class _DryBreakers:
    """A set of DRY sequence breakers as token sequences: `alone` (V,) the tokens that break a match by themselves (and
    are never penalised), `head` (V,) the tokens that begin one, `tails` each head's tails, longest first."""

    alone: np.ndarray
    head: np.ndarray
    tails: dict[int, tuple[tuple[int, ...], ...]]

    def limit(self, window: np.ndarray) -> int:
        """llama.cpp's rep_limit: the tokens after the window's last complete breaker (a breaker whose tail runs past
        the window's end does not count); the window's length without one."""
        n = len(window)
        inside = window < VOCAB_SIZE
        heads = np.flatnonzero(inside & self.head[np.where(inside, window, 0)])
        for pos in heads[::-1].tolist():
            after = n - 1 - pos
            for tail in self.tails[int(window[pos])]:  # the longest complete one, as llama.cpp takes
                if len(tail) <= after and tuple(window[pos + 1 : pos + 1 + len(tail)].tolist()) == tail:
                    return after - len(tail)
        return n


@lru_cache(maxsize=64)
def _dry_breakers(breakers: tuple[str, ...]) -> _DryBreakers:
    alone, head = np.zeros(VOCAB_SIZE, dtype=bool), np.zeros(VOCAB_SIZE, dtype=bool)
    tails: dict[int, set[tuple[int, ...]]] = {}
    for breaker in breakers:
        for token, tail in dry_breaker_sequences(breaker):
            head[token] = True
            alone[token] |= not tail
            tails.setdefault(token, set()).add(tail)
    return _DryBreakers(alone, head, {t: tuple(sorted(s, key=len, reverse=True)) for t, s in tails.items()})


class Dry(LogitsProcessor):
    """llama.cpp's DRY ("Don't Repeat Yourself", by p-e-w; llama_sampler_init_dry, llama-server's dry_* fields): a
    token that would extend a repetition loses multiplier * base ** (n - allowed_length) from its logit, n the length
    of the longest suffix of the context that occurred earlier followed by that token, where n >= allowed_length.
    The context is the row's prompt and output, its last penalty_last_n tokens (-1: all, llama.cpp's context size,
    which a row never passes), as llama-server feeds the prompt to its sampler. What follows llama.cpp:

    - Nothing is penalised while the window holds allowed_length tokens or fewer.
    - Sequence breakers are strings, made token sequences over the vocabulary as llama.cpp makes them
      (dry_breaker_sequences): a token whose text holds a breaker breaks by itself; a token whose text ends with a
      proper prefix of one breaks followed by the rest of it as BPE encodes it (a breaker cut to 40 bytes, the rest to
      20 tokens; a rest that begins or ends inside a character has its lone bytes as one-byte tokens, where llama.cpp
      leaves them to its tokenizer). A match never reaches back past the context's last complete breaker (its
      rep_limit): with fewer than allowed_length tokens after it, nothing is penalised; the tokens that break by
      themselves are never penalised.
    - Of a token's earlier occurrences the longest match wins (one penalty per token); a match may overlap the
      suffix it repeats (after `a a a`, `a` extends a match of 2: the first two repeat the last two).
    - The exponent is capped where base ** exponent would pass float32's largest value (llama.cpp's max_exponent).

    Where it differs: a base below 1 is refused (llama-server replaces it with 1.75, llama.cpp's sampler turns off).
    Scores are float64 here (llama.cpp's float32). Each row's matches (the Z-array of its reversed context, llama.cpp
    recomputes it each step) are kept per History.row and grown by one token each step: O(context) per row per step."""

    fields = ("dry_multiplier", "dry_base", "dry_allowed_length", "dry_penalty_last_n", "dry_sequence_breakers")
    reads_history = True

    @classmethod
    def checked(cls, settings: Settings) -> dict[str, Any]:
        m, b = settings.dry_multiplier, settings.dry_base
        _in_range(settings, "dry_multiplier", m >= 0 and math.isfinite(m), ">= 0 (0: off)")
        _in_range(settings, "dry_base", b >= 1 and math.isfinite(b), ">= 1")
        allowed, last_n = settings.dry_allowed_length, settings.dry_penalty_last_n
        _in_range(settings, "dry_allowed_length", _is_int(allowed) and allowed >= 1, "an integer >= 1")
        _in_range(settings, "dry_penalty_last_n", _is_int(last_n) and last_n >= -1, "an integer >= -1 (-1: all, 0: off)")
        breakers = settings.dry_sequence_breakers
        listed = not isinstance(breakers, (str, bytes)) and hasattr(breakers, "__iter__")
        breakers = tuple(breakers) if listed else breakers
        if not listed or not all(isinstance(s, str) and s for s in breakers):
            raise UsageError(f"dry_sequence_breakers must be a list of non-empty strings, got {breakers!r}",
                             option="dry_sequence_breakers")
        return {"dry_allowed_length": int(allowed), "dry_penalty_last_n": int(last_n),
                "dry_sequence_breakers": breakers}

    @classmethod
    def from_settings(cls, settings: Settings) -> Dry | None:
        if not settings.dry_multiplier or not settings.dry_penalty_last_n:
            return None
        return cls(settings.dry_multiplier, settings.dry_base, settings.dry_allowed_length, settings.dry_penalty_last_n,
                   settings.dry_sequence_breakers)

    def __init__(self, multiplier: float, base: float, allowed_length: int, penalty_last_n: int,
                 breakers: Sequence[str] = DRY_BREAKERS, each: Sequence[Dry | None] | None = None):
        self.multiplier, self.base = float(multiplier), float(base)
        self.allowed_length, self.penalty_last_n = int(allowed_length), int(penalty_last_n)
        self.breakers = tuple(breakers)
        # for_rows: row i penalised by each[i], with its parameters and the matches it keeps (None: left as is)
        self._each = each
        # History.row -> (the ids its matches are for, {length: matches of the first `length` ids}), oldest first
        self._matches: dict[object, tuple[np.ndarray, dict[int, np.ndarray]]] = {}

    @classmethod
    def for_rows(cls, procs: Sequence[Dry | None]) -> Dry:
        return cls(0.0, 1.0, 1, 0, (), list(procs))

    def __call__(self, scores: np.ndarray, rows: Sequence[History]) -> np.ndarray:
        at_row, at_token, amount = [], [], []
        for i, h in enumerate(rows):
            own = self if self._each is None else self._each[i]
            if own is None:
                continue
            tokens, penalty = own._penalties(h, len(rows))
            inside = tokens < scores.shape[-1]
            at_row.append(np.full(int(inside.sum()), i))
            at_token.append(tokens[inside])
            amount.append(penalty[inside])
        if at_row:  # (row, token) pairs are distinct: one penalty per token of a row
            scores[np.concatenate(at_row), np.concatenate(at_token)] -= np.concatenate(amount)
        return scores

    def _penalties(self, h: History, rows: int) -> tuple[np.ndarray, np.ndarray]:
        """The tokens this row's next token is penalised at, and by how much."""
        ids = np.fromiter(chain(h.prompt, h.output), dtype=np.int64, count=len(h.prompt) + len(h.output))
        matches = self._kept_matches(h.row, ids, rows)  # every step, so that the next grows them by one token
        start = 0 if self.penalty_last_n < 0 else max(0, len(ids) - self.penalty_last_n)
        n = len(ids) - start
        if n <= self.allowed_length:
            return _NO_PENALTY
        breakers = _dry_breakers(self.breakers)
        limit = breakers.limit(ids[start:]) if self.breakers else n
        if limit < self.allowed_length:
            return _NO_PENALTY
        # The match ending at j: within the window (j - start + 1 tokens) and after the last breaker (limit)
        lengths = np.minimum(np.minimum(matches[start:], np.arange(1, n)), limit)
        ends = np.flatnonzero(lengths >= self.allowed_length)
        tokens, lengths = ids[start + ends + 1], lengths[ends]
        order = np.lexsort((lengths, tokens))  # by token, then length: a token's longest last
        tokens, lengths = tokens[order], lengths[order]
        longest = np.ones(len(tokens), dtype=bool)
        longest[:-1] = tokens[1:] != tokens[:-1]
        tokens, lengths = tokens[longest], lengths[longest]
        inside = tokens < VOCAB_SIZE
        keep = ~inside
        keep[inside] = ~breakers.alone[tokens[inside]]
        tokens, exponent = tokens[keep], (lengths[keep] - self.allowed_length).astype(np.float64)
        if self.base > 1.000001:
            cap = int(_FLOAT32_MAX_LOG / math.log(self.base))
            if cap > 0:
                exponent = np.minimum(exponent, cap)
        with np.errstate(over="ignore"):  # (a base past float32's range is not capped: an infinite penalty, a ban)
            return tokens, self.multiplier * self.base ** exponent

    def _kept_matches(self, key: object, ids: np.ndarray, rows: int) -> np.ndarray:
        """(len(ids) - 1,): at j, the length of the longest common suffix of ids[:j + 1] and ids. Kept per History.row
        and grown by each new token t: the match ending at j grows by one where ids[j] == t, else ends (0); a history
        that left the kept one (a rejected draft) restarts from the kept lengths it shares."""
        key = id(key) if key is not None else None
        seen, kept = self._matches.pop(key, (ids[:0], {}))
        n = min(len(seen), len(ids))
        differ = np.flatnonzero(seen[:n] != ids[:n])
        common = int(differ[0]) if len(differ) else n
        length = max((k for k in kept if k <= common), default=0)
        if len(ids) - length > _DRY_SNAPSHOTS:  # far behind (a new row): computed at once, the last lengths grown
            length, kept = len(ids) - _DRY_SNAPSHOTS, {}
            matches = _suffix_matches(ids[:length])
        else:
            matches = kept.get(length, np.zeros(0, dtype=np.int32))
            kept = {k: m for k, m in kept.items() if k <= length}
        for t in range(length, len(ids)):
            grown = np.ones(t, dtype=np.int32)
            grown[1:] += matches
            matches = np.where(ids[:t] == ids[t], grown, 0).astype(np.int32)
            if t + 1 > len(ids) - _DRY_SNAPSHOTS:
                kept[t + 1] = matches
        kept = {k: m for k, m in kept.items() if k > len(ids) - _DRY_SNAPSHOTS}
        self._matches[key] = (ids, kept)
        while len(self._matches) > max(64, 2 * rows):  # rows that ended: the oldest dropped
            del self._matches[next(iter(self._matches))]
        return matches


class TypicalP(LogitsProcessor):
    """Locally typical sampling (transformers' TypicalLogitsWarper, min_tokens_to_keep 1): the tokens whose surprise
    (-log p) is nearest the distribution's entropy, in that order, until their mass reaches p; the others -inf. Not
    argmax-invariant (the most likely token may be far from typical), so, as in transformers, a sampling warper only."""

    fields = ("typical_p",)
    sampling_only = True

    @classmethod
    def checked(cls, settings: Settings) -> dict[str, Any]:
        return _in_range(settings, "typical_p", 0 < settings.typical_p <= 1, "in (0, 1] (1: off)")

    @classmethod
    def from_settings(cls, settings: Settings) -> TypicalP | None:
        return cls(settings.typical_p) if settings.typical_p < 1.0 else None

    def __init__(self, p: float | np.ndarray):
        self.p = p

    @classmethod
    def for_rows(cls, procs: Sequence[TypicalP | None]) -> TypicalP:
        return cls(_stacked(procs, "p", 1.0))

    def __call__(self, scores: np.ndarray, rows: Sequence[History] = ()) -> np.ndarray:
        def warp(s: np.ndarray, p: float | np.ndarray) -> np.ndarray:
            probs = softmax(s)
            with np.errstate(divide="ignore", invalid="ignore"):
                logp = np.log(probs)
                entropy = -np.nansum(np.where(probs > 0, logp * probs, 0.0), axis=-1, keepdims=True)
            shifted = np.abs(-logp - entropy)  # (n, V); -inf scores: +inf, last
            order = np.argsort(shifted, axis=-1, kind="stable")
            sorted_shift = np.take_along_axis(shifted, order, axis=-1)
            cum = np.cumsum(np.take_along_axis(probs, order, axis=-1), axis=-1)
            ps = np.broadcast_to(np.asarray(p, dtype=np.float64).reshape(-1, 1), (len(s), 1))
            last = np.minimum((cum < ps).sum(axis=-1), s.shape[-1] - 1)  # (n,)
            cutoff = sorted_shift[np.arange(len(s)), last][:, None]
            remove_sorted = sorted_shift > cutoff
            remove_sorted[:, 0] = False  # the most typical token always stays
            remove = np.empty_like(remove_sorted)
            np.put_along_axis(remove, order, remove_sorted, axis=-1)
            return np.where(remove, -np.inf, s)
        return _on_rows(scores, self.p, lambda p: p < 1.0, warp)


class ConstraintMask(LogitsProcessor):
    """Structured output: one llguidance matcher per History.row, synced to each call's histories. A history
    holding a token the matcher refuses (a draft) leaves the row as it is: that token has probability 0, so
    verification stops there. First in the list, as vLLM applies the grammar's mask."""

    fields = ("constraint",)
    reads_history = masks_only = True

    @classmethod
    def checked(cls, settings: Settings) -> dict[str, Any]:
        if settings.constraint is not None:
            settings.constraint.validate()  # an invalid schema, regex or grammar: one UsageError, before any work
            if settings.ignore_eos:
                raise UsageError("ignore_eos cannot be combined with structured output: a constrained row ends "
                                 "where its constraint is satisfied", option="ignore_eos")
        return {}

    @classmethod
    def from_settings(cls, settings: Settings) -> ConstraintMask | None:
        return None if settings.constraint is None else cls(settings.constraint)

    def __init__(self, spec: ConstraintSpec | None, each: Sequence[ConstraintMask | None] | None = None):
        self.spec = spec
        self._rows: dict[int, tuple[Constraint, list[int]]] = {}  # id(row) -> (matcher, the tokens it consumed)
        self._each = each  # for_rows: row i masked by each[i]'s matchers; spec None

    @classmethod
    def for_rows(cls, procs: Sequence[ConstraintMask | None]) -> ConstraintMask:
        return cls(None, list(procs))

    def _synced(self, history: History) -> Constraint | None:
        """The row's matcher at the end of `history`, or None where the history holds a refused token."""
        key = id(history.row) if history.row is not None else None
        if key not in self._rows:
            self._rows[key] = (Constraint(self.spec), [])
        matcher, consumed = self._rows[key]
        output = list(history.output)
        common = 0
        for a, b in zip(consumed, output):
            if a != b:
                break
            common += 1
        if common < len(consumed):
            matcher.rollback(len(consumed) - common)
            del consumed[common:]
        new = output[common:]
        ok = matcher.accepts(new) if new else 0
        for tok in new[:ok]:
            matcher.advance(tok)
        consumed.extend(new[:ok])
        return matcher if ok == len(new) else None

    def _usable(self, history: History) -> Constraint | None:
        """_synced, checked, for a row with one history (no draft): a matcher that cannot continue (llguidance's limits, met by a grammar only as it runs)
        fails its row alone where the row fails alone (decode.Sequence.fails_alone: None, the row left unmasked,
        its token dropped); elsewhere the Gpt2xError is raised."""
        try:
            matcher = self._synced(history)
            if matcher is None:  # a token it refused: a draft's (left unmasked), or its own limits met (failed)
                own, _ = self._rows[id(history.row) if history.row is not None else None]
                if own.matcher.is_error():
                    raise Gpt2xError(f"the {own.spec.kind.value} constraint cannot take a token its mask allowed: "
                                     f"{own.matcher.get_error()}".splitlines()[0])
                return None
            matcher.check()
            return matcher
        except Gpt2xError as e:
            row = history.row
            if not getattr(row, "fails_alone", False):
                raise
            row.fail(str(e))
            return None

    def __call__(self, scores: np.ndarray, rows: Sequence[History]) -> np.ndarray:
        if self._each is not None:  # rows of their own, each with its own matchers: one batched mask
            mask_rows(scores, [None if own is None else own._usable(h) for own, h in zip(self._each, rows)])
            return scores
        if len({id(h.row) for h in rows}) == len(rows):  # one history per row: one batched mask
            mask_rows(scores, [self._usable(h) for h in rows])
            return scores
        for i, h in enumerate(rows):  # a row at several drafted positions, in order
            matcher = self._synced(h)
            if matcher is not None:
                matcher.mask(scores[i])
        return scores


def end_token_ids(settings: Settings) -> tuple[int, ...]:
    """End-of-text and the stop token ids (vLLM's all_stop_token_ids: end-of-text even with ignore_eos)."""
    return (EOT_ID, *settings.stop_token_ids)


# vLLM's order, with DRY after the penalties and bans and before temperature and the truncations (where llama-server's
# default chain has it); every row's list follows it, so rows with lists of their own merge by it (sampling.sample_many).
ORDER: tuple[type[LogitsProcessor], ...] = (ConstraintMask, AllowedTokens, MinTokens, LogitBias, RepetitionPenalty,
                           PresenceFrequencyPenalty, NoRepeatNGram, BadWords, Dry, Temperature, MinP, TopK, TopP, TypicalP)


def processors_for(settings: Settings) -> list[LogitsProcessor]:
    """The ordered list for `settings`, only those that change anything; greedy skips the sampling-only ones."""
    kinds = (k for k in ORDER if not (settings.greedy and k.sampling_only))
    return [p for k in kinds if (p := k.from_settings(settings)) is not None]


def checked_fields(settings: Settings) -> dict[str, Any]:
    """Every processor's fields checked (a UsageError naming the field), and the values SamplingSettings keeps."""
    kept: dict[str, Any] = {}
    for kind in ORDER:
        kept.update(kind.checked(settings))
    return kept


def beam_refused_fields(settings: Settings) -> list[str]:
    """The fields set that a processor which is not sampling-only reads: what beam search, which searches the raw
    distribution, refuses."""
    return [f for k in ORDER if not k.sampling_only and k.from_settings(settings) is not None for f in k.fields
            if getattr(settings, f) != getattr(type(settings), f, None)]


def softmax(scores: np.ndarray, inplace: bool = False) -> np.ndarray:
    """Row-wise probabilities; a row with +inf scores (an overflowing division) shares its mass among them.
    `inplace`: no new array, whose first touch costs as much as the arithmetic on a (16, 50257) batch."""
    top = scores.max(axis=-1, keepdims=True)
    if not np.isfinite(top).all():
        scores = np.where(np.isposinf(top), np.where(np.isposinf(scores), 0.0, -np.inf), scores)
        top = scores.max(axis=-1, keepdims=True)
    if not inplace:
        scores = scores.copy()
    np.subtract(scores, top, out=scores)
    np.exp(scores, out=scores)
    scores /= scores.sum(axis=-1, keepdims=True)
    return scores
