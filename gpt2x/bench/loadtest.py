"""Load test of any OpenAI-compatible completions endpoint: streamed requests in a closed loop or Poisson arrivals,
reported per concurrency level as vLLM's serving benchmark reports them, optionally on a shared-prefix workload
(docs/commands/loadtest.md). It talks only to the URL given, and bounds every request.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from importlib import resources
from pathlib import Path
from urllib.parse import urlsplit

import httpx
from rich.table import Table

from ..errors import EndpointError, UsageError
from ..evaluate.metrics import summarize_latencies
from ..generation.settings import SamplingSettings
from ..tokenizer import decode, encode
from .report import require_matplotlib, save_png

# 2: each level's prompt_tokens, cached_prompt_tokens, prefix_cache_hit_rate and prompt_tokens_stated;
# the settings' shared_prefix_tokens, prefixes, suffix_tokens and prefix_token_counts. Readers of a
# version-1 file (loadtest_table, plot_loadtest) take the missing keys as "not stated".
SCHEMA_VERSION = 2

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
    seed: int = 0  # Poisson arrival times; the shared-prefix prompts and their order
    shared_prefix_tokens: int = 0  # > 0: the shared-prefix workload (replaces `prompts`)
    prefixes: int = 1  # how many different shared prefixes
    suffix_tokens: int = 32  # about this many tokens after each prompt's prefix, its own

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


MAX_WORKLOAD_SIZE = 100_000  # tokens of a prefix or suffix, prefixes: beyond any model's context


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


def _summary(values: list[float]) -> dict | None:
    """Percentiles and mean in ms, and the largest (`max_ms`: one stall in thousands of gaps is past any p99)."""
    return {**summarize_latencies(values), "max_ms": max(values) * 1e3} if values else None


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
    stated = [r for r in ok if r.prompt_tokens is not None]
    cache_stated = [r for r in stated if r.cached_tokens is not None]
    prompt_tokens = sum(r.prompt_tokens or 0 for r in stated) if stated else None
    cached = sum(r.cached_tokens or 0 for r in cache_stated) if cache_stated else None
    cache_prompt = sum(r.prompt_tokens or 0 for r in cache_stated)
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
        "prompt_tokens": prompt_tokens,  # summed over the completed requests whose server stated them; None: none did
        "prompt_tokens_stated": len(stated),  # requests that stated their prompt tokens
        "cached_prompt_tokens": cached,  # None: the server stated no cached tokens
        # cached / prompt tokens over the requests that stated both
        "prefix_cache_hit_rate": cached / cache_prompt if cache_stated and cache_prompt > 0 else None,
    }


async def run_level(client: httpx.AsyncClient, settings: LoadtestSettings, model: str, concurrency: int,
                    progress: Callable[[str], None], prompts: list[str] | None = None) -> dict:
    """One level; request i sends prompts[i % len(prompts)] (default: the settings' prompts)."""
    prompts = prompts or settings.prompts
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


def level_prompts(settings: LoadtestSettings) -> tuple[list[list[str]], list[int] | None]:
    """Each level's prompts and the shared prefixes' token counts (None: not that workload). No suffix repeats in a
    run: a prompt sent whole a level before would be a cache hit beyond its prefix."""
    if not settings.shared_prefix_tokens:
        return [settings.prompts] * len(settings.concurrency), None
    n = settings.requests
    prompts, _, counts = shared_prefix_prompts(settings.shared_prefix_tokens, settings.prefixes, settings.suffix_tokens,
                                               n * len(settings.concurrency), settings.seed, block=n)
    return [prompts[i * n : (i + 1) * n] for i in range(len(settings.concurrency))], counts


async def _run(settings: LoadtestSettings, prompts: list[list[str]], progress: Callable[[str], None]) -> tuple[str, list[dict]]:
    limits = httpx.Limits(max_connections=max(settings.concurrency), max_keepalive_connections=max(settings.concurrency))
    async with httpx.AsyncClient(timeout=httpx.Timeout(settings.timeout), limits=limits) as client:
        model = await discover_model(client, settings)
        levels = []
        for c, level in zip(settings.concurrency, prompts):
            progress(f"concurrency {c}: starting")
            levels.append(await run_level(client, settings, model, c, progress, level))
        return model, levels


def run_loadtest(settings: LoadtestSettings, environment: dict, progress: Callable[[str], None] = lambda _: None) -> dict:
    """Every concurrency level in turn, JSON-ready. EndpointError only if the server cannot be reached at the start."""
    settings.validate()
    prompts, prefix_counts = level_prompts(settings)
    model, levels = asyncio.run(_run(settings, prompts, progress))
    return {
        "schema_version": SCHEMA_VERSION,
        "settings": {**asdict(settings), "url": base_url(settings.url), "api_key": "***" if settings.api_key else None,
                     "model": model, "prompts": len(prompts[0]) if prefix_counts else len(settings.prompts),
                     "prefix_token_counts": prefix_counts},
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


def loadtest_table(result: dict) -> Table:
    """One row per concurrency level; each latency's p50, p90 and p99 in one cell, and every column folding rather
    than cutting, so that the figures stay whole at 80 columns (rich cuts a number that does not fit: `3…`)."""
    s = result["settings"]
    mode = f"Poisson {s['rate']:g} req/s" if s["rate"] else "closed loop"
    table = Table(title=f"loadtest {s['url']} (model {s['model']}, {s['requests']} requests per level, {mode}, "
                        f"max_tokens {s['max_tokens']}, {workload_text(s)})")
    cols = ("conc.", "ok", "failed", "wall s", "req/s", "out tok/s", "TTFT p50 p90 p99", "TPOT p50", "ITL p50 p90 p99",
            "e2e p50 p90 p99", "prompt tok", "cache hit")
    rows = []
    for lv in result["levels"]:
        fail = str(lv["failed"]) if not lv["failed"] else "[red]" + ", ".join(f"{n} {k}" for k, n in lv["failures"].items()) + "[/]"
        rows.append((
            str(lv["concurrency"]), str(lv["completed"]), fail, f"{lv['wall_s']:.2f}",
            "-" if lv["request_throughput"] is None else f"{lv['request_throughput']:.2f}",
            "-" if lv["output_token_throughput"] is None else f"{lv['output_token_throughput']:.1f}",
            _percentiles(lv["ttft"]), _ms(lv["tpot"], "p50_ms"), _percentiles(lv["itl"]), _percentiles(lv["e2e"]),
            "-" if lv.get("prompt_tokens") is None else str(lv["prompt_tokens"]), hit_rate_text(lv),
        ))
    for i, col in enumerate(cols):  # never narrower than its longest figure: cells wrap between figures, not inside
        widest = max((len(word) for row in rows for word in row[i].split()), default=1)
        table.add_column(col, justify="right", overflow="fold", min_width=widest)
    for row in rows:
        table.add_row(*row)
    table.caption = ("latencies in ms (p50 p90 p99); TTFT: time to first token, TPOT: time per output token after the "
                     "first, ITL: between chunks; prompt tok: as the server states them; cache hit: its cached / prompt "
                     "tokens (n/a: it states none)")
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
