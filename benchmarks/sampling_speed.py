"""One decode step's sampling (logits to tokens) at batch 1 and 16 over GPT-2's vocabulary, per setting.

    python benchmarks/sampling_speed.py --label before   # writes benchmarks/results/sampling-speed-<machine>/before.{json,md}
    git worktree add /tmp/base COMMIT && python benchmarks/sampling_speed.py --baseline /tmp/base --label after
        # before.* (the baseline checkout) and after.* (this one), timed in turn step by step

Two paths, both through gpt2x.generation.sampling's public API, on the same float32 logits (B, 50257), a
pool of arrays reused in turn: by default random (standard normal times 3: flat rows, whose top-p keeps
thousands of tokens), with `--logits bundled` the bundled model's own over held-out text (a trained model's peaked
rows), computed once by this checkout and handed to every worker:
- shared: one Sampler for every row (`gpt2x generate`'s batch: one settings, one stream);
- per-row: sample_many over a Sampler per row, each its own seed (the serving engine's batch).
Settings: greedy, temperature 0.7, top-k 50, top-p 0.9, min-p 0.05, and at batch 16 a mix of
those and of combinations, different in every row (per-row path only). Median ms over the timed
steps (cases interleaved step by step, and with --baseline the two checkouts too, so that the
machine's drift hits them alike), and a digest of every drawn token, which must match between two
runs on the same logits where the tokens are meant to agree. glibc's malloc is set to keep its
heap (steady_malloc; --default-malloc leaves it), so that page faults do not move with the order
of the cases.
"""

from __future__ import annotations

import argparse
import ctypes
import hashlib
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

import numpy as np

from gpt2x.generation import sampling
from gpt2x.generation.processors import History
from gpt2x.generation.sampling import Sampler, sample_many
from gpt2x.generation.settings import SamplingSettings

V = 50257
ROOT = Path(__file__).resolve().parent.parent
CODE = Path(sampling.__file__).resolve().parents[2]  # the checkout whose gpt2x runs (PYTHONPATH may name another)
TIMED = ("sampling", "processors", "settings", "constraints")  # the modules a sampling step runs
UNIFORM = {
    "greedy": {"greedy": True},
    "temperature": {"temperature": 0.7},
    "top-k": {"top_k": 50},
    "top-p": {"top_p": 0.9},
    "min-p": {"min_p": 0.05},
}
# Sixteen rows, each its own settings: every warper, alone and combined, and greedy rows among them.
MIX = [
    {"greedy": True}, {"temperature": 0.7}, {"top_k": 50}, {"top_p": 0.9},
    {"min_p": 0.05}, {"temperature": 0.8, "top_p": 0.95}, {"temperature": 1.2, "top_k": 40}, {"top_k": 20, "top_p": 0.8},
    {}, {"temperature": 0.5, "min_p": 0.1}, {"top_p": 0.7}, {"top_k": 100},
    {"greedy": True}, {"temperature": 0.9, "top_k": 30, "top_p": 0.9}, {"min_p": 0.02, "top_p": 0.95}, {"temperature": 1.5},
]


def cpu_model() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines() if Path("/proc/cpuinfo").exists() else ():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()


def steady_malloc() -> dict | str:
    """glibc's heap kept (no trim; arrays up to 32 MB from the heap, not mmap): its default thresholds
    move with what ran before (freeing a large array raises them), so a case's page faults (up to a
    third of a step's time at batch 16) would depend on the other cases and the other code."""
    try:
        libc = ctypes.CDLL("libc.so.6")
        ok = libc.mallopt(-3, 32 << 20) and libc.mallopt(-1, 1 << 30)  # M_MMAP_THRESHOLD, M_TRIM_THRESHOLD
    except (OSError, AttributeError):
        ok = 0
    return {"mmap_threshold": 32 << 20, "trim_threshold": 1 << 30} if ok else "default (not glibc)"


def commit() -> str:
    def git(*args: str) -> str:
        return subprocess.run(["git", *args], cwd=CODE, capture_output=True, text=True, check=False).stdout.strip()
    head = git("rev-parse", "--short", "HEAD") or "unknown"
    # dirty: the sampling code timed differs from the commit (others' edits elsewhere do not count)
    dirty = git("status", "--porcelain", "--", *(f"gpt2x/generation/{m}.py" for m in TIMED))
    return head + ("+dirty" if dirty else "")


class Case:
    """One timed setting: a callable logits -> tokens, its times and the tokens it drew."""

    def __init__(self, name: str, path: str, batch: int, per_row: list[dict]):
        self.name, self.path, self.batch = name, path, batch
        settings = [SamplingSettings(seed=i, **kw) for i, kw in enumerate(per_row)]
        self.rows = [History([464, 3290], []) for _ in range(batch)]
        if path == "shared":
            sampler = Sampler(settings[0])
            self.step = lambda x: sampler(x, self.rows)
        else:
            samplers = [Sampler(s) for s in settings]
            self.step = lambda x: sample_many(samplers, x, self.rows)
        self.times: list[float] = []
        self.digest = hashlib.sha256()

    def run(self, logits: np.ndarray, timed: bool) -> None:
        t = time.perf_counter()
        tokens = self.step(logits)
        if timed:
            self.times.append((time.perf_counter() - t) * 1e3)
            self.digest.update(np.asarray(tokens, dtype=np.int64).tobytes())

    def result(self) -> dict:
        return {"setting": self.name, "path": self.path, "batch": self.batch,
                "median_ms": statistics.median(self.times), "mean_ms": statistics.fmean(self.times),
                "steps": len(self.times), "tokens_sha256": self.digest.hexdigest()[:16]}


def cases(batches: list[int]) -> list[Case]:
    out = []
    for b in batches:
        for name, kw in UNIFORM.items():
            out.append(Case(name, "shared", b, [kw] * b))
            out.append(Case(name, "per-row", b, [kw] * b))
        if b == len(MIX):
            out.append(Case("mix", "per-row", b, MIX))
    return out


LOGITS = {"normal": "random float32 logits", "bundled": "the bundled model's float32 logits over held-out text"}


def bundled_logits(positions: int = 256) -> np.ndarray:
    """The bundled model's logits (positions, V) at each position of the held-out text's first tokens (torch)."""
    import torch

    from gpt2x.evaluate.metrics import heldout_text
    from gpt2x.model.weights import load_model
    from gpt2x.tokenizer import encode

    model, _ = load_model("shakespeare")
    with torch.no_grad():
        return model(torch.tensor([encode(heldout_text())[:positions]]))[0][0].float().numpy()


def table(results: list[dict], steps: int, logits: str) -> str:
    lines = [f"One sampling step, {LOGITS[logits]} (B, {V}), median ms over {steps} steps "
             "(shared: one Sampler for the batch; per-row: sample_many, a Sampler per row).", "",
             "| setting | batch | path | median ms | mean ms | tokens |", "| --- | ---: | --- | ---: | ---: | --- |"]
    lines += [f"| {r['setting']} | {r['batch']} | {r['path']} | {r['median_ms']:.3f} | {r['mean_ms']:.3f} | "
              f"`{r['tokens_sha256']}` |" for r in results]
    return "\n".join(lines) + "\n"


def comparison(base: list[dict], new: list[dict], base_label: str, label: str) -> str:
    """The two checkouts' medians side by side (timed in turn), and whether they drew the same tokens."""
    lines = [f"| setting | batch | path | {base_label} ms | {label} ms | {label} / {base_label} | same tokens |",
             "| --- | ---: | --- | ---: | ---: | ---: | --- |"]
    lines += [f"| {a['setting']} | {a['batch']} | {a['path']} | {a['median_ms']:.3f} | {b['median_ms']:.3f} | "
              f"{b['median_ms'] / a['median_ms']:.2f} | {'yes' if a['tokens_sha256'] == b['tokens_sha256'] else 'NO'} |"
              for a, b in zip(base, new)]
    return "\n".join(lines) + "\n"


class Bench:
    """Every case over its batch's pool of logits, one step at a time."""

    def __init__(self, batches: list[int], pool: int, logits: np.ndarray | None = None):
        rng = np.random.default_rng(0)
        if logits is None:
            self.pools = {b: [(rng.standard_normal((b, V)) * 3).astype(np.float32) for _ in range(pool)] for b in batches}
        else:  # consecutive positions' rows, from where the last array of the pool ended
            at = lambda b, j: np.arange(j * b, (j + 1) * b) % len(logits)  # noqa: E731
            self.pools = {b: [np.ascontiguousarray(logits[at(b, j)]) for j in range(pool)] for b in batches}
        self.todo = cases(batches)

    def step(self, step: int, timed: bool) -> None:
        for case in self.todo:  # interleaved: every case sees each step's array at the same moment
            pool = self.pools[case.batch]
            case.run(pool[step % len(pool)], timed)

    def run(self) -> dict:
        return {"commit": commit(), "results": [c.result() for c in self.todo]}


def worker(args: argparse.Namespace) -> None:
    """--worker: the steps named on stdin, one a line ("ok" after each); "end": the run as one JSON line."""
    bench = Bench(args.batch_list, args.pool, np.load(args.logits_file) if args.logits_file else None)
    for line in sys.stdin:
        if line.strip() == "end":
            break
        step = int(line)
        bench.step(step, timed=step >= args.warmup)
        print("ok", flush=True)
    print(json.dumps(bench.run()), flush=True)


def interleaved(args: argparse.Namespace, checkouts: dict[str, Path]) -> dict[str, dict]:
    """The same steps in one worker process per checkout, taking turns step by step (take_turns)."""
    command = [sys.executable, __file__, "--worker", "--batches", args.batches, "--pool", str(args.pool),
               "--warmup", str(args.warmup), *(["--default-malloc"] if args.default_malloc else []),
               *(["--logits-file", str(args.logits_file)] if args.logits_file else [])]
    return take_turns(command, checkouts, args.warmup + args.steps)


def take_turns(command: list[str], checkouts: dict[str, Path], steps: int) -> dict[str, dict]:
    """`command` started once per checkout (its PYTHONPATH), the workers taking turns step by step, the order
    alternating, so that the machine's drift over the run hits every checkout alike. A worker reads a step's number a
    line and answers "ok" once it ran it; after "end", its run as one JSON line: {checkout: run}. (logprobs_speed.py's
    workers too.)"""
    procs = {name: subprocess.Popen(command, env={**os.environ, "PYTHONPATH": str(path)}, stdin=subprocess.PIPE,
                                    stdout=subprocess.PIPE, text=True) for name, path in checkouts.items()}
    names = list(procs)
    for step in range(steps):
        for name in names if step % 2 == 0 else names[::-1]:
            proc = procs[name]
            proc.stdin.write(f"{step}\n")
            proc.stdin.flush()
            if proc.stdout.readline().strip() != "ok":
                raise SystemExit(f"the {name} worker ({checkouts[name]}) failed at step {step}")
    runs = {}
    for name, proc in procs.items():
        proc.stdin.write("end\n")
        proc.stdin.flush()
        runs[name] = json.loads(proc.stdout.readline())
        proc.wait()
    return runs


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batches", default="1,16", help="comma-separated batch sizes (the mix runs at 16)")
    ap.add_argument("--steps", type=int, default=300, help="timed steps per case")
    ap.add_argument("--warmup", type=int, default=10, help="untimed steps per case first")
    ap.add_argument("--pool", type=int, default=8, help="distinct logits arrays per batch size, used in turn")
    ap.add_argument("--label", default="run", help="the results file's name (before, after, ...)")
    ap.add_argument("--baseline", type=Path, default=None,
                    help="another checkout (git worktree add DIR COMMIT) timed in turn with this one, step by step")
    ap.add_argument("--baseline-label", default="before", help="the baseline's results file's name")
    ap.add_argument("--out-dir", type=Path, default=None,
                    help="default: benchmarks/results/sampling-speed-cpu-<cores>core")
    ap.add_argument("--no-save", action="store_true", help="print only")
    ap.add_argument("--json", action="store_true", help="print the JSON records instead of the tables")
    ap.add_argument("--default-malloc", action="store_true", help="leave glibc's malloc thresholds as they are")
    ap.add_argument("--logits", choices=sorted(LOGITS), default="normal", help="the logits sampled (see above)")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--logits-file", type=Path, default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    args.batch_list = [int(b) for b in args.batches.split(",")]
    malloc = "default" if args.default_malloc else steady_malloc()
    if args.worker:
        return worker(args)
    with tempfile.TemporaryDirectory() as tmp:
        if args.logits == "bundled":
            args.logits_file = Path(tmp) / "logits.npy"
            np.save(args.logits_file, bundled_logits())
        if args.baseline is not None:
            runs = interleaved(args, {args.baseline_label: args.baseline.resolve(), args.label: ROOT})
        else:
            bench = Bench(args.batch_list, args.pool, np.load(args.logits_file) if args.logits_file else None)
            for step in range(args.warmup + args.steps):
                bench.step(step, timed=step >= args.warmup)
            runs = {args.label: bench.run()}
    common = {"command": " ".join(["python", "benchmarks/sampling_speed.py", *sys.argv[1:]]),
              "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
              "machine": {"cpu": cpu_model(), "cores": os.cpu_count(), "python": platform.python_version(),
                          "numpy": np.__version__, "malloc": malloc},
              "vocab": V, "logits": args.logits, "steps": args.steps, "warmup": args.warmup, "pool": args.pool}
    out_dir = args.out_dir or ROOT / "benchmarks" / "results" / f"sampling-speed-cpu-{os.cpu_count()}core"
    for label, run in runs.items():
        others = {k: r["commit"] for k, r in runs.items() if k != label}
        record = {**common, "label": label, "commit": run["commit"],
                  **({"interleaved_with": others} if others else {}), "results": run["results"]}
        text = table(run["results"], args.steps, args.logits)
        if args.baseline is not None and label == args.label:
            text += "\n" + comparison(runs[args.baseline_label]["results"], run["results"], args.baseline_label, label)
        head = (f"{label}: `{record['command']}` at {record['commit']}"
                + "".join(f" (interleaved with {k} at {c})" for k, c in others.items())
                + f", {record['date']}, {record['machine']['cpu']} ({record['machine']['cores']} cores)\n\n")
        if not args.no_save:
            out_dir.mkdir(parents=True, exist_ok=True)
            (out_dir / f"{label}.json").write_text(json.dumps(record, indent=1) + "\n")
            (out_dir / f"{label}.md").write_text(head + text)
        print(json.dumps(record, indent=1) if args.json else head + text)
    return None


if __name__ == "__main__":
    main()
