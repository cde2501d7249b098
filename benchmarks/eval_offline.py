"""lm-evaluation-harness scores of the bundled model on the offline tasks (tests/data/lm_eval_tasks),
for gpt2x on ONNX Runtime at fp32, int8 and int4, beside lm-eval's own `hf` model (transformers on the
same weights, float32):

    python benchmarks/eval_offline.py --out benchmarks/results/eval-offline-cpu-2core

The standard tasks (lambada_openai, wikitext, hellaswag) need their data sets from the hub; this
machine has no network, so they are not run here (`gpt2x eval --tasks lambada_openai,wikitext` runs
them where the hub is reachable).
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
from pathlib import Path

import torch
from lm_eval import simple_evaluate
from lm_eval.models.huggingface import HFLM
from lm_eval.tasks import TaskManager
from transformers import GPT2LMHeadModel, GPT2TokenizerFast

from gpt2x.bench.report import save_results
from gpt2x.bench.system import system_info
from gpt2x.choices import BackendKind, Precision
from gpt2x.lmeval.model import Gpt2xLM
from gpt2x.onnx.artifact import default_export_dir
from gpt2x.tokenizer import bpe_file
from gpt2x.workflows.backends import export_backend
from gpt2x.workflows.exports import ensure_export

REPO = Path(__file__).resolve().parent.parent
TASKS = REPO / "tests" / "data" / "lm_eval_tasks"
TASK_NAMES = ["gpt2x_shakespeare_mc", "gpt2x_shakespeare_ppl"]
METRICS = {"gpt2x_shakespeare_mc": ["acc,none", "acc_norm,none"],
           "gpt2x_shakespeare_ppl": ["word_perplexity,none", "byte_perplexity,none", "bits_per_byte,none"]}


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def hf_model() -> HFLM:
    folder = Path(tempfile.mkdtemp(prefix="gpt2-tokenizer-"))
    shutil.copy(bpe_file("encoder.json"), folder / "vocab.json")
    shutil.copy(bpe_file("vocab.bpe"), folder / "merges.txt")
    model = GPT2LMHeadModel.from_pretrained(REPO / "gpt2x" / "data" / "shakespeare", dtype=torch.float32).eval()
    return HFLM(pretrained=model, tokenizer=GPT2TokenizerFast.from_pretrained(str(folder)), batch_size=8, device="cpu")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--exports", type=Path, default=Path("exported"))
    ap.add_argument("--out", type=Path, required=True, help="output path without extension (.json, .md)")
    args = ap.parse_args()
    manager = TaskManager(include_path=str(TASKS), include_defaults=False)
    rows = []
    lms = [("hf (transformers, fp32)", hf_model)]
    for precision in (Precision.fp32, Precision.int8, Precision.int4):
        def make(precision=precision):
            info = ensure_export("shakespeare", precision, folder=default_export_dir("shakespeare", precision, args.exports),
                                 progress=log, notice=log)
            return Gpt2xLM(export_backend(BackendKind.ort, info))
        lms.append((f"gpt2x ort {precision.value}", make))
    for label, make in lms:
        log(f"{label}: evaluating")
        result = simple_evaluate(model=make(), tasks=TASK_NAMES, task_manager=manager)
        rows.append({"model": label, "results": {t: {m: result["results"][t][m] for m in METRICS[t]} for t in TASK_NAMES}})
    header = ["model", *[f"{t.removeprefix('gpt2x_shakespeare_')} {m.split(',')[0]}" for t in TASK_NAMES for m in METRICS[t]]]
    lines = ["Bundled model on the offline tasks (all documents), lm-evaluation-harness 0.4.13.", "",
             "| " + " | ".join(header) + " |", "| --- |" + " ---: |" * (len(header) - 1)]
    for row in rows:
        values = [row["results"][t][m] for t in TASK_NAMES for m in METRICS[t]]
        lines.append(f"| {row['model']} | " + " | ".join(f"{v:.4f}" for v in values) + " |")
    lines += ["", "Not run here (no network): lambada_openai, wikitext, hellaswag (their data sets come from the hub)."]
    text = "\n".join(lines) + "\n"
    save_results(args.out, {"machine": system_info(), "command": " ".join(["python", *sys.argv]), "rows": rows}, text)
    print(text)


if __name__ == "__main__":
    main()
