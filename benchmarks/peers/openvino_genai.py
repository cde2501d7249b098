"""OpenVINO GenAI (openvino-genai's LLMPipeline), int8 and fp32 weights, each at OpenVINO's default
compute precision on this CPU (bf16 where the CPU has AVX-512 BF16 or AMX) and at f32; batch 1.

Conversion, as an OpenVINO user does it, from the same Hugging Face folder (with GPT-2's tokenizer
files beside the weights, which optimum-intel turns into openvino_tokenizer.xml / _detokenizer.xml):
    optimum-cli export openvino --model HF_DIR --task text-generation-with-past --weight-format int8|fp32 OUT
run as a subprocess with the optimum-cli of the converter's own environment (optimum-intel pins
optimum ~= 2.3 where the peers' optimum-onnx pins ~= 2.1: benchmarks/setup_peers.sh installs it in
VENV-optimum beside the peers' VENV; OPTIMUM_CLI=path/to/optimum-cli overrides). int8 is
optimum-intel's data-free 8-bit weight compression (NNCF, per output channel); fp32 keeps the
weights as they are.

Running: ov_genai.LLMPipeline(OUT, "CPU", INFERENCE_NUM_THREADS=cores[, INFERENCE_PRECISION_HINT=f32],
scheduler_config=latency_scheduler()): on a CPU its continuous-batching pipeline with paged attention
(the KV cache's precision the CPU plugin's default), as by default, with the scheduler LLMPipeline
makes for itself (GenAI's get_latency_oriented_scheduler_config: no limit on the tokens of a step)
except its prefix caching, which is on by default and here off: every round repeats the same prompt,
and with it on every run after the first times a prefix-cache hit, not a prefill (measured here,
int8 weights, 32-token prompt: 9-10 ms to the first token for the prompt repeated, 22-32 ms for
fresh prompts, and 22-25 ms repeated with caching off). The prompt's token ids go in as an ov.Tensor (no
text tokenization); greedy, min_new_tokens = max_new_tokens = n and ignore_eos, so that EOS neither
stops it nor is chosen (as transformers' min_new_tokens); a StreamerBase stamps the clock as each
token is written to it, so TTFT is from the call to the first token and decode the rest.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from gpt2x.choices import Precision

from .core import Context, StampedLoop, error_line, log, process_error

KEY = "openvino-genai"
ORDER = 55
LABEL = "OpenVINO GenAI"
WEIGHT_FORMATS = {Precision.fp32: "fp32", Precision.int8: "int8"}  # optimum-cli --weight-format per precision
F32 = "f32"


def optimum_cli() -> Path:
    """optimum-cli: OPTIMUM_CLI, else the one in the converter's venv setup_peers.sh makes beside this one."""
    if os.environ.get("OPTIMUM_CLI"):
        return Path(os.environ["OPTIMUM_CLI"])
    return Path(f"{sys.prefix}-optimum") / "bin" / "optimum-cli"


def converter_versions(cli: Path) -> dict:
    """optimum-intel's, nncf's and openvino's versions in the converter's environment."""
    code = ("import importlib.metadata as m, json\n"
            "print(json.dumps({p: m.version(p) for p in ('optimum-intel', 'optimum', 'nncf', 'openvino', 'openvino-tokenizers', "
            "'transformers', 'torch')}))")
    proc = subprocess.run([str(cli.parent / "python"), "-c", code], capture_output=True, text=True, encoding="utf-8", errors="replace")
    return {} if proc.returncode else json.loads(proc.stdout)


def convert(hf_dir: Path, weight_format: str, out: Path) -> tuple[Path, float]:
    """HF_DIR -> OUT (openvino_model.xml/.bin and the tokenizer's IRs) by optimum-cli export openvino;
    the folder and the seconds it took."""
    cli = optimum_cli()
    if not cli.is_file():
        raise FileNotFoundError(f"{cli}: optimum-cli not found (bash benchmarks/setup_peers.sh installs optimum-intel "
                                "beside the peers' venv; or set OPTIMUM_CLI)")
    cmd = [str(cli), "export", "openvino", "--model", str(hf_dir), "--task", "text-generation-with-past",
           "--weight-format", weight_format, str(out)]
    log(f"OpenVINO GenAI: {' '.join(cmd[1:])}")
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, encoding="utf-8", errors="replace")
    if proc.returncode != 0 or not (out / "openvino_model.xml").is_file():
        raise RuntimeError(f"optimum-cli export openvino failed ({proc.returncode}): {process_error(proc.stderr or proc.stdout)}")
    return out, time.perf_counter() - t0


def default_compute() -> str:
    """The CPU plugin's default INFERENCE_PRECISION_HINT here: "bf16" on a CPU with bf16 (AVX-512 BF16, AMX), else "f32"."""
    import openvino as ov

    return ov.Core().get_property("CPU", "INFERENCE_PRECISION_HINT").get_type_name()  # an ov.Type: "bf16", "f32"


def compute_variants(threads: int) -> dict[str, dict]:
    """{compute precision: pipeline properties}: OpenVINO's default first, then f32 when the default is not f32."""
    base = {"INFERENCE_NUM_THREADS": threads}
    default = default_compute()
    variants = {default: dict(base)}
    if default != F32:
        variants[F32] = base | {"INFERENCE_PRECISION_HINT": F32}
    return variants


def latency_scheduler():
    """LLMPipeline's own scheduler on a CPU (no limit on a step's tokens) with prefix caching off (see above)."""
    import openvino_genai as ov_genai

    config = ov_genai.SchedulerConfig()
    config.max_num_batched_tokens = 2**64 - 1  # size_t max: what GenAI's latency-oriented config sets
    config.enable_prefix_caching = False
    return config


def greedy_config(n: int):
    """Greedy, exactly n tokens: EOS masked for all n (min_new_tokens) and never a stop (ignore_eos)."""
    import openvino_genai as ov_genai

    config = ov_genai.GenerationConfig()
    config.max_new_tokens, config.min_new_tokens, config.ignore_eos, config.do_sample = n, n, True, False
    return config


class OvGenai(StampedLoop):
    batches = {1}
    only = "batch 1 only here (its continuous batching on 16 prompts: benchmarks/batch_peers.py)"
    runtime = "OpenVINO GenAI"
    engine = "openvino"

    def __init__(self, folder: Path, weight_format: str, precision: Precision, compute: str, properties: dict):
        import openvino as ov
        import openvino_genai as ov_genai

        self.ov, self.ov_genai = ov, ov_genai
        self.name, self.precision = f"{self.runtime} {weight_format} ({compute})", precision
        scheduler = latency_scheduler()
        self.pipe = ov_genai.LLMPipeline(str(folder), "CPU", scheduler_config=scheduler, **properties)
        self.details = {"ov_weight_format": weight_format, "ov_compute_precision": compute, "ov_properties": properties,
                        "scheduler_config": scheduler.to_string()}

    def _generate(self, prompt: np.ndarray, n: int, stamps: list[float]) -> np.ndarray:
        assert prompt.shape[0] == 1, "batch 1 only"
        tokens: list[int] = []
        running = self.ov_genai.StreamingStatus.RUNNING

        class Stamper(self.ov_genai.StreamerBase):
            def write(self, token):
                for t in token if isinstance(token, list) else [token]:
                    tokens.append(int(t))
                    stamps.append(time.perf_counter())
                return running

            def end(self):
                pass

        self.pipe.generate(self.ov.Tensor(np.ascontiguousarray(prompt, dtype=np.int64)), greedy_config(n), Stamper())
        assert len(tokens) == n, (len(tokens), n)
        return np.array([tokens], dtype=np.int64)


def load(ctx: Context) -> list:
    import openvino_genai as ov_genai

    cli = optimum_cli()
    record: dict = {"openvino_genai": ov_genai.__version__, "converter": str(cli), "converter_versions": converter_versions(cli),
                    "command": "optimum-cli export openvino --model HF_FOLDER --task text-generation-with-past "
                               "--weight-format W OUT; ov_genai.LLMPipeline(OUT, 'CPU', INFERENCE_NUM_THREADS=cores"
                               "[, INFERENCE_PRECISION_HINT='f32'], scheduler_config=latency_scheduler())", "seconds": {}}
    ctx.results["openvino_genai"] = record
    variants = compute_variants(ctx.threads)
    record["compute_precisions"] = list(variants)
    contenders = []
    for precision, weight_format in WEIGHT_FORMATS.items():
        if precision not in ctx.precisions:
            continue
        try:
            folder, record["seconds"][weight_format] = convert(ctx.hf_dir_with_tokenizer(), weight_format,
                                                               ctx.work / f"openvino-{weight_format}")
        except Exception as e:
            ctx.skip(f"{LABEL} {weight_format}", error_line(e))
            continue
        for compute, properties in variants.items():
            try:
                contenders.append(OvGenai(folder, weight_format, precision, compute, properties))
            except Exception as e:
                ctx.skip(f"{LABEL} {weight_format} ({compute})", error_line(e))
    return contenders
