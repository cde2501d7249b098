"""The decode loop: the one place rows are stepped on a backend, for every caller (`generate`, the
evaluation harness's `generate_until`, the serving runner, the bench).

A `Sequence` is one row being generated: its prompt, settings, sampler, budget and, as it goes, its
tokens and why it ended (`Finish`, the one list of reasons). `Sequence.accept` is the one place a
row's end is decided (cancelled, end of text, a stop token id, its budget, the context), so every
loop over rows ends them alike. A step of rows is `step` (a `Batch`: one model step, each row's next
token; `step_rows` is its forward and sampling, which a prefill ends with too) or, for one row with a
draft, `Drafted.step` (a speculative round). `decode_steps` runs them over a static batch, one list
of `Event`s per model step (the bench times steps); `decode` is the same, flattened. A caller that
wants a row to end early (a stop string, a client that left) calls `Sequence.cancel` with its reason.

Sampling: each unfinished row draws from its sampler, one uniform per step (generation.sampling),
through the logits processors (generation.processors), given each row's `History` (its prompt and
the tokens it has kept: `Sequence.history`, live).
Rows that share one Sampler (generate's and generate_until's batch: one seeded stream, as they have
always drawn) draw together, row by row, every row of the group while any of them is unfinished, so
that a row that ends does not move the draws of the others. A row with a sampler of its own (the
serving engine's) draws only while it runs: its tokens are those of the same prompt decoded alone;
such rows are sampled together (sampling.sample_many: one NumPy pass over the rows whose processor
lists are of one shape, each row drawing from its own generator).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..errors import UsageError
from ..numerics import positions
from ..runtime.base import Backend, greedy_step
from ..tokenizer import EOT_ID
from .logprobs import LogprobEntry, token_logprobs
from .processors import History
from .sampling import BatchProcessors, Sampler, sample_many
from .settings import Finish, Generation, SamplingSettings
from .speculative import Drafter, DraftSettings, SpecStats, Speculation, control_for


def left_pad(batch: list[list[int]]) -> tuple[np.ndarray, np.ndarray]:
    """Ids and attention mask (B, L), padded on the left with EOS ids and mask 0."""
    width = max(len(r) for r in batch)
    ids = np.full((len(batch), width), EOT_ID, dtype=np.int64)
    mask = np.zeros((len(batch), width), dtype=np.int64)
    for i, r in enumerate(batch):
        ids[i, width - len(r) :] = r
        mask[i, width - len(r) :] = 1
    return ids, mask


@dataclass(frozen=True, slots=True)
class Event:
    """What one row did at one step: a token, its end, or both (its last token)."""

    row: int  # index into the sequences given to decode()
    token: int | None  # None when the row ended without a new token (eos, cancelled, no room)
    finish: Finish | None  # set on the row's last event
    logprob: LogprobEntry | None = None  # with Sequence.logprobs: the sampled token's (the EOT's too)


@dataclass(eq=False)
class Sequence:
    """One row being generated. `limit` is its budget: max_tokens, or less when the context ends
    first; whoever places the row in a batch sets it (decode_steps does). `cancel` may be called from
    any thread."""

    prompt_ids: list[int]
    settings: SamplingSettings
    max_tokens: int | None = None  # tokens to generate; None: settings.max_new_tokens
    logprobs: int | None = None  # None: none; k: each token's LogprobEntry with the k most likely
    sampler: Sampler | None = None  # None: a Sampler(settings) of its own; rows may share one (see the module)
    tokens: list[int] = field(default_factory=list, init=False)  # generated ids (EOT only with ignore_eos)
    finish: Finish | None = field(default=None, init=False)  # why it ended; None while it runs
    limit: int = field(default=0, init=False)  # its budget in the batch (max_tokens until placed)
    cancelled: Finish | None = field(default=None, init=False)  # the reason a cancel() asked for, until it ends
    speculation: SpecStats | None = field(default=None, init=False)  # decoded with a draft: the run's statistics
    history: History = field(init=False, repr=False)  # what the logits processors read: prompt, tokens (live), the row
    # A row that fails alone (its structured-output constraint cannot continue) ends as Finish.failed, its batch going
    # on, where the caller serves rows of unrelated requests (the serving engine's); elsewhere the failure is raised.
    fails_alone: bool = field(default=False, init=False)
    error: str | None = field(default=None, init=False)  # why it ended as Finish.failed

    def __post_init__(self) -> None:
        if self.max_tokens is None:
            self.max_tokens = self.settings.max_new_tokens
        if self.sampler is None:
            self.sampler = Sampler(self.settings)
        self.limit = self.max_tokens
        self.history = History(self.prompt_ids, self.tokens, self)
        self._stops = frozenset(self.settings.stop_token_ids)

    def result(self, prompt: str, decoder: str | None = None) -> Generation:
        """What it generated after `prompt`, as generate returns it (Finish.length if it has not ended)."""
        return Generation(prompt, self.prompt_ids, self.tokens, self.finish or Finish.length, decoder=decoder)

    def cancel(self, reason: Finish = Finish.cancelled) -> None:
        """End the row at its next token, or before the next step when it is cancelled between steps,
        reporting `reason`. Any thread; no effect on a row that has ended."""
        self.cancelled = reason

    def fail(self, message: str) -> None:
        """End the row as Finish.failed at its next token (the token dropped), saying why."""
        self.error = message
        self.cancel(Finish.failed)

    def accept(self, token: int) -> tuple[int | None, Finish | None]:
        """The row's next sampled token: (the token it keeps, or None; why it ended, or None). The one
        place a row's end is decided: a pending cancel drops the token; <|endoftext|> ends the row
        (unless settings.ignore_eos); a stop token id (settings.stop_token_ids) ends it as `stop`, the
        token not kept (vLLM's default); reaching the budget ends it after the token, as `context` when
        the context cut the budget."""
        if self.cancelled is not None:
            self.finish = self.cancelled
            return None, self.finish
        if token == EOT_ID and not self.settings.ignore_eos:
            self.finish = Finish.eos
            return None, Finish.eos
        if token in self._stops:
            self.finish = Finish.stop
            return None, Finish.stop
        self.tokens.append(token)
        if len(self.tokens) >= self.limit:
            self.finish = Finish.context if self.limit < self.max_tokens else Finish.length
        return token, self.finish


def _accept(seqs: list[Sequence], tokens: list[int], rows: Iterable[int], logits: np.ndarray | None) -> tuple[np.ndarray, list[Event]]:
    """Each unfinished row of `rows` accepts its token of `tokens` (B); the next step's input (B,)
    (EOT_ID where no token was kept) and the events, in row order. `logits` (B, V) give logprobs to
    the rows that ask."""
    events: list[Event] = []
    for i in rows:
        seq = seqs[i]
        if seq.finish is not None:
            tokens[i] = EOT_ID
            continue
        tok = tokens[i]
        lp = None
        if seq.logprobs is not None and seq.cancelled is None and logits is not None:
            lp = token_logprobs(logits[i : i + 1], [tok], seq.logprobs)[0]
        kept, finish = seq.accept(tok)
        if kept is None:
            tokens[i] = EOT_ID
        events.append(Event(i, kept, finish, lp))
    return np.asarray(tokens, dtype=np.int64), events


def sample_rows(seqs: list[Sequence], logits: np.ndarray, rows: list[int] | None = None,
                state: BatchProcessors | None = None) -> tuple[np.ndarray, list[Event]]:
    """Sample the next token of every unfinished row among `rows` (None: all) of a batch whose step
    gave `logits` (B, V): each row draws from its sampler (rows sharing one draw together, see the
    module) given its history, is given its logprobs if it asks, and accepts the token. Returns the
    tokens to feed (B,) int64 (EOT_ID for rows finished or not sampled) and the events, in row order.
    `state`: the batch's processors, kept across its steps (Batch.processors)."""
    index = range(len(seqs)) if rows is None else rows
    groups: dict[int, list[int]] = {}
    for i in index:
        groups.setdefault(id(seqs[i].sampler), []).append(i)
    drawn = np.full(len(logits), EOT_ID, dtype=np.int64)
    alone: list[int] = []  # unfinished rows with a sampler of their own: sampled together (sample_many)
    for members in groups.values():
        if all(seqs[i].finish is not None for i in members):
            continue
        sampler = seqs[members[0]].sampler
        if len(members) == 1:
            alone.append(members[0])
        else:  # every row of the group, finished or not, in row order: the stream moves as it always has
            drawn[members] = sampler(logits if rows is None and len(members) == len(logits) else logits[members],
                                     [seqs[i].history for i in members])
    if alone:
        alone.sort()
        mine = logits if len(alone) == len(logits) else logits[alone]  # every row (sorted): no 3 MB copy a step
        # The step's logits are read after sampling only for the logprobs of the rows that ask (_accept).
        overwrite = all(seqs[i].logprobs is None for i in index)
        drawn[alone] = sample_many([seqs[i].sampler for i in alone], mine, [seqs[i].history for i in alone], state,
                                   overwrite)
    return _accept(seqs, drawn.tolist(), index, logits)


def _end_cancelled(seqs: list[Sequence]) -> list[Event]:
    """Rows cancelled since the last step end now, without a token (no step is run for them)."""
    events = []
    for i, seq in enumerate(seqs):
        if seq.finish is None and seq.cancelled is not None:
            seq.finish = seq.cancelled
            events.append(Event(i, None, seq.finish))
    return events


# ---------------------------------------------------------------- the loop


@dataclass(eq=False)
class Batch:
    """Rows stepped together, left-padded: their attention mask (B, W), the tokens the next step feeds
    (B,) and the cache (W positions). The serving runner's batches are these, merged there."""

    rows: list[Sequence]
    mask: np.ndarray
    nxt: np.ndarray
    past: Any
    argmax_only: bool = field(init=False)  # every row takes the argmax (_argmax_only): fixed with the rows
    processors: BatchProcessors = field(init=False, repr=False)  # its rows' logits processors, across its steps
    column: np.ndarray = field(init=False, repr=False)  # (B, 1) ones: a step's new mask column
    # (B, 1) each row's mask count: the next step's position ids (numerics.positions' last column),
    # kept by adding one a step rather than summing the mask again
    count: np.ndarray = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self.argmax_only = _argmax_only(self.rows)
        self.processors = BatchProcessors()
        self.column = np.ones((len(self.rows), 1), dtype=np.int64)
        self.count = self.mask.sum(axis=1, keepdims=True, dtype=np.int64)


def _argmax_only(rows: list[Sequence]) -> bool:
    """Whether every row is greedy with nothing that moves the argmax (Sampler.argmax_only) and asks
    for no logprobs: the backend may then take the argmax where the logits are (base.greedy_step)."""
    return all(s.logprobs is None and s.sampler.argmax_only for s in rows)


def step_rows(backend: Backend, rows: list[Sequence], ids: np.ndarray, mask: np.ndarray, pos: np.ndarray, past: Any,
              index: np.ndarray | None = None, argmax_only: bool | None = None,
              state: BatchProcessors | None = None) -> tuple[np.ndarray, Any, list[Event]]:
    """One model step (backend.step's inputs: ids (U, T), mask, position ids, past) and each unfinished
    row's next token: the tokens the next step feeds (B,), the cache, the events. `index`: which of
    the U rows run each of the B `rows` is (a prompt run once for several rows); None: U == B.
    `argmax_only`: _argmax_only(rows), if known; `state`: the batch's processors (Batch.processors)."""
    if _argmax_only(rows) if argmax_only is None else argmax_only:
        tokens, past = greedy_step(backend)(ids, mask, pos, past)  # (U,)
        nxt, events = _accept(rows, (tokens if index is None else tokens[index]).tolist(), range(len(rows)), None)
    else:
        logits, past = backend.step(ids, mask, pos, past)  # (U, V)
        nxt, events = sample_rows(rows, logits if index is None else logits[index], state=state)
    return nxt, past, events


def start(backend: Backend, rows: list[Sequence]) -> tuple[Batch, list[Event]]:
    """The rows as one left-padded batch, prefilled: the batch and each row's first token."""
    ids, mask = left_pad([s.prompt_ids for s in rows])  # (B, L)
    nxt, past, events = step_rows(backend, rows, ids, mask, positions(mask, ids.shape[1]), None)
    return Batch(rows, mask, nxt, past), events


def step(backend: Backend, batch: Batch, ran: Callable[[int], None] | None = None) -> list[Event]:
    """One decode step of the batch: rows cancelled since the last step end first, without a token;
    then, unless none is left, a model step of every row (finished rows ride along, unread) and each
    running row's next token. `ran` is told, as the model step starts, how many rows it runs for."""
    ended = _end_cancelled(batch.rows)
    if ended and all(s.finish is not None for s in batch.rows):
        return ended
    batch.mask = np.concatenate([batch.mask, batch.column], axis=1)  # (B, W + 1)
    pos, batch.count = batch.count, batch.count + 1
    if ran is not None:
        ran(sum(s.finish is None for s in batch.rows))
    batch.nxt, batch.past, events = step_rows(backend, batch.rows, batch.nxt[:, None], batch.mask, pos, batch.past,
                                              argmax_only=batch.argmax_only, state=batch.processors)
    return ended + events if ended else events


class Drafted:
    """One row decoded with a draft (speculative.Speculation), a round per step: a round's tokens are
    accepted one at a time as its events are read, so a row cancelled meanwhile ends at its next
    token and runs no further round. The run's statistics are in `Sequence.speculation`."""

    def __init__(self, backend: Backend, seq: Sequence, drafter: Drafter, settings: DraftSettings):
        seq.speculation = SpecStats()
        self.seq = seq
        self.spec = Speculation(backend, drafter, seq.prompt_ids, seq.sampler, control_for(settings), seq.speculation,
                                row=seq)

    def start(self) -> Iterator[Event]:
        """The prefill, and the row's first token."""
        return self._accept([self.spec.prefill()])

    def step(self) -> Iterable[Event]:
        """The row's end, when it was cancelled since the last round; else the next round."""
        ended = _end_cancelled([self.seq])
        if ended:
            return ended
        return self._accept(self.spec.round(self.seq.limit - len(self.seq.tokens)))

    def _accept(self, tokens: list[int]) -> Iterator[Event]:
        for tok in tokens:
            kept, finish = self.seq.accept(tok)
            yield Event(0, kept, finish)
            if finish is not None:
                return


def _steps(backend: Backend, seqs: list[Sequence], drafter: Drafter | None,
           draft_settings: DraftSettings | None) -> Iterator[Iterable[Event]]:
    """The decode loop: the rows placed and prefilled, then stepped until every one has finished, one
    iterable of events per model step (a speculative round's read lazily: Drafted)."""
    first = _place(backend, seqs, drafter)
    if len(first) == len(seqs):
        if first:
            yield first
        return
    if _speculative(seqs[0], drafter):
        drafted = Drafted(backend, seqs[0], drafter, draft_settings or DraftSettings())
        yield drafted.start()
        while seqs[0].finish is None:
            yield drafted.step()
        return
    batch, events = start(backend, seqs)
    yield first + events
    while any(s.finish is None for s in seqs):
        yield step(backend, batch)


def decode_steps(backend: Backend, seqs: list[Sequence], drafter: Drafter | None = None,
                 draft_settings: DraftSettings | None = None) -> Iterator[list[Event]]:
    """Decode `seqs` as one left-padded static batch: prefill, then one list of events per model step
    (a last list without a step when the rows left were cancelled), until every row has finished.
    Leaving the loop early closes it. Rows with no room (a budget of 0) end before the prefill.
    With a `drafter`, the one sequence is decoded speculatively (Drafted: one list per round),
    unless it asks for logprobs: those are the target's, decoded plainly."""
    for events in _steps(backend, seqs, drafter, draft_settings):
        yield list(events)


def decode(backend: Backend, seqs: list[Sequence], drafter: Drafter | None = None,
           draft_settings: DraftSettings | None = None) -> Iterator[Event]:
    """decode_steps' events one by one (a speculative round's accepted as each is read)."""
    for events in _steps(backend, seqs, drafter, draft_settings):
        yield from events


def _place(backend: Backend, seqs: list[Sequence], drafter: Drafter | None) -> list[Event]:
    """Set each row's budget in the batch (the context left after the widest prompt caps it); the
    events of rows that end before the prefill (cancelled, or no room)."""
    if drafter is not None and len(seqs) != 1:
        raise UsageError(f"speculative decoding decodes one sequence at a time, not {len(seqs)}")
    room = backend.n_positions - max((len(s.prompt_ids) for s in seqs), default=0)
    first: list[Event] = []
    for i, seq in enumerate(seqs):
        if seq.finish is not None or seq.tokens:
            raise UsageError("a Sequence is decoded once: this one has been")
        seq.limit = min(seq.max_tokens, room)
        if seq.cancelled is not None or seq.limit <= 0:
            seq.finish = seq.cancelled or (Finish.context if seq.limit < seq.max_tokens else Finish.length)
            first.append(Event(i, None, seq.finish))
    return first


def _speculative(seq: Sequence, drafter: Drafter | None) -> bool:
    """Whether `seq` is decoded with the draft: one that asks for logprobs is decoded plainly."""
    return drafter is not None and seq.logprobs is None
