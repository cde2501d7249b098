"""The `gpt2x` command line: wires library calls and prints (results to stdout, progress and errors to stderr).
Exceptions become exit codes in `main()` alone. A process imports only the command it runs (a shorter start);
help and completion load them all."""

from __future__ import annotations

import functools
import os
import re
import sys
from typing import Annotated

import typer

from ..errors import INTERRUPTED_EXIT_CODE, Gpt2xError, UsageError
from .options import Status, err, version_callback

# Typer (0.29) labels a switch `<bool>` in --help, as if it took a value: a switch is shown without a type.
_display_type_rich = typer.core.TyperOption.display_type_rich


def _switch_without_type(self, ctx):
    return None if self.is_flag and not self.count else _display_type_rich(self, ctx)


typer.core.TyperOption.display_type_rich = _switch_without_type

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
    "  gpt2x inspect gpt2 --seq-len 8\n\n"
    "  gpt2x serve --model shakespeare",
)
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
    Status.enabled = not quiet


COMMANDS = ("generate", "export", "verify", "inspect", "train", "bench", "info", "serve", "loadtest", "eval", "run-batch")


def command_module(name: str):
    """The module of command `name` (its function has the command's name; EPILOG, its examples)."""
    if name == "generate":
        from . import generate as module
    elif name == "export":
        from . import export as module
    elif name == "verify":
        from . import verify as module
    elif name == "inspect":
        from . import inspect as module
    elif name == "train":
        from . import train as module
    elif name == "bench":
        from . import bench as module
    elif name == "info":
        from . import info as module
    elif name == "serve":
        from . import serve as module
    elif name == "loadtest":
        from . import loadtest as module
    elif name == "eval":
        from . import eval as module
    elif name == "run-batch":
        from . import run_batch as module
    else:
        raise KeyError(name)
    return module


@functools.cache
def _command(registered: tuple[str, ...]):
    """The click command Typer builds from `app` with these commands registered. Built once per set: Typer rebuilds
    every command's options on each call, a fifth of a second per call once all are registered (in-process callers)."""
    return typer.main.get_command(app)


def register(args: list[str]) -> None:
    """Add the command `args` names (its first non-option word), or every command when none (help, completion, a typo)."""
    first = next((a for a in args if not a.startswith("-")), None)
    names = [first] if first in COMMANDS and "_GPT2X_COMPLETE" not in os.environ else list(COMMANDS)
    done = {c.name for c in app.registered_commands}
    for name in (n for n in names if n not in done):
        module = command_module(name)
        app.command(name, epilog=module.EPILOG)(getattr(module, name.replace("-", "_")))
        if len(names) == 1 and hasattr(module, "before_parsing"):
            module.before_parsing()


# The previous release's spellings, rewritten before Typer parses (upgrade_args): commands declare only the new ones.
RENAMED_OPTIONS = {"--draft-tokens": "--num-speculative-tokens"}
JSON_PATH_COMMANDS = ("bench", "eval", "loadtest")  # where `--json PATH` wrote a file (now --output PATH)
JSON_PATH_NOTICE = "--json PATH is deprecated; use --output PATH (--json now prints the JSON on stdout)"
_URL = re.compile(r"[A-Za-z][A-Za-z0-9+.-]*://|[\w.-]+:\d+(/|$)")  # scheme://..., or host:port


def _json_path(command: str, value: str | None) -> bool:
    """Whether the word after `--json` is the old `--json PATH`'s file: not an option, nor (loadtest) a URL."""
    if value is None or value.startswith("-"):
        return False
    return not (command == "loadtest" and _URL.match(value))


def upgrade_args(args: list[str]) -> tuple[list[str], list[str]]:
    """`args` with the deprecated spellings rewritten (`--draft-tokens K`: `--num-speculative-tokens K`;
    on bench, eval and loadtest, `--json PATH`: `--output PATH`), and a deprecation notice for each."""
    at = next((i for i, a in enumerate(args) if not a.startswith("-")), None)
    if at is None or args[at] not in COMMANDS:
        return list(args), []
    command = args[at]
    new, notices = list(args[: at + 1]), []
    i = at + 1
    while i < len(args):
        arg = args[i]
        name, eq, value = arg.partition("=")
        if arg == "--":  # what follows is arguments, not options
            new += args[i:]
            break
        if name in RENAMED_OPTIONS:
            new.append(RENAMED_OPTIONS[name] + eq + value)
            notices.append(f"{name} is deprecated; use {RENAMED_OPTIONS[name]}")
        elif command in JSON_PATH_COMMANDS and name == "--json" and (eq or _json_path(command, args[i + 1] if i + 1 < len(args) else None)):
            if eq:
                new.append("--output=" + value)
            else:
                new += ["--output", args[i + 1]]
                i += 1
            notices.append(JSON_PATH_NOTICE)
        else:
            new.append(arg)
        i += 1
    return new, list(dict.fromkeys(notices))


def cli_message(e: Gpt2xError) -> str:
    """The error's message, naming the command-line flag where the library names a parameter."""
    message = str(e)
    if isinstance(e, UsageError) and e.option and message.startswith(e.option):
        message = "--" + e.option.replace("_", "-") + message[len(e.option) :]
    return message


# Typer's usage errors derive from click's ClickException (vendored inside newer Typer releases).
_CLICK_ERROR = next(c for c in typer.BadParameter.__mro__ if c.__name__ == "ClickException")


def main() -> None:
    """Console entry point: runs the app and maps every failure to one line and an exit code."""
    debug = os.environ.get("GPT2X_DEBUG") == "1"
    args = sys.argv[1:]
    if "_GPT2X_COMPLETE" not in os.environ:  # completion reads its words from the environment: left as typed
        args, notices = upgrade_args(args)
        for message in notices:
            err.print(f"warning: {message}", markup=False, soft_wrap=True)
    register(args)
    try:
        # (Typer's app() is get_command(app)(...) with its own traceback printer, which the app turns off.) Ctrl-C
        # inside a command becomes exit code 130.
        code = _command(tuple(c.name for c in app.registered_commands))(args=args, standalone_mode=False)
    except (typer.Abort, KeyboardInterrupt):
        code = INTERRUPTED_EXIT_CODE
    except _CLICK_ERROR as e:  # usage errors: unknown option, bad choice, missing argument
        e.show()
        code = e.exit_code
    except Gpt2xError as e:
        if debug:
            raise
        err.print(f"error: {cli_message(e)}", markup=False, soft_wrap=True)
        code = e.exit_code
    if code == INTERRUPTED_EXIT_CODE:
        sys.stdout.flush()  # what was streamed so far stays
        err.print("\ninterrupted", markup=False)
    sys.exit(code if isinstance(code, int) else 0)
