"""An export's int8 KV cache (onnx/kvcache.py; int8 and int4 exports, fp32 ones where asked for): gated by the export's
own parity check with the cache in int8, and by a long context decoded on it (where an int8 cache matters, and where
its error would show: every step attends to hundreds of quantized positions), then one-row decode steps timed on both
caches, so that the runtime holds an int8 or int4 export's in int8 from measured figures (docs/export.md, the int8 KV
cache). No torch here."""

from __future__ import annotations

import statistics

import numpy as np

from ..errors import ArtifactError, ParityError, ProviderError
from ..numerics import positions
from ..onnx.artifact import INT8_KV_ASKED_PRECISIONS, PAGED_KV_KEY, ExportInfo
from ..runtime.base import Backend
from ..runtime.kvdtype import KvDtypeChoice
from ..runtime.ort import OrtBackend
from .batched import decode_step_ms
from .metrics import logit_stats
from .parity import Tolerance, check, int8_kv_tolerance
from .prefill import FASTER_BY, TIMED_REPEAT

LONG_PROMPT = 512  # positions before the long check's decode steps (capped below the model's context)
LONG_STEPS = 16  # decode steps the long check compares, each on every position before it
TIMED_PASTS = (32, 512)  # one-row decode steps timed on caches this long (capped below the model's context)
# Rounds of both caches' timings, alternating, both backends open: timed once each, one after the other, the int8
# cache's steps came 1.4 ms slower than the float's at 32 positions, and 0.9 ms faster side by side (GPT-2 124M int8,
# scratch).
TIMED_ROUNDS = 3
PAGED_GATE_SLOTS = 8  # the paged slots' rows in the u8 cache's gate: more than its parity cases' batches


def compare_long(reference: Backend, backend: Backend, seed: int = 0) -> dict:
    """Logit statistics of LONG_STEPS one-token steps after a LONG_PROMPT-token prompt (random ids, as the parity cases),
    the backend stepping on its own cache, against the reference's forward over the whole sequence without a cache."""
    steps = min(LONG_STEPS, reference.n_positions // 4)
    prompt = min(LONG_PROMPT, reference.n_positions - steps)
    ids = np.random.default_rng(seed).integers(0, reference.vocab_size, (1, prompt + steps), dtype=np.int64)
    mask = np.ones_like(ids)
    want, _ = reference.run(ids, mask, positions(mask, prompt + steps), None)
    want = want[0, prompt - 1 : prompt + steps - 1]  # (steps, V): the logits each step's input follows
    got, cache = backend.step(ids[:, :prompt], mask[:, :prompt], positions(mask[:, :prompt], prompt), None)
    rows = [got[0]]
    for t in range(prompt, prompt + steps - 1):
        got, cache = backend.step(ids[:, t : t + 1], mask[:, : t + 1], positions(mask[:, : t + 1], 1), cache)
        rows.append(got[0])
    return {"prompt": prompt, "steps": steps, **logit_stats(want, np.stack(rows))}


def long_failures(long: dict, tol: Tolerance) -> list[str]:
    """What of compare_long's figures is outside `tol`'s max_rel and max_kl, a line each."""
    failures = [f"max |Δlogit| {long['max_rel']:.3g} of the logit scale (gate {tol.max_rel:g})"] \
        if long["max_rel"] > tol.max_rel else []
    if long["mean_kl"] > tol.max_kl:
        failures.append(f"mean KL {long['mean_kl']:.3g} nats (gate {tol.max_kl:g})")
    return failures


def time_steps(backends: dict[str, OrtBackend], n_positions: int, repeat: int = TIMED_REPEAT,
               rounds: int = TIMED_ROUNDS) -> dict:
    """One-row decode steps' medians (ms) on the float and the int8 cache (`backends`' "float_ms" and "int8_ms", both
    open) at TIMED_PASTS, timed in alternating rounds (the median of each round's median), and `use`: whether the
    int8 cache was faster by FASTER_BY at the longest (where the bytes it saves are most of a step's)."""
    pasts = sorted({min(p, n_positions - 2) for p in TIMED_PASTS})
    names = list(backends)
    runs: dict[str, list[list[float]]] = {name: [[] for _ in pasts] for name in names}
    for r in range(rounds):
        for name in (names if r % 2 == 0 else names[::-1]):
            for i, p in enumerate(pasts):
                runs[name][i].append(decode_step_ms(backends[name], 1, p, repeat))
    figures = {name: [round(statistics.median(times), 3) for times in per_past] for name, per_past in runs.items()}
    use = figures["int8_ms"][-1] < figures["float_ms"][-1] * (1 - FASTER_BY)
    return {"rows": 1, "pasts": pasts, "repeat": repeat, "rounds": rounds, "faster_by": FASTER_BY, **figures, "use": use}


def gate_int8_kv(reference: Backend, info: ExportInfo, threads: int | None = None) -> dict:
    """The int8 KV cache through the export precision's parity check and the long check against `reference` (raises
    ParityError when either is out of tolerance; an fp32 export's at parity.INT8_KV_ON_FP32), the long check on the
    float cache beside it, then timed beside the float cache, the same two backends throughout: {"parity", "long",
    "long_float", "timing", "use"} for gpt2x.json. `use`: an int8 or int4 export's where the timing says so; an fp32
    export's always (its cache was asked for by name, and its float cache stays a choice: --kv-cache-dtype float)."""
    tol = int8_kv_tolerance(info.precision)
    with OrtBackend(info, threads=threads, kv_cache_dtype=KvDtypeChoice.int8) as int8, \
            OrtBackend(info, threads=threads, kv_cache_dtype=KvDtypeChoice.float) as floats:
        parity = check(reference, int8, info.precision, tolerance=tol)
        long = compare_long(reference, int8)
        if parity["status"] == "failed":
            raise ParityError(f"the int8 KV cache is out of tolerance: {parity['message']}")
        failures = long_failures(long, tol)
        if failures:
            raise ParityError(f"the int8 KV cache is out of tolerance after a {long['prompt']}-token prompt: "
                              f"{'; '.join(failures)}")
        long_float = compare_long(reference, floats)  # what the int8 cache adds to the export's own error
        timing = time_steps({"float_ms": floats, "int8_ms": int8}, info.config.n_positions)
    use = timing["use"] or info.precision in INT8_KV_ASKED_PRECISIONS  # asked for by name
    record = {"parity": parity, "long": long, "long_float": long_float, "timing": timing, "use": use}
    if info.precision in INT8_KV_ASKED_PRECISIONS:
        record[PAGED_KV_KEY] = gate_paged_int8_kv(reference, info, threads)
    return record


def gate_paged_int8_kv(reference: Backend, info: ExportInfo, threads: int | None = None) -> dict:
    """OpenVINO's own u8 KV cache on the paged slots (runtime.openvino_paged; an fp32 export with its OpenVINO prefill
    graph), through the same parity check and long check at INT8_KV_ON_FP32 as ONNX Runtime's int8 cache: {"kept":
    True, "kv_cache_precision", "parity", "long"}, or {"kept": False, "reason"} where the slots cannot run the export or
    the cache is out of tolerance (the ONNX Runtime cache's scales stand on their own either way)."""
    if info.prefill is None:
        return {"kept": False, "reason": "no OpenVINO prefill graph (export with --openvino-prefill)"}
    from ..runtime.openvino_paged import QUANTIZED_KV, PagedSlotBackend  # where the export has a graph

    tol = int8_kv_tolerance(info.precision)
    try:
        paged = PagedSlotBackend(info, threads=threads, slots=PAGED_GATE_SLOTS, kv_cache_precision=QUANTIZED_KV)
    except (ProviderError, ArtifactError) as e:  # slots that cannot run it (paged_refusal), or a layout not read
        return {"kept": False, "reason": str(e)}
    with paged:
        parity = check(reference, paged, info.precision, tolerance=tol)
        long = compare_long(reference, paged)
    record = {"kv_cache_precision": QUANTIZED_KV, "parity": parity, "long": long}
    failures = [] if parity["status"] != "failed" else [parity["message"]]
    after = long_failures(long, tol)
    if after:
        failures.append(f"after a {long['prompt']}-token prompt: {'; '.join(after)}")
    return {"kept": not failures, **({"reason": "; ".join(failures)} if failures else {}), **record}
