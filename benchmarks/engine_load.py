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

serve_load.py measures the same engine behind Ray Serve's proxy and FastAPI, streamed over HTTP to a
client on the same 2 cores; the difference between the two is what the serving stack costs here.
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
import time
from pathlib import Path

from gpt2x.bench.loadtest import DEFAULT_PROMPTS
from gpt2x.bench.system import system_info
from gpt2x.choices import BackendKind, Precision
from gpt2x.generation.settings import SamplingSettings
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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="random:gpt2")
    ap.add_argument("--concurrency", default="1,4,16,32")
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--exports", type=Path, default=Path("exported"))
    ap.add_argument("--out", type=Path, required=True, help="output path without extension (.json, .md)")
    args = ap.parse_args()
    from gpt2x.onnx.artifact import default_export_dir

    configs = {}
    for precision, in_place in ((Precision.fp32, None), (Precision.int8, True), (Precision.int8, False)):
        info = ensure_export(args.model, precision, folder=default_export_dir(args.model, precision, args.exports),
                             progress=log, notice=log)
        name = f"{precision.value} " + ("growing" if in_place is False else "in place" if in_place else "growing (fp32's only cache)")
        backend = export_backend(BackendKind.ort, info, in_place_kv=in_place)
        configs[name] = Engine(backend, EngineSettings(max_batch_size=32, max_waiting=64, continuous=True)).start()
    levels = [int(c) for c in args.concurrency.split(",")]
    results = []
    for n, c in enumerate(levels):
        names = list(configs)
        for name in names[n % len(names):] + names[: n % len(names)]:
            log(f"{name}: concurrency {c}")
            r = drive(configs[name], c, max(16, 2 * c), args.max_tokens)
            results.append({"config": name, **r})
            time.sleep(0.3)
    for engine in configs.values():
        engine.close()
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
    out = {"machine": system_info(), "command": " ".join(["python", *sys.argv]), "results": results}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".json").write_text(json.dumps(out, indent=1) + "\n")
    text = "\n".join(lines) + "\n"
    args.out.with_suffix(".md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
