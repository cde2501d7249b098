"""`gpt2x inspect`: parameter shapes and counts per component, and activation shapes (config only)."""

from __future__ import annotations

import json
from typing import Annotated, Optional

import typer
from rich.markup import escape
from rich.table import Table

from ..errors import UsageError
from ..model.anatomy import describe
from ..model.checkpoints import resolve_config
from .options import JsonOpt, RevisionOpt, out

EPILOG = ("Examples:\n\n  gpt2x inspect gpt2\n\n  gpt2x inspect shakespeare --seq-len 16\n\n  gpt2x inspect gpt2-xl --json")


def inspect(
    model: Annotated[str, typer.Argument(help="Model name, hub repo id or local path (presets need no download).")] = "gpt2",
    revision: RevisionOpt = None,
    seq_len: Annotated[Optional[int], typer.Option(help="Also show activation shapes for a sequence of this length.")] = None,
    as_json: JsonOpt = False,
) -> None:
    """Parameter shapes and counts per component, and activation shapes through the forward pass."""
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
