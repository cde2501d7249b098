"""Optimum's `ORTModelForCausalLM.generate` (its own ONNX export, ONNX Runtime CPU) when importable,
and the very model.onnx Optimum exported in a minimal greedy hand loop on onnxruntime directly,
presents fed back as past (batch 1). HandLoop is also what runs ONNX Runtime's GPT-2 tool's graphs
(ort_gpt2_tool.py)."""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np

from gpt2x.choices import Precision
from gpt2x.runtime.providers import session_options

from .core import Context, StampedLoop, log
from .transformers_hf import HFGenerate

KEY = "optimum"
ORDER = 10
LABEL = "Optimum"

ORT_DTYPES = {"tensor(int64)": np.int64, "tensor(int32)": np.int32, "tensor(float)": np.float32,
              "tensor(float16)": np.float16}


class HandLoop(StampedLoop):
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


def load_optimum(folder: Path, threads: int):
    try:
        from optimum.onnxruntime import ORTModelForCausalLM
    except ImportError as e:
        return None, f"not importable here: {e}"
    return ORTModelForCausalLM.from_pretrained(folder, export=True, use_cache=True, provider="CPUExecutionProvider",
                                               session_options=session_options(threads)), None


def load(ctx: Context) -> list:
    log("exporting with Optimum")
    opt, why = load_optimum(ctx.hf_dir, ctx.threads)
    if opt is None:
        ctx.skip("Optimum", why)
        return []
    contenders: list = [HFGenerate("Optimum ORTModelForCausalLM", "ort", opt)]
    try:
        hand = HandLoop("Optimum's export, hand loop", Precision.fp32, Path(opt.path), ctx.threads)
    except ValueError as e:  # a graph whose cache names the loop cannot pair
        ctx.skip("Optimum's export, hand loop", str(e))
    else:
        ctx.results["optimum_graph_inputs"] = list(hand.inputs)
        contenders.append(hand)
    return contenders
