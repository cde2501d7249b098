"""gpt2x beside the peers a user would otherwise pick, in one process, on the same weights.

    python benchmarks/compare_peers.py --batch 1,4 --out benchmarks/results/cpu-2core
        [--precisions fp32,int8,int4] [--gpt2x-backends torch,ort,openvino,genai]

Runs GPT-2 124M (architecture of `gpt2`, seeded random weights saved in Hugging Face layout so that
every library loads the very same tensors), a prompt of --prompt-len random tokens, --new-tokens
greedy tokens that EOS does not cut short, and times for each batch size:

- transformers' `GPT2LMHeadModel.generate` (PyTorch eager): the reference the ratios divide by;
- Optimum's `ORTModelForCausalLM.generate` (its own ONNX export, ONNX Runtime CPU) when importable;
- Optimum's export in a hand loop: the very model.onnx Optimum exported, run by a minimal greedy
  loop on onnxruntime directly, presents fed back as past (batch 1);
- ONNX Runtime's own GPT-2 tool (`onnxruntime.transformers.models.gpt2.convert_to_onnx`, fused
  `Attention` with a combined past_i cache), fp32 and int8, in the same hand loop (batch 1), when it
  runs with the installed transformers and torch; otherwise its error and the reason are recorded;
- onnxruntime-genai running gpt2x's exports, one per --precisions (same graphs, genai's own C++ loop
  choosing the tokens; batch 1) when importable;
- gpt2x, every contender opened through gpt2x.workflows as a user's would be (ensure_export into
  --exports, parity-gated when made, then export_backend; torch_backend for PyTorch), through the
  shared decode loop and sampler: PyTorch fp32, and ONNX Runtime, OpenVINO and onnxruntime-genai
  (gpt2x's step-by-step backend) at each of --precisions (fp32, int8, int4 by default). --gpt2x-backends
  and --precisions narrow the run.

A contender that cannot run here (a runtime not installed, an export that fails, a backend that does
not open or fails its warm-up) is recorded in OUT.json's "skipped" with the reason, and listed under
the table; the run goes on without it.

Every ONNX Runtime session has gpt2x's thread settings (gpt2x.runtime.providers.session_options: intra-op
threads = cores, sequential). Timing is interleaved, because this VM's memory bandwidth drifts by
tens of percent over minutes: per batch size, each contender warms up (its first tokens are also
checked against transformers'), then --repeat rounds run every contender once each, in an order
rotated every round. Each figure is the contender's median run; the spread (min-max of end-to-end
tokens/s over the rounds) and every run are kept.

End-to-end tokens/s = batch x new tokens / wall time of the whole generation (prefill included);
decode tokens/s = batch x (new tokens - 1) / (wall time - time to first token). The machine's
memory bandwidth is measured in the same run and each decode figure is given as a share of its
roofline (at the precision's bytes per weight, gpt2x.bench.roofline). Under the table: each precision's
gpt2x ort against the fastest peer of that precision, and int4 decode against int8 decode per runtime.
Writes OUT.json (every figure, every run, the environment), OUT.md (the table) and
OUT.png (the plot).
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from gpt2x import workflows
from gpt2x.bench.report import require_matplotlib
from gpt2x.bench.roofline import cpu_read_bandwidth, roofline_tokens_per_s
from gpt2x.bench.run import median_run, timed_generation
from gpt2x.bench.system import installed_versions, system_info
from gpt2x.choices import BackendKind, Precision, ProviderKind
from gpt2x.errors import MissingDependencyError
from gpt2x.evaluate.metrics import summarize_latencies
from gpt2x.model.weights import save_hf
from gpt2x.onnx.artifact import ExportInfo, default_export_dir
from gpt2x.onnx.interop import GENAI_CONFIG_FILE, genai_config
from gpt2x.runtime.providers import physical_cores, session_options

# x transformers' generate (end-to-end tok/s, same batch), from the issue
TARGETS = {"gpt2x ort fp32": 3.2, "gpt2x ort int8": 8.0, "gpt2x ort int4": 10.0}
INT4_VS_INT8_TARGET = 1.3  # int4 decode tok/s over int8's on the same runtime, from the issue
PRECISIONS = (Precision.fp32, Precision.int8, Precision.int4)  # what a CPU run can ask for (fp16: CUDA only)
# What the issue measured on this 2-core VM (batch 1, 32-token prompt, 128 new tokens), for reference.
ISSUE_FIGURES = {"transformers generate": 24.7, "Optimum's export in a hand loop": 57.8,
                 "ORT GPT-2 tool, fused Attention, fp32": 72.8, "ORT GPT-2 tool int8": 175.7}
CHECK_TOKENS = 16  # leading tokens of the warm-up run compared with transformers' (same work for all)
GAP_S = 0.05  # idle time between two contenders' runs (see THREADS below)
ORT_TOOL = "onnxruntime.transformers.models.gpt2.convert_to_onnx"

# THREADS. Each ONNX Runtime session keeps its own intra-op pool, whose threads spin-wait for work
# by default. Turning that off (session.intra_op.allow_spinning = "0") was measured with gpt2x
# running alone (random:gpt2, batch 1, 32 + 32 tokens, 4 interleaved runs each, this 2-core VM):
# fp32 70.7 -> 65.1 tok/s (-8%), int8 226.6 -> 172.0 tok/s (-24%). Spinning is part of how ORT
# reaches its speed at batch 1, so every session keeps the default; contenders never run at the
# same time (one after another, GAP_S apart, long enough for a finished pool to stop spinning).


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


# ---------------------------------------------------------------- contenders
#
# Each has name, engine, runtime (the name without the precision: what "int4 vs int8" compares),
# precision, batches (None: every batch size), check(prompt, k) -> the first k greedy tokens (B, k)
# (the warm-up), and run(prompt, n) -> {"total_s", "ttft_s"[, "steps_s"]}.


class HFGenerate:
    """`generate` of transformers' GPT2LMHeadModel or Optimum's ORTModelForCausalLM. A logits
    processor stamps the clock each time logits arrive, which splits the first token from decoding."""

    batches = None

    def __init__(self, name: str, engine: str, model):
        self.name, self.engine, self.precision, self.model = name, engine, Precision.fp32, model
        self.runtime = name

    def _generate(self, prompt: np.ndarray, n: int, processors=()):
        from transformers import LogitsProcessorList

        ids = torch.from_numpy(prompt)
        with torch.inference_mode():
            out = self.model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n,
                                      do_sample=False, num_beams=1, pad_token_id=50256,
                                      logits_processor=LogitsProcessorList(processors))
        assert out.shape[1] == prompt.shape[1] + n
        return out[:, prompt.shape[1]:].numpy()

    def check(self, prompt: np.ndarray, k: int) -> np.ndarray:
        return self._generate(prompt, k)

    def run(self, prompt: np.ndarray, n: int) -> dict:
        from transformers import LogitsProcessor

        stamps: list[float] = []

        class Clock(LogitsProcessor):
            def __call__(self, input_ids, scores):
                stamps.append(time.perf_counter())
                return scores

        t0 = time.perf_counter()
        self._generate(prompt, n, [Clock()])
        total = time.perf_counter() - t0
        return {"total_s": total, "ttft_s": stamps[0] - t0, "steps_s": [float(x) for x in np.diff(stamps)]}


class _Recorder:
    """A gpt2x backend that notes the greedy token of every step (warm-up only)."""

    def __init__(self, backend):
        self.backend, self.tokens = backend, []

    def step(self, input_ids, attention_mask, position_ids, past):
        logits, present = self.backend.step(input_ids, attention_mask, position_ids, past)
        self.tokens.append(logits.argmax(-1))
        return logits, present


class Gpt2x:
    """gpt2x's generation loop as `gpt2x bench` times it (gpt2x.bench.run.timed_generation) on a
    backend from gpt2x.workflows: named "gpt2x BACKEND PRECISION" ("gpt2x torch" for PyTorch fp32)."""

    batches = None
    ENGINES = {BackendKind.torch: "torch", BackendKind.ort: "ort", BackendKind.openvino: "openvino",
               BackendKind.genai: "ort"}  # the library that runs the kernels (genai runs ONNX Runtime)

    def __init__(self, kind: BackendKind, precision: Precision, backend):
        self.runtime = f"gpt2x {kind.value}"
        self.name = self.runtime if kind is BackendKind.torch else f"{self.runtime} {precision.value}"
        self.engine, self.precision, self.backend = self.ENGINES[kind], precision, backend

    def check(self, prompt: np.ndarray, k: int) -> np.ndarray:
        rec = _Recorder(self.backend)
        timed_generation(rec, prompt, k)
        return np.stack(rec.tokens, axis=1)

    def run(self, prompt: np.ndarray, n: int) -> dict:
        return timed_generation(self.backend, prompt, n)


ORT_DTYPES = {"tensor(int64)": np.int64, "tensor(int32)": np.int32, "tensor(float)": np.float32,
              "tensor(float16)": np.float16}


class _StampedLoop:
    """A contender whose _generate(prompt, n, stamps) appends a clock stamp as each token is chosen."""

    def _generate(self, prompt: np.ndarray, n: int, stamps: list[float]) -> np.ndarray:
        raise NotImplementedError

    def check(self, prompt: np.ndarray, k: int) -> np.ndarray:
        return self._generate(prompt, k, [])

    def run(self, prompt: np.ndarray, n: int) -> dict:
        stamps: list[float] = []
        t0 = time.perf_counter()
        self._generate(prompt, n, stamps)
        return {"total_s": time.perf_counter() - t0, "ttft_s": stamps[0] - t0, "steps_s": [float(x) for x in np.diff(stamps)]}


class HandLoop(_StampedLoop):
    """A minimal greedy loop on an InferenceSession: input_ids (+ attention_mask, + position_ids
    where the graph takes them, with the graph's integer type), each present output fed back as the
    past input of the same layer. The cache stays in the OrtValues ONNX Runtime allocated
    (run_with_ort_values), as in gpt2x; only logits are copied out. Works for Optimum's names
    (past_key_values.i.key/value -> present.i.key/value) and the ORT GPT-2 tool's (past_i -> present_i)."""

    batches = {1}

    def __init__(self, name: str, precision: Precision, model_path: Path, threads: int):
        import onnxruntime as ort

        self.name, self.engine, self.precision, self.ort = name, "ort", precision, ort
        self.runtime = name.replace(f" {precision.value}", "")
        self.model_path = str(model_path)
        self.session = ort.InferenceSession(self.model_path, sess_options=session_options(threads),
                                            providers=["CPUExecutionProvider"])
        inputs = {i.name: i for i in self.session.get_inputs()}
        self.inputs = inputs
        self.past = [n for n in inputs if n.startswith("past")]
        self.outputs = [o.name for o in self.session.get_outputs()]
        self.present = self.outputs[1:]
        expected = [n.replace("past_key_values", "present").replace("past_", "present_") for n in self.past]
        if self.outputs[0] != "logits" or self.present != expected:
            raise ValueError(f"{model_path}: cannot pair past inputs {self.past[:2]}... with outputs {self.outputs[:3]}...")
        self.input_names = [n for n in inputs if not n.startswith("past")]

    def _value(self, name: str, array: np.ndarray):
        return self.ort.OrtValue.ortvalue_from_numpy(np.ascontiguousarray(array, dtype=ORT_DTYPES[self.inputs[name].type]))

    def _empty_past(self, batch: int) -> list:
        values = []
        for name in self.past:
            shape = [d if isinstance(d, int) else (batch if "batch" in str(d) else 0) for d in self.inputs[name].shape]
            values.append(self._value(name, np.zeros(shape)))
        return values

    def _step(self, ids: np.ndarray, mask: np.ndarray, past: list):
        B, T = ids.shape
        past_len = mask.shape[1] - T
        position = np.broadcast_to(np.arange(past_len, past_len + T), (B, T))
        arrays = {"input_ids": ids, "attention_mask": mask, "position_ids": position}
        feeds = {name: self._value(name, arrays[name]) for name in self.input_names}
        feeds.update(zip(self.past, past))
        out = self.session.run_with_ort_values(self.outputs, feeds)
        return out[0].numpy()[:, -1].argmax(-1), out[1:]

    def _generate(self, prompt: np.ndarray, n: int, stamps: list[float]) -> np.ndarray:
        mask = np.ones_like(prompt)
        nxt, past = self._step(prompt, mask, self._empty_past(prompt.shape[0]))
        tokens = [nxt]
        stamps.append(time.perf_counter())
        for _ in range(n - 1):
            mask = np.concatenate([mask, np.ones((prompt.shape[0], 1), dtype=mask.dtype)], axis=1)
            nxt, past = self._step(nxt[:, None], mask, past)
            tokens.append(nxt)
            stamps.append(time.perf_counter())
        return np.stack(tokens, axis=1)


class Genai(_StampedLoop):
    """onnxruntime-genai on a gpt2x export: og.Model on a folder holding the export's model.onnx
    (a link) and the genai_config.json gpt2x writes for it, with intra_op_num_threads set like every
    other session; greedy, min_length = max_length = prompt + new tokens so that EOS cannot stop it.
    append_tokens runs the prefill; each generate_next_token picks a token (and from the second
    on, first runs the decode step that produces its logits)."""

    batches = {1}
    runtime = "onnxruntime-genai on gpt2x"

    def __init__(self, info: ExportInfo, work: Path, threads: int):
        import onnxruntime_genai as og

        self.precision, self.og = info.precision, og
        self.name, self.engine = f"{self.runtime} {info.precision.value}", "ort"
        export_folder = info.folder
        work.mkdir(parents=True)
        if (export_folder / GENAI_CONFIG_FILE).is_file():
            cfg = json.loads((export_folder / GENAI_CONFIG_FILE).read_text())
        else:  # an export made before gpt2x wrote interop files: the same file gpt2x writes now
            cfg = genai_config(info.config, share_buffer=info.attention["shared_kv_buffer"])
        cfg["model"]["decoder"]["session_options"]["intra_op_num_threads"] = threads
        (work / GENAI_CONFIG_FILE).write_text(json.dumps(cfg, indent=1))
        for p in export_folder.iterdir():
            if p.name.startswith(info.model_path.name):  # model.onnx (and model.onnx.data)
                (work / p.name).symlink_to(p.resolve())
        self.genai_search = cfg["search"]
        self.model = og.Model(str(work))

    def _generate(self, prompt: np.ndarray, n: int, stamps: list[float]) -> np.ndarray:
        og = self.og
        params = og.GeneratorParams(self.model)
        length = prompt.shape[1] + n
        params.set_search_options(max_length=length, min_length=length, do_sample=False, batch_size=prompt.shape[0])
        gen = og.Generator(self.model, params)
        gen.append_tokens(prompt.astype(np.int32))
        tokens = []
        while not gen.is_done():
            gen.generate_next_token()
            tokens.append(np.array(gen.get_next_tokens()))
            stamps.append(time.perf_counter())
        assert len(tokens) == n, (len(tokens), n)
        return np.stack(tokens, axis=1)


# ---------------------------------------------------------------- loading the peers


def load_optimum(folder: Path, threads: int):
    try:
        from optimum.onnxruntime import ORTModelForCausalLM
    except ImportError as e:
        return None, f"not importable here: {e}"
    return ORTModelForCausalLM.from_pretrained(folder, export=True, use_cache=True, provider="CPUExecutionProvider",
                                               session_options=session_options(threads)), None


def tool_failure(stderr: str) -> dict:
    """The exception line of a failed run of the tool, where it failed, and why (when known)."""
    lines = [ln for ln in stderr.strip().splitlines() if ln.strip()]
    errors = [ln for ln in lines if re.match(r"^[\w.]+(Error|Exception)\b", ln)]
    frames = re.findall(r'File "[^"]*/site-packages/((?:onnxruntime|transformers)/[^"]+)", line (\d+), in (\w+)', stderr)
    ort_frames = [f for f in frames if f[0].startswith("onnxruntime/")][-1:]
    hf_frames = [f for f in frames if f[0].startswith("transformers/")][-3:]
    failure = {"error": errors[-1] if errors else (lines[-1] if lines else "no output"),
               "frames": [f"{path}:{line} {fn}" for path, line, fn in ort_frames + hf_frames]}
    if "masking_utils" in stderr and "vmap" in stderr:
        failure["reason"] = (
            "the tool exports with the TorchScript tracer (torch.onnx.export(..., dynamo=False), "
            "onnxruntime/transformers/torch_onnx_export_helper.py), which cannot trace the causal mask that "
            "transformers >= 4.53 builds with torch.vmap (transformers/masking_utils.py, sdpa_mask_recent_torch)")
    return failure


def ort_gpt2_tool(hf_dir: Path, work: Path, threads: int) -> tuple[list, dict]:
    """Convert with ONNX Runtime's GPT-2 tool exactly as a user would (fp32 and int8), and a hand
    loop on each graph it writes; or, where it fails, the failure, and what the tool's own steps
    give with Optimum's tracing patches (benchmarks/ort_gpt2_tool_probe.py, in its own process)."""
    import onnx

    contenders, record = [], {"command": f"python -m {ORT_TOOL} -m HF_FOLDER --output OUT.onnx -o -p PRECISION"}
    work.mkdir(parents=True, exist_ok=True)
    for precision in (Precision.fp32, Precision.int8):
        out = work / f"gpt2_{precision.value}.onnx"
        cmd = [sys.executable, "-m", ORT_TOOL, "-m", str(hf_dir), "--output", str(out), "-o", "-p", precision.value,
               "--cache_dir", str(work / "cache"), "-t", "1", "-r", "1"]  # the smallest parity test it allows
        log(f"ONNX Runtime's GPT-2 tool, {precision.value}")
        t0 = time.perf_counter()
        proc = subprocess.run(cmd, capture_output=True, text=True, cwd=work)  # its csv goes to cwd
        entry: dict = {"returncode": proc.returncode, "seconds": time.perf_counter() - t0}
        record[precision.value] = entry
        if proc.returncode != 0 or not out.is_file():
            entry |= tool_failure(proc.stderr)
            log(f"  failed: {entry['error']}")
            break
        ops: dict[str, int] = {}
        for node in onnx.load(str(out), load_external_data=False).graph.node:
            ops[node.op_type] = ops.get(node.op_type, 0) + 1
        entry["fused_operators"] = {k: ops.get(k, 0) for k in ("Attention", "MultiHeadAttention", "SkipLayerNormalization",
                                                                  "FastGelu", "MatMulInteger", "DynamicQuantizeMatMul")}
        entry["inputs"] = [i.name for i in onnx.load(str(out), load_external_data=False).graph.input][:4]
        try:
            contenders.append(HandLoop(f"ORT GPT-2 tool {precision.value}, hand loop", precision, out, threads))
        except ValueError as e:  # a graph whose cache names the loop cannot pair
            entry["error"] = str(e)
            break
    if not contenders:
        log("  probing the tool's own steps with Optimum's tracing patches (benchmarks/ort_gpt2_tool_probe.py)")
        probe = subprocess.run([sys.executable, str(Path(__file__).with_name("ort_gpt2_tool_probe.py")), str(hf_dir),
                                str(work / "probe")], capture_output=True, text=True)
        try:
            record["probe_with_optimum_patches"] = json.loads(probe.stdout.strip().splitlines()[-1])
        except (json.JSONDecodeError, IndexError):
            record["probe_with_optimum_patches"] = {"returncode": probe.returncode, **tool_failure(probe.stderr)}
        record["skipped"] = skip_reason(record)
        log(f"  skipped: {record['skipped']}")
    return contenders, record


def skip_reason(record: dict) -> str:
    fp32 = record.get("fp32", {})
    reason = f"`{ORT_TOOL}` fails: {fp32.get('error', 'unknown error')}"
    if fp32.get("reason"):
        reason += f" ({fp32['reason']})"
    variants = record.get("probe_with_optimum_patches", {}).get("variants", [])
    if variants:
        found = "; ".join(
            f"{v['attn_implementation']} attention, opset {v['opset']}: "
            + (f"Attention fused {v.get('fused_operators', {}).get('Attention', 0)}x" if "fused_operators" in v
               else v.get("error", "not exported"))
            for v in variants)
        reason += (f". With Optimum's tracing patches the tool's own export and optimizer run, but fuse no "
                   f"Attention from this transformers' GPT-2 graph ({found}), so its fused graph cannot be made here"
                   if all(v.get("fused_operators", {}).get("Attention", 0) == 0 for v in variants)
                   else f". With Optimum's tracing patches: {found}")
    return reason


# ---------------------------------------------------------------- loading gpt2x


def error_line(e: BaseException, limit: int = 600) -> str:
    """An exception as one line (for the skipped list and the .md): its type and message."""
    text = " / ".join(ln.strip() for ln in str(e).splitlines() if ln.strip())
    text = f"{type(e).__name__}: {text}" if text else type(e).__name__
    return text if len(text) <= limit else text[: limit - 3] + "..."


def gpt2x_exports(args: argparse.Namespace, loaded: tuple, precisions: list[Precision], results: dict) -> dict:
    """{precision: ExportInfo} of the model at each precision in EXPORTS/<model>-<precision>, exported
    (parity-gated) first where missing, all through workflows.ensure_export; one that fails is skipped."""
    exports = {}
    for precision in precisions:
        try:
            info = workflows.ensure_export(args.model, precision,
                                           folder=default_export_dir(args.model, precision, args.exports),
                                           loaded=loaded, progress=log, notice=log)
        except Exception as e:  # not available yet, failed its parity gate, ...: this precision only
            results["skipped"][f"gpt2x {precision.value} export"] = error_line(e)
            log(f"gpt2x {precision.value} export: skipped ({error_line(e)})")
            continue
        exports[precision] = info
        results[f"gpt2x_{precision.value}_parity"] = info.meta["parity"]
    return exports


def gpt2x_contenders(args: argparse.Namespace, model, kinds: list[BackendKind], precisions: list[Precision],
                     exports: dict, threads: int, results: dict) -> list:
    """gpt2x's backends, each opened through gpt2x.workflows: the PyTorch model (fp32), then every
    export runtime at every precision exported. A runtime that does not import, or a backend that
    does not open, is recorded in results["skipped"]."""
    contenders = []
    for kind in kinds:
        if kind is BackendKind.torch:
            if Precision.fp32 in precisions:  # PyTorch runs fp32 here; int8 and int4 are ONNX exports
                contenders.append(Gpt2x(kind, Precision.fp32,
                                        workflows.torch_backend(model, ProviderKind.cpu, args.model, threads=threads)))
            continue
        try:
            workflows.require_runtime(kind)
        except MissingDependencyError as e:
            results["skipped"][f"gpt2x {kind.value}"] = str(e)
            log(f"gpt2x {kind.value}: skipped ({e})")
            continue
        for precision, info in exports.items():
            name = f"gpt2x {kind.value} {precision.value}"
            log(f"{name}: opening {info.folder}")
            try:
                backend = workflows.export_backend(kind, info, ProviderKind.cpu, threads)
            except Exception as e:  # e.g. an operator this runtime cannot run
                results["skipped"][name] = error_line(e)
                log(f"{name}: skipped ({error_line(e)})")
                continue
            contenders.append(Gpt2x(kind, precision, backend))
    return contenders


# ---------------------------------------------------------------- timing


def first_difference(a: np.ndarray, b: np.ndarray) -> int | None:
    diff = np.nonzero((a != b).any(axis=0))[0]
    return int(diff[0]) if len(diff) else None


def time_batch(contenders: list, prompt: np.ndarray, new_tokens: int, repeat: int) -> tuple[list[dict], list, dict]:
    """Warm-up (and token check) for each, then `repeat` rounds of one run each, order rotated.
    A contender whose warm-up fails (transformers' excepted) is left out of this batch size and
    returned in the third value, {name: reason}."""
    b = prompt.shape[0]
    active = [c for c in contenders if c.batches is None or b in c.batches]
    k = min(CHECK_TOKENS, new_tokens)
    checks, failed = {}, {}
    for c in list(active):
        log(f"batch {b}: {c.name}: warm-up")
        try:
            checks[c.name] = c.check(prompt, k)
        except Exception as e:
            if c.name.startswith("transformers"):
                raise  # the reference every ratio divides by
            failed[f"{c.name}, batch {b}"] = f"warm-up failed: {error_line(e)}"
            log(f"batch {b}: {c.name}: warm-up failed ({error_line(e)}); left out")
            active.remove(c)
    reference = next(checks[c.name] for c in active if c.name.startswith("transformers"))
    runs: dict[str, list[dict]] = {c.name: [] for c in active}
    for r in range(repeat):
        order = active[r % len(active):] + active[: r % len(active)]
        log(f"batch {b}: round {r + 1}/{repeat}")
        for c in order:
            runs[c.name].append(c.run(prompt, new_tokens))
            time.sleep(GAP_S)
    results = []
    for c in active:
        rs = runs[c.name]
        e2e = [b * new_tokens / x["total_s"] for x in rs]
        decode = [b * (new_tokens - 1) / max(x["total_s"] - x["ttft_s"], 1e-9) for x in rs]
        med = median_run(rs)
        i = rs.index(med)
        entry = {"name": c.name, "engine": c.engine, "runtime": c.runtime, "precision": c.precision.value, "batch": b,
                 "e2e_tokens_per_s": e2e[i], "decode_tokens_per_s": decode[i], "total_s": med["total_s"],
                 "prefill_s": med["ttft_s"], "e2e_min": min(e2e), "e2e_max": max(e2e),
                 "e2e_tokens_per_s_runs": e2e, "decode_tokens_per_s_runs": decode,
                 "total_s_runs": [x["total_s"] for x in rs], "ttft_s_runs": [x["ttft_s"] for x in rs],
                 "check_tokens": k, "first_difference_vs_transformers": first_difference(checks[c.name], reference)}
        if med.get("steps_s"):
            entry["decode_latency"] = summarize_latencies(med["steps_s"])
        results.append(entry)
    not_run = [{"name": c.name, "batch": b, "reason": "batch 1 only (hand loops and onnxruntime-genai's own loop)"}
               for c in contenders if not (c.batches is None or b in c.batches)]
    return results, not_run, failed


def parse_list(text: str, enum, allowed, option: str, ap: argparse.ArgumentParser) -> list:
    values = []
    for item in (t.strip() for t in text.split(",") if t.strip()):
        try:
            value = enum(item)
        except ValueError:
            value = None
        if value not in allowed:
            ap.error(f"{option}: {item!r} is not one of {', '.join(a.value for a in allowed)}")
        if value not in values:
            values.append(value)
    if not values:
        ap.error(f"{option}: give at least one of {', '.join(a.value for a in allowed)}")
    return values


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="random:gpt2", help="gpt2x model name (default: GPT-2 124M, random weights)")
    ap.add_argument("--batch", default="1,4")
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--repeat", type=int, default=3, help="interleaved rounds (each contender runs once per round)")
    ap.add_argument("--out", type=Path, required=True, help="output path without extension")
    ap.add_argument("--exports", type=Path, default=Path("exported"), help="where gpt2x's exports go")
    ap.add_argument("--precisions", default="fp32,int8,int4",
                    help="gpt2x export precisions to compare (fp32, int8, int4; gpt2x torch runs only with fp32), "
                         "also those onnxruntime-genai's own loop runs (default: %(default)s)")
    ap.add_argument("--gpt2x-backends", default="torch,ort,openvino,genai",
                    help="gpt2x backends to compare (torch, ort, openvino, genai; default: %(default)s)")
    args = ap.parse_args()
    batches = [int(b) for b in args.batch.split(",")]
    precisions = parse_list(args.precisions, Precision, PRECISIONS, "--precisions", ap)
    kinds = parse_list(args.gpt2x_backends, BackendKind, list(BackendKind), "--gpt2x-backends", ap)
    threads = physical_cores()
    torch.set_num_threads(threads)

    env = system_info()
    env["torch_threads"] = torch.get_num_threads()
    env["ort_intra_op_threads"] = threads
    env["peer packages"] = installed_versions("optimum", "optimum-onnx", "onnxruntime-genai", "openvino", "tokenizers")
    model, source = workflows.load_model(args.model)
    cfg = model.config
    log(f"measuring memory bandwidth ({threads} threads)")
    bandwidth_samples = [cpu_read_bandwidth(threads)]
    results: dict = {"environment": env, "settings": vars(args) | {"out": str(args.out), "exports": str(args.exports),
                                                                   "interleaved": True, "gap_s": GAP_S},
                     "issue_figures_batch1_e2e": ISSUE_FIGURES, "skipped": {}, "not_run": [], "runs": []}
    rng = np.random.default_rng(0)
    prompts = {b: rng.integers(0, cfg.vocab_size, (b, args.prompt_len), dtype=np.int64) for b in batches}

    with tempfile.TemporaryDirectory(prefix="gpt2x-peers-") as tmp:
        hf_dir = Path(tmp) / "hf"
        save_hf(model, hf_dir)  # the same tensors for every library
        contenders: list = []

        from transformers import GPT2LMHeadModel

        hf = GPT2LMHeadModel.from_pretrained(hf_dir, dtype=torch.float32).eval()
        contenders.append(HFGenerate("transformers generate (PyTorch eager)", "torch", hf))
        log("exporting with Optimum")
        opt, why = load_optimum(hf_dir, threads)
        if opt is None:
            log(f"Optimum {why}; skipped")
            results["skipped"]["Optimum"] = why
        else:
            contenders.append(HFGenerate("Optimum ORTModelForCausalLM", "ort", opt))
            try:
                hand = HandLoop("Optimum's export, hand loop", Precision.fp32, Path(opt.path), threads)
            except ValueError as e:  # a graph whose cache names the loop cannot pair
                results["skipped"]["Optimum's export, hand loop"] = str(e)
                log(f"Optimum's export, hand loop: skipped ({e})")
            else:
                results["optimum_graph_inputs"] = list(hand.inputs)
                contenders.append(hand)
        tool_contenders, results["ort_gpt2_tool"] = ort_gpt2_tool(hf_dir, Path(tmp) / "ort-gpt2", threads)
        contenders += tool_contenders
        if not tool_contenders:
            results["skipped"]["ORT GPT-2 tool (fp32, int8)"] = results["ort_gpt2_tool"]["skipped"]
        for precision in ("fp32", "int8"):
            failed = results["ort_gpt2_tool"].get(precision, {})
            if tool_contenders and "error" in failed:
                results["skipped"][f"ORT GPT-2 tool {precision}"] = f"{failed['error']} {failed.get('reason', '')}".strip()
        exports = gpt2x_exports(args, (model, source), precisions, results)
        contenders += gpt2x_contenders(args, model, kinds, precisions, exports, threads, results)
        for info in exports.values():  # onnxruntime-genai's own loop on the same exports
            name = f"{Genai.runtime} {info.precision.value}"
            try:
                contenders.append(Genai(info, Path(tmp) / f"genai-{info.precision.value}", threads))
            except ImportError as e:
                results["skipped"]["onnxruntime-genai"] = f"not importable here: {e}"
                log(f"onnxruntime-genai not importable here ({e}); skipped")
                break
            except Exception as e:  # a graph genai cannot load
                results["skipped"][name] = error_line(e)
                log(f"{name}: skipped ({error_line(e)})")

        for batch in batches:
            runs, not_run, failed = time_batch(contenders, prompts[batch], args.new_tokens, args.repeat)
            results["runs"] += runs
            results["not_run"] += not_run
            results["skipped"] |= failed

    # Bandwidth again at the end; the higher sample sets the roofline (see gpt2x/bench/run.py).
    bandwidth_samples.append(cpu_read_bandwidth(threads))
    bandwidth = max(bandwidth_samples)
    results["bandwidth_samples_bytes_per_s"] = bandwidth_samples
    results["bandwidth_bytes_per_s"] = bandwidth
    for r in results["runs"]:
        roof = roofline_tokens_per_s(bandwidth, cfg, Precision(r["precision"]), r["batch"],
                                     args.prompt_len + args.new_tokens // 2)
        r["roofline_tokens_per_s"] = roof
        r["roofline_share"] = r["decode_tokens_per_s"] / roof

    for batch in batches:
        base = next(r for r in results["runs"] if r["batch"] == batch and r["name"].startswith("transformers"))
        for r in results["runs"]:
            if r["batch"] == batch:
                r["e2e_vs_transformers"] = r["e2e_tokens_per_s"] / base["e2e_tokens_per_s"]
                r["decode_vs_transformers"] = r["decode_tokens_per_s"] / base["decode_tokens_per_s"]
                r["target"] = TARGETS.get(r["name"])
    results["int4_vs_int8_decode"] = int4_vs_int8(results["runs"])
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".json").write_text(json.dumps(results, indent=1) + "\n")
    args.out.with_suffix(".md").write_text(markdown(results))
    plot(results, args.out.with_suffix(".png"))
    print(markdown(results))
    return 0


def markdown(results: dict) -> str:
    env = results["environment"]
    s = results["settings"]
    k = next((r["check_tokens"] for r in results["runs"]), 0)
    lines = [
        f"GPT-2 124M architecture ({s['model']}, random weights), prompt {s['prompt_len']} tokens, "
        f"{s['new_tokens']} greedy tokens; {s['repeat']} interleaved rounds (every contender once per round, "
        "order rotated), median run shown, spread = min-max of end-to-end tok/s over the rounds.",
        f"Machine: {env['cpu']}, {env['cores']} cores, {env['platform']}; measured read bandwidth "
        f"{results['bandwidth_bytes_per_s'] / 1e9:.1f} GB/s; {env['date']}, gpt2x git {env['git']}; "
        + ", ".join(f"{k} {v}" for k, v in (env["packages"] | env.get("peer packages", {})).items()) + ".",
        f"ONNX Runtime sessions: {env.get('ort_intra_op_threads')} intra-op threads, sequential, spinning on "
        "(ORT's default) in every session.",
        "",
        "| engine | batch | end-to-end tok/s | spread (e2e) | decode tok/s | x transformers (e2e) | x transformers (decode) "
        f"| % of roofline (decode) | first {k} tokens = transformers' | target |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- | --- |",
    ]
    batches = sorted({r["batch"] for r in results["runs"]})
    for b in batches:
        for r in (r for r in results["runs"] if r["batch"] == b):
            target = f"≥ {r['target']}x: {'met' if r['e2e_vs_transformers'] >= r['target'] else 'not met'}" if r.get("target") else ""
            d = r["first_difference_vs_transformers"]
            same = "yes" if d is None else f"no (from token {d})"
            lines.append(f"| {r['name']} | {b} | {r['e2e_tokens_per_s']:.1f} | {r['e2e_min']:.1f}-{r['e2e_max']:.1f} | "
                         f"{r['decode_tokens_per_s']:.1f} | {r['e2e_vs_transformers']:.2f} | {r['decode_vs_transformers']:.2f} | "
                         f"{r['roofline_share'] * 100:.0f}% | {same} | {target} |")
        for n in (n for n in results["not_run"] if n["batch"] == b):
            lines.append(f"| {n['name']} | {b} | not run | | | | | | | {n['reason']} |")
    lines.append("")
    for b in batches:
        rows = [r for r in results["runs"] if r["batch"] == b]
        for precision in (p.value for p in PRECISIONS):
            ours = next((r for r in rows if r["name"] == f"gpt2x ort {precision}"), None)
            peers = [r for r in rows if r["precision"] == precision and not r["name"].startswith("gpt2x")]
            if ours and peers:
                best = max(peers, key=lambda r: r["e2e_tokens_per_s"])
                lines.append(f"- batch {b}, {precision}: gpt2x ort {ours['e2e_tokens_per_s']:.1f} tok/s vs the fastest "
                             f"{precision} peer, {best['name']}, {best['e2e_tokens_per_s']:.1f}: "
                             f"{ours['e2e_tokens_per_s'] / best['e2e_tokens_per_s']:.2f}x")
    for c in results.get("int4_vs_int8_decode", []):
        met = "met" if c["ratio"] >= INT4_VS_INT8_TARGET else "not met"
        lines.append(f"- batch {c['batch']}, {c['runtime']}: int4 decode {c['int4_decode_tokens_per_s']:.1f} tok/s vs int8 "
                     f"decode {c['int8_decode_tokens_per_s']:.1f}: {c['ratio']:.2f}x (target ≥ {INT4_VS_INT8_TARGET}x: {met})")
    wanted = set(s.get("precisions", "").split(","))
    if {"int4", "int8"} <= wanted and not results.get("int4_vs_int8_decode"):
        lines.append("- int4 decode vs int8 decode: no runtime ran both here (see skipped below).")
    for name, reason in results["skipped"].items():
        lines.append(f"- {name}: skipped. {reason}")
    lines.append("- The issue's figures from an earlier run on this VM (batch 1, e2e tok/s): "
                 + ", ".join(f"{k} {v}" for k, v in results["issue_figures_batch1_e2e"].items()) + ".")
    return "\n".join(lines) + "\n"


def int4_vs_int8(runs: list[dict]) -> list[dict]:
    """Per batch size and runtime that ran both: int4 decode tok/s over int8's (issue target ≥ 1.3x)."""
    out = []
    for r4 in (r for r in runs if r["precision"] == "int4"):
        r8 = next((r for r in runs if r["precision"] == "int8" and r["runtime"] == r4["runtime"]
                   and r["batch"] == r4["batch"]), None)
        if r8:
            ratio = r4["decode_tokens_per_s"] / r8["decode_tokens_per_s"]
            out.append({"batch": r4["batch"], "runtime": r4["runtime"], "int4_decode_tokens_per_s": r4["decode_tokens_per_s"],
                        "int8_decode_tokens_per_s": r8["decode_tokens_per_s"], "ratio": ratio,
                        "target": INT4_VS_INT8_TARGET, "met": ratio >= INT4_VS_INT8_TARGET})
    return sorted(out, key=lambda c: c["batch"])


def plot(results: dict, path: Path) -> None:
    plt = require_matplotlib()
    batches = sorted({r["batch"] for r in results["runs"]})
    names = list(dict.fromkeys(r["name"] for r in results["runs"]))
    fig, ax = plt.subplots(figsize=(max(12, 0.65 * len(names)), 5))
    width = 0.8 / len(batches)
    for i, b in enumerate(batches):
        rows = [next((r for r in results["runs"] if r["name"] == n and r["batch"] == b), None) for n in names]
        vals = [r["e2e_tokens_per_s"] if r else 0 for r in rows]
        err = [[r["e2e_tokens_per_s"] - r["e2e_min"] if r else 0 for r in rows],
               [r["e2e_max"] - r["e2e_tokens_per_s"] if r else 0 for r in rows]]
        ax.bar(np.arange(len(names)) + i * width, vals, width, yerr=err, capsize=2, label=f"batch {b}")
    ax.set_xticks(np.arange(len(names)) + width * (len(batches) - 1) / 2, names, rotation=20, ha="right", fontsize=7)
    ax.set_ylabel("end-to-end tokens/s (bars: min-max over rounds)")
    env = results["environment"]
    ax.set_title(f"GPT-2 124M on {env['cpu']} ({env['cores']} cores): gpt2x vs peers", fontsize=10)
    ax.legend()
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    sys.exit(main())
