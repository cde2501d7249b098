"""Abandoned requests: a client that gives up, streamed or not, frees its rows at the engine's next
step and its places in the queue at once, and /metrics counts its choices as aborted (vLLM's
request_success_total{finished_reason="abort"}). Under load, through a real HTTP server (uvicorn in
this process) and clients that time out, as a load generator's do."""

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
GIVE_UP_S = 0.3


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


async def abandon(base: str, i: int) -> str:
    body = {"prompt": f"ROMEO {i}:", "max_tokens": LONG, "temperature": 1.0, "seed": i, "ignore_eos": True,
            "stream": i % 4 == 0}
    async with httpx.AsyncClient(timeout=GIVE_UP_S) as client:
        try:
            if body["stream"]:
                async with client.stream("POST", f"{base}/v1/completions", json=body) as r:
                    async for _ in r.aiter_lines():
                        pass
            else:
                await client.post(f"{base}/v1/completions", json=body)
        except httpx.TimeoutException:
            return "gave up"
    return "answered"


def test_a_burst_of_abandoned_requests_is_cancelled_and_a_short_one_is_served_at_once(served):
    base, service = served
    before, tokens_before = success(base), service.engine.stats()["tokens"]

    async def burst() -> list[str]:
        return await asyncio.gather(*(abandon(base, i) for i in range(BURST)))

    outcomes = asyncio.run(burst())
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
