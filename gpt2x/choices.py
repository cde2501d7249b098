"""The enumerated choices of the command line and the library (kept free of heavy imports)."""

from __future__ import annotations

from enum import Enum


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
