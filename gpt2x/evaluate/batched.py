"""An int8 export's batched decode graph (onnx/optimize.quantize_int8_dynamic): gated by the export's own parity check
with every step on it, then one decode step of both graphs timed at a few rows x new tokens, so the backend runs a
step on the faster from measured figures (docs/export.md, the batched decode graph). No torch here."""

from __future__ import annotations

import statistics
import time

import numpy as np

from ..errors import ParityError
from ..onnx.artifact import ExportInfo
from ..runtime.base import Backend
from ..runtime.ort import OrtBackend
from .parity import check
from .prefill import FASTER_BY, TIMED_REPEAT, faster_from

TIMED_ROWS = (1, 4, 8, 16, 32)  # decode steps of this many rows (one new token each): M = rows x new tokens
TIMED_PAST = 32  # positions every row holds before the timed step (capped below the model's context)


def decode_step_ms(backend: OrtBackend, rows: int, past: int, repeat: int) -> float:
    """The median of one decode step of `rows` rows on a `past`-position cache (rolled back after each step)."""
    rng = np.random.default_rng(0)
    ids = rng.integers(0, backend.vocab_size, (rows, past + 1), dtype=np.int64)
    mask = np.ones_like(ids)
    positions = np.broadcast_to(np.arange(past + 1, dtype=np.int64), ids.shape)
    _, cache = backend.step(ids[:, :past], mask[:, :past], positions[:, :past], None)
    times = []
    for i in range(repeat + 1):  # the first compiles the step's kernels
        start = time.perf_counter()
        _, after = backend.step(ids[:, past:], mask, positions[:, past:], cache)
        if i:
            times.append(time.perf_counter() - start)
        cache = after.truncate(past)
    return statistics.median(times) * 1e3


def time_steps(info: ExportInfo, threads: int | None = None, rows: tuple[int, ...] = TIMED_ROWS,
               repeat: int = TIMED_REPEAT) -> dict:
    """Both graphs' medians (ms) of one decode step at `rows`, and `batched_from`: the smallest rows x new tokens
    from which the batched graph was faster by FASTER_BY at that and every larger timed one (None: not at the
    largest)."""
    past = min(TIMED_PAST, info.config.n_positions - 2)
    figures = {}
    for name, batched in (("model_ms", False), ("batched_ms", True)):
        with OrtBackend(info, threads=threads, batched=batched) as backend:
            figures[name] = [round(decode_step_ms(backend, r, past, repeat), 3) for r in rows]
    return {"rows": list(rows), "new_tokens": 1, "past": past, "repeat": repeat, "faster_by": FASTER_BY, **figures,
            "batched_from": faster_from(list(rows), figures["model_ms"], figures["batched_ms"])}


def gate_batched(reference: Backend, info: ExportInfo, threads: int | None = None) -> dict:
    """The batched decode graph, every step on it, through the export precision's parity check against `reference`
    (raises ParityError when out of tolerance), then timed beside model.onnx: {"parity", "timing", "batched_from"}
    for gpt2x.json."""
    with OrtBackend(info, threads=threads, batched=True) as backend:
        parity = check(reference, backend, info.precision)
    if parity["status"] == "failed":
        raise ParityError(f"the batched decode graph is out of tolerance: {parity['message']}")
    timing = time_steps(info, threads)
    return {"parity": parity, "timing": timing, "batched_from": timing["batched_from"]}
