"""What drawing a sampled token costs on the host: the float64 way (softmax, then the inverse CDF: gpt2x before
sampling.draw_scores) against draw_scores (float32 masses first, a row within their rounding of a boundary drawn again
in float64), on the bundled model's own logits, in the same run.

    python benchmarks/sampling_draw.py --out benchmarks/results/sampling-draw-cpu-2core

1. `generate` of --rows prompts x --new-tokens tokens at temperature 1 (OpenAI's default, and what `vllm bench serve`
   sends) on the bundled model's fp32 export, ONNX Runtime, all cores: tokens per second both ways, --repeat
   interleaved rounds, medians. The tokens of both ways must be identical (the script stops otherwise).
2. The draws alone, on the processed scores that run handed the sampler (rows x vocabulary, float64): milliseconds a
   step both ways at 1 row and at --rows rows, and the share of rows draw_scores drew again in float64.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np

from gpt2x.bench.report import save_results
from gpt2x.bench.system import system_info
from gpt2x.generation import sampling
from gpt2x.generation.generate import generate
from gpt2x.generation.processors import softmax
from gpt2x.generation.settings import SamplingSettings
from gpt2x.runtime.ort import OrtBackend
from gpt2x.workflows.exports import ensure_export

PROMPTS = ["ROMEO:", "KING HENRY:", "First Citizen:", "JULIET:", "MENENIUS:", "GLOUCESTER:", "Nurse:", "BRUTUS:"]
FAST = sampling.draw_scores
INVERSE_CDF = sampling._inverse_cdf


def float64_way(scores: np.ndarray, u: np.ndarray) -> np.ndarray:
    return INVERSE_CDF(softmax(scores), u)


def timed_generate(backend, prompts: list[str], settings: SamplingSettings, draw) -> tuple[float, list]:
    sampling.draw_scores = draw
    try:
        start = time.perf_counter()
        out = generate(backend, prompts, settings)
        return time.perf_counter() - start, [g.tokens for g in out]
    finally:
        sampling.draw_scores = FAST


def per_step_ms(steps: list[tuple[np.ndarray, np.ndarray]], draw, rounds: int) -> float:
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        for scores, u in steps:
            draw(scores, u)
        times.append((time.perf_counter() - start) / len(steps) * 1e3)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=16)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--out", type=Path, required=True, help="output path without extension (.json, .md)")
    args = ap.parse_args()
    backend = OrtBackend(ensure_export("shakespeare"))
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(args.rows)]
    settings = SamplingSettings(temperature=1.0, seed=0, max_new_tokens=args.new_tokens, ignore_eos=True)
    timed_generate(backend, prompts, settings, FAST)  # warm-up
    runs: dict = {"float64": [], "draw_scores": []}
    for _ in range(args.repeat):
        for name, draw in (("float64", float64_way), ("draw_scores", FAST)):
            seconds, tokens = timed_generate(backend, prompts, settings, draw)
            runs[name].append(args.rows * args.new_tokens / seconds)
            if name == "float64":
                want = tokens
            elif tokens != want:
                sys.exit("draw_scores gave other tokens than the float64 way: a bug")

    steps: list = []  # the scores and uniforms each step of one run handed the sampler

    def kept(scores, u):
        steps.append((scores.copy(), u.copy()))
        return FAST(scores, u)

    timed_generate(backend, prompts, settings, kept)
    again = [0]

    def counted(p, u):
        again[0] += len(u)
        return INVERSE_CDF(p, u)

    sampling._inverse_cdf = counted
    for scores, u in steps:
        FAST(scores, u)
    sampling._inverse_cdf = INVERSE_CDF
    drawn = sum(len(u) for _, u in steps)
    ones = [(s[i : i + 1], u[i : i + 1]) for s, u in steps for i in range(len(u))]
    draws = {f"{rows} row{'s' * (rows > 1)}": {name: per_step_ms(batch, draw, args.repeat)
                                               for name, draw in (("float64", float64_way), ("draw_scores", FAST))}
             for rows, batch in ((1, ones), (args.rows, steps))}
    machine = system_info()
    # What decides NumPy's exp kernels: float64's is vectorised with AVX-512F only
    from numpy._core._multiarray_umath import __cpu_features__

    machine["simd"] = [f for f in ("AVX2", "AVX512F", "AVX512_SKX") if __cpu_features__.get(f)]
    generated = {name: statistics.median(r) for name, r in runs.items()}
    out = {"machine": machine, "command": " ".join(["python", *sys.argv]), "repeat": args.repeat, "rows": args.rows,
           "new_tokens": args.new_tokens, "vocab": backend.vocab_size, "generate_tokens_per_s": generated,
           "generate_runs": runs, "draw_ms_per_step": draws, "drawn_again_share": again[0] / drawn, "draws": drawn}
    lines = [f"Sampled draws on {machine['cpu']} ({machine['cores']} cores; {', '.join(machine['simd'])}), {machine['date']}, gpt2x git "
             f"{machine.get('git')}: the bundled model's fp32 export on ONNX Runtime, {args.rows} prompts x "
             f"{args.new_tokens} tokens at temperature 1, vocabulary {backend.vocab_size}; {args.repeat} interleaved "
             "rounds, medians. Both ways drew the same tokens.", "",
             "| | float64 way | draw_scores | ratio |", "| --- | ---: | ---: | ---: |",
             f"| `generate`, tokens/s | {generated['float64']:.0f} | {generated['draw_scores']:.0f} | "
             f"{generated['draw_scores'] / generated['float64']:.2f}x |"]
    for label, ms in draws.items():
        lines.append(f"| a draw, {label}: ms a step | {ms['float64']:.3f} | {ms['draw_scores']:.3f} | "
                     f"{ms['float64'] / ms['draw_scores']:.2f}x less |")
    lines += ["", f"draw_scores drew {again[0]} of {drawn} rows ({again[0] / drawn:.1%}) again in float64 (a cut within "
              "the float32 masses' rounding of a token's end)."]
    save_results(args.out, out, "\n".join(lines) + "\n")
    sys.stdout.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
