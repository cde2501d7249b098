"""`gpt2x bench`: parity and speed of every backend x precision x batch, against the PyTorch fp32
reference and against the machine's own memory-bandwidth limit (the roofline of decoding).

Decoding one token reads every weight matrix once (plus the KV cache), so at batch B the fastest
possible decode rate is B * bandwidth / (weight bytes + KV bytes). The bandwidth is measured in the
same run: a multi-threaded read on the CPU, a device-to-device copy on the GPU.
"""

from __future__ import annotations

import math
import os
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from importlib import resources
from pathlib import Path

import numpy as np
import torch

from .backends import TorchBackend
from .choices import BackendKind, Precision, ProviderKind
from .errors import UsageError
from .generation import Sampler, SamplingSettings, positions
from .model import GPT2, GPT2Config
from .parity import check

SCHEMA_VERSION = 1
Progress = Callable[[str], None]


# ---------------------------------------------------------------- statistics


def percentile(values, q: float) -> float:
    """Linear-interpolation percentile (numpy's default), q in [0, 100]."""
    return float(np.percentile(np.asarray(values, dtype=np.float64), q))


def summarize_latencies(seconds: list[float]) -> dict[str, float]:
    ms = [s * 1e3 for s in seconds]
    return {"p50_ms": percentile(ms, 50), "p90_ms": percentile(ms, 90), "p99_ms": percentile(ms, 99),
            "mean_ms": float(np.mean(ms))}


def cross_entropy(logits: np.ndarray, targets: np.ndarray) -> float:
    """Mean -log softmax(logits)[target] over rows, in nats (float64)."""
    logits = logits.astype(np.float64)
    lse = np.logaddexp.reduce(logits, axis=-1)
    return float((lse - logits[np.arange(len(targets)), targets]).mean())


def perplexity(full_logits: Callable[[np.ndarray], np.ndarray], ids: list[int], window: int) -> float:
    """exp(mean cross-entropy) over non-overlapping windows of `window` tokens (each predicts its next)."""
    total, count = 0.0, 0
    for start in range(0, len(ids) - 1, window):
        chunk = np.asarray(ids[start : start + window + 1], dtype=np.int64)
        if len(chunk) < 2:
            break
        x, y = chunk[:-1][None], chunk[1:]
        logits = full_logits(x)[0]
        total += cross_entropy(logits, y) * len(y)
        count += len(y)
    return math.exp(total / count)


# ---------------------------------------------------------------- the hardware limit


def cpu_read_bandwidth(threads: int, megabytes: int = 1024, repeats: int = 7) -> float:
    """Bytes/s of a multi-threaded sequential read, best of `repeats`: each thread takes the max of its
    own chunk (numpy's SIMD max streams memory at full speed and releases the GIL)."""
    chunk = megabytes * (1 << 20) // threads // 4
    arrays = [np.ones(chunk, dtype=np.float32) for _ in range(threads)]
    best = 0.0
    for _ in range(repeats):
        barrier = threading.Barrier(threads + 1)

        def work(a):
            barrier.wait()
            a.max()

        pool = [threading.Thread(target=work, args=(a,)) for a in arrays]
        for t in pool:
            t.start()
        barrier.wait()
        t0 = time.perf_counter()
        for t in pool:
            t.join()
        best = max(best, chunk * 4 * threads / (time.perf_counter() - t0))
    return best


def gpu_copy_bandwidth(megabytes: int = 1024, repeats: int = 10) -> float:
    """Bytes/s moved by a device-to-device copy (read + write counted), via PyTorch's CUDA."""
    a = torch.empty(megabytes << 20, dtype=torch.uint8, device="cuda")
    b = torch.empty_like(a)
    b.copy_(a)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(repeats):
        b.copy_(a)
    torch.cuda.synchronize()
    return 2 * a.numel() * repeats / (time.perf_counter() - t0)


BYTES = {Precision.fp32: 4, Precision.fp16: 2, Precision.int8: 1}


def decode_bytes_per_step(cfg: GPT2Config, precision: Precision, batch: int, context: int) -> float:
    """Bytes one decode step must read: every matrix once (the tied unembedding included; the
    embedding lookups read one row per token), biases and LayerNorms, and the KV cache."""
    C, L = cfg.n_embd, cfg.n_layer
    w = BYTES[precision]
    matrices = L * 12 * C * C + cfg.vocab_size * C
    small = L * 13 * C + 2 * C  # biases and LayerNorm parameters, kept fp32
    kv_bytes = 2 if precision is Precision.fp16 else 4
    kv = 2 * L * batch * context * C * kv_bytes
    return matrices * w + small * 4 + kv


def roofline_tokens_per_s(bandwidth: float, cfg: GPT2Config, precision: Precision, batch: int, context: int) -> float:
    return batch * bandwidth / decode_bytes_per_step(cfg, precision, batch, context)


# ---------------------------------------------------------------- memory


def reset_peak_rss() -> None:
    """Linux: writing 5 to clear_refs resets the peak RSS (VmHWM) of this process."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pass


def peak_rss_mb() -> float | None:
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return None


# ---------------------------------------------------------------- runs


@dataclass
class BenchSettings:
    model: str = "shakespeare"  # model name (as --model)
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
                raise UsageError(f"--{name.replace('_', '-')} must be at least 1")
        if self.warmup < 0:
            raise UsageError("--warmup must be >= 0")
        if not self.batches or min(self.batches) < 1:
            raise UsageError("--batch values must be at least 1")


def combos(s: BenchSettings) -> tuple[list[tuple[BackendKind, Precision]], list[dict]]:
    """Backend x precision pairs that exist, and the ones left out with the reason: PyTorch runs
    fp32 (fp16 on CUDA), int8 is ONNX Runtime's, fp16 needs CUDA."""
    run, skipped = [], []
    for b in s.backends:
        for p in s.precisions:
            if p is Precision.fp16 and s.provider is not ProviderKind.cuda:
                skipped.append({"backend": b.value, "precision": p.value, "reason": "fp16 runs on CUDA only"})
            elif b is BackendKind.torch and p is Precision.int8:
                skipped.append({"backend": b.value, "precision": p.value, "reason": "int8 is an ONNX Runtime export"})
            else:
                run.append((b, p))
    return run, skipped


def timed_generation(backend, prompt_ids: np.ndarray, new_tokens: int, sync: Callable[[], None]) -> dict:
    """One greedy run that never stops early: time to first token, then each decode step."""
    batch = prompt_ids.shape[0]
    mask = np.ones_like(prompt_ids)
    sampler = Sampler(SamplingSettings(greedy=True, max_new_tokens=new_tokens))
    sync()
    t0 = time.perf_counter()
    logits, past = backend.step(prompt_ids, mask, positions(mask, prompt_ids.shape[1]), None)
    nxt = sampler(logits)
    sync()
    ttft = time.perf_counter() - t0
    steps = []
    for _ in range(new_tokens - 1):
        t = time.perf_counter()
        mask = np.concatenate([mask, np.ones((batch, 1), dtype=np.int64)], axis=1)
        logits, past = backend.step(nxt[:, None], mask, positions(mask, 1), past)
        nxt = sampler(logits)
        sync()
        steps.append(time.perf_counter() - t)
    total = time.perf_counter() - t0
    return {"ttft_s": ttft, "steps_s": steps, "total_s": total}


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


def heldout_text() -> str:
    return (resources.files("gpt2x") / "data" / "heldout_shakespeare.txt").read_text(encoding="utf-8")


def read_text(path: Path | None) -> str:
    if path is None:
        return heldout_text()
    try:
        return path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise UsageError(f"cannot read --text {path}: {e}") from None


def ensure_export(precision: Precision, s: BenchSettings, model: GPT2, source, progress: Progress) -> Path:
    """The export folder for this precision, exported (and parity-gated) first when missing."""
    from .export import default_export_dir, export

    folder = default_export_dir(s.model, precision)
    if not (folder / "gpt2x.json").exists():
        progress(f"exporting {s.model} ({precision.value}) to {folder}")
        export(model, source, folder, precision, progress=progress)
    return folder


def make_backend(kind: BackendKind, precision: Precision, s: BenchSettings, model: GPT2, folder: Path | None):
    if kind is BackendKind.torch:
        device = "cuda" if s.provider is ProviderKind.cuda else "cpu"
        m = model if precision is Precision.fp32 else _half_copy(model)
        return TorchBackend(m, device)
    from .export import read_export
    from .runtime import OrtBackend

    return OrtBackend(read_export(folder), s.provider, s.threads)


def _half_copy(model: GPT2) -> GPT2:
    import copy

    return copy.deepcopy(model).half()


def full_logits_fn(backend):
    def run(x: np.ndarray) -> np.ndarray:
        mask = np.ones_like(x)
        return backend.run(x, mask, positions(mask, x.shape[1]), None)[0]

    return run


def sync_fn(s: BenchSettings) -> Callable[[], None]:
    if s.provider is ProviderKind.cuda and torch.cuda.is_available():
        return torch.cuda.synchronize
    return lambda: None


def run_bench(s: BenchSettings, model: GPT2, source, environment: dict, progress: Progress = lambda m: None) -> dict:
    """Every figure of the benchmark as one JSON-ready dict; `passed` is False when a gate fails."""
    cfg = model.config
    if s.prompt_len + s.new_tokens > cfg.n_positions:
        raise UsageError(f"--prompt-len + --new-tokens ({s.prompt_len + s.new_tokens}) exceed the context ({cfg.n_positions})")
    threads = s.threads or environment.get("cores") or os.cpu_count() or 1
    if s.provider is ProviderKind.cpu:
        torch.set_num_threads(threads)
    def measure_bandwidth() -> float:
        progress("measuring memory bandwidth")
        return gpu_copy_bandwidth() if s.provider is ProviderKind.cuda else cpu_read_bandwidth(threads)

    kind = "device-to-device copy (read + write)" if s.provider is ProviderKind.cuda else f"{threads}-thread sequential read"
    bandwidth = {"kind": kind, "samples_bytes_per_s": [measure_bandwidth()]}
    bandwidth["bytes_per_s"] = bandwidth["samples_bytes_per_s"][0]
    from .tokenizer import encode

    text_ids = encode(read_text(s.text))
    window = min(cfg.n_positions, 256)
    reference = TorchBackend(model)
    ref_ppl = perplexity(full_logits_fn(reference), text_ids, window)
    rng = np.random.default_rng(0)
    prompts = {b: rng.integers(0, cfg.vocab_size, (b, s.prompt_len), dtype=np.int64) for b in s.batches}
    sync = sync_fn(s)
    result = {
        "schema_version": SCHEMA_VERSION,
        "settings": {**asdict(s), "provider": s.provider.value, "backends": [b.value for b in s.backends],
                     "precisions": [p.value for p in s.precisions], "text": str(s.text or "bundled held-out Shakespeare"),
                     "threads": threads},
        "environment": environment,
        "model": {"name": s.model, "config": cfg.to_dict(), "parameters": model.num_parameters()},
        "bandwidth": bandwidth,
        "reference": {"backend": "torch", "precision": "fp32", "perplexity": ref_ppl, "text_tokens": len(text_ids)},
        "parity": [],
        "speed": [],
    }
    pairs, result["skipped"] = combos(s)
    for kind, precision in pairs:
        label = f"{kind.value}/{precision.value}"
        folder = ensure_export(precision, s, model, source, progress) if kind is BackendKind.ort else None
        progress(f"{label}: loading")
        reset_peak_rss()  # cold start and peak memory exclude the one-off export
        t0 = time.perf_counter()
        backend = make_backend(kind, precision, s, model, folder)
        first, first_mask = prompts[s.batches[0]], np.ones_like(prompts[s.batches[0]])
        backend.step(first, first_mask, positions(first_mask, s.prompt_len), None)
        sync()
        cold = time.perf_counter() - t0
        progress(f"{label}: parity")
        gate = check(model, backend, precision, s.greedy_tokens)
        ppl = perplexity(full_logits_fn(backend), text_ids, window)
        result["parity"].append({
            "backend": kind.value, "precision": precision.value, "passed": gate["status"] == "passed",
            "message": gate["message"], "logits": gate["logits"], "greedy": gate["greedy"],
            "perplexity": ppl, "perplexity_rel_change": ppl / ref_ppl - 1, "tolerance": gate["tolerance"],
        })
        for batch in s.batches:
            progress(f"{label}: batch {batch}, {s.warmup} warm-up + {s.repeat} timed runs")
            for _ in range(s.warmup):
                timed_generation(backend, prompts[batch], min(8, s.new_tokens), sync)
            runs = [timed_generation(backend, prompts[batch], s.new_tokens, sync) for _ in range(s.repeat)]
            run = median_run(runs)
            entry = {"run": run, "cold": cold, "backend": kind.value, "precision": precision.value, "batch": batch,
                     "peak_rss_mb": peak_rss_mb()}
            if s.provider is ProviderKind.cuda and kind is BackendKind.torch and torch.cuda.is_available():
                entry["peak_gpu_mb"] = torch.cuda.max_memory_allocated() / 2**20
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


def require_matplotlib():
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise UsageError("--plot needs matplotlib: pip install 'gpt2x[plot]'") from None
    return plt


def plot(result: dict, path: Path) -> None:
    """Decode tokens/s and per-token latency against context length, one line per configuration."""
    plt = require_matplotlib()
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.5))
    for e in result["speed"]:
        ctx = [p["context"] for p in e["latency_by_context"]]
        ms = [p["ms"] for p in e["latency_by_context"]]
        label = f"{e['backend']} {e['precision']} b{e['batch']}"
        ax1.plot(ctx, [e["batch"] * 1e3 / m for m in ms], marker="o", label=label)
        ax2.plot(ctx, ms, marker="o", label=label)
    ax1.set(xlabel="context length (tokens)", ylabel="decode tokens/s", title="decode throughput")
    ax2.set(xlabel="context length (tokens)", ylabel="ms per decode step (log scale)", title="per-token latency", yscale="log")
    env = result["environment"]
    fig.suptitle(f"gpt2x bench: {result['model']['name']} on {result['settings']['provider']} "
                 f"({env.get('cpu', '')}, {env.get('cores', '?')} cores; GPU: {env.get('gpu', 'none')})", fontsize=9)
    for ax in (ax1, ax2):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    tmp = path.with_name(path.name + ".tmp.png")
    fig.savefig(tmp, dpi=110)
    plt.close(fig)
    os.replace(tmp, path)
