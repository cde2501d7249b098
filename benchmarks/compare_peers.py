"""gpt2x beside the peers a user would otherwise pick, in one process, on the same weights.

    python benchmarks/compare_peers.py --batch 1,4 --out benchmarks/results/cpu-2core
        [--prompt-len 32,512] [--precisions fp32,int8,int4] [--gpt2x-backends torch,ort,openvino,genai]
        [--contenders optimum,ort-gpt2-tool,gpt2x,genai,llama.cpp,openvino-genai,ctranslate2]

Runs GPT-2 124M (architecture of `gpt2`, seeded random weights saved in Hugging Face layout so that
every library loads or converts the very same tensors), a prompt of --prompt-len random tokens (each
length in the list its own measurement), --new-tokens greedy tokens that EOS does not cut short, and
times for each prompt length and batch size (one module per peer in benchmarks/peers/):

- transformers' `GPT2LMHeadModel.generate` (PyTorch eager): the reference the ratios divide by
  (peers/transformers_hf.py);
- Optimum's `ORTModelForCausalLM.generate` (its own ONNX export, ONNX Runtime CPU) when importable,
  and Optimum's export in a hand loop: the very model.onnx Optimum exported, run by a minimal greedy
  loop on onnxruntime directly, presents fed back as past (batch 1) (peers/optimum.py);
- ONNX Runtime's own GPT-2 tool (`onnxruntime.transformers.models.gpt2.convert_to_onnx`, fused
  `Attention` with a combined past_i cache), fp32 and int8, in the same hand loop (batch 1), when it
  runs with the installed transformers and torch; otherwise its error and the reason are recorded
  (peers/ort_gpt2_tool.py);
- gpt2x, every contender opened through gpt2x.workflows as a user's would be (ensure_export into
  --exports, parity-gated when made, then export_backend; torch_backend for PyTorch), through the
  shared decode loop and sampler: PyTorch fp32, and ONNX Runtime, OpenVINO and onnxruntime-genai
  (gpt2x's step-by-step backend) at each of --precisions (fp32, int8, int4 by default); where the ONNX Runtime
  backend takes an OpenVINO prefill, the same export with ONNX Runtime's prefill, and a second backend warmed up as
  `gpt2x serve` opens it ("warmed up": every graph run once, bf16 prefills on folded weights), in the same rounds.
  --gpt2x-backends and --precisions narrow the run (peers/gpt2x.py);
- onnxruntime-genai running gpt2x's exports, one per --precisions (same graphs, genai's own C++ loop
  choosing the tokens; batch 1) when importable (peers/genai.py);
- llama.cpp through llama-cpp-python: the folder converted by llama.cpp's convert_hf_to_gguf.py to
  GGUF f32, quantized by llama.cpp's quantizer to q8_0, q4_0 and q4_K_M (fp32, int8, int4, int4;
  batch 1) (peers/llamacpp.py);
- OpenVINO GenAI: the folder converted by optimum-intel (`optimum-cli export openvino`) with int8 and
  fp32 weights, each run by its LLMPipeline at OpenVINO's default compute precision on this CPU (bf16
  where the CPU has it) and at f32 (INFERENCE_PRECISION_HINT) (batch 1) (peers/openvino_genai.py);
- CTranslate2: the folder converted by ct2-transformers-converter at float32 and int8
  (peers/ctranslate2.py).
--contenders narrows the peers (transformers always runs: it is the reference); --precisions also
narrows onnxruntime-genai's, llama.cpp's, OpenVINO GenAI's and CTranslate2's precisions.

A contender that cannot run here (a runtime not installed, a conversion or export that fails, a
backend that does not open or fails its warm-up) is recorded in OUT.json's "skipped" with the reason,
and listed under the table; the run goes on without it.

Every ONNX Runtime session has gpt2x's thread settings (gpt2x.runtime.providers.session_options: intra-op
threads = cores, sequential); llama.cpp, OpenVINO GenAI (INFERENCE_NUM_THREADS) and CTranslate2 get
threads = cores too. Timing is
interleaved, because this VM's memory bandwidth drifts by tens of percent over minutes: per prompt
length and batch size, each contender warms up (its first tokens are also checked against
transformers'), then --repeat rounds run every contender once each, in an order rotated every round.
Each figure is the contender's median run; the spread (min-max of end-to-end tokens/s over the
rounds) and every run are kept.

End-to-end tokens/s = batch x new tokens / wall time of the whole generation (prefill included);
decode tokens/s = batch x (new tokens - 1) / (wall time - time to first token); TTFT = time from
the call to the first token, the median over the rounds. The machine's memory bandwidth is measured
in the same run and each decode figure is given as a share of its roofline (at the precision's bytes
per weight as gpt2x stores it, gpt2x.bench.roofline; llama.cpp's and CTranslate2's formats differ a
little). Under the table: each precision's gpt2x ort against the fastest peer of that precision,
gpt2x ort's decode and TTFT against llama.cpp's, OpenVINO GenAI's and CTranslate2's matching
precisions (targets at batch 1: decode ≥ llama.cpp's at fp32/f32, int8/q8_0, int4/q4_0 and q4_K_M, and
TTFT ≤ llama.cpp's, at every prompt length; decode ≥ OpenVINO GenAI's and TTFT ≤ its, int8 and fp32
weights at each compute precision, issue 36; decode ≥ 2x CTranslate2's at fp32 and int8), and int4
decode against int8 decode per runtime. The machine (CPU, cores) heads the table and is in OUT.json's
environment.
Writes OUT.json (every figure, every run, the environment), OUT.md (the table) and
OUT.png (the plot).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

import numpy as np
import peers
import torch
from peers.core import GAP_S, Context, error_line, is_reference, log, time_batch

from gpt2x.bench.report import require_matplotlib
from gpt2x.bench.roofline import cpu_read_bandwidth, roofline_tokens_per_s
from gpt2x.bench.system import installed_versions, system_info
from gpt2x.choices import BackendKind, Precision
from gpt2x.model.weights import save_hf
from gpt2x.runtime.providers import physical_cores, spin_duration_us
from gpt2x.workflows.models import load_model

# x transformers' generate (end-to-end tok/s, same batch), from the issue
TARGETS = {"gpt2x ort fp32": 3.2, "gpt2x ort int8": 8.0, "gpt2x ort int4": 10.0}
INT4_VS_INT8_TARGET = 1.3  # int4 decode tok/s over int8's on the same runtime, from the issue
PRECISIONS = (Precision.fp32, Precision.int8, Precision.int4)  # what a CPU run can ask for (fp16: CUDA only)
# gpt2x ort's decode tok/s over llama.cpp's and CTranslate2's at the matching precision, from the issue
HEAD_TO_HEAD = ("llama.cpp", "OpenVINO GenAI", "CTranslate2")  # runtimes compared one to one with gpt2x ort
# Issue 18's targets at batch 1, per (peer runtime, precision): gpt2x ort's decode tok/s over the
# peer's, and for llama.cpp also its TTFT no later than the peer's (at every prompt length); issue
# 36's the same against OpenVINO GenAI (each of its compute precisions).
PEER_DECODE_TARGETS = {("llama.cpp", "fp32"): 1.0, ("llama.cpp", "int8"): 1.0, ("llama.cpp", "int4"): 1.0,
                       ("OpenVINO GenAI", "fp32"): 1.0, ("OpenVINO GenAI", "int8"): 1.0,
                       ("CTranslate2", "fp32"): 2.0, ("CTranslate2", "int8"): 2.0}
PEER_TTFT_TARGET_RUNTIMES = ("llama.cpp", "OpenVINO GenAI")
TARGET_BATCH = 1
# What the issue measured on this 2-core VM (batch 1, 32-token prompt, 128 new tokens), for reference.
ISSUE_FIGURES = {"transformers generate": 24.7, "Optimum's export in a hand loop": 57.8,
                 "ORT GPT-2 tool, fused Attention, fp32": 72.8, "ORT GPT-2 tool int8": 175.7}
PEER_PACKAGES = ("optimum", "optimum-onnx", "onnxruntime-genai", "openvino", "openvino-genai", "openvino-tokenizers",
                 "tokenizers", "llama-cpp-python", "gguf", "ctranslate2")


def parse_list(text: str, enum, allowed, option: str, ap: argparse.ArgumentParser) -> list:
    values = []
    for item in (t.strip() for t in text.split(",") if t.strip()):
        try:
            value = enum(item)
        except ValueError:
            value = None
        if value not in allowed:
            ap.error(f"{option}: {item!r} is not one of {', '.join(a.value for a in allowed)}")
        if value not in values:
            values.append(value)
    if not values:
        ap.error(f"{option}: give at least one of {', '.join(a.value for a in allowed)}")
    return values


def parse_ints(text: str, option: str, ap: argparse.ArgumentParser) -> list[int]:
    try:
        values = list(dict.fromkeys(int(t) for t in text.split(",") if t.strip()))
    except ValueError:
        ap.error(f"{option}: {text!r} is not a comma-separated list of integers")
    if not values or min(values) < 1:
        ap.error(f"{option}: give one or more integers >= 1")
    return values


def main() -> int:
    modules = peers.modules()
    optional = [m.KEY for m in modules if m.KEY != "transformers"]
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="random:gpt2", help="gpt2x model name (default: GPT-2 124M, random weights)")
    ap.add_argument("--batch", default="1,4")
    ap.add_argument("--prompt-len", default="32",
                    help="prompt length(s) in tokens, comma-separated; each is measured in its own interleaved rounds "
                         "(default: %(default)s)")
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--repeat", type=int, default=3, help="interleaved rounds (each contender runs once per round)")
    ap.add_argument("--out", type=Path, required=True, help="output path without extension")
    ap.add_argument("--exports", type=Path, default=Path("exported"), help="where gpt2x's exports go")
    ap.add_argument("--precisions", default="fp32,int8,int4",
                    help="gpt2x export precisions to compare (fp32, int8, int4; gpt2x torch runs only with fp32), "
                         "also those onnxruntime-genai's own loop, llama.cpp and CTranslate2 run (default: %(default)s)")
    ap.add_argument("--gpt2x-backends", default="torch,ort,openvino,genai",
                    help="gpt2x backends to compare (torch, ort, openvino, genai; default: %(default)s)")
    ap.add_argument("--contenders", default=",".join(optional),
                    help="peers to run besides transformers (the reference, always run), from benchmarks/peers/: "
                         f"{', '.join(optional)} (default: all)")
    ap.add_argument("--llama-no-extra-bufts", action="store_true",
                    help="llama.cpp without its extra buffer types (no AMX, no repacked layouts): on a CPU with AMX its "
                         "q8_0 and q4_0 crash otherwise (peers/llamacpp.no_extra_buffer_types)")
    args = ap.parse_args()
    batches = parse_ints(args.batch, "--batch", ap)
    prompt_lens = parse_ints(args.prompt_len, "--prompt-len", ap)
    precisions = parse_list(args.precisions, Precision, PRECISIONS, "--precisions", ap)
    kinds = parse_list(args.gpt2x_backends, BackendKind, list(BackendKind), "--gpt2x-backends", ap)
    keys = [k.strip() for k in args.contenders.split(",") if k.strip()]
    for k in keys:
        if k not in optional and k != "transformers":
            ap.error(f"--contenders: {k!r} is not one of {', '.join(optional)}")
    if args.new_tokens < 1 or args.repeat < 1:
        ap.error("--new-tokens and --repeat must be at least 1")
    threads = physical_cores()
    torch.set_num_threads(threads)

    env = system_info()
    env["torch_threads"] = torch.get_num_threads()
    env["ort_intra_op_threads"] = threads
    env["ort_spin_us"] = spin_duration_us()  # None: ONNX Runtime's own
    env["peer packages"] = installed_versions(*PEER_PACKAGES)
    model, source = load_model(args.model)
    cfg = model.config
    if max(prompt_lens) + args.new_tokens > cfg.n_positions:
        ap.error(f"--prompt-len {max(prompt_lens)} + --new-tokens {args.new_tokens} exceeds the model's "
                 f"{cfg.n_positions} positions")
    log(f"measuring memory bandwidth ({threads} threads)")
    bandwidth_samples = [cpu_read_bandwidth(threads)]
    results: dict = {"environment": env, "settings": vars(args) | {"out": str(args.out), "exports": str(args.exports),
                                                                   "prompt_lens": prompt_lens, "interleaved": True,
                                                                   "gap_s": GAP_S},
                     "issue_figures_batch1_e2e": ISSUE_FIGURES, "skipped": {}, "not_run": [], "runs": []}
    rng = np.random.default_rng(0)
    prompts = {(t, b): rng.integers(0, cfg.vocab_size, (b, t), dtype=np.int64) for t in prompt_lens for b in batches}

    with tempfile.TemporaryDirectory(prefix="gpt2x-peers-") as tmp:
        hf_dir = Path(tmp) / "hf"
        save_hf(model, hf_dir)  # the same tensors for every library
        ctx = Context(hf_dir=hf_dir, work=Path(tmp), threads=threads, model=model, source=source, model_name=args.model,
                      exports_dir=args.exports, precisions=precisions, kinds=kinds, max_prompt=max(prompt_lens),
                      new_tokens=args.new_tokens, results=results)
        contenders: list = []
        if args.llama_no_extra_bufts and "llama.cpp" in keys:
            from peers.llamacpp import no_extra_buffer_types

            no_extra_buffer_types()
        for module in modules:
            if module.KEY != "transformers" and module.KEY not in keys:
                continue
            try:
                contenders += module.load(ctx)
            except Exception as e:
                if module.KEY == "transformers":
                    raise  # the reference every ratio divides by
                reason = f"not importable here: {e}" if isinstance(e, ImportError) else error_line(e)
                ctx.skip(module.LABEL, reason)

        for prompt_len in prompt_lens:
            for batch in batches:
                label = f"batch {batch}" if len(prompt_lens) == 1 else f"batch {batch}, prompt {prompt_len}"
                runs, not_run, failed = time_batch(contenders, prompts[(prompt_len, batch)], args.new_tokens, args.repeat, label)
                prefills = {c.name: c.prefill for c in contenders if getattr(c, "prefill", None)}
                for r in runs:  # which runtime ran gpt2x ort's prefill (the backend's `prefill`)
                    if r["name"] in prefills:
                        r["prefill"] = prefills[r["name"]]
                results["runs"] += runs
                results["not_run"] += not_run
                results["skipped"] |= failed

    # Bandwidth again at the end; the higher sample sets the roofline (see gpt2x/bench/run.py).
    bandwidth_samples.append(cpu_read_bandwidth(threads))
    bandwidth = max(bandwidth_samples)
    results["bandwidth_samples_bytes_per_s"] = bandwidth_samples
    results["bandwidth_bytes_per_s"] = bandwidth
    for r in results["runs"]:
        roof = roofline_tokens_per_s(bandwidth, cfg, Precision(r["precision"]), r["batch"],
                                     r["prompt_len"] + args.new_tokens // 2)
        r["roofline_tokens_per_s"] = roof
        r["roofline_share"] = r["decode_tokens_per_s"] / roof

    for prompt_len in prompt_lens:
        for batch in batches:
            rows = [r for r in results["runs"] if r["batch"] == batch and r["prompt_len"] == prompt_len]
            base = next(r for r in rows if is_reference(r["name"]))
            for r in rows:
                r["e2e_vs_transformers"] = r["e2e_tokens_per_s"] / base["e2e_tokens_per_s"]
                r["decode_vs_transformers"] = r["decode_tokens_per_s"] / base["decode_tokens_per_s"]
                r["target"] = TARGETS.get(r["name"])
    results["int4_vs_int8_decode"] = int4_vs_int8(results["runs"])
    results["vs_peers"] = vs_peers(results["runs"])
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".json").write_text(json.dumps(results, indent=1) + "\n")
    args.out.with_suffix(".md").write_text(markdown(results))
    plot(results, args.out.with_suffix(".png"))
    print(markdown(results))
    return 0


def groups(results: dict) -> list[tuple[int, int]]:
    """(prompt length, batch) of every row, in the order they ran."""
    return list(dict.fromkeys((r["prompt_len"], r["batch"]) for r in results["runs"]))


def markdown(results: dict) -> str:
    env = results["environment"]
    s = results["settings"]
    k = next((r["check_tokens"] for r in results["runs"]), 0)
    lengths = " and ".join(str(t) for t in s.get("prompt_lens", [s["prompt_len"]]))
    lines = [
        f"GPT-2 124M architecture ({s['model']}, random weights), prompt {lengths} tokens, "
        f"{s['new_tokens']} greedy tokens; {s['repeat']} interleaved rounds (every contender once per round, "
        "order rotated), median run shown, spread = min-max of end-to-end tok/s over the rounds, "
        "TTFT = time from the call to the first token (median over the rounds).",
        f"Machine: {env['cpu']}, {env['cores']} cores, {env['platform']}; measured read bandwidth "
        f"{results['bandwidth_bytes_per_s'] / 1e9:.1f} GB/s; {env['date']}, gpt2x git {env['git']}; "
        + ", ".join(f"{k} {v}" for k, v in (env["packages"] | env.get("peer packages", {})).items()) + ".",
        f"ONNX Runtime sessions: {env.get('ort_intra_op_threads')} intra-op threads, sequential; gpt2x's spin "
        + ("as ONNX Runtime's default does" if env.get("ort_spin_us") is None else f"{env['ort_spin_us']} µs")
        + " after a run (GPT2X_ORT_SPIN_US), the other ONNX Runtime users as ONNX Runtime does; llama.cpp, OpenVINO "
        "GenAI and CTranslate2 with as many threads"
        + (" (llama.cpp without its extra buffer types, --llama-no-extra-bufts: no AMX, no repacked weights)."
           if results["settings"].get("llama_no_extra_bufts") else "."),
        "",
        "| engine | batch | prompt | end-to-end tok/s | spread (e2e) | decode tok/s | TTFT (ms) | x transformers (e2e) "
        f"| x transformers (decode) | % of roofline (decode) | first {k} tokens = transformers' | target |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- | --- |",
    ]
    for t, b in groups(results):
        for r in (r for r in results["runs"] if r["batch"] == b and r["prompt_len"] == t):
            target = f"≥ {r['target']}x: {'met' if r['e2e_vs_transformers'] >= r['target'] else 'not met'}" if r.get("target") else ""
            d = r["first_difference_vs_transformers"]
            same = "yes" if d is None else f"no (from token {d})"
            lines.append(f"| {r['name']} | {b} | {t} | {r['e2e_tokens_per_s']:.1f} | {r['e2e_min']:.1f}-{r['e2e_max']:.1f} | "
                         f"{r['decode_tokens_per_s']:.1f} | {r['ttft_s'] * 1e3:.1f} | {r['e2e_vs_transformers']:.2f} | "
                         f"{r['decode_vs_transformers']:.2f} | {r['roofline_share'] * 100:.0f}% | {same} | {target} |")
        for n in (n for n in results["not_run"] if n["batch"] == b and n.get("prompt_len", t) == t):
            lines.append(f"| {n['name']} | {b} | {t} | not run | | | | | | | | {n['reason']} |")
    lines.append("")
    for t, b in groups(results):
        rows = [r for r in results["runs"] if r["batch"] == b and r["prompt_len"] == t]
        for precision in (p.value for p in PRECISIONS):
            ours = next((r for r in rows if r["name"] == f"gpt2x ort {precision}"), None)
            peer_rows = [r for r in rows if r["precision"] == precision and not r["name"].startswith("gpt2x")]
            if ours and peer_rows:
                best = max(peer_rows, key=lambda r: r["e2e_tokens_per_s"])
                lines.append(f"- batch {b}, prompt {t}, {precision}: gpt2x ort {ours['e2e_tokens_per_s']:.1f} tok/s vs the "
                             f"fastest {precision} peer, {best['name']}, {best['e2e_tokens_per_s']:.1f}: "
                             f"{ours['e2e_tokens_per_s'] / best['e2e_tokens_per_s']:.2f}x")
    if results.get("vs_peers"):
        lines += ["", "gpt2x ort against llama.cpp, OpenVINO GenAI and CTranslate2 at the matching precision (decode = decode tok/s, "
                  "gpt2x's over the peer's; TTFT = the peer's time to first token over gpt2x's, > 1: gpt2x answers first):", ""]
        for c in results["vs_peers"]:
            target = (f" (target ≥ {c['target']}x: {'met' if c['met'] else 'not met'})" if c["target"] else "")
            ttft_target = (f" (target ≥ 1x: {'met' if c['ttft_met'] else 'not met'})" if c["ttft_met"] is not None else "")
            lines.append(f"- prompt {c['prompt_len']}, batch {c['batch']}, {c['precision']}: {c['gpt2x']} "
                         f"{c['gpt2x_decode_tokens_per_s']:.1f} tok/s, TTFT {c['gpt2x_ttft_ms']:.1f} ms vs {c['peer']} "
                         f"{c['peer_decode_tokens_per_s']:.1f} tok/s, TTFT {c['peer_ttft_ms']:.1f} ms: decode "
                         f"{c['decode_ratio']:.2f}x{target}, TTFT {c['ttft_ratio']:.2f}x{ttft_target}")
        lines.append("")
    for c in results.get("int4_vs_int8_decode", []):
        met = "met" if c["ratio"] >= INT4_VS_INT8_TARGET else "not met"
        who = c["runtime"] if c["int4"] == f"{c['runtime']} int4" else f"{c['int4']} vs {c['int8']}"
        lines.append(f"- batch {c['batch']}, prompt {c['prompt_len']}, {who}: int4 decode {c['int4_decode_tokens_per_s']:.1f} "
                     f"tok/s vs int8 decode {c['int8_decode_tokens_per_s']:.1f}: {c['ratio']:.2f}x "
                     f"(target ≥ {INT4_VS_INT8_TARGET}x: {met})")
    wanted = set(s.get("precisions", "").split(","))
    if {"int4", "int8"} <= wanted and not results.get("int4_vs_int8_decode"):
        lines.append("- int4 decode vs int8 decode: no runtime ran both here (see skipped below).")
    for name, reason in results["skipped"].items():
        lines.append(f"- {name}: skipped. {reason}")
    lines.append("- The issue's figures from an earlier run on this VM (batch 1, e2e tok/s): "
                 + ", ".join(f"{k} {v}" for k, v in results["issue_figures_batch1_e2e"].items()) + ".")
    return "\n".join(lines) + "\n"


def int4_vs_int8(runs: list[dict]) -> list[dict]:
    """Per batch size, prompt length and runtime that ran both: int4 decode tok/s over int8's (issue
    target ≥ 1.3x); a runtime with two int4 formats (llama.cpp q4_0, q4_K_M) gives one line each."""
    out = []
    for r4 in (r for r in runs if r["precision"] == "int4"):
        r8 = next((r for r in runs if r["precision"] == "int8" and r["runtime"] == r4["runtime"]
                   and r["batch"] == r4["batch"] and r["prompt_len"] == r4["prompt_len"]), None)
        if r8:
            ratio = r4["decode_tokens_per_s"] / r8["decode_tokens_per_s"]
            out.append({"batch": r4["batch"], "prompt_len": r4["prompt_len"], "runtime": r4["runtime"],
                        "int4": r4["name"], "int8": r8["name"], "int4_decode_tokens_per_s": r4["decode_tokens_per_s"],
                        "int8_decode_tokens_per_s": r8["decode_tokens_per_s"], "ratio": ratio,
                        "target": INT4_VS_INT8_TARGET, "met": ratio >= INT4_VS_INT8_TARGET})
    return sorted(out, key=lambda c: (c["prompt_len"], c["batch"]))


def vs_peers(runs: list[dict]) -> list[dict]:
    """gpt2x ort against every llama.cpp, OpenVINO GenAI and CTranslate2 row of the same precision,
    batch size and prompt length: decode tok/s ratio (gpt2x's over the peer's; target
    PEER_DECODE_TARGETS) and TTFT ratio (the peer's over gpt2x's; target ≥ 1 against llama.cpp and
    OpenVINO GenAI), targets at batch 1."""
    out = []
    for peer in (r for r in runs if r["runtime"] in HEAD_TO_HEAD):
        ours = next((r for r in runs if r["name"] == f"gpt2x ort {peer['precision']}" and r["batch"] == peer["batch"]
                     and r["prompt_len"] == peer["prompt_len"]), None)
        if ours is None:
            continue
        ratio = ours["decode_tokens_per_s"] / peer["decode_tokens_per_s"]
        at_target_batch = peer["batch"] == TARGET_BATCH
        target = PEER_DECODE_TARGETS.get((peer["runtime"], peer["precision"])) if at_target_batch else None
        ttft_ratio = peer["ttft_s"] / ours["ttft_s"]
        ttft_met = ttft_ratio >= 1.0 if at_target_batch and peer["runtime"] in PEER_TTFT_TARGET_RUNTIMES else None
        out.append({"prompt_len": peer["prompt_len"], "batch": peer["batch"], "precision": peer["precision"],
                    "gpt2x": ours["name"], "peer": peer["name"],
                    "gpt2x_decode_tokens_per_s": ours["decode_tokens_per_s"], "peer_decode_tokens_per_s": peer["decode_tokens_per_s"],
                    "gpt2x_ttft_ms": ours["ttft_s"] * 1e3, "peer_ttft_ms": peer["ttft_s"] * 1e3,
                    "decode_ratio": ratio, "ttft_ratio": ttft_ratio, "ttft_met": ttft_met,
                    "target": target, "met": None if target is None else ratio >= target})
    order = {p.value: i for i, p in enumerate(PRECISIONS)}
    return sorted(out, key=lambda c: (c["prompt_len"], c["batch"], order.get(c["precision"], 9)))


def plot(results: dict, path: Path) -> None:
    plt = require_matplotlib()
    series = groups(results)
    names = list(dict.fromkeys(r["name"] for r in results["runs"]))
    fig, (ax, ax2) = plt.subplots(2, 1, figsize=(max(12, 0.65 * len(names)), 9), sharex=True)
    width = 0.8 / len(series)
    x = np.arange(len(names))
    for i, (t, b) in enumerate(series):
        rows = [next((r for r in results["runs"] if r["name"] == n and r["batch"] == b and r["prompt_len"] == t), None)
                for n in names]
        vals = [r["e2e_tokens_per_s"] if r else 0 for r in rows]
        err = [[r["e2e_tokens_per_s"] - r["e2e_min"] if r else 0 for r in rows],
               [r["e2e_max"] - r["e2e_tokens_per_s"] if r else 0 for r in rows]]
        label = f"batch {b}" if len({p for p, _ in series}) == 1 else f"batch {b}, prompt {t}"
        ax.bar(x + i * width, vals, width, yerr=err, capsize=2, label=label)
        ax2.bar(x + i * width, [r["ttft_s"] * 1e3 if r else 0 for r in rows], width, label=label)
    ax2.set_xticks(x + width * (len(series) - 1) / 2, names, rotation=20, ha="right", fontsize=7)
    ax.set_ylabel("end-to-end tokens/s (bars: min-max over rounds)")
    ax2.set_ylabel("time to first token, ms (median)")
    ax2.set_yscale("log")
    env = results["environment"]
    ax.set_title(f"GPT-2 124M on {env['cpu']} ({env['cores']} cores): gpt2x vs peers", fontsize=10)
    for a in (ax, ax2):
        a.legend(fontsize=7)
        a.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    sys.exit(main())
