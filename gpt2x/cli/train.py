"""`gpt2x train`: re-create the bundled Shakespeare model."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer

from ..errors import OutputError, UsageError
from ..workflows.training import train_model
from .options import JsonOpt, err, out

EPILOG = ("Example (re-creates the bundled model):\n\n"
    "  gpt2x train --corpus tinyshakespeare.txt --out gpt2x/data/shakespeare")


def train(
    corpus: Annotated[Path, typer.Option(help="UTF-8 text file; the first 90% of its tokens train, the rest is held out.")],
    out_dir: Annotated[Path, typer.Option("--out", help="Folder for config.json, model.safetensors (fp16) and the model card.")],
    steps: Annotated[int, typer.Option(help="Optimizer steps.")] = 800,
    seed: Annotated[int, typer.Option(help="Seed for initialisation and batches.")] = 1337,
    force: Annotated[bool, typer.Option(help="Overwrite an existing model in --out.")] = False,
    as_json: JsonOpt = False,
) -> None:
    """Train the small Shakespeare GPT-2 (the bundled `shakespeare` model) on the CPU."""
    if steps < 1:
        raise UsageError(f"--steps must be at least 1, got {steps}")
    if (out_dir / "model.safetensors").exists() and not force:
        raise OutputError(f"{out_dir} already holds a model; pass --force to overwrite it")
    record = train_model(corpus, out_dir, steps, seed, log=lambda line: err.print(line, markup=False))
    if as_json:
        print(json.dumps({k: v for k, v in record.items() if k != "history"}))
    else:
        out.print(f"held-out loss {record['heldout_loss_fp16']} nats/token (fp16 weights) -> {out_dir}")
