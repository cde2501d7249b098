"""Where a long prompt's join stalls the rows running: one prompt joins a batch of rows decoding, in the serving engine
(no HTTP), with each backend call it makes timed, and the rows' inter-token gaps over 30 ms listed beside them.

    python benchmarks/join_timeline.py --export EXPORTS/random-gpt2-int8 --chunk 64 \
        --out benchmarks/results/join-timeline-epyc-cpu-2core.txt

The calls timed: the ONNX Runtime backend's decode and multi-token steps (`OrtBackend.step`, its in-place cache's
`forward`), OpenVINO's prefill graph (`OpenVinoPrefill.__call__`) and the in-place cache's `merge` (the joiner's cache
into the batch's buffers). Times in ms from just before the join.
"""

from __future__ import annotations

import argparse
import functools
import time
from pathlib import Path

import numpy as np

from gpt2x.bench.system import system_info
from gpt2x.generation.settings import SamplingSettings
from gpt2x.onnx.artifact import read_export
from gpt2x.runtime import openvino_prefill
from gpt2x.runtime.ort import InPlaceCache, OrtBackend
from gpt2x.serve.core.engine import Engine, EngineSettings, Row
from gpt2x.serve.core.outputs import TokenOut

CALLS = [(OrtBackend, "step", "decode or chunk step (ONNX Runtime)"), (InPlaceCache, "merge", "merge into the batch"),
         (openvino_prefill.OpenVinoPrefill, "__call__", "prefill on OpenVINO")]


def timed(events: list, owner, name: str, label: str) -> None:
    fn = getattr(owner, name)

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        start = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            events.append((start, time.perf_counter(), label))

    setattr(owner, name, wrapper)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--export", type=Path, required=True)
    ap.add_argument("--chunk", type=int, default=256, help="EngineSettings.prefill_chunk")
    ap.add_argument("--rows", type=int, default=8, help="rows decoding when the prompt joins")
    ap.add_argument("--prompt-tokens", type=int, default=545)
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    events: list = []
    for owner, name, label in CALLS:
        timed(events, owner, name, label)
    backend = OrtBackend(read_export(args.export))
    backend.warm_up()  # as gpt2x serve opens it
    engine = Engine(backend, EngineSettings(prefill_chunk=args.chunk, prefix_cache_mb=0)).start()
    rng = np.random.default_rng(0)
    stamps: dict[int, list[float]] = {}

    def row(i: int, prompt_tokens: int, out: int) -> Row:
        arrivals = stamps.setdefault(i, [])

        def sink(o) -> None:
            if isinstance(o, TokenOut):
                arrivals.append(time.perf_counter())

        prompt = rng.integers(0, backend.vocab_size, prompt_tokens).tolist()
        return Row(prompt, SamplingSettings(max_new_tokens=out, ignore_eos=True, seed=i), sink, max_tokens=out)

    try:
        engine.submit([row(i, 16, 150) for i in range(args.rows)])
        time.sleep(1.0)  # the batch decoding steadily
        joined = time.perf_counter()
        engine.submit([row(args.rows, args.prompt_tokens, 4)])
        time.sleep(2.5)
    finally:
        engine.close()
    t0 = joined
    gaps = sorted({(round((a - t0) * 1e3), round((b - a) * 1e3)) for i in range(args.rows)
                   for a, b in zip(stamps[i], stamps[i][1:]) if a > t0 - 0.05 and b - a > 0.03})
    lines = [f"# A {args.prompt_tokens}-token prompt joining {args.rows} rows decoding, prefill chunk {args.chunk} "
             f"({system_info().get('cpu')}, gpt2x git {system_info().get('git')})", "",
             f"joiner's first token {(stamps[args.rows][0] - t0) * 1e3:.0f} ms after it was submitted",
             "rows' gaps over 30 ms (start ms, length ms): " + ", ".join(f"({s}, {n})" for s, n in gaps), "",
             "| start ms | ms | call |", "| ---: | ---: | --- |"]
    lines += [f"| {(s - t0) * 1e3:.1f} | {(e - s) * 1e3:.1f} | {label} |" for s, e, label in sorted(events)
              if t0 - 0.05 < s < t0 + 1.2 and e - s > 0.004]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
