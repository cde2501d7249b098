"""`gpt2x eval`: lm-evaluation-harness tasks on a gpt2x backend (the `gpt2x` model class of gpt2x.lmeval)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer

from ..choices import BackendKind, ProviderKind
from ..errors import UsageError
from ..runtime.registry import refuse_export_folder
from .options import (
    BACKEND_DEFAULT,
    ExportsOpt,
    JsonOpt,
    ModelOptional,
    OutputOpt,
    PrecisionOpt,
    RevisionOpt,
    Status,
    ThreadsOpt,
    notice,
    parse_list,
    print_tables,
    progress_to,
    write_json,
)

EPILOG = ("Examples:\n\n"
    "  gpt2x eval --model shakespeare --tasks gpt2x_shakespeare_mc,gpt2x_shakespeare_ppl --include-path tests/data/lm_eval_tasks\n\n"
    "  gpt2x eval --model gpt2 --precision int8 --tasks lambada_openai,hellaswag --limit 200 --output gpt2-int8.json\n\n"
    "  gpt2x eval --tasks gpt2x_shakespeare_mc --include-path tests/data/lm_eval_tasks --limit 8 --json | jq .results\n\n"
    "  gpt2x eval --model gpt2 --backend torch --tasks arc_easy --num-fewshot 5 --batch-size 16")


def eval(
    tasks: Annotated[str, typer.Option(help="Comma-separated lm-eval task or group names (lm-eval's own, or those of --include-path).")],
    model: ModelOptional = None,
    revision: RevisionOpt = None,
    exports: ExportsOpt = None,
    backend: Annotated[Optional[BackendKind], typer.Option(
        help=f"ort, openvino, genai, web: the export (made first if missing); torch: the PyTorch reference ({BACKEND_DEFAULT}).",
        show_default=False)] = None,
    provider: Annotated[ProviderKind, typer.Option(help="Device for the backend.")] = ProviderKind.cpu,
    precision: PrecisionOpt = None,
    onnx_dir: Annotated[Optional[Path], typer.Option("--onnx", help="Export folder to run (default: EXPORTS/MODEL-PRECISION, see --exports).")] = None,
    threads: ThreadsOpt = None,
    include_path: Annotated[Optional[list[Path]], typer.Option(
        help="A folder of lm-eval task YAML files (repeatable); its tasks take precedence over lm-eval's.")] = None,
    limit: Annotated[Optional[float], typer.Option(
        help="Documents per task (a number below 1: that fraction of them); for quick checks, not for reported scores.")] = None,
    num_fewshot: Annotated[Optional[int], typer.Option(help="Few-shot examples per prompt (default: each task's own).")] = None,
    batch_size: Annotated[int, typer.Option(min=1, help="Requests scored or generated together.")] = 8,
    max_gen_toks: Annotated[int, typer.Option(min=1, help="Most tokens a generation task generates (unless the task says).")] = 256,
    seed: Annotated[int, typer.Option(help="Seeds lm-eval (few-shot examples) and sampled generation.")] = 1234,
    as_json: JsonOpt = False,
    output: OutputOpt = None,
) -> None:
    """Evaluate a model with lm-evaluation-harness: accuracy, perplexity and generation tasks, any backend."""
    from ..workflows.backends import choose_backend  # the export side, imported when the command runs

    backend = choose_backend(backend, precision, provider, onnx_dir)
    if onnx_dir is not None:
        refuse_export_folder(backend, "--onnx")
    if limit is not None and limit <= 0:
        raise UsageError(f"--limit must be above 0, got {limit}")
    # deferred: lm-evaluation-harness is the eval extra (importing gpt2x.lmeval checks for it first)
    from ..lmeval.run import EvalSettings, evaluate, prepare, quiet_lm_eval, result_json, result_tables

    settings = EvalSettings(
        tasks=tuple(parse_list(tasks, str, "--tasks")), model=model, backend=backend, provider=provider, precision=precision,
        onnx_dir=onnx_dir, revision=revision, threads=threads, include_paths=tuple(include_path or ()),
        limit=None if limit is None else (int(limit) if limit >= 1 else limit), num_fewshot=num_fewshot,
        batch_size=batch_size, max_gen_toks=max_gen_toks, seed=seed, show_progress=Status.enabled,
    )
    if not Status.enabled:
        quiet_lm_eval()
    with Status("starting") as status:
        manager, lm = prepare(settings, progress=progress_to(status), notice=notice)
    result = evaluate(settings, manager, lm)  # progress bars on stderr
    write_json(result_json(result), as_json, output)  # lm-eval's results, and what ran
    print_tables(result_tables(result), as_json, markup=False)
