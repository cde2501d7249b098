"""A bf16 export's OpenVINO prefill graph (docs/export.md, docs/backends.md): made and gated at export on the openvino
backend at bf16's tolerances (a graph out of them is dropped), recorded as computing in bf16, and run by that backend
for every step of more than one token (fresh prompts and a prompt's next chunk), and for decode steps on the backend's
KV buffers whole, the new positions written into them."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from gpt2x.choices import Precision
from gpt2x.errors import ArtifactError, ParityError
from gpt2x.evaluate import parity as parity_module
from gpt2x.evaluate.metrics import logit_stats
from gpt2x.evaluate.parity import TOLERANCES
from gpt2x.numerics import positions
from gpt2x.onnx.artifact import BF16, PREFILL_BIN, PREFILL_XML, verify_export
from gpt2x.runtime import openvino_prefill

from ..helpers import torch_last_logits

pytestmark = pytest.mark.skipif(not openvino_prefill.cpu_has_bf16(), reason="this CPU does not compute bf16")


@pytest.fixture(scope="module")
def exports(tiny_export):
    """The tiny model and its bf16 export with its prefill graph, gated."""
    model, _, info = tiny_export(Precision.bf16, openvino_prefill=True)
    return model, info


def _backend(info, **kwargs):
    from gpt2x.runtime.openvino import OpenVinoBackend

    return OpenVinoBackend(info, threads=1, **kwargs)


def test_bf16_exports_get_a_prefill_graph_by_default(monkeypatch):
    from gpt2x.onnx.build import OPENVINO_PREFILL_ENV, openvino_prefill_wanted

    monkeypatch.delenv(OPENVINO_PREFILL_ENV, raising=False)
    assert openvino_prefill_wanted(None, Precision.bf16) is True


def test_the_bf16_export_records_its_prefill_graph_gated_at_bf16_on_the_openvino_backend(exports):
    _, info = exports
    record = info.prefill
    assert record is not None and record["files"] == [PREFILL_XML, PREFILL_BIN]
    verify_export(info.folder)
    assert record["inference_precision"] == BF16 and "bf16" in record["weights"]
    parity, tol = record["parity"], TOLERANCES[Precision.bf16]
    assert (parity["status"], parity["precision"]) == ("passed", "bf16")
    assert parity["tolerance"] == dataclasses.asdict(tol)
    assert parity["logits"]["max_rel"] <= tol.max_rel and parity["logits"]["present_max_rel"] <= tol.max_rel
    assert any(c["past"] for c in parity["logits"]["cases"])  # a prompt's next chunk, on a past
    timing = record["timing"]
    assert timing["compute"] == BF16 and timing["lengths"] == [8, 32, info.config.n_positions - 1]
    assert all(ms > 0 for ms in timing["prefill_graph_ms"] + timing["model_onnx_ms"])


def assert_within_bf16(want: np.ndarray, got: np.ndarray) -> None:
    """bf16's gate on logits: max_rel and mean KL against the reference's."""
    tol = TOLERANCES[Precision.bf16]
    stats = logit_stats(want, got)
    assert stats["max_rel"] <= tol.max_rel and stats["mean_kl"] <= tol.max_kl, stats


def test_the_backend_prefills_on_the_graph_within_bf16_tolerance_of_pytorch(exports):
    """Independent reference: PyTorch's fp32 logits of whole left-padded prompts; the counter shows which graph ran."""
    model, info = exports
    rng = np.random.default_rng(5)
    ids = rng.integers(0, info.config.vocab_size, (3, 21), dtype=np.int64)
    mask = np.ones_like(ids)
    mask[1, :6] = 0
    want = torch_last_logits(model, ids, mask)
    with _backend(info) as backend:
        assert backend.prefill_graph is not None and backend.prefill_graph.inference_precision == BF16
        got, cache = backend.step(ids, mask, positions(mask, 21), None)
        assert backend.prefill_steps == 1
        assert_within_bf16(want, got)
        # decode steps run on the graph too, on the whole buffer as its past, through a growth of that buffer
        assert backend.decodes_on_graph
        capacity = cache.capacity
        for _ in range(capacity - ids.shape[1] + 2):
            nxt = got.argmax(-1)[:, None]
            ids, mask = np.concatenate([ids, nxt], axis=1), np.concatenate([mask, np.ones((3, 1), np.int64)], axis=1)
            got, cache = backend.step(nxt, mask, positions(mask, 1), cache)
            assert_within_bf16(torch_last_logits(model, ids, mask), got)
        assert backend.prefill_steps == 1 and cache.capacity > capacity


def test_a_prompts_next_chunk_runs_on_the_graph_on_its_past(exports):
    model, info = exports
    rng = np.random.default_rng(6)
    ids = rng.integers(0, info.config.vocab_size, (2, 30), dtype=np.int64)
    mask = np.ones_like(ids)
    mask[0, :3] = 0
    with _backend(info) as backend:
        _, cache = backend.step(ids[:, :12], mask[:, :12], positions(mask[:, :12], 12), None)
        got, cache = backend.step(ids[:, 12:], mask, positions(mask, 18), cache)
        assert backend.prefill_steps == 2 and cache.length == 30
    assert_within_bf16(torch_last_logits(model, ids, mask), got)


def test_greedy_tokens_through_the_graph_match_the_backend_without_it(exports):
    from gpt2x.generation.generate import generate
    from gpt2x.generation.settings import SamplingSettings

    _, info = exports
    prompts = ["ROMEO:", "The meaning of life is", "First Citizen:\nBefore we proceed"]
    settings = SamplingSettings(greedy=True, max_new_tokens=16)
    with _backend(info) as backend:
        fast = [r.tokens for r in generate(backend, prompts, settings)]
        assert backend.prefill_steps >= 1
    with _backend(info, prefill_graph=False) as backend:
        assert backend.prefill_graph is None
        plain = [r.tokens for r in generate(backend, prompts, settings)]
        assert backend.prefill_steps == 0
    assert fast == plain


def test_an_export_without_the_graph_runs_model_onnx_and_refuses_to_be_forced(tiny_export):
    _, _, info = tiny_export(Precision.bf16)
    assert info.prefill is None
    with _backend(info) as backend:
        assert backend.prefill_graph is None
    with pytest.raises(ArtifactError, match="has no OpenVINO prefill graph"):
        _backend(info, prefill_graph=True)


def test_the_gate_refuses_a_graph_out_of_bf16_tolerance(exports, monkeypatch):
    """The same gate with bounds no bf16 graph meets: it raises, which drops the graph at export (build._gated)."""
    from gpt2x.evaluate.prefill import gate_prefill
    from gpt2x.runtime.pytorch import TorchBackend

    model, info = exports
    strict = dataclasses.replace(TOLERANCES[Precision.bf16], max_rel=1e-7)
    monkeypatch.setitem(parity_module.TOLERANCES, Precision.bf16, strict)
    with pytest.raises(ParityError, match="OpenVINO prefill at bf16 compute is out of tolerance"):
        gate_prefill(TorchBackend(model), info)


def test_the_prefix_cache_keeps_a_bf16_cache_as_it_is(exports):
    """What the prefix cache keeps of a bf16 cache (KVCache.stored) is its bf16 values, 2 bytes each, and a past made of
    them steps as the cache they came from, bit for bit: nothing rounded or widened on the way."""
    from gpt2x.runtime.base import kv_dtype_name

    _, info = exports
    rng = np.random.default_rng(7)
    ids = rng.integers(0, info.config.vocab_size, (2, 12), dtype=np.int64)
    mask = np.ones_like(ids)
    with _backend(info) as backend:
        assert backend.capabilities.stores_kv_dtype and kv_dtype_name(backend.kv_dtype) == "bfloat16"
        _, cache = backend.step(ids, mask, positions(mask, 12), None)
        kept = [a.copy() for a in cache.stored()]
        assert len(kept) == 2 * info.config.n_layer and all(a.dtype == np.uint16 and a.shape[2] == 12 for a in kept)
        nxt = rng.integers(0, info.config.vocab_size, (2, 1), dtype=np.int64)
        longer = np.ones((2, 13), np.int64)
        want, _ = backend.step(nxt, longer, positions(longer, 1), cache)
        got, _ = backend.step(nxt, longer, positions(longer, 1), backend.past_from_numpy(kept))
    assert np.array_equal(want, got)
