"""gpt2x beside the peers a user would otherwise pick, in one process, on the same weights.

    python benchmarks/compare_peers.py --batch 1,4 --out benchmarks/results/cpu-2core

Runs GPT-2 124M (architecture of `gpt2`, seeded random weights saved in Hugging Face layout so that
every library loads the very same tensors), a prompt of --prompt-len random tokens, --new-tokens
greedy tokens that EOS does not cut short, and times for each batch size:

- transformers' `GPT2LMHeadModel.generate` (PyTorch eager): the reference the ratios divide by;
- Optimum's `ORTModelForCausalLM` (its own ONNX export, ONNX Runtime CPU) when importable;
- gpt2x: PyTorch, ONNX Runtime fp32 and int8 (exported here, parity-gated).

End-to-end tokens/s = batch x new tokens / wall time of the whole generation (prefill included),
the median of --repeat runs after a warm-up. The machine's memory bandwidth is measured in the same
run and each decode figure is given as a share of its roofline. Writes OUT.json (every figure and
the environment), OUT.md (the table) and OUT.png (the plot).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from gpt2x import bench
from gpt2x.backends import TorchBackend
from gpt2x.choices import Precision
from gpt2x.export import export, read_export
from gpt2x.runtime import OrtBackend, physical_cores
from gpt2x.system import system_info
from gpt2x.weights import load_model, save_hf

TARGETS = {"gpt2x ort fp32": 3.2, "gpt2x ort int8": 8.0}  # x transformers' generate, from the issue


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def time_hf_generate(model, prompt: torch.Tensor, new_tokens: int, repeat: int) -> dict:
    kwargs = dict(attention_mask=torch.ones_like(prompt), max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                  do_sample=False, num_beams=1, pad_token_id=50256)
    with torch.inference_mode():
        model.generate(prompt, **{**kwargs, "max_new_tokens": 4, "min_new_tokens": 4})  # warm-up
        times = []
        for _ in range(repeat):
            t0 = time.perf_counter()
            out = model.generate(prompt, **kwargs)
            times.append(time.perf_counter() - t0)
            assert out.shape[1] == prompt.shape[1] + new_tokens
        # Prefill alone, to split decode from time to first token.
        t0 = time.perf_counter()
        for _ in range(repeat):
            model(prompt, attention_mask=torch.ones_like(prompt), use_cache=True)
        prefill = (time.perf_counter() - t0) / repeat
    total = statistics.median(times)
    b = prompt.shape[0]
    return {"e2e_tokens_per_s": b * new_tokens / total, "decode_tokens_per_s": b * (new_tokens - 1) / max(total - prefill, 1e-9),
            "total_s": total, "prefill_s": prefill}


def time_gpt2x(backend, prompt: np.ndarray, new_tokens: int, repeat: int) -> dict:
    bench.timed_generation(backend, prompt, 4, lambda: None)  # warm-up
    runs = [bench.timed_generation(backend, prompt, new_tokens, lambda: None) for _ in range(repeat)]
    run = bench.median_run(runs)
    b = prompt.shape[0]
    return {"e2e_tokens_per_s": b * new_tokens / run["total_s"], "decode_tokens_per_s": b * len(run["steps_s"]) / sum(run["steps_s"]),
            "total_s": run["total_s"], "prefill_s": run["ttft_s"], "decode_latency": bench.summarize_latencies(run["steps_s"]),
            "latency_by_context": bench.speed_entry(run, b, new_tokens, prompt.shape[1], 0.0, lambda c: 1.0)["latency_by_context"]}


def load_optimum(folder: Path):
    try:
        from optimum.onnxruntime import ORTModelForCausalLM
    except ImportError as e:
        log(f"Optimum not importable here ({e}); skipped")
        return None
    return ORTModelForCausalLM.from_pretrained(folder, export=True, use_cache=True, provider="CPUExecutionProvider")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="random:gpt2", help="gpt2x model name (default: GPT-2 124M, random weights)")
    ap.add_argument("--batch", default="1,4")
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--out", type=Path, required=True, help="output path without extension")
    ap.add_argument("--exports", type=Path, default=Path("exported"), help="where gpt2x's exports go")
    args = ap.parse_args()
    batches = [int(b) for b in args.batch.split(",")]
    threads = physical_cores()
    torch.set_num_threads(threads)

    env = system_info()
    env["torch_threads"] = torch.get_num_threads()
    model, source = load_model(args.model)
    cfg = model.config
    log(f"measuring memory bandwidth ({threads} threads)")
    bandwidth_samples = [bench.cpu_read_bandwidth(threads)]
    results: dict = {"environment": env, "settings": vars(args) | {"out": str(args.out), "exports": str(args.exports)},
                     "runs": []}
    rng = np.random.default_rng(0)
    prompts = {b: rng.integers(0, cfg.vocab_size, (b, args.prompt_len), dtype=np.int64) for b in batches}

    with tempfile.TemporaryDirectory() as tmp:
        hf_dir = Path(tmp) / "hf"
        save_hf(model, hf_dir)  # the same tensors for every library
        contenders = []

        from transformers import GPT2LMHeadModel

        hf = GPT2LMHeadModel.from_pretrained(hf_dir, dtype=torch.float32).eval()
        contenders.append(("transformers generate (PyTorch eager)", "torch", Precision.fp32,
                           lambda p: time_hf_generate(hf, torch.from_numpy(p), args.new_tokens, args.repeat)))
        log("exporting with Optimum")
        opt = load_optimum(hf_dir)
        if opt is not None:
            contenders.append(("Optimum ORTModelForCausalLM", "ort", Precision.fp32,
                               lambda p: time_hf_generate(opt, torch.from_numpy(p), args.new_tokens, args.repeat)))
        contenders.append(("gpt2x torch", "torch", Precision.fp32, lambda p: time_gpt2x(TorchBackend(model), p, args.new_tokens, args.repeat)))
        for precision in (Precision.fp32, Precision.int8):
            folder = args.exports / f"{source.name.replace(':', '-')}-{precision.value}"
            if not (folder / "gpt2x.json").exists():
                log(f"exporting gpt2x {precision.value} to {folder}")
                export(model, source, folder, precision, progress=log)
            info = read_export(folder)
            results[f"gpt2x_{precision.value}_parity"] = info.meta["parity"]
            backend = OrtBackend(info, threads=threads)
            contenders.append((f"gpt2x ort {precision.value}", "ort", precision,
                               lambda p, backend=backend: time_gpt2x(backend, p, args.new_tokens, args.repeat)))

        for batch in batches:
            for name, engine, precision, fn in contenders:
                log(f"batch {batch}: {name}")
                r = fn(prompts[batch])
                results["runs"].append({"name": name, "engine": engine, "precision": precision.value, "batch": batch, **r})

    # Bandwidth again at the end; the higher sample sets the roofline (see gpt2x/bench.py).
    bandwidth_samples.append(bench.cpu_read_bandwidth(threads))
    bandwidth = max(bandwidth_samples)
    results["bandwidth_samples_bytes_per_s"] = bandwidth_samples
    results["bandwidth_bytes_per_s"] = bandwidth
    for r in results["runs"]:
        roof = bench.roofline_tokens_per_s(bandwidth, cfg, Precision(r["precision"]), r["batch"],
                                           args.prompt_len + args.new_tokens // 2)
        r["roofline_tokens_per_s"] = roof
        r["roofline_share"] = r["decode_tokens_per_s"] / roof

    for batch in batches:
        base = next(r for r in results["runs"] if r["batch"] == batch and r["name"].startswith("transformers"))
        for r in results["runs"]:
            if r["batch"] == batch:
                r["e2e_vs_transformers"] = r["e2e_tokens_per_s"] / base["e2e_tokens_per_s"]
                r["decode_vs_transformers"] = r["decode_tokens_per_s"] / base["decode_tokens_per_s"]
                r["target"] = TARGETS.get(r["name"])
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".json").write_text(json.dumps(results, indent=1) + "\n")
    args.out.with_suffix(".md").write_text(markdown(results))
    plot(results, args.out.with_suffix(".png"))
    print(markdown(results))
    return 0


def markdown(results: dict) -> str:
    env = results["environment"]
    s = results["settings"]
    lines = [
        f"GPT-2 124M architecture ({s['model']}, random weights), prompt {s['prompt_len']} tokens, "
        f"{s['new_tokens']} greedy tokens, median of {s['repeat']} runs.",
        f"Machine: {env['cpu']}, {env['cores']} cores, {env['platform']}; measured read bandwidth "
        f"{results['bandwidth_bytes_per_s'] / 1e9:.1f} GB/s; {env['date']}, gpt2x git {env['git']}; "
        + ", ".join(f"{k} {v}" for k, v in env["packages"].items()) + ".",
        "",
        "| engine | batch | end-to-end tok/s | decode tok/s | x transformers (e2e) | x transformers (decode) | % of roofline (decode) | target |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | --- |",
    ]
    for r in results["runs"]:
        target = f"≥ {r['target']}x: {'met' if r['e2e_vs_transformers'] >= r['target'] else 'not met'}" if r.get("target") else ""
        lines.append(f"| {r['name']} | {r['batch']} | {r['e2e_tokens_per_s']:.1f} | {r['decode_tokens_per_s']:.1f} | "
                     f"{r['e2e_vs_transformers']:.2f} | {r['decode_vs_transformers']:.2f} | {r['roofline_share'] * 100:.0f}% | {target} |")
    return "\n".join(lines) + "\n"


def plot(results: dict, path: Path) -> None:
    plt = bench.require_matplotlib()
    batches = sorted({r["batch"] for r in results["runs"]})
    names = list(dict.fromkeys(r["name"] for r in results["runs"]))
    fig, ax = plt.subplots(figsize=(10, 4.5))
    width = 0.8 / len(batches)
    for i, b in enumerate(batches):
        vals = [next((r["e2e_tokens_per_s"] for r in results["runs"] if r["name"] == n and r["batch"] == b), 0) for n in names]
        ax.bar(np.arange(len(names)) + i * width, vals, width, label=f"batch {b}")
    ax.set_xticks(np.arange(len(names)) + width * (len(batches) - 1) / 2, names, rotation=15, fontsize=8)
    ax.set_ylabel("end-to-end tokens/s")
    env = results["environment"]
    ax.set_title(f"GPT-2 124M on {env['cpu']} ({env['cores']} cores): gpt2x vs peers", fontsize=10)
    ax.legend()
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    sys.exit(main())
