"""The OpenVINO backend against two independent references: the PyTorch model (parity gates) and
ONNX Runtime on the same export (generated tokens). Both attention graphs: MultiHeadAttention (the
fp32 export) and GroupQueryAttention (the same export rewritten, gated at fp32 strictness, and the
int8 export), whose OpenVINO implementation runs a batch one row at a time."""

from __future__ import annotations

import numpy as np
import onnx
import openvino as ov
import pytest
import torch

from gpt2x.choices import BackendKind, Precision, ProviderKind
from gpt2x.errors import ArtifactError, ProviderError
from gpt2x.evaluate import parity
from gpt2x.generation.generate import generate
from gpt2x.generation.settings import SamplingSettings
from gpt2x.onnx.artifact import MODEL_FILE, ExportInfo
from gpt2x.runtime.base import CPU_PRECISIONS, Capabilities
from gpt2x.runtime.openvino import OpenVinoBackend, OpenVinoKVCache
from gpt2x.runtime.ort import OrtBackend
from gpt2x.runtime.pytorch import TorchBackend
from gpt2x.workflows.backends import export_backend
from gpt2x.workflows.exports import export_model as export

from ..helpers import PROMPTS


@pytest.fixture(scope="module")
def tiny(tiny_export):
    """A tiny model, its fp32 export (MultiHeadAttention) and that export with GroupQueryAttention."""
    model, source, info = tiny_export()
    return model, source, {"mha": info, "gqa": tiny_export(gqa=True)[2]}


@pytest.mark.parametrize("graph", ["mha", "gqa"])
def test_fp32_graphs_pass_the_fp32_gate(tiny, graph):
    """Empty past, left padding, batched multi-token steps on a past, greedy agreement: the whole
    fp32 gate against the PyTorch model."""
    model, _, infos = tiny
    backend = OpenVinoBackend(infos[graph], threads=2)
    assert backend.rows_only is (graph == "gqa")
    result = parity.check(TorchBackend(model), backend, Precision.fp32)
    assert result["status"] == "passed", result["message"]
    assert result["logits"]["max_rel"] <= parity.TOLERANCES[Precision.fp32].max_rel
    assert any(c["batch"] > 1 and c["past"] > 0 and c["seq"] > 1 for c in result["logits"]["cases"])


def test_int8_export_uses_gqa_and_passes_the_int8_gate(tiny, tmp_path):
    model, source, _ = tiny
    info = export(model, source, tmp_path / "tiny-int8", Precision.int8)
    assert info.attention["op"] == "GroupQueryAttention"
    backend = OpenVinoBackend(info)
    assert backend.rows_only
    result = parity.check(TorchBackend(model), backend, Precision.int8)
    assert result["status"] == "passed", result["message"]
    assert result["logits"]["max_rel"] > 0  # int8 weights: not the fp32 graph by mistake


def test_steps_write_new_positions_into_the_same_buffers(tiny):
    """A decode step neither allocates nor rebinds the cache until it is full, and the graph gives out its new
    positions alone (model.onnx gives out the past and them concatenated, as long as the cache: at every step, 84
    against 37 ms at 16 rows of GPT-2 124M bf16); the logits and the cache equal the PyTorch model's on the whole
    sequence."""
    model, _, infos = tiny
    backend = OpenVinoBackend(infos["mha"])
    ids = np.array([[10, 20, 30, 40, 50, 60]])
    _, cache = backend.run(ids[:, :4], np.ones((1, 4), np.int64), np.arange(4)[None], None)
    assert isinstance(cache, OpenVinoKVCache) and cache.length == 4 and cache.capacity >= 6
    pointers = [a.ctypes.data for a in cache.arrays]
    _, cache = backend.step(ids[:, 4:5], np.ones((1, 5), np.int64), np.array([[4]]), cache)
    logits, cache2 = backend.step(ids[:, 5:], np.ones((1, 6), np.int64), np.array([[5]]), cache)
    assert cache2.length == 6 and [a.ctypes.data for a in cache2.arrays] == pointers
    given = [backend.request.get_tensor(backend.compiled.output(name)).shape for name in ("present.0.key", "present.1.value")]
    assert given == [(1, model.config.n_head, 1, model.config.n_embd // model.config.n_head)] * 2
    with torch.no_grad():
        ref, ref_present = model(torch.tensor(ids), torch.ones(1, 6, dtype=torch.long), torch.arange(6)[None])
    assert logits.shape == (1, backend.vocab_size)
    assert np.abs(ref[0, -1].numpy() - logits[0]).max() <= 1e-4 * np.abs(ref.numpy()).max()
    for want, got in zip([t for kv in ref_present for t in kv], cache2.to_numpy()):
        assert got.shape == want.shape
        assert np.abs(want.numpy() - got).max() <= 1e-4 * np.abs(want.numpy()).max()
    with pytest.raises(ValueError, match="already stepped from"):  # `cache` is stale now
        backend.step(ids[:, 5:], np.ones((1, 6), np.int64), np.array([[5]]), cache)
    with pytest.raises(ValueError, match="attention_mask"):
        backend.step(ids[:, 5:], np.ones((1, 9), np.int64), np.array([[5]]), cache2)


@pytest.mark.parametrize("graph", ["mha", "gqa"])
def test_generation_equals_ort_through_cache_growth(tiny, graph, monkeypatch):
    """Greedy and seeded sampled tokens for a left-padded batch, with a cache that starts at 3 +
    prompt positions and has to grow several times, equal ONNX Runtime's on the same export."""
    _, _, infos = tiny
    monkeypatch.setattr(OpenVinoKVCache, "capacity_step", 3)
    backend, ort_backend = OpenVinoBackend(infos[graph]), OrtBackend(infos[graph])
    grown = []
    real = OpenVinoKVCache.allocate
    monkeypatch.setattr(OpenVinoKVCache, "allocate", classmethod(lambda cls, owner, b, cap, keep: grown.append(cap) or real(owner, b, cap, keep)))
    for s in (SamplingSettings(max_new_tokens=40, greedy=True), SamplingSettings(max_new_tokens=40, seed=7, top_k=50)):
        grown.clear()
        want = [r.tokens for r in generate(ort_backend, PROMPTS, s)]
        got = [r.tokens for r in generate(backend, PROMPTS, s)]
        assert got == want
        assert min(len(t) for t in got) > 20
        assert len(grown) >= 3 and grown == sorted(grown)  # allocated once, then grown at least twice


@pytest.mark.parametrize("graph", ["mha", "gqa"])
def test_generation_runs_to_the_context_limit(tiny, graph):
    _, _, infos = tiny
    s = SamplingSettings(max_new_tokens=500, greedy=True)
    got = generate(OpenVinoBackend(infos[graph]), PROMPTS[:2], s)
    want = generate(OrtBackend(infos[graph]), PROMPTS[:2], s)
    assert [g.tokens for g in got] == [w.tokens for w in want]
    assert [g.finish_reason for g in got] == [w.finish_reason for w in want]
    assert "context" in [g.finish_reason for g in got]


@pytest.mark.parametrize("graph", ["mha", "gqa"])
def test_beam_search_equals_ort(tiny, graph):
    _, _, infos = tiny
    s = SamplingSettings(max_new_tokens=12, num_beams=3, length_penalty=0.8)
    backend, ort_backend = OpenVinoBackend(infos[graph]), OrtBackend(infos[graph])
    for prompt in PROMPTS[:2]:
        want = generate(ort_backend, [prompt], s)[0].tokens
        assert len(want) > 3
        assert generate(backend, [prompt], s)[0].tokens == want
    # reorder itself: gather rows of a batch's cache, then step every row on its gathered cache
    rng = np.random.default_rng(5)
    ids, mask = rng.integers(0, 50257, (3, 6)), np.ones((3, 7), np.int64)
    rows = np.array([2, 0, 0])
    step_ids, pos = rng.integers(0, 50257, (3, 1)), np.full((3, 1), 6)
    outs = []
    for b in (backend, ort_backend):
        _, past = b.run(ids, mask[:, :6], np.tile(np.arange(6), (3, 1)), None)
        before = past.to_numpy()
        past = past.reorder(rows)
        assert all(np.array_equal(got, want[rows]) for got, want in zip(past.to_numpy(), before))
        outs.append(b.step(step_ids, mask, pos, past)[0])
    assert np.abs(outs[0] - outs[1]).max() <= 1e-4 * np.abs(outs[1]).max()


def test_workflows_open_it_and_it_implements_the_protocol(tiny):
    _, _, infos = tiny
    backend = export_backend(BackendKind.openvino, infos["mha"], threads=1)
    assert isinstance(backend, OpenVinoBackend)
    assert (backend.name, backend.provider) == ("openvino", ProviderKind.cpu)
    assert backend.capabilities == Capabilities(runtime="OpenVINO", precisions_by_provider={ProviderKind.cpu: (*CPU_PRECISIONS, Precision.bf16)},
                                                takes_past=True, joins_rows=True, rolls_back=True, stores_kv_dtype=True)
    assert backend.model_name == infos["mha"].meta["model"]["name"]
    assert (backend.n_positions, backend.vocab_size) == (96, 50257)
    assert backend.peak_device_memory_mb() is None
    assert backend.compiled.get_property("INFERENCE_NUM_THREADS") == 1
    assert backend.compiled.get_property("INFERENCE_PRECISION_HINT") == ov.Type.f32  # not the CPU's bf16 default


def test_cuda_and_fp16_are_refused(tiny):
    _, _, infos = tiny
    with pytest.raises(ProviderError, match="OpenVINO has no CUDA device") as err:
        OpenVinoBackend(infos["mha"], ProviderKind.cuda)
    assert "\n" not in str(err.value) and "--" not in str(err.value)
    fp16 = ExportInfo(infos["mha"].folder, {**infos["mha"].meta, "precision": "fp16"})
    with pytest.raises(ProviderError, match="fp16"):
        OpenVinoBackend(fp16)


def test_graph_openvino_cannot_load_is_one_artifact_error(tiny, tmp_path):
    _, _, infos = tiny
    proto = onnx.load(str(infos["mha"].model_path))
    node = next(n for n in proto.graph.node if n.op_type == "FastGelu")
    node.op_type = "NoSuchOperator"
    folder = tmp_path / "broken"
    folder.mkdir()
    onnx.save(proto, str(folder / MODEL_FILE))
    with pytest.raises(ArtifactError, match="OpenVINO .* cannot load") as err:
        OpenVinoBackend(ExportInfo(folder, infos["mha"].meta))
    assert "\n" not in str(err.value) and "NoSuchOperator" in str(err.value)
