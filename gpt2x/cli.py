"""The `gpt2x` command line. It only wires library calls together and prints: results to stdout,
progress and errors to stderr, `--json` for scripts. Exceptions become exit codes in `main()` alone."""

from __future__ import annotations

import json
import os
import sys
from enum import Enum
from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from . import __version__
from .choices import BackendKind, Precision, ProviderKind
from .errors import (
    INTERRUPTED_EXIT_CODE,
    ArtifactError,
    Gpt2xError,
    OutputError,
    ParityError,
    ProviderError,
    UsageError,
)

app = typer.Typer(
    name="gpt2x",
    help="GPT-2 from scratch in PyTorch, exported to ONNX with a KV cache, run on ONNX Runtime.",
    add_completion=True,
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    rich_markup_mode="markdown",
    epilog="Examples:\n\n"
    "  gpt2x generate \"ROMEO:\" --model shakespeare --backend torch\n\n"
    "  gpt2x export --model shakespeare --precision int8\n\n"
    "  gpt2x bench --model random:gpt2 --batch 1,4\n\n"
    "  gpt2x inspect gpt2 --seq-len 8",
)
out = Console(highlight=False, soft_wrap=True, width=None if sys.stdout.isatty() else 220)
err = Console(stderr=True, highlight=False)

ModelOpt = Annotated[
    str,
    typer.Option(
        "--model", "-m",
        help="`shakespeare` (bundled), a preset (gpt2, gpt2-medium, gpt2-large, gpt2-xl, distilgpt2), "
        "a hub repo id, a local Hugging Face folder or a .safetensors file.",
    ),
]
RevisionOpt = Annotated[Optional[str], typer.Option(help="Hub revision (branch, tag or commit) to pin.")]
JsonOpt = Annotated[bool, typer.Option("--json", help="Machine-readable JSON on stdout.")]
ModelOptional = Annotated[
    Optional[str],
    typer.Option("--model", "-m", help="As for `export` (default: shakespeare); checked against --onnx metadata when given."),
]
PrecisionOpt = Annotated[Optional[Precision], typer.Option(help="Export precision for --backend ort (default fp32).")]
ThreadsOpt = Annotated[Optional[int], typer.Option(min=1, help="CPU threads (default: the cores available).")]
DEFAULT_MODEL = "shakespeare"


def version_callback(value: bool) -> None:
    if value:
        out.print(f"gpt2x {__version__}")
        raise typer.Exit()


class _Progress:
    """Progress on stderr: a live spinner when stderr is a terminal and --quiet is not given,
    plain lines with GPT2X_PROGRESS=lines, nothing otherwise."""

    enabled = True

    def __init__(self, message: str):
        self.message = message
        self._status = None

    def __enter__(self) -> _Progress:
        if self.enabled and err.is_terminal:
            self._status = err.status(self.message)
            self._status.__enter__()
        elif self.enabled and os.environ.get("GPT2X_PROGRESS") == "lines":
            err.print(self.message, markup=False)
        return self

    def update(self, message: str) -> None:
        if self._status is not None:
            self._status.update(escape(message))
        elif self.enabled and os.environ.get("GPT2X_PROGRESS") == "lines":
            err.print(message, markup=False)

    def __exit__(self, *exc) -> None:
        if self._status is not None:
            self._status.__exit__(*exc)


@app.callback()
def root(
    version: Annotated[
        bool, typer.Option("--version", callback=version_callback, is_eager=True, help="Print the version and exit.")
    ] = False,
    quiet: Annotated[bool, typer.Option("--quiet", "-q", help="No progress output on stderr (errors still show).")] = False,
) -> None:
    """GPT-2 from scratch in PyTorch, exported to ONNX with a KV cache, run on ONNX Runtime.

    Examples:

        gpt2x generate "ROMEO:" --model shakespeare --backend torch

        gpt2x inspect gpt2 --seq-len 8
    """
    _Progress.enabled = not quiet


def read_prompts_file(path: Path) -> list[str]:
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise UsageError(f"prompts file not found: {path}") from None
    except UnicodeDecodeError:
        raise UsageError(f"prompts file is not UTF-8 text: {path}") from None
    except OSError as e:
        raise UsageError(f"cannot read prompts file {path}: {e.strerror}") from None
    prompts = [line for line in text.splitlines() if line.strip()]
    if not prompts:
        raise UsageError(f"prompts file has no prompts (one per line): {path}")
    return prompts


@app.command(
    epilog="Examples:\n\n"
    "  gpt2x generate \"ROMEO:\" --model shakespeare --backend torch --seed 1\n\n"
    "  gpt2x generate \"Hello, my name is\" --model gpt2 --greedy --max-new-tokens 20\n\n"
    "  gpt2x generate --prompts-file prompts.txt --model shakespeare --backend torch --json"
)
def generate(
    prompt: Annotated[Optional[str], typer.Argument(help="Text to continue (empty: start a new document).")] = None,
    model: ModelOptional = None,
    revision: RevisionOpt = None,
    backend: Annotated[BackendKind, typer.Option(help="ort: ONNX Runtime (exports on first use); torch: the PyTorch reference.")] = BackendKind.ort,
    provider: Annotated[ProviderKind, typer.Option(help="Device for the backend.")] = ProviderKind.cpu,
    precision: PrecisionOpt = None,
    onnx_dir: Annotated[Optional[Path], typer.Option("--onnx", help="Export folder to run (default: exported/<model>-<precision>).")] = None,
    threads: ThreadsOpt = None,
    max_new_tokens: Annotated[int, typer.Option(help="Tokens to generate (stops earlier at <|endoftext|> or the context limit).")] = 64,
    greedy: Annotated[bool, typer.Option("--greedy", help="Always take the most likely token.")] = False,
    temperature: Annotated[float, typer.Option(help="Sampling temperature (> 0).")] = 1.0,
    top_k: Annotated[int, typer.Option(help="Sample among the k most likely tokens (0: all).")] = 50,
    top_p: Annotated[float, typer.Option(help="Nucleus sampling threshold in (0, 1].")] = 1.0,
    seed: Annotated[Optional[int], typer.Option(help="Sampler seed: same seed, same text. Random if unset.")] = None,
    num_beams: Annotated[int, typer.Option(help="Beam search with this many beams (1: off).")] = 1,
    length_penalty: Annotated[float, typer.Option(help="Beam search length penalty (as in transformers).")] = 1.0,
    early_stopping: Annotated[bool, typer.Option(help="Beam search stops once num_beams hypotheses are done.")] = False,
    prompts_file: Annotated[Optional[Path], typer.Option(help="One prompt per line, generated as one left-padded batch.")] = None,
    truncate: Annotated[bool, typer.Option(help="Keep the end of prompts longer than the context instead of failing.")] = False,
    as_json: JsonOpt = False,
) -> None:
    """Generate text from a prompt (streamed to stdout) or from a file of prompts (one batch)."""
    from .generation import SamplingSettings
    from .generation import generate as run_generation
    from .tokenizer import StreamDecoder, decode

    if prompt is not None and prompts_file is not None:
        raise UsageError("give a PROMPT or --prompts-file, not both")
    prompts = read_prompts_file(prompts_file) if prompts_file else [prompt or ""]
    if seed is None:
        seed = int.from_bytes(os.urandom(4), "little")
    settings = SamplingSettings(
        max_new_tokens=max_new_tokens, greedy=greedy, temperature=temperature, top_k=top_k, top_p=top_p,
        seed=seed, num_beams=num_beams, length_penalty=length_penalty, early_stopping=early_stopping,
    )
    runner = make_backend(backend, provider, model, revision, precision, onnx_dir, threads)
    model_name = model or getattr(runner, "source_name", DEFAULT_MODEL)
    stream = len(prompts) == 1 and not as_json and num_beams == 1
    decoder = StreamDecoder()
    def write_token(row: int, tok: int) -> None:
        sys.stdout.write(decoder.push(tok))
        sys.stdout.flush()

    if stream:
        sys.stdout.write(prompts[0])
        sys.stdout.flush()
    results = run_generation(runner, prompts, settings, truncate=truncate, on_token=write_token if stream else None)
    if stream:
        sys.stdout.write(decoder.flush() + "\n")
    elif as_json:
        for r in results:
            print(json.dumps({
                "prompt": r.prompt, "prompt_tokens": r.prompt_tokens, "tokens": r.tokens, "text": decode(r.tokens),
                "finish_reason": r.finish_reason, "model": model_name, "backend": runner.name, "seed": seed,
            }))
    else:
        for i, r in enumerate(results):
            if i:
                print()
            print(r.prompt + decode(r.tokens))
    for r in results:
        if r.finish_reason == "context":
            err.print(f"note: stopped at the model's context limit ({runner.n_positions} tokens)")
            break


def make_backend(
    backend: BackendKind, provider: ProviderKind, model: str | None, revision: str | None,
    precision: Precision | None = None, onnx_dir: Path | None = None, threads: int | None = None,
):
    """The backend a command asked for. For ONNX Runtime without an export, export first."""
    if backend is BackendKind.torch:
        if precision not in (None, Precision.fp32) or onnx_dir is not None:
            raise UsageError("--precision and --onnx apply to --backend ort; the torch backend runs fp32")
        import torch

        from .backends import TorchBackend
        from .weights import load_model

        if provider is ProviderKind.cuda and not torch.cuda.is_available():
            raise ProviderError("--provider cuda: this PyTorch build sees no CUDA device")
        if threads:
            torch.set_num_threads(threads)
        with _Progress(f"loading {model or DEFAULT_MODEL}"):
            m, _ = load_model(model or DEFAULT_MODEL, revision)
        return TorchBackend(m, "cuda" if provider is ProviderKind.cuda else "cpu")

    from .export import default_export_dir, read_export
    from .runtime import OrtBackend

    wanted = precision or Precision.fp32
    folder = onnx_dir or default_export_dir(model or DEFAULT_MODEL, wanted)
    if onnx_dir is None and not (folder / "gpt2x.json").exists():
        err.print(f"no export at {folder}: exporting {model or DEFAULT_MODEL} ({wanted.value}) first")
        run_export(model or DEFAULT_MODEL, revision, wanted, folder, force=False)
    info = read_export(folder)
    if precision is not None and info.precision is not precision:
        raise UsageError(f"{folder} is a {info.precision.value} export, not {precision.value}")
    if model is not None or onnx_dir is None:  # the default folder must hold the default model
        check_export_matches(info, model or DEFAULT_MODEL, revision)
    return OrtBackend(info, provider, threads)


def check_export_matches(info, model: str, revision: str | None) -> None:
    """An export used for `model` must come from it: same config, and for the bundled model (cheap
    to hash) the same weights, so an export left over from another gpt2x version is not run."""
    from .export import weights_fingerprint
    from .weights import BUNDLED, resolve, resolve_config

    cfg = resolve_config(model, revision)
    if cfg != info.config:
        raise ArtifactError(
            f"{info.folder} was exported from {info.meta['model']['name']!r}, whose config differs from {model!r}"
        )
    if model == BUNDLED and info.meta["model"].get("weights_sha256") != weights_fingerprint(resolve(model)[0]):
        raise ArtifactError(f"{info.folder} was exported from other {model} weights; re-export with `gpt2x export --force`")


def run_export(model: str, revision: str | None, precision: Precision, out_dir: Path, force: bool,
               opset: int | None = None, check_parity: bool = True):
    from .export import DEFAULT_OPSET, export
    from .weights import load_model

    with _Progress(f"loading {model}") as status:
        m, source = load_model(model, revision)
        return export(m, source, out_dir, precision, opset or DEFAULT_OPSET, force, check_parity,
                      progress=lambda msg: status.update(msg + " ..."))


@app.command(
    epilog="Examples:\n\n"
    "  gpt2x export --model shakespeare\n\n"
    "  gpt2x export --model gpt2 --precision int8\n\n"
    "  gpt2x export --model ./my-gpt2 --precision fp16 --out exported/my-fp16 --force"
)
def export(
    model: ModelOpt = "shakespeare",
    revision: RevisionOpt = None,
    precision: Annotated[Precision, typer.Option(help="fp32 (reference), int8 (CPU, dynamic quantization) or fp16 (CUDA).")] = Precision.fp32,
    out_dir: Annotated[Optional[Path], typer.Option("--out", help="Output folder (default: exported/<model>-<precision>).")] = None,
    opset: Annotated[int, typer.Option(min=17, help="ONNX opset.")] = 18,
    force: Annotated[bool, typer.Option(help="Replace an existing export.")] = False,
    check_parity: Annotated[bool, typer.Option(help="Gate the export on parity with PyTorch (--no-check-parity to skip, at your own risk).")] = True,
    as_json: JsonOpt = False,
) -> None:
    """Export to ONNX with a KV cache, fuse, convert, and check parity against PyTorch."""
    from .export import default_export_dir

    folder = out_dir or default_export_dir(model, precision)
    info = run_export(model, revision, precision, folder, force, opset, check_parity)
    meta = info.meta
    if as_json:
        print(json.dumps({"folder": str(folder), **meta}))
        return
    parity = meta["parity"]
    out.print(f"exported {model} ({precision.value}) to {folder}")
    out.print("fused operators: " + ", ".join(f"{k} {v}" for k, v in meta["fused_operators"].items()))
    if parity.get("status") == "passed":
        lg = parity["logits"]
        out.print(f"parity passed on {parity['provider']}: max |Δlogit| {lg['max_abs']:.3g} "
                  f"({lg['max_rel']:.2g} of scale), mean KL {lg['mean_kl']:.2g}, top-1 agreement "
                  f"{lg['top1_agreement']:.3f}, greedy agreement {parity['greedy']['share']:.2f}")
    else:
        out.print(f"parity: {parity.get('status')} ({parity.get('reason', '')})", markup=False)


@app.command(
    epilog="Examples:\n\n  gpt2x inspect gpt2\n\n  gpt2x inspect shakespeare --seq-len 16\n\n  gpt2x inspect gpt2-xl --json"
)
def inspect(
    model: Annotated[str, typer.Argument(help="Model name, hub repo id or local path (presets need no download).")] = "gpt2",
    revision: RevisionOpt = None,
    seq_len: Annotated[Optional[int], typer.Option(help="Also show activation shapes for a sequence of this length.")] = None,
    as_json: JsonOpt = False,
) -> None:
    """Parameter shapes and counts per component, and activation shapes through the forward pass."""
    from .describe import describe
    from .weights import resolve_config

    if seq_len is not None and seq_len < 1:
        raise UsageError(f"--seq-len must be at least 1, got {seq_len}")
    cfg = resolve_config(model, revision)
    if seq_len is not None and seq_len > cfg.n_positions:
        raise UsageError(f"--seq-len {seq_len} exceeds the model's context ({cfg.n_positions})")
    d = describe(cfg, seq_len)
    if as_json:
        print(json.dumps({"model": model, **d}))
        return
    c = cfg
    out.print(f"[bold]{model}[/]: n_layer={c.n_layer} n_head={c.n_head} n_embd={c.n_embd} "
              f"n_positions={c.n_positions} vocab_size={c.vocab_size} head_dim={c.head_dim}")
    t = Table("component", "parameter shapes", "params", "x", "total")
    for comp in d["components"]:
        shapes = " + ".join(str(tuple(s)) for s in comp["shapes"]) or "-"
        t.add_row(escape(comp["name"]), shapes, f"{comp['params']:,}", str(comp["repeat"]), f"{comp['total']:,}")
    t.add_row("[bold]total[/]", "", "", "", f"[bold]{d['total_params']:,}[/]")
    out.print(t)
    if seq_len is not None:
        a = Table("forward step", "activation shape")
        for row in d["activations"]:
            a.add_row(escape(row["step"]), str(tuple(row["shape"])))
        out.print(a)


@app.command(
    epilog="Example (re-creates the bundled model):\n\n"
    "  gpt2x train --corpus tinyshakespeare.txt --out gpt2x/data/shakespeare"
)
def train(
    corpus: Annotated[Path, typer.Option(help="UTF-8 text file; the first 90% of its tokens train, the rest is held out.")],
    out_dir: Annotated[Path, typer.Option("--out", help="Folder for config.json, model.safetensors (fp16) and the model card.")],
    steps: Annotated[int, typer.Option(help="Optimizer steps.")] = 800,
    seed: Annotated[int, typer.Option(help="Seed for initialisation and batches.")] = 1337,
    force: Annotated[bool, typer.Option(help="Overwrite an existing model in --out.")] = False,
    as_json: JsonOpt = False,
) -> None:
    """Train the small Shakespeare GPT-2 (the bundled `shakespeare` model) on the CPU."""
    from .train import TrainSettings, write_card
    from .train import train as run_training

    if steps < 1:
        raise UsageError(f"--steps must be at least 1, got {steps}")
    if (out_dir / "model.safetensors").exists() and not force:
        raise OutputError(f"{out_dir} already holds a model; pass --force to overwrite it")
    settings = TrainSettings(steps=steps, seed=seed)
    record = run_training(corpus, out_dir, settings, log=lambda line: err.print(line))
    command = f"gpt2x train --corpus {corpus} --out {out_dir} --steps {steps} --seed {seed}"
    write_card(out_dir, record, command)
    if as_json:
        print(json.dumps({k: v for k, v in record.items() if k != "history"}))
    else:
        out.print(f"held-out loss {record['heldout_loss_fp16']} nats/token (fp16 weights) -> {out_dir}")


def parse_list(value: str, kind, option: str) -> list:
    items = [v.strip() for v in value.split(",") if v.strip()]
    try:
        return [kind(v) for v in items]
    except ValueError:
        choices = ", ".join(e.value for e in kind) if isinstance(kind, type) and issubclass(kind, Enum) else "integers"
        raise UsageError(f"{option}: {value!r} is not a comma-separated list of {choices}") from None


@app.command(
    epilog="Examples:\n\n"
    "  gpt2x bench\n\n"
    "  gpt2x bench --model random:gpt2 --batch 1,4 --json bench.json --plot bench.png\n\n"
    "  gpt2x bench --provider cuda --precisions fp32,fp16 --batch 1,8"
)
def bench(
    model: ModelOpt = "shakespeare",
    provider: Annotated[ProviderKind, typer.Option(help="cpu, or cuda (fails clearly without a GPU).")] = ProviderKind.cpu,
    backends: Annotated[str, typer.Option(help="Comma-separated: torch, ort.")] = "torch,ort",
    precisions: Annotated[str, typer.Option(help="Comma-separated: fp32, int8 (CPU), fp16 (CUDA).")] = "fp32,int8,fp16",
    batch: Annotated[str, typer.Option(help="Comma-separated batch sizes.")] = "1",
    prompt_len: Annotated[int, typer.Option(help="Prompt tokens per row.")] = 32,
    new_tokens: Annotated[int, typer.Option(help="Generated tokens per row (EOS does not stop a run).")] = 128,
    repeat: Annotated[int, typer.Option(help="Timed runs per configuration (median reported).")] = 3,
    threads: ThreadsOpt = None,
    text: Annotated[Optional[Path], typer.Option(help="UTF-8 text for perplexity (default: bundled held-out Shakespeare).")] = None,
    json_file: Annotated[Optional[Path], typer.Option("--json", help="Write every figure to this JSON file.")] = None,
    plot_file: Annotated[Optional[Path], typer.Option("--plot", help="Write a PNG plot (needs matplotlib).")] = None,
) -> None:
    """Parity and tokens/sec of each backend x precision x batch, against the memory-bandwidth roofline."""
    from .bench import BenchSettings, plot, require_matplotlib, run_bench
    from .report import bench_tables
    from .system import system_info
    from .weights import load_model

    settings = BenchSettings(
        model=model, provider=provider, backends=parse_list(backends, BackendKind, "--backends"),
        precisions=parse_list(precisions, Precision, "--precisions"), batches=parse_list(batch, int, "--batch"),
        prompt_len=prompt_len, new_tokens=new_tokens, repeat=repeat, threads=threads, text=text,
    )
    if plot_file:
        require_matplotlib()
    if provider is ProviderKind.cuda:
        from .runtime import available_providers

        import torch

        status = available_providers()["loadable"]["cuda"]
        if status != "ok":
            raise ProviderError(status)
        if BackendKind.torch in settings.backends and not torch.cuda.is_available():
            raise ProviderError("--provider cuda with the torch backend: this PyTorch build sees no CUDA device")
    with _Progress("starting") as status_line:
        m, source = load_model(model)
        result = run_bench(settings, m, source, system_info(), progress=lambda msg: status_line.update(msg + " ..."))
    if json_file:
        write_text_atomic(json_file, json.dumps(result, indent=1) + "\n")
    if plot_file:
        plot(result, plot_file)
    for table in bench_tables(result):
        out.print(table)
    if not result["passed"]:
        failed = [f"{p['backend']}/{p['precision']}: {p['message']}" for p in result["parity"] if not p["passed"]]
        raise ParityError("parity gate failed: " + "; ".join(failed))


def write_text_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    try:
        tmp.write_text(text, encoding="utf-8")
        os.replace(tmp, path)
    except OSError as e:
        tmp.unlink(missing_ok=True)
        raise OutputError(f"cannot write {path}: {e.strerror}") from None


@app.command(epilog="Examples:\n\n  gpt2x info\n\n  gpt2x info --json")
def info(as_json: JsonOpt = False) -> None:
    """Versions, execution providers (listed and really loadable), CPU, GPU, and where things are cached."""
    from .system import system_info

    data = system_info()
    if as_json:
        print(json.dumps(data))
        return
    t = Table("item", "value", show_header=False)
    for key, value in data.items():
        if isinstance(value, dict):
            value = "\n".join(f"{k}: {v}" for k, v in value.items())
        t.add_row(key, escape(str(value)))
    out.print(t)


# Typer's usage errors derive from click's ClickException (vendored inside newer Typer releases).
_CLICK_ERROR = next(c for c in typer.BadParameter.__mro__ if c.__name__ == "ClickException")


def main() -> None:
    """Console entry point: runs the app and maps every failure to one line and an exit code."""
    debug = os.environ.get("GPT2X_DEBUG") == "1"
    try:
        code = app(standalone_mode=False)  # Typer turns Ctrl-C inside a command into exit code 130
    except (typer.Abort, KeyboardInterrupt):
        code = INTERRUPTED_EXIT_CODE
    except _CLICK_ERROR as e:  # usage errors: unknown option, bad choice, missing argument
        e.show()
        code = e.exit_code
    except Gpt2xError as e:
        if debug:
            raise
        err.print(f"error: {e}", markup=False, soft_wrap=True)
        code = e.exit_code
    if code == INTERRUPTED_EXIT_CODE:
        sys.stdout.flush()  # what was streamed so far stays
        err.print("\ninterrupted", markup=False)
    sys.exit(code if isinstance(code, int) else 0)
