"""Which graph decodes fastest inside the page: the web backend's own step time (onnxruntime-web's
WebAssembly build in headless Chromium, measured inside the page) and native ONNX Runtime's, for
gpt2x's fp32, int8 and int4 exports and for an int8 graph the export does not make, ONNX Runtime's
`quantize_dynamic` (per-channel MatMulInteger, the form of transformers.js's own q8 models).

    python benchmarks/web_variants.py --out benchmarks/results/web-variants-cpu-2core

GPT-2 124M architecture with random weights (`random:gpt2`; exported first where missing), batch 1,
a 32-token prompt, then greedy decode steps: the median of --steps steps after 8 warm-up steps, one
variant at a time, the page and native in turn. Writes OUT.json and OUT.md.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import onnx
from onnxruntime.quantization import QuantType, quantize_dynamic

from gpt2x import workflows
from gpt2x.bench.system import system_info
from gpt2x.choices import Precision
from gpt2x.numerics import positions
from gpt2x.onnx.artifact import IR_VERSION, ExportInfo
from gpt2x.onnx.optimize import count_ops, fold_transposed_initializers
from gpt2x.runtime.ort import OrtBackend
from gpt2x.runtime.web import WebBackend, ort_web_version

WARMUP = 8


def dynamic_int8(fp32: ExportInfo, folder: Path) -> ExportInfo:
    """The fp32 export with every constant-weight MatMul quantized by quantize_dynamic (per channel,
    int8 weights, uint8 activations quantized per call): MatMulInteger."""
    shutil.copytree(fp32.folder, folder)
    proto = onnx.load(str(fp32.model_path))
    fold_transposed_initializers(proto)  # the tied unembedding as a constant weight
    onnx.save(proto, str(folder / "folded.onnx"))
    quantize_dynamic(str(folder / "folded.onnx"), str(folder / "model.onnx"), op_types_to_quantize=["MatMul"], per_channel=True,
                     weight_type=QuantType.QInt8, extra_options={"MatMulConstBOnly": True, "DefaultTensorType": onnx.TensorProto.FLOAT})
    (folder / "folded.onnx").unlink()
    proto = onnx.load(str(folder / "model.onnx"))
    proto.ir_version = IR_VERSION
    onnx.save(proto, str(folder / "model.onnx"))
    return ExportInfo(folder, {**fp32.meta, "fused_operators": count_ops(proto)})


def step_times(backend, steps: int) -> tuple[list[float], list[float], list[int]]:
    """Seconds per greedy decode step seen by the caller, the page's own ms where the backend has
    them, and the tokens."""
    ids = np.random.default_rng(0).integers(0, backend.vocab_size, (1, 32), dtype=np.int64)
    mask = np.ones_like(ids)
    logits, past = backend.step(ids, mask, positions(mask, 32), None)
    token = logits.argmax(-1)
    seconds, page, tokens = [], [], []
    for i in range(WARMUP + steps):
        mask = np.ones((1, 33 + i), dtype=np.int64)
        t0 = time.perf_counter()
        logits, past = backend.step(token[:, None], mask, positions(mask, 1), past)
        if i >= WARMUP:
            seconds.append(time.perf_counter() - t0)
            if hasattr(backend, "page_ms"):
                page.append(backend.page_ms[-1])
        token = logits.argmax(-1)
        tokens.append(int(token[0]))
    return seconds, page, tokens


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--model", default="random:gpt2")
    ap.add_argument("--steps", type=int, default=32)
    args = ap.parse_args()
    exports = {p: workflows.ensure_export(args.model, p) for p in (Precision.fp32, Precision.int8, Precision.int4)}
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        variants = [("fp32 (gpt2x export)", exports[Precision.fp32]),
                    ("int8 MatMulNBits (gpt2x export)", exports[Precision.int8]),
                    ("int4 MatMulNBits (gpt2x export)", exports[Precision.int4]),
                    ("int8 quantize_dynamic per-channel (MatMulInteger)", dynamic_int8(exports[Precision.fp32], Path(tmp) / "dyn"))]
        for name, info in variants:
            page = WebBackend(info)
            web_s, web_page_ms, web_tokens = step_times(page, args.steps)
            threads = page.page_info["threads"]
            page.close()
            native_s, _, native_tokens = step_times(OrtBackend(info, in_place_kv=False), args.steps)
            row = {"variant": name, "operators": info.meta["fused_operators"], "page_threads": threads,
                   "page_step_ms": statistics.median(web_page_ms), "web_step_ms_from_python": statistics.median(web_s) * 1e3,
                   "native_step_ms": statistics.median(native_s) * 1e3, "same_greedy_tokens": web_tokens == native_tokens}
            row["page_share_of_native"] = row["native_step_ms"] / row["page_step_ms"]
            rows.append(row)
            print(f"{name}: page {row['page_step_ms']:.2f} ms, from Python {row['web_step_ms_from_python']:.2f} ms, "
                  f"native {row['native_step_ms']:.2f} ms")
    fp32_page = rows[0]["page_step_ms"]
    for row in rows:
        row["page_speed_vs_page_fp32"] = fp32_page / row["page_step_ms"]
    result = {"environment": system_info(), "model": args.model, "steps": args.steps, "warmup": WARMUP,
              "onnxruntime_web": ort_web_version(),
              "rows": rows}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".json").write_text(json.dumps(result, indent=1) + "\n")
    env = result["environment"]
    lines = [f"{args.model}, batch 1, greedy decode steps after a 32-token prompt, median of {args.steps} after {WARMUP} warm-up; "
             f"onnxruntime-web {result['onnxruntime_web']} (WebAssembly, {rows[0]['page_threads']} threads) in headless Chromium "
             f"against native onnxruntime {env['packages'].get('onnxruntime-gpu') or env['packages'].get('onnxruntime')}, "
             f"{env['cpu']}, {env['cores']} cores, {env['date']}, git {env['git']}.", "",
             "| graph | page ms/step | from Python ms/step | native ms/step | page / native speed | page speed vs page fp32 | same greedy tokens |",
             "| --- | ---: | ---: | ---: | ---: | ---: | --- |"]
    for r in rows:
        lines.append(f"| {r['variant']} | {r['page_step_ms']:.2f} | {r['web_step_ms_from_python']:.2f} | {r['native_step_ms']:.2f} | "
                     f"{r['page_share_of_native']:.2f} | {r['page_speed_vs_page_fp32']:.2f} | {'yes' if r['same_greedy_tokens'] else 'no'} |")
    args.out.with_suffix(".md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
