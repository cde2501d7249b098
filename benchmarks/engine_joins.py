"""Long prompts joining a running batch, in the serving engine itself (no HTTP, no client on the cores): the rows'
inter-token gaps and the joiners' first tokens under each of --variants (the prefill chunk's tokens:
EngineSettings.prefill_chunk or max_num_batched_tokens; or chunks on the fixed slots, SlotBackend, for an fp32, int8
or int4 export, each in the forward of a decode step, or apart: slots-apart), in rounds that rotate their order, on
the backend `gpt2x serve` takes for the export (ort; openvino for bf16 and for an fp32 export with an OpenVINO prefill
graph) warmed up as `gpt2x serve` opens it: `default` on the cache `gpt2x serve` takes by default (the fixed slots, or
for those exports the openvino backend's paged slots), the others on the backend's own cache. Each round submits the same requests: a
512-token prefix (one of 4) and 32 random tokens, 64 tokens out, arriving at RATE a second (Poisson), at most 16 at
once, the prefix cache off (as serve_peers.py's joins workload).

    python benchmarks/engine_joins.py --export EXPORT --variants chunk=256,slots:chunk=32 \
        --out benchmarks/results/engine-joins-cpu-2core
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from dataclasses import replace
from pathlib import Path

import numpy as np

from gpt2x.bench.system import system_info
from gpt2x.choices import BackendKind, ProviderKind
from gpt2x.generation.settings import SamplingSettings
from gpt2x.onnx.artifact import read_export
from gpt2x.runtime.base import Backend, kv_cache_name
from gpt2x.runtime.static_decode import SlotBackend
from gpt2x.serve.core.engine import Engine, EngineSettings, Row
from gpt2x.serve.core.outputs import TokenOut
from gpt2x.serve.replica import ReplicaConfig, on_slots, open_backend, served_backend
from gpt2x.workflows.backends import export_backend


def variant_settings(name: str) -> EngineSettings:
    """"default": `gpt2x serve`'s defaults (its cache, --kv-cache auto's: serve.replica.on_slots; its chunk);
    "chunk=N": prompts joining prefilled N tokens between two decode steps;
    "slots:chunk=N": chunks of N on the fixed slots (runtime.static_decode.SlotBackend), each run in a decode step's
    forward; "slots-apart:chunk=N": each in a forward of its own; "budget=N" for "chunk=N": the step's token budget
    (max_num_batched_tokens), the chunk what the rows running leave of it; "slots:base=N": the slots' default chunk with
    N for its base (capabilities.mixed_chunk_base: N and a token per row running)."""
    if name == "default":
        return EngineSettings(prefix_cache_mb=0)
    key, _, value = name.removeprefix("slots:").removeprefix("slots-apart:").removeprefix("paged:").partition("=")
    if key not in ("chunk", "budget", "base") or not value.isdigit() or (key == "base" and not name.startswith("slots:")):
        raise SystemExit(f"--variants: {name!r} is neither default nor chunk=N or budget=N (after slots:, slots-apart: or "
                         "paged:) nor slots:base=N")
    if key == "base":
        return EngineSettings(prefix_cache_mb=0)
    if key == "budget":
        return EngineSettings(max_num_batched_tokens=int(value), prefix_cache_mb=0)
    return EngineSettings(prefill_chunk=int(value), prefix_cache_mb=0)


def one_round(backend: Backend, settings: EngineSettings, args) -> dict:
    """Every request's submission time and its tokens' arrival times, summarized."""
    engine = Engine(backend, settings).start()
    rng = np.random.default_rng(args.seed)
    prefixes = [rng.integers(0, backend.vocab_size, args.prefix_tokens).tolist() for _ in range(4)]
    times: list[list[float]] = []
    rows: list[Row] = []
    due = time.perf_counter()
    try:
        for i in range(args.requests):
            due += rng.exponential(1 / args.rate)
            while time.perf_counter() < due or sum(not r.finished for r in rows) >= args.concurrency:
                time.sleep(0.001)
            stamps = [time.perf_counter()]
            times.append(stamps)

            def sink(out, stamps=stamps) -> None:
                if isinstance(out, TokenOut):
                    stamps.append(time.perf_counter())

            prompt = prefixes[i % 4] + rng.integers(0, backend.vocab_size, args.suffix_tokens).tolist()
            settings = SamplingSettings(max_new_tokens=args.max_tokens, ignore_eos=True, seed=i)
            row = Row(prompt, settings, sink, max_tokens=args.max_tokens)
            rows.append(row)
            engine.submit([row])
        while not all(r.finished for r in rows):
            time.sleep(0.01)
    finally:
        engine.close()
    ttft = [(s[1] - s[0]) * 1e3 for s in times]
    gaps = np.concatenate([np.diff(s[1:]) * 1e3 for s in times])
    p50 = float(np.median(gaps))
    return {"ttft_p50_ms": statistics.median(ttft), "itl_p50_ms": p50, "itl_p99_ms": float(np.percentile(gaps, 99)),
            "itl_p999_ms": float(np.percentile(gaps, 99.9)), "itl_max_ms": float(gaps.max()),
            "itl_over_3x_p50_pct": float(100 * (gaps > 3 * p50).mean()), "gaps": len(gaps)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--export", type=Path, required=True)
    ap.add_argument("--rate", type=float, default=1.5, help="requests a second (Poisson)")
    ap.add_argument("--requests", type=int, default=48)
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--prefix-tokens", type=int, default=512)
    ap.add_argument("--suffix-tokens", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--variants", default="default,chunk=256",
                    help="comma-separated: default, chunk=N or budget=N, each also after slots:, slots-apart: or "
                    "paged: (the openvino backend's paged slots)")
    ap.add_argument("--out", type=Path, required=True, help="OUT.json and OUT.md")
    args = ap.parse_args()
    info = read_export(args.export)
    variants = args.variants.split(",")
    settings = {v: variant_settings(v) for v in variants}
    # the backend `gpt2x serve` takes for the export (bf16, and fp32 with an OpenVINO prefill graph: openvino), on its
    # own cache
    kind = served_backend(info, ProviderKind.cpu)
    backend = export_backend(kind, info, ProviderKind.cpu)
    if backend.capabilities.warms_up:
        backend.warm_up()
    # `gpt2x serve`'s default cache for this export (--kv-cache auto): the ort backend's fixed slots, the openvino
    # backend's paged ones (serve.replica.open_backend)
    config = ReplicaConfig(export=str(args.export), model_id="", backend=kind.value, fixed_slots=None,
                           engine=settings[variants[0]])
    default = ("paged" if kind is BackendKind.openvino else "slots") if on_slots(config, info) else ""
    # the fixed slots: a full batch and as many joiners, each of the model's context (the scheduler plans a join's
    # positions as the in-place cache lays them out, right-aligned to the widest row, which a shorter capacity refuses)
    size = 2 * settings[variants[0]].max_batch_size
    backends = {kind: SlotBackend(info, slots=size, mix_chunks=kind == "slots") for kind in ("slots", "slots-apart")
                if any(v.startswith(kind + ":") for v in variants) or (kind == default and "default" in variants)}
    if (default == "paged" and "default" in variants) or any(v.startswith("paged:") for v in variants):
        backends["paged"] = open_backend(replace(config, fixed_slots=True), info)
    for b in backends.values():
        b.warm_up()
    runs = []
    for r in range(args.rounds):
        for v in variants[r % len(variants):] + variants[: r % len(variants)]:
            kind = default if v == "default" else v.partition(":")[0]
            b = backends.get(kind, backend)
            chunk_base = b.capabilities.mixed_chunk_base
            if v.startswith("slots:base="):  # the engine reads it when it starts
                b.capabilities = replace(b.capabilities, mixed_chunk_base=int(v.partition("=")[2]))
            result = one_round(b, settings[v], args)
            b.capabilities = replace(b.capabilities, mixed_chunk_base=chunk_base)
            runs.append({"round": r + 1, "variant": v, **result})
            print(f"round {r + 1}, {v}: " + ", ".join(f"{k} {x:.1f}" for k, x in result.items() if k != "gaps"), flush=True)
    # what each variant's cache held (--kv-cache-dtype or GPT2X_KV_CACHE_DTYPE chooses it where the export has a choice)
    caches = {v: kv_cache_name(backends.get(default if v == "default" else v.partition(":")[0], backend)) or "float32"
              for v in variants}
    keys = [k for k in runs[0] if k.endswith(("_ms", "_pct"))]
    table = {v: {k: statistics.median(r[k] for r in runs if r["variant"] == v) for k in keys} for v in variants}
    command = "python benchmarks/engine_joins.py " + " ".join(f"--{k.replace('_', '-')} {v}" for k, v in vars(args).items())
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".json").write_text(json.dumps({
        "command": command,
        "system": system_info(), "export": str(args.export), "kv_cache_dtype": caches, "runs": runs, "medians": table},
        indent=1, default=str))
    lines = [f"# Long prompts joining, in the engine ({system_info().get('cpu')}, {args.rounds} rounds, medians)", "",
             f"Command: `{command}`", "",
             "| variant | KV cache | TTFT p50 ms (every request) | ITL p50 ms | ITL p99 ms | p99 / p50 | ITL p99.9 ms | "
             "ITL max ms | gaps over 3x p50 |", "|---|---|---:|---:|---:|---:|---:|---:|---:|"]
    for v, x in table.items():
        lines.append(f"| {v} | {caches[v]} | {x['ttft_p50_ms']:.1f} | {x['itl_p50_ms']:.1f} | {x['itl_p99_ms']:.1f} | "
                     f"{x['itl_p99_ms'] / x['itl_p50_ms']:.2f} | {x['itl_p999_ms']:.1f} | {x['itl_max_ms']:.1f} | "
                     f"{x['itl_over_3x_p50_pct']:.2f}% |")
    args.out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
