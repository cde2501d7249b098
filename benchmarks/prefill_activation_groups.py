"""The int8 OpenVINO prefill graph at several activation group sizes (OpenVINO's DYNAMIC_QUANTIZATION_GROUP_SIZE:
activations quantized to int8 as it runs, one scale per group; 0 = none, 32 = OpenVINO's default; the export's graph
says onnx/openvino_prefill.ACTIVATION_GROUP): batch-1 prefill time, in interleaved rounds in one process, and the
last position's logits against PyTorch's, for the export's model and for the same model with outlier channels
planted like GPT-2's (three residual channels far larger than the rest), converted as the export converts.

    python benchmarks/prefill_activation_groups.py --export EXPORTS/random-gpt2-int8 \\
        --out benchmarks/results/prefill-activation-groups-cpu-2core-gpt2-124m
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import openvino as ov
import torch

from gpt2x.bench.report import save_results
from gpt2x.bench.system import system_info
from gpt2x.choices import Precision
from gpt2x.model.weights import load_model
from gpt2x.onnx import openvino_prefill
from gpt2x.onnx.artifact import PREFILL_XML, read_export

OUTLIERS = (138, 378, 447)  # GPT-2's own outlier channels; the planted sizes are this script's, not GPT-2's


def _compile(core, xml: Path, group: str, threads: int):
    # The runtime's config (runtime/openvino_prefill.py at f32), with the group given over the graph's own.
    return core.compile_model(core.read_model(str(xml)), "CPU", {
        "INFERENCE_NUM_THREADS": threads, "INFERENCE_PRECISION_HINT": "f32", "PERFORMANCE_HINT": "LATENCY",
        "ENABLE_CPU_PINNING": False, "DYNAMIC_QUANTIZATION_GROUP_SIZE": group}).create_infer_request()


def _feeds(batch: int, n: int, vocab: int) -> dict:
    ids = np.random.default_rng(n).integers(0, vocab, (batch, n))
    return {"input_ids": ids, "attention_mask": np.ones((batch, n), np.int64),
            "position_ids": np.arange(n, dtype=np.int64)[None].repeat(batch, 0)}


def _errors(core, model, xml: Path, groups: list[str], lengths: list[int], threads: int) -> dict:
    """Max |logit - PyTorch's| over the largest |PyTorch logit|, last position, a batch of 2 random prompts."""
    out = {}
    for n in lengths:
        feeds = _feeds(2, n, model.config.vocab_size)
        with torch.no_grad():
            ref = model(*(torch.from_numpy(feeds[k]) for k in ("input_ids", "attention_mask", "position_ids")), None,
                        logits_to_keep=1)[0][:, -1].numpy()
        for g in groups:
            request = _compile(core, xml, g, threads)
            request.infer(feeds)
            logits = request.get_tensor("logits").data[:, -1]
            out.setdefault(g, []).append(float(np.abs(logits - ref).max() / np.abs(ref).max()))
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--export", type=Path, required=True, help="an int8 export holding the prefill graph")
    ap.add_argument("--groups", default="0,32,64,128,256,768")
    ap.add_argument("--prompt-len", default="32,512")
    ap.add_argument("--repeat", type=int, default=9)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", type=Path, required=True, help="output path without extension")
    args = ap.parse_args()
    groups, lengths = args.groups.split(","), [int(n) for n in args.prompt_len.split(",")]
    info = read_export(args.export)
    xml, core = info.folder / PREFILL_XML, ov.Core()
    requests = {g: _compile(core, xml, g, args.threads) for g in groups}
    times: dict[str, dict[int, list[float]]] = {g: {n: [] for n in lengths} for g in groups}
    for n in lengths:
        feeds = _feeds(1, n, info.config.vocab_size)
        for r in requests.values():
            r.infer(feeds)
        for i in range(args.repeat):  # alternating order, so drift falls on every group alike
            for g in groups if i % 2 == 0 else groups[::-1]:
                t = time.perf_counter()
                requests[g].infer(feeds)
                times[g][n].append((time.perf_counter() - t) * 1e3)
    del requests
    model = load_model(info.meta["model"]["name"])[0].float().eval()
    errors = {"export": _errors(core, model, xml, groups, lengths, args.threads)}
    with torch.no_grad():
        for ch in OUTLIERS:
            model.wpe.weight[:, ch] += 30.0
            for block in model.h:
                block.ln_1.weight[ch] = block.ln_2.weight[ch] = 8.0
    with tempfile.TemporaryDirectory() as tmp:
        openvino_prefill.convert_prefill(model, Path(tmp), Precision.int8)
        errors["outliers"] = _errors(core, model, Path(tmp) / PREFILL_XML, groups, lengths, args.threads)
    medians = {g: {n: statistics.median(v) for n, v in t.items()} for g, t in times.items()}
    env = system_info()
    head = " | ".join(f"{n} tokens: ms (vs 32)" for n in lengths)
    rows = []
    for g in groups:
        cells = " | ".join(f"{medians[g][n]:.1f} ({medians[g][n] / medians['32'][n] - 1:+.0%})" if "32" in medians
                           else f"{medians[g][n]:.1f}" for n in lengths)
        err = " | ".join(" / ".join(f"{e:.3f}" for e in errors[k][g]) for k in ("export", "outliers"))
        rows.append(f"| {g}{' (export)' if g == str(openvino_prefill.ACTIVATION_GROUP) else ''} | {cells} | {err} |")
    md = (f"int8 OpenVINO prefill of {args.export.name} by activation group size (DYNAMIC_QUANTIZATION_GROUP_SIZE): batch 1, "
          f"f32 compute, {args.threads} threads, median of {args.repeat} interleaved runs; logits' max error over their "
          f"scale against PyTorch at {' / '.join(map(str, lengths))} tokens (batch 2), for the export's model and with "
          f"outlier channels {OUTLIERS} planted.\nMachine: {env.get('cpu', 'n/a')}, {env.get('platform', '')}; git "
          f"{env.get('git')}.\n\n| group | {head} | error, export's model | error, outliers planted |\n"
          f"| --- |{' ---: |' * len(lengths)} ---: | ---: |\n" + "\n".join(rows) + "\n")
    save_results(args.out, {"environment": env, "export": str(args.export), "groups": groups, "lengths": lengths,
                            "times_ms": times, "median_ms": medians, "max_rel_error": errors}, md)
    print(md)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
