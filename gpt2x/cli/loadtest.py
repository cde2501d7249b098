"""`gpt2x loadtest`: any OpenAI-compatible completions endpoint under concurrent streaming load."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.text import Text

from ..bench.report import require_matplotlib
from ..bench.system import system_info
from ..errors import EndpointError, MissingDependencyError, UsageError
from ..generation.settings import SamplingSettings
from .options import JsonOpt, OutputOpt, Status, parse_list, print_tables, progress_to, read_prompts_file, write_json

EPILOG = ("Examples:\n\n"
    "  gpt2x loadtest http://127.0.0.1:8000 --requests 200 --concurrency 1,4,16\n\n"
    "  gpt2x loadtest http://127.0.0.1:8080/v1 --rate 4 --max-tokens 128 --output lt.json --plot lt.png\n\n"
    "  gpt2x loadtest http://127.0.0.1:8000 --requests 50 --concurrency 4 --json | jq '.levels[0].ttft.p50_ms'\n\n"
    "  gpt2x loadtest http://127.0.0.1:8000 --shared-prefix-tokens 512 --prefixes 4 --suffix-tokens 32 --concurrency 1,16\n\n"
    "  gpt2x loadtest http://127.0.0.1:8000 --rates 1,2,4,8 --goodput ttft:500 --goodput tpot:50 --report lt.html\n\n"
    "  gpt2x loadtest http://127.0.0.1:8000 --sweep-rate 1:10:1 --goodput ttft:500,e2el:4000 --slo-fraction 0.99\n\n"
    "  GPT2X_API_KEY=... gpt2x loadtest https://my-server.example --model my-model --prompts-file prompts.txt")


def require_httpx() -> None:
    if importlib.util.find_spec("httpx") is None:
        raise MissingDependencyError("gpt2x loadtest needs httpx: pip install 'gpt2x[serve]'")


def loadtest(
    url: Annotated[str, typer.Argument(help="The server's base URL (http://host:port, with or without /v1).")],
    model: Annotated[Optional[str], typer.Option(help="Sent as \"model\" (default: the first id from GET /v1/models).")] = None,
    requests: Annotated[int, typer.Option(help="Requests per level (per concurrency, or per rate of a sweep).")] = 200,
    concurrency: Annotated[Optional[str], typer.Option(
        help="Comma-separated: requests in flight, one level after another (default 1,4,16). With --rates or "
             "--sweep-rate, one value: the most in flight (default: no cap).", show_default=False)] = None,
    rate: Annotated[Optional[float], typer.Option(help="Poisson arrivals at this many requests/s (default: closed loop).")] = None,
    rates: Annotated[Optional[str], typer.Option(
        help="A rate sweep: comma-separated requests/s, one level each (Poisson arrivals), lowest first.",
        show_default=False)] = None,
    sweep_rate: Annotated[Optional[str], typer.Option(
        metavar="START:STOP:STEP", help="A rate sweep: START, START+STEP, ... up to STOP requests/s, one level each.",
        show_default=False)] = None,
    goodput: Annotated[Optional[list[str]], typer.Option(
        metavar="METRIC:MS", show_default=False,
        help="A latency goal (repeatable, or comma-separated): a request is good when it completed and each goal's "
             "metric is at or below it, in ms. ttft, tpot ((e2e - ttft) / (output tokens - 1)) and e2el as vLLM's "
             "--goodput; itl: the request's longest gap between chunks. Adds each level's goodput (good requests/s) "
             "and good share, and the highest rate at which --slo-fraction of requests were good.")] = None,
    slo_fraction: Annotated[float, typer.Option(
        help="With --goodput: a level holds the goals when at least this share of its requests are good.")] = 0.9,
    stop_after_misses: Annotated[int, typer.Option(
        help="With --goodput, a sweep stops after this many consecutive rates missed the goals (0: run every rate).")] = 2,
    max_tokens: Annotated[int, typer.Option(help="max_tokens of each request.")] = 64,
    temperature: Annotated[float, typer.Option(help="Sampling temperature sent to the server (0: greedy).")] = SamplingSettings.temperature,
    prompts_file: Annotated[Optional[Path], typer.Option(help="UTF-8 file, one prompt per line (default: a few Shakespeare openings).")] = None,
    api_key: Annotated[Optional[str], typer.Option(envvar="GPT2X_API_KEY", help="Sent as Authorization: Bearer KEY.", show_default=False)] = None,
    timeout: Annotated[float, typer.Option(help="Seconds per request, connect to last token.")] = 60.0,
    max_duration: Annotated[Optional[float], typer.Option(help="Seconds per level; unfinished requests count as failed.")] = None,
    shared_prefix_tokens: Annotated[int, typer.Option(
        help="Shared-prefix workload: each prompt is one of --prefixes prefixes of this many GPT-2 tokens (bundled "
             "Shakespeare), a newline and its own suffix; the table shows the server's prefix-cache hit rate. 0: off.")] = 0,
    prefixes: Annotated[int, typer.Option(help="How many different shared prefixes (with --shared-prefix-tokens).")] = 1,
    suffix_tokens: Annotated[int, typer.Option(help="About this many tokens after the shared prefix, each prompt its own.")] = 32,
    as_json: JsonOpt = False,
    output: OutputOpt = None,
    plot_file: Annotated[Optional[Path], typer.Option(
        "--plot", help="Write a PNG: latency against output tokens/s; for a sweep or with --goodput, also throughput, "
                       "goodput and good share against the rate (needs matplotlib).")] = None,
    report_file: Annotated[Optional[Path], typer.Option(
        "--report", help="Write a self-contained HTML report: the table, the SLO summary and inline SVG charts.")] = None,
) -> None:
    """TTFT, TPOT, inter-token and end-to-end latency, throughput and failures of a streaming completions endpoint."""
    require_httpx()
    from ..bench import loadtest as lt  # deferred: httpx is an extra, the CLI imports without it

    sweep = lt.parse_rates(rates, sweep_rate)
    # a sweep's default: no cap beyond the level's requests (vLLM's --max-concurrency default), so that an overloaded
    # server queues requests and misses its goals rather than the client holding arrivals back
    levels = concurrency or (str(requests) if sweep else "1,4,16")
    settings = lt.LoadtestSettings(
        url=url, model=model, requests=requests, concurrency=parse_list(levels, int, "--concurrency"), rate=rate,
        rates=sweep, max_tokens=max_tokens, temperature=temperature, api_key=api_key, timeout=timeout,
        max_duration=max_duration, shared_prefix_tokens=shared_prefix_tokens, prefixes=prefixes, suffix_tokens=suffix_tokens,
        goodput=lt.parse_goals(goodput or []), slo_fraction=slo_fraction, stop_after_misses=stop_after_misses,
    )
    if prompts_file and shared_prefix_tokens:
        raise UsageError("--prompts-file and --shared-prefix-tokens cannot be used together (the shared-prefix prompts are generated)",
                         option="prompts_file")
    if prompts_file:
        settings.prompts = read_prompts_file(prompts_file)
    settings.validate()
    if plot_file:
        require_matplotlib()
    with Status(f"connecting to {url}") as status:
        result = lt.run_loadtest(settings, system_info(), progress=progress_to(status))
    write_json(json.dumps(result, indent=1) + "\n", as_json, output)
    if plot_file:
        lt.plot_loadtest(result, plot_file)
    if report_file:
        from ..bench.loadtest_report import write_report

        write_report(result, report_file)
    summary = lt.slo_summary(result)
    print_tables([*lt.loadtest_tables(result), *([Text(summary)] if summary else [])], as_json)
    if lt.all_failed(result):
        raise EndpointError(f"every request failed: {lt.failure_summary(result)}")
