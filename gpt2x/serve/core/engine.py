"""One server replica's engine: one thread owns the backend and serves every request in flight as one
batch. It only loops: the scheduler (scheduler.py) plans each step, the runner (runner.py) executes
the plan, the scheduler applies what it gave, and the engine tells each row's callback the outputs
that come of it. How it batches, joins, chunks and caches: docs/serving/index.md."""

from __future__ import annotations

import logging
import threading
import time
from pathlib import Path
from typing import Protocol

from ...errors import UsageError
from ...generation.logprobs import LogprobEntry
from ...generation.settings import Finish
from ...generation.speculative import Drafter, DraftSettings
from ...runtime.base import Backend
from .outputs import Failed, Output, Sink, TokenOut
from .prefix_cache import BLOCK_TOKENS, PrefixCache
from .prefix_disk import BlockIdentity, DiskBlocks
from .request import Row
from .request_queue import EngineClosed, QueueFull
from .runner import Runner
from .scheduler import EngineSettings, RowOutput, Scheduler

__all__ = ["Engine", "EngineClosed", "EngineSettings", "LogprobEntry", "Observer", "QueueFull", "Row", "Sink",
           "refuse_batched_draft"]

log = logging.getLogger(__name__)

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
                 draft_settings: DraftSettings | None = None, blocks: BlockIdentity | None = None):
        settings = settings or EngineSettings()
        if drafter is not None:
            refuse_batched_draft(settings.max_batch_size)
        self.backend = backend
        self.settings = settings
        self.drafter = drafter  # speculative decoding, one row at a time (see the module's docstring)
        self.counters = {"rows": 0, "tokens": 0, "batches": 0, "steps": 0, "joins": 0, "compactions": 0, "errors": 0}
        if drafter is not None:
            self.counters.update(drafted=0, accepted=0, drafts=0)
        # Prefix caching needs a backend that steps from a cache made elsewhere (its blocks): not
        # onnxruntime-genai, whose generator owns its cache.
        disk = self._disk(settings, blocks)
        self.prefix_cache = PrefixCache(int(settings.prefix_cache_mb * 2**20), disk=disk) \
            if settings.prefix_cache_mb and backend.capabilities.takes_past else None
        estimate = backend.prefill_ms if backend.capabilities.estimates_prefill else None
        self.scheduler = Scheduler(settings, backend.n_positions, backend.capabilities.joins_rows, drafter is not None,
                                   prefix=self.prefix_cache, estimate=estimate,
                                   frees_rows=backend.capabilities.frees_rows,
                                   mixes=backend.capabilities.mixes_chunks, mixed_chunk=backend.capabilities.mixed_chunk,
                                   mixed_chunk_base=backend.capabilities.mixed_chunk_base,
                                   past_rows_apart=backend.capabilities.past_rows_apart)
        self.runner = Runner(backend, self.counters, drafter, draft_settings, self.prefix_cache, self._iteration)
        self._thread = threading.Thread(target=self._loop, name="gpt2x-engine", daemon=True)
        self.observer: Observer | None = None  # told each token as it is told (openai/metrics.py)
        self.kv_positions = 0  # positions the batch in flight's cache holds (rows x width), after its last step

    def _disk(self, settings: EngineSettings, blocks: BlockIdentity | None) -> DiskBlocks | None:
        """The prefix cache's disk tier, where settings.prefix_cache_dir asks for it: `blocks` says what the export's
        blocks depend on (the replica's, from its export)."""
        if settings.prefix_cache_dir is None:
            return None
        if not self.backend.capabilities.takes_past:  # asked for, and nothing would be kept: refused, not ignored
            raise UsageError(f"prefix_cache_dir: the {self.backend.name} backend keeps its own cache, which no prefix "
                             "cache can fill", option="prefix_cache_dir")
        if blocks is None:
            raise UsageError("prefix_cache_dir needs the export's identity, which its blocks are kept under "
                             "(the replica gives it)", option="prefix_cache_dir")
        return DiskBlocks(Path(settings.prefix_cache_dir), blocks, int(settings.prefix_cache_disk_mb * 2**20), BLOCK_TOKENS)

    # -- the callers' side (any thread)

    def start(self) -> Engine:
        self._thread.start()
        return self

    def submit(self, rows: list[Row]) -> None:
        """Queue rows, all or none. Each row's prompt and budget must fit the context together."""
        self.scheduler.submit(rows)

    @property
    def joins(self) -> bool:
        """Whether rows join a running batch (continuous batching on a backend whose cache takes them)."""
        return self.scheduler.joins

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
            disk = self.prefix_cache.disk
            if disk is not None:  # blocks read back from disk, files skipped as not checking out, writes dropped
                stats.update(prefix_cache_disk_reads=disk.loaded, prefix_cache_disk_errors=disk.errors,
                             prefix_cache_disk_dropped=disk.dropped, prefix_cache_disk_mb=disk.bytes / 2**20)
        return stats

    def close(self, timeout: float = 10.0) -> bool:
        """Refuse new rows, let the thread finish the batch in flight (rows still waiting are told the
        server is shutting down), and join it. True once the thread has stopped; False, with a warning
        in the log, when it is still running after `timeout` seconds (a step that does not return):
        the backend is then left open, for the thread still uses it."""
        for row in self.scheduler.close():
            self._tell(row, Failed("the server is shutting down"))
        if self._thread.is_alive():
            self._thread.join(timeout)
        if self.prefix_cache is not None and not self._thread.is_alive():
            self.prefix_cache.close()  # the blocks still being copied, kept (and so written to disk below)
        if self.prefix_cache is not None and self.prefix_cache.disk is not None:  # the blocks handed over, written
            self.prefix_cache.disk.flush(timeout)
        if self._thread.is_alive():
            log.warning("the engine's thread did not stop within %.0f s (a step is still running); left running", timeout)
            return False
        return True

    def stop(self, grace: float, message: str = "the server is shutting down") -> bool:
        """A server's stop: new rows refused, rows still waiting told `message` at once, the batch in
        flight given `grace` seconds to finish, then what is left of it ended with `message` (`abort`),
        and the thread joined (`close`). True once the thread has stopped."""
        for row in self.scheduler.close():
            self._tell(row, Failed(message))
        self._thread.join(grace)
        if self._thread.is_alive():
            self.abort(message)
        return self.close()

    def abort(self, message: str) -> int:
        """End every row of the batch in flight that has not finished with an error (`message`), from
        any thread: each is cancelled (it leaves the batch before the next step), its callback told
        Failed(message) and then nothing more (not the Finished of its cancel). Returns how many rows
        it ended."""
        ended = 0
        for row in list(self.scheduler.in_flight):
            if not row.finished and row.cancelled is None:
                tell, row.sink = row.sink, _told_nothing
                row.cancel()
                try:
                    tell(Failed(message))
                except Exception:  # its client is gone: nothing to tell
                    log.exception("a row's callback failed")
                ended += 1
        return ended

    # -- the engine thread

    def _loop(self) -> None:
        while (plan := self.scheduler.schedule()) is not None:
            try:
                for told in self.scheduler.update_from_output(plan, self.runner.execute(plan)):
                    self._tell_out(told)
            except Exception as e:  # the batch fails; the engine and the other batches go on
                log.exception("a batch failed")
                self.counters["errors"] += 1
                self.runner.reset()
                for row in self.scheduler.fail():
                    if not row.finished:
                        row.finish = Finish.cancelled
                        self._tell(row, Failed(f"generation failed: {e}"))

    def _iteration(self, tokens: int, positions: int) -> None:
        """The runner ran a model step of `tokens` tokens over a cache of `positions` (rows x width)."""
        self.kv_positions = positions
        if self.observer is not None:
            self.observer.iteration(tokens)

    def _tell_out(self, told: RowOutput) -> None:
        """An output for a row, told: the observer hears a token sampled, and a row's end is counted, first."""
        row = told.row
        if told.sampled and self.observer is not None:
            self.observer.token(row, time.monotonic())
        if told.ends:
            self.counters["rows"] += 1
            if self.observer is not None:
                self.observer.finished(row, time.monotonic())
        if isinstance(told.output, TokenOut):
            self.counters["tokens"] += 1
        self._tell(row, told.output)

    def _tell(self, row: Row, out: Output) -> None:
        try:
            row.sink(out)
        except Exception:  # a callback that fails (its client is gone) cancels its row, nothing more
            log.exception("a row's callback failed; cancelling the row")
            row.cancel()


def _told_nothing(out: Output) -> None:
    """The callback of a row that was told its end already (Engine.abort)."""

