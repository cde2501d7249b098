"""The serving engine's scheduler: every decision on which rows run, when and how, made as one plan
per step (`Scheduler.schedule`, a `SchedulerOutput`: the rows it runs and how many tokens each) that the
runner (runner.py) executes, and every row's state, which it updates from what the runner gave
(`Scheduler.update_from_output`), yielding what each row is told. It never touches a backend: it keeps
its own view of the batch (its rows in cache order, its width, the columns its rows use), and sees the
context's length and a clock. Why a regrouped batch is laid out as it is: docs/serving/index.md#batching."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field, replace
from enum import Enum
from typing import Protocol

import numpy as np

from ...errors import UsageError
from ...generation.decode import Event
from ...generation.logprobs import LogprobEntry
from ...generation.settings import Finish
from ...runtime.providers import MIXED_PREFILL_CHUNK
from .outputs import Failed, Finished, Output, PromptLogprobs, TokenOut
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
# Rows sharing this many prompt tokens with an earlier row of their new batch wait for its prefill and take them from
# the prefix cache (Start.after). The wait costs the batch one more forward and a merge: a long
# shared text pays for them, a block or two may not (a threshold chosen, not tuned).
SHARED_TO_WAIT = 64
# A new batch of at least this many prompt tokens is prefilled in two forwards where the halves join at no cost (the
# fixed slots), its first half's first tokens told before the second half runs (Start.after): half the wave's first
# tokens come in half the time, the others about when they would have, as OpenVINO GenAI's step budget does. 16 prompts
# of 32 tokens on the OpenVINO int8 prefill: 149 ms in one forward, 147 in two of 8 (4 of 4: 157; the 2-core Xeon,
# scratch). A cache that copies to merge pays for it before the first step: the openvino backend's bf16 16 rows, 20 ms.
HALVES_FROM = 512
# Where a backend runs rows on a past a forward each and gives no estimate (the fixed slots without an OpenVINO
# prefill: fp32's default), a forward's own cost as this many tokens' compute, beside the tokens it runs: the
# prefix cache is taken where its forwards cost less than the prompts fresh in one (fp32 on the 2-core Xeon: 16 rows'
# 16-token rests on a cached block, a forward each, 483 ms; the same 16 prompts fresh together about 380; a forward of
# 16 tokens on a past 30 ms, 0.75 ms a token fresh: scratch).
FORWARD_TOKENS = 24
# A joiners' chunk by default (EngineSettings.prefill_chunk None): between two decode steps, a forward of its own, long
# enough that a 512-token prompt takes two; in a decode step's forward (the fixed slots), the backend's
# (capabilities.mixed_chunk), or its base and one more token per row running (runtime.providers.MIXED_PREFILL_CHUNK).
PREFILL_CHUNK = 256
_SAMPLED_ENDS = (Finish.eos, Finish.stop)  # a row ended by a token it sampled (not kept): an output all the same


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
    # joiners than rows running). None: where a chunk runs in the decode step's own forward (the fixed slots), the
    # backend's (capabilities.mixed_chunk: the paged slots' 64) or its base and a token per row running (ONNX Runtime's
    # slots: runtime.providers.cpu_mixed_chunk_base); PREFILL_CHUNK elsewhere.
    prefill_chunk: int | None = None
    # vLLM's step token budget, where set: a joiners' chunk is what the rows running leave of it (one token each), at
    # least one column, in place of prefill_chunk. On a backend that runs a chunk in its decode step's forward
    # (capabilities.mixes_chunks: the fixed slots), a step then costs about this many tokens' forward.
    max_num_batched_tokens: int | None = None
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
            if (getattr(self, name) or 0) < 0:
                raise UsageError(f"{name} must be >= 0, got {getattr(self, name)}", option=name)
        if self.max_num_batched_tokens is not None and self.max_num_batched_tokens < 1:
            raise UsageError(f"max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens}",
                             option="max_num_batched_tokens")
        for name in ("batch_wait_s", "max_join_delay_s"):
            if getattr(self, name) is not None and getattr(self, name) < 0:
                raise UsageError(f"{name} must be >= 0, got {getattr(self, name)}", option=name)


@dataclass(frozen=True)
class Regroup:
    """The batch laid out anew before its decode step: row i is row order[i] of the batch (0..B-1) or of the joiners
    just prefilled (B onward), every row right-aligned to `width` columns."""

    order: np.ndarray
    width: int


class Start(Enum):
    """How a row taken from the queue starts (NewRow.start)."""

    prefill = "prefill"  # prefilled: a new batch's rows whole; joiners beside the running batch, in chunks
    after = "after"  # a new batch's row prefilled after its other rows: a large wave's second half (HALVES_FROM), or a
    # row sharing a long prompt text with them, from the prefix cache's blocks theirs leave (SHARED_TO_WAIT)
    search = "search"  # a beam search, run whole
    draft = "draft"  # decoded whole with the draft, its tokens told as they come
    end = "end"  # nothing to run: it ends (NewRow.reason), once its prompt is scored where it asks


@dataclass(frozen=True)
class NewRow:
    """A row scheduled for the first time (vLLM's NewRequestData): the row (its prompt and settings), how it starts,
    whether its prompt is scored first (prompt_logprobs), whether its prefill starts from the prefix cache's blocks
    (`Scheduler._cache_pays`), and, ending at once, why."""

    row: Row
    start: Start
    scored: bool = False
    cached: bool = True
    reason: Finish | None = None


@dataclass(frozen=True)
class SchedulerOutput:
    """One step's plan, in vLLM v1's shape: the rows it runs and how many tokens each, and the layout facts that are
    policy. The runner (runner.Runner.execute) runs it and decides nothing; the scheduler applies what it gave
    (`Scheduler.update_from_output`). A batch's step is two plans, each only when it has work: the joiners' (rows
    taken, the next chunk of the joiners' prefill), then the batch's (its regroup, its decode step)."""

    scheduled_new_reqs: tuple[NewRow, ...] = ()  # rows taken from the queue, with their prompts
    # Rows continuing: the joiners, their prefill's next chunk; or the batch's live
    # rows, its decode step (its finished rows ride along, masked, until it regroups).
    scheduled_cached_reqs: tuple[Row, ...] = ()
    # The tokens each row runs: a prefill's columns of its left-padded prompts, at most (fewer where the prefix cache
    # holds their beginnings); 1 for a decode step's row; a draft row's prompt (its rounds follow in the same step). A
    # beam search, run whole on its own, and a prompt's scoring are not counted.
    num_scheduled_tokens: dict[Row, int] = field(default_factory=dict)
    finished_req_ids: tuple[Row, ...] = ()  # rows leaving the runner's batch: a regroup's, or every row at its end
    regroup: Regroup | None = None  # the batch laid out anew before its decode step: joiners in, finished rows out

    @property
    def total_num_scheduled_tokens(self) -> int:
        return sum(self.num_scheduled_tokens.values())


@dataclass(frozen=True, slots=True)
class RunnerOutput:
    """What the runner gave for a part of a plan, as soon as it was done (vLLM's ModelRunnerOutput): a model step's
    tokens (a prefill's first ones, a decode step's, a draft row's one at a time), a row's prompt scored, or a beam
    search's best hypotheses."""

    rows: Sequence[Row] = ()  # the rows `events` index, in their cache's order
    events: Sequence[Event] = ()  # each row's sampled token, end and logprobs (generation.decode)
    prompt_logprobs: dict[Row, list[LogprobEntry]] = field(default_factory=dict)
    hypotheses: dict[Row, list[tuple[list[int], Finish]]] = field(default_factory=dict)  # best first (generation.beam)
    joined: bool = False  # `rows` are the joiners, prefilled: the runner holds them for the batch's next regroup
    stepped: bool = False  # the batch's decode step ran the model: its cache is a column wider


@dataclass(frozen=True, slots=True)
class RowOutput:
    """An output for a row, as update_from_output hands it to the engine to tell: whether it is a token the row sampled
    just now (its end-of-text or stop token too: the observer times them), and whether the row ends with it (counted
    before it is told: a client may read the counters as soon as its answer ends)."""

    row: Row
    output: Output
    sampled: bool = False
    ends: bool = False


class PrefixView(Protocol):
    """What the scheduler reads of the prefix cache (prefix_cache.PrefixCache) to plan prefills."""

    block_tokens: int

    def held(self, ids: list[int]) -> int: ...

    def lacks(self, ids: list[int]) -> bool: ...


Estimate = Callable[[int, int, int], "float | None"]  # (rows, new tokens, past) -> ms (Backend.prefill_ms)


class Scheduler:
    """Every decision on the waiting rows (held by `queue`, a RequestQueue the callers' threads put rows in:
    `submit`, `close`) and on the batch (the engine's thread: `schedule`, `update_from_output`, `fail`), whose rows'
    state it keeps. `joins_rows`: the backend's cache takes rows prefilled apart (else batches are static);
    `frees_rows`: a row leaves its cache at no cost (finished rows leave at once); `mixes`: a joiners' chunk runs in
    the decode step's own forward (capabilities.mixes_chunks); `speculative`: a draft decodes lone
    rows; `prefix` and `estimate`: the prefix cache and the backend's prefill times, for the prefix cache's policy;
    `past_rows_apart`: rows on a past run a forward each (capabilities.past_rows_apart), where no estimate is given;
    `mixed_chunk`: where chunks mix, the backend's default chunk (capabilities.mixed_chunk; None: `mixed_chunk_base`,
    capabilities.mixed_chunk_base or MIXED_PREFILL_CHUNK, and a token per row running)."""

    def __init__(self, settings: EngineSettings, n_positions: int, joins_rows: bool = True,
                 speculative: bool = False, clock: Callable[[], float] = time.monotonic,
                 prefix: PrefixView | None = None, estimate: Estimate | None = None, frees_rows: bool = False,
                 mixes: bool = False, past_rows_apart: bool = False, mixed_chunk: int | None = None,
                 mixed_chunk_base: int | None = None):
        self.settings = settings
        self.past_rows_apart = past_rows_apart
        self.joins_rows = joins_rows
        self.frees_rows = frees_rows
        self.mixes = mixes
        self.prefill_chunk = settings.prefill_chunk if settings.prefill_chunk is not None else \
            mixed_chunk if mixes else PREFILL_CHUNK
        self.mixed_chunk_base = mixed_chunk_base or MIXED_PREFILL_CHUNK
        # The prefix cache the runner's prefills read (None: none), and the backend's prefill estimates, where it
        # gives them (capabilities.estimates_prefill): whether a prefill starts from the cache is decided here.
        self.prefix = prefix
        self.estimate = estimate
        self.n_positions = n_positions
        self.joins = settings.continuous and joins_rows and settings.max_batch_size > 1
        self.speculative = speculative
        self.clock = clock
        self.queue = RequestQueue(settings.max_waiting, settings.scheduling_policy == "priority")
        self.running = 0  # rows of the batch in flight that have not finished
        self._peak = 0  # the most rows the batch in flight (or the last) has run at once
        self.in_flight: list[Row] = []  # rows a failure (or Engine.abort) ends: the batch's and the joiners'
        # The engine's thread's: the batch the runner holds, as the plans laid it out (its rows in cache order, None:
        # no batch, and its cache's width), the joiners being prefilled and the columns of their prefill planned, the
        # joiners prefilled (told by the runner, brought in by the batch's next plan), and which half of a step the
        # next plan is.
        self._rows: list[Row] | None = None
        self._width = 0
        self._joiners: list[Row] | None = None
        self._chunked = 0
        self._joined: list[Row] | None = None
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

    # -- the engine's side: the plans, and what they gave

    def schedule(self) -> SchedulerOutput | None:
        """The next step's plan. Blocks while nothing is in flight and no row waits; None once closed
        with none waiting. A batch's step is planned in two halves, each only when it has work: the
        joiners' (rows taken, their prefill's next chunk), then the batch's (regroup, decode step)."""
        while True:
            rows = self._rows
            if rows is None:
                self.set_running(0)
                if not self.wait_for_work():
                    return None
                plan = self._new_batch()
            elif not self._decoding:
                self._decoding = True
                plan = self._joining(rows)
            else:
                self._decoding = False
                plan = self._stepping(rows)
            if plan is not None:
                return plan

    def update_from_output(self, plan: SchedulerOutput, outputs: Iterable[RunnerOutput]) -> Iterator[RowOutput]:
        """What the runner gives for `plan`, applied as it gives it (it runs as this is iterated): the batch's state
        (the joiners prefilled, its cache widened) and each row's (its tokens and end), and the outputs to tell, in
        order: rows ending without running first, a row's prompt logprobs before its end."""
        ending = {new.row: new.reason for new in plan.scheduled_new_reqs if new.start is Start.end}
        for new in plan.scheduled_new_reqs:
            if new.start is Start.end and not new.scored:
                yield _ended(new.row, new.reason)
        for out in outputs:
            for row, entries in out.prompt_logprobs.items():
                yield RowOutput(row, PromptLogprobs(entries))
                if row in ending:
                    yield _ended(row, ending[row])
            for row, hypotheses in out.hypotheses.items():
                yield from _searched(row, hypotheses)
            for event in out.events:
                yield from _sampled(out.rows[event.row], event)
            if out.joined:
                self._joined = list(out.rows)
            if out.stepped:
                self._width += 1

    def fail(self) -> list[Row]:
        """A plan failed: the batch in flight is given up. Its rows and the joiners', to be told."""
        rows, self.in_flight = self.in_flight, []
        self._rows = self._joiners = self._joined = None
        self._decoding = False
        return rows

    def _new_batch(self) -> SchedulerOutput | None:
        """Rows taken from the queue as a new batch, prefilled whole, a large wave in two halves (or one row with the
        draft)."""
        rows = self.take([], None)
        if not rows:
            return None
        self.in_flight = rows
        new, going = self._start(rows)
        if self.speculative and len(going) == 1 and going[0].logprobs is None:
            row = going[0]
            new[row] = NewRow(row, Start.draft, bool(row.prompt_logprobs))
            return SchedulerOutput(tuple(new[r] for r in rows), num_scheduled_tokens={row: len(row.prompt_ids)})
        shared = self._sharing(going)
        first, second = self._halves([r for i, r in enumerate(going) if i not in shared])
        later = second + [going[i] for i in sorted(shared)]
        cached = self._cache_pays(first)
        later_cached = self._cache_pays(later, [0] * len(second) + [shared[i] for i in sorted(shared)])
        for group, start, use in ((first, Start.prefill, cached), (later, Start.after, later_cached)):
            new.update((r, NewRow(r, start, bool(r.prompt_logprobs), use)) for r in group)
        if going:
            self._rows, self._width = first + later, max(len(r.prompt_ids) for r in going)
        return SchedulerOutput(tuple(new[r] for r in rows), num_scheduled_tokens={r: len(r.prompt_ids) for r in going})

    def _joining(self, rows: list[Row]) -> SchedulerOutput | None:
        """The joiners' half of a step: waiting rows taken when a join is due (`join_due`), and the
        next chunk of their prefill (whole when no row runs: there is nobody to stall). Where rows leave at no cost
        (`frees_rows`), the finished rows leave first, in this plan's regroup."""
        if self._joined is not None:  # the joiners' prefill ended with the last decode step: they join in the next
            return None
        live = _live(rows)
        new: tuple[NewRow, ...] = ()
        regroup, left = None, ()
        if self._joiners is None and live and self.joins and self.join_due(len(live)):
            if self.frees_rows and len(live) < len(rows):
                regroup, left, rows = self._compacted(rows, live)
                live = list(range(len(rows)))
            new = self._join(rows, live)
        if self._joiners is None:
            return SchedulerOutput(new, finished_req_ids=left, regroup=regroup) if new or regroup else None
        plan = self._chunk(new, rows, live)
        return plan if regroup is None else replace(plan, finished_req_ids=left, regroup=regroup)

    def _compacted(self, rows: list[Row], live: list[int]) -> tuple[Regroup, tuple[Row, ...], list[Row]]:
        """The batch without its finished rows, before joiners are taken (the runner regroups before it joins): their
        cache is free for the joiners, and the rows holding one never outnumber the batch. The regroup, the rows that
        leave, the rows kept."""
        regroup = self.plan_regroup(rows, live, None)
        rows, left = self._laid_out(regroup, rows, None)
        self.in_flight = list(rows)
        return regroup, left, rows

    def _laid_out(self, regroup: Regroup, rows: list[Row], joined: list[Row] | None) -> tuple[list[Row], tuple[Row, ...]]:
        """The batch (`rows`, then `joined`) as `regroup` lays it out, now this scheduler's, and the rows it leaves."""
        every = rows + (joined or [])
        rows = [every[i] for i in regroup.order]
        kept = set(rows)
        self._rows, self._width = rows, regroup.width
        return rows, tuple(r for r in every if r not in kept)

    def _join(self, rows: list[Row], live: list[int]) -> tuple[NewRow, ...]:
        """Waiting rows taken to join the batch (its `live` rows running): those that go on are its joiners. Where a
        chunk runs in the decode step's forward (`mixes`), a prompt longer than a chunk joins alone: the mixed step
        runs one joiner's chunk, and the others' would each run a forward of their own in every step. But a wave
        (`_wave`) joins together, whole, as on any cache: one at a time, the fifteen requests that arrive while a first
        one's prefill runs had taken thirty steps to join (docs/serving/index.md#chunked-prefill)."""
        running = [rows[i] for i in live]
        alone = self.mixes and not self._wave(len(live))
        taken = self.take(running, _used(running), (self.chunk_tokens(len(live)) or None) if alone else None)
        if not taken:
            return ()
        new, going = self._start(taken)
        self.in_flight = rows + taken
        self._joiners, self._chunked = going or None, 0
        cached = self._cache_pays(going) if going else True
        new.update((r, NewRow(r, Start.prefill, bool(r.prompt_logprobs), cached)) for r in going)
        return tuple(new[r] for r in taken)

    def _wave(self, running: int) -> bool:
        """Whether the waiting rows join `running` rows together, whole (a wave): where they outnumber them, but where
        the first prompt waiting is long (over PREFILL_CHUNK tokens) only where they are more than twice them and one.
        Each joiner then saves more waiting than the rows running lose to one stall, and two 545-token prompts no longer
        stop a lone row for their whole prefill (1.4 s on an AMD EPYC with AVX2: docs/results/serving.md)."""
        waiting = len(self.queue)
        first = self.queue.oldest()
        long = first is not None and len(first.prompt_ids) > PREFILL_CHUNK
        return waiting > (2 * running + 1 if long else running)

    def _chunk(self, new: tuple[NewRow, ...], rows: list[Row], live: list[int]) -> SchedulerOutput:
        """The joiners' prefill's next chunk (`new`: the rows just taken, the joiners among them)."""
        joiners = self._joiners
        if not new:
            self.in_flight = rows + joiners
        # Chunks spare the rows running a whole prefill's wait for their next token, at the joiners' first tokens'
        # cost: worth it while those rows are as many as the joiners, not for a wave of requests joining a row or two
        # (docs/serving/index.md#chunked-prefill). Where a chunk runs in a decode step's forward (`mixes`), a lone
        # joiner is chunked there, whatever the rows running, and several (each within a chunk: `_join`) run whole
        # in one forward, the chunks of several each being a forward of their own.
        beside = bool(live) and (len(joiners) == 1 if self.mixes else len(joiners) <= len(live))
        # the columns this chunk runs: prefill_chunk tokens (or what the rows running leave of the step's budget) shared
        # by the distinct prompts, at least one column each
        left = max(len(r.prompt_ids) for r in joiners) - self._chunked
        chunk = self.chunk_tokens(len(live)) if beside else 0
        cols = min(left, max(1, chunk // len({tuple(r.prompt_ids) for r in joiners}))) if chunk else left
        self._chunked += cols
        return SchedulerOutput(new, () if new else tuple(joiners), dict.fromkeys(joiners, cols))

    def chunk_rule(self) -> tuple[int, int]:
        """(tokens, per_row): a joiners' chunk beside `running` rows is tokens + per_row * running: prefill_chunk
        (per_row 0; 0 tokens: whole), mixed_chunk_base and one per row (where chunks mix and prefill_chunk is None), or
        what the rows leave of max_num_batched_tokens (per_row -1). /health reports it."""
        budget = self.settings.max_num_batched_tokens
        if budget is not None:
            return budget, -1
        return (self.mixed_chunk_base, 1) if self.prefill_chunk is None else (self.prefill_chunk, 0)

    def chunk_tokens(self, running: int) -> int:
        """A joiners' chunk beside `running` rows (chunk_rule), at least one token where a budget sets it."""
        tokens, per_row = self.chunk_rule()
        return max(1, tokens - running) if per_row < 0 else tokens + per_row * running

    def _stepping(self, rows: list[Row]) -> SchedulerOutput | None:
        """The batch's half of a step: the joiners whose prefill has ended brought in, or half the
        batch finished compacted away (`regroup_due`), then a decode step while a row runs."""
        live = _live(rows)
        joined, self._joined = self._joined, None
        if joined is not None:
            self._joiners = None
        if not live and joined is None:  # (a prefill under way ran whole, so ended by now)
            self._rows = None
            self.in_flight = []
            return SchedulerOutput(finished_req_ids=tuple(rows))
        regroup = None
        if self.regroup_due(len(live), len(rows), joined is not None):
            regroup = self.plan_regroup(rows, live, joined)
        left: tuple[Row, ...] = tuple(joined or ())  # joiners that ended at their first token are dropped
        if regroup is not None:
            rows, left = self._laid_out(regroup, rows, joined)
        elif not live:
            return None  # every joiner ended at its first token
        self.in_flight = rows + (self._joiners or [])
        self.set_running(sum(not r.finished for r in self.in_flight))
        decoding = tuple(r for r in rows if not r.finished)
        return SchedulerOutput(scheduled_cached_reqs=decoding, num_scheduled_tokens=dict.fromkeys(decoding, 1),
                               finished_req_ids=left, regroup=regroup)

    def _start(self, rows: list[Row]) -> tuple[dict[Row, NewRow], list[Row]]:
        """How rows just taken start, where it is not their prefill, and those that go on to be prefilled. Rows
        cancelled since they were taken end; beam searches run whole; rows with no token to generate end once
        scored (those that ask are scored before their prefill)."""
        new, going = {}, []
        now = self.clock()
        for row in rows:
            row.scheduled_at = now
            if row.cancelled is not None:
                new[row] = NewRow(row, Start.end, reason=Finish.cancelled)
            elif row.beam_rows is not None:
                new[row] = NewRow(row, Start.search)
            elif row.remaining <= 0:
                new[row] = NewRow(row, Start.end, bool(row.prompt_logprobs), reason=Finish.length)
            else:
                going.append(row)
        return new, going

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

    def _halves(self, rows: list[Row]) -> tuple[list[Row], list[Row]]:
        """A new batch's rows as the two halves it is prefilled in (HALVES_FROM; the second empty below it, or where
        the backend's cache copies to merge them): the first rows up to half its prompt tokens, then the rest."""
        tokens = np.cumsum([len(r.prompt_ids) for r in rows])
        if not (self.joins_rows and self.frees_rows) or len(rows) < 2 or tokens[-1] < HALVES_FROM:
            return rows, []
        half = min(int(np.searchsorted(tokens, tokens[-1] / 2)) + 1, len(rows) - 1)
        return rows[:half], rows[half:]

    def _cache_pays(self, rows: list[Row], shared: list[int] | None = None) -> bool:
        """Whether prefilling the rows' prompts' rests on the prefix cache's blocks is estimated sooner than prefilling
        them whole (the prompts the runner runs: each distinct one once where the backend's cache joins rows). A
        backend may run a fresh prompt on a faster runtime than a prompt with a past (the OpenVINO prefill: 15 rows of
        16 tokens on a cached 16 took 250 ms, the same rows of 32 fresh 140; docs/serving/index.md#prefix-caching).
        Where the backend gives no estimate: yes, but where it runs rows on a past a forward each (`past_rows_apart`),
        where those forwards cost more than the prompts fresh in one (FORWARD_TOKENS). `shared`: tokens each row will
        find held once an earlier prefill of its batch has run (Start.after's)."""
        if self.prefix is None or not rows or (self.estimate is None and not self.past_rows_apart):
            return True
        prompts = [r.prompt_ids for r in rows]
        held = [max(self.prefix.held(p), s) for p, s in zip(prompts, shared or [0] * len(rows))]
        if self.joins_rows:  # identical prompts run once
            distinct = {tuple(p): h for p, h in zip(prompts, held)}
            prompts, held = [list(p) for p in distinct], list(distinct.values())
        if not any(held):
            return True
        n = len(prompts)
        if self.estimate is not None:
            with_cache = self.estimate(n, max(len(p) - h for p, h in zip(prompts, held)), max(held))
            whole = self.estimate(n, max(len(p) for p in prompts), 0)
            if with_cache is not None and whole is not None:
                return with_cache <= whole
        return not self.past_rows_apart or _apart_pays(prompts, held)

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

    def take(self, rows: list[Row], width: int | None, tokens: int | None = None) -> list[Row]:
        """Waiting rows (in arrival order, or by priority with the priority policy) that fit beside
        `rows`, a batch whose cache can be made `width` wide (None: a new batch); where `tokens` is given, a prompt
        longer than that is taken alone (first, or not at all). Stops at the first
        that does not fit, so no request is overtaken forever (by one of its own priority)."""
        def fits(taken: list[Row], candidate: Row) -> bool:
            if tokens is not None and taken and max(len(taken[0].prompt_ids), len(candidate.prompt_ids)) > tokens:
                return False
            return self._fits(rows, taken + [candidate], width)

        taken = self.queue.take(fits, self.settings.max_batch_size - len(rows))
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
            lag = self.prefill_steps(joiners, len(_live(rows))) - 1
            new_width = max(width + lag, new_width)
        need = max([r.remaining - lag for r in rows if not r.finished] + [r.remaining - 1 for r in joiners])
        return new_width + need <= self.n_positions

    def prefill_steps(self, joiners: list[Row], running: int) -> int:
        """The steps that prefilling `joiners` beside a batch of `running` rows takes at most (chunks of
        chunk_tokens shared by its distinct prompts, at least a column each; fewer when the prefix cache
        holds some of them, or rows end meanwhile)."""
        chunk = self.chunk_tokens(running)
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
        whole cache, so rows do not leave one by one); where rows leave at no cost (`frees_rows`), a row has."""
        return joining or (live < rows if self.frees_rows else 2 * live <= rows)

    def plan_regroup(self, rows: list[Row], live: list[int], joined: list[Row] | None) -> Regroup | None:
        """The batch (`rows`, `live` of them running) with its finished rows gone and the joined rows still running
        in (`layout`, `merged_width`); None to keep it as it is: when every joiner ended at its first token and
        less than half of the batch has finished, or when no row is left to decode."""
        jlive = [] if joined is None else _live(joined)
        if joined is not None and not jlive and 2 * len(live) > len(rows):
            return None
        if not live and not jlive:
            return None
        n = len(rows)
        order = layout(live, n, [n + j for j in jlive])
        kept, joining = [rows[i] for i in live], [joined[j] for j in jlive]
        need = max(r.remaining for r in kept + joining)
        return Regroup(order, merged_width(self._width, _used(kept), _used(joining), need, self.n_positions))


def _apart_pays(prompts: list[list[int]], held: list[int]) -> bool:
    """Whether the prompts' rests on their `held` tokens, a forward each, cost no more than the prompts fresh in one
    (FORWARD_TOKENS a forward)."""
    apart = sum(len(p) - h + FORWARD_TOKENS for p, h in zip(prompts, held))
    return len(prompts) == 1 or apart <= sum(len(p) for p in prompts) + FORWARD_TOKENS


def _live(rows: list[Row]) -> list[int]:
    return [i for i, r in enumerate(rows) if not r.finished]


def _used(rows: list[Row]) -> int:
    """The columns running rows use in their cache, from the first any of them uses to the end (0: none): a row's
    prompt and every token it has sampled but the last, not yet fed (vLLM's num_computed_tokens); a cache's rows
    are right-aligned, and a decode step adds a column to every row."""
    return max((len(r.prompt_ids) + len(r.tokens) - 1 for r in rows), default=0)


def _ended(row: Row, reason: Finish) -> RowOutput:
    row.finish = reason
    return RowOutput(row, Finished(reason), ends=True)


def _sampled(row: Row, event: Event) -> Iterator[RowOutput]:
    """A row's event of a model step as its callback hears it: the token (with its logprobs), then its end."""
    sampled = event.token is not None or event.finish in _SAMPLED_ENDS
    if event.token is not None:
        yield RowOutput(row, TokenOut(event.token, event.logprob, event.finish), sampled, event.finish is not None)
    alone = event.token is None  # an end with no token before it carries the marks
    if event.finish is Finish.failed:  # this row alone: the others of its batch go on
        yield RowOutput(row, Failed(row.error or "generation failed", client=True), ends=True)
    elif event.finish is not None:  # the logprobs of the end-of-text or stop token, which is not kept
        yield RowOutput(row, Finished(event.finish, event.logprob if alone else None), sampled and alone, alone)


def _searched(row: Row, hypotheses: list[tuple[list[int], Finish]]) -> Iterator[RowOutput]:
    """A beam search's best hypotheses, each told to one of its beam_rows: its tokens and its end (counted before its
    tokens: its answer may end with the last)."""
    for target, (tokens, finish) in zip(row.beam_rows, hypotheses):
        for i, token in enumerate(tokens):
            target.tokens.append(token)
            last = finish if i == len(tokens) - 1 and finish is not Finish.eos else None
            if last is not None:
                target.finish = last  # its last token, told as such
            yield RowOutput(target, TokenOut(token, None, last), ends=i == 0)
        target.finish = finish
        yield RowOutput(target, Finished(finish), ends=not tokens)
    for target in row.beam_rows[len(hypotheses):]:  # fewer hypotheses than asked (none finished)
        yield _ended(target, Finish.length)


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
