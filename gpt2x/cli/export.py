"""`gpt2x export`: the model to ONNX with a KV cache, fused, converted, and gated by parity."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Optional

import typer

from ..choices import Precision
from ..errors import OutputError
from ..onnx.artifact import default_export_dir
from ..workflows import export_by_name
from .options import JsonOpt, ModelOpt, RevisionOpt, Status, out, progress_to

EPILOG = ("Examples:\n\n"
    "  gpt2x export --model shakespeare\n\n"
    "  gpt2x export --model gpt2 --precision int8\n\n"
    "  gpt2x export --model ./my-gpt2 --precision fp16 --out exported/my-fp16 --force")


def export(
    model: ModelOpt = "shakespeare",
    revision: RevisionOpt = None,
    precision: Annotated[Precision, typer.Option(help="fp32 (reference), int8 or int4 (CPU: 8- or 4-bit weights, int8 activations; "
                                                      "int4 keeps the unembedding at 8 bits) or fp16 (CUDA).")] = Precision.fp32,
    out_dir: Annotated[Optional[Path], typer.Option("--out", help="Output folder (default: exported/MODEL-PRECISION).")] = None,
    opset: Annotated[int, typer.Option(min=17, help="ONNX opset.")] = 18,
    force: Annotated[bool, typer.Option(help="Replace an existing export.")] = False,
    check_parity: Annotated[bool, typer.Option(help="Gate the export on parity with PyTorch (--no-check-parity to skip, at your own risk).")] = True,
    as_json: JsonOpt = False,
) -> None:
    """Export to ONNX with a KV cache, fuse, convert, and check parity against PyTorch."""
    folder = out_dir or default_export_dir(model, precision)
    if folder.exists() and not force:
        raise OutputError(f"{folder} exists; pass --force to replace it")
    with Status(f"loading {model}") as status:
        info = export_by_name(model, folder, precision, revision, opset, force, check_parity, progress_to(status))
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
