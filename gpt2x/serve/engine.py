"""One server replica's engine: one thread owns the backend and decodes every request in flight as
one left-padded batch. It splits as vLLM's does: the scheduler (scheduler.py) decides which rows run
and never touches the backend; the runner (runner.py) steps the batch (plain or speculative) and
samples by the decode loop's rules (generation.decode); the engine's thread joins the two and tells
each row's callback what happened to it.

Requests that arrive together start as one batch (prefill, then one decode step per token for all
rows). A row that finishes (end of text, its token budget, or cancelled because its client left or
hit a stop string) stops being read at once and leaves the batch's cache at the next regrouping, so
the batch stops computing rows nobody reads. With continuous batching on, waiting requests also join
a running batch between decode steps: they are prefilled on their own (one batch of joiners), in
chunks of `prefill_chunk` tokens, one chunk before each decode step of the running rows, so that a
long prompt joining does not stall the rows streaming (chunked prefill; the rows' tokens are the
same); then they sample their first token, and their cache is merged into the batch's with the
cache's `merge` (runtime.base.KVCache), every row right-aligned to the batch's width (left padding,
masked out). A join is made only when every row keeps room in the model's context, counting the
steps its chunks take; a backend that cannot take a cache from elsewhere (onnxruntime-genai) batches
statically.

Prefix caching (serve/prefix_cache.py): every prefill keeps its prompts' whole blocks of KV in a
host-memory cache under `prefix_cache_mb`, and a later prompt that begins with blocks held there
takes them as its past and prefills only the rest (runner.Runner.begin); a row's `cached_tokens`
says how many, and stats() counts the tokens looked up and found. On backends that take a cache
made elsewhere (capabilities.takes_past): not onnxruntime-genai.

Every row samples with its own Sampler seeded by its request, one uniform per step: the tokens are
those `gpt2x generate` gives for the same prompt, settings and seed (generation.sampling).
Callers submit from any thread and hear of their tokens through a callback run on the engine thread;
the waiting queue is bounded (QueueFull), never grown without limit.

With a draft (speculative decoding, generation/speculative.py) the engine decodes one request at a
time: a replica with a draft runs at max batch size 1, each request decoded by the decode loop with
its own Sampler and a DraftControl of its own, so its tokens are those of `gpt2x generate --draft`
for the same prompt, settings and seed (for a seeded sampled request: with the draft's K fixed,
`adaptive` off, since adaptive K follows measured timings). A round yields 1 to K + 1 tokens, each
told to the row's callback in turn; a row cancelled meanwhile hears no more of them and stops there,
before the next round. The counters add the draft's drafted and accepted tokens and its
verifications (`drafts`), as SpecStats counts them. A row that asks for logprobs is decoded without the
draft (plain steps, on its own): its logprobs are the target's distribution at each of its tokens,
and its tokens those of `gpt2x generate` without a draft.

Observing (serve/metrics.py): an `observer` given to the engine hears, on the engine's thread, each
token a row samples and when (`token(row, now)`, time.monotonic; the end-of-text or stop token that
ends a row too, which its text leaves out), which times a row's first token from its `queued_at` and
the gaps between its tokens. `abort` ends every row in flight with an error,
from any thread: what a server's stop does to the requests its grace did not let finish.

Logprobs (a row's `logprobs` = k, for rows that ask only): at each token the row samples, the raw
model distribution (generation.logprobs) gives the chosen token's log-probability and the k most
likely tokens. A row that also asks for its prompt's (`prompt_logprobs`, the API's echo with
logprobs) is scored when it starts, on the engine thread (the backend is not thread-safe): one
no-cache forward of its prompt alone, every position's logits (`Backend.run`), before it is
prefilled; a row with no token to generate (the API's max_tokens 0) ends there, "length", without
joining a batch.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Protocol

from ..errors import UsageError
from ..generation.beam import beam_hypotheses
from ..generation.decode import Event
from ..generation.logprobs import LogprobEntry
from ..generation.settings import Finish
from ..generation.speculative import Drafter, DraftSettings
from ..runtime.base import Backend
from .prefix_cache import PrefixCache
from .runner import Batch, Prefill, Runner
from .scheduler import EngineClosed, EngineSettings, QueueFull, Row, Scheduler, Sink, unused_columns

__all__ = ["Engine", "EngineClosed", "EngineSettings", "LogprobEntry", "Observer", "QueueFull", "Row", "Sink",
           "refuse_batched_draft"]

log = logging.getLogger(__name__)

_SAMPLED_ENDS = (Finish.eos, Finish.stop)  # a row ended by a token it sampled (not kept): an output all the same
SPECULATIVE_BATCH = "speculative serving runs at max batch size 1 (one request decoded at a time with its draft)"


class Observer(Protocol):
    """What hears the engine's tokens as they are told, its rows' ends, and how many tokens each model
    step ran (on the engine's thread; it must not block)."""

    def token(self, row: Row, now: float) -> None: ...

    def finished(self, row: Row, now: float) -> None: ...

    def iteration(self, tokens: int) -> None: ...


def refuse_batched_draft(max_batch_size: int, option: str = "max_batch_size") -> None:
    """A draft decodes one request at a time: refused, in one line, with a larger batch."""
    if max_batch_size != 1:
        raise UsageError(f"{option} is {max_batch_size} with a draft; {SPECULATIVE_BATCH}", option=option)


class Engine:
    """The scheduler and the runner over one backend, joined by the engine's own thread (`start`,
    `close`)."""

    def __init__(self, backend: Backend, settings: EngineSettings | None = None, drafter: Drafter | None = None,
                 draft_settings: DraftSettings | None = None):
        settings = settings or EngineSettings()
        if drafter is not None:
            refuse_batched_draft(settings.max_batch_size)
        self.backend = backend
        self.settings = settings
        self.drafter = drafter  # speculative decoding, one row at a time (see the module's docstring)
        # Joining needs a backend whose rows can join a running batch's cache: else static batches.
        self.joins = settings.continuous and backend.capabilities.joins_rows and settings.max_batch_size > 1
        self.counters = {"rows": 0, "tokens": 0, "batches": 0, "steps": 0, "joins": 0, "compactions": 0, "errors": 0}
        if drafter is not None:
            self.counters.update(drafted=0, accepted=0, drafts=0)
        self.scheduler = Scheduler(settings, backend.n_positions)
        # Prefix caching needs a backend that steps from a cache made elsewhere (its blocks): not
        # onnxruntime-genai, whose generator owns its cache.
        self.prefix_cache = PrefixCache(int(settings.prefix_cache_mb * 2**20)) \
            if settings.prefix_cache_mb and backend.capabilities.takes_past else None
        self.runner = Runner(backend, self.counters, drafter, draft_settings, self.prefix_cache, self._iteration)
        self._thread = threading.Thread(target=self._loop, name="gpt2x-engine", daemon=True)
        self._batch: list[Row] = []  # the rows of the batch in flight, told of a failure (the engine thread's)
        self.observer: Observer | None = None  # told each token as it is told (serve/metrics.py)
        self.kv_positions = 0  # positions the batch in flight's cache holds (rows x width), after its last step

    # -- the callers' side (any thread)

    def start(self) -> Engine:
        self._thread.start()
        return self

    def submit(self, rows: list[Row]) -> None:
        """Queue rows, all or none. Each row's prompt and budget must fit the context together."""
        self.scheduler.submit(rows)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    @property
    def running(self) -> int:
        return self.scheduler.running

    @property
    def closing(self) -> bool:
        """Whether it is stopping (or stopped): it takes no more rows."""
        return self.scheduler.closed

    def stats(self) -> dict:
        """Gauges and counters: rows running and waiting, the counters, and with a prefix cache the
        prompt tokens looked up in it and found (`prefix_cache_queries`, `prefix_cache_hits`)."""
        running, waiting = self.scheduler.counts()
        # KV in use: the positions the batch in flight holds (rows x its cache's width), of what the
        # largest batch could hold at the model's context (max_batch_size x n_positions)
        capacity = self.settings.max_batch_size * self.backend.n_positions
        stats = {"running": running, "waiting": waiting, **self.counters,
                 "kv_cache_usage_perc": min(1.0, self.kv_positions / capacity) if running else 0.0}
        if self.prefix_cache is not None:
            stats.update(prefix_cache_queries=self.prefix_cache.queries, prefix_cache_hits=self.prefix_cache.hits)
        return stats

    def close(self, timeout: float = 10.0) -> bool:
        """Refuse new rows, let the thread finish the batch in flight (rows still waiting are told the
        server is shutting down), and join it. True once the thread has stopped; False, with a warning
        in the log, when it is still running after `timeout` seconds (a step that does not return):
        the backend is then left open, for the thread still uses it."""
        for row in self.scheduler.close():
            self._tell(row, "error", "the server is shutting down")
        if self._thread.is_alive():
            self._thread.join(timeout)
        if self._thread.is_alive():
            log.warning("the engine's thread did not stop within %.0f s (a step is still running); left running", timeout)
            return False
        return True

    def stop(self, grace: float, message: str = "the server is shutting down") -> bool:
        """A server's stop: new rows refused, rows still waiting told `message` at once, the batch in
        flight given `grace` seconds to finish, then what is left of it ended with `message` (`abort`),
        and the thread joined (`close`). True once the thread has stopped."""
        for row in self.scheduler.close():
            self._tell(row, "error", message)
        self._thread.join(grace)
        if self._thread.is_alive():
            self.abort(message)
        return self.close()

    def abort(self, message: str) -> int:
        """End every row of the batch in flight that has not finished with an error (`message`), from
        any thread: each is cancelled (it leaves the batch before the next step), its callback told
        ("error", message) and then nothing more (not the "done" of its cancel). Returns how many rows
        it ended."""
        ended = 0
        for row in list(self._batch):
            if not row.finished and row.cancelled is None:
                tell, row.sink = row.sink, _told_nothing
                row.cancel()
                try:
                    tell("error", message)
                except Exception:  # its client is gone: nothing to tell
                    log.exception("a row's callback failed")
                ended += 1
        return ended

    # -- the engine thread

    def _loop(self) -> None:
        while self.scheduler.wait_for_work():
            rows = self.scheduler.take([], None)
            if not rows:
                continue
            self._batch = rows
            try:
                rows = self._start(rows)
                if rows:
                    self._batch = rows
                if self.drafter is not None and len(rows) == 1 and rows[0].logprobs is None:
                    self.counters["batches"] += 1
                    for event in self.runner.speculative(rows[0]):
                        self._tell_event(rows[0], event)
                elif rows:  # with a draft: a row that asks for logprobs, decoded plainly
                    self._run_batch(rows)
            except Exception as e:  # the batch fails; the engine and the other batches go on
                log.exception("a batch failed")
                self.counters["errors"] += 1
                for row in self._batch:
                    if not row.finished:
                        row.finish = Finish.cancelled
                        self._tell(row, "error", f"generation failed: {e}")
            self.scheduler.set_running(0)

    def _run_batch(self, rows: list[Row]) -> None:
        """Prefill `rows` (whole: no row is running yet), then decode until every row (including any
        that joined) has finished. Joins wait until the scheduler says one is due; the joiners are
        prefilled a chunk before each decode step (prefill_chunk tokens) while rows run, and join at
        the step after their last chunk. The batch regroups when rows join or half of it has
        finished."""
        self.counters["batches"] += 1
        batch, events = self.runner.prefill(rows)
        self._tell_events(batch.rows, events)
        pending: Prefill | None = None  # joiners being prefilled
        while True:
            live = batch.live()
            if pending is None and live and self.joins and self.scheduler.join_due(len(live)):
                width = batch.mask.shape[1] - unused_columns(batch.mask[live])
                joiners = self._start(self.scheduler.take([batch.rows[i] for i in live], width))
                if joiners:
                    self.counters["joins"] += 1
                    pending = self.runner.begin(joiners)
            joined = None
            if pending is not None:
                self._batch = batch.rows + pending.rows  # told of a failure from here on
                chunk = (self.settings.prefill_chunk or None) if live else None  # nobody to stall: whole
                done = self.runner.advance(pending, chunk)
                if done is not None:
                    joined, events = done
                    pending = None
                    self._tell_events(joined.rows, events)
            if not live and joined is None:
                return
            if self.scheduler.regroup_due(len(live), len(batch.rows), joined is not None):
                batch = self._regroup(batch, live, joined)
            self._batch = batch.rows + ([] if pending is None else pending.rows)
            if not batch.live():
                continue  # every row ended (joiners at their first token); a prefill may still be under way
            self.scheduler.set_running(sum(not r.finished for r in self._batch))
            self._tell_events(batch.rows, self.runner.step(batch))

    def _regroup(self, batch: Batch, live: list[int], joined: Batch | None) -> Batch:
        """The batch with its finished rows gone and the `joined` rows (prefilled, their first token
        sampled) in, laid out as the scheduler plans."""
        jlive = [] if joined is None else joined.live()
        if joined is not None and not jlive and 2 * len(live) > len(batch.rows):  # every joiner ended at its first token
            return batch
        if not live and not jlive:
            return batch  # nothing left to decode
        if not jlive:
            self.counters["compactions"] += 1
        jmask = joined.mask if joined is not None else batch.mask[:0]
        order, width = self.scheduler.plan_regroup(batch.rows, batch.mask, live, [] if joined is None else joined.rows,
                                                   jmask, jlive)
        return self.runner.merge(batch, joined if jlive else None, order, width)

    def _iteration(self, tokens: int, positions: int) -> None:
        """The runner ran a model step of `tokens` tokens over a cache of `positions` (rows x width)."""
        self.kv_positions = positions
        if self.observer is not None:
            self.observer.iteration(tokens)

    def _start(self, rows: list[Row]) -> list[Row]:
        """What rows do before their prefill: those that asked are told their prompt's logprobs, those
        with no token to generate end ("length"), those cancelled while waiting end. Returns the rows
        that go on to generate."""
        going = []
        now = time.monotonic()
        for row in rows:
            row.scheduled_at = now
            if row.cancelled is not None:
                self._end(row, Finish.cancelled)
                continue
            if row.beam_rows is not None:
                self._beam_search(row)
                continue
            if row.prompt_logprobs:
                self._tell(row, "prompt", self.runner.score(row))
            if row.remaining <= 0:
                self._end(row, Finish.length)
            else:
                going.append(row)
        return going

    def _beam_search(self, row: Row) -> None:
        """A beam search row (the API's use_beam_search), searched whole here on the engine's thread
        (generation.beam: transformers' beam search; the other rows wait meanwhile): each of its
        beam_rows told one of the best hypotheses, its tokens and its end."""
        hypotheses = beam_hypotheses(self.backend, row.prompt_ids, row.settings, len(row.beam_rows))
        self.counters["steps"] += 1
        for target, (tokens, finish) in zip(row.beam_rows, hypotheses):
            self._count_end(target)  # before its tokens: its answer may end with the last one
            for i, token in enumerate(tokens):
                target.tokens.append(token)
                if i == len(tokens) - 1 and finish is not Finish.eos:
                    target.finish = finish  # its last token, told as such
                self.counters["tokens"] += 1
                self._tell(target, "token", token)
            target.finish = finish
            self._tell(target, "done", finish)
        for target in row.beam_rows[len(hypotheses):]:  # fewer hypotheses than asked (none finished)
            self._end(target, Finish.length)

    def _count_end(self, row: Row) -> None:
        self.counters["rows"] += 1
        if self.observer is not None:
            self.observer.finished(row, time.monotonic())

    def _end(self, row: Row, reason: Finish) -> None:
        row.finish = reason
        self._count_end(row)
        self._tell(row, "done", reason)

    def _tell_events(self, rows: list[Row], events: list[Event]) -> None:
        for event in events:
            self._tell_event(rows[event.row], event)

    def _tell_event(self, row: Row, event: Event) -> None:
        """A row's event told as its callback hears it: the token's logprobs, the token, its end."""
        if event.logprob is not None:
            self._tell(row, "logprob", event.logprob)
        if self.observer is not None and (event.token is not None or event.finish in _SAMPLED_ENDS):
            self.observer.token(row, time.monotonic())
        if event.finish is not None:  # counted before the last token is told: its answer may end with it
            self._count_end(row)
        if event.token is not None:
            self.counters["tokens"] += 1
            self._tell(row, "token", event.token)
        if event.finish is not None:
            self._tell(row, "done", event.finish)

    def _tell(self, row: Row, kind: str, value: object) -> None:
        try:
            row.sink(kind, value)
        except Exception:  # a callback that fails (its client is gone) cancels its row, nothing more
            log.exception("a row's callback failed; cancelling the row")
            row.cancel()


def _told_nothing(kind: str, value: object) -> None:
    """The callback of a row that was told its end already (Engine.abort)."""

