"""Load test of any OpenAI-compatible completions endpoint: streamed requests in a closed loop or Poisson arrivals,
reported per concurrency level (or per rate of a rate sweep) as vLLM's serving benchmark reports them, optionally on a
shared-prefix workload, and with latency goals: each level's goodput and the highest rate whose requests met them
(docs/commands/loadtest.md). It talks only to the URL given, and bounds every request.
"""

from __future__ import annotations

import asyncio
import json
import math
import random
import re
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from importlib import resources
from pathlib import Path
from urllib.parse import urlsplit

import httpx
from rich.markup import escape
from rich.table import Table

from ..errors import EndpointError, UsageError
from ..evaluate.metrics import summarize_latencies
from ..generation.settings import SamplingSettings
from ..tokenizer import decode, encode
from .report import require_matplotlib, save_png

# 2: each level's prompt_tokens, cached_prompt_tokens, prefix_cache_hit_rate and prompt_tokens_stated;
# the settings' shared_prefix_tokens, prefixes, suffix_tokens and prefix_token_counts. Readers of a
# version-1 file (loadtest_table, plot_loadtest) take the missing keys as "not stated".
# 3: each level's rate, good, good_fraction, goodput_rps and meets_slo; the result's max_rate_within_slo,
# max_concurrency_within_slo and rates_not_run; the settings' rates, goodput, slo_fraction and stop_after_misses.
# Older files have no sweep and no goals: their readers show no rate column, no goodput table and no SLO line.
SCHEMA_VERSION = 3

# The latency goals --goodput takes, each in ms and judged per completed request (goal_metrics; a failed one is never
# good). ttft, tpot and e2el are vLLM's `bench serve --goodput` metrics, computed as it computes them; itl is gpt2x's.
GOAL_METRICS = ("ttft", "tpot", "itl", "e2el")
DEFAULT_SLO_FRACTION = 0.9  # vLLM's SLA sweeps and GuideLLM's reports judge at p90 by default
MAX_RATES = 1000  # levels of one sweep: a typo in START:STOP:STEP must not queue a day of load

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
    requests: int = 200  # per level
    concurrency: list[int] = field(default_factory=lambda: [1])  # with `rates`, one value: the most in flight
    rate: float | None = None  # requests/s, Poisson arrivals; None: closed loop
    rates: list[float] | None = None  # a rate sweep: one level per rate (increasing), Poisson arrivals
    max_tokens: int = 64
    prompts: list[str] = field(default_factory=lambda: list(DEFAULT_PROMPTS))
    temperature: float = SamplingSettings.temperature  # OpenAI's default, as gpt2x's
    api_key: str | None = None
    timeout: float = 60.0  # seconds, per request (connect to last byte)
    max_duration: float | None = None  # seconds per level; requests unfinished by then count as failures
    seed: int = 0  # Poisson arrival times; the shared-prefix prompts and their order
    shared_prefix_tokens: int = 0  # > 0: the shared-prefix workload (replaces `prompts`)
    prefixes: int = 1  # how many different shared prefixes
    suffix_tokens: int = 32  # about this many tokens after each prompt's prefix, its own
    goodput: dict[str, float] = field(default_factory=dict)  # GOAL_METRICS name -> goal in ms; empty: no goals
    slo_fraction: float = DEFAULT_SLO_FRACTION  # a level holds the goals when at least this share of its requests met them
    stop_after_misses: int = 2  # a sweep with goals stops after this many consecutive rates missed them; 0: never

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
        if self.shared_prefix_tokens < 0:
            raise UsageError(f"shared_prefix_tokens must be >= 0 (0: no shared prefix), got {self.shared_prefix_tokens}",
                             option="shared_prefix_tokens")
        for name in ("prefixes", "suffix_tokens"):
            if getattr(self, name) < 1:
                raise UsageError(f"{name} must be at least 1, got {getattr(self, name)}", option=name)
            if getattr(self, name) > MAX_WORKLOAD_SIZE:
                raise UsageError(f"{name} must be at most {MAX_WORKLOAD_SIZE}, got {getattr(self, name)}", option=name)
        if self.shared_prefix_tokens > MAX_WORKLOAD_SIZE:
            raise UsageError(f"shared_prefix_tokens must be at most {MAX_WORKLOAD_SIZE}, got {self.shared_prefix_tokens}",
                             option="shared_prefix_tokens")
        if self.rates is not None:
            if self.rate is not None:
                raise UsageError("rate cannot be used with a rate sweep (--rates, --sweep-rate: it sets each level's rate)", option="rate")
            if not self.rates or len(self.rates) > MAX_RATES:
                raise UsageError(f"rates must hold 1 to {MAX_RATES} rates, got {len(self.rates)}", option="rates")
            if not all(math.isfinite(r) and r > 0 for r in self.rates) or any(a >= b for a, b in zip(self.rates, self.rates[1:])):
                raise UsageError(f"rates must be positive and increasing, got {self.rates}", option="rates")
            if len(self.concurrency) != 1:
                raise UsageError(f"concurrency takes one value with a rate sweep (the most requests in flight), got {self.concurrency}",
                                 option="concurrency")
        for metric, goal in self.goodput.items():
            check_goal(metric, goal, f"{metric}:{goal}")
        if not 0 < self.slo_fraction <= 1:
            raise UsageError(f"slo_fraction must be in (0, 1], got {self.slo_fraction}", option="slo_fraction")
        if self.stop_after_misses < 0:
            raise UsageError(f"stop_after_misses must be >= 0 (0: never stop early), got {self.stop_after_misses}",
                             option="stop_after_misses")

    def plan(self) -> list[tuple[int, float | None]]:
        """Each level's (concurrency, rate): one per rate of a sweep, all capped by the one concurrency; else one per
        concurrency, at `rate` (None: a closed loop)."""
        if self.rates:
            return [(self.concurrency[0], r) for r in self.rates]
        return [(c, self.rate) for c in self.concurrency]


MAX_WORKLOAD_SIZE = 100_000  # tokens of a prefix or suffix, prefixes: beyond any model's context


_GOAL = re.compile(r"([A-Za-z0-9_]+)[:=](.*?)(ms)?")  # ttft:500, ttft=500, ttft:500ms


def check_goal(metric: str, goal: float, item: str) -> None:
    """A UsageError naming `item` (as given) unless `metric` is one of GOAL_METRICS and `goal` a positive number of ms."""
    if metric not in GOAL_METRICS:
        raise UsageError(f"goodput: unknown metric {metric!r} in {item!r} (one of {', '.join(GOAL_METRICS)})", option="goodput")
    if not (math.isfinite(goal) and goal > 0):
        raise UsageError(f"goodput: the {metric} goal must be a positive number of ms, got {item!r}", option="goodput")


def parse_goals(values: list[str]) -> dict[str, float]:
    """Latency goals in ms from repeatable values, each one or more `METRIC:MS` (or `METRIC=MS`) separated by commas
    or spaces (vLLM's `--goodput ttft:500 tpot:50`, quoted). Bad syntax, unknown metrics and bad values: UsageError."""
    goals: dict[str, float] = {}
    for value in values:
        for item in (v for v in re.split(r"[,\s]+", value.strip()) if v):
            match = _GOAL.fullmatch(item)
            try:
                if not match:
                    raise ValueError
                goal = float(match[2])
            except ValueError:
                raise UsageError(f"goodput: {item!r} is not METRIC:MS (such as ttft:500)", option="goodput") from None
            metric = match[1].lower()
            check_goal(metric, goal, item)
            if metric in goals:
                raise UsageError(f"goodput: {metric} is given twice", option="goodput")
            goals[metric] = goal
    return goals


def _positive(text: str, option: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and value > 0):
        raise UsageError(f"{option}: {text.strip()!r} is not a positive number of requests/s", option=option)
    return value


def parse_rates(rates: str | None, sweep_rate: str | None) -> list[float] | None:
    """The rates (req/s) of a sweep, increasing: `rates` as `1,2,4,8` (any order) or `sweep_rate` as START:STOP:STEP
    (START, START + STEP, ... up to STOP inclusive); None when neither is given."""
    if rates is not None and sweep_rate is not None:
        raise UsageError("rates cannot be used together with --sweep-rate", option="rates")
    if rates is not None:
        found = sorted({_positive(r, "rates") for r in rates.split(",") if r.strip()})
        if not found:
            raise UsageError(f"rates: {rates!r} is not a comma-separated list of requests/s", option="rates")
        return found
    if sweep_rate is None:
        return None
    parts = sweep_rate.split(":")
    if len(parts) != 3:
        raise UsageError(f"sweep_rate: {sweep_rate!r} is not START:STOP:STEP (such as 1:8:1)", option="sweep_rate")
    start, stop, step = (_positive(p, "sweep_rate") for p in parts)
    if stop < start:
        raise UsageError(f"sweep_rate: STOP {stop:g} is below START {start:g}", option="sweep_rate")
    count = math.floor((stop - start) / step + 1e-9) + 1  # the epsilon: 0.1:0.3:0.1 reaches 0.3 despite rounding
    if count > MAX_RATES:
        raise UsageError(f"sweep_rate: {sweep_rate!r} makes {count} rates, more than {MAX_RATES}", option="sweep_rate")
    return [round(start + i * step, 9) for i in range(count)]


def _corpus() -> tuple[list[int], list[int]]:
    """The bundled held-out Shakespeare's GPT-2 tokens, and the indices of those that start a line."""
    tokens = encode((resources.files("gpt2x") / "data" / "heldout_shakespeare.txt").read_text(encoding="utf-8"))
    starts = [i for i in range(1, len(tokens)) if decode(tokens[i - 1 : i]).endswith("\n") and decode(tokens[i : i + 1]).strip()]
    return tokens, starts


def _text_of_tokens(tokens: list[int], start: int, n: int) -> tuple[str, list[int]]:
    """About `n` tokens of `tokens` (cyclic) from about `start`, as stripped text, and its tokens: exactly `n` where
    a nearby window gives them (re-encoding may merge or split tokens at the edges), else the closest."""
    best: tuple[str, list[int]] = ("", [])
    for shift in range(8):
        for width in sorted(range(max(1, n - 4), n + 5), key=lambda w: (abs(w - n), w)):
            window = [tokens[(start + shift + j) % len(tokens)] for j in range(width)]
            text = decode(window).strip()
            ids = encode(text)
            if len(ids) == n:
                return text, ids
            if abs(len(ids) - n) < abs(len(best[1]) - n):
                best = (text, ids)
    return best


def _distinct_starts(tokens: list[int], starts: list[int], k: int, rng: random.Random) -> list[int]:
    """`k` different line starts, seeded, preferring distinct first two tokens (speakers' names open many lines:
    prefixes starting alike would share cached tokens)."""
    pool = rng.sample(starts, len(starts))
    chosen: list[int] = []
    heads: set[tuple[int, ...]] = set()
    for start in pool:
        head = tuple(tokens[start : start + 2])
        if head not in heads:
            chosen.append(start)
            heads.add(head)
        if len(chosen) == k:
            return chosen
    rest = [s for s in pool if s not in chosen]
    chosen += rest[: k - len(chosen)]
    if len(chosen) < k:  # more prefixes than lines: other positions, different ones while the text lasts
        taken = set(chosen)
        others = [i for i in range(len(tokens)) if i not in taken]
        chosen += rng.sample(others, min(k - len(chosen), len(others)))
    while len(chosen) < k:
        chosen.append(rng.randrange(len(tokens)))
    return chosen


def shared_prefix_prompts(prefix_tokens: int, prefixes: int, suffix_tokens: int, count: int, seed: int = 0,
                          block: int | None = None) -> tuple[list[str], list[int], list[int]]:
    """The shared-prefix workload's prompts (prefix + "\n" + suffix, neither with whitespace at its ends, so a prompt's
    tokens start with its prefix's exactly), each prompt's prefix index (shuffled, balanced within every `block`),
    and each prefix's token count."""
    rng = random.Random(f"gpt2x-loadtest-shared-prefix-{seed}")
    tokens, starts = _corpus()
    chosen = _distinct_starts(tokens, starts, prefixes, rng)
    heads = [_text_of_tokens(tokens, start, prefix_tokens) for start in chosen]
    block = block or count
    order: list[int] = []
    for first in range(0, count, block):
        part = [i % prefixes for i in range(min(block, count - first))]
        rng.shuffle(part)
        order += part
    positions = list(range(len(tokens)))
    offsets: list[int] = []
    while len(offsets) < count:
        rng.shuffle(positions)
        offsets += positions[: count - len(offsets)]
    prompts = [heads[k][0] + "\n" + _text_of_tokens(tokens, off, suffix_tokens)[0] for k, off in zip(order, offsets)]
    return prompts, order, [len(ids) for _, ids in heads]


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
    prompt_tokens: int | None = None  # as the server states them (usage, else llama.cpp's timings)
    cached_tokens: int | None = None  # of those, served from its prefix cache, where it says


def stated_prompt_tokens(chunk: dict) -> tuple[int | None, int | None]:
    """(prompt tokens, cached prompt tokens) a streamed chunk states: OpenAI's `usage`, else llama.cpp's `timings`."""
    usage = chunk.get("usage") or {}
    timings = chunk.get("timings") or {}
    prompt = usage.get("prompt_tokens")
    cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens")
    if cached is None and timings.get("cache_n") is not None:
        cached = timings["cache_n"]
        if prompt is None and timings.get("prompt_n") is not None:
            prompt = int(timings["cache_n"]) + int(timings["prompt_n"])
    return (None if prompt is None else int(prompt)), (None if cached is None else int(cached))


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
                    prompt_tokens, cached_tokens = stated_prompt_tokens(chunk)
                    if prompt_tokens is not None:
                        rec.prompt_tokens = prompt_tokens
                    if cached_tokens is not None:
                        rec.cached_tokens = cached_tokens
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


def _tpot(rec: RequestRecord) -> float | None:
    """Seconds per output token after the first, as vLLM computes TPOT; None for an answer of one token or none."""
    return (rec.e2e - rec.ttft) / (rec.output_tokens - 1) if rec.ttft is not None and rec.output_tokens > 1 else None


def goal_metrics(rec: RequestRecord) -> dict[str, float]:
    """A completed request's GOAL_METRICS in ms. As vLLM judges goodput, a one-token answer's TPOT is 0; so is the
    ITL of a one-chunk answer. An answer that streamed no text has no first token: its TTFT is its e2e latency."""
    ttft = rec.ttft if rec.ttft is not None else rec.e2e
    return {"ttft": ttft * 1e3, "tpot": (_tpot(rec) or 0.0) * 1e3, "itl": max(rec.itl, default=0.0) * 1e3,
            "e2el": rec.e2e * 1e3}


def is_good(rec: RequestRecord, goals: dict[str, float]) -> bool:
    """Whether the request completed with every goal's metric at or below it (ms), as vLLM's --goodput counts it."""
    if not rec.ok:
        return False
    metrics = goal_metrics(rec)
    return all(metrics[metric] <= goal for metric, goal in goals.items())


def holds(level: dict, fraction: float) -> bool:
    """Whether at least `fraction` of the level's requests met every goal (False where no goals were set)."""
    return level.get("good_fraction") is not None and level["good_fraction"] >= fraction


def within_slo(levels: list[dict], fraction: float) -> tuple[float | None, int | None]:
    """The highest offered rate among the levels that held the goals (Poisson levels), and the highest concurrency
    among the closed-loop levels that did; None where none did. The highest, not the first: a lower rate that missed
    by noise does not hide a higher one that held."""
    held = [lv for lv in levels if holds(lv, fraction)]
    rates = [lv["rate"] for lv in held if lv.get("rate") is not None]
    closed = [lv["concurrency"] for lv in held if lv.get("rate") is None]
    return max(rates, default=None), max(closed, default=None)


def _summary(values: list[float]) -> dict | None:
    """Percentiles and mean in ms, and the largest (`max_ms`: one stall in thousands of gaps is past any p99)."""
    return {**summarize_latencies(values), "max_ms": max(values) * 1e3} if values else None


def summarize_level(concurrency: int, records: list[RequestRecord], wall: float, requests: int, rate: float | None = None,
                    goals: dict[str, float] | None = None, slo_fraction: float = DEFAULT_SLO_FRACTION) -> dict:
    """A level's figures; with `goals`, its good requests (is_good), their share of the `requests` sent (failed and
    unfinished ones count as not good), goodput (good requests per second of the level's wall time, vLLM's
    "Request goodput") and whether that share reaches `slo_fraction`."""
    ok = [r for r in records if r.ok]
    failures = Counter(r.error for r in records if not r.ok)
    if requests > len(records):
        failures["deadline"] += requests - len(records)
    examples = {}
    for r in records:
        if not r.ok and r.error not in examples:
            examples[r.error] = r.detail
    tokens = sum(r.output_tokens for r in ok)
    tpot = [t for t in map(_tpot, ok) if t is not None]
    good = sum(is_good(r, goals) for r in ok) if goals else None
    stated = [r for r in ok if r.prompt_tokens is not None]
    cache_stated = [r for r in stated if r.cached_tokens is not None]
    prompt_tokens = sum(r.prompt_tokens or 0 for r in stated) if stated else None
    cached = sum(r.cached_tokens or 0 for r in cache_stated) if cache_stated else None
    cache_prompt = sum(r.prompt_tokens or 0 for r in cache_stated)
    level = {
        "concurrency": concurrency,
        "rate": rate,  # offered requests/s (Poisson arrivals); None: a closed loop
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
        "prompt_tokens": prompt_tokens,  # summed over the completed requests whose server stated them; None: none did
        "prompt_tokens_stated": len(stated),  # requests that stated their prompt tokens
        "cached_prompt_tokens": cached,  # None: the server stated no cached tokens
        # cached / prompt tokens over the requests that stated both
        "prefix_cache_hit_rate": cached / cache_prompt if cache_stated and cache_prompt > 0 else None,
        # None without goals
        "good": good,
        "good_fraction": good / requests if good is not None else None,
        "goodput_rps": good / wall if good is not None and wall > 0 else None,
    }
    level["meets_slo"] = holds(level, slo_fraction) if goals else None
    return level


def level_name(concurrency: int, rate: float | None, sweep: bool) -> str:
    """How progress names a level: by its rate in a sweep, else by its concurrency."""
    return f"rate {rate:g} req/s" if sweep else f"concurrency {concurrency}"


async def run_level(client: httpx.AsyncClient, settings: LoadtestSettings, model: str, concurrency: int,
                    progress: Callable[[str], None], prompts: list[str] | None = None, rate: float | None = None) -> dict:
    """One level, Poisson arrivals at `rate` req/s (None: a closed loop); request i sends prompts[i % len(prompts)]
    (default: the settings' prompts)."""
    prompts = prompts or settings.prompts
    name = level_name(concurrency, rate, bool(settings.rates))
    sem = asyncio.Semaphore(concurrency)
    rng = random.Random(settings.seed)
    records: list[RequestRecord] = []
    finished = [0.0]

    async def one(i: int) -> None:
        async with sem:
            prompt = prompts[i % len(prompts)]
            try:
                rec = await asyncio.wait_for(one_request(client, settings, model, prompt), settings.timeout)
            except asyncio.TimeoutError:
                rec = RequestRecord(ok=False, error="timeout", detail=f"no complete answer within {settings.timeout:g} s")
        records.append(rec)
        finished[0] = time.perf_counter()
        progress(f"{name}: {len(records)}/{settings.requests} requests")

    async def launch() -> None:
        tasks = []
        for i in range(settings.requests):
            if rate and i:
                await asyncio.sleep(rng.expovariate(rate))
            tasks.append(asyncio.create_task(one(i)))
        await asyncio.gather(*tasks)

    start = time.perf_counter()
    try:
        await asyncio.wait_for(launch(), settings.max_duration)
    except asyncio.TimeoutError:
        finished[0] = time.perf_counter()
    wall = (finished[0] or time.perf_counter()) - start
    return summarize_level(concurrency, records, wall, settings.requests, rate, settings.goodput, settings.slo_fraction)


def level_prompts(settings: LoadtestSettings) -> tuple[list[list[str]], list[int] | None]:
    """Each level's prompts and the shared prefixes' token counts (None: not that workload). No suffix repeats in a
    run: a prompt sent whole a level before would be a cache hit beyond its prefix."""
    levels = len(settings.plan())
    if not settings.shared_prefix_tokens:
        return [settings.prompts] * levels, None
    n = settings.requests
    prompts, _, counts = shared_prefix_prompts(settings.shared_prefix_tokens, settings.prefixes, settings.suffix_tokens,
                                               n * levels, settings.seed, block=n)
    return [prompts[i * n : (i + 1) * n] for i in range(levels)], counts


def sweep_stops(settings: LoadtestSettings, levels: list[dict]) -> bool:
    """Whether a sweep with goals stops here: its last `stop_after_misses` rates all missed them (higher rates load
    the server more; running them would only prolong an overload)."""
    n = settings.stop_after_misses
    return bool(settings.rates and settings.goodput and n and len(levels) >= n
                and all(lv["meets_slo"] is False for lv in levels[-n:]))


async def _run(settings: LoadtestSettings, prompts: list[list[str]],
               progress: Callable[[str], None]) -> tuple[str, list[dict], list[float]]:
    """The model, the levels run, and the rates of a sweep left unrun (sweep_stops)."""
    plan = settings.plan()
    cap = max(c for c, _ in plan)
    limits = httpx.Limits(max_connections=cap, max_keepalive_connections=cap)
    async with httpx.AsyncClient(timeout=httpx.Timeout(settings.timeout), limits=limits) as client:
        model = await discover_model(client, settings)
        levels: list[dict] = []
        for i, ((c, rate), level) in enumerate(zip(plan, prompts)):
            progress(f"{level_name(c, rate, bool(settings.rates))}: starting")
            levels.append(await run_level(client, settings, model, c, progress, level, rate))
            if i + 1 < len(plan) and sweep_stops(settings, levels):
                not_run = [r for _, r in plan[i + 1 :]]
                progress(f"{settings.stop_after_misses} consecutive rates missed the goals: not running {_rates_text(not_run)}")
                return model, levels, not_run
        return model, levels, []


def run_loadtest(settings: LoadtestSettings, environment: dict, progress: Callable[[str], None] = lambda _: None) -> dict:
    """Every level in turn, JSON-ready. EndpointError only if the server cannot be reached at the start."""
    settings.validate()
    prompts, prefix_counts = level_prompts(settings)
    model, levels, not_run = asyncio.run(_run(settings, prompts, progress))
    max_rate, max_concurrency = within_slo(levels, settings.slo_fraction)
    return {
        "schema_version": SCHEMA_VERSION,
        "settings": {**asdict(settings), "url": base_url(settings.url), "api_key": "***" if settings.api_key else None,
                     "model": model, "prompts": len(prompts[0]) if prefix_counts else len(settings.prompts),
                     "prefix_token_counts": prefix_counts},
        "environment": environment,
        "levels": levels,
        # with goals (None without): the highest rate, and closed-loop concurrency, at which at least slo_fraction
        # of the requests met every goal (None: none did)
        "max_rate_within_slo": max_rate,
        "max_concurrency_within_slo": max_concurrency,
        "rates_not_run": not_run,  # a sweep's rates after it stopped early (sweep_stops)
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


def hit_rate_text(level: dict) -> str:
    """A level's prefix-cache hit rate, "n/a" where no cached tokens were stated (and in version-1 results)."""
    rate = level.get("prefix_cache_hit_rate")
    return "n/a" if rate is None else f"{100 * rate:.1f}%"


def workload_text(settings: dict) -> str:
    """"shared prefix 512 tok x 4, suffix 32 tok" or "N prompts" (older results: the latter)."""
    if settings.get("shared_prefix_tokens"):
        return (f"shared prefix {settings['shared_prefix_tokens']} tok x {settings['prefixes']}, "
                f"suffix {settings['suffix_tokens']} tok")
    return f"{settings['prompts']} prompts"


def _percentiles(summary: dict | None, keys: tuple[str, ...] = ("p50_ms", "p90_ms", "p99_ms")) -> str:
    """A latency's percentiles in one cell, space-separated: a narrow terminal wraps the cell, never cuts a figure."""
    return " ".join(_ms(summary, key) for key in keys)


def _rates_text(rates: list[float]) -> str:
    return ", ".join(f"{r:g}" for r in rates) + " req/s"


def goals_text(goals: dict[str, float]) -> str:
    """"ttft <= 500 ms, tpot <= 50 ms"."""
    return ", ".join(f"{metric} <= {goal:g} ms" for metric, goal in goals.items())


def slo_fraction_of(settings: dict) -> float:
    return settings.get("slo_fraction", DEFAULT_SLO_FRACTION)


def is_sweep(result: dict) -> bool:
    return bool(result["settings"].get("rates"))


def mode_text(settings: dict) -> str:
    """"closed loop", "Poisson 4 req/s" or "Poisson rate sweep, at most 64 in flight"."""
    if settings.get("rates"):
        return f"Poisson rate sweep, at most {settings['concurrency'][0]} in flight"
    return f"Poisson {settings['rate']:g} req/s" if settings["rate"] else "closed loop"


def table_title(result: dict) -> str:
    s = result["settings"]
    return (f"loadtest {s['url']} (model {s['model']}, {s['requests']} requests per level, {mode_text(s)}, "
            f"max_tokens {s['max_tokens']}, {workload_text(s)})")


TABLE_CAPTION = ("latencies in ms (p50 p90 p99); TTFT: time to first token, TPOT: time per output token after the "
                 "first, ITL: between chunks; prompt tok: as the server states them; cache hit: its cached / prompt "
                 "tokens (n/a: it states none)")

Cells = tuple[list[str], list[list[tuple[str, bool]]]]  # column names; rows of (text, whether it is bad news)


def _level_cell(result: dict, lv: dict) -> tuple[str, bool]:
    """A row's first cell: its rate in a sweep, else its concurrency."""
    return (f"{lv['rate']:g}" if is_sweep(result) else str(lv["concurrency"])), False


def table_cells(result: dict) -> Cells:
    """The latency table's columns and rows (failures are bad news), for the terminal and the HTML report."""
    cols = ["rate" if is_sweep(result) else "conc.", "ok", "failed", "wall s", "req/s", "out tok/s", "TTFT p50 p90 p99",
            "TPOT p50", "ITL p50 p90 p99", "e2e p50 p90 p99", "prompt tok", "cache hit"]
    rows = []
    for lv in result["levels"]:
        fail = (str(lv["failed"]), False) if not lv["failed"] else (", ".join(f"{n} {k}" for k, n in lv["failures"].items()), True)
        rows.append([
            _level_cell(result, lv), (str(lv["completed"]), False), fail, (f"{lv['wall_s']:.2f}", False),
            ("-" if lv["request_throughput"] is None else f"{lv['request_throughput']:.2f}", False),
            ("-" if lv["output_token_throughput"] is None else f"{lv['output_token_throughput']:.1f}", False),
            (_percentiles(lv["ttft"]), False), (_ms(lv["tpot"], "p50_ms"), False), (_percentiles(lv["itl"]), False),
            (_percentiles(lv["e2e"]), False),
            ("-" if lv.get("prompt_tokens") is None else str(lv["prompt_tokens"]), False), (hit_rate_text(lv), False),
        ])
    return cols, rows


def goodput_title(result: dict) -> str:
    s = result["settings"]
    return (f"goodput: a request is good when it completed with {goals_text(s['goodput'])}; a level holds when at least "
            f"{100 * slo_fraction_of(s):g}% of its requests are good")


def goodput_cells(result: dict) -> Cells:
    """The goodput table's columns and rows (a level that missed is bad news): its own table, so that the latency
    table keeps its width (it fills 80 columns already)."""
    cols = ["rate" if is_sweep(result) else "conc.", "sent", "good", "good %", "goodput req/s", "req/s", "holds"]
    rows = []
    for lv in result["levels"]:
        fraction, goodput, throughput = lv.get("good_fraction"), lv.get("goodput_rps"), lv["request_throughput"]
        rows.append([
            _level_cell(result, lv), (str(lv["requests"]), False), ("-" if lv.get("good") is None else str(lv["good"]), False),
            ("-" if fraction is None else f"{100 * fraction:.1f}%", False), ("-" if goodput is None else f"{goodput:.2f}", False),
            ("-" if throughput is None else f"{throughput:.2f}", False),
            ("yes", False) if lv.get("meets_slo") else ("no", True),
        ])
    return cols, rows


def _table(title: str, caption: str | None, cells: Cells) -> Table:
    """Every column folding rather than cutting and never narrower than its longest figure, so that cells wrap between
    figures, not inside one (rich cuts a number that does not fit: `3…`)."""
    cols, rows = cells
    table = Table(title=title, caption=caption)
    for i, col in enumerate(cols):
        widest = max((len(word) for row in rows for word in row[i][0].split()), default=1)
        table.add_column(col, justify="right", overflow="fold", min_width=widest)
    for row in rows:
        table.add_row(*(f"[red]{escape(text)}[/]" if bad else escape(text) for text, bad in row))
    return table


def loadtest_table(result: dict) -> Table:
    """One row per level; each latency's p50, p90 and p99 in one cell, so that the figures stay whole at 80 columns."""
    return _table(table_title(result), TABLE_CAPTION, table_cells(result))


def loadtest_tables(result: dict) -> list[Table]:
    """The latency table and, with goals, the goodput table."""
    goals = result["settings"].get("goodput")
    return [loadtest_table(result), *([_table(goodput_title(result), None, goodput_cells(result))] if goals else [])]


def slo_summary(result: dict) -> str | None:
    """With goals, the operator's answer in one line: the highest rate (else closed-loop concurrency) at which at
    least slo_fraction of the requests met every goal, or that none did; and where a sweep stopped early. None
    without goals (and for results older than version 3)."""
    s = result["settings"]
    goals = s.get("goodput")
    if not goals:
        return None
    levels = result["levels"]
    share, goal = f"{100 * slo_fraction_of(s):g}%", goals_text(goals)
    if any(lv.get("rate") is not None for lv in levels):
        best = result.get("max_rate_within_slo")
        held = next((lv for lv in levels if lv.get("rate") == best and holds(lv, slo_fraction_of(s))), None)
        tried = sorted({lv["rate"] for lv in levels if lv.get("rate") is not None})
        text = (f"highest rate within SLO: {best:g} req/s (at least {share} of requests met {goal}; "
                f"goodput {held['goodput_rps']:.2f} req/s)" if held
                else f"no rate within SLO: fewer than {share} of requests met {goal} at every rate tried ({_rates_text(tried)})")
    else:
        best = result.get("max_concurrency_within_slo")
        tried = [lv["concurrency"] for lv in levels]
        text = (f"highest concurrency within SLO: {best} (at least {share} of requests met {goal})" if best is not None
                else f"no concurrency within SLO: fewer than {share} of requests met {goal} at every concurrency tried "
                     f"({', '.join(map(str, tried))})")
    if result.get("rates_not_run"):
        text += (f"; the sweep stopped after {s.get('stop_after_misses')} consecutive rates missed "
                 f"({_rates_text(result['rates_not_run'])} not run)")
    return text


def x_axis(result: dict) -> tuple[str, list[float]]:
    """What the levels vary, for the plots: the offered rate in a sweep, else the concurrency."""
    if is_sweep(result):
        return "offered rate (requests/s)", [lv["rate"] for lv in result["levels"]]
    return "concurrency (requests in flight)", [lv["concurrency"] for lv in result["levels"]]


def plot_loadtest(result: dict, path: Path) -> None:
    """Latency (p50/p99 of e2e and TTFT) against output-token throughput, one point per level; for a sweep or with
    goals, beside it request throughput and goodput (req/s) and the share of good requests against what the levels
    vary (the offered rate, else the concurrency)."""
    plt = require_matplotlib()
    goals = bool(result["settings"].get("goodput"))
    wide = goals or is_sweep(result)
    fig, axes = plt.subplots(1, 2 if wide else 1, figsize=(13 if wide else 8, 5), squeeze=False)
    ax = axes[0][0]
    levels = [lv for lv in result["levels"] if lv["e2e"] and lv["ttft"]]
    x = [lv["output_token_throughput"] for lv in levels]
    for metric, key, style in (("e2e", "p50_ms", "o-"), ("e2e", "p99_ms", "o--"), ("ttft", "p50_ms", "s-"), ("ttft", "p99_ms", "s--")):
        ax.plot(x, [lv[metric][key] for lv in levels], style, label=f"{metric} {key[:3]}")
    for lv, xi in zip(levels, x):
        label = f"{lv['rate']:g}/s" if is_sweep(result) else f"c={lv['concurrency']}"
        ax.annotate(label, (xi, lv["e2e"]["p50_ms"]), textcoords="offset points", xytext=(4, 4), fontsize=8)
    s = result["settings"]
    ax.set(xlabel="output tokens/s", ylabel="latency (ms, log scale)", yscale="log",
           title=f"gpt2x loadtest: {s['model']} at {s['url']} (max_tokens {s['max_tokens']})")
    if wide:
        _plot_goodput(axes[0][1], result)
    for a in axes[0]:
        a.grid(alpha=0.3)
        a.legend(fontsize=8)
    save_png(fig, path)


def _plot_goodput(ax, result: dict) -> None:
    """Request throughput and goodput, and (right axis) the share of good requests with the SLO's line."""
    xlabel, xs = x_axis(result)
    levels = result["levels"]
    ax.plot(xs, [lv["request_throughput"] or 0 for lv in levels], "o-", label="completed req/s")
    if is_sweep(result):
        ax.plot(xs, xs, ":", color="grey", label="offered req/s")
    ax.set(xlabel=xlabel, ylabel="requests/s", title="throughput and goodput", ylim=(0, None))
    goals = result["settings"].get("goodput")
    if not goals:
        return
    ax.plot(xs, [lv["goodput_rps"] or 0 for lv in levels], "s-", label="goodput req/s")
    share = ax.twinx()
    share.plot(xs, [100 * lv["good_fraction"] for lv in levels], "^--", color="tab:green", label="good %")
    share.axhline(100 * slo_fraction_of(result["settings"]), color="tab:red", linestyle=":", label="SLO")
    share.set(ylabel=f"good requests % ({goals_text(goals)})", ylim=(0, 105))
    share.legend(fontsize=8, loc="lower left")
