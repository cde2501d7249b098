"""`gpt2x loadtest`: any OpenAI-compatible completions endpoint under concurrent streaming load."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from typing import Annotated, Optional

import typer

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
    "  GPT2X_API_KEY=... gpt2x loadtest https://my-server.example --model my-model --prompts-file prompts.txt")


def require_httpx() -> None:
    if importlib.util.find_spec("httpx") is None:
        raise MissingDependencyError("gpt2x loadtest needs httpx: pip install 'gpt2x[serve]'")


def loadtest(
    url: Annotated[str, typer.Argument(help="The server's base URL (http://host:port, with or without /v1).")],
    model: Annotated[Optional[str], typer.Option(help="Sent as \"model\" (default: the first id from GET /v1/models).")] = None,
    requests: Annotated[int, typer.Option(help="Requests per concurrency level.")] = 200,
    concurrency: Annotated[str, typer.Option(help="Comma-separated: requests in flight, one level after another.")] = "1,4,16",
    rate: Annotated[Optional[float], typer.Option(help="Poisson arrivals at this many requests/s (default: closed loop).")] = None,
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
    plot_file: Annotated[Optional[Path], typer.Option("--plot", help="Write a PNG: latency against output tokens/s (needs matplotlib).")] = None,
) -> None:
    """TTFT, TPOT, inter-token and end-to-end latency, throughput and failures of a streaming completions endpoint."""
    require_httpx()
    from ..bench import loadtest as lt  # deferred: httpx is an extra, the CLI imports without it

    settings = lt.LoadtestSettings(
        url=url, model=model, requests=requests, concurrency=parse_list(concurrency, int, "--concurrency"), rate=rate,
        max_tokens=max_tokens, temperature=temperature, api_key=api_key, timeout=timeout, max_duration=max_duration,
        shared_prefix_tokens=shared_prefix_tokens, prefixes=prefixes, suffix_tokens=suffix_tokens,
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
    print_tables([lt.loadtest_table(result)], as_json)
    if lt.all_failed(result):
        raise EndpointError(f"every request failed: {lt.failure_summary(result)}")
