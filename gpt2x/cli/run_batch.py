"""`gpt2x run-batch`: an OpenAI batch file (one request a line) answered offline by an export, vLLM's `run-batch`."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Annotated, Optional

import typer

from ..choices import BackendKind, Precision, ProviderKind
from ..errors import UsageError
from .options import BACKEND_DEFAULT, ExportsOpt, ModelOptional, Status, ThreadsOpt, read_text_file
from .options import out as console
from .serve import require_serve_extra

EPILOG = ("Examples:\n\n"
    "  gpt2x run-batch -i requests.jsonl -o answers.jsonl\n\n"
    "  gpt2x run-batch -i requests.jsonl -o answers.jsonl --model gpt2 --precision int8 --resume")


def run_batch(
    input_file: Annotated[Path, typer.Option("--input", "-i", help="The batch file: one request a line, OpenAI's format "
                                             "(custom_id, method POST, url /v1/completions or /v1/chat/completions, body).")],
    output_file: Annotated[Path, typer.Option("--output", "-o", help="Where the answers go, one line per request, in "
                                              "order (OpenAI's batch output).")],
    model: ModelOptional = None,
    precision: Annotated[Optional[Precision], typer.Option(help="The export's precision (default fp32).")] = None,
    backend: Annotated[Optional[BackendKind], typer.Option(help=f"ort, openvino or genai ({BACKEND_DEFAULT}).",
                                                           show_default=False)] = None,
    exports: ExportsOpt = None,
    threads: ThreadsOpt = None,
    max_batch_size: Annotated[int, typer.Option(min=1, help="Requests decoded together.")] = 16,
    resume: Annotated[bool, typer.Option("--resume", help="Go on with an output an earlier run left: its requests "
                                         "(by custom_id) are skipped, a half-written last line is written again.")] = False,
) -> None:
    """Answer an OpenAI batch file offline, as `gpt2x serve` would answer its requests (vLLM's run-batch)."""
    require_serve_extra()
    from ..workflows.backends import choose_backend  # the export side, imported when the command runs

    backend = choose_backend(backend, precision, ProviderKind.cpu)
    # deferred: the serve extra's
    from ..serve.batch_file import open_output
    from ..serve.batch_file import run_batch as run
    from ..serve.offline import LLM

    lines = [line for line in read_text_file(input_file, "batch file").splitlines() if line.strip()]
    if not lines:
        raise UsageError(f"{input_file} holds no request")
    out, done = open_output(output_file, resume)
    with out:
        with Status("opening the export"):
            llm = LLM(model or "shakespeare", precision=precision, backend=backend.value, threads=threads,
                      max_batch_size=max_batch_size)
        try:
            from tqdm import tqdm

            with tqdm(total=len(lines), initial=0, desc="gpt2x run-batch", unit="line", file=sys.stderr,
                      disable=not Status.enabled) as bar:
                counts = run(llm, lines, out, done, bar.update)
        finally:
            llm.close()
    console.print(f"{counts['ok']} answered, {counts['refused']} refused by the API, {counts['invalid']} not requests"
                  + (f", {len(done)} answered before (--resume)" if done else "") + f": {output_file}", markup=False)
