"""`gpt2x bench`: parity and speed of every backend x precision x batch, against the PyTorch fp32
reference and against the machine's own memory-bandwidth limit (roofline.py).

Without PyTorch installed, the bench runs ONNX Runtime exports that already exist: parity is then
the gate recorded in each export's metadata (no reference to compare against here), and perplexity
is reported without a reference figure.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from .. import workflows
from ..choices import BackendKind, Precision, Progress, ProviderKind, no_progress
from ..errors import UsageError
from ..evaluate.metrics import heldout_text, perplexity, summarize_latencies
from ..evaluate.parity import check
from ..generation.generate import decode_loop
from ..generation.sampling import Sampler
from ..generation.settings import SamplingSettings
from ..memory import peak_rss_mb, reset_peak_rss
from ..model.anatomy import total_params
from ..model.checkpoints import resolve_config
from ..numerics import positions
from ..runtime.base import Backend
from ..tokenizer import encode
from .roofline import cpu_read_bandwidth, gpu_copy_bandwidth, roofline_tokens_per_s

SCHEMA_VERSION = 1


@dataclass
class BenchSettings:
    model: str = "shakespeare"  # model name: bundled, preset, hub repo, local path or random:NAME
    provider: ProviderKind = ProviderKind.cpu
    backends: list[BackendKind] = field(default_factory=lambda: [BackendKind.torch, BackendKind.ort])
    precisions: list[Precision] = field(default_factory=lambda: [Precision.fp32, Precision.int8])
    batches: list[int] = field(default_factory=lambda: [1])
    prompt_len: int = 32  # prompt tokens per row
    new_tokens: int = 128  # generated tokens per row (EOS does not stop a benchmark run)
    repeat: int = 3  # timed runs per configuration; the median is reported
    warmup: int = 1  # untimed runs before timing
    threads: int | None = None  # CPU threads (default: all available cores)
    text: Path | None = None  # perplexity text (default: the bundled held-out Shakespeare excerpt)
    greedy_tokens: int = 32  # tokens of the greedy-agreement check

    def __post_init__(self) -> None:
        for name in ("prompt_len", "new_tokens", "repeat", "greedy_tokens"):
            if getattr(self, name) < 1:
                raise UsageError(f"{name} must be at least 1", option=name)
        if self.warmup < 0:
            raise UsageError("warmup must be >= 0", option="warmup")
        if not self.batches or min(self.batches) < 1:
            raise UsageError("batch sizes must be at least 1", option="batch")


def combos(s: BenchSettings) -> tuple[list[tuple[BackendKind, Precision]], list[dict]]:
    """Backend x precision pairs that exist, and the ones left out with the reason: fp16 needs CUDA;
    PyTorch runs fp32 (fp16 on CUDA), the quantized precisions are ONNX exports; OpenVINO has no
    CUDA device."""
    run, skipped = [], []
    for b in s.backends:
        for p in s.precisions:
            reason = workflows.unsupported(b, s.provider, p)
            if reason:
                skipped.append({"backend": b.value, "precision": p.value, "reason": str(reason)})
            else:
                run.append((b, p))
    return run, skipped


def timed_generation(backend: Backend, prompt_ids: np.ndarray, new_tokens: int) -> dict:
    """One greedy run through the shared decode loop that never stops early: time to first token,
    then each decode step (the sampler's tokens are on the host, so every step has finished)."""
    sampler = Sampler(SamplingSettings(greedy=True, max_new_tokens=new_tokens))
    steps: list[float] = []
    ttft = None
    t0 = last = time.perf_counter()
    for _ in decode_loop(backend, prompt_ids, np.ones_like(prompt_ids), sampler, new_tokens):
        now = time.perf_counter()
        if ttft is None:
            ttft = now - t0
        else:
            steps.append(now - last)
        last = now
    return {"ttft_s": ttft, "steps_s": steps, "total_s": time.perf_counter() - t0}


def median_run(runs: list[dict]) -> dict:
    return sorted(runs, key=lambda r: r["total_s"])[len(runs) // 2]


def speed_entry(run: dict, batch: int, new_tokens: int, prompt_len: int, cold_s: float, roof: Callable[[int], float]) -> dict:
    steps = run["steps_s"]
    decode = batch * len(steps) / sum(steps) if steps else float("nan")
    mid_context = prompt_len + new_tokens // 2
    roof_tps = roof(mid_context)
    # Per-token latency along the context, in 8 buckets, for the plot.
    buckets = np.array_split(np.arange(len(steps)), min(8, max(1, len(steps))))
    by_context = [{"context": int(prompt_len + 1 + b[len(b) // 2]), "ms": float(np.median([steps[i] for i in b]) * 1e3)}
                  for b in buckets if len(b)]
    return {
        "cold_start_s": cold_s,
        "ttft_ms": run["ttft_s"] * 1e3,
        "decode_latency": summarize_latencies(steps) if steps else {},
        "decode_tokens_per_s": decode,
        "e2e_tokens_per_s": batch * new_tokens / run["total_s"],
        "roofline_tokens_per_s": roof_tps,
        "roofline_share": decode / roof_tps,
        "latency_by_context": by_context,
    }


# ---------------------------------------------------------------- the whole benchmark


def read_text(path: Path | None) -> str:
    if path is None:
        return heldout_text()
    try:
        return path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise UsageError(f"cannot read the perplexity text {path}: {e}") from None


def full_logits_fn(backend: Backend) -> Callable[[np.ndarray], np.ndarray]:
    def run(x: np.ndarray) -> np.ndarray:
        mask = np.ones_like(x)
        return backend.run(x, mask, positions(mask, x.shape[1]), None)[0]

    return run


def run_bench(s: BenchSettings, environment: dict, progress: Progress = no_progress,
              loaded: tuple | None = None) -> dict:
    """Every figure of the benchmark as one JSON-ready dict; `passed` is False when a gate fails.
    `loaded` is the PyTorch model and its source when the caller has it in memory already."""
    cfg = loaded[0].config if loaded else resolve_config(s.model)
    if s.prompt_len + s.new_tokens > cfg.n_positions:
        raise UsageError(f"prompt length + new tokens ({s.prompt_len + s.new_tokens}) exceed the context ({cfg.n_positions})")
    threads = s.threads or environment.get("cores") or os.cpu_count() or 1
    have_torch = workflows.torch_available()
    if loaded is None and (have_torch or BackendKind.torch in s.backends):
        progress(f"loading {s.model}")
        loaded = workflows.load_model(s.model)  # a missing torch is one clear error here

    def measure_bandwidth() -> float:
        progress("measuring memory bandwidth")
        return gpu_copy_bandwidth() if s.provider is ProviderKind.cuda else cpu_read_bandwidth(threads)

    kind = "device-to-device copy (read + write)" if s.provider is ProviderKind.cuda else f"{threads}-thread sequential read"
    bandwidth = {"kind": kind, "samples_bytes_per_s": [measure_bandwidth()]}
    bandwidth["bytes_per_s"] = bandwidth["samples_bytes_per_s"][0]
    text_ids = encode(read_text(s.text))
    window = min(cfg.n_positions, 256)
    reference = workflows.torch_backend(loaded[0], ProviderKind.cpu, s.model, threads=threads) if loaded else None
    ref_ppl = perplexity(full_logits_fn(reference), text_ids, window) if reference else None
    rng = np.random.default_rng(0)
    prompts = {b: rng.integers(0, cfg.vocab_size, (b, s.prompt_len), dtype=np.int64) for b in s.batches}
    result = {
        "schema_version": SCHEMA_VERSION,
        "settings": {**asdict(s), "provider": s.provider.value, "backends": [b.value for b in s.backends],
                     "precisions": [p.value for p in s.precisions], "text": str(s.text or "bundled held-out Shakespeare"),
                     "threads": threads},
        "environment": environment,
        "model": {"name": s.model, "config": cfg.to_dict(), "parameters": total_params(cfg)},
        "bandwidth": bandwidth,
        "reference": {"backend": "torch", "precision": "fp32", "perplexity": ref_ppl, "text_tokens": len(text_ids)},
        "parity": [],
        "speed": [],
    }
    pairs, result["skipped"] = combos(s)
    for kind, precision in pairs:
        label = f"{kind.value}/{precision.value}"
        info = folder = None
        if kind is not BackendKind.torch:
            info = workflows.ensure_export(s.model, precision, loaded=loaded, progress=progress, notice=progress)
            folder = info.folder
        progress(f"{label}: loading")
        reset_peak_rss()  # cold start and peak memory exclude the one-off export
        t0 = time.perf_counter()
        backend = workflows.open_backend(kind, s.provider, None if folder else s.model, precision=precision,
                                         onnx_dir=folder, threads=threads, loaded=loaded)
        first = prompts[s.batches[0]]
        backend.step(first, np.ones_like(first), positions(np.ones_like(first), s.prompt_len), None)
        cold = time.perf_counter() - t0
        progress(f"{label}: parity")
        ppl = perplexity(full_logits_fn(backend), text_ids, window)
        if reference is not None or info is None:
            gate = check(reference, backend, precision, s.greedy_tokens)
            parity = {"source": "measured against torch fp32", "passed": gate["status"] == "passed",
                      "message": gate["message"], "logits": gate["logits"], "greedy": gate["greedy"],
                      "tolerance": gate["tolerance"]}
        else:  # no PyTorch here: the gate this export passed when it was made
            recorded = info.meta.get("parity", {})
            parity = {"source": "recorded at export (no PyTorch installed to measure)",
                      "passed": recorded.get("status") == "passed", "message": recorded.get("message", recorded.get("status", "")),
                      "logits": recorded.get("logits"), "greedy": recorded.get("greedy"), "tolerance": recorded.get("tolerance")}
        result["parity"].append({
            "backend": kind.value, "precision": precision.value, **parity, "perplexity": ppl,
            "perplexity_rel_change": ppl / ref_ppl - 1 if ref_ppl else None,
        })
        for batch in s.batches:
            progress(f"{label}: batch {batch}, {s.warmup} warm-up + {s.repeat} timed runs")
            for _ in range(s.warmup):
                timed_generation(backend, prompts[batch], min(8, s.new_tokens))
            runs = [timed_generation(backend, prompts[batch], s.new_tokens) for _ in range(s.repeat)]
            entry = {"run": median_run(runs), "cold": cold, "backend": kind.value, "precision": precision.value,
                     "batch": batch, "peak_rss_mb": peak_rss_mb()}
            device_mb = backend.peak_device_memory_mb()
            if device_mb is not None:
                entry["peak_gpu_mb"] = device_mb
            result["speed"].append(entry)
        del backend
    # On a shared machine the bandwidth varies over minutes: measure again at the end and take the
    # higher figure, so that a transient slowdown cannot make the roofline look easy to reach.
    bandwidth["samples_bytes_per_s"].append(measure_bandwidth())
    bandwidth["bytes_per_s"] = max(bandwidth["samples_bytes_per_s"])
    for i, e in enumerate(result["speed"]):
        precision, batch = Precision(e["precision"]), e["batch"]

        def roof(context, batch=batch, precision=precision):
            return roofline_tokens_per_s(bandwidth["bytes_per_s"], cfg, precision, batch, context)

        figures = speed_entry(e.pop("run"), batch, s.new_tokens, s.prompt_len, e.pop("cold"), roof)
        result["speed"][i] = {**figures, **e}
    result["passed"] = all(p["passed"] for p in result["parity"])
    return result
