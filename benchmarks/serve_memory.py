"""Resident memory of `gpt2x serve` while long prompts join its running batch, against the same requests sent at once
(one batch, no joins), for each --kv-cache: the server's peak resident memory (/health's max_rss_mb), each workload
in a fresh server process.

    python benchmarks/serve_memory.py --onnx EXPORT [--onnx EXPORT2 ...] --out benchmarks/results/serve-memory-cpu-2core
        [--kv-cache auto,slots] [--backends default] [--requests 24] [--rate 1.5] [--threads 2]

The requests are engine_joins.py's: a 512-token prefix (one of 4) and 32 random tokens each (sent as token ids), 64
greedy tokens out (ignore_eos), the prefix cache off. "joins": arriving at --rate a second (Poisson, seeded), at most
16 at once, so that most join a running batch; "at once": all sent together. Each server has the command's defaults
but --kv-cache, --backend (each of --backends; "default": none given, the command's own), --threads and
--prefix-cache-mb 0. Target (issue 58): with joins, within 10% of the server without.
Writes OUT.json and OUT.md.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import subprocess
import sys
from pathlib import Path

import httpx
import numpy as np

from gpt2x.bench.system import system_info

VOCAB = 50257
CONCURRENCY = 16
DEFAULT = "default"  # --backends: no --backend given


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def prompts(n: int, seed: int) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    prefixes = [rng.integers(0, VOCAB, 512).tolist() for _ in range(4)]
    return [prefixes[i % 4] + rng.integers(0, VOCAB, 32).tolist() for i in range(n)]


async def send(url: str, ids: list[list[int]], delays: list[float]) -> None:
    """Each prompt sent `delays` seconds after the start, at most CONCURRENCY in flight; every answer whole."""
    gate = asyncio.Semaphore(CONCURRENCY)
    async with httpx.AsyncClient(timeout=900) as client:
        async def one(prompt: list[int], delay: float) -> None:
            await asyncio.sleep(delay)
            async with gate:
                r = await client.post(f"{url}/v1/completions", json={"prompt": prompt, "max_tokens": 64,
                                                                     "temperature": 0, "ignore_eos": True})
                r.raise_for_status()
                assert r.json()["usage"]["completion_tokens"] == 64

        await asyncio.gather(*(one(p, d) for p, d in zip(ids, delays)))


def served(export: str, kv_cache: str, backend: str, threads: int, ids: list[list[int]], delays: list[float]) -> dict:
    """A fresh server: its resident memory once ready, the workload, then its /health (peak and current memory)."""
    cmd = [sys.executable, "-m", "gpt2x", "serve", "--onnx", export, "--port", "0", "--json", "--threads", str(threads),
           "--kv-cache", kv_cache, "--prefix-cache-mb", "0"] + ([] if backend == DEFAULT else ["--backend", backend])
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        line = proc.stdout.readline()
        if not line:
            raise SystemExit(f"{' '.join(cmd)} did not start: {proc.communicate(timeout=60)[1][-2000:]}")
        url = json.loads(line)["url"]
        ready = httpx.get(f"{url}/health", timeout=30).json()
        asyncio.run(send(url, ids, delays))
        health = httpx.get(f"{url}/health", timeout=30).json()
    finally:
        proc.terminate()
        proc.wait(60)
    return {"ready_rss_mb": ready["rss_mb"], "peak_rss_mb": health["max_rss_mb"], "rss_mb": health["rss_mb"],
            "joins": health.get("joins"), "backend": health.get("backend"), "kv_cache": health.get("kv_cache"),
            "kv_cache_dtype": health.get("kv_cache_dtype")}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--onnx", action="append", required=True, help="an export folder (repeat for several)")
    ap.add_argument("--out", required=True)
    ap.add_argument("--kv-cache", default="auto,slots", help="comma-separated --kv-cache choices")
    ap.add_argument("--backends", default=DEFAULT, help="comma-separated --backend choices (default: none given)")
    ap.add_argument("--requests", type=int, default=24)
    ap.add_argument("--rate", type=float, default=1.5, help="requests a second, joins workload (Poisson)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    ids = prompts(args.requests, args.seed)
    arrivals = np.cumsum(np.random.default_rng(args.seed + 1).exponential(1 / args.rate, args.requests)).tolist()
    workloads = {"at once": [0.0] * args.requests, "joins": arrivals}
    rows = []
    for export in args.onnx:
        meta = json.loads((Path(export) / "gpt2x.json").read_text())
        for backend in args.backends.split(","):
            for kv_cache in args.kv_cache.split(","):
                row = {"model": meta["model"]["name"], "precision": meta["precision"], "export": export,
                       "openvino_prefill": bool((meta.get("openvino_prefill") or {}).get("kept")),
                       "backend_asked": backend, "kv_cache_asked": kv_cache}
                for name, delays in workloads.items():
                    row[name] = served(export, kv_cache, backend, args.threads, ids, delays)
                    log(json.dumps({**row, "workload": name}))
                row["joins_over_at_once"] = row["joins"]["peak_rss_mb"] / row["at once"]["peak_rss_mb"]
                rows.append(row)
    system = system_info()
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    out = {"system": system, "commit": commit, "command": " ".join(sys.argv), "requests": args.requests,
           "rate": args.rate, "rows": rows}
    Path(f"{args.out}.json").write_text(json.dumps(out, indent=1, default=str) + "\n")
    lines = ["# The server's peak resident memory while prompts join, against the same requests at once", "",
             f"{system.get('cpu')}, {system.get('cores')} cores; commit {commit}; `{out['command']}`. {args.requests} "
             f"requests of 544 tokens, 64 out; joins: {args.rate:g} a second (Poisson), at most {CONCURRENCY} at once.",
             "", "| model | precision | OpenVINO prefill graph | --backend | --kv-cache | served by | cache | at once: ready / "
             "peak (MiB) | joins: ready / peak (MiB) | joins made | joins / at once |",
             "| --- | --- | --- | --- | --- | --- | --- | ---: | ---: | ---: | ---: |"]
    for r in rows:
        a, j = r["at once"], r["joins"]
        lines.append(f"| {r['model']} | {r['precision']} | {'yes' if r['openvino_prefill'] else 'no'} | {r['backend_asked']} "
                     f"| {r['kv_cache_asked']} | {j['backend']} | {j['kv_cache']} ({j['kv_cache_dtype']}) "
                     f"| {a['ready_rss_mb']:.0f} / {a['peak_rss_mb']:.0f} | {j['ready_rss_mb']:.0f} / {j['peak_rss_mb']:.0f} "
                     f"| {j['joins']} | {r['joins_over_at_once']:.2f} |")
    Path(f"{args.out}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
