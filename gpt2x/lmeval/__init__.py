"""gpt2x in lm-evaluation-harness: the `gpt2x` model class (model.py; importing this package registers
it with lm-eval, so that `simple_evaluate(model="gpt2x", model_args="model=shakespeare,backend=ort")`
finds it) and `gpt2x eval`'s runner (run.py).

This package sits beside bench and serve, above workflows: turning a model name into a backend needs
workflows.backends.open_backend. The scoring itself is NumPy on any Backend (gpt2x.evaluate.harness), so the
evaluation layer stays free of lm_eval. lm-eval is the `eval` extra: without it, importing this
package raises one MissingDependencyError naming the install command. Only `gpt2x eval` imports it.
"""

from __future__ import annotations

import importlib.util

from ..errors import MissingDependencyError

EVAL_INSTALL = "pip install 'gpt2x[eval]'"


def require_eval_extra() -> None:
    """Raise MissingDependencyError unless lm-evaluation-harness is installed."""
    try:
        found = importlib.util.find_spec("lm_eval") is not None
    except (ImportError, ValueError):
        found = False
    if not found:
        raise MissingDependencyError(f"evaluating with lm-evaluation-harness needs lm_eval, which this install lacks: {EVAL_INSTALL}")


require_eval_extra()

from .model import Gpt2xLM  # noqa: E402  (registers "gpt2x" with lm-eval; after the check above)

__all__ = ["EVAL_INSTALL", "Gpt2xLM", "require_eval_extra"]
