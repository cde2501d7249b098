"""CTranslate2 (OpenNMT's inference engine), float32 and int8, converted from the same Hugging Face
folder as a user would: `ct2-transformers-converter --model HF_DIR --output_dir OUT --quantization
float32|int8` as a subprocess (the folder gets GPT-2's tokenizer files beside the weights, since the
converter writes the vocabulary from the tokenizer). Run by ctranslate2.Generator(OUT, device="cpu",
compute_type=the same type, intra_threads=cores, inter_threads=1).

Generation: Generator.generate_batch with the prompt's token ids as the converted vocabulary's
strings (vocabulary.json; CTranslate2 takes strings), include_prompt_in_result=False (the whole
prompt forwarded at once into the KV cache: the prefill), greedy (beam_size 1, sampling_topk 1),
max_length = min_length = new tokens so that EOS cannot stop it (min_length masks EOS like
transformers' min_new_tokens), and a step callback that stamps the clock as each step's tokens are
chosen (after the last row's token of the step, for a batch). generate_tokens, CTranslate2's
streaming call, is this very call made asynchronous with the same callback feeding a queue that a
Python thread reads; calling generate_batch with the callback keeps that thread hop out of the
timing while still separating the first token (prefill) from decoding (measured: the same figures
within noise, int8 decode 53.7 against 53.3 tok/s). Batches of equal-length prompts run as one
batch, so every --batch size runs.

CTranslate2's own CPU choices stay: on this AMD CPU it runs oneDNN for float32 and int8 GEMMs (Intel
MKL is off on non-Intel CPUs unless CT2_USE_MKL=1; measured with it: float32 about the same, int8
4.3 tok/s against 53.7), int8 weights with int8_float32 compute.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from gpt2x.choices import Precision

from .core import Context, StampedLoop, error_line, log, process_error

KEY = "ctranslate2"
ORDER = 60
LABEL = "CTranslate2"
QUANTIZATIONS = {Precision.fp32: "float32", Precision.int8: "int8"}  # int4: CTranslate2 has no 4-bit CPU type


class CT2(StampedLoop):
    batches = None
    runtime = "CTranslate2"

    def __init__(self, folder: Path, quantization: str, precision: Precision, threads: int):
        import ctranslate2

        self.name, self.engine, self.precision = f"{self.runtime} {quantization}", "ctranslate2", precision
        self.generator = ctranslate2.Generator(str(folder), device="cpu", compute_type=quantization,
                                               intra_threads=threads, inter_threads=1)
        self.vocab = json.loads((folder / "vocabulary.json").read_text(encoding="utf-8"))
        self.details = {"ct2_quantization": quantization, "ct2_compute_type": self.generator.compute_type}

    def _generate(self, prompt: np.ndarray, n: int, stamps: list[float]) -> np.ndarray:
        B = prompt.shape[0]
        tokens = np.zeros((B, n), dtype=np.int64)
        seen = [0] * n

        def step(s) -> bool:
            tokens[s.batch_id, s.step] = s.token_id
            seen[s.step] += 1
            if seen[s.step] == B:
                stamps.append(time.perf_counter())
            return False

        start = [[self.vocab[i] for i in row] for row in prompt.tolist()]
        self.generator.generate_batch(start, max_length=n, min_length=n, beam_size=1, sampling_topk=1,
                                      include_prompt_in_result=False, callback=step)
        assert min(seen) == B, seen
        return tokens


def converter() -> str:
    """ct2-transformers-converter beside this Python (the venv's), else on PATH."""
    here = Path(sys.executable).parent / "ct2-transformers-converter"
    return str(here) if here.is_file() else (shutil.which("ct2-transformers-converter") or str(here))


def convert(ctx: Context, quantization: str) -> tuple[Path, dict]:
    out = ctx.work / f"ct2-{quantization}"
    cmd = [converter(), "--model", str(ctx.hf_dir_with_tokenizer()), "--output_dir", str(out), "--quantization", quantization]
    log(f"CTranslate2: {' '.join(cmd[1:])}")
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True)
    record = {"returncode": proc.returncode, "seconds": time.perf_counter() - t0}
    if proc.returncode != 0 or not (out / "model.bin").is_file():
        raise RuntimeError(f"ct2-transformers-converter failed ({proc.returncode}): {process_error(proc.stderr)}")
    record["model_bin_bytes"] = (out / "model.bin").stat().st_size
    return out, record


def load(ctx: Context) -> list:
    import ctranslate2

    record: dict = {"version": ctranslate2.__version__,
                    "command": "ct2-transformers-converter --model HF_FOLDER --output_dir OUT --quantization Q"}
    ctx.results["ctranslate2"] = record
    contenders = []
    for precision, quantization in QUANTIZATIONS.items():
        if precision not in ctx.precisions:
            continue
        name = f"CTranslate2 {quantization}"
        try:
            folder, record[quantization] = convert(ctx, quantization)
            contenders.append(CT2(folder, quantization, precision, ctx.threads))
        except Exception as e:
            ctx.skip(name, error_line(e))
    return contenders
