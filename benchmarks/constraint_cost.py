"""Structured output's cost per decode step against the step itself: the int8 export of GPT-2 124M
(random weights) on ONNX Runtime, at batch 1 and 16, every row under its own constraint.

    python benchmarks/constraint_cost.py --out benchmarks/results/constraint-cost-cpu-2core

Each step of a constrained batch pays, besides the model's decode step:
- fill: every row's next-token bitmask (B, 1571 words): llguidance's one call on its thread pool
  (gpt2x.generation.constraints.fill_rows, what mask_rows does: "parallel"), and, in a run of its
  own with the same seed (the same tokens), row by row ("serial"); batch 1 fills its one row directly;
- apply: the bitmask on the step's logits (B, 50257) float32, in place (constraints.apply_bitmask);
- advance: every row's matcher takes its sampled token.
The sampling itself (softmax and draw from the masked logits) is the sampler's, paid with or without
a constraint, and is not counted. A row whose constraint is done feeds end of text and starts over
with a fresh Constraint (counted in advance), so every row is constrained at every step. The kinds:
a JSON schema, any JSON object, a regex and a Lark grammar. The mask's share = (fill + apply + advance)
/ the decode step, from the means; the issue's target is at most 10%.

Before the steps, once: a spec's validation and compilation cold (first use in the process), and a
Constraint's construction from a compiled spec (a deep copy).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np

from gpt2x.bench.report import save_results
from gpt2x.bench.system import system_info
from gpt2x.choices import BackendKind, Precision
from gpt2x.generation.constraints import Constraint, ConstraintSpec, apply_bitmask, fill_rows, lltokenizer, words
from gpt2x.numerics import positions
from gpt2x.tokenizer import EOT_ID, encode
from gpt2x.workflows import ensure_export, export_backend

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 24},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "email": {"type": "string", "format": "email"},
        "member": {"type": "boolean"},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 12}, "maxItems": 5},
        "home": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}, "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
                 "required": ["city", "zip"], "additionalProperties": False},
    },
    "required": ["name", "age", "member", "home"],
    "additionalProperties": False,
}
SPECS = {
    "json_schema": ConstraintSpec.json_schema(PERSON),
    "json_object": ConstraintSpec.json_object(),
    "regex": ConstraintSpec.regex(r"[A-Z][a-z]{2,8}-[0-9]{3}( [a-z]{2,8}){1,6}\."),
    "grammar": ConstraintSpec.grammar('start: expr\nexpr: term (("+" | "-") term)*\nterm: factor (("*" | "/") factor)*\n'
                                      'factor: /[0-9]{1,4}/ | "(" expr ")"'),
}
PROMPT = "Here is the record as JSON:"


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def stats(ms: list[float]) -> dict:
    return {"median": statistics.median(ms), "mean": statistics.fmean(ms), "p90": float(np.percentile(ms, 90)), "max": max(ms)}


def cold_costs() -> dict:
    """Validation + compilation of each spec the first time (this process has compiled none yet),
    and a Constraint's construction once compiled."""
    t = time.perf_counter()
    lltokenizer()
    out = {"tokenizer_ms": (time.perf_counter() - t) * 1e3}
    for kind, spec in SPECS.items():
        t = time.perf_counter()
        spec.validate()
        Constraint(spec)
        cold = (time.perf_counter() - t) * 1e3
        t = time.perf_counter()
        for _ in range(100):
            Constraint(spec)
        out[kind] = {"validate_and_compile_ms": cold, "new_constraint_ms": (time.perf_counter() - t) * 10}
    return out


def run(backend, spec: ConstraintSpec, batch: int, steps: int, warmup: int, seed: int, parallel: bool) -> dict:
    """`warmup` + `steps` decode steps of `batch` rows under `spec`, the masks filled by llguidance's
    thread pool (`parallel`, as mask_rows does) or row by row; the timings of the last `steps`."""
    rng = np.random.default_rng(seed)
    prompt = encode(PROMPT)
    ids = np.asarray([prompt] * batch, dtype=np.int64)  # (B, L): one length, no padding
    mask = np.ones_like(ids)
    logits, past = backend.step(ids, mask, positions(mask, ids.shape[1]), None)  # (B, V)
    rows = [Constraint(spec, logits.shape[1]) for _ in range(batch)]
    n_words = words(logits.shape[1])
    t: dict[str, list[float]] = {"step": [], "fill": [], "apply": [], "advance": []}
    restarts = tokens_out = 0
    for s in range(warmup + steps):
        if not logits.flags.writeable or logits.dtype != np.float32:
            logits = logits.astype(np.float32)  # (B, V); else the backend's own array, masked in place
        bitmask = np.empty((batch, n_words), dtype=np.int32)  # (B, words)
        a = time.perf_counter()
        if parallel:
            fill_rows(rows, bitmask)
        else:
            for i, c in enumerate(rows):
                c.fill(bitmask[i])
        fill_ms = (time.perf_counter() - a) * 1e3
        a = time.perf_counter()
        apply_bitmask(logits, bitmask)
        apply_ms = (time.perf_counter() - a) * 1e3
        p = np.exp(logits.astype(np.float64) - logits.max(axis=1, keepdims=True))  # sampled at temperature 1 (not counted)
        cdf = np.cumsum(p, axis=1)
        drawn = np.minimum((cdf < rng.random((batch, 1)) * cdf[:, -1:]).sum(axis=1), logits.shape[1] - 1)
        a = time.perf_counter()
        for i, c in enumerate(rows):
            c.advance(int(drawn[i]))
            if c.done:  # the text is complete: end of text goes in, a new record starts
                rows[i] = Constraint(spec, logits.shape[1])
                drawn[i] = EOT_ID
                restarts += s >= warmup
            tokens_out += s >= warmup
        advance_ms = (time.perf_counter() - a) * 1e3
        mask = np.concatenate([mask, np.ones((batch, 1), dtype=np.int64)], axis=1)  # (B, P+1)
        a = time.perf_counter()
        logits, past = backend.step(drawn.astype(np.int64)[:, None], mask, positions(mask, 1), past)
        step_ms = (time.perf_counter() - a) * 1e3
        if s >= warmup:
            for k, v in (("step", step_ms), ("fill", fill_ms), ("apply", apply_ms), ("advance", advance_ms)):
                t[k].append(v)
    out = {k: stats(v) for k, v in t.items()}
    cost = statistics.fmean(t["fill"]) + statistics.fmean(t["apply"]) + statistics.fmean(t["advance"])
    out["mask_share_of_step"] = cost / statistics.fmean(t["step"])
    out["completed_outputs"] = restarts
    out["tokens"] = tokens_out
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="random:gpt2")
    ap.add_argument("--precision", type=Precision, default=Precision.int8)
    ap.add_argument("--batches", default="1,16")
    ap.add_argument("--kinds", default=",".join(SPECS), help=f"of {', '.join(SPECS)}")
    ap.add_argument("--steps", type=int, default=128, help="timed decode steps per batch and kind")
    ap.add_argument("--warmup", type=int, default=8)
    ap.add_argument("--exports", type=Path, default=Path("exported"))
    ap.add_argument("--out", type=Path, default=None, help="output path without extension (.json, .md); none: print only")
    args = ap.parse_args()
    from gpt2x.onnx.artifact import default_export_dir

    cold = cold_costs()
    info = ensure_export(args.model, args.precision, folder=default_export_dir(args.model, args.precision, args.exports),
                         progress=log, notice=log)
    backend = export_backend(BackendKind.ort, info)
    if len(encode(PROMPT)) + args.warmup + args.steps + 1 > backend.n_positions:
        raise SystemExit(f"--warmup + --steps must fit in the context ({backend.n_positions} positions)")
    results = []
    for batch in (int(b) for b in args.batches.split(",")):
        for kind in args.kinds.split(","):
            for fill in ("parallel", "serial") if batch > 1 else ("serial",):
                log(f"batch {batch}, {kind}, fill {fill}")
                r = run(backend, SPECS[kind], batch, args.steps, args.warmup, seed=batch, parallel=fill == "parallel")
                results.append({"batch": batch, "kind": kind, "fill_mode": fill, **r})
    backend.close()
    lines = [f"Structured output's cost per decode step, {args.model} {args.precision.value} on ONNX Runtime (CPU), "
             f"{args.steps} timed steps after {args.warmup}; every row constrained, sampled at temperature 1. Mean ms "
             "(median in brackets). share = (fill + apply + advance) / step.", "",
             "| batch | kind | fill | decode step | fill | apply | advance | share of the step | outputs completed |",
             "| ---: | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for r in results:
        cells = " | ".join(f"{r[k]['mean']:.3f} ({r[k]['median']:.3f})" for k in ("step", "fill", "apply", "advance"))
        lines.append(f"| {r['batch']} | {r['kind']} | {r['fill_mode']} | {cells} | {100 * r['mask_share_of_step']:.1f}% | {r['completed_outputs']} |")
    lines += ["", f"Once: GPT-2's llguidance tokenizer {cold['tokenizer_ms']:.0f} ms; a spec's first validation and "
              "compilation, then a new Constraint from it: "
              + ", ".join(f"{k} {v['validate_and_compile_ms']:.1f} ms / {v['new_constraint_ms'] * 1e3:.0f} us"
                          for k, v in cold.items() if k != "tokenizer_ms") + "."]
    text = "\n".join(lines) + "\n"
    if args.out is not None:
        out = {"machine": system_info(), "command": " ".join(["python", *sys.argv]), "model": args.model,
               "precision": args.precision.value, "steps": args.steps, "warmup": args.warmup,
               "specs": {k: {"kind": s.kind.value, "value": s.value} for k, s in SPECS.items()}, "cold": cold, "results": results}
        save_results(args.out, out, text)
    print(text)


if __name__ == "__main__":
    main()
