"""What every command shares: the consoles (results to stdout, progress and errors to stderr), the
progress display, and the options several commands take."""

from __future__ import annotations

import os
import sys
from collections.abc import Iterable
from enum import Enum
from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.console import Console
from rich.markup import escape

from ..choices import BackendKind, KvCache, Precision, ProviderKind
from ..errors import UsageError
from ..fileio import write_atomic
from ..onnx.artifact import EXPORTS_ENV, INT8_KV_ANY_PRECISIONS, ExportInfo
from ..onnx.interop import check_chat_template
from ..runtime.base import PAGED_PRECISIONS
from ..runtime.kvdtype import KV_DTYPE_ENV, KvDtypeChoice
from ..runtime.kvdtype import asked as asked_kv_dtype
from ..runtime.prefill import PREFILL_ENV, PrefillChoice, asked
from ..version import __version__

out = Console(highlight=False, soft_wrap=True, width=None if sys.stdout.isatty() else 220)
err = Console(stderr=True, highlight=False)
err_tables = Console(stderr=True, highlight=False, soft_wrap=True, width=None if sys.stderr.isatty() else 220)  # tables, with --json

# --help's panels: the common options come first, in Typer's default panel; the rest by theme, each in one of these.
RUNTIME_PANEL = "Backend, export and runtime"
SAMPLING_PANEL = "Sampling controls"
STRUCTURED_PANEL = "Structured output"
BEAM_PANEL = "Beam search"
DRAFT_PANEL = "Speculative decoding"

ModelOpt = Annotated[
    str,
    typer.Option(
        "--model", "-m",
        help="`shakespeare` (bundled), a preset (gpt2, gpt2-medium, gpt2-large, gpt2-xl, distilgpt2), "
        "a hub repo id, a local Hugging Face folder or a .safetensors file.",
    ),
]


def _use_exports(value: Optional[Path]) -> Optional[Path]:
    """--exports DIR: set as GPT2X_EXPORTS for this process and those it starts (artifact.exports_root reads it)."""
    if value is not None:
        os.environ[EXPORTS_ENV] = str(value.expanduser().resolve())
    return value


ExportsOpt = Annotated[Optional[Path], typer.Option(
    "--exports", envvar=EXPORTS_ENV, callback=_use_exports, metavar="DIR", show_default=False, rich_help_panel=RUNTIME_PANEL,
    help="Where exports made by model name are kept (DIR/MODEL-PRECISION); default ~/.cache/gpt2x/exported "
         "(under XDG_CACHE_HOME when set).")]
def _sets_env(env: str, asked_for):
    """A callback for an option the ONNX Runtime backend reads from `env`: the value checked (`asked_for`: one line,
    exit 2) and set as `env` for this process and those it starts."""
    def use(value: Optional[str]) -> Optional[str]:
        if value is not None:
            os.environ[env] = asked_for(value).value
        return value

    return use


_use_prefill = _sets_env(PREFILL_ENV, asked)  # runtime.prefill


PrefillOpt = Annotated[Optional[str], typer.Option(
    "--prefill", envvar=PREFILL_ENV, callback=_use_prefill, metavar="|".join(c.value for c in PrefillChoice),
    show_default=False, rich_help_panel=RUNTIME_PANEL,
    help="Where the ort backend runs a new prompt's prefill on an export with OpenVINO's prefill graph (int8, or fp32 "
         "exported with --openvino-prefill): auto (default: that graph "
         "where the export measured it faster and openvino is installed), onnxruntime, or openvino. Given to gpt2x "
         "serve, the ort backend serves such an fp32 export (not the openvino backend's paged slots).")]
_use_kv_dtype = _sets_env(KV_DTYPE_ENV, asked_kv_dtype)  # runtime.kvdtype
KvDtypeOpt = Annotated[Optional[str], typer.Option(
    "--kv-cache-dtype", envvar=KV_DTYPE_ENV, callback=_use_kv_dtype, metavar="|".join(c.value for c in KvDtypeChoice),
    show_default=False, rich_help_panel=RUNTIME_PANEL,
    help="The dtype of the ort backend's KV cache on an int8 or int4 export, or an fp32 one exported with --int8-kv: "
         "auto (default: int8 where the export calibrated and gated its scales and, int8 and int4, timed decode steps on "
         "them faster), int8 (a quarter of the bytes; an fp32 export by name is then made with the scales, in "
         "<model>-fp32-int8-kv), or float. Given to gpt2x serve, the ort backend serves an fp32 export with an OpenVINO "
         "prefill graph (not the openvino backend's paged slots), but one exported with --int8-kv --openvino-prefill, "
         "whose paged slots hold OpenVINO's u8 cache (gated at export) and honour all three; int8 for generate or "
         "serve on another backend is refused.")]
RevisionOpt = Annotated[Optional[str], typer.Option(help="Hub revision (branch, tag or commit) to pin.",
                                                   rich_help_panel=RUNTIME_PANEL)]
JsonOpt = Annotated[bool, typer.Option("--json", help="Machine-readable JSON on stdout.")]
OutputOpt = Annotated[Optional[Path], typer.Option(
    "--output", help="Also write the JSON result to this file (atomically: whole or not at all).")]
NumSpeculativeTokensOpt = Annotated[int, typer.Option(
    "--num-speculative-tokens", rich_help_panel=DRAFT_PANEL,
    help="Most tokens the draft proposes per verification (K, vLLM's num_speculative_tokens).")]
ModelOptional = Annotated[
    Optional[str],
    typer.Option("--model", "-m", help="As for `export` (default: shakespeare); checked against --onnx metadata when given."),
]
PrecisionOpt = Annotated[Optional[Precision], typer.Option(
    help="fp32 (default); int8 and int4: exports, run by the ort, openvino, genai and web backends; bf16: fp32 weights "
    "computed in bf16 by the openvino backend, on a CPU with AVX-512 BF16 or AMX; fp16: CUDA only.")]
ThreadsOpt = Annotated[Optional[int], typer.Option(min=1, help="CPU threads (default: the cores available).",
                                                  rich_help_panel=RUNTIME_PANEL)]
KvCacheOpt = Annotated[KvCache, typer.Option(
    rich_help_panel=RUNTIME_PANEL,
    help="The ort backend's KV cache: auto (gpt2x serve: the fixed slots for fp32, int8 and int4 exports on the CPU; "
    "elsewhere, and for the other commands, written in place wherever it can be on the CPU: int8 and int4 graphs, an "
    "fp32 export's through its graph's GroupQueryAttention twin, made in memory; on CUDA, gpt2x generate decodes on "
    "the fixed cache wherever the generation allows), in-place (required), growing (the export's own graph), fixed "
    "(gpt2x generate only, required: one fixed-capacity cache, its step replayed as a CUDA graph on CUDA; greedy or a "
    "temperature, one prompt length), or slots (gpt2x serve only: a fixed slot per request, whose prompt's chunks run "
    "in the decode steps' own forward). A server on the openvino backend takes auto (its paged slots for bf16 and fp32 "
    "exports with an OpenVINO prefill graph, else its own cache), slots (the paged slots, fp32 and bf16) or in-place "
    "(its own cache); with no --backend, a server takes the openvino backend's paged slots for those exports with auto or "
    "slots (not with --prefill or --draft).")]


BACKEND_DEFAULT = "default: ort, or the first backend whose record runs the precision where ort's does not (bf16: openvino)"
# A server's: that, but openvino's paged slots for an fp32 export with an OpenVINO prefill graph (serve.replica.served_backend).
SERVED_BACKEND_DEFAULT = BACKEND_DEFAULT + "; an fp32 export with an OpenVINO prefill graph: openvino, on its paged slots " \
    "(ort with --prefill, --kv-cache-dtype, --draft or --kv-cache in-place)"


def on_command_line(ctx: typer.Context, name: str) -> bool:
    """Whether parameter `name` was given on the command line (not by its environment variable nor its default)."""
    source = ctx.get_parameter_source(name)
    return source is not None and source.name == "COMMANDLINE"


def ort_options_given(ctx: typer.Context, info: ExportInfo) -> bool:
    """Whether the ort backend's own options are asked for the export `info`: --prefill on the command line, or a KV
    cache dtype (--kv-cache-dtype on the command line, or int8 by GPT2X_KV_CACHE_DTYPE) where the openvino backend's
    paged slots hold no int8 cache for it (ExportInfo.paged_int8_kv: they then honour all three). A server then runs an
    fp32 export with an OpenVINO prefill graph there, not on those paged slots (serve.replica.served_backend)."""
    dtype = on_command_line(ctx, "kv_cache_dtype") or asked_kv_dtype(None) is KvDtypeChoice.int8
    return on_command_line(ctx, "prefill") or (dtype and info.paged_int8_kv is None)


def given_by_user(ctx: typer.Context, name: str) -> bool:
    """Whether parameter `name` came from the command line or the environment, not its default. Compared by name:
    Typer vendors its own click, whose ParameterSource is not click's (click's compared equal to nothing)."""
    source = ctx.get_parameter_source(name)
    return source is not None and source.name in ("COMMANDLINE", "ENVIRONMENT")


def refuse_kv_cache(kv_cache: KvCache, backend: BackendKind, served: bool = False,
                    precision: Precision | None = None, provider: ProviderKind = ProviderKind.cpu) -> None:
    """--kv-cache other than auto is the native backend's option: a backend with a cache of its own refuses it, but a
    server on the openvino backend takes slots (its paged slots) or in-place (its own buffers). The fixed slots are the
    server's (`served`), for the precisions they run (runtime.static_decode.SLOT_PRECISIONS; `precision`: the one asked
    for, None: the default fp32 or an --onnx folder's, checked when it is opened)."""
    from ..runtime.registry import capabilities_of  # the backends' records, read only when the option is given

    if served and backend is BackendKind.openvino and kv_cache in (KvCache.slots, KvCache.in_place):
        if kv_cache is KvCache.slots and precision is not None and precision not in PAGED_PRECISIONS:
            raise UsageError(f"--kv-cache slots: the openvino backend's paged slots run "
                             f"{' and '.join(p.value for p in PAGED_PRECISIONS)} exports, not {precision.value}",
                             option="kv-cache")
        return  # its paged slots, or its own buffers in place
    if kv_cache is not KvCache.auto and not capabilities_of(backend).native:
        raise UsageError(f"--kv-cache {kv_cache.value} applies to the ort backend; {backend.value} keeps its own cache",
                         option="kv-cache")
    if kv_cache is KvCache.fixed and served:
        raise UsageError("--kv-cache fixed is gpt2x generate's: a server's rows join and leave (slots: a fixed slot "
                         "per request)", option="kv-cache")
    if kv_cache is KvCache.slots and not served:
        raise UsageError("--kv-cache slots is the server's (gpt2x serve): a slot per request, joined and left between "
                         "steps", option="kv-cache")
    if kv_cache is KvCache.slots and precision is not None:
        from ..runtime.static_decode import slots_refusal  # ONNX Runtime's module: only when the option is given

        why = slots_refusal(provider, precision)
        if why:
            raise UsageError(f"--kv-cache slots: {why}", option="kv-cache")


def refuse_int8_kv(precision: Precision | None, onnx_dir: Path | None, backend: BackendKind | None = None,
                   paged_holds: bool = False) -> None:
    """--kv-cache-dtype int8 (or GPT2X_KV_CACHE_DTYPE) for an fp16 or bf16 export by name, or on a `backend` that holds
    no int8 cache (Capabilities.holds_int8_kv; `paged_holds`: the openvino backend's paged slots hold OpenVINO's u8 one
    for this export, ExportInfo.paged_int8_kv): refused in one line before anything is exported (int8 and int4 exports
    by name hold int8 caches, and an fp32 one is then made with its scales: workflows.exports.by_name_int8_kv; an --onnx
    folder is checked when opened)."""
    if asked_kv_dtype(None) is not KvDtypeChoice.int8:
        return
    from ..runtime.registry import capabilities_of  # the backends' records, read only when int8 is asked for

    if backend is not None and not paged_holds and not capabilities_of(backend).holds_int8_kv:
        raise UsageError(f"--kv-cache-dtype int8 is the ort backend's cache (int8, with the gated scales of an int8, int4 "
                         f"or fp32 --int8-kv export); the {backend.value} backend keeps its own in the export's float "
                         "dtype (`gpt2x serve --backend openvino` holds OpenVINO's u8 one on its paged slots for an fp32 "
                         "export made with --int8-kv --openvino-prefill): drop the option", option="kv-cache-dtype")
    wanted = precision or Precision.fp32  # the commands' default precision
    if onnx_dir is None and wanted not in INT8_KV_ANY_PRECISIONS:
        raise UsageError(f"--kv-cache-dtype int8 is for int8, int4 and fp32 exports; --precision {wanted.value} has a "
                         "float cache", option="kv-cache-dtype")


def version_callback(value: bool) -> None:
    if value:
        out.print(f"gpt2x {__version__}")
        raise typer.Exit()


class Status:
    """Progress on stderr: a live spinner when stderr is a terminal and --quiet is not given,
    plain lines with GPT2X_PROGRESS=lines, nothing otherwise."""

    enabled = True

    def __init__(self, message: str):
        self.message = message
        self._status = None

    def __enter__(self) -> Status:
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
            self._status = None


def read_text_file(path: Path, what: str) -> str:
    """A UTF-8 text file's contents, or one UsageError line naming `what` it is."""
    try:
        return path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise UsageError(f"{what} not found: {path}") from None
    except UnicodeDecodeError:
        raise UsageError(f"{what} is not UTF-8 text: {path}") from None
    except OSError as e:
        raise UsageError(f"cannot read {what} {path}: {e.strerror}") from None


def read_api_keys(path: Path) -> tuple[str, ...]:
    """The keys of an --api-key-file, one a line (blank lines and # comments skipped); one UsageError line for a file
    that cannot be read or holds none."""
    lines = read_text_file(path, "--api-key-file").splitlines()
    keys = tuple(k for k in (line.strip() for line in lines) if k and not k.startswith("#"))
    if not keys:
        raise UsageError(f"--api-key-file {path} holds no key", option="api-key-file")
    return keys


def read_chat_template(value: str) -> str:
    """--chat-template's template: the file it names, or (as vLLM takes it) the template's own text where no such file
    exists and it reads as Jinja2 (`{{` or `{%`); checked as a Jinja2 template; one UsageError line where it is not one."""
    path = Path(value).expanduser()
    if not path.is_file() and ("{{" in value or "{%" in value):
        check_chat_template(value, "--chat-template's text")
        return value
    text = read_text_file(path, "--chat-template file")
    check_chat_template(text, f"--chat-template {value}")
    return text


def read_prompts_file(path: Path) -> list[str]:
    text = read_text_file(path, "prompts file")
    prompts = [line for line in text.splitlines() if line.strip()]
    if not prompts:
        raise UsageError(f"prompts file has no prompts (one per line): {path}")
    return prompts


def parse_list(value: str, kind, option: str) -> list:
    items = [v.strip() for v in value.split(",") if v.strip()]
    try:
        return [kind(v) for v in items]
    except ValueError:
        choices = ", ".join(e.value for e in kind) if isinstance(kind, type) and issubclass(kind, Enum) else "integers"
        raise UsageError(f"{option}: {value!r} is not a comma-separated list of {choices}") from None


def parse_logit_bias(values: Iterable[str], option: str = "--logit-bias") -> dict[int, float]:
    """`ID=BIAS` pairs, each value one pair or a comma-separated list of them (repeatable options)."""
    bias: dict[int, float] = {}
    for value in values:
        for item in (v.strip() for v in value.split(",")):
            if not item:
                continue
            token, sep, amount = item.partition("=")
            try:
                if not sep:
                    raise ValueError
                bias[int(token)] = float(amount)
            except ValueError:
                raise UsageError(f"{option}: {item!r} is not TOKEN_ID=BIAS (such as 50256=-100)") from None
    return bias


def parse_token_ids(values: Iterable[str], option: str) -> list[int]:
    """Token ids from repeatable values, each one id or a comma-separated list of them."""
    ids: list[int] = []
    for value in values:
        ids += parse_list(value, int, option)
    return ids


def progress_to(status: Status):
    """A library Progress callback that updates `status`."""
    return lambda message: status.update(message + " ...")


def write_json(text: str, as_json: bool, output: Optional[Path]) -> None:
    """A command's JSON result: to the --output file (atomically) and, with --json, on stdout."""
    if output is not None:
        write_atomic(output, text)
    if as_json:
        sys.stdout.write(text)
        sys.stdout.flush()


def print_tables(tables: Iterable, as_json: bool, **options) -> None:
    """A command's tables on stdout, or on stderr with --json (stdout holds the JSON alone), or nowhere with --quiet too."""
    console = out if not as_json else err_tables if Status.enabled else None
    for table in tables if console is not None else ():
        console.print(table, **options)


def notice(message: str) -> None:
    """A message the user sees even with --quiet (an export about to start), on one line."""
    err.print(message, markup=False, soft_wrap=True)
