"""The folder transformers.js loads, from the model's exports."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from ..choices import Precision, Progress, no_progress
from ..errors import OutputError
from ..onnx.artifact import default_export_dir, is_export
from ..onnx.transformers_js import ALL_PRECISIONS as TRANSFORMERS_JS_PRECISIONS
from ..onnx.transformers_js import TransformersJsFolder, check_precisions, default_layout_dir, write_transformers_js
from .exports import ensure_export
from .models import DEFAULT_MODEL, load_model


def export_transformers_js(model: str = DEFAULT_MODEL, out: Path | None = None,
                           precisions: Sequence[Precision] = TRANSFORMERS_JS_PRECISIONS, revision: str | None = None,
                           force: bool = False, progress: Progress = no_progress,
                           notice: Progress = no_progress) -> TransformersJsFolder:
    """The transformers.js folder of `model`'s exports at `precisions`, each made first when missing (the model
    loaded once for all of them)."""
    precisions = check_precisions(precisions)
    out = Path(out) if out is not None else default_layout_dir(model)
    if out.exists() and not force:
        raise OutputError(f"{out} exists; pass --force to replace it")
    loaded = None
    exports = []
    for precision in precisions:
        missing = not is_export(default_export_dir(model, precision))
        if missing and loaded is None:
            progress(f"loading {model}")
            loaded = load_model(model, revision)
        exports.append(ensure_export(model, precision, revision, loaded=loaded if missing else None,
                                     progress=progress, notice=notice))
    progress(f"writing {out}")
    return write_transformers_js(exports, out, force, progress)
