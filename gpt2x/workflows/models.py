"""Models in PyTorch: loading one by name, and whether PyTorch is here at all."""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..errors import MissingDependencyError
from ..model.checkpoints import BUNDLED
from ..runtime.registry import require_export_extra

if TYPE_CHECKING:
    from ..model.checkpoints import ModelSource
    from ..model.gpt2 import GPT2

DEFAULT_MODEL = BUNDLED


def load_model(name: str = DEFAULT_MODEL, revision: str | None = None) -> tuple[GPT2, ModelSource]:
    """The PyTorch model and where it came from (bundled, hub, local or random:)."""
    require_export_extra(f"loading {name} into PyTorch")
    from ..model.weights import load_model as load_weights

    return load_weights(name, revision)


def torch_available() -> bool:
    try:
        require_export_extra("PyTorch")
    except MissingDependencyError:
        return False
    return True
