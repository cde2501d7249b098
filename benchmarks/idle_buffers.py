"""The in-place KV cache's idle-buffer reuse (kvbuffers.IdleBuffers) on and off, in one process: the time to the
first token of a fresh prompt on an export's `ort` backend (OpenVINO prefill where the export chose it), in
interleaved runs, each after a generation that left its buffers idle. Off keeps no idle memory (keep_bytes 0), so
every prompt's buffers are fresh pages, as before the reuse.

    python benchmarks/idle_buffers.py --export EXPORT --out benchmarks/results/idle-buffers-cpu-2core
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import numpy as np

from gpt2x.bench.system import system_info
from gpt2x.generation.generate import generate
from gpt2x.generation.settings import SamplingSettings
from gpt2x.numerics import positions
from gpt2x.onnx.artifact import read_export
from gpt2x.runtime.kvbuffers import IdleBuffers
from gpt2x.runtime.ort import OrtBackend


def first_token_ms(backend: OrtBackend, ids: np.ndarray) -> float:
    mask = np.ones_like(ids)
    t0 = time.perf_counter()
    backend.step(ids, mask, positions(mask, ids.shape[1]), None)
    return (time.perf_counter() - t0) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--export", type=Path, required=True)
    ap.add_argument("--prompt-len", type=int, nargs="+", default=[32, 512])
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", type=Path, required=True)
    a = ap.parse_args()
    info = read_export(a.export)
    backends = {"reuse": OrtBackend(info, threads=a.threads), "fresh": OrtBackend(info, threads=a.threads)}
    backends["fresh"].idle = IdleBuffers(keep_bytes=0)
    rng = np.random.default_rng(0)
    results: dict = {}
    for n in a.prompt_len:
        times: dict[str, list[float]] = {k: [] for k in backends}
        for r in range(a.rounds):
            for name in (list(backends) if r % 2 == 0 else list(reversed(backends))):
                b = backends[name]
                generate(b, ["ROMEO: what light"], SamplingSettings(max_new_tokens=4, greedy=True))  # leaves buffers idle
                ids = rng.integers(0, info.config.vocab_size, (1, n), dtype=np.int64)
                times[name].append(first_token_ms(b, ids))
        results[str(n)] = {k: {"median_ms": statistics.median(v), "runs_ms": v} for k, v in times.items()}
    doc = {"command": "python benchmarks/idle_buffers.py " + " ".join(
               f"--{k.replace('_', '-')} {' '.join(map(str, v)) if isinstance(v, list) else v}" for k, v in vars(a).items()),
           "export": str(a.export), "prefill": backends["reuse"].prefill, "prefill_from": backends["reuse"].prefill_from,
           "machine": system_info(), "results": results}
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.with_suffix(".json").write_text(json.dumps(doc, indent=1) + "\n")
    lines = ["| prompt | reuse: median ms (min-max) | fresh: median ms (min-max) | reuse / fresh |", "| ---: | ---: | ---: | ---: |"]
    for n, r in results.items():
        re, fr = r["reuse"], r["fresh"]
        lines.append(f"| {n} | {re['median_ms']:.1f} ({min(re['runs_ms']):.1f}-{max(re['runs_ms']):.1f}) | "
                     f"{fr['median_ms']:.1f} ({min(fr['runs_ms']):.1f}-{max(fr['runs_ms']):.1f}) | {re['median_ms'] / fr['median_ms']:.2f} |")
    m = doc["machine"]
    head = f"{doc['command']}\n\n{m['cpu']}, {m['cores']} cores, {a.threads} threads; {m['date']}; gpt2x git {m['git']}; prefill: {doc['prefill']}\n\n"
    a.out.with_suffix(".md").write_text(head + "\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
