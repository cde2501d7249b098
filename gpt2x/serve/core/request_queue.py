"""The rows waiting for the engine, apart from every decision on them (scheduler.py decides): bounded, in arrival
order or by priority, shared by the callers' threads (`put`, `close`) and the engine's (`wait`, `fill`, `take`) under
its own lock. Rows whose clients left while they waited leave it at once, freeing their places."""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable

from .request import Row


class QueueFull(RuntimeError):
    """The waiting queue is at its bound: the request is refused, not queued."""


class EngineClosed(RuntimeError):
    """The engine is shutting down and takes no more requests."""


class RequestQueue:
    """The waiting rows: at most `max_waiting` beyond the places free in the batch (`put`'s `free`), and by priority
    (lower first, arrival order among equals) with `priority`."""

    def __init__(self, max_waiting: int, priority: bool = False):
        self.max_waiting = max_waiting
        self.priority = priority
        self._rows: deque[Row] = deque()
        self._cond = threading.Condition()
        self._closed = False
        self.arrived = 0.0  # time.monotonic() of the last put
        self.burst = 0  # puts since the queue was last empty

    def put(self, rows: list[Row], free: int) -> None:
        """Queue rows, all or none (QueueFull past the bound, EngineClosed once closed)."""
        with self._cond:
            if self._closed:
                raise EngineClosed("the server is shutting down")
            self._purge()
            if len(self._rows) + len(rows) > self.max_waiting + free:
                raise QueueFull(f"{len(self._rows)} requests are waiting (the limit is {self.max_waiting})")
            if not self._rows:
                self.burst = 0
            self._rows.extend(rows)
            self.burst += 1
            self.arrived = time.monotonic()
            if self.priority:  # a stable sort: arrival order among equals
                self._rows = deque(sorted(self._rows, key=lambda r: r.priority))
            self._cond.notify()

    def close(self) -> list[Row]:
        """Take no more rows; the rows still waiting, which will not run."""
        with self._cond:
            self._closed = True
            left = list(self._rows)
            self._rows.clear()
            self._cond.notify_all()
        return left

    @property
    def closed(self) -> bool:
        return self._closed

    def __len__(self) -> int:
        """Rows waiting, those whose clients left not counted."""
        with self._cond:
            self._purge()
            return len(self._rows)

    def oldest(self) -> Row | None:
        """The row first in line (None: none waits)."""
        with self._cond:
            return self._rows[0] if self._rows else None

    def _purge(self) -> None:
        """Rows cancelled while they waited leave (under the lock)."""
        if any(r.cancelled is not None for r in self._rows):
            self._rows = deque(r for r in self._rows if r.cancelled is None)

    def wait(self) -> bool:
        """Block until rows wait (True) or the queue is closed with none waiting (False)."""
        with self._cond:
            while not self._rows and not self._closed:
                self._cond.wait()
            return bool(self._rows)

    def fill(self, count: int, until: Callable[[], float]) -> None:
        """Block while fewer than `count` rows wait and the queue is open, until time.monotonic() reaches `until()`
        (read again after each put: it may depend on `arrived`)."""
        with self._cond:
            while len(self._rows) < count and not self._closed:
                left = until() - time.monotonic()
                if left <= 0:
                    return
                self._cond.wait(left)

    def take(self, fits: Callable[[list[Row], Row], bool], most: int) -> list[Row]:
        """Rows from the head of the line while each `fits(taken so far, it)`, at most `most`; stops at the first that
        does not fit, so no row is overtaken forever (by one of its own priority)."""
        taken: list[Row] = []
        with self._cond:
            while self._rows and len(taken) < most:
                candidate = self._rows[0]
                if candidate.cancelled is not None:
                    self._rows.popleft()
                    continue
                if not fits(taken, candidate):
                    break
                taken.append(self._rows.popleft())
        return taken
