"""Where one decode step's time goes on CUDA, GPT-2 124M fp16, batch 1 (runtime.static_decode.StaticDecoder):

    python benchmarks/cuda_step_breakdown.py EXPORT_FOLDER   (an fp16 export, e.g. made by benchmarks/cuda_decode.py)

For the plain fixed-cache step and its CUDA graph: the mean of 500 calls of each part of a step (run_with_iobinding
alone, the 4-byte seqlens_k write, the token's copy back) and of a whole step in a 128-token generation, in µs.
A replay's run_with_iobinding is the GPU's work (the captured kernels) plus ONNX Runtime's call.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import numpy as np

from gpt2x.choices import ProviderKind
from gpt2x.onnx.artifact import read_export
from gpt2x.runtime.static_decode import StaticDecoder


def mean_us(f, n: int = 500) -> float:
    f()
    start = time.perf_counter()
    for _ in range(n):
        f()
    return 1e6 * (time.perf_counter() - start) / n


def parts_of(d: StaticDecoder, prompt: np.ndarray) -> dict[str, float]:
    d.generate(prompt, 128)
    d.generate(prompt, 64)  # the cache now holds 32 + 63 positions
    seqlens = np.full(1, 90, np.int32)
    parts = {"run_with_iobinding": mean_us(lambda: d._decode.run_with_iobinding(d._binding)),
             "seqlens update_inplace": mean_us(lambda: d._seqlens.update_inplace(seqlens)),
             "token numpy()": mean_us(lambda: d._tokens.numpy())}
    d.generate(prompt, 2)
    start = time.perf_counter()
    d.generate(prompt, 128)
    parts["whole step (generate loop)"] = 1e6 * (time.perf_counter() - start) / 128
    return parts


def main() -> int:
    info = read_export(Path(sys.argv[1]))
    prompt = np.random.default_rng(0).integers(0, info.config.vocab_size, (1, 32))
    for graph in (False, True):
        parts = parts_of(StaticDecoder(info, ProviderKind.cuda, rows=1, capacity=256, cuda_graph=graph), prompt)
        print("cuda_graph" if graph else "plain", {k: round(v, 1) for k, v in parts.items()}, "us", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
