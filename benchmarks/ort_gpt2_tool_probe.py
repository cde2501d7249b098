"""Can ONNX Runtime's GPT-2 tool build its fused graph from this environment's transformers, once the
export itself is made to trace? A probe for benchmarks/compare_peers.py, run in its own process
because it patches transformers:

    python benchmarks/ort_gpt2_tool_probe.py HF_FOLDER WORK_DIR      # prints one JSON object

`python -m onnxruntime.transformers.models.gpt2.convert_to_onnx` fails with transformers >= 4.53
before it writes anything: it exports with the TorchScript tracer (`torch.onnx.export(...,
dynamo=False)`), which cannot trace the causal mask transformers now builds with `torch.vmap`
(`RuntimeError: unordered_map::at`). Optimum's own export gets past that with a few patches
(optimum/exporters/onnx/model_patcher.py: a mask without vmap, a traceable DynamicLayer.update and
find_packed_sequence_indices). This applies those same patches, then runs the tool's own steps,
`Gpt2Helper.export_onnx` and `Gpt2Helper.optimize_onnx` (what convert_to_onnx -o does), and reports
the fused operators: the tool's fp32/int8 graphs are worth timing only if `Attention` was fused.

Two variants: eager attention at the tool's default opset 11 (its SDPA path needs opset 14), and
SDPA through the tool's external-data path, which exports at opset 14.
"""

from __future__ import annotations

import json
import sys
import traceback
from pathlib import Path


def patch_transformers_for_tracing() -> None:
    import transformers.masking_utils as masking
    from optimum.exporters.onnx import model_patcher as mp
    from transformers.cache_utils import DynamicLayer

    masking.ALL_MASK_ATTENTION_FUNCTIONS.register("sdpa", mp.sdpa_mask_without_vmap)
    masking.ALL_MASK_ATTENTION_FUNCTIONS.register("eager", mp.eager_mask_without_vmap)
    masking.find_packed_sequence_indices = mp.find_packed_sequence_indices_patched
    DynamicLayer.update = mp.patched_dynamic_layer_update


def probe(hf_dir: Path, work: Path, attn: str, external_data: bool) -> dict:
    import torch
    from onnxruntime.transformers.models.gpt2.gpt2_helper import Gpt2Helper, MyGPT2LMHeadModel

    result: dict = {"attn_implementation": attn, "opset": 14 if external_data else 11, "exported": False}
    work.mkdir(parents=True, exist_ok=True)
    try:
        model = MyGPT2LMHeadModel.from_pretrained(hf_dir, attn_implementation=attn).eval()
        Gpt2Helper.export_onnx(model, torch.device("cpu"), str(work / "raw.onnx"), use_external_data_format=external_data)
        result["exported"] = True
        optimized = Gpt2Helper.optimize_onnx(str(work / "raw.onnx"), str(work / "fp32.onnx"), False,
                                             model.config.n_head, model.config.n_embd, external_data)
        result["fused_operators"] = {k: v for k, v in optimized.get_fused_operator_statistics().items() if v}
    except Exception as e:  # whatever the tool's steps raise is the finding
        result["error"] = f"{type(e).__name__}: {e}".splitlines()[0]
        result["traceback_tail"] = traceback.format_exc().strip().splitlines()[-6:]
    return result


def main() -> int:
    hf_dir, work = Path(sys.argv[1]), Path(sys.argv[2])
    patch_transformers_for_tracing()
    results = [probe(hf_dir, work / "eager-opset11", "eager", False), probe(hf_dir, work / "sdpa-opset14", "sdpa", True)]
    print(json.dumps({"patches": "optimum.exporters.onnx.model_patcher (mask without vmap, DynamicLayer.update, "
                      "find_packed_sequence_indices)", "variants": results}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
