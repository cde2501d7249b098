"""A restarted server's first token on a prompt whose 512-token prefix it saw before the restart, with the prefix
cache on disk (`gpt2x serve --prefix-cache-dir`), against a cold one (the same restart with an empty folder).

    python benchmarks/prefix_disk.py --onnx EXPORT [--onnx EXPORT2 ...] --out benchmarks/results/prefix-disk-cpu-2core
        [--prefix-len 512] [--rounds 3] [--threads 2]

Each round and export: a fresh folder; a server started on it answers one short warm-up request, streamed as the
timed one is (its sessions' and its stream's first run are not the cache's doing) and then prefix + suffix A (the cold first token: nothing on disk), and is
stopped (its blocks written as it stops); a second server started on the same folder answers the warm-up and then
prefix + suffix B (the restarted first token: the prefix's blocks read back from the disk). Both are first requests
of a fresh `gpt2x serve` process, streamed, greedy, timed by this client from the request to the first chunk with
text, on the connection the warm-up opened. The prefix is --prefix-len random token ids (seeded), the suffixes 8 more; their text is sent as token ids.

Target (issue 61): the restarted first token >= 5x sooner than the cold one. Writes OUT.json and OUT.md.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import numpy as np

VOCAB = 50257


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def first_token_ms(client: httpx.Client, url: str, ids: list[int]) -> float:
    """From the request to the first streamed chunk with text, greedy, on `client`'s open connection."""
    body = {"prompt": ids, "max_tokens": 4, "temperature": 0, "stream": True, "ignore_eos": True}
    began = time.perf_counter()
    with client.stream("POST", f"{url}/v1/completions", json=body) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if line.startswith("data: {") and json.loads(line[6:])["choices"][0]["text"]:
                return (time.perf_counter() - began) * 1e3
    raise RuntimeError("no text came back")


def served(export: str, folder: Path, threads: int, ids: list[int]) -> tuple[float, dict]:
    """A fresh server on `folder`: the warm-up, then `ids`' first token; its /health after; then stopped."""
    port = free_port()
    cmd = [sys.executable, "-m", "gpt2x", "serve", "--onnx", export, "--port", str(port), "--json", "--threads",
           str(threads), "--prefix-cache-dir", str(folder)]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        ready = json.loads(proc.stdout.readline())
        url = ready["url"]
        # One client and its connection for both requests, as a serving benchmark's client keeps them (vLLM's `bench
        # serve`): `httpx.stream` alone makes a client per call, whose set-up (an SSL context, even for http) took
        # 35-60 ms of each timed request before it reached the server.
        with httpx.Client(timeout=300) as client:
            first_token_ms(client, url, [464, 465])  # the warm-up, streamed as the request timed: its path's first use is not timed
            ms = first_token_ms(client, url, ids)
            health = client.get(f"{url}/health").json()
    finally:
        proc.terminate()
        proc.wait(60)
    return ms, health


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--onnx", action="append", required=True, help="an export folder (repeat for several)")
    ap.add_argument("--out", required=True)
    ap.add_argument("--prefix-len", type=int, default=512)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    rng = np.random.default_rng(0)
    prefix = rng.integers(0, VOCAB, args.prefix_len).tolist()
    suffixes = [rng.integers(0, VOCAB, 8).tolist() for _ in range(2)]
    runs = []
    for export in args.onnx:
        meta = json.loads((Path(export) / "gpt2x.json").read_text())
        for r in range(args.rounds):
            with tempfile.TemporaryDirectory(prefix="gpt2x-prefix-disk-") as tmp:
                cold, _ = served(export, Path(tmp), args.threads, prefix + suffixes[0])
                warm, health = served(export, Path(tmp), args.threads, prefix + suffixes[1])
            run = {"export": export, "model": meta["model"]["name"], "precision": meta["precision"], "round": r,
                   "cold_ms": cold, "restarted_ms": warm, "disk_reads": health.get("prefix_cache_disk_reads"),
                   "disk_errors": health.get("prefix_cache_disk_errors"), "load": os.getloadavg()[0]}
            log(json.dumps(run))
            runs.append(run)
    rows = []
    for export in args.onnx:
        mine = [r for r in runs if r["export"] == export]
        cold = statistics.median(r["cold_ms"] for r in mine)
        warm = statistics.median(r["restarted_ms"] for r in mine)
        rows.append({"model": mine[0]["model"], "precision": mine[0]["precision"], "cold_ms": cold,
                     "restarted_ms": warm, "speedup": cold / warm, "disk_reads": mine[-1]["disk_reads"]})
    machine = {"cpu": platform.processor() or platform.machine(), "cores": os.cpu_count(), "platform": platform.platform()}
    try:
        machine["cpu"] = next(line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                              if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    out = {"machine": machine, "commit": commit, "command": " ".join(sys.argv), "prefix_len": args.prefix_len,
           "rows": rows, "runs": runs}
    Path(f"{args.out}.json").write_text(json.dumps(out, indent=1) + "\n")
    lines = [f"# A restarted server's first token on a {args.prefix_len}-token prefix it saw before, from the disk",
             "", f"{machine['cpu']}, {machine['cores']} cores; commit {commit}; `{out['command']}`; median of "
             f"{args.rounds} rounds, each a fresh `gpt2x serve` process's first request after a warm-up.", "",
             "| model | precision | cold first token (ms) | restarted, prefix on disk (ms) | sooner | blocks read |",
             "| --- | --- | ---: | ---: | ---: | ---: |"]
    lines += [f"| {r['model']} | {r['precision']} | {r['cold_ms']:.0f} | {r['restarted_ms']:.0f} | {r['speedup']:.1f}x | "
              f"{r['disk_reads']} |" for r in rows]
    Path(f"{args.out}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
