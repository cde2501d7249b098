"""The OpenVINO prefill graph's own gate and timings (docs/export.md, the OpenVINO prefill): its last-position logits
and presents against the reference on fresh prompts and on a past (a left-padded batch among each), the whole
pipeline's greedy agreement (OpenVINO's prefill, then ONNX Runtime's decode), and both prefills timed with their caches
made, fresh and on a past, so the backend can choose the faster from measured figures. A bf16 export's graph is gated
on the openvino backend, at bf16 (gate_bf16_prefill). No torch here."""

from __future__ import annotations

import math
import statistics
import time
from dataclasses import asdict

import numpy as np

from ..choices import Precision
from ..errors import ParityError, UsageError
from ..numerics import positions
from ..onnx.artifact import BF16, F32, PREFILL_KEY, ExportInfo
from ..runtime.base import Backend
from ..runtime.ort import OrtBackend
from ..runtime.prefill import PrefillChoice, takes_past
from .metrics import logit_stats
from .parity import GREEDY_TOKENS, TOLERANCES, Case, case_inputs, greedy_agreement, out_of_tolerance

# Fresh prompts: one row, a left-padded batch, a longer batch.
PREFILL_CASES = [Case(1, 0, 7, False), Case(3, 0, 5, True), Case(2, 0, 19, True)]
# On a past (a graph that takes one): a prompt's next chunk, a left-padded batch's, and its decode step (the openvino
# backend decodes on the graph).
PAST_CASES = [Case(1, 9, 6, False), Case(3, 11, 4, True), Case(3, 11, 1, True)]
# Prompt lengths both prefills are timed at (capped at the model's context): the runtime switches where the two lines
# cross between neighbouring lengths (crossover), so a prompt's chunk of 128 gets the faster one. 8: a short prompt ran
# sooner on ONNX Runtime (GPT-2 124M int8, 2-core EPYC: 9-10 against 9.5-14 ms), where timing 32 first had sent it to
# OpenVINO and a fresh process's short prompt waited for OpenVINO's start.
TIMED_LENGTHS = (8, 32, 128, 256)
TIMED_PAST = 256  # the past those lengths are timed on too (capped to half the model's context)
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


def check_prefill(reference: Backend, backend: Backend, precision: Precision = Precision.int8,
                  greedy_tokens: int = GREEDY_TOKENS, past: bool | None = None) -> dict:
    """The prefill's parity against `reference` and whether it passes `precision`'s gate (the presents held to the
    logits' relative bound); on a past too where `past` (None: where the OrtBackend runs one on OpenVINO)."""
    tol = TOLERANCES[precision]
    if past is None:
        past = backend.prefill_past_from is not None
    stats = compare_prefills(reference, backend, past=past)
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
    smallest (sizes below it were not timed and stay on the base: a few milliseconds either way, where a one-shot
    process would open OpenVINO for them, about 170 ms on a Xeon), else where the two lines cross between it and the
    timed size below it (each line straight between its two timed points), so that sizes between two timed ones get
    the faster side too. None: not faster at the largest."""
    start = faster_from(sizes, base_ms, new_ms)
    if start is None or start == sizes[0]:
        return start
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
    longer timed length (the shortest timed where at all of them; None: not at the longest); where the graph takes a past, the same for
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


def at_compute(info: ExportInfo, precision: str) -> ExportInfo:
    """`info` with its prefill record's compute precision set to `precision` (what the runtime then compiles at)."""
    record = {k: v for k, v in info.prefill.items() if k != "bf16_from"} | {"inference_precision": precision}
    return ExportInfo(info.folder, {**info.meta, PREFILL_KEY: record})


def _gate_at(reference: Backend, info: ExportInfo, threads: int | None, warmed: bool = False) -> dict:
    """The gate on the backend as a process runs it; `warmed`: as `gpt2x serve` runs it, after warm_up."""
    with OrtBackend(info, threads=threads, prefill=PrefillChoice.openvino) as backend:
        if warmed:
            backend.warm_up(fold_bf16=True)
        return check_prefill(reference, backend, info.precision)


def _median_ms_on(open_backend, prompts: list[np.ndarray], repeat: int) -> list[float]:
    with open_backend() as backend:
        return [round(_median_ms(backend, ids, repeat), 3) for ids in prompts]


def gate_bf16_prefill(reference: Backend, info: ExportInfo, threads: int | None = None) -> dict:
    """A bf16 export's prefill graph gated on the backend that runs bf16 (the openvino backend: ONNX Runtime computes
    none on the CPU), every step of more than one token on it, fresh and on a past, at bf16's tolerances (raises
    ParityError when out of them; it runs at bf16 only, so there is no f32 gate); then timed against that backend's
    model.onnx at bf16 (`timing`: both at batch 1, fresh prompts, for the record: the backend uses it whatever it says,
    as OrtBackend's bf16 prefill, so that a prompt's numerics do not depend on its length)."""
    from ..runtime.openvino import OpenVinoBackend

    with OpenVinoBackend(info, threads=threads, prefill_graph=True) as backend:
        parity = check_prefill(reference, backend, Precision.bf16, past=backend.prefill_graph.takes_past)
        used = backend.prefill_steps
    if parity["status"] == "failed":
        raise ParityError(f"the OpenVINO prefill at bf16 compute is out of tolerance: {parity['message']}")
    if not used:  # the gate would have checked model.onnx again
        raise ParityError("the OpenVINO prefill's gate ran no step on it")
    lengths, prompts = _prompts(info, TIMED_LENGTHS)
    timing = {"batch": 1, "lengths": lengths, "repeat": TIMED_REPEAT, "compute": BF16,
              "prefill_graph_ms": _median_ms_on(lambda: OpenVinoBackend(info, threads=threads, prefill_graph=True),
                                                prompts, TIMED_REPEAT),
              "model_onnx_ms": _median_ms_on(lambda: OpenVinoBackend(info, threads=threads, prefill_graph=False),
                                             prompts, TIMED_REPEAT)}
    return {"inference_precision": BF16, "parity": parity, "timing": timing}


def gate_prefill(reference: Backend, info: ExportInfo, threads: int | None = None, compute: str = F32) -> dict:
    """The export's OpenVINO prefill gated against `reference` at f32 compute (raises ParityError when out of
    tolerance); with `compute` bf16 (asked for at export, never chosen by a timing: every prefill path must compute
    the same way, docs/export.md), gated at bf16 too, on the graph as a one-shot process compiles it and with its
    int8 weights folded as a server does (raises where either fails); then timed beside ONNX Runtime's at the compute
    precision recorded: {"inference_precision", "parity" (that precision's gate), "parity_f32" (with bf16: the
    fallback's on a CPU without it), "bf16_folded", "timing"} for gpt2x.json."""
    if info.precision is Precision.bf16:
        return gate_bf16_prefill(reference, info, threads)
    f32 = at_compute(info, F32)
    parity = _gate_at(reference, f32, threads)
    if parity["status"] == "failed":
        raise ParityError(f"the OpenVINO prefill is out of tolerance: {parity['message']}")
    record = {"inference_precision": F32, "parity": parity}
    if compute == BF16:
        from ..runtime.openvino_prefill import cpu_has_bf16

        if not cpu_has_bf16():
            raise UsageError("bf16 prefill compute needs a CPU that computes bf16 (AVX-512 BF16 or AMX); this one does not")
        bf16 = at_compute(info, BF16)
        parity_bf16 = _gate_at(reference, bf16, threads)
        folded = _gate_at(reference, bf16, threads, warmed=True)
        for what, gate in (("", parity_bf16), (" with its weights folded", folded)):
            if gate["status"] == "failed":
                raise ParityError(f"the OpenVINO prefill at bf16 compute{what} is out of tolerance: {gate['message']}")
        record.update(inference_precision=BF16, parity=parity_bf16, parity_f32=parity,
                      bf16_folded={k: folded[k] for k in ("status", "message")})
    record["timing"] = time_prefills(at_compute(info, record["inference_precision"]), threads)
    return record
