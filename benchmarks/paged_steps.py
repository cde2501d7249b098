"""The paged forwards inside gpt2x's fp32 server and inside OpenVINO GenAI, timed on their own, at f32 compute: where
the 16-prompt fp32 gap between the two engines lies.

    .venv-peers/bin/python benchmarks/paged_steps.py --export DIR --out benchmarks/results/paged-steps-cpu-2core
        [--prompts 16] [--prompt-len 32] [--new-tokens 64] [--rounds 5] [--step-tokens 256]

batch_peers.py times whole engines; this times what runs inside them, on the same weights (--model, GPT-2 124M with
seeded random weights by default) and the same prompts (--prompts of --prompt-len random tokens, --new-tokens greedy
tokens each, EOS neither chosen nor a stop):

- OpenVINO GenAI: ContinuousBatchingPipeline on optimum-intel's fp32 conversion of the weights (peers/openvino_genai.py's
  convert), INFERENCE_PRECISION_HINT f32, its default SchedulerConfig (a step holds at most 256 tokens, split-fuse), its
  KV cache in f32 and in u8 (KV_CACHE_PRECISION; u8 is its CPU plugin's default), every prompt added at once and each
  pipe.step() timed;
- gpt2x's paged decoder (runtime.openvino_paged.PagedDecoder, what `gpt2x serve` opens for an fp32 export with an
  OpenVINO prefill graph: DIR, made by `gpt2x export --model random:gpt2 --precision fp32 --openvino-prefill`), its cache in
  f32 (as served) and in u8 (OpenVINO's quantized cache, GenAI's default): the prompts in forwards of whole prompts of
  at most --step-tokens tokens, then one forward per token of every row, the next tokens by numpy's argmax;
- gpt2x's serving engine on that decoder (batch_peers.Gpt2xEngine on the backend `gpt2x serve` takes): its wall time
  beside the decoder's alone is what the engine adds (scheduling, sampling, outputs, its threads);
- on an export that keeps an int8 KV cache (`--int8-kv --openvino-prefill`), also ONNX Runtime's slots alone
  (runtime.static_decode.SlotDecoder) with that cache, in the same loop: what `gpt2x serve` runs such an export on.

Columns: prompt ms, the forwards (GenAI: steps) until every row had its first token; decode step ms, the median of the
forwards after them; wall ms from the first forward to the last token; paired, the median over rounds of a contender's
wall over gpt2x's f32 decoder's in the same round. Each round runs every contender once, in an
order rotated every round, after one unmeasured run each (the token check: rows whose first 16 tokens equal gpt2x's
f32 decoder's); the figure is the median round. Writes OUT.json and OUT.md.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
from batch_peers import CHECK_TOKENS, Gpt2xEngine
from peers.core import Context, error_line, log, machine_line, paired_median, rotated
from peers.openvino_genai import F32, convert, greedy_config

from gpt2x.bench.report import save_results
from gpt2x.bench.system import installed_versions, system_info
from gpt2x.choices import Precision, ProviderKind
from gpt2x.errors import Gpt2xError
from gpt2x.model.weights import save_hf
from gpt2x.onnx.artifact import read_export
from gpt2x.runtime.openvino_paged import QUANTIZED_KV, PagedDecoder, paged_refusal
from gpt2x.runtime.providers import physical_cores
from gpt2x.runtime.static_decode import SlotDecoder
from gpt2x.serve.replica import served_backend
from gpt2x.workflows.models import load_model

KV_CACHES = (F32, QUANTIZED_KV)


class GenaiSteps:
    """OpenVINO GenAI's continuous batching, f32 compute, its KV cache in `kv_cache`; a run times each step()."""

    def __init__(self, folder: Path, threads: int, kv_cache: str):
        import openvino as ov
        import openvino_genai as ov_genai

        self.ov, self.name = ov, f"OpenVINO GenAI f32, {kv_cache} KV cache"
        self.properties = {"INFERENCE_NUM_THREADS": threads, "INFERENCE_PRECISION_HINT": F32, "KV_CACHE_PRECISION": kv_cache}
        self.scheduler = ov_genai.SchedulerConfig()
        self.pipe = ov_genai.ContinuousBatchingPipeline(str(folder), self.scheduler, "CPU", self.properties)
        self.requests = 0

    def run(self, prompts: np.ndarray, n: int) -> dict:
        config = greedy_config(n)
        handles = []
        for p in prompts:
            self.requests += 1
            handles.append(self.pipe.add_request(self.requests, self.ov.Tensor(np.ascontiguousarray(p[None, :])), config))
        tokens: list[list[int]] = [[] for _ in prompts]
        steps, prompt_steps = [], 0
        t0 = time.perf_counter()
        while self.pipe.has_non_finished_requests():
            t = time.perf_counter()
            self.pipe.step()
            steps.append(time.perf_counter() - t)
            for i, handle in enumerate(handles):
                if handle.can_read():
                    for out in handle.read().values():
                        tokens[i].extend(out.generated_ids)
            if not prompt_steps and all(tokens):
                prompt_steps = len(steps)
        return figures(time.perf_counter() - t0, steps, prompt_steps, tokens)

    def details(self) -> dict:
        return {"properties": self.properties, "scheduler_config": self.scheduler.to_string()}

    def close(self) -> None:
        self.pipe = None


class DecoderSteps:
    """gpt2x's paged decoder alone, its cache in `kv_cache` (f32: the compute precision's, as served); with
    `ort_slots`, ONNX Runtime's slots instead (runtime.static_decode.SlotDecoder), the cache as the export's record
    says (int8 where it kept gated scales)."""

    def __init__(self, info, threads: int, kv_cache: str, batch: int, step_tokens: int, ort_slots: bool = False):
        if ort_slots:
            self.decoder = SlotDecoder(info, slots=batch, threads=threads)
            self.name = f"gpt2x ONNX Runtime's slots f32, {np.dtype(self.decoder.dtype).name} KV cache"
        else:
            self.name = f"gpt2x paged decoder f32, {kv_cache} KV cache"
            self.decoder = PagedDecoder(info, slots=batch, threads=threads,
                                        kv_cache_precision=QUANTIZED_KV if kv_cache == QUANTIZED_KV else None)
            self.decoder.warm_up()
        self.step_tokens = step_tokens

    def run(self, prompts: np.ndarray, n: int) -> dict:
        dec, (B, T) = self.decoder, prompts.shape
        for slot in range(B):
            dec.release(slot)
        per_forward = max(1, self.step_tokens // T)  # whole prompts, as many as the step's tokens hold
        steps, tokens, every = [], np.zeros((B, n), np.int64), np.arange(B)  # take: the logits of these, as the engine asks
        t0 = time.perf_counter()
        for first in range(0, B, per_forward):
            rows = np.arange(first, min(B, first + per_forward))
            t = time.perf_counter()
            logits = dec.prefill_fresh(rows, prompts[rows], np.ones((len(rows), T), bool))
            if logits is None:  # ONNX Runtime's slots where the export's record runs such prompts there: a row at a time
                logits = np.stack([dec.prefill(int(r), prompts[r]) for r in rows])
            tokens[rows, 0] = logits.argmax(-1)
            steps.append(time.perf_counter() - t)
        prompt_steps = len(steps)
        for i in range(1, n):
            t = time.perf_counter()
            tokens[:, i] = dec.step(tokens[:, i - 1], take=every).argmax(-1)
            steps.append(time.perf_counter() - t)
        return figures(time.perf_counter() - t0, steps, prompt_steps, tokens.tolist())

    def details(self) -> dict:
        return {"slots": self.decoder.slots, "block": getattr(self.decoder, "block", None),
                "kv_dtype": np.dtype(self.decoder.dtype).name, "step_tokens": self.step_tokens}

    def close(self) -> None:
        self.decoder.close()


class EngineWall:
    """gpt2x's serving engine on the backend `gpt2x serve` takes for the export (batch_peers.Gpt2xEngine)."""

    def __init__(self, info, threads: int, batch: int):
        self.engine = Gpt2xEngine(served_backend(info, ProviderKind.cpu), info, threads, batch)
        self.name = self.engine.name

    def run(self, prompts: np.ndarray, n: int) -> dict:
        run = self.engine.run(prompts, n)
        return {"wall_ms": 1e3 * run["wall_s"], "prompt_ms": None, "decode_step_ms": None, "steps": None,
                "ttft_mean_ms": 1e3 * statistics.fmean(run["ttft_s"]), "tpot_mean_ms": 1e3 * statistics.fmean(run["tpot_s"]),
                "tokens": run["tokens"]}

    def details(self) -> dict:
        return self.engine.details

    def close(self) -> None:
        self.engine.close()


def figures(wall_s: float, steps: list[float], prompt_steps: int, tokens: list[list[int]]) -> dict:
    decode = steps[prompt_steps:]
    return {"wall_ms": 1e3 * wall_s, "prompt_ms": 1e3 * sum(steps[:prompt_steps]),
            "decode_step_ms": 1e3 * statistics.median(decode) if decode else None, "steps": len(steps),
            "prompt_steps": prompt_steps, "tokens": tokens}


def table(rows: list[dict]) -> str:
    def ms(v):
        return "-" if v is None else f"{v:.1f}" if v >= 100 else f"{v:.2f}"

    out = ["| contender | wall ms | spread | wall / decoder f32's, paired | prompt ms | decode step ms | forwards | "
           "rows = gpt2x decoder f32 |", "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        out.append(f"| {r['name']} | {ms(r['wall_ms'])} | {ms(r['min_wall_ms'])}-{ms(r['max_wall_ms'])} | "
                   f"{r['paired_ratio']:.3f} | {ms(r['prompt_ms'])} | {ms(r['decode_step_ms'])} | {r['steps'] or '-'} | "
                   f"{r['rows_matching']} |")
    return "\n".join(out)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results/paged-steps-cpu-2core"))
    ap.add_argument("--model", default="random:gpt2", help="gpt2x model name (default: GPT-2 124M, seeded random weights)")
    ap.add_argument("--export", type=Path, required=True, help="gpt2x's fp32 export of --model with its OpenVINO prefill "
                    "graph (gpt2x export --precision fp32 --openvino-prefill)")
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--step-tokens", type=int, default=256, help="prompt tokens a forward of gpt2x's decoder holds at "
                    "most, whole prompts (default: GenAI's max_num_batched_tokens)")
    args = ap.parse_args()
    if min(args.prompts, args.prompt_len, args.new_tokens, args.rounds, args.step_tokens) < 1:
        ap.error("--prompts, --prompt-len, --new-tokens, --rounds and --step-tokens must be at least 1")
    threads = physical_cores()
    env = system_info()
    env["peer packages"] = installed_versions("openvino", "openvino-genai", "openvino-tokenizers")
    model, source = load_model(args.model)
    if args.prompt_len + args.new_tokens > model.config.n_positions:
        ap.error("--prompt-len + --new-tokens exceeds the model's positions")
    try:
        info = read_export(args.export)
    except Gpt2xError as e:
        ap.error(f"--export: {e}")
    why = f"a {info.precision.value} export" if info.precision is not Precision.fp32 else paged_refusal(info, ProviderKind.cpu)
    if why:
        ap.error(f"--export: {why}; this times an fp32 export with its OpenVINO prefill graph (gpt2x export --model "
                 f"{args.model} --precision fp32 --openvino-prefill)")
    rng = np.random.default_rng(0)
    prompt_sets = [rng.integers(0, model.config.vocab_size, (args.prompts, args.prompt_len), dtype=np.int64)
                   for _ in range(args.rounds + 1)]  # [0]: the unmeasured run's (the check), then one per round
    skipped: dict[str, str] = {}
    runs: dict[str, list[dict]] = {}
    with tempfile.TemporaryDirectory(prefix="gpt2x-paged-steps-") as tmp:
        hf_dir = Path(tmp) / "hf"
        save_hf(model, hf_dir)
        ctx = Context(hf_dir=hf_dir, work=Path(tmp), threads=threads, model=model, source=source, model_name=args.model,
                      exports_dir=args.export.parent, precisions=[], kinds=[], max_prompt=args.prompt_len,
                      new_tokens=args.new_tokens, results={"skipped": skipped})
        contenders = [DecoderSteps(info, threads, kv, args.prompts, args.step_tokens) for kv in KV_CACHES]
        if info.int8_kv is not None and info.int8_kv.get("use"):  # an --int8-kv export: the slots that serve it today
            contenders.append(DecoderSteps(info, threads, "int8", args.prompts, args.step_tokens, ort_slots=True))
        contenders.append(EngineWall(info, threads, args.prompts))
        try:
            folder, _ = convert(ctx.hf_dir_with_tokenizer(), "fp32", Path(tmp) / "openvino-fp32")
            contenders += [GenaiSteps(folder, threads, kv) for kv in KV_CACHES]
        except Exception as e:
            skipped["OpenVINO GenAI"] = error_line(e)
            log(f"OpenVINO GenAI: skipped ({error_line(e)})")
        checks = {}
        for c in contenders:
            log(f"{c.name}: unmeasured run")
            checks[c.name] = c.run(prompt_sets[0], args.new_tokens)["tokens"]
        for r in range(args.rounds):
            log(f"round {r + 1}/{args.rounds}")
            for c in rotated(contenders, r):
                run = c.run(prompt_sets[r + 1], args.new_tokens)
                run.pop("tokens")
                runs.setdefault(c.name, []).append(run)
                log(f"  {c.name}: wall {run['wall_ms']:.0f} ms")
        details = {c.name: c.details() for c in contenders}
        for c in contenders:
            c.close()

    reference = checks[contenders[0].name]
    rows = []
    for c in contenders:
        rs = runs[c.name]
        med = sorted(rs, key=lambda x: x["wall_ms"])[len(rs) // 2]
        matching = sum(a[:CHECK_TOKENS] == b[:CHECK_TOKENS] for a, b in zip(checks[c.name], reference, strict=True))
        paired = paired_median([x["wall_ms"] for x in rs], [y["wall_ms"] for y in runs[contenders[0].name]])
        rows.append({"name": c.name, **med, "paired_ratio": paired, "min_wall_ms": min(x["wall_ms"] for x in rs),
                     "max_wall_ms": max(x["wall_ms"] for x in rs), "rows_matching": matching, "runs": rs,
                     "details": details[c.name]})
    record = {"command": f"{Path(sys.executable).name} " + " ".join(sys.argv),
              "settings": vars(args) | {"out": str(args.out), "export": str(info.folder), "threads": threads,
                                        "check_tokens": CHECK_TOKENS},
              "environment": env, "skipped": skipped, "rows": rows}
    lines = ["# The paged forwards inside gpt2x's fp32 server and inside OpenVINO GenAI, f32 compute", "",
             f"{args.model} (GPT-2 124M, random weights), {args.prompts} prompts of {args.prompt_len} random tokens at once, "
             f"{args.new_tokens} greedy tokens each (EOS masked); {args.rounds} rounds, each contender once a round in a "
             f"rotated order, median round shown (spread: min-max wall; paired: the median over rounds of each round's wall "
             "over gpt2x's f32 decoder's in the same round, which this VM's drift between rounds leaves alone); "
             f"{threads} threads each. Prompt ms: the forwards "
             "until every row had its first token; decode step ms: the median forward after them; wall: the first "
             "forward to the last token. The engine row: gpt2x's serving engine on the same decoder, as `gpt2x serve` "
             "runs the export.",
             machine_line(env),
             f"Command: `{record['command']}`", "", table(rows), ""]
    lines += [f"- {name}: skipped. {reason}" for name, reason in skipped.items()]
    save_results(args.out, record, "\n".join(lines) + "\n")
    print(table(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
