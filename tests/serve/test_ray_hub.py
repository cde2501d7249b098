"""gpt2x/serve/ray/hub.py: the metrics hub, as a plain object on a clock the test moves (no Ray instance):
when a stop is drained; and a replica's reporting loop (deploy._Replica._report) on a fake replica: when it reports.
The replicas' side is tested on a cluster in test_ray.py."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from gpt2x.serve.ray import deploy, hub
from gpt2x.serve.ray.hub import IDLE_REPORT_S, REPORT_S, SILENT_S, Hub


@pytest.fixture
def clock(monkeypatch):
    now = [100.0]
    monkeypatch.setattr(hub.time, "monotonic", lambda: now[0])
    return now


def test_a_stop_waits_for_every_replica_that_still_reports_and_not_for_one_that_went_silent(clock):
    h = Hub()
    h.report("a", {"drained": False})
    h.report("b", {"drained": False})  # b is then killed: it never reports again
    clock[0] += REPORT_S
    h.stop(3.0)
    assert not h.drained()
    clock[0] += REPORT_S
    assert h.report("a", {"drained": False}) == pytest.approx(3.0 - REPORT_S)  # a hears of the stop
    clock[0] += REPORT_S
    h.report("a", {"drained": True})
    assert not h.drained()  # b may still be on its way
    clock[0] = 100.0 + SILENT_S - 0.01
    assert not h.drained()
    clock[0] += 0.02
    assert h.drained()  # b said nothing for SILENT_S since its last report: gone


def test_a_replica_silent_for_long_before_the_stop_is_not_waited_for(clock):
    """Killed seconds before the stop (its snapshot still counted in the metrics): the stop does not wait SILENT_S
    more for it."""
    h = Hub()
    h.report("b", {"drained": False})
    clock[0] += SILENT_S + REPORT_S
    h.report("a", {"drained": True})
    h.stop(3.0)
    assert h.drained()


def test_a_replica_that_reported_since_the_stop_is_waited_for_until_it_has_drained(clock):
    h = Hub()
    h.report("a", {"drained": False})
    h.stop(3.0)
    clock[0] += REPORT_S
    h.report("a", {"drained": False})  # still finishing its requests
    clock[0] += 2 * SILENT_S
    assert not h.drained()
    h.report("a", {"drained": True})
    assert h.drained()


def test_without_a_stop_drained_means_every_recent_replica_has_drained(clock):
    h = Hub()
    h.report("a", {"drained": True})
    h.report("b", {"drained": False})
    assert not h.drained()
    h.report("b", {"drained": True})
    assert h.drained()


def test_a_replica_reports_a_change_at_its_next_tick_and_unchanged_values_every_idle_report_s(monkeypatch):
    """Ticks of REPORT_S on a fake clock; the snapshot's values change at ticks 6 and 7 (its `at` changes at each): it is
    reported at the first tick, at each change, and otherwise once IDLE_REPORT_S has passed since the last report."""
    assert SILENT_S > IDLE_REPORT_S > REPORT_S  # a live idle replica is never taken for gone during a stop
    now = [0.0]
    ticks = round(3.0 / REPORT_S)
    monkeypatch.setattr(deploy.time, "monotonic", lambda: now[0])

    class Closing:
        def wait(self, seconds):
            now[0] += seconds
            return now[0] > ticks * REPORT_S

    def snapshot():
        tick = round(now[0] / REPORT_S)
        return {"at": now[0], "drained": False, "counters": {"generation_tokens": 0 if tick < 6 else 4 if tick < 7 else 9}}

    reported = []
    replica = SimpleNamespace(_closing=Closing(), http=SimpleNamespace(metrics=SimpleNamespace(snapshot=snapshot, drained=False)),
                              exchange=SimpleNamespace(report=lambda snap: reported.append(round(snap["at"] / REPORT_S))))
    deploy._Replica._report(replica)
    idle = round(IDLE_REPORT_S / REPORT_S)
    assert reported == [1, 1 + idle, 6, 7, 7 + idle]
