"""16 prompts at once, in process: gpt2x's serving engine (and its offline Python API) beside OpenVINO GenAI's
continuous batching.

    .venv-peers/bin/python benchmarks/batch_peers.py --out benchmarks/results/batch-peers-cpu-2core
        [--prompts 16] [--prompt-len 32] [--new-tokens 64] [--rounds 3] [--precisions fp32,int8,bf16]
        [--gpt2x-backends served] [--gpt2x-kv-caches auto] [--gpt2x-batched auto] [--gpt2x-kv-dtypes auto]
        [--genai-kv-caches auto]
        [--contenders gpt2x,gpt2x-offline,openvino-genai]

The same weights on every side: GPT-2 124M with seeded random weights (--model random:gpt2), --prompts
prompts of --prompt-len random tokens (seeded), each generating --new-tokens greedy tokens that EOS
neither stops nor is chosen for, all handed over at once; output tok/s = prompts x new tokens / the
wall time from handing them over to the last token.

- gpt2x: the serving engine `gpt2x serve` runs (gpt2x.serve.core.engine.Engine, max batch = --prompts, its
  defaults otherwise: continuous batching, chunked prefill, prefix cache) on gpt2x's export at each
  precision (workflows.ensure_export, parity-gated when made; threads = cores), on the backend and KV cache
  `gpt2x serve` opens for it (serve.replica.open_backend: the ort backend's fixed slots where they run the export
  by default, the openvino backend's paged slots for bf16 and, with --gpt2x-backends served, for an fp32 export with an
  OpenVINO prefill graph, else the backend's own cache), with --gpt2x-kv-caches
  slots on the backend's fixed slots asked for (the openvino backend's paged ones at fp32 too), and with in-place on
  the backend's own cache (export_backend), every prompt submitted as one Row (greedy, min_tokens = max_new_tokens = --new-tokens);
  the batched and KV dtype switches below run on the cache in place (the KV dtype's on the slots where
  --gpt2x-kv-caches has slots, given as `gpt2x serve --kv-cache-dtype` gives it); with --gpt2x-batched
  auto,off, the ort backend twice on the same int8 export: running a step on its batched decode graph from the
  record's batched_from, and never (model.onnx alone, as before that graph); with --gpt2x-kv-dtypes auto,float,
  the ort backend on an export that kept int8 KV scales (int8; fp32 made with --int8-kv) with its cache as the
  record says and in float32;
  at bf16 (a CPU that computes it), gpt2x's bf16 export on the backend gpt2x picks for it (openvino), as `gpt2x
  serve --precision bf16` runs it;
- gpt2x's offline API (`gpt2x.LLM(export).generate(prompts as token ids, SamplingParams(max_tokens = min_tokens =
  --new-tokens, temperature 0))`, vLLM's shape): the same engine behind a call that returns once every prompt is
  done, each prompt a completions request of the OpenAI layer, so the figure is what that layer adds; it has no
  per-row first-token time (TTFT and TPOT not shown);
- OpenVINO GenAI: ov_genai.ContinuousBatchingPipeline on the folder optimum-intel converted from the
  same weights (int8 and fp32 weights, peers/openvino_genai.py's convert), at OpenVINO's default compute
  precision on this CPU and at f32 (bf16: the fp32 weights at its default compute, bf16 on such a CPU, the
  default its users get; refused where the default is f32), INFERENCE_NUM_THREADS = cores, its default SchedulerConfig (paged
  KV cache, dynamic split-fuse), every prompt added at once (add_request, greedy configs) and the pipeline
  stepped until none is left, as its generate() does; its KV cache in
  the CPU plugin's default precision (u8 on a CPU), and with --genai-kv-caches auto,f32 again in f32
  (KV_CACHE_PRECISION, as gpt2x's fp32 export keeps its cache).

Each contender runs once unmeasured (its tokens kept for the check), then --rounds rounds run each once,
in an order rotated every round (this VM's memory bandwidth drifts over minutes); the figure is the
median round; paired, the median over rounds of a row's output tok/s over the first row's in the same round. Every
round has prompts of its own (the same for every contender in it), so neither
engine's prefix cache finds a prompt it has seen. The check: how many rows' first 16 tokens equal gpt2x's at fp32 (bf16 compute may differ).
Writes OUT.json (every run, the settings, the environment with the machine) and OUT.md (the table).
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import sys
import tempfile
import threading
import time
from contextlib import contextmanager
from dataclasses import asdict
from pathlib import Path

import numpy as np
from peers.core import Context, error_line, log, machine_line, paired_median, rotated
from peers.openvino_genai import F32, WEIGHT_FORMATS, compute_variants, convert, greedy_config, optimum_cli

from gpt2x.bench.report import save_results
from gpt2x.bench.system import installed_versions, system_info
from gpt2x.choices import BackendKind, Precision, ProviderKind
from gpt2x.errors import Gpt2xError
from gpt2x.generation.settings import SamplingSettings
from gpt2x.model.weights import save_hf
from gpt2x.onnx.artifact import default_export_dir
from gpt2x.runtime.base import kv_cache_name
from gpt2x.runtime.kvdtype import KV_DTYPE_ENV
from gpt2x.runtime.providers import physical_cores
from gpt2x.serve.core.engine import Engine, EngineSettings, Row
from gpt2x.serve.core.outputs import Failed, Finished, Output, TokenOut
from gpt2x.serve.replica import ReplicaConfig, on_slots, open_backend, served_backend
from gpt2x.workflows.backends import choose_backend, export_backend
from gpt2x.workflows.exports import ensure_export
from gpt2x.workflows.models import load_model

CHECK_TOKENS = 16
CONTENDERS = ("gpt2x", "gpt2x-offline", "openvino-genai")
SERVED = "served"  # --gpt2x-backends: the backend `gpt2x serve` takes (serve.replica.served_backend)


@contextmanager
def env_set(name: str, value: str | None):
    """`name` set to `value` meanwhile (None: left as it is)."""
    before = os.environ.get(name)
    if value is not None:
        os.environ[name] = value
    try:
        yield
    finally:
        if value is not None:
            if before is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = before


class Gpt2xEngine:
    """gpt2x's serving engine on one backend; a run submits every prompt at once and waits for all. `kv_cache` "auto":
    the backend `gpt2x serve` opens (its KV cache as the server's `--kv-cache auto` chooses); "slots": the backend's fixed
    slots asked for (`--kv-cache slots`: the ort backend's, the openvino backend's paged ones); "in-place": export_backend,
    which the batched and KV dtype switches choose for."""

    def __init__(self, backend_kind: BackendKind, info, threads: int, batch: int, batched: bool | None = None,
                 kv_cache_dtype: str | None = None, kv_cache: str = "auto"):
        self.settings = EngineSettings(max_batch_size=batch)
        config = ReplicaConfig(export=str(info.folder), model_id="", backend=backend_kind.value, threads=threads,
                               engine=self.settings, fixed_slots=True if kv_cache == "slots" else None)
        slots = (kv_cache == "slots" or kv_cache == "auto" and batched is None and kv_cache_dtype in (None, "auto")) \
            and on_slots(config, info)
        kind = " paged" if slots and backend_kind is BackendKind.openvino else " slots" if slots else ""
        self.name = f"gpt2x engine {backend_kind.value} {info.precision.value}{kind}" \
            + (" batched-off" if batched is False else "") \
            + (f" {kv_cache_dtype} KV cache" if kv_cache_dtype not in (None, "auto") else "")
        self.precision = info.precision.value
        if slots:  # the KV dtype as `gpt2x serve --kv-cache-dtype` gives it to the slots: in the environment
            with env_set(KV_DTYPE_ENV, kv_cache_dtype if kv_cache_dtype not in (None, "auto") else None):
                self.backend = open_backend(config, info)
        else:
            self.backend = export_backend(backend_kind, info, ProviderKind.cpu, threads, batched=batched,
                                          kv_cache_dtype=kv_cache_dtype)
            if self.backend.capabilities.warms_up:  # as gpt2x serve opens it
                self.backend.warm_up()
        held = self.backend.capabilities.kv_cache_dtype  # OpenVINO's u8 cache on the paged slots, where the export has it
        self.name += f" {held} KV cache" if held else ""
        self.engine = Engine(self.backend, self.settings).start()
        self.details = {"engine_settings": asdict(self.settings), "kv_cache": kind.strip() or "in place",
                        "prefill": getattr(self.backend, "prefill", None),
                        "batched_from": getattr(self.backend, "batched_from", None),
                        "kv_cache_dtype": kv_cache_name(self.backend) or "float32"}

    def run(self, prompts: np.ndarray, n: int) -> dict:
        B = len(prompts)
        tokens: list[list[int]] = [[] for _ in range(B)]
        first, last = [0.0] * B, [0.0] * B
        left = [B]
        done, lock = threading.Event(), threading.Lock()
        errors: list[str] = []

        def sink_for(i: int):
            def sink(out: Output) -> None:
                if isinstance(out, TokenOut):
                    last[i] = time.perf_counter()
                    if not tokens[i]:
                        first[i] = last[i]
                    tokens[i].append(out.token)
                elif isinstance(out, (Finished, Failed)):
                    if isinstance(out, Failed):
                        errors.append(out.message)
                    with lock:
                        left[0] -= 1
                        if left[0] == 0:
                            done.set()
            return sink

        settings = SamplingSettings(max_new_tokens=n, greedy=True, min_tokens=n)
        rows = [Row(p.tolist(), settings, sink_for(i)) for i, p in enumerate(prompts)]
        t0 = time.perf_counter()
        self.engine.submit(rows)
        done.wait()
        wall = time.perf_counter() - t0
        if errors:
            raise RuntimeError(f"{self.name}: {errors[0]}")
        tpot = [(e - f) / (len(t) - 1) for f, e, t in zip(first, last, tokens) if len(t) > 1]
        return {"wall_s": wall, "ttft_s": [f - t0 for f in first], "tpot_s": tpot, "tokens": tokens}

    def close(self) -> None:
        self.engine.close()


class Gpt2xOffline:
    """gpt2x's offline Python API (gpt2x.LLM) on an export: a run hands every prompt to one generate() call."""

    def __init__(self, info, threads: int, batch: int):
        from gpt2x import LLM

        self.name = f"gpt2x offline API ort {info.precision.value}"
        self.precision = info.precision.value
        self.llm = LLM(str(info.folder), threads=threads, max_batch_size=batch)
        self.details = {"api": "gpt2x.LLM.generate"}

    def run(self, prompts: np.ndarray, n: int) -> dict:
        from gpt2x import SamplingParams

        params = SamplingParams(max_tokens=n, min_tokens=n, temperature=0)
        t0 = time.perf_counter()
        outputs = self.llm.generate([p.tolist() for p in prompts], params, progress=False)
        wall = time.perf_counter() - t0
        return {"wall_s": wall, "ttft_s": [math.nan], "tpot_s": [math.nan],
                "tokens": [list(o.outputs[0].token_ids) for o in outputs]}

    def close(self) -> None:
        self.llm.close()


class OvContinuousBatching:
    """OpenVINO GenAI's ContinuousBatchingPipeline, its default SchedulerConfig. A run adds every prompt (add_request)
    and steps the pipeline until no request is left, as its generate() does, in Python so that each row's first and
    last tokens are timed on this script's clock, as gpt2x's are: its own perf_metrics time the first token from a
    later point than the submission (docs/results/engines.md, where the targets stand)."""

    def __init__(self, folder: Path, weight_format: str, compute: str, properties: dict, kv_cache: str = "auto"):
        import openvino as ov
        import openvino_genai as ov_genai

        self.ov = ov
        self.name = f"OpenVINO GenAI {weight_format} ({compute})" + ("" if kv_cache == "auto" else f" {kv_cache} KV cache")
        if kv_cache != "auto":
            properties = properties | {"KV_CACHE_PRECISION": kv_cache}
        self.precision = {v: k for k, v in WEIGHT_FORMATS.items()}[weight_format].value
        if compute == "bf16" and weight_format == WEIGHT_FORMATS[Precision.fp32]:
            self.precision = Precision.bf16.value  # fp32 weights computed in bf16: the peer of gpt2x's bf16
        scheduler = ov_genai.SchedulerConfig()
        self.pipe = ov_genai.ContinuousBatchingPipeline(str(folder), scheduler, "CPU", properties)
        self.requests = 0
        self.details = {"ov_weight_format": weight_format, "ov_compute_precision": compute, "ov_properties": properties,
                        "scheduler_config": scheduler.to_string()}

    def run(self, prompts: np.ndarray, n: int) -> dict:
        inputs = [self.ov.Tensor(np.ascontiguousarray(p[None, :], dtype=np.int64)) for p in prompts]
        config = greedy_config(n)
        B = len(prompts)
        tokens: list[list[int]] = [[] for _ in range(B)]
        first, last = [0.0] * B, [0.0] * B
        t0 = time.perf_counter()
        handles = []
        for x in inputs:
            self.requests += 1
            handles.append(self.pipe.add_request(self.requests, x, config))
        while self.pipe.has_non_finished_requests():
            self.pipe.step()
            now = time.perf_counter()
            for i, handle in enumerate(handles):
                if handle.can_read():
                    for out in handle.read().values():  # greedy: one sequence a request
                        if out.generated_ids:
                            first[i] = first[i] or now
                            last[i] = now
                            tokens[i].extend(out.generated_ids)
        wall = time.perf_counter() - t0
        tpot = [(e - f) / (len(t) - 1) for f, e, t in zip(first, last, tokens) if len(t) > 1]
        return {"wall_s": wall, "ttft_s": [f - t0 for f in first], "tpot_s": tpot, "tokens": tokens}

    def close(self) -> None:
        pass


def parse_list(text: str, allowed, option: str, ap: argparse.ArgumentParser) -> list[str]:
    values = list(dict.fromkeys(t.strip() for t in text.split(",") if t.strip()))
    bad = [v for v in values if v not in allowed]
    if bad or not values:
        ap.error(f"{option}: one or more of {', '.join(allowed)}")
    return values


def open_contenders(args, ctx: Context, threads: int, skipped: dict) -> list:
    contenders = []
    precisions = [Precision(p) for p in args.precisions]
    if "gpt2x" in args.contenders:
        for precision in precisions:
            info = ensure_export(args.model, precision, folder=default_export_dir(args.model, precision, args.exports),
                                           loaded=(ctx.model, ctx.source), progress=log, notice=log)
            # bf16: the backend gpt2x picks for it (main refused bf16 on a CPU without it)
            kinds = [kind for kind, only in args.gpt2x_backends if only in (None, precision.value)] \
                if precision is not Precision.bf16 else [choose_backend(None, precision, ProviderKind.cpu).value]
            # served: the backend `gpt2x serve` takes for the export when none is asked
            kinds = list(dict.fromkeys(served_backend(info, ProviderKind.cpu).value if k == SERVED else k for k in kinds))
            for kind in kinds:
                # the batched decode graph's switch: the ort backend's option, on the int8 exports that have one
                choices = args.gpt2x_batched if kind == "ort" and info.batched is not None else ["auto"]
                # and the KV cache's dtype: the ort backend's option, on the exports that kept int8 scales
                dtypes = args.gpt2x_kv_dtypes if kind == "ort" and info.int8_kv is not None else ["auto"]
                # the server's default and (--gpt2x-kv-caches in-place) the cache in place, where they differ; the
                # batched and KV dtype switches are the cache in place's
                variants = [(choice, dtype, cache) for choice in choices for dtype in dtypes
                            for cache in (args.gpt2x_kv_caches if (choice, dtype) == ("auto", "auto") else
                                          ["slots" if "slots" in args.gpt2x_kv_caches and choice == "auto" else "in-place"])]
                names = set()
                for choice, dtype, cache in variants:
                    try:
                        engine = Gpt2xEngine(BackendKind(kind), info, threads, args.prompts,
                                             None if choice == "auto" else False, dtype, cache)
                    except Exception as e:
                        skipped[f"gpt2x engine {kind} {precision.value}"] = error_line(e)
                        continue
                    if engine.name in names:  # the server's default is the cache in place here
                        engine.close()
                        continue
                    names.add(engine.name)
                    contenders.append(engine)
    if "gpt2x-offline" in args.contenders:
        for precision in precisions:
            info = ensure_export(args.model, precision, folder=default_export_dir(args.model, precision, args.exports),
                                 loaded=(ctx.model, ctx.source), progress=log, notice=log)
            try:
                contenders.append(Gpt2xOffline(info, threads, args.prompts))
            except Exception as e:
                skipped[f"gpt2x offline API {precision.value}"] = error_line(e)
    if "openvino-genai" in args.contenders:
        try:
            variants = compute_variants(threads)
        except ImportError as e:
            skipped["OpenVINO GenAI"] = f"not importable here: {e}"
            variants = {}
        opened: set[tuple[str, str]] = set()  # (weights, compute): fp32 and bf16 both run fp32 weights at bf16
        folders: dict[str, Path] = {}  # weight format -> its converted folder, converted once
        for precision in precisions if variants else []:
            fmt = WEIGHT_FORMATS.get(precision, WEIGHT_FORMATS[Precision.fp32])
            computes = variants if precision is not Precision.bf16 else {c: v for c, v in variants.items() if c == "bf16"}
            if precision is Precision.bf16 and not computes:
                skipped["OpenVINO GenAI bf16"] = "OpenVINO's default compute on this CPU is f32 (no bf16)"
                continue
            computes = {c: v for c, v in computes.items() if (fmt, c) not in opened}
            if not computes:
                continue
            if fmt not in folders:
                try:
                    folders[fmt], _ = convert(ctx.hf_dir_with_tokenizer(), fmt, ctx.work / f"openvino-{fmt}")
                except Exception as e:
                    skipped[f"OpenVINO GenAI {fmt}"] = error_line(e)
                    continue
            folder = folders[fmt]
            for compute, properties in computes.items():
                opened.add((fmt, compute))
                for kv_cache in args.genai_kv_caches:
                    try:
                        contenders.append(OvContinuousBatching(folder, fmt, compute, properties, kv_cache))
                    except Exception as e:
                        skipped[f"OpenVINO GenAI {fmt} ({compute}, {kv_cache} KV cache)"] = error_line(e)
    for name, reason in skipped.items():
        log(f"{name}: skipped ({reason})")
    return contenders


def table(rows: list[dict]) -> str:
    out = ["| engine | precision | output tok/s | spread | over the first row's, paired | wall s | TTFT mean ms | TPOT mean ms | "
           "rows = gpt2x fp32 (first 16 tokens) |", "|---|---|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        out.append(f"| {r['name']} | {r['precision']} | {r['output_tokens_per_s']:.1f} | {r['min']:.1f}-{r['max']:.1f} | "
                   f"{r['paired_ratio']:.3f} | {r['wall_s']:.2f} | {r['ttft_mean_ms']:.1f} | {r['tpot_mean_ms']:.1f} | "
                   f"{r['rows_matching'] if r['rows_matching'] is not None else '-'} |")
    return "\n".join(out)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results/batch-peers-cpu-2core"))
    ap.add_argument("--model", default="random:gpt2", help="gpt2x model name (default: GPT-2 124M, seeded random weights)")
    ap.add_argument("--exports", type=Path, default=Path("exported"), help="where gpt2x's exports go")
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3, help="interleaved rounds (each contender once per round)")
    ap.add_argument("--precisions", default="fp32,int8", help="fp32, int8, bf16 (default: %(default)s)")
    ap.add_argument("--gpt2x-backends", default=SERVED, help="gpt2x backends in the engine: ort, openvino, or served "
                    "(the one `gpt2x serve` takes for the export when none is asked: ort, or openvino for an fp32 export "
                    "with an OpenVINO prefill graph), each for every precision or for one (openvino@fp32) "
                    "(default: %(default)s)")
    ap.add_argument("--gpt2x-kv-caches", default="auto", help="the engine's KV cache: auto (as `gpt2x serve` opens the "
                    "export: the ort backend's fixed slots where they run it by default, the openvino backend's paged slots for bf16 "
                    "and for an fp32 export with an OpenVINO prefill graph), "
                    "slots (the backend's fixed slots, where it has them: the openvino backend's paged ones at fp32 too), "
                    "in-place (the backend's own cache); all: auto,slots,in-place")
    ap.add_argument("--gpt2x-batched", default="auto", help="the ort backend's batched decode graph, where an int8 "
                    "export has one: auto (from its recorded batched_from), off (never); both: auto,off")
    ap.add_argument("--gpt2x-kv-dtypes", default="auto", help="the ort backend's KV cache dtype, where an int8 export "
                    "kept int8 scales: auto (as its record says), int8, float; several: auto,float")
    ap.add_argument("--genai-kv-caches", default="auto", help="OpenVINO GenAI's KV cache precision: auto (the CPU "
                    "plugin's default, u8), f32, bf16, u8; several: auto,f32")
    ap.add_argument("--contenders", default=",".join(CONTENDERS))
    args = ap.parse_args()
    args.precisions = parse_list(args.precisions, [*(p.value for p in WEIGHT_FORMATS), Precision.bf16.value],
                                 "--precisions", ap)
    kinds = ["ort", "openvino", SERVED]
    args.gpt2x_backends = [tuple(v.split("@")) if "@" in v else (v, None) for v in parse_list(
        args.gpt2x_backends, kinds + [f"{k}@{p}" for k in kinds for p in args.precisions], "--gpt2x-backends", ap)]
    if Precision.bf16.value in args.precisions:
        try:  # bf16 on a CPU without it (or without openvino): one line, before any export
            choose_backend(None, Precision.bf16, ProviderKind.cpu)
        except Gpt2xError as e:
            ap.error(f"--precisions bf16: {e}")
    args.contenders = parse_list(args.contenders, CONTENDERS, "--contenders", ap)
    args.gpt2x_kv_caches = parse_list(args.gpt2x_kv_caches, ["auto", "slots", "in-place"], "--gpt2x-kv-caches", ap)
    args.gpt2x_batched = parse_list(args.gpt2x_batched, ["auto", "off"], "--gpt2x-batched", ap)
    args.gpt2x_kv_dtypes = parse_list(args.gpt2x_kv_dtypes, ["auto", "int8", "float"], "--gpt2x-kv-dtypes", ap)
    args.genai_kv_caches = parse_list(args.genai_kv_caches, ["auto", "f32", "bf16", "u8"], "--genai-kv-caches", ap)
    if min(args.prompts, args.prompt_len, args.new_tokens, args.rounds) < 1:
        ap.error("--prompts, --prompt-len, --new-tokens and --rounds must be at least 1")
    threads = physical_cores()
    env = system_info()
    env["peer packages"] = installed_versions("openvino", "openvino-genai", "openvino-tokenizers", "onnxruntime", "onnxruntime-gpu")
    model, source = load_model(args.model)
    if args.prompt_len + args.new_tokens > model.config.n_positions:
        ap.error("--prompt-len + --new-tokens exceeds the model's positions")
    rng = np.random.default_rng(0)
    prompt_sets = [rng.integers(0, model.config.vocab_size, (args.prompts, args.prompt_len), dtype=np.int64)
                   for _ in range(args.rounds + 1)]  # [0]: the warm-up's (the check), then one per round
    skipped: dict[str, str] = {}
    runs: dict[str, list[dict]] = {}
    with tempfile.TemporaryDirectory(prefix="gpt2x-batch-peers-") as tmp:
        hf_dir = Path(tmp) / "hf"
        save_hf(model, hf_dir)
        ctx = Context(hf_dir=hf_dir, work=Path(tmp), threads=threads, model=model, source=source, model_name=args.model,
                      exports_dir=args.exports, precisions=[], kinds=[], max_prompt=args.prompt_len,
                      new_tokens=args.new_tokens, results={"skipped": skipped})
        contenders = open_contenders(args, ctx, threads, skipped)
        if not contenders:
            raise SystemExit("no contender could run: " + "; ".join(f"{k}: {v}" for k, v in skipped.items()))
        checks = {}
        for c in list(contenders):
            log(f"{c.name}: warm-up")
            try:
                checks[c.name] = c.run(prompt_sets[0], args.new_tokens)["tokens"]
            except Exception as e:
                skipped[c.name] = f"warm-up failed: {error_line(e)}"
                log(f"{c.name}: warm-up failed ({error_line(e)}); left out")
                contenders.remove(c)
        for r in range(args.rounds):
            order = rotated(contenders, r)
            log(f"round {r + 1}/{args.rounds}")
            for c in order:
                run = c.run(prompt_sets[r + 1], args.new_tokens)
                run["output_tokens"] = sum(len(t) for t in run.pop("tokens"))
                runs.setdefault(c.name, []).append(run)
                log(f"  {c.name}: {run['output_tokens'] / run['wall_s']:.1f} output tok/s")
                time.sleep(0.05)
        for c in contenders:
            c.close()

    reference = checks.get("gpt2x engine ort fp32 slots") or checks.get("gpt2x engine ort fp32") \
        or next((checks[c.name] for c in contenders if c.name.startswith("gpt2x")), None)
    rows = []
    for c in contenders:
        rs = runs[c.name]
        tps = [x["output_tokens"] / x["wall_s"] for x in rs]
        med = sorted(rs, key=lambda x: x["wall_s"])[len(rs) // 2]
        matching = None if reference is None else sum(
            a[:CHECK_TOKENS] == b[:CHECK_TOKENS] for a, b in zip(checks[c.name], reference, strict=True))
        first = [x["output_tokens"] / x["wall_s"] for x in runs[contenders[0].name]]
        rows.append({"name": c.name, "precision": c.precision, "output_tokens_per_s": med["output_tokens"] / med["wall_s"],
                     "paired_ratio": paired_median(tps, first),
                     "min": min(tps), "max": max(tps), "wall_s": med["wall_s"], "output_tokens": med["output_tokens"],
                     "ttft_mean_ms": 1e3 * statistics.fmean(med["ttft_s"]), "tpot_mean_ms": 1e3 * statistics.fmean(med["tpot_s"]),
                     "rows_matching": matching,
                     "output_tokens_per_s_runs": tps, "runs": rs, **c.details})
    record = {"command": f"{Path(sys.executable).name} " + " ".join(sys.argv), "settings": vars(args) | {
                  "out": str(args.out), "exports": str(args.exports), "threads": threads, "check_tokens": CHECK_TOKENS},
              "optimum_cli": str(optimum_cli()), "environment": env, "skipped": skipped, "rows": rows}
    lines = [f"# {args.prompts} prompts x {args.new_tokens} tokens in process: gpt2x's serving engine vs OpenVINO GenAI's "
             "continuous batching", "",
             f"{args.model} (GPT-2 124M, random weights), {args.prompts} prompts of {args.prompt_len} random tokens handed over "
             f"at once, {args.new_tokens} greedy tokens each (EOS masked); output tok/s = all output tokens / wall time; "
             f"{args.rounds} interleaved rounds, median shown, spread = min-max; paired: the median over rounds of each "
             "round's output tok/s over the first row's in the same round (which this VM's drift between rounds leaves "
             f"alone). {threads} threads each. TTFT: from "
             "handing the prompts over to each row's first token, the mean over rows; TPOT: each row's time from its "
             "first token to its last over its other tokens, the mean over rows; both on this script's clock for every "
             "engine.",
             machine_line(env),
             f"Command: `{record['command']}`", "", table(rows), ""]
    lines += [f"- {name}: skipped. {reason}" for name, reason in skipped.items()]
    if any(r["name"].endswith(f"({F32})") for r in rows):
        lines.append(f"- OpenVINO GenAI ({F32}): INFERENCE_PRECISION_HINT=f32; the other its CPU plugin's default here.")
    save_results(args.out, record, "\n".join(lines) + "\n")
    print(table(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
