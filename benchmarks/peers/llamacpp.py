"""llama.cpp through llama-cpp-python: GGUF f32, q8_0, q4_0 and q4_K_M (precisions fp32, int8, int4,
int4), batch 1.

Conversion, as a llama.cpp user does it, from the same Hugging Face folder (with GPT-2's tokenizer
files beside the weights, which the converter reads the vocabulary from):
    python convert_hf_to_gguf.py HF_DIR --outfile gpt2-f32.gguf --outtype f32
with the convert_hf_to_gguf.py (and the gguf-py beside it) of the llama.cpp sources the
llama-cpp-python sdist carries (benchmarks/setup_peers.sh keeps it unpacked in
VENV/src/llama_cpp_python-VERSION; LLAMA_CPP_CONVERT=path/to/convert_hf_to_gguf.py overrides), then
    llama_model_quantize(gpt2-f32.gguf, gpt2-TYPE.gguf, {ftype: TYPE, nthread: cores})
llama.cpp's own quantizer (the C function the llama-quantize tool calls; the bindings' build ships
no tool), through the bindings, each in a subprocess whose output is kept out of the run's.

Running: llama_cpp.Llama(gguf, n_threads = n_threads_batch = cores, n_ctx = longest prompt + new
tokens, n_batch = n_ubatch = max(512, longest prompt) so a prompt is one decode call, logits_all
False, verbose False, flash_attn True: what llama.cpp's own default (flash_attn_type auto) resolves
to on a CPU, where the bindings' default would turn it off; the KV cache stays llama.cpp's default
f16). The prompt's token ids are fed directly, no text tokenization. Flash attention measured on this
2-core VM (2026-11-23, 32-token prompt, 64 tokens, 4 alternating runs, one process): decode f32
49.7 -> 52.7 tok/s, q8_0 148.8 -> 183.5, q4_K_M 189.3 -> 244.1; time to first token 10-15% lower.

The loop: llm.reset(); llm.eval(prompt) (the prefill, one llama_decode); then per token the argmax
of the last position's logits (llama_get_logits_ith(ctx, -1), read in place, no copy; EOS masked
like transformers' min_new_tokens, so that EOS never stops it or changes the tokens compared),
the clock stamped as the token is chosen, and llm.eval([token]) (one llama_decode) for the next.
Why not Llama.generate: it keeps the previous call's tokens and skips re-evaluating the longest
common prefix, so every round after the first would time a prompt already in the KV cache (a TTFT
of nothing), and it samples through a sampler chain configured for sampling; the eval loop runs the
same llama_decode per token that generate does, so decode is llama.cpp's, and TTFT is the whole
prefill of the prompt. llama_decode on the CPU returns once the logits are computed, so each
stamp follows finished work.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from gpt2x.choices import Precision

from .core import Context, StampedLoop, error_line, log, process_error

KEY = "llama.cpp"
ORDER = 50
LABEL = "llama.cpp"
# GGUF type -> (precision compared with, llama_ftype constant in llama_cpp)
GGUF_TYPES = {"f32": (Precision.fp32, "LLAMA_FTYPE_ALL_F32"), "q8_0": (Precision.int8, "LLAMA_FTYPE_MOSTLY_Q8_0"),
              "q4_0": (Precision.int4, "LLAMA_FTYPE_MOSTLY_Q4_0"), "q4_K_M": (Precision.int4, "LLAMA_FTYPE_MOSTLY_Q4_K_M")}
FLASH_ATTN = True
QUANTIZE = ("import ctypes, sys, llama_cpp\n"
            "p = llama_cpp.llama_model_quantize_default_params()\n"
            "p.ftype, p.nthread = int(sys.argv[3]), int(sys.argv[4])\n"
            "sys.exit(llama_cpp.llama_model_quantize(sys.argv[1].encode(), sys.argv[2].encode(), ctypes.byref(p)))\n")


def no_extra_buffer_types() -> None:
    """Every Llama made from now on loads its weights without llama.cpp's extra buffer types
    (llama_model_params.use_extra_bufts = false: no AMX and no repacked CPU layouts, the plain
    quantized kernels), which Llama(...) has no argument for. --llama-no-extra-bufts: on a CPU with
    AMX, llama.cpp's AMX matrix multiply crashes on the quantized GGUFs here (a segmentation fault
    in ggml_backend_amx_mul_mat at the first llama_decode; ggml-org/llama.cpp#20824) unless the
    bindings were built without AMX."""
    import llama_cpp.llama_cpp as bindings

    default = bindings.llama_model_default_params

    def params():
        p = default()
        p.use_extra_bufts = False
        return p

    bindings.llama_model_default_params = params  # what Llama.__init__ calls


class LlamaCpp(StampedLoop):
    batches = {1}
    only = "batch 1 only (llama.cpp: one sequence per llama_decode here)"
    runtime = "llama.cpp"
    engine = "llama.cpp"

    def __init__(self, gguf: Path, gguf_type: str, precision: Precision, threads: int, n_ctx: int, n_batch: int):
        import llama_cpp

        self.llama_cpp = llama_cpp
        self.name, self.precision = f"{self.runtime} {gguf_type}", precision
        self.llm = llama_cpp.Llama(str(gguf), n_threads=threads, n_threads_batch=threads, n_ctx=n_ctx, n_batch=n_batch,
                                   n_ubatch=n_batch, logits_all=False, flash_attn=FLASH_ATTN, verbose=False)
        self.n_vocab, self.eos = self.llm.n_vocab(), self.llm.token_eos()
        self.details = {"gguf_type": gguf_type, "gguf_bytes": gguf.stat().st_size, "flash_attn": FLASH_ATTN,
                        "n_ctx": self.llm.n_ctx(), "n_batch": n_batch}

    def _next(self) -> int:
        logits = np.ctypeslib.as_array(self.llama_cpp.llama_get_logits_ith(self.llm.ctx, -1), shape=(self.n_vocab,))
        token = int(logits.argmax())
        if token == self.eos:  # as min_new_tokens: EOS is not a candidate
            token = int(np.argmax(np.where(np.arange(self.n_vocab) == self.eos, -np.inf, logits)))
        return token

    def _generate(self, prompt: np.ndarray, n: int, stamps: list[float]) -> np.ndarray:
        assert prompt.shape[0] == 1, "batch 1 only"
        llm = self.llm
        llm.reset()
        llm.eval(prompt[0].tolist())
        tokens = [self._next()]
        stamps.append(time.perf_counter())
        for _ in range(n - 1):
            llm.eval([tokens[-1]])
            tokens.append(self._next())
            stamps.append(time.perf_counter())
        return np.array([tokens], dtype=np.int64)


def converter() -> Path:
    """convert_hf_to_gguf.py: LLAMA_CPP_CONVERT, else the one in the unpacked sdist setup_peers.sh keeps."""
    if os.environ.get("LLAMA_CPP_CONVERT"):
        return Path(os.environ["LLAMA_CPP_CONVERT"])
    import llama_cpp

    return Path(sys.prefix) / "src" / f"llama_cpp_python-{llama_cpp.__version__}" / "vendor" / "llama.cpp" / "convert_hf_to_gguf.py"


def llama_cpp_commit(script: Path) -> str | None:
    """The llama.cpp commit the sdist vendors, from its CHANGELOG.md (the newest "update llama.cpp to")."""
    changelog = script.parent.parent.parent / "CHANGELOG.md"
    if not changelog.is_file():
        return None
    found = re.search(r"update llama\.cpp to ([\w.-]+/llama\.cpp@[0-9a-f]+)", changelog.read_text(encoding="utf-8"))
    return found.group(1) if found else None


def run_tool(cmd: list[str], what: str) -> float:
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"{what} failed ({proc.returncode}): {process_error(proc.stderr or proc.stdout)}")
    return time.perf_counter() - t0


def convert_f32(script: Path, hf_dir: Path, folder: Path) -> tuple[Path, float]:
    """HF_DIR (with GPT-2's tokenizer files) -> FOLDER/gpt2-f32.gguf by llama.cpp's convert_hf_to_gguf.py;
    the GGUF and the seconds it took."""
    f32 = folder / "gpt2-f32.gguf"
    log(f"llama.cpp: {script.name} -> {f32.name}")
    return f32, run_tool([sys.executable, str(script), str(hf_dir), "--outfile", str(f32), "--outtype", "f32"], "convert_hf_to_gguf.py")


def quantize(f32: Path, gguf_type: str, threads: int) -> tuple[Path, float]:
    """gpt2-f32.gguf -> gpt2-TYPE.gguf beside it by llama.cpp's quantizer (llama_model_quantize, in a
    subprocess); the GGUF and the seconds it took."""
    import llama_cpp

    path = f32.with_name(f"gpt2-{gguf_type}.gguf")
    log(f"llama.cpp: quantizing to {gguf_type}")
    ftype = getattr(llama_cpp, GGUF_TYPES[gguf_type][1])
    return path, run_tool([sys.executable, "-c", QUANTIZE, str(f32), str(path), str(ftype), str(threads)],
                          f"llama_model_quantize to {gguf_type}")


def load(ctx: Context) -> list:
    import llama_cpp

    script = converter()
    record: dict = {"llama_cpp_python": llama_cpp.__version__, "llama_cpp_commit": llama_cpp_commit(script),
                    "converter": str(script), "system_info": llama_cpp.llama_print_system_info().decode(errors="replace").strip(),
                    "command": "python convert_hf_to_gguf.py HF_FOLDER --outfile gpt2-f32.gguf --outtype f32; "
                               "llama_model_quantize(gpt2-f32.gguf, gpt2-TYPE.gguf, ftype=TYPE)"}
    ctx.results["llama_cpp"] = record
    wanted = {t: p for t, (p, _) in GGUF_TYPES.items() if p in ctx.precisions}
    if not wanted:
        return []
    if not script.is_file():
        raise FileNotFoundError(f"{script}: llama.cpp's converter not found (bash benchmarks/setup_peers.sh unpacks it; "
                                "or set LLAMA_CPP_CONVERT)")
    folder = ctx.work / "gguf"
    folder.mkdir(parents=True, exist_ok=True)
    f32, seconds = convert_f32(script, ctx.hf_dir_with_tokenizer(), folder)
    record["seconds"] = {"f32": seconds}
    n_ctx = ctx.max_prompt + ctx.new_tokens
    n_batch = max(512, ctx.max_prompt)
    contenders = []
    for gguf_type, precision in wanted.items():
        name = f"llama.cpp {gguf_type}"
        path = f32
        try:
            if gguf_type != "f32":
                path, record["seconds"][gguf_type] = quantize(f32, gguf_type, ctx.threads)
            contenders.append(LlamaCpp(path, gguf_type, precision, ctx.threads, n_ctx, n_batch))
        except Exception as e:
            ctx.skip(name, error_line(e))
    return contenders
