"""onnxruntime-genai running gpt2x's exports, one per --precisions: the same graphs, genai's own C++
loop choosing the tokens (batch 1), when importable."""

from __future__ import annotations

import json
import time
from pathlib import Path

import numpy as np

from gpt2x.onnx.artifact import ExportInfo
from gpt2x.onnx.interop import GENAI_CONFIG_FILE, genai_config
from gpt2x.onnx.names import in_place_kv

from .core import Context, StampedLoop, error_line
from .gpt2x import ensure_exports

KEY = "genai"
ORDER = 40
LABEL = "onnxruntime-genai"


class Genai(StampedLoop):
    """onnxruntime-genai on a gpt2x export: og.Model on a folder holding the export's model.onnx
    (a link) and the genai_config.json gpt2x writes for it, with intra_op_num_threads set like every
    other session; greedy, min_length = max_length = prompt + new tokens so that EOS cannot stop it.
    append_tokens runs the prefill; each generate_next_token picks a token (and from the second
    on, first runs the decode step that produces its logits)."""

    batches = {1}
    runtime = "onnxruntime-genai on gpt2x"

    def __init__(self, info: ExportInfo, work: Path, threads: int):
        import onnxruntime_genai as og

        self.precision, self.og = info.precision, og
        self.name, self.engine = f"{self.runtime} {info.precision.value}", "ort"
        export_folder = info.folder
        work.mkdir(parents=True)
        if (export_folder / GENAI_CONFIG_FILE).is_file():
            cfg = json.loads((export_folder / GENAI_CONFIG_FILE).read_text())
        else:  # an export made before gpt2x wrote interop files: the same file gpt2x writes now
            cfg = genai_config(info.config, share_buffer=in_place_kv(info.attention))
        cfg["model"]["decoder"]["session_options"]["intra_op_num_threads"] = threads
        (work / GENAI_CONFIG_FILE).write_text(json.dumps(cfg, indent=1))
        for p in export_folder.iterdir():
            if p.name.startswith(info.model_path.name):  # model.onnx (and model.onnx.data)
                (work / p.name).symlink_to(p.resolve())
        self.genai_search = cfg["search"]
        self.model = og.Model(str(work))

    def _generate(self, prompt: np.ndarray, n: int, stamps: list[float]) -> np.ndarray:
        og = self.og
        params = og.GeneratorParams(self.model)
        length = prompt.shape[1] + n
        params.set_search_options(max_length=length, min_length=length, do_sample=False, batch_size=prompt.shape[0])
        gen = og.Generator(self.model, params)
        gen.append_tokens(prompt.astype(np.int32))
        tokens = []
        while not gen.is_done():
            gen.generate_next_token()
            tokens.append(np.array(gen.get_next_tokens()))
            stamps.append(time.perf_counter())
        assert len(tokens) == n, (len(tokens), n)
        return np.stack(tokens, axis=1)


def load(ctx: Context) -> list:
    contenders = []
    for info in ensure_exports(ctx).values():  # onnxruntime-genai's own loop on gpt2x's exports
        name = f"{Genai.runtime} {info.precision.value}"
        try:
            contenders.append(Genai(info, ctx.work / f"genai-{info.precision.value}", ctx.threads))
        except ImportError as e:
            ctx.skip(LABEL, f"not importable here: {e}")
            break
        except Exception as e:  # a graph genai cannot load
            ctx.skip(name, error_line(e))
    return contenders
