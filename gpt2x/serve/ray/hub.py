"""The hub of an application on Ray Serve (of a model, with several): a small actor that each replica hands its
metrics' snapshot to (every REPORT_S where it changed, else every IDLE_REPORT_S), and that carries the stop
(deploy.py says how both are used). It lives apart from deploy.py so that its actor's process imports Ray and this
module alone, not the serving stack (the ONNX Runtime, FastAPI and pydantic of a replica, which a hub never runs)."""

from __future__ import annotations

import time

import ray

HUB_NAMESPACE = "gpt2x"
REPORT_S = 0.25  # how often a replica hands the hub its snapshot where it changed (and hears of a stop)
IDLE_REPORT_S = 1.0  # and at least this often where it did not: an idle replica's calls only cost both processes CPU
STALE_S = 10.0  # a replica whose last snapshot is older than this is gone (the drain stops waiting for it)
SILENT_S = 10 * REPORT_S  # during a stop, a replica that has not reported for this long is taken for gone (> IDLE_REPORT_S)


class Hub:
    """One per application: each replica's last metrics snapshot (kept when a replica dies: counters
    do not go down), and the stop (when it began, and for how long requests in flight may run).
    MetricsHub is this class as a Ray actor."""

    def __init__(self) -> None:
        self.snapshots: dict[str, tuple[float, dict]] = {}  # replica -> (when the hub received it, snapshot)
        self.stop_at: float | None = None
        self.stop_began: float | None = None

    def report(self, replica: str, snapshot: dict) -> float | None:
        """A replica's snapshot; the answer: None, or the seconds its requests in flight have left (a stop)."""
        self.snapshots[replica] = (time.monotonic(), snapshot)
        return None if self.stop_at is None else max(0.0, self.stop_at - time.monotonic())

    def exchange(self, replica: str, snapshot: dict) -> list[dict]:
        """A replica's snapshot in, every replica's out, each with its `age` in seconds (on the hub's clock)."""
        self.report(replica, snapshot)
        now = time.monotonic()
        return [{**snap, "age": now - received} for received, snap in self.snapshots.values()]

    def stop(self, grace: float) -> None:
        if self.stop_at is None:
            self.stop_began = time.monotonic()
            self.stop_at = self.stop_began + grace

    def drained(self) -> bool:
        """Every replica that reported lately has stopped its engine. A live replica reports every
        REPORT_S, so one that has not reported since the stop began and not for SILENT_S is gone (a
        replica killed before), not draining: the stop does not wait for it (from its last report: one
        killed seconds before the stop is not waited for at all)."""
        now = time.monotonic()
        began = self.stop_began if self.stop_began is not None else now
        return all(snap["drained"] for received, snap in self.snapshots.values()
                   if now - received < STALE_S and (received >= began or now - received < SILENT_S))


MetricsHub = ray.remote(num_cpus=0)(Hub)
