"""`gpt2x bench`: parity and tokens/sec of backends x precisions x batch sizes, against the roofline."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer

from ..bench.report import bench_tables, plot, require_matplotlib
from ..bench.run import REFERENCE, BenchSettings, run_bench
from ..bench.system import system_info
from ..choices import BackendKind, KvCache, Precision, ProviderKind
from ..errors import ParityError
from ..generation.speculative import DraftSettings
from ..runtime.providers import default_precisions
from ..runtime.registry import default_backend
from ..workflows.backends import require_provider
from ..workflows.drafts import DRAFT_HELP
from ..workflows.exports import require_bf16_cpu
from .options import (
    ExportsOpt,
    JsonOpt,
    KvCacheOpt,
    KvDtypeOpt,
    ModelOpt,
    NumSpeculativeTokensOpt,
    OutputOpt,
    PrefillOpt,
    Status,
    ThreadsOpt,
    notice,
    parse_list,
    print_tables,
    progress_to,
    write_json,
)

EPILOG = ("Examples:\n\n"
    "  gpt2x bench\n\n"
    "  gpt2x bench --model random:gpt2 --batch 1,4 --output bench.json --plot bench.png\n\n"
    "  gpt2x bench --backends ort --precisions fp32 --json > bench.json    (tables on stderr)\n\n"
    "  gpt2x bench --provider cuda --batch 1,8    (fp32 and fp16: the provider's precisions; fp16 on the fixed cache too)\n\n"
    "  gpt2x bench --backends ort --precisions fp32 --draft int4,ngram --num-speculative-tokens 5")


def default_backends(precisions: list[Precision] | None, provider: ProviderKind) -> list[BackendKind]:
    """The reference, then each precision's default runner (registry.default_backend), once each."""
    kinds = [REFERENCE]
    for precision in precisions or default_precisions(provider):
        kind = default_backend(precision, provider)
        if kind not in kinds:
            kinds.append(kind)
    return kinds


def bench(
    model: ModelOpt = "shakespeare",
    exports: ExportsOpt = None,
    prefill: PrefillOpt = None,
    kv_cache_dtype: KvDtypeOpt = None,
    provider: Annotated[ProviderKind, typer.Option(help="cpu, or cuda (fails clearly without a GPU).")] = ProviderKind.cpu,
    backends: Annotated[Optional[str], typer.Option(
        help="Comma-separated: torch, ort, openvino, genai, web (onnxruntime-web in headless Chromium). Default: torch "
        "and, for each precision, the backend that runs it by default (ort; bf16: openvino).", show_default=False)] = None,
    precisions: Annotated[Optional[str], typer.Option(
        help="Comma-separated: fp32, int8, int4, bf16 (openvino, on a CPU with AVX-512 BF16 or AMX), fp16 (CUDA). "
        "Default: the provider's own, fp32,int8 on cpu and fp32,fp16 on cuda.", show_default=False)] = None,
    batch: Annotated[str, typer.Option(help="Comma-separated batch sizes.")] = "1",
    prompt_len: Annotated[int, typer.Option(help="Prompt tokens per row.")] = 32,
    new_tokens: Annotated[int, typer.Option(help="Generated tokens per row (EOS does not stop a run).")] = 128,
    repeat: Annotated[int, typer.Option(help="Timed runs per configuration (median reported).")] = 3,
    threads: ThreadsOpt = None,
    text: Annotated[Optional[Path], typer.Option(help="UTF-8 text for perplexity (default: bundled held-out Shakespeare).")] = None,
    as_json: JsonOpt = False,
    output: OutputOpt = None,
    plot_file: Annotated[Optional[Path], typer.Option("--plot", help="Write a PNG plot (needs matplotlib).")] = None,
    draft: Annotated[Optional[str], typer.Option(
        help=f"Also measure speculative decoding with each of these comma-separated drafts: {DRAFT_HELP}. Greedy, at batch 1 "
        "(whatever --batch says), against plain decoding of the same target, on each backend x precision "
        "whose KV cache rolls back (not genai).")] = None,
    num_speculative_tokens: NumSpeculativeTokensOpt = DraftSettings.num_speculative_tokens,
    prompt_text: Annotated[Optional[str], typer.Option(
        help="The prompt of the --draft rows and their plain baseline, as text (all its tokens; "
        "default: --prompt-len random token ids, as the other rows).")] = None,
    kv_cache: KvCacheOpt = KvCache.auto,
    fixed_cache: Annotated[Optional[bool], typer.Option(
        "--fixed-cache/--no-fixed-cache",
        help="Also time the ort rows on the fixed-capacity cache (StaticDecoder: one buffer per layer bound as past and "
        "present, the argmax in the graph, the step in a CUDA graph on CUDA), at the precision it runs: fp16 on cuda, "
        "fp32 on cpu. Default: on with --provider cuda.", show_default=False)] = None,
) -> None:
    """Parity and tokens/sec of each backend x precision x batch, against the memory-bandwidth roofline."""
    asked = None if precisions is None else parse_list(precisions, Precision, "--precisions")
    if asked is not None and Precision.bf16 in asked:  # before any work
        require_bf16_cpu("--precisions bf16", "precisions")
    settings = BenchSettings(
        model=model, provider=provider,
        backends=default_backends(asked, provider) if backends is None else parse_list(backends, BackendKind, "--backends"),
        precisions=asked,
        batches=parse_list(batch, int, "--batch"),
        prompt_len=prompt_len, new_tokens=new_tokens, repeat=repeat, threads=threads, text=text,
        drafts=parse_list(draft or "", str, "--draft"), num_speculative_tokens=num_speculative_tokens,
        prompt_text=prompt_text, kv_cache=kv_cache, fixed_cache=fixed_cache,
    )
    if plot_file:
        require_matplotlib()
    require_provider(settings.backends, provider)
    with Status("starting") as status:
        result = run_bench(settings, system_info(), progress=progress_to(status), notice=notice)
    write_json(result.to_json(), as_json, output)
    if plot_file:
        plot(result, plot_file)
    print_tables(bench_tables(result), as_json)
    if not result.passed:
        failed = [f"{p.backend.value}/{p.precision.value}: {p.message}" for p in result.parity if not p.passed]
        raise ParityError("parity gate failed: " + "; ".join(failed))
