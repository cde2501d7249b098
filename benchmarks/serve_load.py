"""gpt2x serve under concurrent streaming load: batching off, static batches and continuous batching.

    python benchmarks/serve_load.py --out benchmarks/results/serve-cpu-2core-gpt2-124m
        [--model random:gpt2] [--precisions fp32,int8] [--concurrency 1,4,16,32] [--max-tokens 32]

One local Ray instance serves, on 127.0.0.1, one application per (precision, batching mode), each
one replica of `gpt2x serve`'s deployment (gpt2x.serve.deploy.start, as the CLI runs it) on the
export `gpt2x serve --model MODEL --precision P` would use:

- off: max batch 1, every request alone;
- static: max batch 32, requests that arrive together decode together; later arrivals wait for the
  whole batch to finish;
- continuous: max batch 32, a finished row leaves and a waiting request joins between decode steps
  (int8 on ONNX Runtime's growing KV cache, gpt2x serve's default when this ran; since 2026-11-25
  serving keeps int8's cache in place, measured by serve_peers.py; the growing cache's merges copy the whole
  cache through the host);
- continuous-in-place (int8 only): the same on the in-place KV cache (`in_place_kv=True`), rows
  moving inside its buffers, for comparison.

`gpt2x loadtest`'s code (gpt2x.bench.loadtest.run_loadtest) drives each application, closed loop,
streaming, at each concurrency level with max(16, 2 x concurrency) requests, and records TTFT, ITL,
end-to-end latency percentiles and output tokens/s. The applications are measured interleaved: per
concurrency level each application runs once, in an order rotated every level, so the VM's drift in
memory bandwidth falls on all of them alike. The load generator runs on the same 2 cores as the
server: the figures are for client and server together on one machine.
Writes OUT.json (every figure and the environment), OUT.md (the table) and OUT.png (the plot).
"""

from __future__ import annotations

import argparse
import socket
import sys
import time
from pathlib import Path

import ray
from ray import serve

from gpt2x.bench.loadtest import LoadtestSettings, run_loadtest
from gpt2x.bench.report import require_matplotlib, save_png, save_results
from gpt2x.bench.system import system_info
from gpt2x.choices import Precision
from gpt2x.onnx.names import in_place_kv
from gpt2x.serve.deploy import ReplicaConfig, ServeSettings, start
from gpt2x.serve.engine import EngineSettings
from gpt2x.workflows import resolve_export

# The settings of the committed run (2026-11-23): a 2 ms batch wait and the growing cache when batching,
# gpt2x serve's defaults then (now: no wait, the in-place cache; benchmarks/serve_peers.py).
_THEN = {"max_waiting": 64, "batch_wait_s": 0.002}
MODES = {  # engine, and ONNX Runtime's in-place KV cache (None: wherever the graph allows it; False: growing)
    "off": (EngineSettings(max_batch_size=1, continuous=False, **_THEN), None),
    "static": (EngineSettings(max_batch_size=32, continuous=False, **_THEN), False),
    "continuous": (EngineSettings(max_batch_size=32, continuous=True, **_THEN), False),
    # int8 and int4 graphs only: continuous batching on the in-place cache, rows moving inside its buffers
    "continuous-in-place": (EngineSettings(max_batch_size=32, continuous=True, **_THEN), True),
}


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def table(results: list[dict]) -> str:
    rows = ["| precision | batching | concurrency | requests | failed | output tok/s | vs concurrency 1 | TTFT p50 ms | TTFT p99 ms | ITL p50 ms | e2e p50 s |",
            "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in results:
        base = next(x["level"]["output_token_throughput"] for x in results
                    if x["precision"] == r["precision"] and x["mode"] == r["mode"] and x["level"]["concurrency"] == 1)
        lv = r["level"]
        rows.append(
            f"| {r['precision']} | {r['mode']} | {lv['concurrency']} | {lv['requests']} | {lv['failed']} | "
            f"{lv['output_token_throughput']:.1f} | {lv['output_token_throughput'] / base:.2f}x | "
            f"{lv['ttft']['p50_ms']:.0f} | {lv['ttft']['p99_ms']:.0f} | {lv['itl']['p50_ms']:.1f} | {lv['e2e']['p50_ms'] / 1e3:.2f} |"
        )
    return "\n".join(rows)


def plot(results: list[dict], path: Path, title: str) -> None:
    plt = require_matplotlib()
    fig, (a, b) = plt.subplots(1, 2, figsize=(12, 4.5))
    for precision in sorted({r["precision"] for r in results}):
        for mode, style in zip(MODES, ("o:", "s--", "^-", "v-.")):
            pts = sorted((r["level"]["concurrency"], r["level"]) for r in results if r["precision"] == precision and r["mode"] == mode)
            if not pts:
                continue
            xs = [c for c, _ in pts]
            a.plot(xs, [lv["output_token_throughput"] for _, lv in pts], style, label=f"{precision} {mode}")
            b.plot(xs, [lv["ttft"]["p99_ms"] for _, lv in pts], style, label=f"{precision} {mode}")
    for ax, ylabel in ((a, "output tokens/s"), (b, "TTFT p99 (ms)")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("concurrent requests")
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
    b.set_yscale("log")
    a.legend(fontsize=8)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    save_png(fig, path)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, required=True, help="Path prefix of OUT.json / OUT.md / OUT.png")
    p.add_argument("--model", default="random:gpt2")
    p.add_argument("--precisions", default="fp32,int8")
    p.add_argument("--modes", default=",".join(MODES))
    p.add_argument("--concurrency", default="1,4,16,32")
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--threads", type=int, default=None, help="ONNX Runtime threads per replica (default: the cores)")
    args = p.parse_args()
    require_matplotlib()
    precisions = [Precision(x) for x in args.precisions.split(",")]
    modes = args.modes.split(",")
    levels = [int(x) for x in args.concurrency.split(",")]

    port = free_port()
    ray.init(address="local", include_dashboard=False, log_to_driver=False, namespace="gpt2x-bench")
    apps = []
    try:
        for precision in precisions:
            info = resolve_export(args.model, precision=precision, progress=log, notice=log)
            for mode in modes:
                engine, in_place = MODES[mode]
                if in_place and not in_place_kv(info.attention):
                    continue  # fp32's MultiHeadAttention graph has no in-place cache: the mode is "continuous"
                name = f"{precision.value}-{mode}"
                config = ReplicaConfig(export=str(info.folder.resolve()), model_id=args.model, threads=args.threads,
                                       engine=engine, in_place_kv=in_place)
                log(f"starting {name}")
                start(config, ServeSettings(port=port, cpus_per_replica=0, route_prefix=f"/{name}", app_name=name))
                apps.append((precision.value, mode, f"http://127.0.0.1:{port}/{name}"))
        results = []
        began = time.time()
        for i, concurrency in enumerate(levels):
            order = apps[i % len(apps):] + apps[: i % len(apps)]
            for precision, mode, url in order:
                requests = max(16, 2 * concurrency)
                log(f"{precision} {mode}: concurrency {concurrency}, {requests} requests")
                settings = LoadtestSettings(url=url, model=args.model, requests=requests, concurrency=[concurrency],
                                            max_tokens=args.max_tokens, timeout=600)
                # A few requests first, unmeasured: the replica's first runs allocate.
                run_loadtest(LoadtestSettings(url=url, model=args.model, requests=2, concurrency=[2], max_tokens=4), {})
                level = run_loadtest(settings, {})["levels"][0]
                results.append({"precision": precision, "mode": mode, "level": level})
                log(f"  {level['output_token_throughput']:.1f} output tok/s, TTFT p99 {level['ttft']['p99_ms']:.0f} ms, "
                    f"failed {level['failed']}")
    finally:
        serve.shutdown()
        ray.shutdown()

    results.sort(key=lambda r: (r["precision"], list(MODES).index(r["mode"]), r["level"]["concurrency"]))
    env = system_info()
    record = {
        "command": "python " + " ".join(sys.argv),
        "model": args.model, "max_tokens": args.max_tokens, "replicas": 1, "threads": args.threads,
        "modes": {m: {**MODES[m][0].__dict__, "in_place_kv": MODES[m][1]} for m in modes}, "wall_s": time.time() - began,
        "environment": env, "results": results,
    }
    machine = f"{env['cpu']}, {env['cores']} cores"
    header = (f"# gpt2x serve under load: {args.model}, {args.max_tokens} tokens per request, one replica\n\n"
              f"Machine: {machine}. Command: `{record['command']}`\n\n")
    save_results(args.out, record, header + table(results) + "\n")
    plot(results, args.out.with_suffix(".png"), f"gpt2x serve, {args.model}, {machine}")
    print(table(results))


if __name__ == "__main__":
    main()
