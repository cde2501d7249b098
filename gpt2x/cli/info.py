"""`gpt2x info`: versions, execution providers, CPU, GPU, caches."""

from __future__ import annotations

import json

from rich.markup import escape
from rich.table import Table

from ..bench.system import system_info
from .options import JsonOpt, out

EPILOG = ("Examples:\n\n  gpt2x info\n\n  gpt2x info --json")


def info(as_json: JsonOpt = False) -> None:
    """Versions, execution providers (listed and really loadable), CPU, GPU, and where things are cached."""
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
