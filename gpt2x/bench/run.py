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

`run_bench` returns a `results.BenchResult`: typed rows, built once, serialised once (its `to_json`).
"""

from __future__ import annotations

import dataclasses
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from ..choices import BackendKind, KvCache, Precision, Progress, ProviderKind, no_progress
from ..errors import ProviderError, UsageError
from ..evaluate.metrics import heldout_text, perplexity, summarize_latencies
from ..evaluate.parity import check
from ..generation.decode import Sequence, decode_steps
from ..generation.settings import SamplingSettings
from ..generation.speculative import Drafter, DraftSettings, SpecStats
from ..memory import peak_rss_mb, reset_peak_rss
from ..model.anatomy import total_params
from ..model.checkpoints import resolve_config
from ..model.config import GPT2Config
from ..numerics import positions
from ..onnx.artifact import ExportInfo
from ..runtime.base import Backend
from ..runtime.providers import default_precisions
from ..runtime.registry import cannot_roll_back, capabilities_of, unsupported
from ..runtime.static_decode import FIXED_CACHE, StaticDecoder, fixed_cache_refusal
from ..tokenizer import encode
from ..workflows.backends import open_backend, torch_backend
from ..workflows.drafts import check_draft, open_drafter
from ..workflows.exports import ensure_export
from ..workflows.models import load_model, torch_available
from .results import (
    Bandwidth,
    BenchResult,
    ContextLatency,
    Environment,
    ModelFacts,
    PageFigures,
    ParityRow,
    Reference,
    RunSettings,
    Skipped,
    SpeculativeRow,
    SpeedRow,
)
from .roofline import cpu_read_bandwidth, gpu_copy_bandwidth, roofline_tokens_per_s

STEP_COST_MAX_N = 8  # the target's step cost is measured over N = 1..8 new tokens
# The reference every row is compared with is the backend whose record says `reference` (PyTorch on
# the model in memory); the result names it even where PyTorch is missing and its record unreadable.
REFERENCE = BackendKind.torch


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
    # Speculative decoding, at batch 1: each draft (workflows.drafts.open_drafter: int4, int8, ngram, a model
    # or an export folder) on each backend x precision that rolls back its cache.
    drafts: list[str] = field(default_factory=list)
    num_speculative_tokens: int = DraftSettings.num_speculative_tokens  # K: the most tokens drafted per verification (adaptive below it)
    # The prompt of the speculative rows and their plain baseline, as text (its tokens, as many as it
    # encodes to); None: prompt_len random token ids, as the other rows.
    prompt_text: str | None = None
    kv_cache: KvCache = KvCache.auto  # the native (ort) rows' KV cache form; the other backends keep their own
    # The ort rows timed again on runtime.static_decode.StaticDecoder (fixed-capacity cache, argmax in the graph, a
    # CUDA graph on CUDA) where the precision allows it (fixed_cache_refusal); None: on CUDA only.
    fixed_cache: bool | None = None

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
        if self.kv_cache is not KvCache.auto and not any(capabilities_of(k).native for k in self.backends):
            raise UsageError(f"kv_cache {self.kv_cache.value} applies to the ort rows, and none is asked for", option="kv_cache")
        if self.kv_cache is KvCache.slots:
            raise UsageError("kv_cache slots is the server's (gpt2x serve): the bench times a batch decoding alone",
                             option="kv_cache")
        if self.kv_cache is KvCache.fixed:
            raise UsageError("kv_cache fixed is gpt2x generate's: the bench times the fixed cache beside each ort row",
                             option="kv_cache")
        if self.prompt_text is not None and not encode(self.prompt_text):
            raise UsageError("prompt_text is empty: it encodes to no tokens", option="prompt_text")
        if self.fixed_cache:
            if not any(capabilities_of(k).native for k in self.backends):
                raise UsageError("fixed_cache times the ort rows, and none is asked for", option="fixed_cache")
            reasons = [fixed_cache_refusal(self.provider, p) for p in self.precisions]
            if all(reasons):
                raise UsageError(reasons[0], option="fixed_cache")

    def fixed_rows(self, kind: BackendKind, precision: Precision) -> bool:
        """Whether `kind` at `precision` is also timed on the fixed-capacity cache."""
        wanted = self.provider is ProviderKind.cuda if self.fixed_cache is None else self.fixed_cache
        return wanted and capabilities_of(kind).native and fixed_cache_refusal(self.provider, precision) is None

    def draft_settings(self) -> DraftSettings:
        """The drafts' settings: K up to num_speculative_tokens, adaptive (as `gpt2x generate --draft`)."""
        return DraftSettings(num_speculative_tokens=self.num_speculative_tokens)

    def recorded(self, threads: int) -> RunSettings:
        """These settings as the result records them: the thread count used, the text by its path."""
        return RunSettings(
            model=self.model, provider=self.provider, backends=list(self.backends), precisions=list(self.precisions),
            batches=list(self.batches), prompt_len=self.prompt_len, new_tokens=self.new_tokens, repeat=self.repeat,
            warmup=self.warmup, threads=threads, text=str(self.text or "bundled held-out Shakespeare"),
            greedy_tokens=self.greedy_tokens, drafts=list(self.drafts), num_speculative_tokens=self.num_speculative_tokens,
            prompt_text=self.prompt_text, kv_cache=self.kv_cache.value, fixed_cache=self.fixed_cache)


def label(kind: BackendKind, precision: Precision) -> str:
    return f"{kind.value}/{precision.value}"


# ---------------------------------------------------------------- before any work


def check_context(s: BenchSettings, cfg: GPT2Config) -> None:
    """Refuse settings whose prompts and new tokens do not fit the model's context."""
    if s.prompt_len + s.new_tokens > cfg.n_positions:
        raise UsageError(f"prompt length + new tokens ({s.prompt_len + s.new_tokens}) exceed the context ({cfg.n_positions})")
    if s.drafts and s.prompt_text is not None and len(encode(s.prompt_text)) + s.new_tokens > cfg.n_positions:
        raise UsageError(f"prompt_text's {len(encode(s.prompt_text))} tokens + new tokens ({s.new_tokens}) exceed "
                         f"the context ({cfg.n_positions})", option="prompt_text")


def combos(s: BenchSettings) -> tuple[list[tuple[BackendKind, Precision]], list[Skipped]]:
    """Backend x precision pairs that run on the provider, and the ones left out with the reason
    (runtime.registry.unsupported: what each backend's record says it runs, and where)."""
    run, skipped = [], []
    for b in s.backends:
        for p in s.precisions:
            reason = unsupported(b, s.provider, p)
            if reason:
                skipped.append(Skipped(backend=b, precision=p, reason=str(reason)))
            else:
                run.append((b, p))
    return run, skipped


def check_drafts(s: BenchSettings, pairs: list[tuple[BackendKind, Precision]]) -> None:
    """Refuse, before any work, a draft that cannot serve a benchmarked target (workflows.drafts.check_draft)
    on a backend that rolls back (the others are skipped, with the reason)."""
    for draft in s.drafts:
        for kind in {kind for kind, _ in pairs if capabilities_of(kind).rolls_back}:
            check_draft(draft, kind, s.provider)


# ---------------------------------------------------------------- memory bandwidth


def bandwidth_kind(provider: ProviderKind, threads: int) -> str:
    return "device-to-device copy (read + write)" if provider is ProviderKind.cuda else f"{threads}-thread sequential read"


def measure_bandwidth(provider: ProviderKind, threads: int, progress: Progress = no_progress) -> float:
    """One sample of the bandwidth the roofline divides, in bytes/s."""
    progress("measuring memory bandwidth")
    return gpu_copy_bandwidth() if provider is ProviderKind.cuda else cpu_read_bandwidth(threads)


# ---------------------------------------------------------------- timing


def timed_generation(backend: Backend, prompt_ids: np.ndarray, new_tokens: int) -> dict:
    """One greedy run of the prompts (B, L) through the decode loop (generation.decode.decode_steps)
    that never stops early (ignore_eos): time to first token, then each decode step (the tokens are
    on the host, so every step has finished). `decode_s` is the time from the first token to the
    last, over which each row decoded `decoded` tokens; `tokens` are each row's."""
    settings = SamplingSettings(greedy=True, max_new_tokens=new_tokens, ignore_eos=True)
    seqs = [Sequence(row.tolist(), settings) for row in prompt_ids]
    steps: list[float] = []
    page_ms = backend.page_ms if backend.capabilities.page else None  # each forward's time inside the page
    if page_ms is not None:
        page_ms.clear()
    ttft = None
    t0 = last = time.perf_counter()
    for _ in decode_steps(backend, seqs):
        now = time.perf_counter()
        if ttft is None:
            ttft = now - t0
        else:
            steps.append(now - last)
        last = now
    return {"ttft_s": ttft, "steps_s": steps, "decode_s": sum(steps), "decoded": len(steps),
            "total_s": time.perf_counter() - t0, "tokens": [s.tokens for s in seqs],
            "page_ms": None if page_ms is None else list(page_ms)}


def timed_speculative(target: Backend, drafter: Drafter, prompt_ids: list[int], new_tokens: int,
                      draft_settings: DraftSettings) -> dict:
    """One greedy run of speculative decoding (batch 1) through the decode loop that never stops early
    (ignore_eos), timed as timed_generation: time to first token (the prefill's), then `decode_s`
    from the first token to the last, over which `decoded` tokens were produced (as they came: 1 to
    K + 1 per round); with the run's draft statistics (SpecStats) and each round's K."""
    seq = Sequence(list(prompt_ids), SamplingSettings(greedy=True, max_new_tokens=new_tokens, ignore_eos=True))
    ttft = first = last = None
    t0 = time.perf_counter()
    for _ in decode_steps(target, [seq], drafter, draft_settings):
        last = time.perf_counter()
        if first is None:
            first, ttft = last, last - t0
    stats = seq.speculation
    return {"ttft_s": ttft, "decode_s": last - first, "decoded": len(seq.tokens) - 1, "total_s": time.perf_counter() - t0,
            "tokens": [seq.tokens], "stats": stats, "k_history": list(stats.k_history)}


def timed_fixed(decoder, prompt_ids: np.ndarray, new_tokens: int) -> dict:
    """One greedy run on a StaticDecoder, timed as timed_generation: the prefill and the first tokens (chosen on the
    host), then the steps in the decoder's blocks, as `gpt2x generate` runs them (StaticDecoder.steps: its tokens
    copied back, so it has finished); each step of a block is given the block's time over its steps."""
    steps: list[float] = []
    out = np.empty((prompt_ids.shape[0], new_tokens), np.int64)
    t0 = time.perf_counter()
    out[:, 0] = decoder.prefill(prompt_ids)
    ttft = time.perf_counter() - t0
    last = t0 + ttft
    for i in range(1, new_tokens, decoder.block):
        k = min(decoder.block, new_tokens - i)
        out[:, i:i + k] = decoder.steps(k)
        now = time.perf_counter()
        steps += [(now - last) / k] * k
        last = now
    return {"ttft_s": ttft, "steps_s": steps, "decode_s": sum(steps), "decoded": len(steps),
            "total_s": time.perf_counter() - t0, "tokens": out.tolist(), "page_ms": None}


def decode_rate(run: dict, batch: int = 1) -> float:
    """Decode tokens per second of a timed run (timed_generation or timed_speculative), the same
    measure for both: the tokens after the first over the time after the first."""
    return batch * run["decoded"] / run["decode_s"] if run["decode_s"] > 0 else float("nan")


def median_run(runs: list[dict]) -> dict:
    return sorted(runs, key=lambda r: r["total_s"])[len(runs) // 2]


def open_timed(s: BenchSettings, kind: BackendKind, precision: Precision, info: ExportInfo | None, prompt: np.ndarray,
               threads: int, loaded: tuple | None, progress: Progress = no_progress) -> tuple[Backend, float]:
    """The backend of `kind` at `precision` (on `info`'s export, or the model in memory), and its cold
    start: opening it and its first step on `prompt` (peak memory is counted from here on, so the
    one-off export is left out of both)."""
    progress(f"{label(kind, precision)}: loading")
    reset_peak_rss()
    t0 = time.perf_counter()
    folder = info.folder if info is not None else None
    backend = open_backend(kind, s.provider, None if folder else s.model, precision=precision,
                           onnx_dir=folder, threads=threads, loaded=loaded, in_place_kv=s.kv_cache.in_place_kv)
    backend.step(prompt, np.ones_like(prompt), positions(np.ones_like(prompt), s.prompt_len), None)
    return backend, time.perf_counter() - t0


@dataclass(frozen=True)
class Timing:
    """One backend x precision x batch as timed: the median run (timed_generation's) and the memory
    it took. Its speed row is made once every pair has run (speed_row): the roofline needs the
    bandwidth measured last, the share of native ort's row."""

    backend: BackendKind
    precision: Precision
    batch: int
    run: dict
    cold_start_s: float
    peak_rss_mb: float
    peak_gpu_mb: float | None
    page_memory_mb: float | None  # capabilities.page: the page's process, peak over these runs
    page_info: dict[str, Any] | None  # capabilities.page: what ran it (onnxruntime-web's version, threads, ...)
    prefill: str | None = None  # the runtime that ran the prompt, where the backend says (ort: onnxruntime or openvino)
    decoder: str | None = None  # the ort rows timed on StaticDecoder: which (FIXED_CACHE, FIXED_CACHE_GRAPH)
    same_tokens: float | None = None  # those rows: the share of their tokens equal to the ort row's


def time_batch(backend: Backend, kind: BackendKind, precision: Precision, prompt: np.ndarray, cold_s: float,
               s: BenchSettings) -> Timing:
    """s.warmup untimed runs, then s.repeat timed ones of `backend` on `prompt` (one row per batch
    item); the median run, and the peak memory of process, device and page."""
    page = backend.capabilities.page
    if page:  # the page's memory: its peak over these runs
        backend.reset_page_memory()
    for _ in range(s.warmup):
        timed_generation(backend, prompt, min(8, s.new_tokens))
    runs = [timed_generation(backend, prompt, s.new_tokens) for _ in range(s.repeat)]
    rss = peak_rss_mb()
    device_mb = backend.peak_device_memory_mb()
    page_mb = backend.page_memory_mb() if page else None
    info = backend.page_info if page else None
    prefill = backend.prefill_runtime(prompt.shape[1], prompt.shape[0]) if hasattr(backend, "prefill_runtime") else None
    return Timing(backend=kind, precision=precision, batch=prompt.shape[0], run=median_run(runs), cold_start_s=cold_s,
                  peak_rss_mb=rss, peak_gpu_mb=device_mb, page_memory_mb=page_mb,
                  page_info=None if info is None else {k: info[k] for k in ("version", "threads", "crossOriginIsolated", "userAgent")},
                  prefill=prefill)


def time_fixed(s: BenchSettings, info: ExportInfo, precision: Precision, prompt: np.ndarray, threads: int,
               plain: Timing) -> Timing:
    """The ort row of `plain` timed again on a StaticDecoder of `prompt`'s rows and the run's positions (a CUDA graph
    on CUDA): cold start (made, its graph captured, and its first prefill), s.warmup + s.repeat runs as time_batch's,
    and the share of its tokens equal to `plain`'s (greedy both: a near tie may flip at fp16)."""
    reset_peak_rss()
    graph = s.provider is ProviderKind.cuda
    t0 = time.perf_counter()
    decoder = StaticDecoder(info, s.provider, rows=prompt.shape[0], capacity=s.prompt_len + s.new_tokens,
                            cuda_graph=graph, threads=threads)
    try:
        decoder.prefill(prompt)
        cold_s, name = time.perf_counter() - t0, decoder.name
        for _ in range(s.warmup):
            timed_fixed(decoder, prompt, min(8, s.new_tokens))
        runs = [timed_fixed(decoder, prompt, s.new_tokens) for _ in range(s.repeat)]
    finally:
        decoder.close()
    run = median_run(runs)
    same = float(np.mean(np.asarray(run["tokens"]) == np.asarray(plain.run["tokens"])))
    return Timing(backend=plain.backend, precision=precision, batch=prompt.shape[0], run=run, cold_start_s=cold_s,
                  peak_rss_mb=peak_rss_mb(), peak_gpu_mb=None, page_memory_mb=None, page_info=None,
                  decoder=name, same_tokens=same)


def speed_row(t: Timing, new_tokens: int, prompt_len: int, roof_tps: float) -> SpeedRow:
    """A timed row's figures; `roof_tps` is the roofline's tokens/s halfway through the run's context."""
    run, batch = t.run, t.batch
    steps = run["steps_s"]
    decode = decode_rate(run, batch)
    # Per-token latency along the context, in 8 buckets, for the plot.
    buckets = np.array_split(np.arange(len(steps)), min(8, max(1, len(steps))))
    by_context = [ContextLatency(context=int(prompt_len + 1 + b[len(b) // 2]), ms=float(np.median([steps[i] for i in b]) * 1e3))
                  for b in buckets if len(b)]
    return SpeedRow(
        backend=t.backend, precision=t.precision, batch=batch, cold_start_s=t.cold_start_s, ttft_ms=run["ttft_s"] * 1e3,
        decode_latency=summarize_latencies(steps) if steps else {}, decode_tokens_per_s=decode,
        e2e_tokens_per_s=batch * new_tokens / run["total_s"], roofline_tokens_per_s=roof_tps,
        roofline_share=decode / roof_tps, latency_by_context=by_context, peak_rss_mb=t.peak_rss_mb,
        peak_gpu_mb=t.peak_gpu_mb, page=page_figures(t), prefill=t.prefill, decoder=t.decoder, same_tokens=t.same_tokens,
    )


def page_figures(t: Timing) -> PageFigures | None:
    """The web backend's speed inside the page (its forwards' own times: no trip to Python), where
    the run recorded them: the prefill's time and the decode steps' tokens per second; with the
    page's memory and what ran it. None for a backend without a page."""
    if t.page_info is None:
        return None
    page = t.run.get("page_ms")
    if not page or len(page) < 2:
        return PageFigures(memory_mb=t.page_memory_mb, info=t.page_info)
    return PageFigures(memory_mb=t.page_memory_mb, info=t.page_info, ttft_ms=page[0],
                       decode_tokens_per_s=t.batch * (len(page) - 1) / (sum(page[1:]) / 1e3),
                       decode_latency=summarize_latencies([ms / 1e3 for ms in page[1:]]))


def speed_rows(timings: list[Timing], s: BenchSettings, cfg: GPT2Config, bytes_per_s: float) -> list[SpeedRow]:
    """The speed rows, against the roofline at `bytes_per_s` and against the native backend's rows (its rows on
    a fixed-cache decoder against its plain ones too)."""
    mid_context = s.prompt_len + s.new_tokens // 2
    return native_shares([speed_row(t, s.new_tokens, s.prompt_len,
                                    roofline_tokens_per_s(bytes_per_s, cfg, t.precision, t.batch, mid_context))
                          for t in timings])


def native_shares(speed: list[SpeedRow]) -> list[SpeedRow]:
    """Each row of another backend, against the native backend's row (ONNX Runtime's, its record's
    `native`) at the same precision and batch in the same run (where there is one): `native_share`,
    its decode tok/s over native's, `native_ttft_ratio`, its time to first token over native's, and
    for a backend with a page `page.native_share`, the page's own decode tok/s over native's."""
    native = {(e.precision, e.batch): e for e in speed if capabilities_of(e.backend).native and e.decoder is None}
    out = []
    for e in speed:
        ort = native.get((e.precision, e.batch))
        if ort is not None and e is not ort:
            page = e.page
            if page is not None and page.decode_tokens_per_s is not None:
                page = dataclasses.replace(page, native_share=page.decode_tokens_per_s / ort.decode_tokens_per_s)
            e = dataclasses.replace(e, native_share=e.decode_tokens_per_s / ort.decode_tokens_per_s,
                                    native_ttft_ratio=e.ttft_ms / ort.ttft_ms, page=page)
        out.append(e)
    return out


# ---------------------------------------------------------------- parity


@dataclass(frozen=True)
class Baseline:
    """What every backend's parity is measured against: the reference backend (None without
    PyTorch), the perplexity text's tokens, the window it is scored in, and the reference's perplexity."""

    reference: Backend | None
    text_ids: list[int]
    window: int
    perplexity: float | None


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


def baseline(s: BenchSettings, cfg: GPT2Config, loaded: tuple | None, threads: int) -> Baseline:
    """The reference on the CPU (where the model is loaded) and its perplexity on the bench's text."""
    text_ids = encode(read_text(s.text))
    window = min(cfg.n_positions, 256)
    reference = torch_backend(loaded[0], ProviderKind.cpu, s.model, threads=threads) if loaded else None
    ref_ppl = perplexity(full_logits_fn(reference), text_ids, window) if reference else None
    return Baseline(reference=reference, text_ids=text_ids, window=window, perplexity=ref_ppl)


def gate_figures(base: Baseline, backend: Backend, precision: Precision, info: ExportInfo | None,
                 greedy_tokens: int) -> dict[str, Any]:
    """A parity row's gate: measured against the reference, or, with no PyTorch here to measure, the
    gate the export passed when it was made (its metadata's)."""
    if base.reference is not None or info is None:
        gate = check(base.reference, backend, precision, greedy_tokens)
        return {"source": "measured against torch fp32", "passed": gate["status"] == "passed",
                "message": gate["message"], "logits": gate["logits"], "greedy": gate["greedy"],
                "tolerance": gate["tolerance"]}
    recorded = info.meta.get("parity", {})
    return {"source": "recorded at export (no PyTorch installed to measure)",
            "passed": recorded.get("status") == "passed", "message": recorded.get("message", recorded.get("status", "")),
            "logits": recorded.get("logits"), "greedy": recorded.get("greedy"), "tolerance": recorded.get("tolerance")}


def parity_row(base: Baseline, kind: BackendKind, precision: Precision, backend: Backend, info: ExportInfo | None,
               greedy_tokens: int) -> ParityRow:
    """One backend x precision's parity gate and perplexity, against the baseline."""
    ppl = perplexity(full_logits_fn(backend), base.text_ids, base.window)
    return ParityRow(backend=kind, precision=precision, **gate_figures(base, backend, precision, info, greedy_tokens),
                     perplexity=ppl, perplexity_rel_change=ppl / base.perplexity - 1 if base.perplexity else None)


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
            past = past.truncate(n_past)
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


def speculative_row(kind: BackendKind, precision: Precision, draft: str, target: Backend, drafter: Drafter,
                    prompt_ids: list[int], s: BenchSettings, costs: list[float]) -> SpeculativeRow:
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
    return SpeculativeRow(
        backend=kind, precision=precision, draft=draft, draft_name=drafter.name,
        num_speculative_tokens=settings.num_speculative_tokens, adaptive=settings.adaptive,
        prompt_len=len(prompt_ids), new_tokens=s.new_tokens, timed_runs=s.repeat,
        acceptance_rate=total.acceptance_rate, mean_acceptance_length=total.mean_acceptance_length,
        drafted=total.drafted, accepted=total.accepted, drafts=total.drafts, plain_steps=total.plain_steps,
        decode_tokens_per_s=spec_tps, plain_decode_tokens_per_s=plain_tps, speedup=spec_tps / plain_tps,
        ttft_ms=float(np.median([run["ttft_s"] for run in spec]) * 1e3),
        plain_ttft_ms=float(np.median([run["ttft_s"] for run in plain]) * 1e3),
        step_cost_ms=costs, step_cost_ratio=[c / costs[0] for c in costs],
        greedy_identical=not differences, first_difference=min(differences) if differences else None,
    )


def speculative_prompt(s: BenchSettings, prompts: dict[int, np.ndarray], vocab_size: int) -> list[int]:
    """The speculative rows' prompt: prompt_text's tokens, or the batch-1 prompt of the speed rows
    (random token ids; drawn as they are when batch 1 is not benchmarked)."""
    if s.prompt_text is not None:
        return encode(s.prompt_text)
    first = prompts[1] if 1 in prompts else np.random.default_rng(0).integers(0, vocab_size, (1, s.prompt_len), dtype=np.int64)
    return first[0].tolist()


def speculate(s: BenchSettings, kind: BackendKind, precision: Precision, backend: Backend, prompt_ids: list[int],
              progress: Progress = no_progress, loaded: tuple | None = None,
              notice: Progress = no_progress) -> tuple[list[SpeculativeRow], list[Skipped]]:
    """The speculative rows of one backend x precision, one per draft, or, where its cache cannot
    roll back, each draft skipped with the reason. A quantized draft of the model in memory
    (`loaded`) is exported from it when missing, rather than loaded again by open_drafter."""
    if not backend.capabilities.rolls_back:
        reason = str(cannot_roll_back(backend.name))
        return [], [Skipped(backend=kind, precision=precision, draft=draft, reason=reason) for draft in s.drafts]
    progress(f"{label(kind, precision)}: step cost over N = 1..{STEP_COST_MAX_N} new tokens")
    costs = step_costs(backend, prompt_ids, repeat=max(5, s.repeat))
    rows = []
    for draft in s.drafts:
        if loaded is not None and draft in {p.value for p in Precision} and backend.model_name == s.model:
            ensure_export(s.model, Precision(draft), loaded=loaded, progress=progress, notice=notice)
        drafter = open_drafter(draft, backend, kind, s.provider, None, s.draft_settings(),
                               progress=progress, notice=notice)
        progress(f"{label(kind, precision)}: draft {draft}, {s.warmup} warm-up + {s.repeat} timed rounds (plain, speculative)")
        rows.append(speculative_row(kind, precision, draft, backend, drafter, prompt_ids, s, costs))
        del drafter
    return rows, []


# ---------------------------------------------------------------- the whole benchmark


def prepare_export(s: BenchSettings, kind: BackendKind, precision: Precision, loaded: tuple | None,
                   progress: Progress = no_progress, notice: Progress = no_progress) -> ExportInfo | None:
    """The export a backend of `kind` runs at `precision`, made first when missing (from the model
    in memory where there is one); None for the reference, which runs the model itself."""
    if capabilities_of(kind).reference:
        return None
    return ensure_export(s.model, precision, loaded=loaded, progress=progress, notice=notice)


def run_bench(s: BenchSettings, environment: dict, progress: Progress = no_progress,
              loaded: tuple | None = None, notice: Progress = no_progress) -> BenchResult:
    """Every figure of the benchmark; its `passed` is False when a gate fails. `environment` is the
    machine's record (system.system_info); `loaded` is the PyTorch model and its source when the
    caller has it in memory already; `notice` hears that an export is about to be made, and where."""
    env = Environment.from_dict(environment)
    cfg = loaded[0].config if loaded else resolve_config(s.model)
    check_context(s, cfg)
    pairs, skipped = combos(s)
    check_drafts(s, pairs)
    threads = s.threads or env.cores or os.cpu_count() or 1
    if loaded is None and (torch_available() or any(capabilities_of(k).reference for k in s.backends)):
        progress(f"loading {s.model}")
        loaded = load_model(s.model)  # a missing torch is one clear error here
    first_sample = measure_bandwidth(s.provider, threads, progress)
    base = baseline(s, cfg, loaded, threads)
    rng = np.random.default_rng(0)
    prompts = {b: rng.integers(0, cfg.vocab_size, (b, s.prompt_len), dtype=np.int64) for b in s.batches}
    spec_prompt = speculative_prompt(s, prompts, cfg.vocab_size)
    parity: list[ParityRow] = []
    timings: list[Timing] = []
    speculative: list[SpeculativeRow] = []
    for kind, precision in pairs:
        most = capabilities_of(kind).max_batch
        batches = [b for b in s.batches if most is None or b <= most]
        skipped += [Skipped(backend=kind, precision=precision, reason=f"batch {b}: {capabilities_of(kind).runtime} batches "
                            f"at most {most} rows (gpt2x runs more as one generator a row, which is not its speed)")
                    for b in s.batches if b not in batches]
        if not batches:
            continue
        info = prepare_export(s, kind, precision, loaded, progress, notice)
        backend, cold_s = open_timed(s, kind, precision, info, prompts[batches[0]], threads, loaded, progress)
        with backend:
            progress(f"{label(kind, precision)}: parity")
            parity.append(parity_row(base, kind, precision, backend, info, s.greedy_tokens))
            fixed = s.fixed_rows(kind, precision)
            for batch in batches:
                progress(f"{label(kind, precision)}: batch {batch}, {s.warmup} warm-up + {s.repeat} timed runs")
                timings.append(time_batch(backend, kind, precision, prompts[batch], cold_s, s))
                if fixed:
                    progress(f"{label(kind, precision)}: batch {batch} on the {FIXED_CACHE}")
                    try:
                        timings.append(time_fixed(s, info, precision, prompts[batch], threads, timings[-1]))
                    except ProviderError as e:  # an export StaticDecoder cannot run (weights in a data file)
                        skipped.append(Skipped(backend=kind, precision=precision, reason=f"{FIXED_CACHE}: {e}"))
                        fixed = False
            if s.drafts:
                rows, skips = speculate(s, kind, precision, backend, spec_prompt, progress, loaded, notice)
                speculative += rows
                skipped += skips
    # On a shared machine the bandwidth varies over minutes: measure again at the end and take the
    # higher figure, so that a transient slowdown cannot make the roofline look easy to reach.
    samples = [first_sample, measure_bandwidth(s.provider, threads, progress)]
    bandwidth = Bandwidth(kind=bandwidth_kind(s.provider, threads), samples_bytes_per_s=samples, bytes_per_s=max(samples))
    return BenchResult(
        settings=s.recorded(threads), environment=env,
        model=ModelFacts(name=s.model, config=cfg.to_dict(), parameters=total_params(cfg)),
        bandwidth=bandwidth, reference=Reference(backend=REFERENCE, precision=Precision.fp32, perplexity=base.perplexity,
                                                 text_tokens=len(base.text_ids)),
        parity=parity, speed=speed_rows(timings, s, cfg, bandwidth.bytes_per_s), speculative=speculative, skipped=skipped,
    )
