"""Time to first token in a fresh process and in a warm one: gpt2x (ONNX Runtime) against llama.cpp
(llama-cpp-python) at fp32, int8 and int4, on the same weights.

    .venv-peers/bin/python benchmarks/first_token.py --out benchmarks/results/first-token-cpu-2core
        [--prompt-len 32,512] [--precisions fp32,int8,int4] [--rounds 3] [--requests 4]
        [--llama-no-extra-bufts]  (a CPU with AMX: llama.cpp's AMX path crashes on q8_0 and q4_0)

Why: benchmarks/compare_peers.py times every contender after a warm-up run in one long-lived process
(peers.core.time_batch), so its TTFT is a warm one; a process that loads an engine and answers its
first request straight away also pays whatever that engine does on its first run. This script
measures both, each engine in a fresh subprocess per measurement:

- gpt2x: GPT-2 124M (random:gpt2, seeded random weights), exported by gpt2x at each precision
  (peers.gpt2x.ensure_exports: workflows.ensure_export into --exports), opened with
  workflows.export_backend (ONNX Runtime, CPU) and asked through gpt2x's public API
  (generation.generate.generate with the prompt's token ids, greedy; the clock stops at the first
  on_token call);
- llama.cpp: the same weights saved in Hugging Face layout, converted by llama.cpp's
  convert_hf_to_gguf.py to GGUF f32 and quantized by llama.cpp's quantizer to q8_0 and q4_0 (fp32,
  int8, int4), run by peers.llamacpp.LlamaCpp (llama_cpp.Llama, flash attention, prompt fed as token
  ids, greedy argmax of the last logits) exactly as compare_peers.py runs it.

Each subprocess loads its engine (timed: `load`, from the start of the engine's constructor until it
returns, so a warm-up an engine does at load is counted there), then answers --requests requests of
the same prompt (--prompt-len random token ids, --new-tokens greedy tokens that EOS does not stop):
the first request's time to first token is the fresh one, the median of the later ones the warm one.
Time to first token = from the call to the first token chosen (the prefill and the first argmax). Both
engines get the prompt as token ids (made by the parent process, so that a subprocess has done
nothing before its first request that a user's process would not: e.g. NumPy 2 imports numpy.random
only when first used, which gpt2x's sampler does), and the same number of threads (the cores). A
text prompt would add tokenization: llama.cpp reads its vocabulary when it loads, gpt2x builds its
tokenizer (tokenizer.get_encoding, about 55 ms here) at its first use, which this harness leaves
out. For every (precision, prompt length) the two engines run one after the other, in an order that alternates every round, --rounds rounds; each
figure is the median over the rounds. The model files are read once first so that every process
finds them in the page cache: this measures the engines, not the disk. The machine's load average
is recorded with each measurement (other work on a 2-core VM moves these figures a lot).

Target (issue 30): gpt2x's time to first token ≤ llama.cpp's at every precision and prompt length,
fresh and warm. Writes OUT.json (every measurement) and OUT.md (the table).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

GGUF_FOR = {"fp32": "f32", "int8": "q8_0", "int4": "q4_0"}  # gpt2x precision -> the GGUF type compared with
ENGINES = ("gpt2x", "llama.cpp")
VOCAB = 50257  # GPT-2's
GAP_S = 0.5  # idle time between two subprocesses (spinning thread pools and page reclaim settle)


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


# ---------------------------------------------------------------- the subprocess: one engine, fresh


def prompt_ids(length: int, vocab: int, seed: int) -> list[int]:
    return np.random.default_rng(seed).integers(0, vocab, length).tolist()


def minor_faults() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def child(job: dict) -> dict:
    """Load one engine and answer `requests` requests: load time, each request's time to first token
    (and the minor page faults it took: memory touched for the first time), and the first token of
    each (the same every time). Nothing before the first request but the engine's load."""
    t_start = time.perf_counter()
    threads, n, ids = job["threads"], job["new_tokens"], job["prompt"]
    if job["engine"] == "gpt2x":
        from gpt2x.choices import BackendKind, ProviderKind
        from gpt2x.generation.generate import generate
        from gpt2x.generation.settings import SamplingSettings
        from gpt2x.onnx.artifact import read_export
        from gpt2x.workflows.backends import export_backend

        info = read_export(Path(job["path"]))
        t_import = time.perf_counter()
        backend = export_backend(BackendKind.ort, info, ProviderKind.cpu, threads)
        t_load = time.perf_counter()
        settings = SamplingSettings(greedy=True, max_new_tokens=n, ignore_eos=True)

        def request() -> tuple[float, int]:
            stamps: list[float] = []
            t0 = time.perf_counter()
            out = generate(backend, [""], settings, prompt_ids=[ids],  # the text is not read when ids are given
                           on_token=lambda row, token: stamps.append(time.perf_counter()) if not stamps else None)
            return stamps[0] - t0, int(out[0].tokens[0])
    else:
        from peers.llamacpp import LlamaCpp, no_extra_buffer_types

        from gpt2x.choices import Precision

        if not job["extra_bufts"]:
            no_extra_buffer_types()
        t_import = time.perf_counter()
        llm = LlamaCpp(Path(job["path"]), job["gguf_type"], Precision(job["precision"]), threads, job["n_ctx"], job["n_batch"])
        t_load = time.perf_counter()
        prompt = np.array([ids], dtype=np.int64)

        def request() -> tuple[float, int]:
            stamps: list[float] = []
            t0 = time.perf_counter()
            tokens = llm._generate(prompt, n, stamps)
            return stamps[0] - t0, int(tokens[0][0])
    ttfts, faults, firsts = [], [], []
    for _ in range(job["requests"]):
        f0 = minor_faults()
        ttft, token = request()
        ttfts.append(ttft)
        faults.append(minor_faults() - f0)
        firsts.append(token)
    return {"import_s": t_import - t_start, "load_s": t_load - t_import, "ttft_s": ttfts, "minor_faults": faults,
            "first_tokens": firsts}


# ---------------------------------------------------------------- the parent: files, rounds, report


def run_child(job: dict) -> dict:
    proc = subprocess.run([sys.executable, __file__, "--child", json.dumps(job)], capture_output=True, text=True)
    if proc.returncode != 0:
        hint = " (a segmentation fault: on a CPU with AMX, see --llama-no-extra-bufts)" \
            if proc.returncode == -11 and job["engine"] == "llama.cpp" else ""
        raise RuntimeError(f"{job['engine']} {job['precision']} failed ({proc.returncode}){hint}: "
                           f"{(proc.stderr or proc.stdout).strip()[-2000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def make_files(args, precisions: list[str], work: Path, threads: int) -> tuple[dict, dict, dict]:
    """gpt2x's exports and llama.cpp's GGUF files of the same weights: ({precision: export folder},
    {precision: GGUF path}, what was recorded about them)."""
    from peers.core import Context
    from peers.gpt2x import ensure_exports
    from peers.llamacpp import convert_f32, converter, llama_cpp_commit, quantize

    from gpt2x.choices import BackendKind, Precision
    from gpt2x.model.weights import save_hf
    from gpt2x.workflows.models import load_model

    model, source = load_model(args.model)
    hf_dir = work / "hf"
    save_hf(model, hf_dir)
    results: dict = {"skipped": {}}
    ctx = Context(hf_dir=hf_dir, work=work, threads=threads, model=model, source=source, model_name=args.model,
                  exports_dir=args.exports, precisions=[Precision(p) for p in precisions], kinds=[BackendKind.ort],
                  max_prompt=max(args.prompt_len), new_tokens=args.new_tokens, results=results)
    exports = {p.value: str(info.folder) for p, info in ensure_exports(ctx).items()}
    if results["skipped"]:
        raise RuntimeError(f"gpt2x exports failed: {results['skipped']}")
    import llama_cpp

    script = converter()
    record = {"llama_cpp_python": llama_cpp.__version__, "llama_cpp_commit": llama_cpp_commit(script),
              "system_info": llama_cpp.llama_print_system_info().decode(errors="replace").strip()}
    folder = work / "gguf"
    folder.mkdir()
    f32, _ = convert_f32(script, ctx.hf_dir_with_tokenizer(), folder)
    ggufs = {p: str(f32 if GGUF_FOR[p] == "f32" else quantize(f32, GGUF_FOR[p], threads)[0]) for p in precisions}
    return exports, ggufs, record


def read_through(paths: list[Path]) -> None:
    """Every file once, so that the subprocesses find them in the page cache."""
    for p in paths:
        for f in ([p] if p.is_file() else sorted(x for x in p.rglob("*") if x.is_file())):
            with open(f, "rb") as fh:
                while fh.read(1 << 24):
                    pass


def summarize(measurements: list[dict]) -> dict:
    """Per (engine, precision, prompt length): medians over the rounds of load, fresh and warm TTFT."""
    groups: dict = {}
    for m in measurements:
        groups.setdefault((m["engine"], m["precision"], m["prompt_len"]), []).append(m)
    out = {}
    for (engine, precision, prompt_len), ms in groups.items():
        warm = [statistics.median(m["ttft_s"][1:]) for m in ms if len(m["ttft_s"]) > 1]
        out[f"{engine} {precision} {prompt_len}"] = {
            "engine": engine, "precision": precision, "prompt_len": prompt_len, "rounds": len(ms),
            "load_s": statistics.median(m["load_s"] for m in ms),
            "fresh_ttft_s": statistics.median(m["ttft_s"][0] for m in ms),
            "warm_ttft_s": statistics.median(warm) if warm else None,
            "fresh_minor_faults": statistics.median(m["minor_faults"][0] for m in ms),
            "warm_minor_faults": statistics.median(f for m in ms for f in m["minor_faults"][1:]) if warm else None,
            "fresh_ttft_s_runs": [m["ttft_s"][0] for m in ms], "warm_ttft_s_runs": warm}
    return out


def ms(x: float | None) -> str:
    return "-" if x is None else f"{x * 1e3:.1f}"


def met(g: dict, q: dict, key: str) -> str:
    """Whether gpt2x's figure is at most llama.cpp's, and their ratio."""
    if g[key] is None or q[key] is None:
        return "-"
    return f"{'met' if g[key] <= q[key] else 'not met'} ({g[key] / q[key]:.2f}x)"


def markdown(summary: dict, args, env: dict, record: dict, loads: list[float]) -> str:
    lines = [f"Time to first token, fresh process and warm: gpt2x (ONNX Runtime) against llama.cpp "
             f"(llama-cpp-python {record['llama_cpp_python']}), {args.model}, batch 1, greedy; {args.rounds} rounds, "
             f"the two engines alternating, each measurement in its own process; medians.",
             f"Machine: {env.get('cpu', '?')}, {env.get('cores', '?')} cores, {env.get('platform', '?')}; {env.get('date', '')}, "
             f"gpt2x git {env.get('git', '?')}; {args.threads} threads for both engines; load average during the run "
             f"{min(loads):.2f}-{max(loads):.2f}.",
             "load: the engine's constructor (gpt2x: workflows.export_backend, i.e. the ONNX Runtime session; "
             "llama.cpp: Llama(...)). fresh: the first request's time to first token in the process; warm: the median of "
             f"requests 2-{args.requests}."
             + (" llama.cpp ran without its extra buffer types (--llama-no-extra-bufts: no AMX, no repacked weights), "
                "slower than it can be." if args.llama_no_extra_bufts else ""), "",
             "| precision | prompt | gpt2x load (ms) | gpt2x fresh (ms) | gpt2x warm (ms) | llama.cpp | llama.cpp load (ms) "
             "| llama.cpp fresh (ms) | llama.cpp warm (ms) | fresh ≤ llama.cpp | warm ≤ llama.cpp |",
             "| --- | ---: | ---: | ---: | ---: | --- | ---: | ---: | ---: | --- | --- |"]
    for p in args.precisions:
        for t in args.prompt_len:
            g, q = summary.get(f"gpt2x {p} {t}"), summary.get(f"llama.cpp {p} {t}")
            if g is None or q is None:
                continue
            lines.append(f"| {p} | {t} | {ms(g['load_s'])} | {ms(g['fresh_ttft_s'])} | {ms(g['warm_ttft_s'])} | {GGUF_FOR[p]} "
                         f"| {ms(q['load_s'])} | {ms(q['fresh_ttft_s'])} | {ms(q['warm_ttft_s'])} | {met(g, q, 'fresh_ttft_s')} "
                         f"| {met(g, q, 'warm_ttft_s')} |")
    return "\n".join(lines) + "\n"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--out", type=Path, help="output path without extension (.json, .md)")
    ap.add_argument("--model", default="random:gpt2")
    ap.add_argument("--exports", type=Path, default=Path("exported"), help="where gpt2x's exports go")
    ap.add_argument("--precisions", default="fp32,int8,int4")
    ap.add_argument("--prompt-len", default="32,512")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--requests", type=int, default=4, help="requests per process: the first is fresh, the others warm")
    ap.add_argument("--new-tokens", type=int, default=16, help="greedy tokens per request")
    ap.add_argument("--engines", default=",".join(ENGINES))
    ap.add_argument("--seed", type=int, default=0, help="the prompt's random token ids")
    ap.add_argument("--llama-no-extra-bufts", action="store_true",
                    help="load llama.cpp's weights without its extra buffer types (no AMX, no repacking): for a CPU "
                         "with AMX, where llama.cpp's AMX path crashes; llama.cpp is then slower than it can be")
    args = ap.parse_args()
    if args.child:
        print(json.dumps(child(json.loads(args.child))))
        return 0
    if args.out is None:
        ap.error("--out is required")
    args.precisions = [p.strip() for p in args.precisions.split(",") if p.strip()]
    args.prompt_len = [int(t) for t in args.prompt_len.split(",") if t.strip()]
    engines = [e.strip() for e in args.engines.split(",") if e.strip()]
    for p in args.precisions:
        if p not in GGUF_FOR:
            ap.error(f"--precisions: {p!r} is not one of {', '.join(GGUF_FOR)}")
    for e in engines:
        if e not in ENGINES:
            ap.error(f"--engines: {e!r} is not one of {', '.join(ENGINES)}")
    if args.rounds < 1 or args.requests < 1 or args.new_tokens < 1:
        ap.error("--rounds, --requests and --new-tokens must be at least 1")

    from gpt2x.bench.report import save_results
    from gpt2x.bench.system import system_info
    from gpt2x.runtime.providers import physical_cores

    args.threads = physical_cores()
    env = system_info()
    n_ctx = max(args.prompt_len) + args.new_tokens  # as compare_peers.py sizes llama.cpp's context
    n_batch = max(512, max(args.prompt_len))
    prompts = {t: prompt_ids(t, VOCAB, args.seed) for t in args.prompt_len}  # made here: see child()
    measurements: list[dict] = []
    failed: dict[tuple[str, str], str] = {}
    with tempfile.TemporaryDirectory(prefix="gpt2x-first-token-") as tmp:
        exports, ggufs, record = make_files(args, args.precisions, Path(tmp), args.threads)
        read_through([Path(x) for x in (*exports.values(), *ggufs.values())])
        jobs = {("gpt2x", p): {"engine": "gpt2x", "path": exports[p]} for p in args.precisions} | \
               {("llama.cpp", p): {"engine": "llama.cpp", "path": ggufs[p], "gguf_type": GGUF_FOR[p], "n_ctx": n_ctx,
                                   "n_batch": n_batch, "extra_bufts": not args.llama_no_extra_bufts} for p in args.precisions}
        for r in range(args.rounds):
            for t in args.prompt_len:
                for i, p in enumerate(args.precisions):
                    order = engines if (r + i) % 2 == 0 else engines[::-1]
                    for e in order:
                        job = jobs[(e, p)] | {"precision": p, "prompt_len": t, "threads": args.threads, "prompt": prompts[t],
                                              "requests": args.requests, "new_tokens": args.new_tokens}
                        if (e, p) in failed:
                            continue
                        load = os.getloadavg()[0]
                        try:
                            result = run_child(job)
                        except RuntimeError as err:  # e.g. a crash in the engine: recorded, the run goes on
                            failed[(e, p)] = str(err)
                            log(f"{e} {p}: {err}; left out")
                            continue
                        m = {"engine": e, "precision": p, "prompt_len": t, "round": r, "loadavg_1m": load} | result
                        measurements.append(m)
                        log(f"round {r + 1}/{args.rounds}: {e} {p} prompt {t}: load {ms(m['load_s'])} ms, fresh "
                            f"{ms(m['ttft_s'][0])} ms, warm {', '.join(ms(x) for x in m['ttft_s'][1:])} ms "
                            f"(faults {m['minor_faults']}; load avg {load:.2f})")
                        time.sleep(GAP_S)
    for m in measurements:
        if m["engine"] == "gpt2x" and len(set(m["first_tokens"])) != 1:
            log(f"warning: gpt2x {m['precision']} prompt {m['prompt_len']}: first tokens differ between requests "
                f"{m['first_tokens']}")
    summary = summarize(measurements)
    loads = [m["loadavg_1m"] for m in measurements] or [os.getloadavg()[0]]
    text = markdown(summary, args, env, record, loads)
    if failed:
        text += "\nNot measured: " + "; ".join(f"{e} {p}: {why[:300]}" for (e, p), why in failed.items()) + "\n"
    settings = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items() if k != "child"}
    save_results(args.out, {"machine": env, "command": " ".join([Path(sys.executable).name, *sys.argv]),
                            "settings": settings, "llama_cpp": record, "summary": summary,
                            "failed": {f"{e} {p}": why for (e, p), why in failed.items()},
                            "measurements": measurements}, text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
