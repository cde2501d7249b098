"""The serving engine's scheduler: every decision on which rows run, when and how, made as one plan
per step (`Scheduler.schedule`) that the runner (runner.py) executes. It never touches a backend: it
sees rows, the batch's width and the columns its rows use, the context's length and a clock. Why a
regrouped batch is laid out as it is: docs/serving/index.md#batching."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from ...errors import UsageError
from ...generation.settings import Finish
from .prefix_cache import DEFAULT_PREFIX_CACHE_MB
from .prefix_disk import DEFAULT_PREFIX_CACHE_DISK_MB
from .request import Row
from .request_queue import RequestQueue

SCHEDULING_POLICIES = ("fcfs", "priority")
# A new batch's wait for requests arriving together after a batch of several rows, or where several wait already
# (EngineSettings.batch_wait_s None):
# until AUTO_QUIET_S pass with no request arriving, at most AUTO_BATCH_WAIT_S. vllm bench serve at c=16 (scratch
# runs, int8, 2-core Xeon): TTFT p50 135-138 ms with a fixed 5 or 10 ms wait, 168-176 ms without; at 5 ms part of a
# wave was left to join it, its prefill chunked beside the rows running (ITL p99 47-52 against 31-38 ms); at c=1 a
# fixed wait cost every first token 7-11 ms, which the auto rule does not pay. A wave's requests came 0.3-2.3 ms
# apart, its second up to 6.5 ms after its first; a 2 ms quiet split waves (docs/results/engines.md).
AUTO_BATCH_WAIT_S = 0.02
AUTO_QUIET_S = 0.005
# A joiners' prefill is overlapped (EngineSettings.overlap_prefill) where chunking would spread it over more chunks than
# this. On half the cores a prefill takes about twice as long (a 545-token prompt of GPT-2 124M int8 238 against 122 ms
# on the 2-core Xeon, scratch): up to two chunks, with a step between them, its first token comes sooner chunked
# (a 512-token joiner 165 against 268 ms); from three on, as soon overlapped (the 545-token joiners of
# docs/results/serving.md#overlapped-prefill), and the rows running do not wait for the chunks.
OVERLAP_AFTER_CHUNKS = 2
# Rows sharing this many prompt tokens with an earlier row of their new batch wait for its prefill and take them from
# the prefix cache (SchedulerOutput.prefill_later). The wait costs the batch one more forward and a merge: a long
# shared text pays for them, a block or two may not (a threshold chosen, not tuned).
SHARED_TO_WAIT = 64


@dataclass(frozen=True)
class EngineSettings:
    max_batch_size: int = 16  # rows decoded together; 1 = no batching
    max_waiting: int = 64  # rows waiting for a place in the batch; more are refused (QueueFull)
    continuous: bool = True  # waiting rows join a running batch between decode steps
    # A new batch waits this long after its first request for others (at most; it starts once a batch's
    # worth waits). 0: requests arriving a moment later join at the next decode step. None (auto): after
    # a batch that ran several rows at once, or where several requests wait already, until none has arrived
    # for AUTO_QUIET_S (AUTO_BATCH_WAIT_S at most), none for a lone request after one of a single row: a closed
    # loop's requests come back in waves, while one request at a time would pay the wait on every first token
    # (docs/serving/index.md#batching).
    batch_wait_s: float | None = None
    max_join_delay_s: float = 0.05  # a waiting request joins a running batch after at most this long
    # Prompts joining a running batch are prefilled this many tokens at a time, a chunk between two
    # decode steps, so the rows running keep streaming (0: a joiner's prefill runs whole; so does one of more
    # joiners than rows running).
    prefill_chunk: int = 256
    # Joiners whose prefill would take more than OVERLAP_AFTER_CHUNKS chunks are prefilled whole on half the cores
    # while the batch decodes on the other half, where the backend can share its cores (else chunked as above): the
    # rows running keep streaming, each step on half the cores, rather than waiting a chunk between two steps. Off
    # by default: its second set of sessions and graphs doubled a served GPT-2 124M int8's memory (5.4 against
    # 2.9 GB), and the joiners' first tokens come later (docs/serving/index.md#overlapped-prefill).
    overlap_prefill: bool = False
    # Host memory for the KV of prompts' prefixes, kept for later prompts that begin the same way
    # (prefix_cache.py; 0: off).
    prefix_cache_mb: float = DEFAULT_PREFIX_CACHE_MB
    # A folder the prefix cache's blocks are also kept in, read back by a later process serving the same export
    # (prefix_disk.py; None: memory only), at most this many MiB of them per export.
    prefix_cache_dir: str | None = None
    prefix_cache_disk_mb: float = DEFAULT_PREFIX_CACHE_DISK_MB
    # Which waiting row runs next: "fcfs" (arrival order) or "priority" (vLLM's: the lowest `priority`
    # first, arrival order among equals; rows running are never preempted).
    scheduling_policy: str = "fcfs"

    @property
    def rows_held(self) -> int:
        """The most rows an engine holds at once, running and waiting: a request with more is refused, and the
        offline API and batch files submit in waves of this many."""
        return self.max_batch_size + self.max_waiting

    def __post_init__(self) -> None:
        if self.scheduling_policy not in SCHEDULING_POLICIES:
            raise UsageError(f"scheduling_policy must be one of {', '.join(SCHEDULING_POLICIES)}, got "
                             f"{self.scheduling_policy!r}", option="scheduling_policy")
        if self.max_batch_size < 1:
            raise UsageError(f"max_batch_size must be >= 1, got {self.max_batch_size}", option="max_batch_size")
        if self.prefix_cache_dir is not None and not self.prefix_cache_mb:
            raise UsageError("prefix_cache_dir keeps the prefix cache's blocks on disk too: it needs the prefix cache itself "
                             "(a memory budget above 0)", option="prefix_cache_dir")
        for name in ("max_waiting", "prefill_chunk", "prefix_cache_mb", "prefix_cache_disk_mb"):
            if getattr(self, name) < 0:
                raise UsageError(f"{name} must be >= 0, got {getattr(self, name)}", option=name)
        for name in ("batch_wait_s", "max_join_delay_s"):
            if getattr(self, name) is not None and getattr(self, name) < 0:
                raise UsageError(f"{name} must be >= 0, got {getattr(self, name)}", option=name)


class Shape(Protocol):
    """What the scheduler sees of a batch the runner holds (runner.Batch)."""

    rows: list[Row]  # in cache order

    @property
    def width(self) -> int:
        """Its cache's width (mask columns)."""

    def used(self, rows: list[int]) -> int:
        """Columns the rows at these indices use: from the first any of them uses to the end (0: none)."""


@dataclass(frozen=True)
class Regroup:
    """The batch laid out anew: row i is row order[i] of the batch (0..B-1) or of the joined batch
    (B onward), every row right-aligned to `width` columns."""

    order: np.ndarray
    width: int
    joins: bool  # the joined rows come in; False: a compaction (finished rows leave)


@dataclass(frozen=True)
class SchedulerOutput:
    """One step's plan, executed in this order by runner.Runner.execute."""

    scored: tuple[Row, ...] = ()  # rows just taken whose prompts are scored first (prompt_logprobs)
    searched: tuple[Row, ...] = ()  # rows just taken that run a beam search, whole
    ended: tuple[tuple[Row, Finish], ...] = ()  # rows just taken that end without running
    prefill: tuple[Row, ...] = ()  # a new batch, prefilled whole ...
    prefill_later: tuple[Row, ...] = ()  # ... then these rows, which share a long prompt text with it, from the cache
    cached: bool = True  # the prefill (the new batch's first rows, or the joiners') starts from the prefix cache
    later_cached: bool = True  # prefill_later's does
    speculative: Row | None = None  # one row decoded whole with the draft
    join: tuple[Row, ...] = ()  # rows whose prefill begins beside the running batch
    advance: bool = False  # the joiners' prefill runs its next chunk (or, overlapped, is waited for to end) ...
    chunk: int | None = None  # ... of about this many tokens (None: all that is left)
    overlap: bool = False  # ... whole, on half the cores, beside the decode steps that follow (runner.joined once done)
    regroup: Regroup | None = None  # the batch laid out anew, the joiners prefilled by now in or not
    decode: bool = False  # one decode step of every row of the batch
    release: bool = False  # the batch has ended: the runner lets its cache go


DECODE = SchedulerOutput(decode=True)  # the plan of most steps


class PrefixView(Protocol):
    """What the scheduler reads of the prefix cache (prefix_cache.PrefixCache) to plan prefills."""

    block_tokens: int

    def held(self, ids: list[int]) -> int: ...

    def lacks(self, ids: list[int]) -> bool: ...


Estimate = Callable[[int, int, int], "float | None"]  # (rows, new tokens, past) -> ms (Backend.prefill_ms)


class Scheduler:
    """Every decision on the waiting rows (held by `queue`, a RequestQueue the callers' threads put rows in:
    `submit`, `close`) and on the batch (the engine's thread: `schedule`, `update`, `fail`). `joins_rows`: the
    backend's cache takes rows prefilled apart (else batches are static); `speculative`: a draft decodes lone rows;
    `prefix` and `estimate`: the prefix cache and the backend's prefill times, for the prefix cache's policy."""

    def __init__(self, settings: EngineSettings, n_positions: int, joins_rows: bool = True,
                 speculative: bool = False, clock: Callable[[], float] = time.monotonic, shares_cores: bool = False,
                 prefix: PrefixView | None = None, estimate: Estimate | None = None):
        self.settings = settings
        self.joins_rows = joins_rows
        # The prefix cache the runner's prefills read (None: none), and the backend's prefill estimates, where it
        # gives them (capabilities.estimates_prefill): whether a prefill starts from the cache is decided here.
        self.prefix = prefix
        self.estimate = estimate
        self.n_positions = n_positions
        self.joins = settings.continuous and joins_rows and settings.max_batch_size > 1
        self.speculative = speculative
        # the backend prefills on half its cores beside decode steps on the rest (Backend.sharing_cores)
        self.overlaps = self.joins and shares_cores and settings.overlap_prefill and settings.prefill_chunk > 0
        self.clock = clock
        self.queue = RequestQueue(settings.max_waiting, settings.scheduling_policy == "priority")
        self.running = 0  # rows of the batch in flight that have not finished
        self._peak = 0  # the most rows the batch in flight (or the last) has run at once
        self.in_flight: list[Row] = []  # rows a failure (or Engine.abort) ends: the batch's and the joiners'
        # The engine's thread's: the batches the runner holds, as it last reported them (`update`),
        # the rows being prefilled to join, and which half of a step the next plan is.
        self._batch: Shape | None = None
        self._joined: Shape | None = None
        self._prefilling: list[Row] | None = None
        # While the joiners' prefill runs overlapped: the decode steps the batch may still take before they must join
        # (each row keeping room in the context: overlap_room); None otherwise.
        self._overlap: int | None = None
        self._decoding = False

    # -- the callers' side (any thread)

    def submit(self, rows: list[Row]) -> None:
        """Queue rows, all or none. Each row's prompt and budget must fit the context together."""
        n = self.n_positions
        for row in rows:
            if not row.prompt_ids or len(row.prompt_ids) + row.max_tokens > n or row.max_tokens < 0:
                raise ValueError(f"{len(row.prompt_ids)} prompt tokens + {row.max_tokens} new exceed the context ({n})")
            if row.settings.num_beams != 1 and row.beam_rows is None:
                raise ValueError("a beam search row needs the rows its hypotheses are told to (beam_rows)")
        self.queue.put(rows, self._free_places())

    def close(self) -> list[Row]:
        """Take no more rows; the rows still waiting, which will not run."""
        return self.queue.close()

    @property
    def closed(self) -> bool:
        """Whether it takes no more rows (the engine is stopping or stopped)."""
        return self.queue.closed

    def counts(self) -> tuple[int, int]:
        """(running, waiting): rows whose clients left while they waited are not counted."""
        return self.running, len(self.queue)

    def _free_places(self) -> int:
        return max(0, self.settings.max_batch_size - self.running)

    # -- the engine's side: the plans

    def schedule(self) -> SchedulerOutput | None:
        """The next step's plan. Blocks while nothing is in flight and no row waits; None once closed
        with none waiting. A batch's step is planned in two halves, each only when it has work: the
        joiners' (rows taken, their prefill's next chunk), then the batch's (regroup, decode step)."""
        while True:
            batch = self._batch
            if batch is None:
                self.set_running(0)
                if not self.wait_for_work():
                    return None
                plan = self._new_batch()
            elif not self._decoding:
                self._decoding = True
                plan = self._joining(batch)
            else:
                self._decoding = False
                plan = self._stepping(batch)
            if plan is not None:
                return plan

    def update(self, batch: Shape | None, joined: Shape | None) -> None:
        """The batches the runner holds after a plan: the batch in flight, and the joiners when their
        prefill has just ended (merged, or dropped, by the next plan)."""
        self._batch, self._joined = batch, joined

    def fail(self) -> list[Row]:
        """A plan failed: the batch in flight is given up. Its rows and the joiners', to be told."""
        rows, self.in_flight = self.in_flight, []
        self._batch = self._joined = self._prefilling = self._overlap = None
        self._decoding = False
        return rows

    def _new_batch(self) -> SchedulerOutput | None:
        """Rows taken from the queue as a new batch, prefilled whole (or one row with the draft)."""
        rows = self.take([], None)
        if not rows:
            return None
        self.in_flight = rows
        scored, searched, ended, going = self._start(rows)
        alone = self.speculative and len(going) == 1 and going[0].logprobs is None
        if alone:
            return SchedulerOutput(scored, searched, ended, speculative=going[0])
        shared = self._sharing(list(going))
        first = tuple(r for i, r in enumerate(going) if i not in shared)
        later = tuple(going[i] for i in sorted(shared))
        return SchedulerOutput(scored, searched, ended, prefill=first, prefill_later=later,
                               cached=self._cache_pays(list(first)),
                               later_cached=self._cache_pays(list(later), [shared[i] for i in sorted(shared)]))

    def _joining(self, batch: Shape) -> SchedulerOutput | None:
        """The joiners' half of a step: waiting rows taken when a join is due (`join_due`), and the
        next chunk of their prefill (whole when no row runs: there is nobody to stall)."""
        live = _live(batch.rows)
        if self._overlap is not None:  # the joiners' prefill runs beside the steps
            if self._joined is not None or (live and self._overlap > 0):
                return None
            return SchedulerOutput(advance=True)  # no row decodes, or none may run further ahead: wait for it
        scored = searched = ended = join = ()
        if self._prefilling is None and live and self.joins and self.join_due(len(live)):
            taken = self.take([batch.rows[i] for i in live], batch.used(live))
            if taken:
                scored, searched, ended, join = self._start(taken)
                self.in_flight = batch.rows + taken
                self._prefilling = list(join) or None
        if self._prefilling is None:
            return SchedulerOutput(scored, searched, ended) if scored or searched or ended else None
        if not join:
            self.in_flight = batch.rows + self._prefilling
        # Chunks spare the rows running a whole prefill's wait for their next token, at the joiners' first tokens'
        # cost: worth it while those rows are as many as the joiners, not for a wave of requests joining a row or two
        # (docs/serving/index.md#chunked-prefill).
        beside = bool(live) and len(self._prefilling) <= len(live)
        cached = self._cache_pays(list(join)) if join else True
        if join and beside and self.overlaps and self.prefill_steps(list(join)) > OVERLAP_AFTER_CHUNKS:
            self._overlap = self.overlap_room([batch.rows[i] for i in live], list(join), batch.used(live))
            return SchedulerOutput(scored, searched, ended, join=join, advance=True, overlap=True, cached=cached)
        chunk = (self.settings.prefill_chunk or None) if beside else None
        return SchedulerOutput(scored, searched, ended, join=join, advance=True, chunk=chunk, cached=cached)

    def _stepping(self, batch: Shape) -> SchedulerOutput | None:
        """The batch's half of a step: the joiners whose prefill has ended brought in, or half the
        batch finished compacted away (`regroup_due`), then a decode step while a row runs."""
        live = _live(batch.rows)
        joined, self._joined = self._joined, None
        if joined is not None:
            self._prefilling = self._overlap = None
        elif self._overlap is not None:
            self._overlap -= 1  # the step planned below
        if not live and joined is None:  # (a prefill under way ran whole, so ended by now)
            self._batch = None
            self.in_flight = []
            return SchedulerOutput(release=True)
        regroup = None
        if self.regroup_due(len(live), len(batch.rows), joined is not None):
            regroup = self.plan_regroup(batch, live, joined)
        if regroup is None:
            rows = batch.rows
            if not live:
                return None  # every joiner ended at its first token
        else:
            rows = batch.rows + ([] if joined is None else joined.rows)
            rows = [rows[i] for i in regroup.order]
        self.in_flight = rows + (self._prefilling or [])
        self.set_running(sum(not r.finished for r in self.in_flight))
        return DECODE if regroup is None else SchedulerOutput(regroup=regroup, decode=True)

    def _start(self, rows: list[Row]) -> tuple[tuple[Row, ...], tuple[Row, ...], tuple[tuple[Row, Finish], ...],
                                               tuple[Row, ...]]:
        """What rows just taken do before their prefill: (scored, searched, ended, going). Rows that
        ask are scored; beam searches run whole; rows cancelled while waiting end, and so do rows with
        no token to generate (once scored); the others go on to be prefilled."""
        scored, searched, ended, going = [], [], [], []
        now = self.clock()
        for row in rows:
            row.scheduled_at = now
            if row.cancelled is not None:
                ended.append((row, Finish.cancelled))
                continue
            if row.beam_rows is not None:
                searched.append(row)
                continue
            if row.prompt_logprobs:
                scored.append(row)
            if row.remaining <= 0:
                ended.append((row, Finish.length))
            else:
                going.append(row)
        return tuple(scored), tuple(searched), tuple(ended), tuple(going)

    # -- the decisions

    def _sharing(self, rows: list[Row]) -> dict[int, int]:
        """The rows (indices) of a new batch whose prompts share SHARED_TO_WAIT or more leading tokens, whole blocks the
        prefix cache lacks, with the prompt of an earlier row (and differ from it: identical prompts are prefilled
        once anyway), each with the tokens it shares: they wait for that row's prefill, which leaves those blocks in
        the cache, so that a batch of requests sharing a long system text computes it once, not once per request."""
        cache = self.prefix
        if cache is None or len(rows) < 2 or not self.joins_rows:
            return {}
        block, later = cache.block_tokens, {}
        leaders: dict[tuple[int, ...], list[int]] = {}  # first block -> the first prompt that began with it
        for i, row in enumerate(rows):
            ids = row.prompt_ids
            if len(ids) <= SHARED_TO_WAIT:
                continue
            lead = leaders.setdefault(tuple(ids[:block]), ids)
            if lead is ids or lead == ids:
                continue
            same = next((k for k, (a, b) in enumerate(zip(ids, lead)) if a != b), min(len(ids), len(lead)))
            shared = ids[: min(same, len(ids) - 1) // block * block]
            if len(shared) >= SHARED_TO_WAIT and cache.lacks(shared):
                later[i] = len(shared)
        return later

    def _cache_pays(self, rows: list[Row], shared: list[int] | None = None) -> bool:
        """Whether prefilling the rows' prompts' rests on the prefix cache's blocks is estimated sooner than prefilling
        them whole (the prompts the runner runs: each distinct one once where the backend's cache joins rows). A
        backend may run a fresh prompt on a faster runtime than a prompt with a past (the OpenVINO prefill: 15 rows of
        16 tokens on a cached 16 took 250 ms, the same rows of 32 fresh 140; docs/serving/index.md#prefix-caching).
        Yes where the backend gives no estimate. `shared`: tokens each row will find held once an earlier prefill of
        its batch has run (prefill_later's)."""
        if self.prefix is None or self.estimate is None or not rows:
            return True
        prompts = [r.prompt_ids for r in rows]
        held = [max(self.prefix.held(p), s) for p, s in zip(prompts, shared or [0] * len(rows))]
        if self.joins_rows:  # identical prompts run once
            distinct = {tuple(p): h for p, h in zip(prompts, held)}
            prompts, held = [list(p) for p in distinct], list(distinct.values())
        if not any(held):
            return True
        n = len(prompts)
        with_cache = self.estimate(n, max(len(p) - h for p, h in zip(prompts, held)), max(held))
        whole = self.estimate(n, max(len(p) for p in prompts), 0)
        return with_cache is None or whole is None or with_cache <= whole

    def wait_for_work(self) -> bool:
        """Block until rows wait (True) or the scheduler is closed with none waiting (False). A new
        batch waits up to batch_wait (batch_wait_s, or auto) more while fewer than a batch's worth
        wait, so that requests that arrive together batch together."""
        if not self.queue.wait():
            self.running = 0
            return False
        wait = self.batch_wait()
        self._peak = 0
        if wait:
            deadline = time.monotonic() + wait
            if self.settings.batch_wait_s is None:  # auto: until requests stop arriving for AUTO_QUIET_S, at most the deadline
                self.queue.fill(self.settings.max_batch_size, lambda: min(deadline, self.queue.arrived + AUTO_QUIET_S))
            else:
                self.queue.fill(self.settings.max_batch_size, lambda: deadline)
        return True

    def batch_wait(self) -> float:
        """The longest a new batch waits for more requests: batch_wait_s, or where it is None AUTO_BATCH_WAIT_S (less
        once no request has arrived for AUTO_QUIET_S) after a batch that ran more than one row at once or where more
        than one request waits already (a wave is arriving), and none for a lone request after one of a single row."""
        if self.settings.batch_wait_s is not None:
            return self.settings.batch_wait_s
        return AUTO_BATCH_WAIT_S if self._peak > 1 or self.queue.burst > 1 else 0.0

    def set_running(self, n: int) -> None:
        self.running = n
        self._peak = max(self._peak, n)  # the batch's most rows at once, for the next one's batch_wait

    def take(self, rows: list[Row], width: int | None) -> list[Row]:
        """Waiting rows (in arrival order, or by priority with the priority policy) that fit beside
        `rows`, a batch whose cache can be made `width` wide (None: a new batch). Stops at the first
        that does not fit, so no request is overtaken forever (by one of its own priority)."""
        taken = self.queue.take(lambda taken, candidate: self._fits(rows, taken + [candidate], width),
                                self.settings.max_batch_size - len(rows))
        self.running = len(rows) + len(taken)
        return taken

    def _fits(self, rows: list[Row], joiners: list[Row], width: int | None, lag: int | None = None) -> bool:
        """Whether every row keeps room in the context for its remaining tokens once `joiners` join a
        batch whose cache can be made `width` wide (None: they start a new one). The merged cache is
        at least as wide as that and the joiners' prompts; a running row samples its next token one
        position further, a joiner its first from its own prefill. Joiners prefilled in chunks join
        `lag` steps later, the batch's rows that many positions further on (and as many tokens
        nearer their end; `lag`: that many steps instead)."""
        joiners = [r for r in joiners if r.remaining > 0]  # a row that is only scored never joins the cache
        if not joiners:
            return True
        new_width = max(len(r.prompt_ids) for r in joiners)
        if width is None:
            lag = 0
        else:
            lag = self.prefill_steps(joiners) - 1 if lag is None else lag
            new_width = max(width + lag, new_width)
        need = max([r.remaining - lag for r in rows if not r.finished] + [r.remaining - 1 for r in joiners])
        return new_width + need <= self.n_positions

    def overlap_room(self, rows: list[Row], joiners: list[Row], width: int) -> int:
        """The decode steps a batch whose live `rows` use `width` columns may take while `joiners` are prefilled beside
        it, every row keeping room for its remaining tokens once they join (`_fits` at that lag: `take` checked the
        chunked prefill's), at most n_positions: past it the batch waits for them. The widths `_fits` adds up first
        shrink, then grow with the lag, so the lags that fit from the checked one on are an interval: its end is
        searched."""
        low, high = self.prefill_steps(joiners) - 1, self.n_positions  # low fits
        while low < high:
            mid = (low + high + 1) // 2
            if self._fits(rows, joiners, width, mid):
                low = mid
            else:
                high = mid - 1
        return low

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
        oldest = self.queue.oldest()
        if oldest is None or live >= self.settings.max_batch_size:
            return False
        return len(self.queue) >= max(1, live // 4) or self.clock() - oldest.queued_at >= self.settings.max_join_delay_s

    def regroup_due(self, live: int, rows: int, joining: bool) -> bool:
        """Whether the batch regroups before its next step: rows join, or half of it has finished
        (finished rows ride along, masked and unread, until then: a merge through the host copies the
        whole cache, so rows do not leave one by one)."""
        return joining or 2 * live <= rows

    def plan_regroup(self, batch: Shape, live: list[int], joined: Shape | None) -> Regroup | None:
        """The batch with its finished rows gone and the joined rows still running in (`layout`,
        `merged_width`); None to keep it as it is: when every joiner ended at its first token and
        less than half of the batch has finished, or when no row is left to decode."""
        jlive = [] if joined is None else _live(joined.rows)
        if joined is not None and not jlive and 2 * len(live) > len(batch.rows):
            return None
        if not live and not jlive:
            return None
        n = len(batch.rows)
        order = layout(live, n, [n + j for j in jlive])
        need = max([batch.rows[i].remaining for i in live] + [joined.rows[j].remaining for j in jlive])
        width = merged_width(batch.width, batch.used(live), joined.used(jlive) if jlive else 0, need, self.n_positions)
        return Regroup(order, width, bool(jlive))


def _live(rows: list[Row]) -> list[int]:
    return [i for i, r in enumerate(rows) if not r.finished]


def merged_width(width: int, used: int, jused: int, need: int, n_positions: int) -> int:
    """The merged cache's width, of a batch `width` wide whose kept rows use `used` columns and
    joiners that use `jused`: the batch's own (or the joiners', when wider: every row moves right
    then anyway), unless dropping the leading columns no kept row uses pays for moving every row (in
    an in-place cache): when they are at least half of it, when a joiner moves every row anyway, or
    when the rows' remaining tokens (`need`, the most of them) need the room (`Scheduler._fits`
    counted on it)."""
    keep = max(width, jused)
    least = max(used, jused)
    if 2 * least <= keep or keep > width or keep + need > n_positions:
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
