"""The OpenVINO prefill graph of an fp32, int8 or bf16 export (docs/export.md): gpt2x's PyTorch model converted by
OpenVINO's own converter (its attention becomes ScaledDotProductAttention, run by oneDNN's kernels) for a prompt's
tokens on a past of any length, none included (a fresh prompt, or the next chunk of one), its weights kept at f32 (fp32; bf16,
whose runtime computes it in bf16) or compressed to int8 by nncf (int8). Inputs input_ids, attention_mask (B, P + T), position_ids, and every layer's
past key and value (B, H, P, D), with batch, sequence and past dynamic; outputs the last position's logits and every
layer's key and value of the T new positions only (B, H, T, D), which the runtime writes after the past in place."""

from __future__ import annotations

import contextlib
import io as _io
import logging
import os
import sys
import warnings
from pathlib import Path

import torch
from torch import nn

from ..choices import Precision
from ..model.gpt2 import GPT2
from . import names as io
from .artifact import PREFILL_BIN, PREFILL_XML

# The precisions that get a prefill graph, and what it needs beyond the export extra (the openvino extra's). int4
# gets none: nncf's int4 (its own groups, some layers left at int8) is not the main graph's and has no gate of its own.
MODULES = {Precision.fp32: ("openvino",), Precision.int8: ("openvino", "nncf"), Precision.bf16: ("openvino",)}
# OpenVINO's CPU plugin multiplies int8 weights by activations it quantizes to int8 itself, one scale per group of
# this many (its default 32): 128 is faster at 32 and 512 tokens with its error well inside int8's gate, outlier
# channels included (docs/export.md). The graph carries it (rt_info), so the gate runs what the runtime will.
ACTIVATION_GROUP = 128
# The record's `weights`, by precision.
WEIGHTS = {Precision.fp32: "f32, as the model's",
           Precision.bf16: "f32, as the model's (computed in bf16: INFERENCE_PRECISION_HINT bf16)",
           Precision.int8: "int8 asymmetric, one scale per output channel (nncf INT8_ASYM); activations quantized "
                           f"at run time in groups of {ACTIVATION_GROUP} (DYNAMIC_QUANTIZATION_GROUP_SIZE, in the graph)"}


class _Prefill(nn.Module):
    """The model on a past: the last position's logits, then key and value of every layer at the new positions."""

    def __init__(self, model: GPT2):
        super().__init__()
        self.model = model

    def forward(self, input_ids, attention_mask, position_ids, *past):
        P = past[0].shape[2]
        layers = [(past[2 * i], past[2 * i + 1]) for i in range(len(past) // 2)]
        logits, presents = self.model(input_ids, attention_mask, position_ids, layers, logits_to_keep=1)
        return (logits, *[t[:, :, P:] for kv in presents for t in kv])  # (B, H, T, D) each


@contextlib.contextmanager
def _quiet():
    """nncf and the converter report on stdout and through warnings; stdout belongs to results."""
    if os.environ.get("GPT2X_DEBUG") == "1":
        yield
        return
    nncf_log = logging.getLogger("nncf")
    level = nncf_log.level
    nncf_log.setLevel(logging.ERROR)
    try:
        with contextlib.redirect_stdout(_io.StringIO()), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield
    finally:
        nncf_log.setLevel(level)


def convert_prefill(model: GPT2, folder: Path, precision: Precision = Precision.int8) -> list[str]:
    """Write the prefill graph of a `precision` export into `folder` (PREFILL_XML and PREFILL_BIN); returns their
    names."""
    import openvino as ov

    cfg = model.config
    P, T = 4, 8
    example = (torch.zeros(1, T, dtype=torch.long), torch.ones(1, P + T, dtype=torch.long), torch.arange(P, P + T)[None],
               *[torch.zeros(1, cfg.n_head, P, cfg.head_dim) for _ in range(2 * cfg.n_layer)])
    # Shapes by position: the converter names a traced module's inputs after forward's arguments (*past has none).
    shapes = [(ov.PartialShape([-1, -1]), ov.Type.i64)] * 3 + \
        [(ov.PartialShape([-1, cfg.n_head, -1, cfg.head_dim]), ov.Type.f32)] * (2 * cfg.n_layer)
    limit = sys.getrecursionlimit()
    sys.setrecursionlimit(max(limit, 10000))  # the TorchScript trace of a deep model recurses
    try:
        with torch.no_grad(), _quiet():
            converted = ov.convert_model(_Prefill(model.float().eval()), example_input=example, input=shapes)
            for port, name in zip(converted.inputs, io.input_names(cfg.n_layer)):
                port.get_tensor().set_names({name})
            for port, name in zip(converted.outputs, io.output_names(cfg.n_layer)):
                port.get_tensor().set_names({name})
            if precision is Precision.int8:
                import nncf

                # Per-channel asymmetric int8 on every weight, the tied embedding and unembedding included.
                converted = nncf.compress_weights(converted, mode=nncf.CompressWeightsMode.INT8_ASYM)
                converted.set_rt_info(str(ACTIVATION_GROUP), ["runtime_options", "DYNAMIC_QUANTIZATION_GROUP_SIZE"])
    finally:
        sys.setrecursionlimit(limit)
    (folder / PREFILL_XML).parent.mkdir(parents=True, exist_ok=True)
    ov.save_model(converted, str(folder / PREFILL_XML), compress_to_fp16=False)
    return [PREFILL_XML, PREFILL_BIN]
