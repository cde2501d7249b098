"""The scheduler of one server replica: one thread owns the backend and decodes every request in
flight as one left-padded batch.

Requests that arrive together start as one batch (prefill, then one decode step per token for all
rows). A row that finishes (end of text, its token budget, or cancelled because its client left or
hit a stop string) leaves the batch before the next step: its cache rows are dropped with
`Backend.reorder`, so the batch never computes for rows nobody reads. With continuous batching on,
waiting requests also join a running batch between decode steps: the joining step feeds the
running rows their next token, left-padded to the joiners' prompt width (those pad slots are masked
out, so positions and attention are unchanged), and the joiners' prompts, whose past is masked out
entirely. The cache is then one step longer than any row needs by the joiners' prompt width; a join
is only made when every row still fits in the model's context, and a batch that has emptied starts
afresh.

Every row samples with its own Sampler seeded by its request, one uniform per step: the tokens are
those `gpt2x generate` gives for the same prompt, settings and seed (generation.sampling).
Callers submit from any thread and hear of their tokens through a callback run on the engine thread;
the waiting queue is bounded (QueueFull), never grown without limit.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from ..generation.generate import left_pad
from ..generation.sampling import Sampler
from ..generation.settings import SamplingSettings
from ..numerics import positions
from ..runtime.base import Backend
from ..tokenizer import EOT_ID

log = logging.getLogger(__name__)

# What a row's callback hears: ("token", id) for each token, then once ("done", reason) with reason
# "stop" (end of text), "length" (its token budget) or "cancelled", or ("error", message).
Sink = Callable[[str, object], None]


class QueueFull(RuntimeError):
    """The waiting queue is at its bound: the request is refused, not queued."""


class EngineClosed(RuntimeError):
    """The engine is shutting down and takes no more requests."""


@dataclass(frozen=True)
class EngineSettings:
    max_batch_size: int = 16  # rows decoded together; 1 = no batching
    max_waiting: int = 64  # rows waiting for a place in the batch; more are refused (QueueFull)
    continuous: bool = True  # waiting rows join a running batch between decode steps
    batch_wait_s: float = 0.002  # a new batch waits this long after its first request for others

    def __post_init__(self) -> None:
        if self.max_batch_size < 1:
            raise ValueError(f"max_batch_size must be at least 1, got {self.max_batch_size}")
        if self.max_waiting < 0:
            raise ValueError(f"max_waiting must be >= 0, got {self.max_waiting}")
        if self.batch_wait_s < 0:
            raise ValueError(f"batch_wait_s must be >= 0, got {self.batch_wait_s}")


class Row:
    """One prompt being generated: its ids, settings, sampler and callback. `cancel()` (any thread)
    makes it leave the batch before the next step."""

    def __init__(self, prompt_ids: list[int], settings: SamplingSettings, sink: Sink):
        self.prompt_ids = prompt_ids
        self.settings = settings
        self.sampler = Sampler(settings)
        self.sink = sink
        self.produced = 0
        self.finished = False
        self.cancelled = False

    def cancel(self) -> None:
        self.cancelled = True

    @property
    def remaining(self) -> int:
        return self.settings.max_new_tokens - self.produced


class Engine:
    """A batch scheduler over one backend, run by its own thread (`start`, `close`)."""

    def __init__(self, backend: Backend, settings: EngineSettings = EngineSettings()):
        self.backend = backend
        self.settings = settings
        self._waiting: deque[Row] = deque()
        self._cond = threading.Condition()
        self._closed = False
        self._thread = threading.Thread(target=self._loop, name="gpt2x-engine", daemon=True)
        self.running = 0
        self._batch: list[Row] = []  # the rows of the batch in flight (the engine thread's)
        self.counters = {"rows": 0, "tokens": 0, "batches": 0, "steps": 0, "joins": 0, "errors": 0}

    # -- the callers' side (any thread)

    def start(self) -> Engine:
        self._thread.start()
        return self

    def submit(self, rows: list[Row]) -> None:
        """Queue rows, all or none. Each row's prompt and budget must fit the context together."""
        n = self.backend.n_positions
        for row in rows:
            if not row.prompt_ids or len(row.prompt_ids) + row.settings.max_new_tokens > n:
                raise ValueError(f"{len(row.prompt_ids)} prompt tokens + {row.settings.max_new_tokens} new exceed the context ({n})")
            if row.settings.num_beams != 1:
                raise ValueError("the engine samples; beam search is not served")
        with self._cond:
            if self._closed:
                raise EngineClosed("the server is shutting down")
            if len(self._waiting) + len(rows) > self.settings.max_waiting:
                self._waiting = deque(r for r in self._waiting if not r.cancelled)  # clients that left
            if len(self._waiting) + len(rows) > self.settings.max_waiting + self._free_places():
                raise QueueFull(f"{len(self._waiting)} requests are waiting (the limit is {self.settings.max_waiting})")
            self._waiting.extend(rows)
            self._cond.notify()

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def _free_places(self) -> int:
        return max(0, self.settings.max_batch_size - self.running)

    def stats(self) -> dict:
        with self._cond:
            return {"running": self.running, "waiting": len(self._waiting), **self.counters}

    def close(self, timeout: float = 10.0) -> None:
        """Refuse new rows, let the thread finish the batch in flight (rows still waiting are told the
        server is shutting down), and join it."""
        with self._cond:
            self._closed = True
            left = list(self._waiting)
            self._waiting.clear()
            self._cond.notify_all()
        for row in left:
            self._tell(row, "error", "the server is shutting down")
        if self._thread.is_alive():
            self._thread.join(timeout)

    # -- the engine thread

    def _tell(self, row: Row, kind: str, value: object) -> None:
        try:
            row.sink(kind, value)
        except Exception:  # a callback that fails (its client is gone) cancels its row, nothing more
            log.exception("a row's callback failed; cancelling the row")
            row.cancel()

    def _take(self, rows: list[Row], width: int | None) -> list[Row]:
        """Waiting rows (FIFO) that fit beside `rows`, a batch whose cache is `width` wide (None: a
        new batch). Stops at the first that does not fit, so no request is overtaken forever."""
        taken: list[Row] = []
        with self._cond:
            while self._waiting and len(rows) + len(taken) < self.settings.max_batch_size:
                candidate = self._waiting[0]
                if candidate.cancelled:
                    self._waiting.popleft()
                    continue
                if not self._fits(rows, taken + [candidate], width):
                    break
                taken.append(self._waiting.popleft())
            self.running = len(rows) + len(taken)
        return taken

    def _fits(self, rows: list[Row], joiners: list[Row], width: int | None) -> bool:
        """Whether every row still has room in the context for its remaining tokens once `joiners`
        join: the step that admits them makes the cache `new_width` wide, each row then samples its
        next token from that step and needs one more position for each token after it."""
        prompt_width = max(len(r.prompt_ids) for r in joiners)
        new_width = prompt_width if width is None else width + prompt_width
        need = max(r.remaining for r in rows + joiners)
        return new_width + need - 1 <= self.backend.n_positions

    def _loop(self) -> None:
        while True:
            with self._cond:
                while not self._waiting and not self._closed:
                    self._cond.wait()
                if self._closed and not self._waiting:
                    self.running = 0
                    return
            if self.settings.batch_wait_s and len(self._waiting) < self.settings.max_batch_size:
                time.sleep(self.settings.batch_wait_s)  # let requests that arrive together batch together
            rows = self._take([], None)
            if not rows:
                continue
            self._batch = rows
            try:
                self._run_batch(rows)
            except Exception as e:  # the batch fails; the engine and the other batches go on
                log.exception("a batch failed")
                self.counters["errors"] += 1
                for row in self._batch:
                    if not row.finished:
                        row.finished = True
                        self._tell(row, "error", f"generation failed: {e}")
            with self._cond:
                self.running = 0

    def _run_batch(self, rows: list[Row]) -> None:
        """Prefill `rows`, then decode until every row (including any that joined) has finished."""
        self.counters["batches"] += 1
        ids, mask = left_pad([r.prompt_ids for r in rows])
        logits, past = self.backend.step(ids, mask, positions(mask, ids.shape[1]), None)
        self.counters["steps"] += 1
        while True:
            nxt = self._sample(rows, logits)
            keep = [i for i, r in enumerate(rows) if not r.finished]
            if not keep:
                return
            if len(keep) < len(rows):  # finished rows leave the batch, and their cache with them
                rows = [rows[i] for i in keep]
                past = self.backend.reorder(past, np.asarray(keep, dtype=np.int64))
                mask, nxt = mask[keep], nxt[keep]
            joiners = self._take(rows, mask.shape[1]) if self.settings.continuous and self._waiting else []
            with self._cond:
                self.running = len(rows) + len(joiners)
            if joiners:
                ids, mask, past = self._join(rows, joiners, nxt, mask, past)
                rows = rows + joiners
                self._batch = rows
                self.counters["joins"] += 1
            else:
                ids = nxt[:, None]
                mask = np.concatenate([mask, np.ones((len(rows), 1), dtype=np.int64)], axis=1)
            logits, past = self.backend.step(ids, mask, positions(mask, ids.shape[1]), past)
            self.counters["steps"] += 1

    def _join(self, rows: list[Row], joiners: list[Row], nxt: np.ndarray, mask: np.ndarray, past):
        """The inputs of a step that feeds `rows` their next token and `joiners` their prompts:
        ids and mask (B + J, width), and the cache with J more rows (copies of row 0, masked out)."""
        B, width = mask.shape
        jids, jmask = left_pad([r.prompt_ids for r in joiners])
        L = jids.shape[1]
        run_ids = np.full((B, L), EOT_ID, dtype=np.int64)
        run_ids[:, -1] = nxt
        run_step = np.zeros((B, L), dtype=np.int64)
        run_step[:, -1] = 1
        ids = np.concatenate([run_ids, jids])
        mask = np.concatenate([
            np.concatenate([mask, run_step], axis=1),
            np.concatenate([np.zeros((len(joiners), width), dtype=np.int64), jmask], axis=1),
        ])
        rows_index = np.concatenate([np.arange(B), np.zeros(len(joiners), dtype=np.int64)])
        return ids, mask, self.backend.reorder(past, rows_index)

    def _sample(self, rows: list[Row], logits: np.ndarray) -> np.ndarray:
        """Each row's next token from its own sampler; tokens are told to the rows' callbacks, and
        rows that end are marked finished (and told why)."""
        nxt = np.full(len(rows), EOT_ID, dtype=np.int64)
        for i, row in enumerate(rows):
            if row.cancelled:
                row.finished = True
                self._tell(row, "done", "cancelled")
                continue
            tok = int(row.sampler(logits[i : i + 1])[0])
            nxt[i] = tok
            if tok == EOT_ID:
                row.finished = True
                self._tell(row, "done", "stop")
                continue
            row.produced += 1
            self.counters["tokens"] += 1
            self._tell(row, "token", tok)
            if row.remaining <= 0:
                row.finished = True
                self._tell(row, "done", "length")
        self.counters["rows"] += sum(r.finished for r in rows)
        return nxt
