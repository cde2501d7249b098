"""The serving engine alone under concurrent load, without Ray Serve, HTTP or a client process: where
`benchmarks/serve_load.py`'s throughput goes.

    python benchmarks/engine_load.py --out benchmarks/results/engine-load-cpu-2core-gpt2-124m

For each precision (GPT-2 124M, random weights) and KV cache (int8: in place, gpt2x serve's default,
and growing), one gpt2x.serve.engine.Engine with continuous batching (max batch 32, as serve_load's
"continuous" mode) is driven in-process by `concurrency` threads in a closed loop: each submits a
request (serve_load's prompts, 32 tokens, sampled at temperature 1 with its own seed, as
`gpt2x loadtest` sends them), waits for it to finish and submits the next, until max(16, 2 x
concurrency) requests are done. Output tokens/s = tokens produced / wall time; with the engine's
counters (decode steps, joins, compactions) and the mean time of a step. The levels run
interleaved: each configuration once per level, in an order rotated every level.

Inside the engine, every backend call is timed (the benchmark wraps `step` and `merge`): the median
decode step by batch size, the prefills and the merges, so a step's share of the engine's time shows.
Last, the in-place cache's batch prefill with and without spare positions in its buffers (16 rows
of 15 tokens, 7 interleaved pairs): GroupQueryAttention's multi-token step over a shared buffer
grows with its capacity, which is why a batch's prefill now gets none (gpt2x.runtime.ort).

serve_load.py measures the same engine behind Ray Serve's proxy and FastAPI, streamed over HTTP to a
client on the same 2 cores; the difference between the two is what the serving stack costs here.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import threading
import time
from collections import defaultdict
from pathlib import Path

import numpy as np

from gpt2x.bench.loadtest import DEFAULT_PROMPTS
from gpt2x.bench.report import save_results
from gpt2x.bench.system import system_info
from gpt2x.choices import BackendKind, Precision
from gpt2x.generation.settings import SamplingSettings
from gpt2x.numerics import positions
from gpt2x.runtime import ort as ort_runtime
from gpt2x.serve.engine import Engine, EngineSettings, Row
from gpt2x.tokenizer import encode
from gpt2x.workflows import ensure_export, export_backend


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def drive(engine: Engine, concurrency: int, requests: int, max_tokens: int) -> dict:
    prompts = [encode(p) for p in DEFAULT_PROMPTS]
    lock = threading.Lock()
    state = {"next": 0, "tokens": 0, "failed": 0}

    def client() -> None:
        while True:
            with lock:
                i = state["next"]
                if i >= requests:
                    return
                state["next"] += 1
            done = threading.Event()
            count = [0]

            def sink(kind: str, value: object, done=done, count=count) -> None:
                if kind == "token":
                    count[0] += 1
                elif kind in ("done", "error"):
                    if kind == "error":
                        state["failed"] += 1
                    done.set()

            settings = SamplingSettings(max_new_tokens=max_tokens, temperature=1.0, seed=i)
            engine.submit([Row(prompts[i % len(prompts)], settings, sink)])
            done.wait()
            with lock:
                state["tokens"] += count[0]

    before = dict(engine.counters)
    threads = [threading.Thread(target=client) for _ in range(concurrency)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    counters = {k: engine.counters[k] - before[k] for k in before}
    return {"concurrency": concurrency, "requests": requests, "failed": state["failed"], "tokens": state["tokens"],
            "wall_s": wall, "output_tokens_per_s": state["tokens"] / wall, "counters": counters}


def timed_calls(backend) -> dict[str, list[float]]:
    """Wrap the backend's step and its caches' merge so each call's milliseconds are recorded by kind."""
    calls: dict[str, list[float]] = defaultdict(list)
    step = backend.step

    def timed_step(ids, mask, pos, past):
        t = time.perf_counter()
        out = step(ids, mask, pos, past)
        kind = f"prefill {ids.shape[0]} rows" if ids.shape[1] > 1 else f"decode step, batch {ids.shape[0]}"
        calls[kind].append((time.perf_counter() - t) * 1e3)
        return out

    backend.step = timed_step
    MERGE_CALLS[id(backend)] = calls
    for form in backend.cache_forms:  # merges are the cache's: timed per form, recorded per owner
        if not getattr(form.merge, "timed", False):
            form.merge = timed_merge(form.merge)
    return calls


MERGE_CALLS: dict[int, dict[str, list[float]]] = {}  # id(backend) -> its calls


def timed_merge(merge):
    def timed(cache, *args):
        t = time.perf_counter()
        out = merge(cache, *args)
        MERGE_CALLS[id(cache.owner)]["merge"].append((time.perf_counter() - t) * 1e3)
        return out
    timed.timed = True
    return timed


def spare_room_prefill(info, rows: int = 16, tokens: int = 15, rounds: int = 7, decode: int = 0) -> dict:
    """The in-place cache's prefill of `rows` x `tokens` (then `decode` greedy steps, whose first moves
    a cache without room into larger buffers) with 256 spare positions and with none."""
    backend = export_backend(BackendKind.ort, info, in_place_kv=True)
    ids = np.random.default_rng(0).integers(0, info.config.vocab_size, (rows, tokens), dtype=np.int64)
    mask = np.ones_like(ids)
    real = ort_runtime.buffers_for_step
    times: dict[str, list[float]] = {"256 spare positions": [], "none": []}
    try:
        for r in range(rounds):
            for name, room in ((("none", 0), ("256 spare positions", 256)) if r % 2 else (("256 spare positions", 256), ("none", 0))):
                ort_runtime.buffers_for_step = lambda *a, room=room, **k: real(*a, **{**k, "first_room": room})
                t = time.perf_counter()
                logits, past = backend.step(ids, mask, positions(mask, tokens), None)
                m = mask
                for _ in range(decode):
                    m = np.concatenate([m, np.ones((rows, 1), dtype=np.int64)], axis=1)
                    logits, past = backend.step(logits.argmax(-1)[:, None], m, positions(m, 1), past)
                times[name].append((time.perf_counter() - t) * 1e3)
    finally:
        ort_runtime.buffers_for_step = real
    return {"rows": rows, "tokens": tokens, "decode_steps": decode, "median_ms": {k: statistics.median(v) for k, v in times.items()},
            "runs_ms": times}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="random:gpt2")
    ap.add_argument("--concurrency", default="1,4,16,32")
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--exports", type=Path, default=Path("exported"))
    ap.add_argument("--out", type=Path, required=True, help="output path without extension (.json, .md)")
    args = ap.parse_args()
    from gpt2x.onnx.artifact import default_export_dir

    configs, calls, infos = {}, {}, {}
    for precision, in_place in ((Precision.fp32, None), (Precision.int8, True), (Precision.int8, False)):
        info = ensure_export(args.model, precision, folder=default_export_dir(args.model, precision, args.exports),
                             progress=log, notice=log)
        name = f"{precision.value} " + ("growing" if in_place is False else "in place" if in_place else "growing (fp32's only cache)")
        infos[precision] = info
        backend = export_backend(BackendKind.ort, info, in_place_kv=in_place)
        calls[name] = timed_calls(backend)
        configs[name] = Engine(backend, EngineSettings(max_batch_size=32, max_waiting=64, continuous=True)).start()
    levels = [int(c) for c in args.concurrency.split(",")]
    results = []
    for n, c in enumerate(levels):
        names = list(configs)
        for name in names[n % len(names):] + names[: n % len(names)]:
            log(f"{name}: concurrency {c}")
            for v in calls[name].values():
                v.clear()
            r = drive(configs[name], c, max(16, 2 * c), args.max_tokens)
            r["backend_calls_ms"] = {k: {"count": len(v), "median": statistics.median(v), "total": sum(v)}
                                     for k, v in sorted(calls[name].items()) if v}
            results.append({"config": name, **r})
            time.sleep(0.3)
    for engine in configs.values():
        engine.close()
    log("int8 in place: a batch prefill with and without spare positions")
    rooms = [spare_room_prefill(infos[Precision.int8]), spare_room_prefill(infos[Precision.int8], 1, 512, decode=24)]
    base = {r["config"]: r["output_tokens_per_s"] for r in results if r["concurrency"] == levels[0]}
    lines = [f"Engine alone (no Ray, no HTTP), {args.model}, {args.max_tokens} tokens per request, continuous batching, "
             "max batch 32; closed loop in-process.", "",
             f"| cache | concurrency | requests | failed | output tok/s | vs concurrency {levels[0]} | decode steps | mean step ms | joins | compactions |",
             "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for r in results:
        steps = r["counters"]["steps"]
        lines.append(f"| {r['config']} | {r['concurrency']} | {r['requests']} | {r['failed']} | {r['output_tokens_per_s']:.1f} | "
                     f"{r['output_tokens_per_s'] / base[r['config']]:.2f}x | {steps} | {r['wall_s'] / max(steps, 1) * 1e3:.1f} | "
                     f"{r['counters']['joins']} | {r['counters']['compactions']} |")
    lines += ["", "Backend calls inside the engine at each level (median ms, count):", ""]
    for r in results:
        parts = ", ".join(f"{k} {v['median']:.1f} ms x{v['count']}" for k, v in r["backend_calls_ms"].items())
        lines.append(f"- {r['config']}, concurrency {r['concurrency']}: {parts}")
    lines.append("")
    for room in rooms:
        lines.append(f"- int8 in place, a prefill of {room['rows']} rows x {room['tokens']} tokens"
                     + (f" and {room['decode_steps']} decode steps" if room["decode_steps"] else "")
                     + " (median of 7): " + ", ".join(f"{k} {v:.1f} ms" for k, v in room["median_ms"].items()))
    out = {"machine": system_info(), "command": " ".join(["python", *sys.argv]), "results": results,
           "spare_room_prefill": rooms}
    text = "\n".join(lines) + "\n"
    save_results(args.out, out, text)
    print(text)


if __name__ == "__main__":
    main()
