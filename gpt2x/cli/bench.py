"""`gpt2x bench`: parity and tokens/sec of backends x precisions x batch sizes, against the roofline."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Optional

import typer

from ..bench.report import bench_tables, plot, require_matplotlib
from ..bench.run import BenchSettings, run_bench
from ..bench.system import system_info
from ..choices import BackendKind, Precision, ProviderKind
from ..errors import ParityError
from ..fileio import write_atomic
from ..generation.speculative import DraftSettings
from ..workflows import DRAFT_HELP, require_provider
from .options import ModelOpt, Status, ThreadsOpt, out, parse_list, progress_to

EPILOG = ("Examples:\n\n"
    "  gpt2x bench\n\n"
    "  gpt2x bench --model random:gpt2 --batch 1,4 --json bench.json --plot bench.png\n\n"
    "  gpt2x bench --provider cuda --precisions fp32,fp16 --batch 1,8\n\n"
    "  gpt2x bench --backends ort --precisions fp32 --draft int4,ngram --draft-tokens 5")


def bench(
    model: ModelOpt = "shakespeare",
    provider: Annotated[ProviderKind, typer.Option(help="cpu, or cuda (fails clearly without a GPU).")] = ProviderKind.cpu,
    backends: Annotated[str, typer.Option(help="Comma-separated: torch, ort, openvino, genai, web (onnxruntime-web in headless Chromium).")] = "torch,ort",
    precisions: Annotated[str, typer.Option(help="Comma-separated: fp32, int8, int4, fp16 (CUDA).")] = "fp32,int8,fp16",
    batch: Annotated[str, typer.Option(help="Comma-separated batch sizes.")] = "1",
    prompt_len: Annotated[int, typer.Option(help="Prompt tokens per row.")] = 32,
    new_tokens: Annotated[int, typer.Option(help="Generated tokens per row (EOS does not stop a run).")] = 128,
    repeat: Annotated[int, typer.Option(help="Timed runs per configuration (median reported).")] = 3,
    threads: ThreadsOpt = None,
    text: Annotated[Optional[Path], typer.Option(help="UTF-8 text for perplexity (default: bundled held-out Shakespeare).")] = None,
    json_file: Annotated[Optional[Path], typer.Option("--json", help="Write every figure to this JSON file.")] = None,
    plot_file: Annotated[Optional[Path], typer.Option("--plot", help="Write a PNG plot (needs matplotlib).")] = None,
    draft: Annotated[Optional[str], typer.Option(
        help=f"Also measure speculative decoding with each of these comma-separated drafts: {DRAFT_HELP}. Greedy, at batch 1 "
        "(whatever --batch says), against plain decoding of the same target, on each backend x precision "
        "whose KV cache rolls back (not genai).")] = None,
    draft_tokens: Annotated[int, typer.Option(
        help="Most tokens drafted per verification (K; adaptive below it).")] = DraftSettings.max_tokens,
    prompt_text: Annotated[Optional[str], typer.Option(
        help="The prompt of the --draft rows and their plain baseline, as text (all its tokens; "
        "default: --prompt-len random token ids, as the other rows).")] = None,
) -> None:
    """Parity and tokens/sec of each backend x precision x batch, against the memory-bandwidth roofline."""
    settings = BenchSettings(
        model=model, provider=provider, backends=parse_list(backends, BackendKind, "--backends"),
        precisions=parse_list(precisions, Precision, "--precisions"), batches=parse_list(batch, int, "--batch"),
        prompt_len=prompt_len, new_tokens=new_tokens, repeat=repeat, threads=threads, text=text,
        drafts=parse_list(draft or "", str, "--draft"), draft_tokens=draft_tokens, prompt_text=prompt_text,
    )
    if plot_file:
        require_matplotlib()
    require_provider(settings.backends, provider)
    with Status("starting") as status:
        result = run_bench(settings, system_info(), progress=progress_to(status))
    if json_file:
        write_atomic(json_file, json.dumps(result, indent=1) + "\n")
    if plot_file:
        plot(result, plot_file)
    for table in bench_tables(result):
        out.print(table)
    if not result["passed"]:
        failed = [f"{p['backend']}/{p['precision']}: {p['message']}" for p in result["parity"] if not p["passed"]]
        raise ParityError("parity gate failed: " + "; ".join(failed))
