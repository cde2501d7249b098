"""gpt2x's exceptions. Each carries the exit code the CLI maps it to (the one place that does)."""

from __future__ import annotations

import importlib.util
import sys


class Gpt2xError(Exception):
    """Base class: a failure with a one-line explanation for the user."""

    exit_code = 1


class UsageError(Gpt2xError):
    """Invalid option values or combinations; `option` names the parameter at fault, so the CLI can name its flag."""

    exit_code = 2

    def __init__(self, message: str, option: str | None = None):
        super().__init__(message)
        self.option = option


class ModelNotFoundError(Gpt2xError):
    """Unknown model name or repo id, or a local path that does not exist."""

    exit_code = 3


class WeightsError(Gpt2xError):
    """Weights or config that cannot be loaded: missing/extra/mis-shaped tensors, not GPT-2, refused pickle."""

    exit_code = 4


class HubError(Gpt2xError):
    """No network and nothing cached, or the hub answered with an error."""

    exit_code = 5


class ArtifactError(Gpt2xError):
    """An ONNX export that is missing, corrupt, or does not match what was asked for."""

    exit_code = 6


class ParityError(Gpt2xError):
    """A backend's outputs are outside the precision's tolerance."""

    exit_code = 7


class ProviderError(Gpt2xError):
    """An execution provider that is unknown, unavailable or failed to load."""

    exit_code = 8


class OutputError(Gpt2xError):
    """An output that exists and would be overwritten unasked, or cannot be written."""

    exit_code = 9


class MissingDependencyError(Gpt2xError):
    """An optional part of gpt2x that is not installed; the message names the pip command."""

    exit_code = 10


def missing_modules(*modules: str) -> list[str]:
    """Those of `modules` that do not import here (an extra not installed)."""
    missing = []
    for name in modules:
        try:
            __import__(name)
        except ImportError:
            missing.append(name)
    return missing


def installed(module: str) -> bool:
    """Whether `module` is installed, without importing it (openvino's import alone is 0.2-0.3 s)."""
    if module in sys.modules:  # imported already, or blocked (None)
        return sys.modules[module] is not None
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):  # a parent package that does not import, or a finder that refuses it
        return False


class EndpointError(Gpt2xError):
    """A server that `gpt2x loadtest` cannot reach at the start, or that failed every request."""

    exit_code = 11


class ServeError(Gpt2xError):
    """`gpt2x serve` could not start: Ray, or the replicas, failed (the message says which and why)."""

    exit_code = 12


# Ctrl-C: the shell convention, 128 + SIGINT.
INTERRUPTED_EXIT_CODE = 130
