"""Speculative decoding at batch 1: a cheap draft proposes K tokens, the target checks all K in one
step over K + 1 new positions, and the tokens it agrees with are kept, so one read of the target's
weights can yield up to K + 1 tokens.

The output is the target's own:
- greedy: a drafted token is kept while it is the target's argmax at its position; the first one
  that is not is replaced by the argmax, and after K kept tokens the argmax of the last position is
  a bonus token. The tokens equal plain greedy decoding's, except where scoring K + 1 positions in
  one step instead of one at a time moves a near-tie's float rounding (measured and stated in
  benchmarks/speculative.py, in git at 92ef2fb; the tests hold it to a stated logit margin);
- sampling: the standard rule (Leviathan et al. 2023, Chen et al. 2023). A drafted token d drawn
  from the draft's q is kept with probability min(1, p(d) / q(d)); the first that is not is replaced
  by a draw from max(0, p - q) normalised; after K kept tokens a bonus token is drawn from p. A draft
  without probabilities (ngram) is a point mass: a token is drawn from p and the draft token is
  kept if the draw equals it. The logits processors (penalties, logit_bias, min_tokens, temperature,
  min-p, top-k, top-p) shape p and q alike (Sampler.probabilities), each position with its own
  history (generation.processors.History: the output so far followed by the drafted tokens before
  it, as vLLM applies penalties to drafted positions), and every draw uses the sampler's one seeded
  generator. Greedy takes the argmax of the processed scores the same way (of the logits themselves
  when no processor moves it), so greedy with a penalty still gives plain greedy's tokens.

Both caches roll back the positions of rejected tokens (`KVCache.truncate`): the target's holds the
K + 1 verified positions and drops the rejected ones; the draft's, which ran one token ahead, drops
what the target rejected, and catches up (one multi-token step) on whatever it has not seen.

How many tokens to draft is `DraftControl`'s choice: K grows after full acceptance and shrinks after
rejections, and decoding turns plain while the measured tokens per second of speculative rounds fall
below those of plain steps, probing again (with few tokens) after a growing number of plain steps, so
a draft that rarely agrees costs a few probes.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np

from ..errors import UsageError
from ..numerics import positions
from ..runtime.base import Backend
from ..runtime.registry import cannot_roll_back
from .processors import History
from .sampling import Sampler

NGRAM_MAX = 3  # prompt lookup matches the last 3 tokens first, then 2, then 1


@dataclass(frozen=True)
class DraftSettings:
    num_speculative_tokens: int = 8  # K: the most draft tokens one verification checks (vLLM's name)
    adaptive: bool = True  # K (and whether to speculate at all) from measured costs and acceptance; False: always K
    ngram_max: int = NGRAM_MAX  # prompt lookup: the longest suffix matched
    ngram_min: int = 1  # ... and the shortest

    def __post_init__(self) -> None:
        if not 1 <= self.num_speculative_tokens <= 32:
            raise UsageError(f"num_speculative_tokens must be in 1..32, got {self.num_speculative_tokens}",
                             option="num_speculative_tokens")
        if not 1 <= self.ngram_min <= self.ngram_max:
            raise UsageError(f"ngram sizes must satisfy 1 <= min <= max, got {self.ngram_min}, {self.ngram_max}")


@dataclass
class Proposal:
    tokens: list[int]  # the drafted tokens, d_1 .. d_k
    q: np.ndarray | None = None  # (k, V) the draft's filtered distributions they were drawn from; None: point masses


class Drafter(Protocol):
    name: str  # "ngram", or the draft model's name and precision
    n_positions: int  # the longest sequence it can draft for

    def reset(self) -> None:
        """Forget the previous sequence: a new one starts."""
        ...

    def sync(self, tokens: list[int]) -> None:
        """Catch up on the sequence but its newest token (a draft model's multi-token step after plain
        steps or at the start), so that `propose` times drafting alone."""
        ...

    def propose(self, tokens: list[int], k: int, sampler: Sampler, history: History | None = None) -> Proposal:
        """Up to `k` tokens to follow `tokens` (prompt and output so far); `history`: the same sequence
        as the logits processors read it (its prompt and output; None: all of `tokens` as the prompt).
        A draft that samples draws through `sampler`'s processors, so that q is shaped as p is."""
        ...

    def keep(self, length: int) -> None:
        """Only the first `length` tokens of the sequence stand: drop what the draft holds beyond them."""
        ...


class NgramDrafter:
    """Prompt lookup: the draft is the continuation of the latest earlier occurrence of the sequence's
    last n tokens (n from ngram_max down to ngram_min), in the prompt and the text generated so far.
    No model, no cache, no probabilities (a point mass)."""

    name = "ngram"
    n_positions = 1 << 30

    def __init__(self, settings: DraftSettings = DraftSettings()):
        self.n_max, self.n_min = settings.ngram_max, settings.ngram_min

    def reset(self) -> None:
        pass

    def sync(self, tokens: list[int]) -> None:
        pass

    def propose(self, tokens: list[int], k: int, sampler: Sampler, history: History | None = None) -> Proposal:
        return Proposal(lookup(tokens, k, self.n_max, self.n_min))

    def keep(self, length: int) -> None:
        pass


def lookup(tokens: list[int], k: int, n_max: int = NGRAM_MAX, n_min: int = 1) -> list[int]:
    """The up to `k` tokens that followed the latest earlier occurrence of the last n tokens, for the
    largest n in [n_min, n_max] that occurs earlier; [] when none does."""
    seq = np.asarray(tokens, dtype=np.int64)
    L = len(seq)
    for n in range(min(n_max, L - 1), n_min - 1, -1):
        # Windows starting at 0 .. L - n - 1: every occurrence that ends before the last token.
        windows = np.lib.stride_tricks.sliding_window_view(seq[: L - 1], n)
        hits = np.flatnonzero((windows == seq[L - n :]).all(axis=1))
        if len(hits):
            start = int(hits[-1]) + n
            return seq[start : start + k].tolist()
    return []


class ModelDrafter:
    """A draft model on any backend that rolls back: its own KV cache over the sequence's first
    `cached` tokens, one token behind the sequence after each proposal."""

    def __init__(self, backend: Backend, name: str | None = None):
        refuse_unrollable(backend, "draft")
        self.backend = backend
        self.name = name or backend.model_name
        self.n_positions = backend.n_positions
        self.past = None
        self.cached = 0  # tokens of the sequence the cache holds

    def reset(self) -> None:
        self.past = None
        self.cached = 0

    def sync(self, tokens: list[int]) -> None:
        if len(tokens) - 1 - self.cached > 1 and len(tokens) - 1 <= self.n_positions:
            self._feed(tokens[self.cached : len(tokens) - 1], len(tokens) - 1)

    def _feed(self, ids: list[int], total: int) -> np.ndarray:
        arr = np.asarray([ids], dtype=np.int64)
        mask = np.ones((1, total), dtype=np.int64)
        logits, self.past = self.backend.step(arr, mask, positions(mask, len(ids)), self.past)
        self.cached = total
        return logits[0]

    def propose(self, tokens: list[int], k: int, sampler: Sampler, history: History | None = None) -> Proposal:
        k = min(k, self.n_positions - len(tokens) + 1)
        if k < 1:
            return Proposal([])
        history = History(tokens, ()) if history is None else history
        logits = self._feed(tokens[self.cached :], len(tokens))  # catch up: at least the newest token
        out: list[int] = []
        qs = []
        for i in range(k):
            rows = [history.extended(out)] if sampler.reads_history else None
            if sampler.s.greedy:
                tok = int(sampler.greedy(logits[None], rows)[0])
            else:
                q = sampler.probabilities(logits[None], rows)[0]
                tok = int(sampler.draw(q[None])[0])
                qs.append(q)
            out.append(tok)
            if i < k - 1:
                logits = self._feed([tok], len(tokens) + i + 1)
        return Proposal(out, np.stack(qs) if qs else None)

    def keep(self, length: int) -> None:
        if self.cached > length:
            self.past = self.past.truncate(length)
            self.cached = length


# ---------------------------------------------------------------- choosing K


@dataclass
class DraftControl:
    """Chooses each round's K (0: a plain step) and measures whether speculating pays.

    - K starts at `start_tokens`, grows by `grow` after a round whose drafted tokens were all
      accepted and shrinks by one after a rejection, within [1, num_speculative_tokens] (transformers' assisted
      generation adapts its K the same way). Rounds that grow K are not judged below (unless far
      slower than plain): a draft that pays only at a large K is not given up on its way there.
    - Whether it pays is measured, not modelled: the tokens per second of recent speculative rounds
      (draft, verification and rollback) against those of recent plain steps, each as decayed sums
      of tokens over decayed sums of seconds (so a round weighs by its time). The
      first decode steps are plain, to measure the latter. While speculation is slower, decoding turns
      plain for `backoff` steps, then one round drafts again (a probe, with the current K: a draft
      that rarely agrees has shrunk it to 1 by then, so its probes cost little); a probe that does
      not pay multiplies the backoff by `backoff_growth` (up to max_backoff), one that does resumes
      speculation.
    With adaptive False, every round drafts num_speculative_tokens (reproducible: no timing decides anything)."""

    num_speculative_tokens: int
    adaptive: bool = True
    start_tokens: int = 1
    grow: int = 2
    decay: float = 0.8
    ramp_floor: float = 0.8  # a round that grows K is not judged if it ran at least this share of plain's rate
    min_backoff: int = 32
    backoff_growth: int = 4
    max_backoff: int = 512
    first_plain: int = 2  # plain steps that measure plain decoding before the first round
    skip_cold: bool = True  # a fully accepted round drafting a K for the first time is neither judged nor counted
    k: int = 0
    plain_steps: int = 0
    plain_sums: tuple[float, float] | None = None  # decayed (tokens, seconds) of plain steps
    spec_sums: tuple[float, float] | None = None  # decayed (tokens, seconds) of speculative rounds
    plain_run: int = 0  # plain steps since the last round
    backing_off: bool = False
    backoff: int = 0
    history: list[int] = field(default_factory=list)  # each round's K (0: plain), for reports and tests
    seen: set[int] = field(default_factory=set)  # the K drafted so far

    def __post_init__(self) -> None:
        self.k = min(self.start_tokens, self.num_speculative_tokens)
        self.backoff = self.min_backoff

    def next_k(self, cap: int) -> int:
        """K for the next round, at most `cap` (the tokens and context left)."""
        if cap < 1:
            k = 0
        elif not self.adaptive:
            k = min(self.num_speculative_tokens, cap)
        elif self.plain_steps < self.first_plain:
            k = 0  # measure plain decoding first
        elif self.backing_off:
            k = 0 if self.plain_run < self.backoff else min(self.k, cap)
        else:
            k = min(self.k, cap)
        self.history.append(k)
        return k

    @property
    def plain_rate(self) -> float | None:
        """Tokens per second of recent plain steps."""
        return None if self.plain_sums is None else self.plain_sums[0] / max(self.plain_sums[1], 1e-12)

    @property
    def spec_rate(self) -> float | None:
        """Tokens per second of recent speculative rounds."""
        return None if self.spec_sums is None else self.spec_sums[0] / max(self.spec_sums[1], 1e-12)

    def _add(self, sums: tuple[float, float] | None, tokens: int, seconds: float) -> tuple[float, float]:
        return (tokens, seconds) if sums is None else (self.decay * sums[0] + tokens, self.decay * sums[1] + seconds)

    def plain(self, seconds: float) -> None:
        """A plain step (one token) took `seconds`."""
        self.plain_sums = self._add(self.plain_sums, 1, seconds)
        self.plain_run += 1
        self.plain_steps += 1

    def speculated(self, drafted: int, accepted: int, draft_seconds: float, verify_seconds: float) -> None:
        """A round drafted `drafted` tokens in `draft_seconds`, of which the target kept `accepted`, and
        verified them (and rolled back) in `verify_seconds`. A round whose tokens were all kept while
        K could still grow is not judged (K grows: a short round says little of a longer one), unless
        it ran below ramp_floor of plain's rate or a fully accepted round of num_speculative_tokens at this
        round's costs could not beat plain; the others are judged against plain steps. The first
        fully accepted round of each K is neither judged nor counted (skip_cold): its verification
        is of a length the runtime has not run yet, whose one-off costs say nothing of the next (a
        rejected round is judged all the same: a draft that disagrees is given up at once)."""
        seconds = draft_seconds + verify_seconds
        full = accepted >= drafted
        growing = full and self.k < self.num_speculative_tokens
        self.k = min(self.num_speculative_tokens, self.k + self.grow) if full else max(1, self.k - 1)
        probe = self.backing_off
        cold = self.skip_cold and full and drafted not in self.seen and not probe
        self.seen.add(drafted)
        self.plain_run = 0
        if cold:  # a verification of a new length: its first run pays one-off costs (ONNX Runtime's per shape)
            return
        self.spec_sums = self._add(None if probe else self.spec_sums, accepted + 1, seconds)
        if not self.adaptive or self.plain_rate is None:
            return
        k_max = self.num_speculative_tokens
        best_case = (k_max + 1) / max(k_max * draft_seconds / max(drafted, 1) + verify_seconds, 1e-12)
        ramping = (growing and (accepted + 1) / max(seconds, 1e-12) >= self.ramp_floor * self.plain_rate
                   and best_case > self.plain_rate)
        if ramping or self.spec_rate >= self.plain_rate:
            self.backing_off, self.backoff = False, self.min_backoff
        elif probe:
            self.backoff = min(self.max_backoff, self.backoff_growth * self.backoff)
        else:
            self.backing_off = True


# ---------------------------------------------------------------- the rounds


@dataclass
class SpecStats:
    """What a speculative run did, in vLLM's terms: drafted and accepted tokens, verifications
    (`drafts`: rounds that drafted at least one token) and plain steps."""

    drafted: int = 0
    accepted: int = 0
    drafts: int = 0
    plain_steps: int = 0
    tokens: int = 0
    k_history: list[int] = field(default_factory=list)

    @property
    def acceptance_rate(self) -> float | None:
        return self.accepted / self.drafted if self.drafted else None

    @property
    def mean_acceptance_length(self) -> float | None:
        return 1 + self.accepted / self.drafts if self.drafts else None

    def to_dict(self) -> dict:
        return {"drafted": self.drafted, "accepted": self.accepted, "drafts": self.drafts,
                "plain_steps": self.plain_steps, "tokens": self.tokens, "acceptance_rate": self.acceptance_rate,
                "mean_acceptance_length": self.mean_acceptance_length}


def control_for(settings: DraftSettings) -> DraftControl:
    return DraftControl(settings.num_speculative_tokens, settings.adaptive)


def refuse_unrollable(backend: Backend, role: str) -> None:
    if not backend.capabilities.rolls_back:
        raise cannot_roll_back(backend.name, role)


def verify(logits: np.ndarray, proposal: Proposal, sampler: Sampler, history: History | None = None) -> list[int]:
    """The tokens a round yields: the drafted tokens the target keeps, then one of the target's own
    (the correction of the first rejected token, or the bonus token after all K). `logits` (K + 1, V)
    are the target's at the pending token and at each drafted token; `history` is the sequence before
    the round (the processors read it at position i followed by the first i drafted tokens; None only
    where they read no history)."""
    d = proposal.tokens
    rows = None
    if history is not None and sampler.reads_history:
        rows = [history.extended(d[:i]) for i in range(len(d) + 1)]
    out: list[int] = []
    if sampler.s.greedy:
        choice = sampler.greedy(logits, rows)
        for i, tok in enumerate(d):
            if int(choice[i]) != tok:
                return out + [int(choice[i])]
            out.append(tok)
        return out + [int(choice[len(d)])]
    p = sampler.probabilities(logits, rows)  # (K + 1, V)
    for i, tok in enumerate(d):
        if proposal.q is None:  # a point mass at tok: draw from p, keep tok if the draw is tok
            x = int(sampler.draw(p[i : i + 1])[0])
            if x != tok:
                return out + [x]
        else:
            q = proposal.q[i]
            if not sampler.rng.random() < min(1.0, p[i, tok] / q[tok]):  # q[tok] > 0: tok was drawn from q
                residual = np.maximum(p[i] - q, 0.0)
                if residual.sum() <= 0:  # p == q up to rounding: nothing to correct towards
                    residual = p[i]
                return out + [int(sampler.draw(residual[None])[0])]
        out.append(tok)
    return out + [int(sampler.draw(p[len(d) : len(d) + 1])[0])]


Clock = Callable[[], float]


class Speculation:
    """One sequence decoded with a draft, at batch 1, a step at a time: `prefill` gives its first
    token, then each `round` one to K + 1 more (or one plain step's). The decode loop (decode.py)
    drives it for a `Sequence`; `row` is who the sequence is, for processors with per-row state
    (History.row). `clock` times the rounds for DraftControl."""

    def __init__(self, target: Backend, drafter: Drafter, prompt: list[int], sampler: Sampler,
                 control: DraftControl, stats: SpecStats | None = None, clock: Clock = time.perf_counter,
                 row: object = None):
        refuse_unrollable(target, "target")
        self.target, self.drafter, self.sampler, self.control, self.clock = target, drafter, sampler, control, clock
        self.stats = stats if stats is not None else SpecStats()
        self.stats.k_history = control.history  # the same list: the control appends each round's K
        self.tokens = list(prompt)
        self.generated: list[int] = []
        self.history = History(prompt, self.generated, row)  # live: generated grows with tokens
        self.past = None

    def prefill(self) -> int:
        """The prompt's step and the first token."""
        self.drafter.reset()
        tokens = self.tokens
        mask = np.ones((1, len(tokens)), dtype=np.int64)
        logits, self.past = self.target.step(np.asarray([tokens], dtype=np.int64), mask, positions(mask, len(tokens)),
                                             None)
        first = int(self.sampler(logits, [self.history])[0])
        self._extend([first])
        return first

    def round(self, budget: int) -> list[int]:
        """One round: K drafted tokens verified (K from the control, 0: a plain step), the 1 to K + 1
        tokens it yields, at most `budget` (>= 1)."""
        target, drafter, sampler, control, stats, clock = (self.target, self.drafter, self.sampler, self.control,
                                                           self.stats, self.clock)
        tokens, history = self.tokens, self.history
        cached = len(tokens) - 1  # the target's cache holds every token but the newest
        cap = min(budget - 1, target.n_positions - len(tokens), drafter.n_positions - len(tokens) + 1)
        k = control.next_k(cap)
        if k:
            drafter.sync(tokens)
        t0 = clock()
        proposal = drafter.propose(tokens, k, sampler, history) if k else Proposal([])
        t1 = clock()
        d = proposal.tokens
        feed = np.asarray([tokens[cached:] + d], dtype=np.int64)
        mask = np.ones((1, cached + feed.shape[1]), dtype=np.int64)
        if not d:
            logits, self.past = target.step(feed, mask, positions(mask, feed.shape[1]), self.past)
            new = [int(sampler(logits, [history])[0])]
            control.plain(clock() - t1)
            stats.plain_steps += 1
        else:
            all_logits, past = target.run(feed, mask, positions(mask, feed.shape[1]), self.past)
            new = verify(all_logits[0], proposal, sampler, history)
            kept = len(tokens) + len(new) - 1  # positions that stand: the sequence but its newest token
            self.past = past.truncate(kept) if kept < mask.shape[1] else past
            drafter.keep(kept)
            accepted = len(new) - 1
            control.speculated(len(d), accepted, t1 - t0, clock() - t1)
            stats.drafted += len(d)
            stats.accepted += accepted
            stats.drafts += 1
        self._extend(new)
        return new

    def _extend(self, new: list[int]) -> None:
        self.tokens.extend(new)
        self.generated.extend(new)
        self.stats.tokens = len(self.generated)


def speculative_loop(target: Backend, drafter: Drafter, prompt: list[int], sampler: Sampler, n_new: int,
                     control: DraftControl, stats: SpecStats | None = None,
                     clock: Clock = time.perf_counter, row: object = None) -> Iterator[list[int]]:
    """`Speculation`'s tokens as they come, `n_new` in all, without a `Sequence` (nothing ends the run
    but its length): the prefill's first token, then each round's."""
    spec = Speculation(target, drafter, prompt, sampler, control, stats, clock, row)
    yield [spec.prefill()]
    while len(spec.generated) < n_new:
        yield spec.round(n_new - len(spec.generated))
