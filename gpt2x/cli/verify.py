"""`gpt2x verify`: an export folder checked in full: metadata, sizes, external data and every file's
sha256 against the one recorded at export time (loading an export checks all but the hashes)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer
from rich.markup import escape

from ..onnx.artifact import verify_export
from .options import JsonOpt, Status, out

EPILOG = ("Examples:\n\n  gpt2x verify ~/.cache/gpt2x/exported/shakespeare-fp32\n\n  gpt2x verify my-exports/gpt2-int8 --json")


def verify(
    folder: Annotated[Path, typer.Argument(help="An export folder (as written by `gpt2x export`).")],
    as_json: JsonOpt = False,
) -> None:
    """Check an export folder in full, every file's sha256 included; exit code 6 on any mismatch."""
    with Status(f"hashing the files of {folder}"):
        info = verify_export(folder)
    files = info.meta["files"]
    sizes = {name: (folder / name).stat().st_size for name in files}
    if as_json:
        print(json.dumps({"folder": str(folder), "ok": True, "precision": info.precision.value,
                          "model": info.meta["model"]["name"], "files": {n: {"sha256": files[n], "bytes": sizes[n]} for n in files}}))
        return
    out.print(f"{escape(str(folder))}: {info.meta['model']['name']} ({info.precision.value}), "
              f"{len(files)} files, {sum(sizes.values()) / 1e6:.1f} MB, every sha256 as at export: ok")
