"""`gpt2x export`: the model to ONNX with a KV cache, fused, converted, and gated by parity."""

from __future__ import annotations

import json
from collections.abc import Callable
from enum import Enum
from pathlib import Path
from typing import Annotated, Optional

import typer

from ..choices import BackendKind, Precision
from ..errors import OutputError, UsageError
from ..fileio import folder_lock
from ..onnx.artifact import BATCHED_KEY, BF16, DEFAULT_OPSET, F32, KV_KEY, PAGED_KV_KEY, PREFILL_KEY, default_export_dir
from ..onnx.transformers_js import ALL_PRECISIONS, default_layout_dir
from ..workflows.exports import export_by_name, require_bf16_cpu
from ..workflows.models import adapted_name
from ..workflows.transformers_js import export_transformers_js
from .options import ExportsOpt, JsonOpt, ModelOpt, RevisionOpt, Status, notice, out, progress_to, read_chat_template


class PrefillCompute(str, Enum):
    f32 = F32
    bf16 = BF16


class Layout(str, Enum):
    gpt2x = "gpt2x"  # one export folder: model.onnx, gpt2x.json and the interop files
    transformers_js = "transformers.js"  # onnx/model{,_quantized,_q4}.onnx for @huggingface/transformers


EPILOG = ("Examples:\n\n"
    "  gpt2x export --model shakespeare\n\n"
    "  gpt2x export --model gpt2 --precision int8\n\n"
    "  gpt2x export --model ./my-gpt2 --precision fp16 --out my-fp16 --force\n\n"
    "  gpt2x export --model shakespeare --layout transformers.js\n\n"
    "  gpt2x export --model gpt2 --adapter ./my-lora --precision int8")


def export(
    model: ModelOpt = "shakespeare",
    revision: RevisionOpt = None,
    exports: ExportsOpt = None,
    precision: Annotated[Optional[Precision], typer.Option(
        help="fp32 (reference, the default), int8 or int4 (CPU: 8- or 4-bit weights, int8 activations; "
             "int4 keeps the unembedding at 8 bits), bf16 (fp32 weights computed in bf16 by the openvino backend, on a "
             "CPU with AVX-512 BF16 or AMX) or fp16 (CUDA). With --layout transformers.js: that one "
             "precision only (default: fp32, int8 and int4).")] = None,
    out_dir: Annotated[Optional[Path], typer.Option("--out", help="Output folder (default: EXPORTS/MODEL-PRECISION, see --exports; "
                                                    "with --layout transformers.js, EXPORTS/MODEL-transformers.js).")] = None,
    opset: Annotated[int, typer.Option(min=17, help="ONNX opset.")] = DEFAULT_OPSET,
    force: Annotated[bool, typer.Option(help="Replace an existing export (with --layout transformers.js: the "
                                             "transformers.js folder; the exports it copies are reused).")] = False,
    check_parity: Annotated[bool, typer.Option(help="Gate the export on parity with PyTorch (--no-check-parity to skip, at your own risk).")] = True,
    openvino_prefill: Annotated[Optional[bool], typer.Option(
        help="fp32, int8 and bf16: also write OpenVINO's prefill graph, gated and timed, which `ort` runs where it measured "
             "faster and `openvino` runs for a bf16 export's prompts (needs the openvino extra; default: int8 and bf16, or "
             "GPT2X_OPENVINO_PREFILL=0 or 1).")] = None,
    int8_kv: Annotated[Optional[bool], typer.Option(
        help="int8 and int4: also calibrate scales for an int8 KV cache, gated and timed, which `ort` holds where its "
             "decode steps measured faster (default: yes, or GPT2X_INT8_KV=0 or 1). fp32: only with --int8-kv, gated on "
             "its own (the weights and arithmetic stay fp32), and then held by default (--kv-cache-dtype float: not); with "
             "--openvino-prefill, OpenVINO's u8 cache on the paged slots, which `gpt2x serve` then runs, gated too.")] = None,
    prefill_compute: Annotated[PrefillCompute, typer.Option(
        help="int8: the compute precision of OpenVINO's prefill graph, gated at int8's tolerances: f32, or bf16 on a "
             "CPU that computes it (AVX-512 BF16, AMX), faster on long prompts there. Chosen here, never by a timing: "
             "every prefill then runs on OpenVINO, so a prompt gets the same numerics whole, chunked or after a "
             "cached prefix.")] = PrefillCompute.f32,
    chat_template: Annotated[Optional[str], typer.Option(
        "--chat-template", metavar="FILE|TEXT",
        help="A Jinja2 chat template, a file or the template's text, recorded in the export's tokenizer_config.json (where "
        "transformers, vLLM and gpt2x serve read it). Default: the bundled model's export carries gpt2x's default "
        "one, other exports none.", show_default=False)] = None,
    layout: Annotated[Layout, typer.Option(
        help="gpt2x: one export folder (model.onnx, gpt2x.json, interop files). transformers.js: a folder "
             "@huggingface/transformers loads (onnx/model.onnx, model_quantized.onnx, model_q4.onnx for dtype fp32, "
             "q8, q4), copied from the exports in EXPORTS/MODEL-PRECISION, exported first where missing.")] = Layout.gpt2x,
    adapter: Annotated[Optional[Path], typer.Option(
        metavar="FOLDER", show_default=False,
        help="A PEFT LoRA adapter folder (adapter_config.json, adapter_model.safetensors) merged into the model's "
             "weights by PEFT before the export, gated by parity against PEFT's merged model and the adapter applied "
             "at run time (needs the adapters extra). The export records base and adapter; default folder "
             "EXPORTS/MODEL+ADAPTER-PRECISION.")] = None,
    as_json: JsonOpt = False,
) -> None:
    """Export to ONNX with a KV cache, fuse, convert, and check parity against PyTorch."""
    if layout is Layout.transformers_js:
        if adapter is not None:
            raise UsageError("--adapter applies to --layout gpt2x: a transformers.js folder copies the exports made by "
                             "model name, which have no adapter")
        if opset != DEFAULT_OPSET or not check_parity or openvino_prefill is not None or int8_kv is not None or \
                prefill_compute is not PrefillCompute.f32 or chat_template is not None:
            raise UsageError("--opset, --no-check-parity, --[no-]openvino-prefill, --prefill-compute, --chat-template and "
                             "--[no-]int8-kv apply to --layout gpt2x; a "
                             "transformers.js folder copies parity-checked exports at the default opset")
        _export_transformers_js(model, revision, precision, out_dir, force, as_json)
        return
    precision = precision or Precision.fp32
    if precision is Precision.bf16:  # before anything else: a CPU without bf16 cannot gate, nor run, the export
        require_bf16_cpu("--precision bf16")
    folder = out_dir or default_export_dir(model if adapter is None else adapted_name(model, adapter), precision)
    template = None if chat_template is None else read_chat_template(chat_template)
    # Refused while another process writes the folder (two exports to one --out: the later would replace the
    # earlier unasked), and checked for an existing export once this one holds it.
    with folder_lock(folder, wait=False):
        if folder.exists() and not force:
            raise OutputError(f"{folder} exists; pass --force to replace it")
        with Status(f"loading {model}") as status:
            info = export_by_name(model, folder, precision, revision, opset, force, check_parity, progress_to(status),
                                  openvino_prefill, int8_kv, prefill_compute.value, template, adapter)
    meta = info.meta
    if as_json:
        print(json.dumps({"folder": str(folder), **meta}))
        return
    parity = meta["parity"]
    out.print(f"exported {meta['model']['name']} ({precision.value}) to {folder}", markup=False)
    merged = meta["model"].get("adapter")
    if merged is not None:
        out.print(_adapter_line(merged), markup=False)
    out.print("fused operators: " + ", ".join(f"{k} {v}" for k, v in meta["fused_operators"].items()))
    if parity.get("status") == "passed":
        lg = parity["logits"]
        where = parity["provider"] + _gated_on(parity)
        out.print(f"parity passed on {where}: max |Δlogit| {lg['max_abs']:.3g} "
                  f"({lg['max_rel']:.2g} of scale), mean KL {lg['mean_kl']:.2g}, top-1 agreement "
                  f"{lg['top1_agreement']:.3f}, {_greedy(parity)}")
    else:
        out.print(f"parity: {parity.get('status')} ({parity.get('reason', '')})", markup=False)
    batched = meta.get(BATCHED_KEY)
    if batched is not None:
        out.print(_graph_line("batched decode graph", batched, _batched_timings), markup=False)
    prefill = meta.get(PREFILL_KEY)
    if prefill is not None:
        out.print(_graph_line("OpenVINO prefill graph", prefill, _prefill_timings, presents=True), markup=False)
    kv = meta.get(KV_KEY)
    if kv is not None:
        out.print(_graph_line("int8 KV cache", kv, _kv_timings, presents=True), markup=False)
        if kv.get(PAGED_KV_KEY) is not None:
            out.print(_graph_line("OpenVINO's u8 KV cache on the paged slots", kv[PAGED_KV_KEY], _paged_kv_use,
                                  presents=True), markup=False)


def _gated_on(parity: dict) -> str:
    """The backend the gate ran on, where it is not the native one (bf16's: OpenVINO at bf16 compute)."""
    from ..runtime.registry import capabilities_of

    kind = parity.get("backend")
    return "" if kind is None or capabilities_of(BackendKind(kind)).native else f" ({kind} backend, {parity['precision']} compute)"


def _adapter_line(record: dict) -> str:
    """The merged adapter and its gate, in one line."""
    gate = record["parity"]
    return (f"LoRA adapter {record['path']} (r {record['r']}, lora_alpha {record['lora_alpha']}, {len(record['modules'])} "
            f"layers) merged into {record['base']}: parity passed against PEFT's merged model (max |Δlogit| "
            f"{gate['peft_merged']['max_rel']:.2g} of scale) and the adapter at run time "
            f"({gate['peft']['max_rel']:.2g}); it moves the base's logits by {gate['change']:.2g} of scale")


def _graph_line(title: str, record: dict, timed: Callable[[dict], str], presents: bool = False) -> str:
    """A graph kept beside model.onnx in one line: its gate and the timings that decide its use (`timed`); or why
    it was not kept."""
    if not record.get("kept"):
        return f"{title}: not kept ({record.get('reason', '')})"
    parity = record["parity"]
    lg = parity["logits"]
    extra = f", presents {lg['present_max_rel']:.2g}" if presents else ""
    return f"{title}: parity passed (max |Δlogit| {lg['max_rel']:.2g} of scale{extra}, {_greedy(parity)}); {timed(record)}"


def _greedy(parity: dict) -> str:
    """The greedy agreement with its gate: the share of greedy tokens equal to PyTorch's before the first that
    differs, which a lossy precision's near-ties end early (docs/export.md, parity gates)."""
    gate = (parity.get("tolerance") or {}).get("min_greedy")
    return f"greedy agreement {parity['greedy']['share']:.2f}" + ("" if gate is None else f" (gate {gate:g})")


def _batched_timings(record: dict) -> str:
    timing, start = record["timing"], record["batched_from"]
    times = ", ".join(f"{m} rows {b:.1f} against {a:.1f} ms" for m, b, a in
                      zip(timing["rows"], timing["batched_ms"], timing["model_ms"]))
    use = f"used from {start} rows x new tokens on" if start is not None else "not used (slower)"
    return f"a decode step, batched graph against model.onnx: {times}; {use}"


def _kv_timings(record: dict) -> str:
    timing, long = record["timing"], record["long"]
    times = ", ".join(f"on {p} positions {i:.2f} against {f:.2f} ms" for p, i, f in
                      zip(timing["pasts"], timing["int8_ms"], timing["float_ms"]))
    use = "used" if timing["use"] else "used (asked for: an fp32 export's)" if record["use"] else \
        f"not used (not {timing['faster_by']:.0%} faster on the longest)"
    return (f"after a {long['prompt']}-token prompt max |Δlogit| {long['max_rel']:.2g} of scale (float cache "
            f"{record['long_float']['max_rel']:.2g}); a decode step, int8 cache against float: {times}; {use}")


def _paged_kv_use(record: dict) -> str:
    long = record["long"]
    return f"after a {long['prompt']}-token prompt max |Δlogit| {long['max_rel']:.2g} of scale; `gpt2x serve` holds it"


def _prefill_timings(record: dict) -> str:
    timing = record["timing"]
    if "model_onnx_ms" in timing:  # a bf16 export's: both on the openvino backend (evaluate.prefill.gate_bf16_prefill)
        times = ", ".join(f"{n} tokens {g:.1f} against {m:.1f} ms" for n, g, m in
                          zip(timing["lengths"], timing["prefill_graph_ms"], timing["model_onnx_ms"]))
        return f"against model.onnx on OpenVINO at bf16, batch 1: {times}; used for every step of more than one token"
    said = f"OpenVINO against ONNX Runtime at batch 1: {_timed_lengths(timing)}"
    if timing.get("past"):
        said += f"; on a {timing['past']['past']}-token past: {_timed_lengths(timing['past'])}"
    return said


def _timed_lengths(timing: dict) -> str:
    times = ", ".join(f"{n} tokens {o:.1f} against {r:.1f} ms" for n, o, r in
                      zip(timing["lengths"], timing["openvino_ms"], timing["onnxruntime_ms"]))
    use = f"used from {timing['openvino_from']} tokens on" if timing["openvino_from"] is not None else "not used (slower)"
    return f"{times}; {use}"


def _export_transformers_js(model: str, revision: Optional[str], precision: Optional[Precision], out_dir: Optional[Path],
                            force: bool, as_json: bool) -> None:
    folder = out_dir or default_layout_dir(model)
    if folder.exists() and not force:
        raise OutputError(f"{folder} exists; pass --force to replace it")
    precisions = [precision] if precision is not None else list(ALL_PRECISIONS)
    with Status(f"loading {model}") as status:
        result = export_transformers_js(model, folder, precisions, revision, force, progress_to(status), notice)
    if as_json:
        # "contents": every file in the folder; the metadata's "files": sha256 of the top-level ones
        print(json.dumps({"folder": str(result.folder), "layout": Layout.transformers_js.value, "contents": result.files,
                          **result.meta}))
        return
    out.print(f"wrote {model} for transformers.js to {result.folder}", markup=False)
    for name, graph in result.meta["onnx"].items():
        out.print(f"  {name}  dtype {graph['dtype']}  (from {graph['source']})", markup=False)
    others = [f for f in result.files if f not in result.meta["onnx"]]
    out.print("  " + ", ".join(others), markup=False)
    out.print(f"load it with env.localModelPath = {str(result.folder.resolve().parent)!r}, "
              f"AutoModelForCausalLM.from_pretrained({result.folder.name!r}, {{dtype: ...}})", markup=False)
