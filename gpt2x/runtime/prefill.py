"""Which runtime runs a fresh prompt's prefill on an fp32 or int8 export: ONNX Runtime on model.onnx, or OpenVINO on the
export's prefill graph (docs/backends.md, the OpenVINO prefill). Chosen from the figures the export measured, not by
name; a user may force either way. Neither openvino nor torch is imported here."""

from __future__ import annotations

import os
from enum import Enum
from typing import TypeVar

from ..errors import ProviderError, UsageError, installed
from ..onnx import names as io
from ..onnx.artifact import ExportInfo

PREFILL_ENV = "GPT2X_PREFILL"  # the choice for this process and those it starts (the CLI's --prefill sets it)


class PrefillChoice(str, Enum):
    auto = "auto"  # OpenVINO where the export measured it faster and openvino imports
    onnxruntime = "onnxruntime"
    openvino = "openvino"  # refused where the export has no prefill graph or openvino does not import


Choice = TypeVar("Choice", bound=Enum)


def env_choice(kind: type[Choice], choice: Choice | str | None, env: str, option: str) -> Choice:
    """The choice given, else the environment variable `env`'s, else `kind`'s auto; one UsageError line (naming
    `option`) for a bad value."""
    value = choice if choice is not None else os.environ.get(env) or kind("auto")
    try:
        return kind(value)
    except ValueError:
        raise UsageError(f"{option}: {value!r} is not one of {', '.join(c.value for c in kind)}"
                         f" (the choice or {env})", option=option) from None


def asked(choice: PrefillChoice | str | None) -> PrefillChoice:
    """The choice given, else GPT2X_PREFILL's, else auto; one UsageError line for a bad value."""
    return env_choice(PrefillChoice, choice, PREFILL_ENV, "prefill")


def openvino_from(info: ExportInfo, choice: PrefillChoice, on_cpu: bool) -> int | None:
    """The prompt length from which OpenVINO runs the prefill (None: never). Auto: from the export's record, where
    it timed OpenVINO's prefill (with the handoff of its cache) faster than ONNX Runtime's; every prompt where the
    record computes in bf16 (uniform_compute: a timing chooses no numerics)."""
    if choice is PrefillChoice.onnxruntime:
        return None
    record = info.prefill
    usable = record is not None and on_cpu and installed("openvino")  # imported where it runs (OrtBackend)
    if choice is PrefillChoice.openvino:
        if not usable:
            why = "it has no OpenVINO prefill graph (an fp32 or int8 export made with the openvino extra installed has one)" \
                if record is None else "OpenVINO runs on the CPU only" if not on_cpu else "openvino is not installed"
            raise ProviderError(f"{info.folder}: cannot run the prefill on OpenVINO: {why}")
        return 2
    if not usable:
        return None
    if uniform_compute(info):
        return 2
    return (record.get("timing") or {}).get("openvino_from")


def uniform_compute(info: ExportInfo) -> bool:
    """Whether every prefill and chunk must run on OpenVINO: its record computes in bf16, which ONNX Runtime does not,
    so a route chosen by a timing would give a prompt other numerics whole than chunked or after a cached prefix."""
    return (info.prefill or {}).get("inference_precision") == "bf16"


def takes_past(info: ExportInfo) -> bool:
    """Whether the export's prefill graph takes a past: the next chunk of a prompt, or its rest after a cached prefix
    (exports made before it did run fresh prompts only)."""
    return io.past_key(0) in (info.prefill or {}).get("inputs", ())


def openvino_past_from(info: ExportInfo, choice: PrefillChoice, fresh_from: int | None) -> int | None:
    """The new tokens (rows x new tokens, more than one a row) from which OpenVINO runs a step on a past (None: never):
    where it runs fresh prompts (`fresh_from`, openvino_from's) and the graph takes a past; forced or at bf16 compute,
    every such step; auto, from the export's timing of chunks on a past on both runtimes (its `past`)."""
    if fresh_from is None or not takes_past(info):
        return None
    if choice is PrefillChoice.openvino or uniform_compute(info):
        return 2
    return ((info.prefill.get("timing") or {}).get("past") or {}).get("openvino_from")


def estimate_ms(timing: dict | None, runtime: PrefillChoice, tokens: int) -> float | None:
    """A prefill's time on `runtime` for `tokens` (rows x new tokens), from the export's record of one row's prompts
    timed on both runtimes (`timing`: lengths, onnxruntime_ms, openvino_ms): the line through its first and last
    lengths' times. None where the record has no such times."""
    ms = (timing or {}).get(f"{runtime.value}_ms")
    lengths = (timing or {}).get("lengths")
    if not ms or not lengths or len(ms) != len(lengths) or len(lengths) < 2 or lengths[-1] == lengths[0]:
        return None
    per_token = (ms[-1] - ms[0]) / (lengths[-1] - lengths[0])
    return max(0.0, ms[0] + per_token * (tokens - lengths[0]))
