"""Which dtype the ONNX Runtime backend's KV cache holds on an int8 or int4 export, or an fp32 one exported with
--int8-kv: the export's float, or int8 with the scales the export calibrated and gated (onnx/kvcache.py; docs/export.md,
the int8 KV cache). Chosen from the export's record (an int8 or int4 export's from the figures it measured, an fp32
one's as asked at export); a user may force either way. No torch."""

from __future__ import annotations

import hashlib
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from enum import Enum

import numpy as np

from ..errors import ProviderError
from ..onnx.artifact import INT8_KV_PRECISIONS, KV_KEY, ExportInfo
from .prefill import env_choice

KV_DTYPE_ENV = "GPT2X_KV_CACHE_DTYPE"  # the choice for this process and those it starts (the CLI's --kv-cache-dtype)


class KvDtypeChoice(str, Enum):
    auto = "auto"  # int8 where the export's record says to use its scales (an fp32 export's: kept at all)
    int8 = "int8"  # refused where the export has no gated scales or the cache cannot be int8
    float = "float"  # the export's float dtype (float32; float16 for fp16 exports)


# The choice in force where no choice is given, over GPT2X_KV_CACHE_DTYPE's, while kv_dtype_for holds it (None: none).
_HELD: ContextVar[KvDtypeChoice | None] = ContextVar("gpt2x_kv_dtype", default=None)


def asked(choice: KvDtypeChoice | str | None) -> KvDtypeChoice:
    """The choice given, else kv_dtype_for's, else GPT2X_KV_CACHE_DTYPE's, else auto; one UsageError line for a bad
    value."""
    held = _HELD.get()
    if choice is None and held is not None:
        return held
    return env_choice(KvDtypeChoice, choice, KV_DTYPE_ENV, "kv-cache-dtype")


@contextmanager
def kv_dtype_for(choice: KvDtypeChoice) -> Iterator[None]:
    """`choice` where no choice is given, meanwhile, in this thread (an export's gates: whatever the process asks for
    its own backends, the export's are opened on the export as it stands)."""
    token = _HELD.set(choice)
    try:
        yield
    finally:
        _HELD.reset(token)


def int8_kv_scales(info: ExportInfo, choice: KvDtypeChoice, in_place: bool) -> np.ndarray | None:
    """The (2L, H, D) scales of an int8 cache for this export, or None for a float one. Auto: where the export's record
    says to use them (evaluate.kvcache.gate_int8_kv's `use`); int8: wherever the export kept gated scales. The cache must be written
    in place (GroupQueryAttention on the CPU, `in_place`): int8 refused in one line otherwise."""
    if choice is KvDtypeChoice.float:
        return None
    record = info.int8_kv
    if choice is KvDtypeChoice.int8:
        if record is None or not in_place:
            why = f"it is an {info.precision.value} export (int8 and int4 exports hold one; an fp32 one exported with " \
                "--int8-kv)" if KV_KEY not in info.meta and info.precision not in INT8_KV_PRECISIONS else \
                "it kept no gated scales for one (exported before gpt2x had one, with GPT2X_INT8_KV=0, or its gate " \
                "dropped them: its gpt2x.json says which)" if record is None else \
                "the cache is not written in place (on the CPU, --kv-cache auto or in-place)"
            raise ProviderError(f"{info.folder}: cannot hold an int8 KV cache: {why}")
    elif record is None or not in_place or not record.get("use"):
        return None
    from ..onnx.kvcache import load_scales  # safetensors only where the cache is int8

    return load_scales(info.folder, info.config.n_layer)


def scales_digest(scales: np.ndarray | None) -> str | None:
    """The SHA-256 of an int8 cache's scales (None for a float cache): what a graph rewritten to read them depends on."""
    return None if scales is None else hashlib.sha256(np.ascontiguousarray(scales).tobytes()).hexdigest()
