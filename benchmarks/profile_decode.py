"""Where a decode step's time goes on ONNX Runtime, per operator type, for each precision: ONNX
Runtime's own profiler over greedy decode steps of GPT-2 124M (random weights), batch 1, the prefill
left out. Explains the speed table: how much of a step is the weight matrices (MatMul/MatMulNBits),
attention, and the rest.

    python benchmarks/profile_decode.py --out benchmarks/results/profile-decode-cpu-2core.json
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import defaultdict
from pathlib import Path

import numpy as np
import onnxruntime as ort

from gpt2x.bench.system import system_info
from gpt2x.choices import Precision
from gpt2x.generation.decode import Sequence, decode_steps
from gpt2x.generation.settings import SamplingSettings
from gpt2x.runtime.ort import OrtBackend
from gpt2x.runtime.providers import physical_cores, session_options
from gpt2x.workflows import ensure_export


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def profile(info, tokens: int, prompt_len: int, threads: int, folder: Path) -> dict:
    backend = OrtBackend(info, threads=threads)
    so = session_options(threads)
    so.enable_profiling = True
    so.profile_file_prefix = str(folder / f"ort-{info.precision.value}")
    # The same session settings as gpt2x's, with ONNX Runtime's profiler on (the backend's own
    # session is replaced: profiling is a session option only).
    backend.session = ort.InferenceSession(str(info.model_path), sess_options=so, providers=["CPUExecutionProvider"])
    ids = np.random.default_rng(0).integers(0, info.config.vocab_size, (1, prompt_len), dtype=np.int64)
    settings = SamplingSettings(greedy=True, max_new_tokens=tokens, ignore_eos=True)
    for _ in decode_steps(backend, [Sequence(ids[0].tolist(), settings)]):
        pass
    events = json.loads(Path(backend.session.end_profiling()).read_text())
    runs = sorted((e for e in events if e.get("name") == "model_run"), key=lambda e: e["ts"])
    prefill_end = runs[0]["ts"] + runs[0]["dur"]  # the first run is the prompt
    per_op: dict[str, float] = defaultdict(float)
    for e in events:
        if e.get("cat") == "Node" and e["name"].endswith("_kernel_time") and e["ts"] > prefill_end:
            per_op[e["args"]["op_name"]] += e["dur"]
    steps = len(runs) - 1
    total = sum(per_op.values())
    run_us = sum(r["dur"] for r in runs[1:])
    return {
        "decode_steps": steps,
        "step_ms": run_us / steps / 1e3,
        "kernel_ms_per_step": total / steps / 1e3,
        "ops": {op: {"ms_per_step": us / steps / 1e3, "share": us / total}
                for op, us in sorted(per_op.items(), key=lambda kv: -kv[1])},
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="random:gpt2")
    ap.add_argument("--precisions", default="fp32,int8,int4")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    threads = physical_cores()
    result = {"machine": system_info(), "model": args.model, "batch": 1, "threads": threads, "precisions": {}}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    scratch = args.out.parent / ".profiles"
    scratch.mkdir(exist_ok=True)
    for name in args.precisions.split(","):
        precision = Precision(name)
        info = ensure_export(args.model, precision, progress=log, notice=log)
        log(f"profiling {precision.value}")
        result["precisions"][name] = profile(info, args.tokens, args.prompt_len, threads, scratch)
    for f in scratch.iterdir():
        f.unlink()
    scratch.rmdir()
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    for name, p in result["precisions"].items():
        top = ", ".join(f"{op} {v['ms_per_step']:.2f} ms ({v['share']:.0%})" for op, v in list(p["ops"].items())[:4])
        print(f"{name}: {p['step_ms']:.2f} ms/step; {top}")


if __name__ == "__main__":
    main()
