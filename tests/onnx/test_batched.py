"""An int8 export's batched decode graph (onnx/optimize.quantize_int8_dynamic, evaluate/batched.py): written beside
model.onnx with the same inputs, outputs and in-place KV cache form, its file recorded and checked like the others,
gated by the export's own parity check (a perturbed graph is dropped and the export goes on), both graphs' steps timed
and batched_from read from the timings; asked for by GPT2X_BATCHED_DECODE or the export's argument."""

from __future__ import annotations

import json
import shutil

import numpy as np
import onnx
import pytest
from onnx import numpy_helper

from gpt2x.choices import Precision
from gpt2x.errors import ArtifactError, ParityError, UsageError
from gpt2x.evaluate.batched import gate_batched
from gpt2x.evaluate.parity import TOLERANCES
from gpt2x.numerics import positions
from gpt2x.onnx import build
from gpt2x.onnx.artifact import BATCHED_FILE, BATCHED_KEY, MODEL_FILE, ExportInfo, read_export, verify_export
from gpt2x.runtime.ort import OrtBackend
from gpt2x.runtime.pytorch import TorchBackend

from ..helpers import torch_last_logits


@pytest.fixture(scope="module")
def tiny(tiny_export):
    model, _, info = tiny_export(Precision.int8, batched=True)
    assert info.batched is not None, info.meta.get(BATCHED_KEY)
    return model, info


def test_the_int8_export_keeps_a_gated_and_timed_batched_graph(tiny):
    _, info = tiny
    record = info.batched
    assert record["file"] == BATCHED_FILE
    assert info.meta["sizes"][BATCHED_FILE] == info.batched_path.stat().st_size > 0
    assert len(info.meta["files"][BATCHED_FILE]) == 64
    verify_export(info.folder)
    parity, tol = record["parity"], TOLERANCES[Precision.int8]
    assert parity["status"] == "passed" and parity["logits"]["max_rel"] <= tol.max_rel
    assert parity["greedy"]["share"] >= tol.min_greedy
    timing = record["timing"]
    assert len(timing["model_ms"]) == len(timing["batched_ms"]) == len(timing["rows"]) and timing["new_tokens"] == 1
    assert all(ms > 0 for ms in timing["model_ms"] + timing["batched_ms"])
    # batched_from, recomputed from the figures: faster by faster_by there and at every larger M, not just before
    start = record["batched_from"]
    assert start == timing["batched_from"]
    faster = [b < m * (1 - timing["faster_by"]) for m, b in zip(timing["model_ms"], timing["batched_ms"])]
    if start is None:
        assert not faster[-1]
    else:
        at = timing["rows"].index(start)
        assert all(faster[at:]) and (at == 0 or not faster[at - 1])


def test_the_batched_graph_is_quantize_dynamics_with_model_onnxs_io_and_in_place_cache(tiny):
    _, info = tiny
    graph, main = onnx.load(str(info.batched_path)), onnx.load(str(info.model_path))
    ops = {n.op_type for n in graph.graph.node}
    assert "GroupQueryAttention" in ops and "MatMulNBits" not in ops
    assert ops & {"DynamicQuantizeMatMul", "MatMulInteger", "MatMulIntegerToFloat"}
    assert [i.name for i in graph.graph.input] == [i.name for i in main.graph.input]  # logits_to_keep included
    assert [o.name for o in graph.graph.output] == [o.name for o in main.graph.output]
    # the weights are int8 with one scale per output channel: a vector of scales per quantized matmul
    scales = [numpy_helper.to_array(t) for t in graph.graph.initializer if t.name.endswith("_scale") and t.dims]
    assert scales and all(s.ndim == 1 and s.size > 1 for s in scales)
    # in 7 bits: on a CPU without VNNI, MLAS sums pairs of uint8 x int8 products in int16, which 255 x 127 x 2 overflows
    weights = [numpy_helper.to_array(t) for t in graph.graph.initializer if t.data_type == onnx.TensorProto.INT8]
    assert weights and all(np.abs(w.astype(np.int16)).max() <= 64 for w in weights)  # 255 x 64 x 2 < 2**15


def test_its_logits_and_presents_match_pytorchs_without_a_cache(tiny):
    """Every step on the batched graph: a left-padded prefill, then a step on its cache, against PyTorch's forward
    of the whole sequences (logits) and PyTorch's own cache (presents)."""
    model, info = tiny
    tol = TOLERANCES[Precision.int8].max_rel
    rng = np.random.default_rng(4)
    ids = rng.integers(0, info.config.vocab_size, (3, 9))
    mask = np.ones_like(ids)
    mask[0, :3] = 0
    reference = TorchBackend(model)
    with OrtBackend(info, threads=1, batched=True) as backend:
        assert backend.batched_from == 1 and backend.session_for(1, 1) is not backend.session
        logits, cache = backend.step(ids[:, :8], mask[:, :8], positions(mask[:, :8], 8), None)
        want = torch_last_logits(model, ids[:, :8], mask[:, :8])
        assert np.abs(logits - want).max() / np.abs(want).max() <= tol
        logits, cache = backend.step(ids[:, 8:], mask, positions(mask, 1), cache)
        want = torch_last_logits(model, ids, mask)
        assert np.abs(logits - want).max() / np.abs(want).max() <= tol
        _, ref_cache = reference.step(ids, mask, positions(mask, 9), None)
        keep = mask.astype(bool)
        for got, ref in zip(cache.to_numpy(), ref_cache.to_numpy()):
            g, r = got.transpose(0, 2, 1, 3)[keep], ref.transpose(0, 2, 1, 3)[keep]
            assert np.abs(g - r).max() / np.abs(r).max() <= tol


def test_a_perturbed_batched_graph_fails_its_gate_and_is_dropped(tiny, tmp_path):
    model, info = tiny
    folder = tmp_path / "perturbed"
    shutil.copytree(info.folder, folder)
    proto = onnx.load(str(folder / BATCHED_FILE))
    for t in proto.graph.initializer:  # every per-channel weight scale x 3: the logits move far out of tolerance
        if t.name.endswith("_scale") and t.dims:
            t.CopyFrom(numpy_helper.from_array(numpy_helper.to_array(t) * 3, t.name))
    onnx.save(proto, str(folder / BATCHED_FILE))
    perturbed = ExportInfo(folder, json.loads(json.dumps(info.meta)))
    with pytest.raises(ParityError, match="batched decode graph is out of tolerance"):
        gate_batched(TorchBackend(model), perturbed)
    messages = []
    record = build._batched_decode(perturbed, lambda i: gate_batched(TorchBackend(model), i), messages.append)
    assert record["kept"] is False and "out of tolerance" in record["reason"]
    assert not (folder / BATCHED_FILE).exists() and (folder / MODEL_FILE).exists()
    assert "dropped" in messages[-1]


def test_a_missing_batched_file_is_refused_in_one_line(tiny, tmp_path):
    _, info = tiny
    folder = tmp_path / "missing"
    shutil.copytree(info.folder, folder)
    (folder / BATCHED_FILE).unlink()
    with pytest.raises(ArtifactError) as e:
        read_export(folder)
    assert f"{BATCHED_FILE} is missing" in str(e.value) and "\n" not in str(e.value)


def test_the_env_asks_for_the_graph_and_a_bad_value_is_one_line(monkeypatch):
    monkeypatch.delenv(build.BATCHED_DECODE_ENV, raising=False)
    assert build.batched_decode_wanted(None) is True and build.batched_decode_wanted(False) is False
    monkeypatch.setenv(build.BATCHED_DECODE_ENV, "0")
    assert build.batched_decode_wanted(None) is False and build.batched_decode_wanted(True) is True
    monkeypatch.setenv(build.BATCHED_DECODE_ENV, "1")
    assert build.batched_decode_wanted(None) is True
    monkeypatch.setenv(build.BATCHED_DECODE_ENV, "yes")
    with pytest.raises(UsageError, match="GPT2X_BATCHED_DECODE must be 0 or 1"):
        build.batched_decode_wanted(None)


def test_exports_without_it_say_why(tiny_export):
    """The suite's int8 exports (GPT2X_BATCHED_DECODE=0) record the graph as not asked for; others have no record."""
    assert tiny_export(Precision.int8)[2].meta[BATCHED_KEY] == {"kept": False, "reason": "not asked for"}
    assert BATCHED_KEY not in tiny_export(Precision.fp32)[2].meta
