"""Logits processors: the one ordered list of transforms that turns a step's logits into the scores
the sampler draws from (or, greedy, takes the argmax of). Every decoding path samples through it
(generation.sampling.Sampler: the decode loop, speculative decoding's drafts and acceptance rule, the
serving engine, the evaluation harness), so a transform added here is applied everywhere.

A processor is called with the scores (B, V) float64 and each row's `History` (its prompt ids, the
ids generated so far, and who the row is) and returns the scores (B, V) float64; a token it removes
gets -inf. It may change `scores` in place and return it (the sampler hands the list its own float64
copy of the logits): the penalties, the bias and min_tokens touch a few entries of each row, and a
copy of a (16, 50257) batch per processor would cost more than they do.
Each processor is written once, for a batch: its parameters are one value for every row (a Sampler's
settings: `Temperature(0.7)`) or one per row (`Temperature.for_rows`: rows with samplers of their
own, sampled together by sampling.sample_many; a row without that processor gets the identity, as
vLLM v1's batch-level processors do). One row is the batch-of-one case. In speculative decoding the
rows of one call are one sequence at successive drafted positions, each History that sequence's
tokens up to its position (`History.extended`).

The order is vLLM's (v1 sampler): the transforms that can move the argmax first, so that greedy
decoding applies them too -
  allowed_token_ids (every other token masked), min_tokens (end-of-text and stop_token_ids
  masked), logit_bias, repetition_penalty, frequency_penalty and presence_penalty;
then the sampling warpers, which greedy decoding skips (none of them moves the argmax) -
  temperature, min_p, top-k, top-p.
(transformers applies min_p after top-k and top-p; the two orders differ only when min_p is combined
with top-k or top-p.) `argmax_invariant` says which group a processor is in: a greedy row whose list
holds only invariant ones takes the plain argmax of its logits (the backend's own, where the logits are).

A processor with per-row state (a grammar's matcher, advanced with each accepted token and rolled
back when speculative decoding rejects drafted ones) keeps it per `History.row` and brings it to the
History it is called with: the tokens it has consumed for that row against `History.output` (keep
the common prefix, roll back the rest, consume what is new), then computes its mask. The histories
it is given are the truth; no other hook is needed (see the class docstring of LogitsProcessor).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from ..tokenizer import EOT_ID
from .constraints import Constraint, ConstraintSpec, mask_rows
from .settings import SamplingSettings


@dataclass(frozen=True, slots=True)
class History:
    """One row's tokens, as the processors read them: its prompt ids and the ids generated so far
    (a live list: a Sequence's own `tokens`, which grow as it accepts), and who the row is (`row`:
    the key under which a processor keeps per-row state; the Sequence itself in the decode loop)."""

    prompt: Sequence[int]
    output: Sequence[int]
    row: object = None

    def extended(self, tokens: Sequence[int]) -> History:
        """The same row with `tokens` generated after its output (a drafted position)."""
        return History(self.prompt, [*self.output, *tokens], self.row) if tokens else self


class LogitsProcessor(Protocol):
    """scores (B, V) float64 and each row's History -> scores (B, V) float64 (removed tokens: -inf).

    `argmax_invariant`: True when it never moves a row's argmax (temperature, min-p, top-k, top-p),
    so that greedy decoding can skip it. `reads_history`: whether it reads the rows' histories (a
    caller that has none may call a list without such processors with `rows` None).

    A stateful processor (a grammar's mask) keeps its state per `History.row` and syncs it to the
    History of each call (consumed tokens against `History.output`: roll back what is no longer
    there, consume what is new): the decode loop calls it with each row's growing output, speculative
    decoding with the output followed by the drafted tokens up to each position, then with the
    output as the target accepted it; the histories of one call are in position order.

    `for_rows(procs)`: one processor for a batch whose row i it processes as procs[i] would alone
    (None: the row is left as it is); the rows' parameters become per-row arrays."""

    argmax_invariant: bool
    reads_history: bool

    def __call__(self, scores: np.ndarray, rows: Sequence[History]) -> np.ndarray:
        ...

    @classmethod
    def for_rows(cls, procs: Sequence[LogitsProcessor | None]) -> LogitsProcessor:
        ...


def _per_row(value: float | np.ndarray, n: int, dtype: type = np.float64) -> np.ndarray:
    """A parameter as one value per row (n,): a scalar is every row's."""
    a = np.asarray(value, dtype=dtype)
    if a.ndim == 0:
        return np.full(n, a, dtype=dtype)
    if a.shape != (n,):
        raise ValueError(f"{len(a)} per-row parameters for {n} rows")
    return a


def _on_rows(scores: np.ndarray, live: np.ndarray, warp) -> np.ndarray:
    """warp(scores of some rows, their index into the batch) applied to the rows where `live`: a new
    array when every row is (the input left as it is), else written into those rows of `scores` (the
    others, the identity's rows, are not touched, not even copied)."""
    if live.all():
        return warp(scores, slice(None))
    at = np.flatnonzero(live)
    if len(at):
        scores[at] = warp(scores[at], at)
    return scores


def _stacked(procs: Sequence, attr: str, identity: float) -> np.ndarray:
    """Each row's `attr` of its processor (identity where it has none), as a per-row array."""
    return np.array([identity if p is None else getattr(p, attr) for p in procs])


class Temperature:
    """Scores divided by the temperature (> 0; 0 is greedy decoding, which skips it; 1: left as is)."""

    argmax_invariant = True
    reads_history = False

    def __init__(self, temperature: float | np.ndarray):
        self.temperature = temperature  # one for every row, or one per row

    @classmethod
    def for_rows(cls, procs: Sequence[Temperature | None]) -> Temperature:
        return cls(_stacked(procs, "temperature", 1.0))

    def __call__(self, scores: np.ndarray, rows: Sequence[History] = ()) -> np.ndarray:
        t = _per_row(self.temperature, len(scores))

        def warp(s: np.ndarray, at) -> np.ndarray:
            with np.errstate(over="ignore"):  # a tiny temperature: +inf, which softmax reads as the argmax
                return s / t[at, None]
        return _on_rows(scores, t != 1.0, warp)


class TopK:
    """Only the k highest scores stay (ties with the k-th stay too; k 0 or >= V: every score stays)."""

    argmax_invariant = True
    reads_history = False

    def __init__(self, k: int | np.ndarray):
        self.k = k  # one for every row, or one per row

    @classmethod
    def for_rows(cls, procs: Sequence[TopK | None]) -> TopK:
        return cls(_stacked(procs, "k", 0).astype(np.int64))

    def __call__(self, scores: np.ndarray, rows: Sequence[History] = ()) -> np.ndarray:
        v = scores.shape[-1]
        k = _per_row(self.k, len(scores), np.int64)

        def warp(s: np.ndarray, at) -> np.ndarray:
            # one partition puts every row's k-th largest in its sorted place, however many ks the rows ask
            kth_at = v - k[at]
            part = np.partition(s, np.unique(kth_at), axis=-1)
            kth = part[np.arange(len(s)), kth_at][:, None]
            return np.where(s < kth, -np.inf, s)
        return _on_rows(scores, (k > 0) & (k < v), warp)


class TopP:
    """Nucleus: the smallest set of most likely tokens whose probability reaches p stays (a token stays
    when the mass of the tokens more likely than it is below p; the most likely always stays; p >= 1:
    every token stays)."""

    argmax_invariant = True
    reads_history = False

    def __init__(self, p: float | np.ndarray):
        self.p = p  # one for every row, or one per row

    @classmethod
    def for_rows(cls, procs: Sequence[TopP | None]) -> TopP:
        return cls(_stacked(procs, "p", 1.0))

    def __call__(self, scores: np.ndarray, rows: Sequence[History] = ()) -> np.ndarray:
        p = _per_row(self.p, len(scores))

        def warp(s: np.ndarray, at) -> np.ndarray:
            probs = softmax(s)
            keep = np.zeros(s.shape, dtype=bool)
            for row, row_p, row_keep in zip(probs, p[at], keep):
                _top_p_keep(row, row_p, row_keep)
            return np.where(keep, s, -np.inf)
        return _on_rows(scores, p < 1.0, warp)


_MARGIN = 1e-6  # the head's mass must pass p by this much (far above cumsum's rounding, ~1e-11)


def _top_p_keep(probs: np.ndarray, p: float, keep: np.ndarray) -> None:
    """TopP's kept tokens of one row (V,) into `keep`, sorting only the head of the distribution (a
    full argsort is most of the cost): the tokens at or above the m-th largest probability (ties
    included) are a prefix of the stable descending order, so their sorted order, cumsum and
    `before < p` are the full sort's own; once the head's mass is past p (with a margin), every token
    after it has `before` >= p too, removed. The head grows until it is; the full sort is the last resort."""
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


class MinP:
    """Only tokens at least `min_p` times as likely as the most likely token stay (transformers'
    MinPLogitsWarper, vLLM's min_p): removed where p < min_p * max p. The most likely always stays
    (min_p 0: every token)."""

    argmax_invariant = True
    reads_history = False

    def __init__(self, min_p: float | np.ndarray):
        self.min_p = min_p  # one for every row, or one per row

    @classmethod
    def for_rows(cls, procs: Sequence[MinP | None]) -> MinP:
        return cls(_stacked(procs, "min_p", 0.0))

    def __call__(self, scores: np.ndarray, rows: Sequence[History] = ()) -> np.ndarray:
        min_p = _per_row(self.min_p, len(scores))

        def warp(s: np.ndarray, at) -> np.ndarray:
            probs = softmax(s)
            return np.where(probs < min_p[at, None] * probs.max(axis=-1, keepdims=True), -np.inf, s)
        return _on_rows(scores, min_p > 0, warp)


class MinTokens:
    """Until a row has generated `min_tokens` tokens, its end tokens (end-of-text and the stop token
    ids) get -inf: vLLM's min_tokens (transformers' MinNewTokensLengthLogitsProcessor). Ids outside
    the model's vocabulary are left out."""

    argmax_invariant = False
    reads_history = True

    def __init__(self, min_tokens: int | np.ndarray, end_ids: Iterable[int]):
        self.min_tokens = min_tokens  # one for every row, or one per row (0: left as is)
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


class AllowedTokens:
    """Only the given tokens can be sampled: every other gets -inf (vLLM's allowed_token_ids, which
    it applies before the penalties and the bias). Ids outside the model's vocabulary are left out."""

    argmax_invariant = False
    reads_history = False

    def __init__(self, ids: Iterable[int], each: Sequence[AllowedTokens | None] | None = None):
        self.ids = np.unique(np.asarray(list(ids), dtype=np.int64))
        self._banned: np.ndarray | None = None  # the complement, made once for the logits' width
        self._each = each  # for_rows: row i masked by each[i]'s own mask (None: left as is)

    @classmethod
    def for_rows(cls, procs: Sequence[AllowedTokens | None]) -> AllowedTokens:
        return cls((), list(procs))

    def banned(self, vocab: int) -> np.ndarray:
        """The tokens this one removes, as a mask (vocab,) (kept for the width it was last asked for)."""
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


class LogitBias:
    """A bias added to given tokens' logits (OpenAI's and vLLM's logit_bias: -100 bans a token in
    practice, 100 all but forces it). Ids outside the model's vocabulary are left out."""

    argmax_invariant = False
    reads_history = False

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


class RepetitionPenalty:
    """The CTRL rule (Keskar et al. 2019), as transformers' RepetitionPenaltyLogitsProcessor and
    vLLM's repetition_penalty apply it: the logit of every token in the row's prompt or output is
    divided by the penalty where it is positive, multiplied by it otherwise (> 1 discourages
    repeating, < 1 encourages it, 1: left as is)."""

    argmax_invariant = False
    reads_history = True

    def __init__(self, penalty: float | np.ndarray):
        self.penalty = penalty  # one for every row, or one per row

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


class PresenceFrequencyPenalty:
    """OpenAI's presence and frequency penalties, on the generated tokens only (as OpenAI and vLLM
    define them): logit[j] -= count[j] * frequency_penalty + (count[j] > 0) * presence_penalty, count[j]
    the times token j was generated in the row."""

    argmax_invariant = False
    reads_history = True

    def __init__(self, presence: float | np.ndarray, frequency: float | np.ndarray):
        self.presence = presence  # each one for every row, or one per row
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


class ConstraintMask:
    """Structured output (constraints.py): each row's tokens kept to its constraint by llguidance's
    matcher, one per row (kept by History.row), synced to each call's histories: the tokens it
    consumed that the history no longer holds are rolled back (speculative decoding's rejected
    drafts), the new ones consumed. A history that holds a token the matcher refuses (a drafted one)
    leaves that row's scores as they are: its refused token has probability 0, so the verification
    stops there. First in the list (vLLM applies the grammar's mask before everything else)."""

    argmax_invariant = False
    reads_history = True

    def __init__(self, spec: ConstraintSpec | None, each: Sequence[ConstraintMask | None] | None = None):
        self.spec = spec
        self._rows: dict[int, tuple[Constraint, list[int]]] = {}  # id(row) -> (matcher, the tokens it consumed)
        self._each = each  # for_rows: row i masked by each[i]'s matchers (None: left as is); spec None

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

    def __call__(self, scores: np.ndarray, rows: Sequence[History]) -> np.ndarray:
        if self._each is not None:  # rows of their own, each with its own matchers: one batched mask
            mask_rows(scores, [None if own is None else own._synced(h) for own, h in zip(self._each, rows)])
            return scores
        if len({id(h.row) for h in rows}) == len(rows):  # one history per row: one batched mask
            mask_rows(scores, [self._synced(h) for h in rows])
            return scores
        for i, h in enumerate(rows):  # a row at several drafted positions, in order
            matcher = self._synced(h)
            if matcher is not None:
                matcher.mask(scores[i])
        return scores


def end_token_ids(settings: SamplingSettings) -> tuple[int, ...]:
    """The tokens that end a row: end-of-text and the stop token ids (what min_tokens masks, as
    vLLM's all_stop_token_ids; end-of-text is masked even with ignore_eos, as there)."""
    return (EOT_ID, *settings.stop_token_ids)


# The order every list applies its processors in (vLLM's; see the module): each row's list is in it,
# so rows with lists of their own merge into one batch list by it (sampling.sample_many).
ORDER: tuple[type, ...] = (ConstraintMask, AllowedTokens, MinTokens, LogitBias, RepetitionPenalty,
                           PresenceFrequencyPenalty, Temperature, MinP, TopK, TopP)


def processors_for(settings: SamplingSettings) -> list[LogitsProcessor]:
    """The ordered list for `settings` (only those that change anything), in ORDER. Greedy decoding
    keeps those that can move the argmax (min_tokens, logit_bias, the penalties) and skips the warpers."""
    chain: list[LogitsProcessor] = []
    if settings.constraint is not None:
        chain.append(ConstraintMask(settings.constraint))
    if settings.allowed_token_ids:
        chain.append(AllowedTokens(settings.allowed_token_ids))
    if settings.min_tokens:
        chain.append(MinTokens(settings.min_tokens, end_token_ids(settings)))
    if settings.logit_bias:
        chain.append(LogitBias(settings.logit_bias))
    if settings.repetition_penalty != 1.0:
        chain.append(RepetitionPenalty(settings.repetition_penalty))
    if settings.presence_penalty or settings.frequency_penalty:
        chain.append(PresenceFrequencyPenalty(settings.presence_penalty, settings.frequency_penalty))
    if settings.greedy:
        return sorted(chain, key=lambda p: ORDER.index(type(p)))
    if settings.temperature != 1.0:
        chain.append(Temperature(settings.temperature))
    if settings.min_p:
        chain.append(MinP(settings.min_p))
    if settings.top_k:
        chain.append(TopK(settings.top_k))
    if settings.top_p < 1.0:
        chain.append(TopP(settings.top_p))
    return sorted(chain, key=lambda p: ORDER.index(type(p)))


def softmax(scores: np.ndarray, inplace: bool = False) -> np.ndarray:
    """Row-wise probabilities of scores (B, V) float64; -inf scores get 0. A row with +inf scores (a
    tiny temperature or repetition penalty overflowing the division) gives them all its mass, shared.
    `inplace`: written into `scores` (the same values; no new arrays, whose first touch costs as much
    as the arithmetic on a (16, 50257) batch)."""
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
