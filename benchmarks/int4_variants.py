"""Which int4 graph keeps quality best: ONNX Runtime's MatMulNBits quantizer at 4 bits with each of its
calibration-free algorithms (round-to-nearest symmetric and asymmetric, HQQ, k-quant), blocks of 32,
64 and 128 weights, and the tied unembedding at 8 or 4 bits; int8 beside them for reference.

    python benchmarks/int4_variants.py --out benchmarks/results/int4-variants-cpu-2core.json

Quality only, no timings. For the bundled `shakespeare` model and the GPT-2 124M architecture with
random weights (`random:gpt2`), each variant is measured against the PyTorch fp32 model with the
export's parity check (`gpt2x.evaluate.parity.check`: mean KL, max relative logit error and top-1
agreement on random shapes, greedy agreement over 3 prompts x 32 tokens) and on the held-out
Shakespeare text: perplexity change, mean KL and top-1 agreement over its ~1,800 positions (on
random weights the perplexity itself means nothing; the KL still does). Every variant is made from
the same parity-gated fp32 export by the library's own `quantize_int4` / `quantize_int8`; the
chosen default is then exported end to end with `gpt2x.workflows.export_model` (so through its gate).
Two deliberately broken int4 graphs (every 4-bit scale 30% off; each byte's two 4-bit weights
swapped, as tests/test_int4.py breaks them) show where the gate must fail. `summary` ranks the
variants by the geometric mean of their four KLs (random shapes and held-out text, both models).
"""

from __future__ import annotations

import argparse
import gc
import json
import logging
import tempfile
import time
from dataclasses import asdict
from pathlib import Path

import numpy as np
import onnx
from onnx import numpy_helper

from gpt2x import workflows
from gpt2x.bench.system import system_info
from gpt2x.choices import Precision
from gpt2x.errors import ParityError
from gpt2x.evaluate.metrics import heldout_text, kl_divergence, perplexity
from gpt2x.evaluate.parity import GREEDY_TOKENS, TOLERANCES, check
from gpt2x.generation.generate import generate
from gpt2x.generation.settings import SamplingSettings
from gpt2x.numerics import positions
from gpt2x.onnx import optimize
from gpt2x.onnx.artifact import ExportInfo, attention_layout
from gpt2x.runtime.ort import OrtBackend
from gpt2x.runtime.pytorch import TorchBackend
from gpt2x.tokenizer import encode

ALGORITHMS = optimize.INT4_ALGORITHMS
BLOCKS = (32, 64, 128)


def variants() -> list[dict]:
    """int8, then every int4 algorithm x block with the unembedding at 8 bits, then each algorithm with
    the unembedding at 4 bits too (block 32), then the broken graph."""
    out = [{"name": "int8 (reference: block 128, symmetric, unembedding int8)", "precision": "int8"}]
    for algorithm in ALGORITHMS:
        for block in BLOCKS:
            out.append({"name": f"int4 {algorithm}, block {block}, unembedding int8", "precision": "int4",
                        "algorithm": algorithm, "block_size": block, "head_bits": 8})
    for algorithm in ALGORITHMS:
        out.append({"name": f"int4 {algorithm}, block 32, unembedding int4", "precision": "int4",
                    "algorithm": algorithm, "block_size": 32, "head_bits": 4})
    # HQQ's float zero points make ONNX Runtime's CPU kernel skip its packed int8-activation path
    # (MatMulNBits::PrePack returns early on unquantized zero points, and Compute then dequantizes B
    # and runs a float GEMM): HQQ is measured with fp32 activations. This control gives RTN the same.
    out.append({"name": "int4 rtn-sym, block 32, unembedding int8, 4-bit MatMuls in fp32 (HQQ control)",
                "precision": "int4", "algorithm": "rtn-sym", "block_size": 32, "head_bits": 8, "fp32_compute": True})
    default = {"precision": "int4", "algorithm": optimize.INT4_ALGORITHM, "block_size": optimize.INT4_BLOCK,
               "head_bits": optimize.INT4_HEAD_BITS}
    out.append({"name": "broken: default with every 4-bit scale x1.3", **default, "broken": "scales x1.3"})
    out.append({"name": "broken: default with the 4-bit nibbles swapped", **default, "broken": "nibbles swapped"})
    return out


def four_bit_nodes(proto: onnx.ModelProto) -> list[onnx.NodeProto]:
    return [n for n in proto.graph.node if n.op_type == "MatMulNBits" and any(a.name == "bits" and a.i == 4 for a in n.attribute)]


def break_weights(path: Path, how: str) -> None:
    """What a quantizer bug would do: every 4-bit scale 30% off, or each byte's two 4-bit weights swapped."""
    proto = onnx.load(str(path))
    nodes = four_bit_nodes(proto)
    target = {n.input[2] for n in nodes} if how == "scales x1.3" else {n.input[1] for n in nodes}
    for init in proto.graph.initializer:
        if init.name in target:
            a = numpy_helper.to_array(init)
            a = a * np.float32(1.3) if how == "scales x1.3" else ((a >> 4) | (a << 4)).astype(np.uint8)
            init.CopyFrom(numpy_helper.from_array(a, init.name))
    onnx.save(proto, str(path))


def compute_in_fp32(path: Path) -> None:
    """accuracy_level 1 (fp32 activations) on the 4-bit MatMulNBits."""
    proto = onnx.load(str(path))
    for node in four_bit_nodes(proto):
        for a in node.attribute:
            if a.name == "accuracy_level":
                a.i = 1
    onnx.save(proto, str(path))


def quantized_bytes(path: Path) -> int:
    """Bytes of the MatMulNBits weights, scales and zero points (what a decode step reads)."""
    proto = onnx.load(str(path))
    names = {i for n in proto.graph.node if n.op_type == "MatMulNBits" for i in n.input[1:]}
    return sum(numpy_helper.to_array(t).nbytes for t in proto.graph.initializer if t.name in names)


def make_variant(v: dict, fused: Path, folder: Path, fp32_meta: dict) -> ExportInfo:
    folder.mkdir()
    path = folder / "model.onnx"
    if v["precision"] == "int8":
        ops = optimize.quantize_int8(fused, path)
    else:
        ops = optimize.quantize_int4(fused, path, v["algorithm"], v["block_size"], v["head_bits"])
    if v.get("broken"):
        break_weights(path, v["broken"])
    if v.get("fp32_compute"):
        compute_in_fp32(path)
    return ExportInfo(folder, {**fp32_meta, "precision": v["precision"], "fused_operators": ops,
                               "attention": attention_layout(ops)})


def text_logits(backend, ids: list[int], window: int) -> tuple[float, np.ndarray]:
    """Perplexity on `ids` (as the bench measures it) and the logits of every position."""
    chunks = []

    def run(x: np.ndarray) -> np.ndarray:
        mask = np.ones_like(x)
        logits = backend.run(x, mask, positions(mask, x.shape[1]), None)[0]
        chunks.append(logits[0])
        return logits

    ppl = perplexity(run, ids, window)
    return ppl, np.concatenate(chunks)


HELDOUT_PROMPTS = 16  # greedy continuations of 8-token prompts spread over the held-out text
PROMPT_TOKENS = 8


def heldout_greedy(reference_tokens: list[list[int]], backend, prompt_ids: list[list[int]]) -> dict:
    """Mean identical greedy prefix (out of GREEDY_TOKENS) over the held-out prompts."""
    got = generate(backend, [""] * len(prompt_ids), SamplingSettings(max_new_tokens=GREEDY_TOKENS, greedy=True),
                   prompt_ids=prompt_ids)
    prefixes = []
    for a, g in zip(reference_tokens, got):
        b = g.tokens
        k = 0
        while k < min(len(a), len(b)) and a[k] == b[k]:
            k += 1
        prefixes.append(GREEDY_TOKENS if a == b else k)
    return {"prompts": len(prompt_ids), "tokens": GREEDY_TOKENS, "identical_prefix": prefixes,
            "share": float(np.mean(prefixes) / GREEDY_TOKENS), "all_identical": sum(p == GREEDY_TOKENS for p in prefixes)}


def measure_model(name: str, tmp: Path, log) -> dict:
    model, source = workflows.load_model(name)
    cfg = model.config
    fp32 = workflows.export_model(model, source, tmp / "fp32", Precision.fp32)  # parity-gated, as `gpt2x export`
    reference = TorchBackend(model, model_name=source.name)
    ids = encode(heldout_text())
    window = min(cfg.n_positions, 256)
    ref_ppl, ref_logits = text_logits(reference, ids, window)
    step = (len(ids) - PROMPT_TOKENS) // HELDOUT_PROMPTS
    prompt_ids = [ids[i * step : i * step + PROMPT_TOKENS] for i in range(HELDOUT_PROMPTS)]
    settings = SamplingSettings(max_new_tokens=GREEDY_TOKENS, greedy=True)
    ref_greedy = [g.tokens for g in generate(reference, [""] * HELDOUT_PROMPTS, settings, prompt_ids=prompt_ids)]
    result = {"model": name, "config": cfg.to_dict(), "text_tokens": len(ids), "reference_perplexity": ref_ppl,
              "variants": []}

    def record(v: dict, info: ExportInfo) -> None:
        backend = OrtBackend(info)
        parity = check(reference, backend, Precision(v["precision"]))
        ppl, logits = text_logits(backend, ids, window)
        wide = heldout_greedy(ref_greedy, backend, prompt_ids)
        row = {**v, "quantized_weight_bytes": quantized_bytes(info.model_path),
               "fused_operators": info.meta["fused_operators"],
               "gate": parity["status"], "gate_message": parity["message"],
               "random_shapes": {k: parity["logits"][k] for k in ("mean_kl", "max_rel", "top1_agreement", "positions")},
               "greedy": parity["greedy"], "greedy_heldout_prompts": wide,
               "heldout": {"perplexity": ppl, "perplexity_rel_change": ppl / ref_ppl - 1,
                           "mean_kl": float(kl_divergence(ref_logits, logits).mean()),
                           "top1_agreement": float((ref_logits.argmax(-1) == logits.argmax(-1)).mean())}}
        result["variants"].append(row)
        log(f"{name:14s} {v['name']:60s} KL {row['random_shapes']['mean_kl']:.2e} / held-out {row['heldout']['mean_kl']:.2e}"
            f"  greedy {parity['greedy']['share']:.2f} {parity['greedy']['identical_prefix']} / held-out {wide['share']:.2f}"
            f"  ppl {row['heldout']['perplexity_rel_change']:+.2%}  top-1 {row['random_shapes']['top1_agreement']:.3f}"
            f"/{row['heldout']['top1_agreement']:.3f}  {parity['status']}")

    for i, v in enumerate(variants()):
        t0 = time.perf_counter()
        try:
            info = make_variant(v, fp32.model_path, tmp / f"v{i}", fp32.meta)
        except Exception as e:  # a quantizer that cannot handle this shape: recorded, not measured
            result["variants"].append({**v, "error": f"{type(e).__name__}: {e}"})
            log(f"{name:14s} {v['name']:60s} quantizer failed: {type(e).__name__}: {e}")
            continue
        v = {**v, "quantize_s": round(time.perf_counter() - t0, 1)}  # one-off cost, not a speed figure
        record(v, info)
        gc.collect()
    # The default, end to end: trace, fuse, quantize_int4 with its defaults, gate.
    row = {"name": "int4 as exported by gpt2x (defaults, through its gate)", "precision": "int4",
           "algorithm": optimize.INT4_ALGORITHM, "block_size": optimize.INT4_BLOCK, "head_bits": optimize.INT4_HEAD_BITS}
    try:
        info = workflows.export_model(model, source, tmp / "int4", Precision.int4)
    except ParityError as e:
        result["variants"].append({**row, "export_parity": "failed", "error": str(e)})
        log(f"{name:14s} {row['name']:60s} {e}")
    else:
        record({**row, "export_parity": info.meta["parity"]["status"]}, info)
    return result


def summarize(models: list[dict]) -> list[dict]:
    """Per variant over both models: the geometric mean of its four KLs (random shapes and held-out
    text, each model), the selection criterion; the greedy shares and the bundled model's perplexity."""
    rows = []
    for name in [v["name"] for v in models[0]["variants"]]:
        found = [next((v for v in m["variants"] if v["name"] == name), None) for m in models]
        if any(v is None or "error" in v for v in found):
            rows.append({"name": name, "measured": False})
            continue
        kls = [x for v in found for x in (v["random_shapes"]["mean_kl"], v["heldout"]["mean_kl"])]
        rows.append({"name": name, "measured": True, "kl_geomean": float(np.exp(np.mean(np.log(kls)))),
                     **{f"{m['model']}": {"mean_kl": v["random_shapes"]["mean_kl"], "heldout_kl": v["heldout"]["mean_kl"],
                                          "max_rel": v["random_shapes"]["max_rel"], "greedy": v["greedy"]["share"],
                                          "greedy_heldout_prompts": v["greedy_heldout_prompts"]["share"],
                                          "perplexity_rel_change": v["heldout"]["perplexity_rel_change"], "gate": v["gate"]}
                        for m, v in zip(models, found)}})
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--models", nargs="+", default=["shakespeare", "random:gpt2"])
    args = ap.parse_args()
    # before ONNX Runtime's quantizer is imported: it calls logging.basicConfig(level=INFO) otherwise
    logging.basicConfig(level=logging.WARNING)
    results = {"environment": system_info(), "tolerances": {p.value: asdict(t) for p, t in TOLERANCES.items()},
               "defaults": {"algorithm": optimize.INT4_ALGORITHM, "block_size": optimize.INT4_BLOCK,
                            "head_bits": optimize.INT4_HEAD_BITS},
               "models": []}
    for name in args.models:
        with tempfile.TemporaryDirectory() as tmp:
            results["models"].append(measure_model(name, Path(tmp), lambda s: print(s, flush=True)))
        results["summary"] = summarize(results["models"])
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(results, indent=1) + "\n")


if __name__ == "__main__":
    main()
