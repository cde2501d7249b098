"""Load test of any OpenAI-compatible completions endpoint (vLLM, llama.cpp's server, TGI, ...).

Streams `POST {base}/v1/completions` under a closed loop of `concurrency` requests in flight (or
Poisson arrivals at `rate` requests/s, still capped by `concurrency`) and reports, per concurrency
level, what vLLM's serving benchmark reports: TTFT, TPOT, inter-token latency and end-to-end latency
percentiles, request and output-token throughput, and failures by kind. It only talks to the URL it
is given, sends at most `requests` requests per level, and bounds every request by `timeout`.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from urllib.parse import urlsplit

import httpx
from rich.table import Table

from ..errors import EndpointError, UsageError
from ..evaluate.metrics import summarize_latencies
from ..generation.settings import SamplingSettings
from .report import require_matplotlib, save_png

SCHEMA_VERSION = 1

DEFAULT_PROMPTS = (
    "ROMEO:\nBut, soft! what light through yonder window breaks?",
    "JULIET:\nO Romeo, Romeo! wherefore art thou Romeo?",
    "HAMLET:\nTo be, or not to be, that is the question:",
    "KING RICHARD III:\nNow is the winter of our discontent",
    "MACBETH:\nTomorrow, and tomorrow, and tomorrow,",
)


@dataclass
class LoadtestSettings:
    url: str
    model: str | None = None  # None: the first id from GET {base}/v1/models, else "default"
    requests: int = 200  # per concurrency level
    concurrency: list[int] = field(default_factory=lambda: [1])
    rate: float | None = None  # requests/s, Poisson arrivals; None: closed loop
    max_tokens: int = 64
    prompts: list[str] = field(default_factory=lambda: list(DEFAULT_PROMPTS))
    temperature: float = SamplingSettings.temperature  # OpenAI's default, as gpt2x's
    api_key: str | None = None
    timeout: float = 60.0  # seconds, per request (connect to last byte)
    max_duration: float | None = None  # seconds per level; requests unfinished by then count as failures
    seed: int = 0  # Poisson arrival times

    def validate(self) -> None:
        parts = urlsplit(self.url)
        if parts.scheme not in ("http", "https") or not parts.netloc:
            raise UsageError(f"{self.url!r} is not an http:// or https:// URL")
        for name in ("requests", "max_tokens"):
            if getattr(self, name) < 1:
                raise UsageError(f"{name} must be at least 1, got {getattr(self, name)}", option=name)
        if not self.concurrency or min(self.concurrency) < 1:
            raise UsageError(f"concurrency must be a list of integers >= 1, got {self.concurrency}", option="concurrency")
        for name in ("rate", "timeout", "max_duration"):
            value = getattr(self, name)
            if value is not None and value <= 0:
                raise UsageError(f"{name} must be positive, got {value}", option=name)
        if self.temperature < 0:
            raise UsageError(f"temperature must be >= 0, got {self.temperature}", option="temperature")
        if not self.prompts:
            raise UsageError("prompts: no prompts given", option="prompts")


def base_url(url: str) -> str:
    """The server's root: `http://host:8000/v1/` and `http://host:8000` both give `http://host:8000`."""
    url = url.rstrip("/")
    for suffix in ("/v1/completions", "/v1"):
        if url.endswith(suffix):
            url = url[: -len(suffix)]
    return url


@dataclass
class RequestRecord:
    ok: bool
    error: str | None = None  # failure kind: http_<code>, timeout, connection, malformed_stream, stream_error, deadline
    detail: str | None = None
    ttft: float | None = None
    itl: list[float] = field(default_factory=list)
    e2e: float | None = None
    output_tokens: int = 0
    chunks: int = 0


def _headers(settings: LoadtestSettings) -> dict[str, str]:
    return {"Authorization": f"Bearer {settings.api_key}"} if settings.api_key else {}


def _describe(e: Exception) -> str:
    return f"{type(e).__name__}: {e}" if str(e) else type(e).__name__


async def discover_model(client: httpx.AsyncClient, settings: LoadtestSettings) -> str:
    """Checks the server answers, and picks the model: the given one, else GET /v1/models' first id."""
    base = base_url(settings.url)
    try:
        r = await client.get(f"{base}/v1/models", headers=_headers(settings))
    except httpx.TimeoutException as e:
        raise EndpointError(f"{base} did not answer within {settings.timeout:g} s ({_describe(e)})") from None
    except httpx.HTTPError as e:
        raise EndpointError(f"cannot reach {base}: {_describe(e)}") from None
    if settings.model:
        return settings.model
    try:
        return str(r.json()["data"][0]["id"]) if r.status_code == 200 else "default"
    except (ValueError, KeyError, IndexError, TypeError):
        return "default"


async def one_request(client: httpx.AsyncClient, settings: LoadtestSettings, model: str, prompt: str) -> RequestRecord:
    body = {"model": model, "prompt": prompt, "max_tokens": settings.max_tokens, "temperature": settings.temperature,
            "stream": True, "stream_options": {"include_usage": True}}
    start = time.perf_counter()
    rec = RequestRecord(ok=False)
    usage_tokens = None
    last = None
    try:
        async with client.stream("POST", f"{base_url(settings.url)}/v1/completions", json=body, headers=_headers(settings)) as r:
            if r.status_code != 200:
                text = (await r.aread()).decode("utf-8", "replace")
                rec.error, rec.detail = f"http_{r.status_code}", text[:200]
                return rec
            async for line in r.aiter_lines():
                if not line.startswith("data:"):
                    continue  # blank separators, `event:` and `:` comment lines
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                try:
                    chunk = json.loads(data)
                    if "error" in chunk:
                        rec.error, rec.detail = "stream_error", str(chunk["error"])[:200]
                        return rec
                    choices = chunk.get("choices") or []
                    text = choices[0].get("text") or "" if choices else ""
                    if chunk.get("usage"):
                        usage_tokens = int(chunk["usage"]["completion_tokens"])
                except (ValueError, KeyError, TypeError, AttributeError, IndexError):
                    rec.error, rec.detail = "malformed_stream", data[:200]
                    return rec
                if text:
                    now = time.perf_counter()
                    if last is None:
                        rec.ttft = now - start
                    else:
                        rec.itl.append(now - last)
                    last = now
                    rec.chunks += 1
    except httpx.TimeoutException as e:
        rec.error, rec.detail = "timeout", _describe(e)
        return rec
    except httpx.HTTPError as e:
        rec.error, rec.detail = "connection", _describe(e)
        return rec
    rec.e2e = time.perf_counter() - start
    rec.output_tokens = usage_tokens if usage_tokens is not None else rec.chunks
    rec.ok = True
    return rec


def _summary(values: list[float]) -> dict | None:
    return summarize_latencies(values) if values else None


def summarize_level(concurrency: int, records: list[RequestRecord], wall: float, requests: int) -> dict:
    ok = [r for r in records if r.ok]
    failures = Counter(r.error for r in records if not r.ok)
    if requests > len(records):
        failures["deadline"] += requests - len(records)
    examples = {}
    for r in records:
        if not r.ok and r.error not in examples:
            examples[r.error] = r.detail
    tokens = sum(r.output_tokens for r in ok)
    tpot = [(r.e2e - r.ttft) / (r.output_tokens - 1) for r in ok if r.ttft is not None and r.output_tokens > 1]
    return {
        "concurrency": concurrency,
        "requests": requests,
        "completed": len(ok),
        "failed": requests - len(ok),
        "failures": dict(sorted(failures.items())),
        "failure_examples": examples,
        "wall_s": wall,
        "request_throughput": len(ok) / wall if wall > 0 else None,
        "output_token_throughput": tokens / wall if wall > 0 else None,
        "total_output_tokens": tokens,
        "mean_output_tokens": tokens / len(ok) if ok else None,
        "ttft": _summary([r.ttft for r in ok if r.ttft is not None]),
        "tpot": _summary(tpot),
        "itl": _summary([x for r in ok for x in r.itl]),
        "e2e": _summary([r.e2e for r in ok]),
    }


async def run_level(client: httpx.AsyncClient, settings: LoadtestSettings, model: str, concurrency: int,
                    progress: Callable[[str], None]) -> dict:
    sem = asyncio.Semaphore(concurrency)
    rng = random.Random(settings.seed)
    records: list[RequestRecord] = []
    finished = [0.0]

    async def one(i: int) -> None:
        async with sem:
            prompt = settings.prompts[i % len(settings.prompts)]
            try:
                rec = await asyncio.wait_for(one_request(client, settings, model, prompt), settings.timeout)
            except asyncio.TimeoutError:
                rec = RequestRecord(ok=False, error="timeout", detail=f"no complete answer within {settings.timeout:g} s")
        records.append(rec)
        finished[0] = time.perf_counter()
        progress(f"concurrency {concurrency}: {len(records)}/{settings.requests} requests")

    async def launch() -> None:
        tasks = []
        for i in range(settings.requests):
            if settings.rate and i:
                await asyncio.sleep(rng.expovariate(settings.rate))
            tasks.append(asyncio.create_task(one(i)))
        await asyncio.gather(*tasks)

    start = time.perf_counter()
    try:
        await asyncio.wait_for(launch(), settings.max_duration)
    except asyncio.TimeoutError:
        finished[0] = time.perf_counter()
    wall = (finished[0] or time.perf_counter()) - start
    return summarize_level(concurrency, records, wall, settings.requests)


async def _run(settings: LoadtestSettings, progress: Callable[[str], None]) -> tuple[str, list[dict]]:
    limits = httpx.Limits(max_connections=max(settings.concurrency), max_keepalive_connections=max(settings.concurrency))
    async with httpx.AsyncClient(timeout=httpx.Timeout(settings.timeout), limits=limits) as client:
        model = await discover_model(client, settings)
        levels = []
        for c in settings.concurrency:
            progress(f"concurrency {c}: starting")
            levels.append(await run_level(client, settings, model, c, progress))
        return model, levels


def run_loadtest(settings: LoadtestSettings, environment: dict, progress: Callable[[str], None] = lambda _: None) -> dict:
    """Every concurrency level in turn; the result is JSON-ready. Raises EndpointError if the server
    cannot be reached at the start (requests that fail later are counted, not raised)."""
    settings.validate()
    model, levels = asyncio.run(_run(settings, progress))
    return {
        "schema_version": SCHEMA_VERSION,
        "settings": {**asdict(settings), "url": base_url(settings.url), "api_key": "***" if settings.api_key else None,
                     "model": model, "prompts": len(settings.prompts)},
        "environment": environment,
        "levels": levels,
    }


def all_failed(result: dict) -> bool:
    return all(level["completed"] == 0 for level in result["levels"])


def failure_summary(result: dict) -> str:
    kinds: Counter = Counter()
    example = None
    for level in result["levels"]:
        kinds.update(level["failures"])
        example = example or next(iter(level["failure_examples"].values()), None)
    text = ", ".join(f"{n} x {k}" for k, n in sorted(kinds.items()))
    return text + (f" (first: {' '.join(example.split())[:120]})" if example else "")


def _ms(summary: dict | None, key: str) -> str:
    return "-" if not summary else f"{summary[key]:.1f}"


def loadtest_table(result: dict) -> Table:
    s = result["settings"]
    mode = f"Poisson {s['rate']:g} req/s" if s["rate"] else "closed loop"
    table = Table(title=f"loadtest {s['url']} (model {s['model']}, {s['requests']} requests per level, {mode}, "
                        f"max_tokens {s['max_tokens']})")
    cols = ("conc.", "ok", "failed", "wall s", "req/s", "out tok/s", "TTFT p50", "TTFT p90", "TTFT p99",
            "TPOT p50", "ITL p50", "ITL p90", "ITL p99", "e2e p50", "e2e p90", "e2e p99")
    for col in cols:
        table.add_column(col, justify="right")
    for lv in result["levels"]:
        fail = str(lv["failed"]) if not lv["failed"] else "[red]" + ", ".join(f"{n} {k}" for k, n in lv["failures"].items()) + "[/]"
        table.add_row(
            str(lv["concurrency"]), str(lv["completed"]), fail, f"{lv['wall_s']:.2f}",
            "-" if lv["request_throughput"] is None else f"{lv['request_throughput']:.2f}",
            "-" if lv["output_token_throughput"] is None else f"{lv['output_token_throughput']:.1f}",
            _ms(lv["ttft"], "p50_ms"), _ms(lv["ttft"], "p90_ms"), _ms(lv["ttft"], "p99_ms"), _ms(lv["tpot"], "p50_ms"),
            _ms(lv["itl"], "p50_ms"), _ms(lv["itl"], "p90_ms"), _ms(lv["itl"], "p99_ms"),
            _ms(lv["e2e"], "p50_ms"), _ms(lv["e2e"], "p90_ms"), _ms(lv["e2e"], "p99_ms"),
        )
    table.caption = "latencies in ms; TTFT: time to first token, TPOT: time per output token after the first, ITL: between chunks"
    return table


def plot_loadtest(result: dict, path: Path) -> None:
    """Latency (p50/p99 of e2e and TTFT) against output-token throughput, one point per concurrency level."""
    plt = require_matplotlib()
    levels = [lv for lv in result["levels"] if lv["e2e"] and lv["ttft"]]
    fig, ax = plt.subplots(figsize=(8, 5))
    x = [lv["output_token_throughput"] for lv in levels]
    for metric, key, style in (("e2e", "p50_ms", "o-"), ("e2e", "p99_ms", "o--"), ("ttft", "p50_ms", "s-"), ("ttft", "p99_ms", "s--")):
        ax.plot(x, [lv[metric][key] for lv in levels], style, label=f"{metric} {key[:3]}")
    for lv, xi in zip(levels, x):
        ax.annotate(f"c={lv['concurrency']}", (xi, lv["e2e"]["p50_ms"]), textcoords="offset points", xytext=(4, 4), fontsize=8)
    s = result["settings"]
    ax.set(xlabel="output tokens/s", ylabel="latency (ms, log scale)", yscale="log",
           title=f"gpt2x loadtest: {s['model']} at {s['url']} (max_tokens {s['max_tokens']})")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    save_png(fig, path)
