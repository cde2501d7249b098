"""ONNX Runtime's own GPT-2 tool (`onnxruntime.transformers.models.gpt2.convert_to_onnx`, fused
`Attention` with a combined past_i cache), fp32 and int8, each graph in the same hand loop as
Optimum's (batch 1), when it runs with the installed transformers and torch; otherwise its error
and the reason are recorded (results["ort_gpt2_tool"]), with what the tool's own steps give under
Optimum's tracing patches (benchmarks/ort_gpt2_tool_probe.py, in its own process)."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
from pathlib import Path

from gpt2x.choices import Precision

from .core import Context, log
from .optimum import HandLoop

KEY = "ort-gpt2-tool"
ORDER = 20
LABEL = "ORT GPT-2 tool (fp32, int8)"
ORT_TOOL = "onnxruntime.transformers.models.gpt2.convert_to_onnx"
PROBE = Path(__file__).resolve().parent.parent / "ort_gpt2_tool_probe.py"


def tool_failure(stderr: str) -> dict:
    """The exception line of a failed run of the tool, where it failed, and why (when known)."""
    lines = [ln for ln in stderr.strip().splitlines() if ln.strip()]
    errors = [ln for ln in lines if re.match(r"^[\w.]+(Error|Exception)\b", ln)]
    frames = re.findall(r'File "[^"]*/site-packages/((?:onnxruntime|transformers)/[^"]+)", line (\d+), in (\w+)', stderr)
    ort_frames = [f for f in frames if f[0].startswith("onnxruntime/")][-1:]
    hf_frames = [f for f in frames if f[0].startswith("transformers/")][-3:]
    failure = {"error": errors[-1] if errors else (lines[-1] if lines else "no output"),
               "frames": [f"{path}:{line} {fn}" for path, line, fn in ort_frames + hf_frames]}
    if "masking_utils" in stderr and "vmap" in stderr:
        failure["reason"] = (
            "the tool exports with the TorchScript tracer (torch.onnx.export(..., dynamo=False), "
            "onnxruntime/transformers/torch_onnx_export_helper.py), which cannot trace the causal mask that "
            "transformers >= 4.53 builds with torch.vmap (transformers/masking_utils.py, sdpa_mask_recent_torch)")
    return failure


def ort_gpt2_tool(hf_dir: Path, work: Path, threads: int) -> tuple[list, dict]:
    """Convert with ONNX Runtime's GPT-2 tool exactly as a user would (fp32 and int8), and a hand
    loop on each graph it writes; or, where it fails, the failure, and what the tool's own steps
    give with Optimum's tracing patches (benchmarks/ort_gpt2_tool_probe.py, in its own process)."""
    import onnx

    contenders, record = [], {"command": f"python -m {ORT_TOOL} -m HF_FOLDER --output OUT.onnx -o -p PRECISION"}
    work.mkdir(parents=True, exist_ok=True)
    for precision in (Precision.fp32, Precision.int8):
        out = work / f"gpt2_{precision.value}.onnx"
        cmd = [sys.executable, "-m", ORT_TOOL, "-m", str(hf_dir), "--output", str(out), "-o", "-p", precision.value,
               "--cache_dir", str(work / "cache"), "-t", "1", "-r", "1"]  # the smallest parity test it allows
        log(f"ONNX Runtime's GPT-2 tool, {precision.value}")
        t0 = time.perf_counter()
        proc = subprocess.run(cmd, capture_output=True, text=True, cwd=work)  # its csv goes to cwd
        entry: dict = {"returncode": proc.returncode, "seconds": time.perf_counter() - t0}
        record[precision.value] = entry
        if proc.returncode != 0 or not out.is_file():
            entry |= tool_failure(proc.stderr)
            log(f"  failed: {entry['error']}")
            break
        ops: dict[str, int] = {}
        for node in onnx.load(str(out), load_external_data=False).graph.node:
            ops[node.op_type] = ops.get(node.op_type, 0) + 1
        entry["fused_operators"] = {k: ops.get(k, 0) for k in ("Attention", "MultiHeadAttention", "SkipLayerNormalization",
                                                                  "FastGelu", "MatMulInteger", "DynamicQuantizeMatMul")}
        entry["inputs"] = [i.name for i in onnx.load(str(out), load_external_data=False).graph.input][:4]
        try:
            contenders.append(HandLoop(f"ORT GPT-2 tool {precision.value}, hand loop", precision, out, threads))
        except ValueError as e:  # a graph whose cache names the loop cannot pair
            entry["error"] = str(e)
            break
    if not contenders:
        log("  probing the tool's own steps with Optimum's tracing patches (benchmarks/ort_gpt2_tool_probe.py)")
        probe = subprocess.run([sys.executable, str(PROBE), str(hf_dir), str(work / "probe")], capture_output=True, text=True)
        try:
            record["probe_with_optimum_patches"] = json.loads(probe.stdout.strip().splitlines()[-1])
        except (json.JSONDecodeError, IndexError):
            record["probe_with_optimum_patches"] = {"returncode": probe.returncode, **tool_failure(probe.stderr)}
        record["skipped"] = skip_reason(record)
        log(f"  skipped: {record['skipped']}")
    return contenders, record


def skip_reason(record: dict) -> str:
    fp32 = record.get("fp32", {})
    reason = f"`{ORT_TOOL}` fails: {fp32.get('error', 'unknown error')}"
    if fp32.get("reason"):
        reason += f" ({fp32['reason']})"
    variants = record.get("probe_with_optimum_patches", {}).get("variants", [])
    if variants:
        found = "; ".join(
            f"{v['attn_implementation']} attention, opset {v['opset']}: "
            + (f"Attention fused {v.get('fused_operators', {}).get('Attention', 0)}x" if "fused_operators" in v
               else v.get("error", "not exported"))
            for v in variants)
        reason += (f". With Optimum's tracing patches the tool's own export and optimizer run, but fuse no "
                   f"Attention from this transformers' GPT-2 graph ({found}), so its fused graph cannot be made here"
                   if all(v.get("fused_operators", {}).get("Attention", 0) == 0 for v in variants)
                   else f". With Optimum's tracing patches: {found}")
    return reason


def load(ctx: Context) -> list:
    contenders, record = ort_gpt2_tool(ctx.hf_dir, ctx.work / "ort-gpt2", ctx.threads)
    ctx.results["ort_gpt2_tool"] = record
    if not contenders:
        ctx.results["skipped"][LABEL] = record["skipped"]
    for precision in ("fp32", "int8"):
        failed = record.get(precision, {})
        if contenders and "error" in failed:
            ctx.results["skipped"][f"ORT GPT-2 tool {precision}"] = f"{failed['error']} {failed.get('reason', '')}".strip()
    return contenders
