"""A one-off investigation (issue 35): does a decode on ONNX Runtime's CUDA provider read cache positions not yet
written? Each decoder's cache is filled with NaN (or 6e4) before two generations, whose tokens are compared with a
zeroed decoder's. It reads StaticDecoder's private buffers, so it goes once its finding is in docs/results/cuda.md:

    python benchmarks/cuda_unwritten_cache_check.py [cuda|cpu]    (GPT2X_EXPORTS: where its exports go)
"""
import sys

import numpy as np

from gpt2x.choices import Precision, ProviderKind
from gpt2x.onnx.artifact import default_export_dir
from gpt2x.runtime.static_decode import StaticDecoder
from gpt2x.workflows.exports import ensure_export

prov = ProviderKind(sys.argv[1]) if len(sys.argv) > 1 else ProviderKind.cuda
prec = Precision.fp16 if prov is ProviderKind.cuda else Precision.fp32
dt = np.float16 if prec is Precision.fp16 else np.float32
for model in ("shakespeare", "random:gpt2"):
    info = ensure_export(model, prec, folder=default_export_dir(model, prec))
    for rows in ((1, 2) if model == "shakespeare" else (1,)):
        p = np.random.default_rng(5).integers(0, info.config.vocab_size, (rows, 9))
        want = StaticDecoder(info, prov, rows=rows, capacity=48).generate(p, 30)
        for graph in ((False, True) if prov is ProviderKind.cuda else (False,)):
            for fill in ("nan", "big"):
                d = StaticDecoder(info, prov, rows=rows, capacity=48, cuda_graph=graph)
                v = {"nan": np.nan, "inf": np.inf, "big": 6e4}[fill]
                for kv in d._kv:
                    kv.update_inplace(np.full(kv.shape(), v, dt))
                res = []
                for _ in range(2):
                    got = d.generate(p, 30)
                    res.append(f"{(got == want).mean():.2f}/{got[0, :3].tolist()}")
                print(model, "rows", rows, "graph", graph, "fill", fill, "want", want[0, :3].tolist(), "gens:", " ".join(res), flush=True)  # noqa: T201
