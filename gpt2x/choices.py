"""The enumerated choices of the command line and the library, and the progress callback type (no heavy imports)."""

from __future__ import annotations

from collections.abc import Callable
from enum import Enum

# Progress messages from long library calls (the CLI shows them on stderr).
Progress = Callable[[str], None]


def no_progress(message: str) -> None:
    """The default Progress: says nothing."""


class BackendKind(str, Enum):
    torch = "torch"
    ort = "ort"


class ProviderKind(str, Enum):
    cpu = "cpu"
    cuda = "cuda"


class Precision(str, Enum):
    fp32 = "fp32"
    fp16 = "fp16"
    int8 = "int8"
