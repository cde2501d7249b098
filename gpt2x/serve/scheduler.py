"""The serving engine's scheduler: which rows run. It owns the waiting queue (bounded: QueueFull, never
grown without limit), takes waiting rows into a new batch or a running one when they fit the context,
says when a join is due, and lays out a regrouped batch (`plan_regroup`). It never touches a backend:
it sees rows, attention masks and the context length. The runner (runner.py) steps what it decides.

How rows are laid out is chosen for caches that move rows in place (ONNX Runtime's in-place cache and
OpenVINO's, kvbuffers.BufferCache.merge), where a merge costs only the rows it moves: a live row keeps
its place where that is inside the new batch, joiners take the places of rows that left, and only
live rows beyond the new batch size move, into the remaining holes. The batch keeps its width unless
a joiner's prompt is wider (every row then moves right: unavoidable, since all rows share the width),
and leading mask columns no row uses are dropped only when that pays for moving every row: when they
are at least half the width, or when the context needs them for the rows' remaining tokens
(`merged_width`). Caches merged through the host (ONNX Runtime's growing cache, PyTorch) are copied
whole at every merge, whatever the layout.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from ..errors import UsageError
from ..generation.decode import Sequence
from ..generation.settings import SamplingSettings
from .prefix_cache import DEFAULT_PREFIX_CACHE_MB

SCHEDULING_POLICIES = ("fcfs", "priority")


class QueueFull(RuntimeError):
    """The waiting queue is at its bound: the request is refused, not queued."""


class EngineClosed(RuntimeError):
    """The engine is shutting down and takes no more requests."""


@dataclass(frozen=True)
class EngineSettings:
    max_batch_size: int = 16  # rows decoded together; 1 = no batching
    max_waiting: int = 64  # rows waiting for a place in the batch; more are refused (QueueFull)
    continuous: bool = True  # waiting rows join a running batch between decode steps
    # A new batch waits this long after its first request for others. 0: requests arriving a moment
    # later join at the next decode step; measured on the 2-core VM (2026-11-25, int8, gpt2x loadtest
    # c=1 and 16): 0 against 2 ms, TTFT p50 15.3 against 18.1 ms at c=1, 111 against 113 ms at c=16.
    batch_wait_s: float = 0.0
    max_join_delay_s: float = 0.05  # a waiting request joins a running batch after at most this long
    # Prompts joining a running batch are prefilled this many tokens at a time, a chunk between two
    # decode steps, so the rows running keep streaming (0: a joiner's prefill runs whole).
    prefill_chunk: int = 256
    # Host memory for the KV of prompts' prefixes, kept for later prompts that begin the same way
    # (serve/prefix_cache.py; 0: off).
    prefix_cache_mb: float = DEFAULT_PREFIX_CACHE_MB
    # Which waiting row runs next: "fcfs" (arrival order) or "priority" (vLLM's: the lowest `priority`
    # first, arrival order among equals; rows running are never preempted).
    scheduling_policy: str = "fcfs"

    def __post_init__(self) -> None:
        if self.scheduling_policy not in SCHEDULING_POLICIES:
            raise UsageError(f"scheduling_policy must be one of {', '.join(SCHEDULING_POLICIES)}, got "
                             f"{self.scheduling_policy!r}", option="scheduling_policy")
        if self.max_batch_size < 1:
            raise UsageError(f"max_batch_size must be >= 1, got {self.max_batch_size}", option="max_batch_size")
        for name in ("max_waiting", "prefill_chunk", "prefix_cache_mb"):
            if getattr(self, name) < 0:
                raise UsageError(f"{name} must be >= 0, got {getattr(self, name)}", option=name)
        for name in ("batch_wait_s", "max_join_delay_s"):
            if getattr(self, name) < 0:
                raise UsageError(f"{name} must be >= 0, got {getattr(self, name)}", option=name)


# What a row's callback hears: ("token", id) for each token, then once ("done", reason) with reason a
# generation.settings.Finish: eos (end of text), length (its token budget) or cancelled; or ("error",
# message). A row with logprobs also hears ("logprob", LogprobEntry) before each ("token", id), and
# before the ("done", Finish.eos) of the end-of-text token; with prompt_logprobs, first ("prompt",
# [entry per prompt token]), the first entry (id, None, None).
Sink = Callable[[str, object], None]


class Row(Sequence):
    """One request's prompt being generated (generation.decode.Sequence, with its own Sampler seeded by
    the request): its callback (`sink`), whether its prompt is scored first, and when it was queued.
    `cancel()` (any thread) makes it leave the batch before the next step."""

    def __init__(self, prompt_ids: list[int], settings: SamplingSettings, sink: Sink, logprobs: int | None = None,
                 prompt_logprobs: bool = False, max_tokens: int | None = None):
        # Tokens to generate: settings.max_new_tokens unless given (0: the prompt is only scored).
        super().__init__(prompt_ids, settings, max_tokens, logprobs)
        self.sink = sink
        self.prompt_logprobs = prompt_logprobs  # the prompt scored when the row starts (k = logprobs or 0)
        self.cached_tokens = 0  # prompt tokens whose KV its prefill took from the prefix cache
        self.queued_at = time.monotonic()
        self.scheduled_at: float | None = None  # when the engine took it from the queue
        self.priority = 0  # with the priority policy: lower runs earlier (vLLM's)
        self.prompt_k: int | None = None  # with prompt_logprobs: the most likely tokens listed per prompt position
        self.prompt_ranks: list[int | None] | None = None  # each prompt token's rank, set as it is scored
        # Beam search (settings.num_beams > 1): this row runs the search, and each of these rows (this
        # one first) is told one of the best hypotheses, best first. Only this row is queued.
        self.beam_rows: list[Row] | None = None

    @property
    def finished(self) -> bool:
        return self.finish is not None

    @property
    def remaining(self) -> int:
        return self.limit - len(self.tokens)


class Scheduler:
    """The waiting queue and the decisions on it, shared by the callers' threads (`submit`, `close`)
    and the engine's (everything else)."""

    def __init__(self, settings: EngineSettings, n_positions: int):
        self.settings = settings
        self.n_positions = n_positions
        self._waiting: deque[Row] = deque()
        self._cond = threading.Condition()
        self._closed = False
        self.running = 0  # rows of the batch in flight that have not finished

    # -- the callers' side (any thread)

    def submit(self, rows: list[Row]) -> None:
        """Queue rows, all or none. Each row's prompt and budget must fit the context together."""
        n = self.n_positions
        for row in rows:
            if not row.prompt_ids or len(row.prompt_ids) + row.max_tokens > n or row.max_tokens < 0:
                raise ValueError(f"{len(row.prompt_ids)} prompt tokens + {row.max_tokens} new exceed the context ({n})")
            if row.settings.num_beams != 1 and row.beam_rows is None:
                raise ValueError("a beam search row needs the rows its hypotheses are told to (beam_rows)")
        with self._cond:
            if self._closed:
                raise EngineClosed("the server is shutting down")
            self._purge()
            if len(self._waiting) + len(rows) > self.settings.max_waiting + self._free_places():
                raise QueueFull(f"{len(self._waiting)} requests are waiting (the limit is {self.settings.max_waiting})")
            self._waiting.extend(rows)
            if self.settings.scheduling_policy == "priority":  # a stable sort: arrival order among equals
                self._waiting = deque(sorted(self._waiting, key=lambda r: r.priority))
            self._cond.notify()

    def close(self) -> list[Row]:
        """Take no more rows; the rows still waiting, which will not run."""
        with self._cond:
            self._closed = True
            left = list(self._waiting)
            self._waiting.clear()
            self._cond.notify_all()
        return left

    @property
    def closed(self) -> bool:
        """Whether it takes no more rows (the engine is stopping or stopped)."""
        return self._closed

    def counts(self) -> tuple[int, int]:
        """(running, waiting): rows whose clients left while they waited are not counted."""
        with self._cond:
            self._purge()
            return self.running, len(self._waiting)

    def _purge(self) -> None:
        """Rows cancelled while they waited (their clients left) leave the queue, freeing their places
        at once rather than when the engine reaches them (under the lock)."""
        if any(r.cancelled is not None for r in self._waiting):
            self._waiting = deque(r for r in self._waiting if r.cancelled is None)

    def _free_places(self) -> int:
        return max(0, self.settings.max_batch_size - self.running)

    # -- the engine's side

    def wait_for_work(self) -> bool:
        """Block until rows wait (True) or the scheduler is closed with none waiting (False). A new
        batch waits batch_wait_s more, so that requests that arrive together batch together."""
        with self._cond:
            while not self._waiting and not self._closed:
                self._cond.wait()
            if self._closed and not self._waiting:
                self.running = 0
                return False
            short = len(self._waiting) < self.settings.max_batch_size
        if self.settings.batch_wait_s and short:
            time.sleep(self.settings.batch_wait_s)
        return True

    def set_running(self, n: int) -> None:
        with self._cond:
            self.running = n

    def take(self, rows: list[Row], width: int | None) -> list[Row]:
        """Waiting rows (in arrival order, or by priority with the priority policy) that fit beside
        `rows`, a batch whose cache can be made `width` wide (None: a new batch). Stops at the first
        that does not fit, so no request is overtaken forever (by one of its own priority)."""
        taken: list[Row] = []
        with self._cond:
            while self._waiting and len(rows) + len(taken) < self.settings.max_batch_size:
                candidate = self._waiting[0]
                if candidate.cancelled is not None:
                    self._waiting.popleft()
                    continue
                if not self._fits(rows, taken + [candidate], width):
                    break
                taken.append(self._waiting.popleft())
            self.running = len(rows) + len(taken)
        return taken

    def _fits(self, rows: list[Row], joiners: list[Row], width: int | None) -> bool:
        """Whether every row keeps room in the context for its remaining tokens once `joiners` join a
        batch whose cache can be made `width` wide (None: they start a new one). The merged cache is
        at least as wide as that and the joiners' prompts; a running row samples its next token one
        position further, a joiner its first from its own prefill. Joiners prefilled in chunks join
        `lag` steps later, the batch's rows that many positions further on (and as many tokens
        nearer their end)."""
        joiners = [r for r in joiners if r.remaining > 0]  # a row that is only scored never joins the cache
        if not joiners:
            return True
        new_width = max(len(r.prompt_ids) for r in joiners)
        lag = 0
        if width is not None:
            lag = self.prefill_steps(joiners) - 1
            new_width = max(width + lag, new_width)
        need = max([r.remaining - lag for r in rows if not r.finished] + [r.remaining - 1 for r in joiners])
        return new_width + need <= self.n_positions

    def prefill_steps(self, joiners: list[Row]) -> int:
        """The steps that prefilling `joiners` beside a running batch takes at most (chunks of
        prefill_chunk tokens shared by its distinct prompts, at least a column each; fewer when the
        prefix cache holds some of them)."""
        chunk = self.settings.prefill_chunk
        if not chunk:
            return 1
        distinct = len({tuple(r.prompt_ids) for r in joiners})
        return -(-max(len(r.prompt_ids) for r in joiners) // max(1, chunk // distinct))

    def join_due(self, live: int) -> bool:
        """Whether waiting rows should join a running batch of `live` rows now: when enough wait (a
        quarter of the batch) or the oldest has waited max_join_delay_s."""
        with self._cond:
            if not self._waiting or live >= self.settings.max_batch_size:
                return False
            waited = time.monotonic() - self._waiting[0].queued_at
        return len(self._waiting) >= max(1, live // 4) or waited >= self.settings.max_join_delay_s

    def regroup_due(self, live: int, rows: int, joining: bool) -> bool:
        """Whether the batch regroups before its next step: rows join, or half of it has finished
        (finished rows ride along, masked and unread, until then: a merge through the host copies the
        whole cache, so rows do not leave one by one)."""
        return joining or 2 * live <= rows

    def plan_regroup(self, rows: list[Row], mask: np.ndarray, live: list[int], joiners: list[Row],
                     jmask: np.ndarray, jlive: list[int]) -> tuple[np.ndarray, int]:
        """The regrouped batch of `rows` (mask (B, W)) with its finished rows gone and the live joiners
        (their own prefill's mask (J, Wj)) in: which row each new row is (`layout`: batch rows 0..B-1,
        joiners B onward) and the merged cache's width (`merged_width`)."""
        order = layout(live, len(rows), [len(rows) + j for j in jlive])
        kept = [rows[i] for i in live] + [joiners[j] for j in jlive]
        return order, merged_width(mask, jmask, kept, live, jlive, self.n_positions)


def merged_width(mask: np.ndarray, jmask: np.ndarray, kept: list[Row], live: list[int], jlive: list[int],
                 n_positions: int) -> int:
    """The merged cache's width: the batch's own (or the joiners', when wider: every row moves right
    then anyway), unless dropping the leading columns no kept row uses pays for moving every row (in
    an in-place cache): when they are at least half of it, when a joiner moves every row anyway, or
    when the rows' remaining tokens need the room (`Scheduler._fits` counted on it)."""
    jwidth = jmask.shape[1] - unused_columns(jmask[jlive]) if jlive else 0
    keep = max(mask.shape[1], jwidth)
    least = max(mask.shape[1] - unused_columns(mask[live]), jwidth)
    need = max(r.remaining for r in kept)
    if 2 * least <= keep or keep > mask.shape[1] or keep + need > n_positions:
        return least
    return keep


def unused_columns(mask: np.ndarray) -> int:
    """Leading columns of a mask (B, T) that are 0 in every row."""
    used = mask.any(axis=0)
    return int(np.argmax(used)) if used.any() else mask.shape[1]


def layout(live: list[int], n: int, joining: list[int]) -> np.ndarray:
    """Which row of the batch (0..n-1) or of the joiners (n onward, in `joining`) each row of the
    regrouped batch is: a live row keeps its place where that is inside the new batch; joiners and
    the live rows beyond it take the places of rows that left. A cache that moves rows in place then
    copies only those."""
    size = len(live) + len(joining)
    order = np.full(size, -1, dtype=np.int64)
    staying = [i for i in live if i < size]
    order[staying] = staying
    order[order < 0] = [i for i in live if i >= size] + joining
    return order
