"""What a deployment without torch saves: install size and cold start of `gpt2x generate --onnx`.

Builds gpt2x's wheel, installs it into two fresh virtual environments, and measures:
- size: the environment's site-packages after `pip install gpt2x` (ONNX Runtime path only) and after
  `pip install torch==2.13.0` + `pip install 'gpt2x[export]'` (the full install, CPU torch);
- cold start: process start to the first generated token on stdout, `gpt2x generate PROMPT --onnx DIR
  --greedy`, for (a) the deployment install, (b) the full install (torch installed, not imported),
  (c) the full install with `import torch` first (what every `generate --onnx` paid before the
  layered package). Interleaved rounds, median and range reported.

    python benchmarks/deploy_footprint.py --out benchmarks/results/deploy-footprint-cpu-2core

Needs a package index (pip) and an existing fp32 export (made with the full install if missing).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from gpt2x.bench.system import system_info
from gpt2x.choices import Precision
from gpt2x.workflows.exports import ensure_export

REPO = Path(__file__).resolve().parent.parent
TORCH = "torch==2.13.0"
PROMPT = "ROMEO:"
WITH_TORCH = "import sys, torch; from gpt2x.cli.app import main; sys.argv = ['gpt2x', *sys.argv[1:]]; main()"


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def run(*cmd: str) -> None:
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)


def site_packages_bytes(venv: Path) -> int:
    [site] = list(venv.glob("lib/python*/site-packages"))
    return sum(p.stat().st_size for p in site.rglob("*") if p.is_file() and not p.is_symlink())


def largest_packages(venv: Path, n: int = 6) -> dict[str, int]:
    """Bytes of the n largest top-level entries of site-packages (packages and their .libs)."""
    [site] = list(venv.glob("lib/python*/site-packages"))
    sizes = {p.name: sum(f.stat().st_size for f in p.rglob("*") if f.is_file() and not f.is_symlink())
             for p in site.iterdir() if p.is_dir() and not p.name.endswith((".dist-info", "__pycache__"))}
    return dict(sorted(sizes.items(), key=lambda kv: -kv[1])[:n])


def make_venv(path: Path, wheel: Path, full: bool) -> Path:
    run(sys.executable, "-m", "venv", str(path))
    pip = [str(path / "bin" / "python"), "-m", "pip", "install", "--quiet"]
    if full:
        run(*pip, TORCH)
        run(*pip, f"{wheel}[export]")
    else:
        run(*pip, str(wheel))
    return path


def first_token_seconds(cmd: list[str]) -> float:
    """Seconds from process start until stdout holds more than the prompt (the first token's text)."""
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
    got = b""
    while len(got) <= len(PROMPT):
        chunk = proc.stdout.read1(64)
        if not chunk:
            raise RuntimeError(f"no token from {cmd}")
        got += chunk
    elapsed = time.perf_counter() - t0
    proc.wait()
    return elapsed


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="shakespeare")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--out", type=Path, required=True, help="results path without suffix (.json and .md are written)")
    args = ap.parse_args()

    info = ensure_export(args.model, Precision.fp32, progress=log, notice=log)
    with tempfile.TemporaryDirectory(prefix="gpt2x-deploy-") as tmp:
        tmp = Path(tmp)
        log("building the wheel")
        run(sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "--no-build-isolation", "-w", str(tmp), str(REPO))
        [wheel] = list(tmp.glob("gpt2x-*.whl"))
        log("installing the deployment environment (no torch)")
        deploy = make_venv(tmp / "deploy", wheel, full=False)
        log("installing the full environment (CPU torch + export extra)")
        full = make_venv(tmp / "full", wheel, full=True)
        sizes = {"deploy": site_packages_bytes(deploy), "full": site_packages_bytes(full)}
        largest = {"deploy": largest_packages(deploy), "full": largest_packages(full)}
        gen = ["generate", PROMPT, "--onnx", str(info.folder.resolve()), "--greedy", "--max-new-tokens", "2"]
        variants = {
            "deployment install": [str(deploy / "bin" / "gpt2x"), *gen],
            "full install, torch not imported": [str(full / "bin" / "gpt2x"), *gen],
            "full install, torch imported first": [str(full / "bin" / "python"), "-c", WITH_TORCH, *gen],
        }
        for cmd in variants.values():  # warm the page cache once
            first_token_seconds(cmd)
        times: dict[str, list[float]] = {k: [] for k in variants}
        for r in range(args.rounds):
            log(f"round {r + 1}/{args.rounds}")
            names = list(variants)
            for name in names[r % len(names):] + names[: r % len(names)]:  # rotate the order each round
                times[name].append(first_token_seconds(variants[name]))
        versions = subprocess.run([str(full / "bin" / "python"), "-c", "import torch, onnxruntime; "
                                   "print(torch.__version__, onnxruntime.__version__)"], capture_output=True, text=True).stdout.split()

    result = {
        "machine": system_info(),
        "export": str(info.folder),
        "site_packages_bytes": sizes,
        "largest_packages_bytes": largest,
        "torch": versions[0] if versions else None,
        "onnxruntime": versions[1] if len(versions) > 1 else None,
        "rounds": args.rounds,
        "first_token_s": {k: {"median": statistics.median(v), "min": min(v), "max": max(v), "runs": v} for k, v in times.items()},
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".json").write_text(json.dumps(result, indent=1) + "\n")
    env = result["machine"]
    lines = [
        f"# Deployment footprint ({env['cpu']}, {env['cores']} cores, {env['date']}, gpt2x git {env['git']})",
        "",
        "| install | site-packages |",
        "| --- | ---: |",
        f"| `pip install gpt2x` (ONNX Runtime path) | {sizes['deploy'] / 2**20:.0f} MiB |",
        f"| `pip install {TORCH}` + `gpt2x[export]` (full, CPU torch) | {sizes['full'] / 2**20:.0f} MiB |",
        "",
        "Largest packages: " + "; ".join(
            f"{kind}: " + ", ".join(f"{k} {v / 2**20:.0f} MiB" for k, v in largest[kind].items()) for kind in ("deploy", "full")) + ".",
        "",
        f"Cold start of `gpt2x generate {PROMPT!r} --onnx {info.folder} --greedy`: process start to the first token on "
        f"stdout, {args.rounds} interleaved rounds.",
        "",
        "| variant | median s | range s |",
        "| --- | ---: | ---: |",
    ]
    for name, t in result["first_token_s"].items():
        lines.append(f"| {name} | {t['median']:.2f} | {t['min']:.2f}-{t['max']:.2f} |")
    args.out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
