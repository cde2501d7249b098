"""Speculative decoding against plain decoding of the same target, batch 1, greedy, on this machine
(issue 19's figures):

    python benchmarks/speculative.py --out benchmarks/results/speculative-cpu-2core

Cases (each: target, draft, prompt), every one measured as interleaved rounds: per round and per
prompt, one plain run and one run per draft of the case, in alternating order; medians over rounds.

- bundled: the bundled Shakespeare model (trained: agreement is real), ort fp32 target, with the
  int4 draft (its own int4 export) and ngram, on Shakespeare prompts; plus the int4 draft on 2
  threads instead of 1, and with K fixed (no adaptation), to show what each choice does;
- grounded: the bundled model, ngram, on an input-grounded prompt: a passage, then its first line
  again, so that continuing means repeating the passage (the model copies it, as LMs do);
- gpt2: GPT-2 124M's architecture with random weights, fp32 target, int4 draft (agreement is low:
  this shows the cost side and what adaptive K saves), adaptive and fixed K;
- xl: GPT-2 xl's architecture (1.5B) with random weights, fp32 target, int4 draft (--xl; slow);
- threads: the int4 draft on 1 thread (gpt2x's default on the CPU) against 2, bundled model and GPT-2
  124M (`--cases threads`).

Reported per row: decode tok/s (tokens after the first over the time after the first), x plain,
time to first token, acceptance rate (accepted / drafted) and mean acceptance length (1 + accepted /
verifications) as vLLM reports them, plain steps taken by the adaptive control, and whether the
tokens equal plain decoding's (with the first difference and the plain logits' top-2 margin there).
Also per target: the step cost over N = 1..8 new tokens (a verification of N - 1 drafted tokens)
and the draft's step cost.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path

import numpy as np

from gpt2x.bench.report import save_results
from gpt2x.bench.system import system_info
from gpt2x.choices import BackendKind, Precision
from gpt2x.generation.decode import Sequence, decode_steps
from gpt2x.generation.sampling import Sampler
from gpt2x.generation.settings import SamplingSettings
from gpt2x.generation.speculative import DraftSettings, SpecStats, control_for, speculative_loop
from gpt2x.numerics import positions
from gpt2x.onnx.artifact import default_export_dir
from gpt2x.tokenizer import encode
from gpt2x.workflows import ensure_export, export_backend, open_drafter

GREEDY = SamplingSettings(greedy=True, max_new_tokens=1 << 20)
PROMPTS = [
    "ROMEO:\nBut soft, what light through yonder window breaks?\n",
    "First Citizen:\nBefore we proceed any further, hear me speak.\n",
    "KING HENRY:\nOnce more unto the breach, dear friends, once more;\n",
    "DUKE VINCENTIO:\nWhat news abroad i' the world?\n",
]
PASSAGE = (
    "MENENIUS:\nI tell you, friends, most charitable care\nHave the patricians of you. For your wants,\n"
    "Your suffering in this dearth, you may as well\nStrike at the heaven with your staves as lift them\n"
    "Against the Roman state, whose course will on\nThe way it takes, cracking ten thousand curbs\n"
    "Of more strong link asunder than can ever\nAppear in your impediment.\n"
)
GROUNDED = PASSAGE + "\nSay that again:\n\nMENENIUS:\nI tell you, friends,"


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def plain_run(target, prompt: list[int], n: int) -> dict:
    seq = Sequence(prompt, replace(GREEDY, ignore_eos=True), max_tokens=n)
    t0 = time.perf_counter()
    t1 = None
    for _ in decode_steps(target, [seq]):
        if t1 is None:
            t1 = time.perf_counter()
    out = seq.tokens
    end = time.perf_counter()
    return {"tokens": out, "ttft_s": t1 - t0, "decode_s": end - t1}


def spec_run(target, drafter, prompt: list[int], n: int, settings: DraftSettings) -> dict:
    stats = SpecStats()
    out, t0 = [], time.perf_counter()
    t1 = None
    for chunk in speculative_loop(target, drafter, prompt, Sampler(GREEDY), n, control_for(settings), stats):
        if t1 is None:
            t1 = time.perf_counter()
        out.extend(chunk)
    end = time.perf_counter()
    return {"tokens": out, "ttft_s": t1 - t0, "decode_s": end - t1, "stats": stats.to_dict(), "k": list(stats.k_history)}


def step_costs(backend, prompt_len: int, max_n: int = 8, repeat: int = 9) -> dict[int, float]:
    """Median ms of one step over N new tokens on a cache of `prompt_len` positions, N = 1..max_n."""
    rng = np.random.default_rng(0)
    ids = rng.integers(0, backend.vocab_size, (1, prompt_len + max_n), dtype=np.int64)
    mask = np.ones_like(ids)
    times: dict[int, list[float]] = {n: [] for n in range(1, max_n + 1)}
    for r in range(repeat + 1):
        for n in (range(1, max_n + 1) if r % 2 else range(max_n, 0, -1)):
            _, past = backend.step(ids[:, :prompt_len], mask[:, :prompt_len], positions(mask[:, :prompt_len], prompt_len), None)
            m = mask[:, : prompt_len + n]
            t0 = time.perf_counter()
            (backend.step if n == 1 else backend.run)(ids[:, prompt_len : prompt_len + n], m, positions(m, n), past)
            if r:
                times[n].append((time.perf_counter() - t0) * 1e3)
    return {n: statistics.median(v) for n, v in times.items()}


def top2_margin(target, sequence: list[int], at: int) -> float:
    """The top-2 logit margin of the target at sequence position `at` (predicting token at + 1), from a
    no-cache forward over the sequence."""
    ids = np.asarray([sequence[: at + 1]], dtype=np.int64)
    mask = np.ones_like(ids)
    logits = target.run(ids, mask, positions(mask, ids.shape[1]), None)[0][0, -1]
    top = np.sort(logits)[-2:]
    return float(top[1] - top[0])


def run_case(name: str, target, drafters: dict, prompts: list[str], n_new: int, rounds: int) -> dict:
    """Interleaved rounds over prompts: plain, then each draft (order alternating per round)."""
    encoded = [encode(p) for p in prompts]
    labels = ["plain", *drafters]
    runs: dict[str, list[list[dict]]] = {label: [[] for _ in encoded] for label in labels}
    for r in range(rounds + 1):  # round 0 warms up
        order = labels if r % 2 else labels[::-1]
        for i, prompt in enumerate(encoded):
            for label in order:
                if label == "plain":
                    res = plain_run(target, prompt, n_new)
                else:
                    drafter, settings = drafters[label]
                    res = spec_run(target, drafter, prompt, n_new, settings)
                if r:
                    runs[label][i].append(res)
        log(f"{name}: round {r} of {rounds} done")
    rows = []
    plain_decode = [statistics.median(x["decode_s"] for x in runs["plain"][i]) for i in range(len(encoded))]
    plain_tokens = [runs["plain"][i][0]["tokens"] for i in range(len(encoded))]
    for label in labels:
        decode_s = [statistics.median(x["decode_s"] for x in runs[label][i]) for i in range(len(encoded))]
        ttft = [statistics.median(x["ttft_s"] for x in runs[label][i]) for i in range(len(encoded))]
        tokens = n_new - 1
        row = {"case": name, "draft": label, "decode_tokens_per_s": tokens * len(encoded) / sum(decode_s),
               "x_plain": sum(plain_decode) / sum(decode_s), "ttft_ms": 1e3 * statistics.median(ttft),
               "per_prompt_x_plain": [p / d for p, d in zip(plain_decode, decode_s)]}
        if label != "plain":
            stats = [x["stats"] for i in range(len(encoded)) for x in runs[label][i]]
            drafted, accepted = sum(s["drafted"] for s in stats), sum(s["accepted"] for s in stats)
            drafts = sum(s["drafts"] for s in stats)
            row.update({"acceptance_rate": accepted / drafted if drafted else None,
                        "mean_acceptance_length": 1 + accepted / drafts if drafts else None,
                        "plain_steps_per_run": statistics.mean(s["plain_steps"] for s in stats),
                        "k_first_run": runs[label][0][0]["k"]})
            identical, diffs = True, []
            for i in range(len(encoded)):
                for x in runs[label][i]:
                    if x["tokens"] != plain_tokens[i]:
                        identical = False
                        at = next(j for j, (a, b) in enumerate(zip(x["tokens"], plain_tokens[i])) if a != b)
                        diffs.append({"prompt": i, "token": at,
                                      "plain_top2_margin": top2_margin(target, encoded[i] + plain_tokens[i], len(encoded[i]) + at - 1)})
            row["greedy_identical"] = identical
            row["runs_compared"] = sum(len(runs[label][i]) for i in range(len(encoded)))
            row["differences"] = diffs
        rows.append(row)
    return {"case": name, "prompts": prompts, "new_tokens": n_new, "rounds": rounds, "rows": rows}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cases", default="bundled,grounded,gpt2", help="comma-separated: bundled, grounded, gpt2, xl, threads")
    ap.add_argument("--xl", action="store_true", help="add the xl case")
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--xl-new-tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--num-speculative-tokens", "--draft-tokens", dest="num_speculative_tokens", type=int,
                    default=DraftSettings.num_speculative_tokens)
    ap.add_argument("--exports", type=Path, default=Path("exported"))
    ap.add_argument("--out", type=Path, required=True, help="output path without extension (.json, .md)")
    args = ap.parse_args()
    cases = args.cases.split(",") + (["xl"] if args.xl and "xl" not in args.cases else [])
    adaptive = DraftSettings(num_speculative_tokens=args.num_speculative_tokens)
    fixed = DraftSettings(num_speculative_tokens=args.num_speculative_tokens, adaptive=False)

    def export(model: str, precision: Precision):
        return ensure_export(model, precision, folder=default_export_dir(model, precision, args.exports), progress=log, notice=log)

    def target_and_int4(model: str, draft_threads: list[int]):
        target = export_backend(BackendKind.ort, export(model, Precision.fp32))
        export(model, Precision.int4)  # open_drafter finds it in the default folder
        drafts = {t: open_drafter("int4", target, threads=t, progress=log, notice=log) for t in draft_threads}
        return target, drafts

    results, costs = [], {}
    for case in cases:
        if case in ("bundled", "grounded"):
            target, drafts = target_and_int4("shakespeare", [1])
            ngram = open_drafter("ngram", target)
            if case == "bundled":
                drafters = {"int4": (drafts[1], adaptive), "int4 (fixed K)": (drafts[1], fixed), "ngram": (ngram, adaptive)}
                results.append(run_case(case, target, drafters, PROMPTS, args.new_tokens, args.rounds))
                costs["shakespeare"] = {"target_fp32_ms": step_costs(target, 32), "draft_int4_ms": step_costs(drafts[1].backend, 32, 1)}
            else:
                drafters = {"ngram": (ngram, adaptive), "ngram (fixed K)": (ngram, fixed)}
                results.append(run_case(case, target, drafters, [GROUNDED], args.new_tokens, args.rounds))
        elif case == "threads":
            for model in ("shakespeare", "random:gpt2"):
                target, drafts = target_and_int4(model, [1, 2])
                drafters = {"int4, 1 draft thread": (drafts[1], adaptive), "int4, 2 draft threads": (drafts[2], adaptive)}
                results.append(run_case(f"threads {model}", target, drafters, PROMPTS, args.new_tokens, args.rounds))
                del drafts
        elif case in ("gpt2", "xl"):
            model = "random:gpt2" if case == "gpt2" else "random:gpt2-xl"
            target, drafts = target_and_int4(model, [1])
            drafters = {"int4": (drafts[1], adaptive), "int4 (fixed K)": (drafts[1], fixed)}
            if case == "gpt2":  # a draft that rarely agrees: another model's random weights
                other = "random:distilgpt2"
                export(other, Precision.fp32)
                stranger = open_drafter(other, target, progress=log, notice=log)
                drafters[f"{other} fp32"] = (stranger, adaptive)
                drafters[f"{other} fp32 (fixed K)"] = (stranger, fixed)
            n_new = args.new_tokens if case == "gpt2" else args.xl_new_tokens
            results.append(run_case(case, target, drafters, PROMPTS[:2] if case == "xl" else PROMPTS, n_new,
                                    args.rounds if case == "gpt2" else max(1, args.rounds // 2)))
            costs[model] = {"target_fp32_ms": step_costs(target, 32, repeat=5 if case == "xl" else 9),
                            "draft_int4_ms": step_costs(drafts[1].backend, 32, 1)}
        else:
            raise SystemExit(f"unknown case {case!r}")
        del target
    lines = [f"Speculative decoding against plain decoding of the same target, batch 1, greedy, K at most {args.num_speculative_tokens}; "
             "ONNX Runtime on the CPU (fp32 target; the int4 draft on 1 thread unless said).", "",
             "| case | draft | decode tok/s | x plain | TTFT ms | acceptance | mean acceptance length | plain steps/run | tokens = plain |",
             "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | --- |"]

    def fmt(v, spec=".2f"):
        return "" if v is None else format(v, spec)

    for res in results:
        for row in res["rows"]:
            same = "" if row["draft"] == "plain" else ("yes" if row["greedy_identical"] else f"no ({len(row['differences'])} runs)")
            lines.append(f"| {res['case']} | {row['draft']} | {row['decode_tokens_per_s']:.1f} | {row['x_plain']:.2f} | "
                         f"{row['ttft_ms']:.1f} | {fmt(row.get('acceptance_rate'))} | {fmt(row.get('mean_acceptance_length'))} | "
                         f"{fmt(row.get('plain_steps_per_run'), '.1f')} | {same} |")
    lines += ["", "Step cost over N new tokens on a 32-position cache (ms; N - 1 drafted tokens are verified by the N-token step):", "",
              "| model | step | " + " | ".join(f"N={n}" for n in range(1, 9)) + " |", "| --- | --- | " + " | ".join("---:" for _ in range(8)) + " |"]
    for model, c in costs.items():
        t = c["target_fp32_ms"]
        lines.append(f"| {model} | fp32 target | " + " | ".join(f"{t[n]:.2f}" for n in range(1, 9)) + " |")
        lines.append(f"| {model} | int4 draft | {c['draft_int4_ms'][1]:.2f} |" + " |" * 7)
    text = "\n".join(lines) + "\n"
    save_results(args.out, {"machine": system_info(), "command": " ".join(["python", *sys.argv]), "cases": results,
                            "step_costs_ms": costs}, text)
    print(text)


if __name__ == "__main__":
    main()
