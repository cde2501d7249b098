"""`gpt2x bench`: parity and speed of every backend x precision x batch, against the PyTorch fp32
reference and against the machine's own memory-bandwidth limit (roofline.py).

Without PyTorch installed, the bench runs ONNX Runtime exports that already exist: parity is then
the gate recorded in each export's metadata (no reference to compare against here), and perplexity
is reported without a reference figure.

With drafts (`--draft int4,ngram`), each backend x precision whose cache rolls back is also measured
with speculative decoding at batch 1 (`speculative` rows): greedy, each timed speculative run
interleaved with a plain run of the same target on the same prompt, against which it is compared
(speed, and whether the tokens are the same); plus the target's step cost over N = 1..8 new tokens,
which bounds what any draft can gain.
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
from ..generation.speculative import Drafter, DraftSettings, SpecStats, control_for, speculative_loop
from ..memory import peak_rss_mb, reset_peak_rss
from ..model.anatomy import total_params
from ..model.checkpoints import resolve_config
from ..numerics import positions
from ..runtime.base import Backend
from ..runtime.providers import default_precisions
from ..tokenizer import encode
from .roofline import cpu_read_bandwidth, gpu_copy_bandwidth, roofline_tokens_per_s

# 2: `speculative` rows, and the settings drafts, draft_tokens and prompt_text; 3: speed rows' native_share
# and native_ttft_ratio (against ort), and the web backend's page_* figures; 4: draft_tokens (settings and
# speculative rows) renamed num_speculative_tokens, vLLM's name (report.py reads both)
SCHEMA_VERSION = 4
STEP_COST_MAX_N = 8  # the target's step cost is measured over N = 1..8 new tokens


@dataclass
class BenchSettings:
    model: str = "shakespeare"  # model name: bundled, preset, hub repo, local path or random:NAME
    provider: ProviderKind = ProviderKind.cpu
    backends: list[BackendKind] = field(default_factory=lambda: [BackendKind.torch, BackendKind.ort])
    precisions: list[Precision] | None = None  # None: the provider's own (providers.default_precisions)
    batches: list[int] = field(default_factory=lambda: [1])
    prompt_len: int = 32  # prompt tokens per row
    new_tokens: int = 128  # generated tokens per row (EOS does not stop a benchmark run)
    repeat: int = 3  # timed runs per configuration; the median is reported
    warmup: int = 1  # untimed runs before timing
    threads: int | None = None  # CPU threads (default: all available cores)
    text: Path | None = None  # perplexity text (default: the bundled held-out Shakespeare excerpt)
    greedy_tokens: int = 32  # tokens of the greedy-agreement check
    # Speculative decoding, at batch 1: each draft (workflows.open_drafter: int4, int8, ngram, a model
    # or an export folder) on each backend x precision that rolls back its cache.
    drafts: list[str] = field(default_factory=list)
    num_speculative_tokens: int = DraftSettings.num_speculative_tokens  # K: the most tokens drafted per verification (adaptive below it)
    # The prompt of the speculative rows and their plain baseline, as text (its tokens, as many as it
    # encodes to); None: prompt_len random token ids, as the other rows.
    prompt_text: str | None = None

    def __post_init__(self) -> None:
        if self.precisions is None:
            self.precisions = default_precisions(self.provider)
        for name in ("prompt_len", "new_tokens", "repeat", "greedy_tokens"):
            if getattr(self, name) < 1:
                raise UsageError(f"{name} must be at least 1", option=name)
        if self.warmup < 0:
            raise UsageError("warmup must be >= 0", option="warmup")
        if not self.batches or min(self.batches) < 1:
            raise UsageError("batch sizes must be at least 1", option="batch")
        self.draft_settings()  # num_speculative_tokens in range
        if self.prompt_text is not None and not encode(self.prompt_text):
            raise UsageError("prompt_text is empty: it encodes to no tokens", option="prompt_text")

    def draft_settings(self) -> DraftSettings:
        """The drafts' settings: K up to num_speculative_tokens, adaptive (as `gpt2x generate --draft`)."""
        return DraftSettings(num_speculative_tokens=self.num_speculative_tokens)


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
    then each decode step (the sampler's tokens are on the host, so every step has finished).
    `decode_s` is the time from the first token to the last, over which each row decoded `decoded`
    tokens; `tokens` are each row's."""
    sampler = Sampler(SamplingSettings(greedy=True, max_new_tokens=new_tokens))
    steps: list[float] = []
    out: list[np.ndarray] = []
    page_ms = backend.page_ms if backend.capabilities.page else None  # each forward's time inside the page
    if page_ms is not None:
        page_ms.clear()
    ttft = None
    t0 = last = time.perf_counter()
    for nxt in decode_loop(backend, prompt_ids, np.ones_like(prompt_ids), sampler, new_tokens):
        now = time.perf_counter()
        if ttft is None:
            ttft = now - t0
        else:
            steps.append(now - last)
        last = now
        out.append(nxt)
    return {"ttft_s": ttft, "steps_s": steps, "decode_s": sum(steps), "decoded": len(steps),
            "total_s": time.perf_counter() - t0, "tokens": np.stack(out, axis=1).tolist(),
            "page_ms": None if page_ms is None else list(page_ms)}


def timed_speculative(target: Backend, drafter: Drafter, prompt_ids: list[int], new_tokens: int,
                      draft_settings: DraftSettings) -> dict:
    """One greedy run of speculative decoding (batch 1) that never stops early, timed as
    timed_generation: time to first token (the prefill's), then `decode_s` from the first token to
    the last, over which `decoded` tokens were produced (as they came: 1 to K + 1 per round); with
    the run's draft statistics (SpecStats) and each round's K."""
    sampler = Sampler(SamplingSettings(greedy=True, max_new_tokens=new_tokens))
    stats = SpecStats()
    control = control_for(draft_settings)
    tokens: list[int] = []
    ttft = first = last = None
    t0 = time.perf_counter()
    for chunk in speculative_loop(target, drafter, list(prompt_ids), sampler, new_tokens, control, stats):
        last = time.perf_counter()
        if first is None:
            first, ttft = last, last - t0
        tokens.extend(chunk)
    return {"ttft_s": ttft, "decode_s": last - first, "decoded": len(tokens) - 1, "total_s": time.perf_counter() - t0,
            "tokens": [tokens], "stats": stats, "k_history": list(control.history)}


def decode_rate(run: dict, batch: int = 1) -> float:
    """Decode tokens per second of a timed run (timed_generation or timed_speculative), the same
    measure for both: the tokens after the first over the time after the first."""
    return batch * run["decoded"] / run["decode_s"] if run["decode_s"] > 0 else float("nan")


def median_run(runs: list[dict]) -> dict:
    return sorted(runs, key=lambda r: r["total_s"])[len(runs) // 2]


def speed_entry(run: dict, batch: int, new_tokens: int, prompt_len: int, cold_s: float, roof: Callable[[int], float]) -> dict:
    steps = run["steps_s"]
    decode = decode_rate(run, batch)
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
        **page_figures(run, batch),
    }


def page_figures(run: dict, batch: int) -> dict:
    """The web backend's speed inside the page (its forwards' own times: no trip to Python), where
    the run recorded them: the prefill's time and the decode steps' tokens per second."""
    page = run.get("page_ms")
    if not page or len(page) < 2:
        return {}
    return {"page_ttft_ms": page[0], "page_decode_tokens_per_s": batch * (len(page) - 1) / (sum(page[1:]) / 1e3),
            "page_decode_latency": summarize_latencies([ms / 1e3 for ms in page[1:]])}


# ---------------------------------------------------------------- speculative decoding


def step_costs(backend: Backend, prompt_ids: list[int], max_n: int = STEP_COST_MAX_N, repeat: int = 3) -> list[float]:
    """Median ms of one target step over N = 1..max_n new tokens on a cache of the prompt's positions
    (batch 1): what verifying N - 1 drafted tokens costs. N = 1 is `step` (a plain decode step), N > 1
    `run` (all N positions' logits, as a verification). Each timed step is rolled back (`truncate`,
    not timed) to the prompt's cache; N interleaved in alternating order within each of `repeat`
    rounds, after one untimed round. N stops where the context ends."""
    n_past = len(prompt_ids)
    max_n = min(max_n, backend.n_positions - n_past)
    extra = np.random.default_rng(1).integers(0, backend.vocab_size, (1, max_n), dtype=np.int64)
    ids = np.asarray([prompt_ids], dtype=np.int64)
    mask = np.ones_like(ids)
    _, past = backend.step(ids, mask, positions(mask, n_past), None)
    times: dict[int, list[float]] = {n: [] for n in range(1, max_n + 1)}
    for r in range(repeat + 1):
        for n in (range(1, max_n + 1) if r % 2 else range(max_n, 0, -1)):
            m = np.ones((1, n_past + n), dtype=np.int64)
            forward = backend.step if n == 1 else backend.run
            t0 = time.perf_counter()
            _, past = forward(extra[:, :n], m, positions(m, n), past)
            seconds = time.perf_counter() - t0
            past = backend.truncate(past, n_past)
            if r:  # round 0 warms up
                times[n].append(seconds)
    return [float(np.median(times[n]) * 1e3) for n in times]


def first_difference(a: list[int], b: list[int]) -> int | None:
    """The first index where two token sequences differ (the shorter one's length when one is a
    prefix of the other), or None when they are equal."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def speculative_row(target: Backend, drafter: Drafter, prompt_ids: list[int], s: BenchSettings,
                    costs: list[float]) -> dict:
    """Speculative decoding with `drafter` against plain decoding of `target`, greedy, batch 1: after
    s.warmup untimed runs of each, s.repeat rounds of one plain run then one speculative run (so a
    machine's slow minutes hit both alike); speeds and time to first token are medians over the
    rounds, the draft statistics totals over the timed speculative runs (vLLM's counters), and the
    tokens of every speculative run are compared with the plain run's."""
    settings = s.draft_settings()
    ids = np.asarray([prompt_ids], dtype=np.int64)
    for _ in range(s.warmup):
        timed_generation(target, ids, min(8, s.new_tokens))
        timed_speculative(target, drafter, prompt_ids, s.new_tokens, settings)
    plain, spec = [], []
    for _ in range(s.repeat):
        plain.append(timed_generation(target, ids, s.new_tokens))
        spec.append(timed_speculative(target, drafter, prompt_ids, s.new_tokens, settings))
    total = SpecStats()
    for run in spec:
        st = run["stats"]
        total.drafted += st.drafted
        total.accepted += st.accepted
        total.drafts += st.drafts
        total.plain_steps += st.plain_steps
    reference = plain[0]["tokens"][0]
    differences = [d for d in (first_difference(run["tokens"][0], reference) for run in spec) if d is not None]
    plain_tps = float(np.median([decode_rate(run) for run in plain]))
    spec_tps = float(np.median([decode_rate(run) for run in spec]))
    return {
        "num_speculative_tokens": settings.num_speculative_tokens, "adaptive": settings.adaptive,
        "prompt_len": len(prompt_ids), "new_tokens": s.new_tokens, "timed_runs": s.repeat,
        "acceptance_rate": total.acceptance_rate, "mean_acceptance_length": total.mean_acceptance_length,
        "drafted": total.drafted, "accepted": total.accepted, "drafts": total.drafts, "plain_steps": total.plain_steps,
        "decode_tokens_per_s": spec_tps, "plain_decode_tokens_per_s": plain_tps, "speedup": spec_tps / plain_tps,
        "ttft_ms": float(np.median([run["ttft_s"] for run in spec]) * 1e3),
        "plain_ttft_ms": float(np.median([run["ttft_s"] for run in plain]) * 1e3),
        "step_cost_ms": costs, "step_cost_ratio": [c / costs[0] for c in costs],
        "greedy_identical": not differences, "first_difference": min(differences) if differences else None,
    }


def check_drafts(s: BenchSettings, pairs: list[tuple[BackendKind, Precision]]) -> None:
    """Refuse, before any work, a draft that cannot serve a benchmarked target (workflows.check_draft)
    on a backend that rolls back (the others are skipped, with the reason)."""
    for draft in s.drafts:
        for kind in {kind for kind, _ in pairs if workflows.capabilities_of(kind).rolls_back}:
            workflows.check_draft(draft, kind, s.provider)


def speculative_prompt(s: BenchSettings, prompts: dict[int, np.ndarray], vocab_size: int) -> list[int]:
    """The speculative rows' prompt: prompt_text's tokens, or the batch-1 prompt of the speed rows
    (random token ids; drawn as they are when batch 1 is not benchmarked)."""
    if s.prompt_text is not None:
        return encode(s.prompt_text)
    first = prompts[1] if 1 in prompts else np.random.default_rng(0).integers(0, vocab_size, (1, s.prompt_len), dtype=np.int64)
    return first[0].tolist()


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


def speculate(s: BenchSettings, kind: BackendKind, precision: Precision, backend: Backend, prompt_ids: list[int],
              result: dict, progress: Progress, loaded: tuple | None = None, notice: Progress = no_progress) -> None:
    """The speculative rows of one backend x precision, one per draft, or the reason it has none.
    A quantized draft of the model in memory (`loaded`) is exported from it when missing, rather
    than loaded again by open_drafter."""
    label = f"{kind.value}/{precision.value}"
    if not backend.capabilities.rolls_back:
        for draft in s.drafts:
            result["skipped"].append({"backend": kind.value, "precision": precision.value, "draft": draft,
                                      "reason": f"speculative decoding: the {backend.name} backend cannot roll back its KV cache"})
        return
    progress(f"{label}: step cost over N = 1..{STEP_COST_MAX_N} new tokens")
    costs = step_costs(backend, prompt_ids, repeat=max(5, s.repeat))
    for draft in s.drafts:
        if loaded is not None and draft in {p.value for p in Precision} and backend.model_name == s.model:
            workflows.ensure_export(s.model, Precision(draft), loaded=loaded, progress=progress, notice=notice)
        drafter = workflows.open_drafter(draft, backend, kind, s.provider, None, s.draft_settings(),
                                         progress=progress, notice=notice)
        progress(f"{label}: draft {draft}, {s.warmup} warm-up + {s.repeat} timed rounds (plain, speculative)")
        row = speculative_row(backend, drafter, prompt_ids, s, costs)
        result["speculative"].append({"backend": kind.value, "precision": precision.value, "draft": draft,
                                      "draft_name": drafter.name, **row})
        del drafter


def run_bench(s: BenchSettings, environment: dict, progress: Progress = no_progress,
              loaded: tuple | None = None, notice: Progress = no_progress) -> dict:
    """Every figure of the benchmark as one JSON-ready dict; `passed` is False when a gate fails.
    `loaded` is the PyTorch model and its source when the caller has it in memory already; `notice`
    hears that an export is about to be made, and where."""
    cfg = loaded[0].config if loaded else resolve_config(s.model)
    if s.prompt_len + s.new_tokens > cfg.n_positions:
        raise UsageError(f"prompt length + new tokens ({s.prompt_len + s.new_tokens}) exceed the context ({cfg.n_positions})")
    if s.drafts and s.prompt_text is not None and len(encode(s.prompt_text)) + s.new_tokens > cfg.n_positions:
        raise UsageError(f"prompt_text's {len(encode(s.prompt_text))} tokens + new tokens ({s.new_tokens}) exceed "
                         f"the context ({cfg.n_positions})", option="prompt_text")
    pairs, skipped = combos(s)
    check_drafts(s, pairs)
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
        "speculative": [],
        "skipped": skipped,
    }
    spec_prompt = speculative_prompt(s, prompts, cfg.vocab_size)
    for kind, precision in pairs:
        label = f"{kind.value}/{precision.value}"
        info = folder = None
        if kind is not BackendKind.torch:
            info = workflows.ensure_export(s.model, precision, loaded=loaded, progress=progress, notice=notice)
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
            if backend.capabilities.page:  # the page's memory: its peak over these runs
                backend.reset_page_memory()
            for _ in range(s.warmup):
                timed_generation(backend, prompts[batch], min(8, s.new_tokens))
            runs = [timed_generation(backend, prompts[batch], s.new_tokens) for _ in range(s.repeat)]
            entry = {"run": median_run(runs), "cold": cold, "backend": kind.value, "precision": precision.value,
                     "batch": batch, "peak_rss_mb": peak_rss_mb()}
            device_mb = backend.peak_device_memory_mb()
            if device_mb is not None:
                entry["peak_gpu_mb"] = device_mb
            if backend.capabilities.page:  # the memory of the process that holds the page (a browser's renderer)
                entry["page_memory_mb"] = backend.page_memory_mb()
                page = backend.page_info  # what ran it: onnxruntime-web's version, threads, isolation, browser
                entry["page"] = {k: page[k] for k in ("version", "threads", "crossOriginIsolated", "userAgent")}
            result["speed"].append(entry)
        if s.drafts:
            speculate(s, kind, precision, backend, spec_prompt, result, progress, loaded, notice)
        backend.close()
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
    native_shares(result["speed"])
    result["passed"] = all(p["passed"] for p in result["parity"])
    return result


def native_shares(speed: list[dict]) -> None:
    """Each row of another backend, against native ONNX Runtime's row at the same precision and batch
    in the same run (where there is one): `native_share`, its decode tok/s over ort's,
    `native_ttft_ratio`, its time to first token over ort's, and for the web backend
    `page_native_share`, the page's own decode tok/s over ort's."""
    native = {(e["precision"], e["batch"]): e for e in speed if e["backend"] == BackendKind.ort.value}
    for e in speed:
        ort = native.get((e["precision"], e["batch"]))
        if ort is not None and e is not ort:
            e["native_share"] = e["decode_tokens_per_s"] / ort["decode_tokens_per_s"]
            e["native_ttft_ratio"] = e["ttft_ms"] / ort["ttft_ms"]
            if "page_decode_tokens_per_s" in e:
                e["page_native_share"] = e["page_decode_tokens_per_s"] / ort["decode_tokens_per_s"]
