"""Which int8 graph decodes fastest on this machine: ONNX Runtime's `quantize_dynamic` (per-channel
MatMulInteger) or its `MatMulNBits` quantizer with 8 bits at several block sizes.

    python benchmarks/int8_variants.py --out benchmarks/results/int8-variants-cpu-2core.json

GPT-2 124M architecture with random weights (`random:gpt2`), one decode step at context 64, batch 1,
median of 50 runs after 10 warm-ups, plus the max relative logit error against the fp32 graph.
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort

from gpt2x import workflows
from gpt2x.bench.system import system_info
from gpt2x.choices import Precision
from gpt2x.onnx.artifact import IR_VERSION, read_export
from gpt2x.onnx.optimize import fold_transposed_initializers
from gpt2x.runtime.providers import session_options


def decode_ms(path: Path, feeds_prefill: dict) -> tuple[float, np.ndarray]:
    s = ort.InferenceSession(str(path), session_options(), providers=["CPUExecutionProvider"])
    names = [i.name for i in s.get_inputs()]
    outs = s.run(None, feeds_prefill)
    step = {"input_ids": np.array([[5]]), "attention_mask": np.ones((1, 65), np.int64), "position_ids": np.array([[64]])}
    step.update(dict(zip(names[3:], outs[1:])))
    for _ in range(10):
        s.run(["logits"], step)
    times = []
    for _ in range(50):
        t = time.perf_counter()
        s.run(["logits"], step)
        times.append(time.perf_counter() - t)
    return statistics.median(times) * 1e3, outs[0]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    logging.getLogger("onnxruntime.quantization.matmul_nbits_quantizer").setLevel(logging.WARNING)
    model, source = workflows.load_model("random:gpt2")
    cfg = model.config
    feeds = {"input_ids": np.random.default_rng(0).integers(0, cfg.vocab_size, (1, 64)),
             "attention_mask": np.ones((1, 64), np.int64), "position_ids": np.arange(64)[None]}
    for i in range(cfg.n_layer):
        for kv in ("key", "value"):
            feeds[f"past_key_values.{i}.{kv}"] = np.zeros((1, cfg.n_head, 0, cfg.head_dim), np.float32)
    results = {"environment": system_info(), "variants": []}
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        info = workflows.export_model(model, source, tmp / "fp32", Precision.fp32)  # parity-gated, as `gpt2x export`
        fp32_ms, ref = decode_ms(info.model_path, feeds)
        results["variants"].append({"name": "fp32 (reference)", "decode_ms": fp32_ms, "max_rel": 0.0})
        from onnxruntime.quantization import QuantType, quantize_dynamic
        from onnxruntime.quantization.matmul_nbits_quantizer import MatMulNBitsQuantizer

        folded = onnx.load(str(read_export(tmp / "fp32").model_path))
        fold_transposed_initializers(folded)
        onnx.save(folded, str(tmp / "folded.onnx"))
        quantize_dynamic(str(tmp / "folded.onnx"), str(tmp / "dyn.onnx"), op_types_to_quantize=["MatMul"], per_channel=True,
                         weight_type=QuantType.QInt8, extra_options={"MatMulConstBOnly": True, "DefaultTensorType": onnx.TensorProto.FLOAT})
        variants = [("quantize_dynamic per-channel (MatMulInteger)", tmp / "dyn.onnx")]
        for block in (32, 64, 128):
            q = MatMulNBitsQuantizer(onnx.load(str(tmp / "folded.onnx")), bits=8, block_size=block, is_symmetric=True, accuracy_level=4)
            q.process()
            q.model.model.ir_version = IR_VERSION
            path = tmp / f"nbits{block}.onnx"
            onnx.save(q.model.model, str(path))
            variants.append((f"MatMulNBits 8-bit, block {block}, accuracy_level 4", path))
        for name, path in variants:
            ms, logits = decode_ms(path, feeds)
            results["variants"].append({"name": name, "decode_ms": ms,
                                        "max_rel": float(np.abs(logits - ref).max() / np.abs(ref).max())})
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=1) + "\n")
    for v in results["variants"]:
        print(f"{v['name']:50s} {v['decode_ms']:7.2f} ms/token   max rel logit error {v['max_rel']:.4f}")


if __name__ == "__main__":
    main()
