"""Whether StaticDecoder's CUDA graph gives the tokens of the same steps run one by one, from its first generation on
(fp16 exports of a tiny random model and the bundled one, 1 and 2 rows, either decoder made first):

    python -m benchmarks.cuda_graph_capture_check   (from the repository root: it makes its tiny model with tests.helpers)

Prints, per case, the plain decoder's first tokens and, for three generations in a row on the graph decoder, the
share of tokens equal to the plain decoder's and the first three. Writes its exports under /tmp/diag.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

import numpy as np

from gpt2x.choices import ProviderKind
from gpt2x.onnx.artifact import read_export
from gpt2x.runtime.static_decode import StaticDecoder
from tests.helpers import make_hf_model

cuda = ProviderKind.cuda
tiny = Path("/tmp/diag/tiny-hf")
if not tiny.exists():
    make_hf_model(tiny, seed=31, n_positions=96)
for src in (str(tiny), "shakespeare"):
    subprocess.run(["gpt2x", "export", "--model", src, "--precision", "fp16", "--exports", "/tmp/diag/e"], check=False,
                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
for folder in sorted(Path("/tmp/diag/e").iterdir()):
    if not (folder / "gpt2x.json").exists():
        continue
    info = read_export(folder)
    for rows in (2, 1):
        p = np.random.default_rng(5).integers(0, info.config.vocab_size, (rows, 9))
        for order in ("plain-first", "graph-first"):
            try:
                if order == "plain-first":
                    pl = StaticDecoder(info, cuda, rows=rows, capacity=48)
                    g = StaticDecoder(info, cuda, rows=rows, capacity=48, cuda_graph=True)
                else:
                    g = StaticDecoder(info, cuda, rows=rows, capacity=48, cuda_graph=True)
                    pl = StaticDecoder(info, cuda, rows=rows, capacity=48)
                want = pl.generate(p, 30)
                res = []
                for _ in range(3):
                    got = g.generate(p, 30)
                    res.append(f"{(got == want).mean():.2f}/{got[0, :3].tolist()}")
                print(folder.name, "rows", rows, order, "want", want[0, :3].tolist(), "graph runs:", " ".join(res), flush=True)
            except Exception as e:  # a case that fails is reported and the others still run
                print(folder.name, rows, order, "ERROR", type(e).__name__, str(e)[:300], flush=True)
