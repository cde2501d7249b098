"""What `gpt2x generate` decodes at on one provider, beside the bench's fixed-cache row, in one run:

    python benchmarks/cuda_generate.py --out RESULTS/cuda-generate [--provider cuda] [--model random:gpt2]
        [--precision fp16] [--prompt-len 32] [--new-tokens 128] [--repeat 5] [--batches 1,8] [--cli]

Rows (greedy unless said, the same random prompt ids, --repeat timed runs after one warm-up, the median reported):
- `generate (auto)`: generation.generate with fixed_cache=None, as `gpt2x generate` runs it (on CUDA: the fixed cache
  and its CUDA graph where the generation allows), timed by its on_token callback: decode tok/s is the tokens after
  each row's first over the time after the first;
- `generate (growing)`: the same with fixed_cache=False (`--kv-cache growing`: the decode loop on the growing cache);
- `bench fixed row`: bench.run.timed_fixed on a StaticDecoder of the prompt plus the new tokens (`gpt2x bench`'s row:
  blocks of 16 steps, as generate runs them);
- `fixed, a step a block`: the same on a decoder of blocks of one step (the host writing each step's position and
  reading its token, as before the host left the step's path);
- `generate (auto), sampled`: temperature 0.8 (seed 1): the draw on the device, against the greedy row's rate;
- with --cli, `gpt2x generate` itself in a subprocess, its streamed stdout timed as it arrives (the first chunk holds
  the prompt and the first token, the last the final flush): (new tokens - 1) over the time between them.

Every row's tokens are compared with `generate (growing)`'s. Writes OUT.json (figures, providers each path ran on,
the environment) and OUT.md after every row; GPT2X_GPU_PROVIDER=cpu in benchmarks/gpu_run.sh rehearses this on the CPU
provider with an fp32 export: its figures are CPU figures.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from functools import partial
from pathlib import Path

import numpy as np

from gpt2x.bench.run import timed_fixed
from gpt2x.bench.system import system_info
from gpt2x.choices import Precision, ProviderKind
from gpt2x.generation.generate import generate
from gpt2x.generation.settings import SamplingSettings
from gpt2x.onnx.artifact import default_export_dir
from gpt2x.runtime.ort import OrtBackend
from gpt2x.runtime.static_decode import StaticDecoder, fixed_cache_refusal
from gpt2x.tokenizer import decode, encode
from gpt2x.workflows.exports import ensure_export


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def timed_generate(backend, prompts: np.ndarray, settings: SamplingSettings, fixed_cache: bool | None) -> dict:
    """One generation, every token's arrival time from on_token: time to the first tokens, then the rest's rate."""
    arrivals: list[float] = []
    t0 = time.perf_counter()
    results = generate(backend, [""] * len(prompts), settings, prompt_ids=prompts.tolist(), fixed_cache=fixed_cache,
                       on_token=lambda row, tok: arrivals.append(time.perf_counter()))
    rows = len(prompts)
    first = arrivals[rows - 1] - t0  # every row's first token (one prefill)
    decode_s = arrivals[-1] - arrivals[rows - 1]
    decoded = len(arrivals) - rows
    return {"ttft_s": first, "decode_s": decode_s, "decoded": decoded, "tokens": [r.tokens for r in results],
            "decoder": results[0].decoder}


def timed_bench_row(decoder: StaticDecoder, prompts: np.ndarray, n: int) -> dict:
    run = timed_fixed(decoder, prompts, n)
    return {"ttft_s": run["ttft_s"], "decode_s": run["decode_s"], "decoded": run["decoded"] * len(prompts),
            "tokens": run["tokens"], "decoder": decoder.name}


def timed_cli(args: argparse.Namespace, folder: Path, prompt_text: str) -> dict:
    """`gpt2x generate` streaming to a pipe: the arrival of its stdout's chunks."""
    cmd = [sys.executable, "-m", "gpt2x", "generate", prompt_text, "--onnx", str(folder), "--provider", args.provider,
           "--max-new-tokens", str(args.new_tokens), "--greedy", "--ignore-eos"]
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    chunks: list[float] = []
    while True:
        data = os.read(proc.stdout.fileno(), 1 << 16)
        if not data:
            break
        chunks.append(time.perf_counter())
    err = proc.stderr.read().decode(errors="replace")
    if proc.wait() != 0:
        raise RuntimeError(f"gpt2x generate failed ({proc.returncode}): {err.strip()[-500:]}")
    return {"wall_s": time.perf_counter() - t0, "first_chunk_s": chunks[0] - t0, "chunks": len(chunks),
            "decode_s": chunks[-1] - chunks[0], "decoded": args.new_tokens - 1, "command": " ".join(cmd)}


def ratio(rate: float | None, base: float | None) -> str:
    return f"{rate / base:.2f}" if rate and base else "-"


def summary(runs: list[dict]) -> dict:
    rates = [r["decoded"] / r["decode_s"] for r in runs if r["decode_s"] > 0]
    out = {"decode_tok_s": statistics.median(rates) if rates else None, "decode_tok_s_runs": rates}
    if "ttft_s" in runs[0]:
        out["ttft_ms"] = statistics.median(r["ttft_s"] for r in runs) * 1e3
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, type=Path)
    p.add_argument("--provider", type=ProviderKind, default=ProviderKind.cuda)
    p.add_argument("--model", default="random:gpt2")
    p.add_argument("--precision", type=Precision, default=None, help="default: fp16 on CUDA, fp32 on the CPU")
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--repeat", type=int, default=5)
    p.add_argument("--batches", default="1,8")
    p.add_argument("--cli", action="store_true", help="also time `gpt2x generate` itself (batch 1)")
    a = p.parse_args()
    precision = a.precision or (Precision.fp16 if a.provider is ProviderKind.cuda else Precision.fp32)
    a.out.parent.mkdir(parents=True, exist_ok=True)
    info = ensure_export(a.model, precision, default_export_dir(a.model, precision), notice=log)
    backend = OrtBackend(info, a.provider)
    report: dict = {"model": a.model, "precision": precision.value, "provider": a.provider.value,
                    "prompt_len": a.prompt_len, "new_tokens": a.new_tokens, "repeat": a.repeat,
                    "session_providers": backend.session.get_providers(), "system": system_info(), "rows": []}

    def save() -> None:  # after every row: a lease cut off still leaves the figures so far
        a.out.with_suffix(".json").write_text(json.dumps(report, indent=1, default=str))
        sysinfo = report["system"]
        lines = [f"# What `gpt2x generate` decodes at: {a.model} {precision.value} on {a.provider.value}", "",
                 f"Machine: {sysinfo['cpu']}, {sysinfo['cores']} cores, GPU {sysinfo['gpu']}; {sysinfo['date']}, "
                 f"gpt2x git {sysinfo.get('git', '?')}; session providers {', '.join(report['session_providers'])}. "
                 f"Prompt {a.prompt_len} random tokens, {a.new_tokens} new (greedy unless sampled, EOS ignored), "
                 f"{a.repeat} runs after a warm-up, medians.", "", f"Command: `python {' '.join(sys.argv)}`", "",
                 "| batch | row | decoder | decode tok/s | TTFT ms | x generate (growing) | x bench fixed row | same tokens |",
                 "|---|---|---|---|---|---|---|---|"]
        for r in report["rows"]:
            rate = r.get("decode_tok_s")
            base = next((x.get("decode_tok_s") for x in report["rows"]
                         if x["batch"] == r["batch"] and x["row"] == "generate (growing)"), None)
            fixed = next((x.get("decode_tok_s") for x in report["rows"]
                          if x["batch"] == r["batch"] and x["row"] == "bench fixed row"), None)

            lines.append(f"| {r['batch']} | {r['row']} | {r.get('decoder') or '-'} | "
                         f"{rate:,.0f} | {r.get('ttft_ms', float('nan')):.1f} | {ratio(rate, base)} | {ratio(rate, fixed)} | "
                         f"{r.get('same_tokens', '-')} |" if rate else f"| {r['batch']} | {r['row']} | - | "
                         f"{r.get('error', '-')} | | | | |")
        a.out.with_suffix(".md").write_text("\n".join(lines) + "\n")

    rng = np.random.default_rng(0)
    greedy = SamplingSettings(greedy=True, max_new_tokens=a.new_tokens, ignore_eos=True)
    sampled = SamplingSettings(temperature=0.8, seed=1, max_new_tokens=a.new_tokens, ignore_eos=True)
    for batch in [int(b) for b in a.batches.split(",")]:
        prompts = rng.integers(0, info.config.vocab_size, (batch, a.prompt_len))
        rows = [("generate (growing)", partial(timed_generate, backend, prompts, greedy, False)),
                ("generate (auto)", partial(timed_generate, backend, prompts, greedy, None))]
        decoder = None
        if fixed_cache_refusal(a.provider, precision) is None:
            decoder = StaticDecoder(info, a.provider, rows=batch, capacity=a.prompt_len + a.new_tokens,
                                    cuda_graph=a.provider is ProviderKind.cuda)
            rows.append(("bench fixed row", partial(timed_bench_row, decoder, prompts, a.new_tokens)))
            single = StaticDecoder(info, a.provider, rows=batch, capacity=a.prompt_len + a.new_tokens,
                                   cuda_graph=a.provider is ProviderKind.cuda, block=1)
            rows.append(("fixed, a step a block", partial(timed_bench_row, single, prompts, a.new_tokens)))
        rows.append(("generate (auto), sampled", partial(timed_generate, backend, prompts, sampled, None)))
        base_tokens = None
        for name, run in rows:
            log(f"batch {batch}: {name}")
            row: dict = {"batch": batch, "row": name}
            try:
                run()  # warm-up: sessions, the decoder's capture
                runs = [run() for _ in range(a.repeat)]
                row.update(summary(runs), decoder=runs[0]["decoder"])
                tokens = np.asarray(runs[0]["tokens"])
                if name == "generate (growing)":
                    base_tokens = tokens
                elif base_tokens is not None and "sampled" not in name:
                    row["same_tokens"] = f"{float(np.mean(tokens == base_tokens)):.0%}"
            except Exception as e:  # one row failing leaves the others' figures
                row["error"] = f"{type(e).__name__}: {e}"
                log(f"  failed: {row['error']}")
            report["rows"].append(row)
            save()
        if decoder is not None:
            report.setdefault("fixed_providers", decoder.providers)
            decoder.close()
            single.close()
    if a.cli:
        log("gpt2x generate (the command)")
        text = decode(rng.integers(0, 50000, a.prompt_len).tolist())
        row = {"batch": 1, "row": "gpt2x generate (command)", "prompt_tokens": len(encode(text))}
        try:
            timed_cli(a, info.folder, text)  # warm-up: the graph cache, the page cache
            runs = [timed_cli(a, info.folder, text) for _ in range(max(1, a.repeat // 2))]
            row.update(summary(runs), runs=runs)
        except Exception as e:
            row["error"] = f"{type(e).__name__}: {e}"
            log(f"  failed: {row['error']}")
        report["rows"].append(row)
        save()
    log(a.out.with_suffix(".md").read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
