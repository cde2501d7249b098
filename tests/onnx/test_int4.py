"""`--precision int4`: 4-bit MatMulNBits blocks, the tied unembedding at 8 bits, GroupQueryAttention
attention with the in-place KV cache, gated by parity (KL and relative logit error); a perturbed int4 export fails its gate
and leaves nothing behind; generation runs on it."""

from __future__ import annotations

import json
import logging
import subprocess
import sys

import numpy as np
import onnx
import pytest
from onnx import helper, numpy_helper

from gpt2x.choices import Precision
from gpt2x.errors import ParityError
from gpt2x.evaluate.parity import TOLERANCES, check
from gpt2x.generation.generate import generate
from gpt2x.generation.settings import SamplingSettings
from gpt2x.onnx import build, names
from gpt2x.onnx.artifact import read_export
from gpt2x.onnx.interop import GENAI_CONFIG_FILE
from gpt2x.onnx.optimize import INT4_BLOCK, INT4_HEAD_BITS, INT8_BLOCK
from gpt2x.runtime.ort import OrtBackend
from gpt2x.runtime.pytorch import TorchBackend
from gpt2x.workflows.exports import export_model

from ..helpers import Noisy


@pytest.fixture(scope="module")
def tiny_model(tiny_export):
    return tiny_export(n_positions=64)[:2]


@pytest.fixture(scope="module")
def int4_export(tiny_export):
    return tiny_export(Precision.int4, n_positions=64)[2]


def nbits_nodes(path) -> list[tuple[list[str], dict]]:
    proto = onnx.load(str(path))
    return [(list(n.output), {a.name: helper.get_attribute_value(a) for a in n.attribute})
            for n in proto.graph.node if n.op_type == "MatMulNBits"]


def test_int4_export_is_gated_and_has_4bit_blocks_and_an_8bit_head(tiny_model, int4_export):
    model, _ = tiny_model
    info = read_export(int4_export.folder)  # hashes checked
    meta = info.meta
    assert meta["precision"] == "int4" and info.precision is Precision.int4
    parity = meta["parity"]
    assert parity["status"] == "passed" and parity["provider"] == "cpu" and parity["precision"] == "int4"
    assert parity["greedy"]["share"] >= parity["tolerance"]["min_greedy"]

    n_layer = model.config.n_layer
    ops = meta["fused_operators"]
    assert ops["GroupQueryAttention"] == n_layer and "MultiHeadAttention" not in ops
    assert ops["MatMulNBits"] == 4 * n_layer + 1  # qkv, attention out, fc, proj per block; the unembedding
    nodes = nbits_nodes(info.model_path)
    head = [attrs for outputs, attrs in nodes if names.LOGITS in outputs]
    blocks = [attrs for outputs, attrs in nodes if names.LOGITS not in outputs]
    assert len(head) == 1 and len(blocks) == 4 * n_layer
    assert INT4_HEAD_BITS == 8 and head[0]["bits"] == 8 and head[0]["block_size"] == INT8_BLOCK  # int8's settings
    assert {(a["bits"], a["block_size"]) for a in blocks} == {(4, INT4_BLOCK)}
    assert {a["accuracy_level"] for _, a in nodes} == {4}  # int8 activations on the CPU

    assert meta["attention"] == {"op": "GroupQueryAttention", "in_place_kv": True, "batched_multi_token_past": False}
    genai = json.loads((info.folder / GENAI_CONFIG_FILE).read_text())
    assert genai["search"]["past_present_share_buffer"] is True


def test_int4_generation_runs_with_the_in_place_cache(int4_export):
    settings = SamplingSettings(max_new_tokens=12, greedy=True)
    prompts = ["ROMEO:", "The meaning of life is"]
    shared = OrtBackend(int4_export)
    assert shared.in_place_kv
    got = generate(shared, prompts, settings)
    growing = generate(OrtBackend(int4_export, in_place_kv=False), prompts, settings)
    for a, b in zip(got, growing):
        assert len(a.tokens) == 12 or a.finish_reason == "eos"
        assert a.tokens == b.tokens  # the in-place cache decodes the same tokens as the growing one


def test_int4_gate_fails_a_perturbed_export(tiny_model, tmp_path, monkeypatch):
    """The int4 gate refuses a graph whose 4-bit weights are scrambled as a packing bug would: each
    byte's two 4-bit weights swapped (on this tiny model: KL 0.06, max relative error 1.2, against
    4e-4 and 0.12 for the real int4 graph)."""
    model, source = tiny_model
    real_quantize = build.quantize_int4

    def quantize_then_perturb(fused, out):
        ops = real_quantize(fused, out)
        proto = onnx.load(str(out))
        weights = {n.input[1] for n in proto.graph.node if n.op_type == "MatMulNBits"
                   and any(a.name == "bits" and a.i == 4 for a in n.attribute)}
        assert weights, "4-bit MatMulNBits expected"
        for init in proto.graph.initializer:
            if init.name in weights:
                packed = numpy_helper.to_array(init)
                init.CopyFrom(numpy_helper.from_array(((packed >> 4) | (packed << 4)).astype(np.uint8), init.name))
        onnx.save(proto, str(out))
        return ops

    monkeypatch.setattr(build, "quantize_int4", quantize_then_perturb)
    with pytest.raises(ParityError, match="int4 export is out of tolerance: max .* mean KL"):
        export_model(model, source, tmp_path / "bad", Precision.int4)
    assert not (tmp_path / "bad").exists()
    assert list(tmp_path.iterdir()) == []  # no partial folder either


def test_int4_gate_passes_small_noise_and_fails_large(tiny_model):
    """As for fp16 and int8 (test_export_cli): rounding-sized noise on the logits passes the int4
    tolerances, noise that changes the next-token distributions (sigma 0.5: KL ~0.12) fails on KL."""
    model, _ = tiny_model
    ref = TorchBackend(model)
    assert check(ref, Noisy(model, 1e-4), Precision.int4)["status"] == "passed"
    large = check(ref, Noisy(model, 0.5), Precision.int4)
    assert large["status"] == "failed" and "mean KL" in large["message"]
    assert large["logits"]["mean_kl"] > TOLERANCES[Precision.int4].max_kl


def test_quantizer_import_leaves_the_root_logger_alone():
    """ONNX Runtime's nbits quantizer configures the root logger at INFO when imported; gpt2x undoes it
    (else a second export in one process printed every library's INFO records)."""
    code = ("import logging; from gpt2x.onnx import optimize; optimize.nbits_quantizer_module(); "
            "root = logging.getLogger(); print(len(root.handlers), root.level)")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, encoding="utf-8", timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["0", str(logging.WARNING)]

