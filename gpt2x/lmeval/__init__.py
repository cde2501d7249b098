"""gpt2x in lm-evaluation-harness: the `gpt2x` model class (registered with lm-eval on import) and `gpt2x eval`'s
runner. Above workflows (it opens backends by name); the scoring itself is evaluate.harness, free of lm_eval.
Without the `eval` extra, importing it is one MissingDependencyError; only `gpt2x eval` imports it.
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
