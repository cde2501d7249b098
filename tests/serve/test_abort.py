"""Abandoned requests: a client that gives up, streamed or not, frees its rows at the engine's next
step and its places in the queue at once, and /metrics counts its choices as aborted (vLLM's
request_success_total{finished_reason="abort"}). Under load, through a real HTTP server (uvicorn in
this process) and clients that give up, their connections closed as a load generator's timeout closes them."""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from gpt2x.generation.settings import SamplingSettings
from gpt2x.onnx.artifact import read_export
from gpt2x.runtime.ort import OrtBackend
from gpt2x.serve.core.engine import EngineSettings
from gpt2x.serve.core.request import Row
from gpt2x.serve.core.request_queue import QueueFull
from gpt2x.serve.core.scheduler import Scheduler
from gpt2x.serve.openai.routes import local_app
from gpt2x.serve.openai.service import CompletionService

from ..helpers import uvicorn_server

BURST = 24  # abandoned requests: 18 whole, 6 streamed
LONG = 250  # tokens each asks for (ignore_eos: every one runs to its budget unless aborted)
GIVE_UP_S = 0.3  # the burst's clients give up no sooner (and not before the server holds every request)


@pytest.fixture(scope="module")
def served(export_dir):
    backend = OrtBackend(read_export(export_dir), threads=1)
    service = CompletionService(backend, EngineSettings(max_batch_size=2, max_waiting=64), "shakespeare")
    with uvicorn_server(local_app(service)) as port:
        yield f"http://127.0.0.1:{port}", service
    service.close()


def success(base: str) -> dict[str, float]:
    text = httpx.get(f"{base}/metrics").text
    out = {}
    for family in text_string_to_metric_families(text):
        if family.name == "gpt2x:request_success":
            out = {s.labels["finished_reason"]: s.value for s in family.samples if s.name.endswith("_total")}
    return out


async def ask(base: str, i: int) -> str:
    """A long request, streamed or not, read to its end unless the client gives up (its task is cancelled: the
    connection closes, as at a client's timeout)."""
    body = {"prompt": f"ROMEO {i}:", "max_tokens": LONG, "temperature": 1.0, "seed": i, "ignore_eos": True,
            "stream": i % 4 == 0}
    async with httpx.AsyncClient(timeout=60) as client:
        if body["stream"]:
            async with client.stream("POST", f"{base}/v1/completions", json=body) as r:
                async for _ in r.aiter_lines():
                    pass
        else:
            await client.post(f"{base}/v1/completions", json=body)
    return "answered"


async def abandon_all(base: str, service) -> list[str]:
    """BURST clients that give up together, once the server holds every one's request (a client that gave up before
    its request arrived would have sent none, which a loaded machine made happen), and at least GIVE_UP_S after they
    began: "gave up" or "answered" each."""
    began = time.monotonic()
    tasks = [asyncio.create_task(ask(base, i)) for i in range(BURST)]
    while time.monotonic() - began < 30:
        stats = service.engine.stats()
        if stats["running"] + stats["waiting"] >= BURST - sum(t.done() for t in tasks) and time.monotonic() - began >= GIVE_UP_S:
            break
        await asyncio.sleep(0.01)
    for t in tasks:
        t.cancel()
    results = await asyncio.gather(*tasks, return_exceptions=True)
    return ["gave up" if isinstance(r, asyncio.CancelledError) else r for r in results]


def test_a_burst_of_abandoned_requests_is_cancelled_and_a_short_one_is_served_at_once(served):
    base, service = served
    before, tokens_before = success(base), service.engine.stats()["tokens"]

    outcomes = asyncio.run(abandon_all(base, service))
    assert outcomes.count("gave up") >= BURST - 2  # 2 rows run at once: at most those could have finished
    started = time.monotonic()
    r = httpx.post(f"{base}/v1/completions", json={"prompt": "JULIET:", "max_tokens": 10, "temperature": 0}, timeout=30)
    waited = time.monotonic() - started
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 10
    # Not cancelled, the burst is 24 x 250 tokens at 2 rows a step: tens of seconds on this machine.
    assert waited < 3.0, f"the short request waited {waited:.1f} s behind abandoned ones"
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        stats = service.engine.stats()
        after = success(base)
        moved = {k: after.get(k, 0) - before.get(k, 0) for k in ("stop", "length", "abort")}
        if stats["running"] == 0 and stats["waiting"] == 0 and sum(moved.values()) == BURST + 1:
            break
        time.sleep(0.05)
    assert stats["running"] == 0 and stats["waiting"] == 0
    assert sum(moved.values()) == BURST + 1  # every choice counted once, the short one a "length"
    assert moved["abort"] == outcomes.count("gave up") and moved["abort"] >= BURST - 2
    assert stats["tokens"] - tokens_before < BURST * LONG / 4  # the rows stopped long before their budgets


def test_rows_cancelled_while_waiting_free_their_places_at_once():
    scheduler = Scheduler(EngineSettings(max_batch_size=1, max_waiting=2), 256)

    def row() -> Row:
        return Row([1, 2, 3], SamplingSettings(max_new_tokens=4), lambda out: None)

    rows = [row() for _ in range(3)]  # 2 waiting + 1 free place in the batch
    scheduler.submit(rows)
    with pytest.raises(QueueFull):
        scheduler.submit([row()])
    rows[0].cancel()
    rows[2].cancel()
    assert scheduler.counts() == (0, 1)
    scheduler.submit([row(), row()])
    assert scheduler.counts() == (0, 3)
    assert scheduler.take([], None)[0] is rows[1]  # the cancelled are gone, the order kept
