"""A wave of prompts in the serving engine (no HTTP): the gap from each token of a row to its next, for the first tokens
after the wave's prefill, and the engine's time outside the model step.

    python benchmarks/wave_gaps.py --export EXPORTS/random-gpt2-int8 --kv-cache-dtype float \
        --out benchmarks/results/wave-gaps-xeon-amx-cpu-2core --label int8-float-after
    # a commit before, from a worktree of it: PYTHONPATH=WORKTREE python benchmarks/wave_gaps.py ... --label ...-before

--prompts rows of --prompt-len random tokens are handed over at once (as `vllm bench serve` sends a wave at c=16),
greedy with min_tokens (end-of-text masked, as its `ignore_eos`), --tokens each. Per round: each gap (token k to k+1,
k = 1 .. --gaps) as the mean over rows, on the rows' sink clock; the tokens' mean interval past the first --gaps (TPOT);
and the mean time of the backend's decode steps that gave those tokens (`Backend.step` of one token a row, timed around
the call): TPOT's excess over it is the engine's own time. Medians over the rounds after the first (a warm-up). Under
`vllm bench serve` every request's second token comes after its wave's prefill: one ITL sample in --tokens - 1, which
sets the p99 at 64 tokens.
"""

from __future__ import annotations

import argparse
import statistics
import threading
import time
from pathlib import Path

import numpy as np

from gpt2x.bench.report import save_results
from gpt2x.bench.system import git_revision, system_info
from gpt2x.choices import BackendKind, ProviderKind
from gpt2x.generation.settings import SamplingSettings
from gpt2x.runtime.static_decode import SlotBackend
from gpt2x.serve.core.engine import Engine, EngineSettings, Row
from gpt2x.serve.core.outputs import Failed, Finished, TokenOut
from gpt2x.workflows.backends import choose_backend, export_backend
from gpt2x.workflows.exports import resolve_export


def one_round(engine: Engine, backend, prompts: np.ndarray, tokens: int) -> tuple[list[list[float]], list[float]]:
    """Each row's token times, and the decode steps' durations, for one wave."""
    times: list[list[float]] = [[] for _ in prompts]
    steps: list[float] = []
    left, done, lock = [len(prompts)], threading.Event(), threading.Lock()
    step = backend.step

    def timed(ids, *args, **kwargs):
        start = time.perf_counter()
        out = step(ids, *args, **kwargs)
        if ids.shape[1] == 1:
            steps.append(time.perf_counter() - start)
        return out

    def sink_for(i: int):
        def sink(out) -> None:
            if isinstance(out, TokenOut):
                times[i].append(time.perf_counter())
            elif isinstance(out, (Finished, Failed)):
                with lock:
                    left[0] -= 1
                    if not left[0]:
                        done.set()
        return sink

    backend.step = timed
    try:
        settings = SamplingSettings(max_new_tokens=tokens, greedy=True, min_tokens=tokens)
        engine.submit([Row(p.tolist(), settings, sink_for(i)) for i, p in enumerate(prompts)])
        if not done.wait(300):
            raise RuntimeError("the wave did not finish within 300 s")
    finally:
        del backend.step
    return times, steps


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--export", type=Path, required=True)
    ap.add_argument("--backend", default=None, help="ort or openvino (default: the export's own)")
    ap.add_argument("--kv-cache-dtype", default=None, help="the ort backend's KV cache: auto, float or int8")
    ap.add_argument("--slots", action="store_true", help="the fixed slots (gpt2x serve --kv-cache slots) instead")
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--tokens", type=int, default=16)
    ap.add_argument("--gaps", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--out", type=Path, required=True, help="a folder: LABEL.json and LABEL.md go there")
    ap.add_argument("--label", required=True)
    args = ap.parse_args()

    info = resolve_export(onnx_dir=args.export)
    kind = choose_backend(BackendKind(args.backend) if args.backend else None, info.precision, ProviderKind.cpu)
    options = {"kv_cache_dtype": args.kv_cache_dtype} if args.kv_cache_dtype else {}
    if args.slots:  # as gpt2x serve --kv-cache slots opens them
        backend = SlotBackend(info, ProviderKind.cpu, slots=2 * args.prompts, resident=args.prompts)
    else:
        backend = export_backend(kind, info, ProviderKind.cpu, **options)
    if backend.capabilities.warms_up:
        backend.warm_up()
    engine = Engine(backend, EngineSettings(max_batch_size=args.prompts)).start()
    rng = np.random.default_rng(0)
    rounds = []
    try:
        for _ in range(args.rounds + 1):
            times, steps = one_round(engine, backend, rng.integers(0, info.config.vocab_size, (args.prompts, args.prompt_len)),
                                     args.tokens)
            gaps = [statistics.fmean(t[k + 1] - t[k] for t in times) * 1e3 for k in range(args.gaps)]
            tpot = statistics.fmean((t[-1] - t[args.gaps]) / (len(t) - 1 - args.gaps) for t in times) * 1e3
            # the steps that gave the tokens TPOT spans: token k + 1 comes from decode step k
            rounds.append({"gaps_ms": gaps, "tpot_ms": tpot, "decode_step_ms": statistics.fmean(steps[args.gaps :]) * 1e3})
    finally:
        engine.close()
        backend.close()
    kept = rounds[1:]
    result = {
        "label": args.label, "export": str(args.export), "precision": info.precision.value, "backend": kind.value,
        "kv_cache_dtype": args.kv_cache_dtype or "auto", "slots": args.slots, "prompts": args.prompts, "prompt_len": args.prompt_len,
        "tokens": args.tokens, "rounds": args.rounds,
        "gaps_ms": [statistics.median(r["gaps_ms"][k] for r in kept) for k in range(args.gaps)],
        "tpot_ms": statistics.median(r["tpot_ms"] for r in kept),
        "decode_step_ms": statistics.median(r["decode_step_ms"] for r in kept),
        "runs": rounds, "commit": git_revision(), "system": system_info(),
    }
    result["outside_step_ms"] = result["tpot_ms"] - result["decode_step_ms"]
    sysinfo = result["system"]
    md = (f"# {args.label}: a wave of {args.prompts} prompts of {args.prompt_len} tokens in the serving engine\n\n"
          f"{info.precision.value} export on the {kind.value} backend, KV cache {result['kv_cache_dtype']}"
          f"{' in fixed slots' if args.slots else ''}; "
          f"{sysinfo['cpu']}, {sysinfo['cores']} cores; gpt2x git {result['commit']}; "
          f"medians of {args.rounds} rounds after a warm-up.\n\n"
          "| gap after token | " + " | ".join(str(k + 1) for k in range(args.gaps)) + " | TPOT | decode step | outside the step |\n"
          "| --- | " + " | ".join("---:" for _ in range(args.gaps + 3)) + " |\n"
          "| ms | " + " | ".join(f"{g:.1f}" for g in result["gaps_ms"])
          + f" | {result['tpot_ms']:.2f} | {result['decode_step_ms']:.2f} | {result['outside_step_ms']:.2f} |\n")
    save_results(args.out / args.label, result, md)
    print(md)


if __name__ == "__main__":
    main()
