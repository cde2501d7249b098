"""The timing core every peer module shares: the contender protocol, the run context, and the
interleaved timing of one (batch size, prompt length).

A contender has
    name       "llama.cpp q8_0": one row of the table;
    engine     the library that runs the kernels ("torch", "ort", "openvino", "llama.cpp", "ctranslate2");
    runtime    the name without the precision: what "int4 vs int8" compares;
    precision  a gpt2x.choices.Precision (fp32, int8, int4): which roofline and which comparison row;
    batches    None (every batch size) or the set of batch sizes it runs;
    check(prompt, k) -> (B, k) int array: its first k greedy tokens (the warm-up, compared with
               transformers');
    run(prompt, n) -> {"total_s", "ttft_s"[, "steps_s"]}: one timed greedy generation of n tokens
               that EOS does not stop, from the call to the last token; ttft_s from the call to the
               first token chosen, steps_s the time between two consecutive tokens.
and optionally
    only       why it runs only `batches` (the "not run" row's reason);
    settle_s   idle time its threads need after a run before the next contender starts (GAP_S at least);
    details    a dict copied into each of its result rows (e.g. the GGUF type).

A peer module (one file in this package) has KEY (its --contenders name), ORDER (where its
contenders go in the run), LABEL (how a skip of the whole module is named) and load(ctx) -> list of
contenders; it records what it could not run in ctx.skip(...) and what it learnt in ctx.results.
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from gpt2x.bench.run import median_run
from gpt2x.choices import BackendKind, Precision
from gpt2x.evaluate.metrics import summarize_latencies
from gpt2x.onnx.interop import SPECIAL_TOKENS_FILE, TOKENIZER_CONFIG_FILE, TOKENIZER_FILE, special_tokens_map, tokenizer_config, tokenizer_json

CHECK_TOKENS = 16  # leading tokens of the warm-up run compared with transformers' (same work for all)
GAP_S = 0.05  # idle time between two contenders' runs (see THREADS below)
BATCH1_ONLY = "batch 1 only (hand loops and onnxruntime-genai's own loop)"

# THREADS. Each ONNX Runtime session keeps its own intra-op pool, whose threads spin-wait for work
# by default. Turning that off (session.intra_op.allow_spinning = "0") was measured with gpt2x
# running alone (random:gpt2, batch 1, 32 + 32 tokens, 4 interleaved runs each, this 2-core VM):
# fp32 70.7 -> 65.1 tok/s (-8%), int8 226.6 -> 172.0 tok/s (-24%). Spinning is part of how ORT
# reaches its speed at batch 1, so every session keeps the default; contenders never run at the
# same time (one after another, GAP_S apart, long enough for a finished pool to stop spinning;
# a contender whose pool spins longer says so in settle_s).


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def error_line(e: BaseException, limit: int = 600) -> str:
    """An exception as one line (for the skipped list and the .md): its type and message."""
    text = " / ".join(ln.strip() for ln in str(e).splitlines() if ln.strip())
    text = f"{type(e).__name__}: {text}" if text else type(e).__name__
    return text if len(text) <= limit else text[: limit - 3] + "..."


def rotated(items: list, r: int) -> list:
    """`items` in round r's order: rotated by r, so that each runs first in turn (this VM's speed drifts over minutes)."""
    k = r % len(items)
    return items[k:] + items[:k]


def paired_median(values: list[float], reference: list[float]) -> float:
    """The median over rounds of each round's value over the reference's in the same round: the ratio that drift
    between rounds leaves alone."""
    return statistics.median(v / ref for v, ref in zip(values, reference, strict=True))


def machine_line(env: dict) -> str:
    """A results page's "Machine:" line from gpt2x.bench.system.system_info() (with its "peer packages" added)."""
    return (f"Machine: {env['cpu']}, {env['cores']} cores, {env['platform']}; {env['date']}, gpt2x git {env['git']}; "
            + ", ".join(f"{k} {v}" for k, v in (env["packages"] | env["peer packages"]).items()) + ".")


def process_error(stderr: str, limit: int = 600) -> str:
    """The last meaningful lines of a failed tool's stderr, as one line."""
    lines = [ln.strip() for ln in stderr.strip().splitlines() if ln.strip()]
    text = " / ".join(lines[-3:]) or "no output"
    return text if len(text) <= limit else "..." + text[-(limit - 3):]


class Contender(Protocol):
    name: str
    engine: str
    runtime: str
    precision: Precision
    batches: set[int] | None

    def check(self, prompt: np.ndarray, k: int) -> np.ndarray: ...

    def run(self, prompt: np.ndarray, n: int) -> dict: ...


@dataclass
class Context:
    """What every peer module's load() gets: the weights, where to work, the run's settings."""

    hf_dir: Path  # the Hugging Face folder (config.json + model.safetensors) every peer converts from
    work: Path  # a temporary folder for conversions, removed after the run
    threads: int  # physical cores: every runtime's intra-op threads
    model: Any  # gpt2x's GPT2 (the same weights)
    source: Any  # where gpt2x loaded it from (workflows.load_model)
    model_name: str  # --model
    exports_dir: Path  # --exports: where gpt2x's exports go
    precisions: list[Precision]  # --precisions
    kinds: list[BackendKind]  # --gpt2x-backends
    max_prompt: int  # the longest --prompt-len
    new_tokens: int  # --new-tokens
    results: dict  # the run's JSON: "skipped" and each module's own record
    shared: dict = field(default_factory=dict)  # what one module makes for others (gpt2x's exports, ...)

    def skip(self, name: str, reason: str) -> None:
        self.results["skipped"][name] = reason
        log(f"{name}: skipped ({reason})")

    def hf_dir_with_tokenizer(self) -> Path:
        """hf_dir's files (links to the very same config.json and model.safetensors) plus GPT-2's
        tokenizer files as gpt2x writes them beside its exports: the converters (llama.cpp's
        convert_hf_to_gguf.py, ct2-transformers-converter) read the vocabulary from the folder too."""
        if "hf_tokenizer_dir" not in self.shared:
            folder = self.work / "hf-with-tokenizer"
            folder.mkdir(parents=True)
            for p in self.hf_dir.iterdir():
                (folder / p.name).symlink_to(p.resolve())
            for name, data in ((TOKENIZER_FILE, tokenizer_json()), (TOKENIZER_CONFIG_FILE, tokenizer_config(self.model.config)),
                               (SPECIAL_TOKENS_FILE, special_tokens_map())):
                (folder / name).write_text(json.dumps(data, indent=1, ensure_ascii=False) + "\n", encoding="utf-8")
            self.shared["hf_tokenizer_dir"] = folder
        return self.shared["hf_tokenizer_dir"]


class StampedLoop:
    """A contender whose _generate(prompt, n, stamps) appends a clock stamp as each token is chosen."""

    batches: set[int] | None = None

    def _generate(self, prompt: np.ndarray, n: int, stamps: list[float]) -> np.ndarray:
        raise NotImplementedError

    def check(self, prompt: np.ndarray, k: int) -> np.ndarray:
        return self._generate(prompt, k, [])

    def run(self, prompt: np.ndarray, n: int) -> dict:
        stamps: list[float] = []
        t0 = time.perf_counter()
        self._generate(prompt, n, stamps)
        return {"total_s": time.perf_counter() - t0, "ttft_s": stamps[0] - t0, "steps_s": [float(x) for x in np.diff(stamps)]}



def first_difference(a: np.ndarray, b: np.ndarray) -> int | None:
    """The first token position where any row differs (None: the same tokens)."""
    if a.shape != b.shape:
        return 0
    diff = np.nonzero((a != b).any(axis=0))[0]
    return int(diff[0]) if len(diff) else None


def is_reference(name: str) -> bool:
    """Whether a contender (or result row) of this name is transformers', the reference."""
    return name.startswith("transformers")


def runs_here(c, batch: int) -> bool:
    return c.batches is None or batch in c.batches


def time_batch(contenders: list, prompt: np.ndarray, new_tokens: int, repeat: int,
               label: str | None = None) -> tuple[list[dict], list[dict], dict]:
    """One (batch size, prompt length): warm-up (and token check) for each, then `repeat` rounds of
    one run each, order rotated. A contender whose warm-up fails (transformers' excepted) is left out
    of this set and returned in the third value, {"NAME, LABEL": reason}; `label` defaults to
    "batch B". Returns the result rows (median run, every run), the contenders not run at this
    batch size, and those failures."""
    b, prompt_len = prompt.shape
    label = label or f"batch {b}"
    active = [c for c in contenders if runs_here(c, b)]
    k = min(CHECK_TOKENS, new_tokens)
    checks, failed = {}, {}
    for c in list(active):
        log(f"{label}: {c.name}: warm-up")
        try:
            checks[c.name] = c.check(prompt, k)
        except Exception as e:
            if is_reference(c.name):
                raise  # the reference every ratio divides by
            failed[f"{c.name}, {label}"] = f"warm-up failed: {error_line(e)}"
            log(f"{label}: {c.name}: warm-up failed ({error_line(e)}); left out")
            active.remove(c)
    reference = next(checks[c.name] for c in active if is_reference(c.name))
    runs: dict[str, list[dict]] = {c.name: [] for c in active}
    for r in range(repeat):
        order = active[r % len(active):] + active[: r % len(active)]
        log(f"{label}: round {r + 1}/{repeat}")
        for c in order:
            runs[c.name].append(c.run(prompt, new_tokens))
            time.sleep(max(GAP_S, getattr(c, "settle_s", 0.0)))
    results = []
    for c in active:
        rs = runs[c.name]
        e2e = [b * new_tokens / x["total_s"] for x in rs]
        decode = [b * (new_tokens - 1) / max(x["total_s"] - x["ttft_s"], 1e-9) for x in rs]
        ttfts = [x["ttft_s"] for x in rs]
        med = median_run(rs)
        i = rs.index(med)
        entry = {"name": c.name, "engine": c.engine, "runtime": c.runtime, "precision": c.precision.value, "batch": b,
                 "prompt_len": prompt_len,
                 "e2e_tokens_per_s": e2e[i], "decode_tokens_per_s": decode[i], "total_s": med["total_s"],
                 "prefill_s": med["ttft_s"], "ttft_s": float(np.median(ttfts)), "e2e_min": min(e2e), "e2e_max": max(e2e),
                 "e2e_tokens_per_s_runs": e2e, "decode_tokens_per_s_runs": decode,
                 "total_s_runs": [x["total_s"] for x in rs], "ttft_s_runs": ttfts,
                 "check_tokens": k, "first_difference_vs_transformers": first_difference(checks[c.name], reference)}
        entry |= getattr(c, "details", {})
        if med.get("steps_s"):
            entry["decode_latency"] = summarize_latencies(med["steps_s"])
        results.append(entry)
    not_run = [{"name": c.name, "batch": b, "prompt_len": prompt_len, "reason": getattr(c, "only", BATCH1_ONLY)}
               for c in contenders if not runs_here(c, b)]
    return results, not_run, failed
