"""The OpenVINO prefill graph's own gate and timings (docs/export.md, the OpenVINO prefill): its last-position logits
and presents against the reference on fresh prompts and on a past (a left-padded batch among each), the whole
pipeline's greedy agreement (OpenVINO's prefill, then ONNX Runtime's decode), and both prefills timed with their caches
made, fresh and on a past, so the backend can choose the faster from measured figures. No torch here."""

from __future__ import annotations

import math
import statistics
import time
from dataclasses import asdict

import numpy as np

from ..choices import Precision
from ..errors import ParityError
from ..numerics import positions
from ..onnx.artifact import BF16, F32, PREFILL_KEY, ExportInfo
from ..runtime.base import Backend
from ..runtime.ort import OrtBackend
from ..runtime.prefill import PrefillChoice, takes_past
from .metrics import logit_stats
from .parity import GREEDY_TOKENS, TOLERANCES, Case, case_inputs, greedy_agreement, out_of_tolerance

# Fresh prompts: one row, a left-padded batch, a longer batch.
PREFILL_CASES = [Case(1, 0, 7, False), Case(3, 0, 5, True), Case(2, 0, 19, True)]
# On a past (a graph that takes one): a prompt's next chunk, a left-padded batch's.
PAST_CASES = [Case(1, 9, 6, False), Case(3, 11, 4, True)]
# Prompt lengths both prefills are timed at (capped at the model's context): the runtime switches where the two lines
# cross between neighbouring lengths (crossover), so a prompt's chunk of 128 gets the faster one.
TIMED_LENGTHS = (32, 128, 256)
TIMED_PAST = 256  # the past those lengths are timed on too (capped to half the model's context)
# Prompt lengths f32 and bf16 compute are timed at: bf16 may win on long prompts only (GPT-2 124M at int8 weights:
# slower at 256 tokens, faster at 512, benchmarks/prefill_profile.py), so the runtime may use it from a length on.
BF16_LENGTHS = (32, 128, 256, 512)
TIMED_REPEAT = 5  # timed runs per length, after one warm-up; the median counts
# OpenVINO counts as faster only by this share: a near-tie stays on ONNX Runtime, whose caches every other path makes.
FASTER_BY = 0.05


def compare_prefills(reference: Backend, backend: Backend, seed: int = 0, past: bool = False) -> dict:
    """Last-position logits and every layer's presents (real positions only) of `backend`'s prefill against
    `reference`'s on PREFILL_CASES, and with `past` on PAST_CASES too: the reference makes the past, both then
    run the rest of the prompt on it."""
    rng = np.random.default_rng(seed)
    refs, gots, present_err = [], [], 0.0
    cases = PREFILL_CASES + (PAST_CASES if past else [])
    for c in cases:
        ids, mask = case_inputs(c, reference.vocab_size, rng)
        pos = positions(mask, c.seq)
        ref_past = got_past = None
        if c.past:
            _, ref_past = reference.run(ids[:, : c.past], mask[:, : c.past], positions(mask[:, : c.past], c.past), None)
            got_past = backend.past_from_numpy(ref_past.to_numpy())
        ref, ref_cache = reference.step(ids[:, c.past :], mask, pos, ref_past)
        got, got_cache = backend.step(ids[:, c.past :], mask, pos, got_past)
        refs.append(ref)
        gots.append(got)
        keep = mask.astype(bool)  # a padding slot's cache entry is never attended to
        want = np.concatenate([t.transpose(0, 2, 1, 3)[keep].ravel() for t in ref_cache.to_numpy()])
        have = np.concatenate([t.transpose(0, 2, 1, 3)[keep].ravel() for t in got_cache.to_numpy()])
        present_err = max(present_err, float(np.abs(want - have).max() / max(np.abs(want).max(), 1e-12)))
    stats = logit_stats(np.concatenate(refs), np.concatenate(gots))
    stats["present_max_rel"] = present_err
    stats["cases"] = [asdict(c) for c in cases]
    return stats


def check_prefill(reference: Backend, backend: OrtBackend, precision: Precision = Precision.int8,
                  greedy_tokens: int = GREEDY_TOKENS) -> dict:
    """The prefill's parity against `reference` and whether it passes `precision`'s gate (the presents held to the
    logits' relative bound)."""
    tol = TOLERANCES[precision]
    stats = compare_prefills(reference, backend, past=backend.prefill_past_from is not None)
    greedy = greedy_agreement(reference, backend, greedy_tokens)
    failures = out_of_tolerance(stats, greedy, tol)
    if stats["present_max_rel"] > tol.max_rel:
        failures.append(f"max |Δpresent| is {stats['present_max_rel']:.3g} of the cache's scale (gate {tol.max_rel:g})")
    return {"status": "failed" if failures else "passed", "precision": precision.value, "tolerance": asdict(tol),
            "logits": stats, "greedy": greedy, "message": "; ".join(failures)}


def _median_ms(backend: OrtBackend, ids: np.ndarray, repeat: int) -> float:
    mask = np.ones_like(ids)
    pos = positions(mask, ids.shape[1])
    backend.step(ids, mask, pos, None)  # warm-up: the first inference of a shape compiles its kernels
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        backend.step(ids, mask, pos, None)  # the prefill and its cache made, as generation gets them
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def _median_past_ms(backend: OrtBackend, ids: np.ndarray, past: int, repeat: int) -> float:
    """The median ms of the step of ids[:, past:] on the cache of ids[:, :past] (made anew for each, untimed)."""
    mask = np.ones_like(ids)
    T = ids.shape[1] - past
    times = []
    for _ in range(repeat + 1):  # the first a warm-up
        _, cache = backend.step(ids[:, :past], mask[:, :past], positions(mask[:, :past], past), None)
        start = time.perf_counter()
        backend.step(ids[:, past:], mask, positions(mask, T), cache)
        times.append(time.perf_counter() - start)
    return statistics.median(times[1:]) * 1e3


def _medians(info: ExportInfo, prefill: PrefillChoice, prompts: list[np.ndarray], threads: int | None, repeat: int,
             past: int = 0) -> list[float]:
    with OrtBackend(info, threads=threads, prefill=prefill) as backend:
        if past:
            return [round(_median_past_ms(backend, ids, past, repeat), 3) for ids in prompts]
        return [round(_median_ms(backend, ids, repeat), 3) for ids in prompts]


def _prompts(info: ExportInfo, lengths: tuple[int, ...], past: int = 0) -> tuple[list[int], list[np.ndarray]]:
    """`lengths` capped at the model's context after `past`, sorted, and a batch-1 prompt of `past` + each."""
    lengths = sorted({min(n, info.config.n_positions - 1 - past) for n in lengths})
    rng = np.random.default_rng(0)
    return lengths, [rng.integers(0, info.config.vocab_size, (1, past + n), dtype=np.int64) for n in lengths]


def faster_from(sizes: list[int], base_ms: list[float], new_ms: list[float]) -> int | None:
    """The smallest of `sizes` (ascending) from which `new_ms` was faster than `base_ms` by FASTER_BY at that size and
    every larger one (None: not at the largest)."""
    start = len(sizes)
    while start and new_ms[start - 1] < base_ms[start - 1] * (1 - FASTER_BY):
        start -= 1
    return None if start == len(sizes) else sizes[start]


def crossover(sizes: list[int], base_ms: list[float], new_ms: list[float]) -> int | None:
    """The size from which `new_ms` is faster than `base_ms` by FASTER_BY: faster_from's timed size where it is the
    smallest (2: every size), else where the two lines cross between it and the timed size below it (each line
    straight between its two timed points), so that sizes between two timed ones get the faster side too. None: not
    faster at the largest."""
    start = faster_from(sizes, base_ms, new_ms)
    if start is None or start == sizes[0]:
        return None if start is None else 2
    hi = sizes.index(start)
    lo = hi - 1
    # The margin new has over base at each end: not positive at lo (not faster enough there), positive at hi.
    m_lo = base_ms[lo] * (1 - FASTER_BY) - new_ms[lo]
    m_hi = base_ms[hi] * (1 - FASTER_BY) - new_ms[hi]
    return min(start, sizes[lo] + math.ceil((sizes[hi] - sizes[lo]) * -m_lo / (m_hi - m_lo)))


def time_prefills(info: ExportInfo, threads: int | None = None, lengths: tuple[int, ...] = TIMED_LENGTHS,
                  repeat: int = TIMED_REPEAT) -> dict:
    """Both prefills' medians (ms, batch 1) at `lengths` (OpenVINO's at the record's compute precision), and
    `openvino_from`: the prompt length from which OpenVINO's was faster (by FASTER_BY at least) at that and every
    longer timed length (2: at all of them; None: not at the longest); where the graph takes a past, the same for
    those lengths on a past of TIMED_PAST tokens (`past`), from which the runtime runs a prompt's next chunk."""
    timing = _timed(info, threads, lengths, repeat, 0)
    if takes_past(info):
        past = min(TIMED_PAST, (info.config.n_positions - 1) // 2)
        timing["past"] = {"past": past, **_timed(info, threads, lengths, repeat, past)}
    return timing


def _timed(info: ExportInfo, threads: int | None, lengths: tuple[int, ...], repeat: int, past: int) -> dict:
    """Both runtimes' medians of a batch-1 prompt of each of `lengths` new tokens on a `past` (0: fresh; capped at
    the model's context), and from which OpenVINO's was faster (faster_from; 2: at every length)."""
    lengths, prompts = _prompts(info, lengths, past)
    figures = {choice.value: _medians(info, choice, prompts, threads, repeat, past)
               for choice in (PrefillChoice.onnxruntime, PrefillChoice.openvino)}
    openvino_from = crossover(lengths, figures["onnxruntime"], figures["openvino"])
    return {"batch": 1, "lengths": lengths, "repeat": repeat, "faster_by": FASTER_BY, "onnxruntime_ms": figures["onnxruntime"],
            "openvino_ms": figures["openvino"], "openvino_from": openvino_from}


def at_compute(info: ExportInfo, precision: str, bf16_from: int | None = None) -> ExportInfo:
    """`info` with its prefill record's compute precision set to `precision` (what the runtime then compiles at),
    for every prompt length, or bf16 from `bf16_from` tokens on."""
    record = {k: v for k, v in info.prefill.items() if k != "bf16_from"} | {"inference_precision": precision}
    if bf16_from is not None:
        record["bf16_from"] = bf16_from
    return ExportInfo(info.folder, {**info.meta, PREFILL_KEY: record})


def _gate_at(reference: Backend, info: ExportInfo, threads: int | None, warmed: bool = False) -> dict:
    """The gate on the backend as a process runs it; `warmed`: as `gpt2x serve` runs it, after warm_up."""
    with OrtBackend(info, threads=threads, prefill=PrefillChoice.openvino) as backend:
        if warmed:
            backend.warm_up(fold_bf16=True)
        return check_prefill(reference, backend, info.precision)


def bf16_wins(f32_ms: list[float], bf16_ms: list[float]) -> bool:
    """bf16 compute faster by FASTER_BY at the longest timed length, where a prefill takes longest, and slower by no
    more than FASTER_BY at any shorter one (a few percent either way on a short prompt is the rounds' noise)."""
    return bf16_ms[-1] < f32_ms[-1] * (1 - FASTER_BY) and all(b <= f * (1 + FASTER_BY) for b, f in zip(bf16_ms, f32_ms))


def bf16_start(lengths: list[int], f32_ms: list[float], bf16_ms: list[float]) -> int | None:
    """The prompt length from which bf16 compute runs: 2 (every length) where bf16_wins, else the shortest timed
    length from which bf16 was faster by FASTER_BY at that and every longer one (None: not at the longest)."""
    return 2 if bf16_wins(f32_ms, bf16_ms) else crossover(lengths, f32_ms, bf16_ms)


def try_bf16(reference: Backend, info: ExportInfo, threads: int | None = None, lengths: tuple[int, ...] = BF16_LENGTHS,
             repeat: int = TIMED_REPEAT) -> dict:
    """The prefill at bf16 compute, where this CPU has it: gated as f32's (the export precision's tolerances), then
    timed beside f32 compute; `kept` (for every length) where it passed and bf16_wins, `from` the prompt length from
    which it runs where it passed (bf16_start; None: never). `folded`: the same gate's verdict on the graph a server
    compiles, its int8 weights' decompression folded into constants (runtime.openvino_prefill), which it runs only
    where that passed."""
    from ..runtime.openvino_prefill import cpu_has_bf16

    if not cpu_has_bf16():
        return {"kept": False, "reason": "this CPU has no bf16 compute"}
    bf16 = at_compute(info, BF16)
    parity = _gate_at(reference, bf16, threads)
    if parity["status"] == "failed":
        return {"kept": False, "reason": f"out of tolerance: {parity['message']}", "parity": parity}
    folded = _gate_at(reference, bf16, threads, warmed=True)
    lengths, prompts = _prompts(info, lengths)
    ms = {p: _medians(at_compute(info, p), PrefillChoice.openvino, prompts, threads, repeat) for p in (F32, BF16)}
    start = bf16_start(lengths, ms[F32], ms[BF16])
    reason = "passed, faster" if start == 2 else "passed, not faster" if start is None else f"passed, faster from {start} tokens"
    return {"kept": start == 2, "from": start, "reason": reason, "parity": parity, "lengths": lengths,
            "f32_ms": ms[F32], "bf16_ms": ms[BF16], "folded": {k: folded[k] for k in ("status", "message")}}


def gate_prefill(reference: Backend, info: ExportInfo, threads: int | None = None) -> dict:
    """The export's OpenVINO prefill gated against `reference` at f32 compute (raises ParityError when out of
    tolerance), then at bf16 where the CPU has it (try_bf16: kept only where it passes the same gate and is faster),
    then timed beside ONNX Runtime's at the compute precision chosen: {"inference_precision", "parity" (the chosen
    one's), "parity_f32" (where bf16 was chosen: the fallback's), "bf16_from" and "parity_bf16" (where bf16 runs
    from a prompt length on only, f32 below it), "bf16", "timing"} for gpt2x.json."""
    f32 = at_compute(info, F32)
    parity = _gate_at(reference, f32, threads)
    if parity["status"] == "failed":
        raise ParityError(f"the OpenVINO prefill is out of tolerance: {parity['message']}")
    bf16 = try_bf16(reference, f32, threads)
    record = {"inference_precision": F32, "parity": parity, "bf16": dict(bf16)}
    if "parity" in bf16:  # its verdict here; the whole of it is `parity` where bf16 is kept
        record["bf16"]["parity"] = {k: bf16["parity"][k] for k in ("status", "message")}
    if bf16["kept"]:
        record.update(inference_precision=BF16, parity=bf16["parity"], parity_f32=parity)
    elif bf16.get("from") is not None:
        record.update(bf16_from=bf16["from"], parity_bf16=bf16["parity"])
    record["timing"] = time_prefills(at_compute(info, record["inference_precision"], record.get("bf16_from")), threads)
    return record
