"""What a long prompt's join costs the rows decoding beside it, at the backend: the serving engine's in-place cache (the
joiner's prefill, then its merge into the batch's buffers, every row right-aligned to the new width) against
SlotDecoder's fixed slots (the joiner's prefill into a slot of its own; nothing merged), and the slots with each chunk
run in the forward of the rows' decode step (`slots_mixed`: SlotDecoder.step_mixed), on one fp32 export, with the same
rows, prompt and threads. Medians over rounds, in ms.

    python benchmarks/slot_join.py --export EXPORTS/random-gpt2-fp32 \
        --out benchmarks/results/slot-join-epyc-avx2-cpu-2core.json

Rows: `--rows` rows of `--row-tokens` tokens decoding; a prompt of `--prompt-tokens` joins, in one forward or in
`--chunk`-token chunks (each on what the earlier ones wrote); `--steps` decode steps timed before and after. The slot
decoder holds `--slots` slots; a step runs those up to the highest one held. `join_stall`: the running rows' longest
gap beyond a step, where the engine interleaves chunks with decode steps (the longest chunk, the merge, the first
step's excess); for `slots_mixed`, whose every chunk is a forward with the rows' decode step in it, the longest such
forward's excess over a step, and the first step's.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np

from gpt2x.bench.system import system_info
from gpt2x.numerics import positions
from gpt2x.onnx.artifact import read_export
from gpt2x.runtime.ort import OrtBackend
from gpt2x.runtime.static_decode import SlotDecoder


def ms(start: float) -> float:
    return (time.perf_counter() - start) * 1e3


def in_place_round(backend: OrtBackend, rows: np.ndarray, prompt: np.ndarray, steps: int, chunk: int) -> dict:
    R, L = rows.shape
    mask = np.ones_like(rows)
    logits, past = backend.step(rows, mask, positions(mask, L), None)
    tok = logits.argmax(-1)[:, None]
    before = []
    for _ in range(steps):
        mask = np.concatenate([mask, np.ones((R, 1), np.int64)], axis=1)
        t = time.perf_counter()
        logits, past = backend.step(tok, mask, positions(mask, 1), past)
        before.append(ms(t))
        tok = logits.argmax(-1)[:, None]
    P = prompt.shape[1]
    chunks, jpast = [], None
    for start in range(0, P, chunk):  # the joiner's prefill, in chunks on its own growing cache
        part = prompt[:, start : start + chunk]
        jmask = np.ones((1, start + part.shape[1]), np.int64)
        t = time.perf_counter()
        jlogits, jpast = backend.step(part, jmask, positions(jmask, part.shape[1]), jpast)
        chunks.append(ms(t))
    prefill = sum(chunks)
    width = max(mask.shape[1], P)
    t = time.perf_counter()
    past = past.merge(np.arange(R + 1), jpast, width)
    merge = ms(t)
    fit = np.zeros((R + 1, width), np.int64)
    fit[:R, width - mask.shape[1]:] = mask
    fit[R, width - P:] = 1
    mask, tok = fit, np.concatenate([tok, jlogits.argmax(-1)[:, None]])
    after = []
    for _ in range(steps):
        mask = np.concatenate([mask, np.ones((R + 1, 1), np.int64)], axis=1)
        t = time.perf_counter()
        logits, past = backend.step(tok, mask, positions(mask, 1), past)
        after.append(ms(t))
        tok = logits.argmax(-1)[:, None]
    return {"step_before": before, "prefill": prefill, "chunk": chunks, "merge": merge, "first_step_after": after[0],
            "step_after": after[1:]}


def slot_round(decoder: SlotDecoder, rows: np.ndarray, prompt: np.ndarray, steps: int, chunk: int,
               mixed: bool = False) -> dict:
    """The rows decoding in slots, the prompt joining into its own slot, chunk after chunk; `mixed`: each chunk run in
    the forward of the rows' decode step (SlotDecoder.step_mixed), whose time `chunk` then is."""
    R = rows.shape[0]
    for slot in range(decoder.slots):
        decoder.release(slot)
    tok = np.zeros(decoder.slots, np.int64)
    for slot in range(R):
        tok[slot] = decoder.prefill(slot, rows[slot]).argmax()
    active = np.arange(decoder.slots) < R
    before = []
    for _ in range(steps):
        t = time.perf_counter()
        logits = decoder.step(tok)
        before.append(ms(t))
        tok[:R] = logits[:R].argmax(-1)
    chunks = []
    for start in range(0, prompt.shape[1], chunk):
        part = prompt[0, start : start + chunk]
        t = time.perf_counter()
        if mixed:
            logits, last = decoder.step_mixed(tok, active, R, part)
            tok[:R] = logits[:R].argmax(-1)
        else:
            last = decoder.prefill(R, part)
        chunks.append(ms(t))
        tok[R] = last.argmax()
    after = []
    for _ in range(steps):
        t = time.perf_counter()
        logits = decoder.step(tok)
        after.append(ms(t))
        tok[: R + 1] = logits[: R + 1].argmax(-1)
    return {"step_before": before, "prefill": sum(chunks), "chunk": chunks, "merge": 0.0, "first_step_after": after[0],
            "step_after": after[1:]}


def summary(rounds: list[dict], mixed: bool = False) -> dict:
    out = {}
    for key in rounds[0]:
        values = [v for r in rounds for v in (r[key] if isinstance(r[key], list) else [r[key]])]
        out[key] = round(float(np.median(values)), 2)
    # the running rows' longest gap: the whole prefill where it is one forward, the longest chunk where the engine
    # would interleave chunks with decode steps; plus the merge and the first step's excess
    longest = max(float(np.median([r["chunk"][i] for r in rounds])) for i in range(len(rounds[0]["chunk"])))
    out["chunk"] = [round(float(np.median([r["chunk"][i] for r in rounds])), 2) for i in range(len(rounds[0]["chunk"]))]
    # (a mixed chunk's forward holds the rows' step: only its excess over a step stalls them)
    stall = longest - out["step_before"] if mixed else longest
    out["join_stall"] = round(stall + out["merge"] + out["first_step_after"] - out["step_after"], 2)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--export", type=Path, required=True)
    ap.add_argument("--rows", type=int, default=4)
    ap.add_argument("--row-tokens", type=int, default=128)
    ap.add_argument("--prompt-tokens", type=int, default=512)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--slots", type=int, default=8)
    ap.add_argument("--chunk", type=int, default=None, help="the joiner's prefill in chunks of this many tokens (default: one)")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    info = read_export(args.export)
    rng = np.random.default_rng(0)
    V = info.config.vocab_size
    capacity = max(args.row_tokens, args.prompt_tokens) + 2 * args.steps + 1
    backend = OrtBackend(info, threads=args.threads)
    decoder = SlotDecoder(info, slots=args.slots, capacity=capacity, threads=args.threads)
    results = {"in_place": [], "slots": [], "slots_mixed": []}
    for _ in range(args.rounds + 1):  # the first round warms both up and is not kept
        rows = rng.integers(0, V, (args.rows, args.row_tokens))
        prompt = rng.integers(0, V, (1, args.prompt_tokens))
        chunk = args.chunk or args.prompt_tokens
        results["in_place"].append(in_place_round(backend, rows, prompt, args.steps, chunk))
        results["slots"].append(slot_round(decoder, rows, prompt, args.steps, chunk))
        results["slots_mixed"].append(slot_round(decoder, rows, prompt, args.steps, chunk, mixed=True))
    record = {
        "benchmark": "slot_join", "command": "python benchmarks/slot_join.py " + " ".join(
            f"--{k.replace('_', '-')} {v}" for k, v in vars(args).items() if k not in ("out",) and v is not None),
        "system": system_info(), "export": {"model": info.meta["model"]["name"], "precision": info.precision.value,
                                            "in_place_kv": backend.in_place_kv},
        "settings": {k: v for k, v in vars(args).items() if k not in ("export", "out")} | {"capacity": capacity},
        "in_place": summary(results["in_place"][1:]), "slots": summary(results["slots"][1:]),
        "slots_mixed": summary(results["slots_mixed"][1:], mixed=True),
    }
    args.out.write_text(json.dumps(record, indent=1) + "\n")
    print(json.dumps({k: record[k] for k in ("in_place", "slots", "slots_mixed")}, indent=1))


if __name__ == "__main__":
    main()
