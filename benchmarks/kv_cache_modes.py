"""The int8 graph's two ways of holding the KV cache, timed against each other in one process.

    python benchmarks/kv_cache_modes.py --out benchmarks/results/kv-cache-modes-cpu-2core.json

- in-place (`in_place_kv`): one fixed-capacity buffer per layer bound as both past and present, updated
  in place by GroupQueryAttention (gpt2x's default for int8 on the CPU; results before this release
  call it "shared");
- growing: each step's presents, one position longer, fed back as the next past (what Optimum and
  genai without past_present_share_buffer do; `OrtBackend(..., in_place_kv=False)`).

Same export, same session settings, batch 1, 32-token prompt, --new-tokens greedy tokens; the two
modes alternate for --rounds rounds and the medians are reported, with the greedy tokens checked
equal.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import numpy as np

from gpt2x import workflows
from gpt2x.bench.run import timed_generation
from gpt2x.bench.system import system_info
from gpt2x.choices import Precision
from gpt2x.generation.generate import generate
from gpt2x.generation.settings import SamplingSettings
from gpt2x.runtime.ort import OrtBackend
from gpt2x.runtime.providers import physical_cores


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="random:gpt2")
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    threads = physical_cores()
    # exported/<model>-int8, exported (parity-gated) first when missing
    info = workflows.ensure_export(args.model, Precision.int8, progress=lambda m: print(m, file=sys.stderr),
                                   notice=lambda m: print(m, file=sys.stderr))
    folder = info.folder
    modes = {"in-place": OrtBackend(info, threads=threads, in_place_kv=True),
             "growing": OrtBackend(info, threads=threads, in_place_kv=False)}
    prompt = np.random.default_rng(0).integers(0, info.config.vocab_size, (1, 32), dtype=np.int64)
    for backend in modes.values():
        timed_generation(backend, prompt, 8)  # warm-up
    runs: dict[str, list[dict]] = {name: [] for name in modes}
    for r in range(args.rounds):
        for name in (list(modes) if r % 2 == 0 else list(modes)[::-1]):
            run = timed_generation(modes[name], prompt, args.new_tokens)
            runs[name].append({"e2e_tokens_per_s": args.new_tokens / run["total_s"],
                               "decode_tokens_per_s": len(run["steps_s"]) / sum(run["steps_s"])})
    s = SamplingSettings(max_new_tokens=args.new_tokens, greedy=True)
    same = [generate(b, [""], s, prompt_ids=[prompt[0].tolist()])[0].tokens for b in modes.values()]
    results = {"environment": system_info(), "settings": vars(args) | {"out": str(args.out), "threads": threads},
               "export": str(folder), "attention": info.attention, "same_greedy_tokens": same[0] == same[1],
               "modes": {name: {"runs": rs,
                                "median_e2e_tokens_per_s": statistics.median(x["e2e_tokens_per_s"] for x in rs),
                                "median_decode_tokens_per_s": statistics.median(x["decode_tokens_per_s"] for x in rs)}
                         for name, rs in runs.items()}}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=1) + "\n")
    for name, m in results["modes"].items():
        print(f"{name:8s} e2e {m['median_e2e_tokens_per_s']:6.1f} tok/s   decode {m['median_decode_tokens_per_s']:6.1f} tok/s")
    print(f"same greedy tokens: {results['same_greedy_tokens']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
