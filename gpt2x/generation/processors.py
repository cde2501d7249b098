"""Logits processors: the one ordered list of transforms that turns a step's logits into the scores
the sampler draws from (or, greedy, takes the argmax of). Every decoding path samples through it
(generation.sampling.Sampler: the decode loop, speculative decoding's drafts and acceptance rule, the
serving engine, the evaluation harness), so a transform added here is applied everywhere.

A processor is called with the scores (B, V) float64 and each row's `History` (its prompt ids, the
ids generated so far, and who the row is) and returns the scores (B, V) float64; a token it removes
gets -inf. It may change `scores` in place and return it (the sampler hands the list its own float64
copy of the logits): the penalties, the bias and min_tokens touch a few entries of each row, and a
copy of a (16, 50257) batch per processor would cost more than they do.
Rows in one call share the settings the processors were made from (one Sampler); in speculative
decoding the rows of one call are one sequence at successive drafted positions, each History that
sequence's tokens up to its position (`History.extended`).

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
    output as the target accepted it; the histories of one call are in position order."""

    argmax_invariant: bool
    reads_history: bool

    def __call__(self, scores: np.ndarray, rows: Sequence[History]) -> np.ndarray:
        ...


class Temperature:
    """Scores divided by the temperature (> 0; 0 is greedy decoding, which skips it)."""

    argmax_invariant = True
    reads_history = False

    def __init__(self, temperature: float):
        self.temperature = temperature

    def __call__(self, scores: np.ndarray, rows: Sequence[History] = ()) -> np.ndarray:
        with np.errstate(over="ignore"):  # a tiny temperature: +inf, which softmax reads as the argmax
            return scores / self.temperature


class TopK:
    """Only the k highest scores stay (ties with the k-th stay too)."""

    argmax_invariant = True
    reads_history = False

    def __init__(self, k: int):
        self.k = k

    def __call__(self, scores: np.ndarray, rows: Sequence[History] = ()) -> np.ndarray:
        if self.k >= scores.shape[-1]:
            return scores
        kth = np.partition(scores, -self.k, axis=-1)[:, -self.k][:, None]
        return np.where(scores < kth, -np.inf, scores)


class TopP:
    """Nucleus: the smallest set of most likely tokens whose probability reaches p stays (a token stays
    when the mass of the tokens more likely than it is below p; the most likely always stays)."""

    argmax_invariant = True
    reads_history = False

    def __init__(self, p: float):
        self.p = p

    def __call__(self, scores: np.ndarray, rows: Sequence[History] = ()) -> np.ndarray:
        probs = softmax(scores)
        order = np.argsort(-probs, axis=-1, kind="stable")
        sorted_p = np.take_along_axis(probs, order, axis=-1)
        before = np.cumsum(sorted_p, axis=-1) - sorted_p  # mass strictly before each token
        keep = np.zeros(scores.shape, dtype=bool)
        np.put_along_axis(keep, order, before < self.p, axis=-1)
        return np.where(keep, scores, -np.inf)


class MinP:
    """Only tokens at least `min_p` times as likely as the most likely token stay (transformers'
    MinPLogitsWarper, vLLM's min_p): removed where p < min_p * max p. The most likely always stays."""

    argmax_invariant = True
    reads_history = False

    def __init__(self, min_p: float):
        self.min_p = min_p

    def __call__(self, scores: np.ndarray, rows: Sequence[History] = ()) -> np.ndarray:
        probs = softmax(scores)
        return np.where(probs < self.min_p * probs.max(axis=-1, keepdims=True), -np.inf, scores)


class MinTokens:
    """Until a row has generated `min_tokens` tokens, its end tokens (end-of-text and the stop token
    ids) get -inf: vLLM's min_tokens (transformers' MinNewTokensLengthLogitsProcessor). Ids outside
    the model's vocabulary are left out."""

    argmax_invariant = False
    reads_history = True

    def __init__(self, min_tokens: int, end_ids: Iterable[int]):
        self.min_tokens = min_tokens
        self.end_ids = np.unique(np.asarray(list(end_ids), dtype=np.int64))

    def __call__(self, scores: np.ndarray, rows: Sequence[History]) -> np.ndarray:
        short = np.flatnonzero([len(h.output) < self.min_tokens for h in rows])
        ids = self.end_ids[self.end_ids < scores.shape[-1]]
        if len(short) and len(ids):
            scores[np.ix_(short, ids)] = -np.inf
        return scores


class AllowedTokens:
    """Only the given tokens can be sampled: every other gets -inf (vLLM's allowed_token_ids, which
    it applies before the penalties and the bias). One mask, shared by every row of the call; ids
    outside the model's vocabulary are left out."""

    argmax_invariant = False
    reads_history = False

    def __init__(self, ids: Iterable[int]):
        self.ids = np.unique(np.asarray(list(ids), dtype=np.int64))
        self._banned: np.ndarray | None = None  # the complement, made once for the logits' width

    def __call__(self, scores: np.ndarray, rows: Sequence[History] = ()) -> np.ndarray:
        vocab = scores.shape[-1]
        if self._banned is None or self._banned.shape[0] != vocab:
            banned = np.ones(vocab, dtype=bool)
            banned[self.ids[self.ids < vocab]] = False
            self._banned = banned
        scores[:, self._banned] = -np.inf
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

    def __call__(self, scores: np.ndarray, rows: Sequence[History] = ()) -> np.ndarray:
        inside = self.ids < scores.shape[-1]
        scores[:, self.ids[inside]] += self.values[inside]
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
    repeating, < 1 encourages it)."""

    argmax_invariant = False
    reads_history = True

    def __init__(self, penalty: float):
        self.penalty = penalty

    def __call__(self, scores: np.ndarray, rows: Sequence[History]) -> np.ndarray:
        row, token = np.divmod(np.unique(_flat_ids(rows, scores.shape[-1], prompt=True)), scores.shape[-1])
        if len(row):
            seen = scores[row, token]
            with np.errstate(over="ignore", under="ignore"):  # a huge penalty: -inf, a ban (0 where positive)
                scores[row, token] = np.where(seen > 0, seen / self.penalty, seen * self.penalty)
        return scores


class PresenceFrequencyPenalty:
    """OpenAI's presence and frequency penalties, on the generated tokens only (as OpenAI and vLLM
    define them): logit[j] -= count[j] * frequency_penalty + (count[j] > 0) * presence_penalty, count[j]
    the times token j was generated in the row."""

    argmax_invariant = False
    reads_history = True

    def __init__(self, presence: float, frequency: float):
        self.presence = presence
        self.frequency = frequency

    def __call__(self, scores: np.ndarray, rows: Sequence[History]) -> np.ndarray:
        flat, counts = np.unique(_flat_ids(rows, scores.shape[-1], prompt=False), return_counts=True)
        if len(flat):
            row, token = np.divmod(flat, scores.shape[-1])
            scores[row, token] -= counts * self.frequency + self.presence  # (row, token) pairs are distinct
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

    def __init__(self, spec: ConstraintSpec):
        self.spec = spec
        self._rows: dict[int, tuple[Constraint, list[int]]] = {}  # id(row) -> (matcher, the tokens it consumed)

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


def processors_for(settings: SamplingSettings) -> list[LogitsProcessor]:
    """The ordered list for `settings` (only those that change anything). Greedy decoding keeps those
    that can move the argmax (min_tokens, logit_bias, the penalties) and skips the warpers."""
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
        return chain
    if settings.temperature != 1.0:
        chain.append(Temperature(settings.temperature))
    if settings.min_p:
        chain.append(MinP(settings.min_p))
    if settings.top_k:
        chain.append(TopK(settings.top_k))
    if settings.top_p < 1.0:
        chain.append(TopP(settings.top_p))
    return chain


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
