"""GroupQueryAttention graphs (the int8 export's attention) and the shared, in-place KV cache.

The rewrite (onnx_ops.mha_to_gqa) is checked on an fp32 export, where it must pass the fp32 gate
against the PyTorch model: logits on random shapes (the multi-token-with-past batches go row by
row), greedy tokens, sampled tokens, beam search, left padding, and a cache that has to grow."""

from __future__ import annotations

import threading

import numpy as np
import onnx
import pytest
import torch

from gpt2x.choices import Precision
from gpt2x.errors import ProviderError
from gpt2x.evaluate import parity
from gpt2x.generation.generate import generate
from gpt2x.generation.settings import SamplingSettings
from gpt2x.model.weights import load_model
from gpt2x.numerics import positions
from gpt2x.onnx import optimize
from gpt2x.onnx.artifact import read_export
from gpt2x.runtime import ort as runtime
from gpt2x.runtime.ort import InPlaceCache, OrtBackend
from gpt2x.runtime.pytorch import TorchBackend
from gpt2x.serve.core.engine import Engine, EngineSettings, Row
from gpt2x.serve.core.outputs import Finished, TokenOut
from gpt2x.tokenizer import encode

from ..helpers import PROMPTS


@pytest.fixture(scope="module")
def tiny_gqa(tiny_export):
    model, _, info = tiny_export()
    return model, info, tiny_export(gqa=True)[2]


def test_rewrite_replaces_every_attention_and_keeps_the_interface(tiny_gqa):
    _, mha_info, info = tiny_gqa
    before = onnx.load(str(mha_info.model_path))
    after = onnx.load(str(info.model_path))
    ops = [n.op_type for n in after.graph.node]
    assert ops.count("GroupQueryAttention") == info.config.n_layer
    assert "MultiHeadAttention" not in ops and "Split" not in ops
    assert [i.name for i in after.graph.input] == [i.name for i in before.graph.input]
    assert [o.name for o in after.graph.output] == [o.name for o in before.graph.output]
    assert info.attention == {"op": "GroupQueryAttention", "in_place_kv": True, "batched_multi_token_past": False}
    assert mha_info.attention["in_place_kv"] is False


@pytest.mark.parametrize("shared", [True, False])
def test_gqa_graph_passes_the_fp32_gate(tiny_gqa, shared):
    """Random shapes incl. empty past, left padding and batched multi-token steps on a past, plus
    greedy agreement: the whole fp32 gate, against the PyTorch model."""
    model, _, info = tiny_gqa
    backend = OrtBackend(info, in_place_kv=shared)
    assert backend.in_place_kv is shared
    result = parity.check(TorchBackend(model), backend, Precision.fp32)
    assert result["status"] == "passed", result["message"]
    assert any(c["batch"] > 1 and c["past"] > 0 and c["seq"] > 1 for c in result["logits"]["cases"])


def test_shared_cache_is_written_in_place(tiny_gqa):
    model, _, info = tiny_gqa
    backend = OrtBackend(info)
    ids = np.array([[10, 20, 30, 40]])
    logits, cache = backend.run(ids, np.ones((1, 4), np.int64), np.arange(4)[None], None)
    assert isinstance(cache, InPlaceCache) and cache.length == 4
    buffers = [a.ctypes.data for a in cache.arrays]
    logits2, cache2 = backend.run(np.array([[50]]), np.ones((1, 5), np.int64), np.array([[4]]), cache)
    assert cache2.length == 5 and [a.ctypes.data for a in cache2.arrays] == buffers  # no new allocation
    with torch.no_grad():
        ref, ref_present = model(torch.tensor([[10, 20, 30, 40, 50]]), torch.ones(1, 5, dtype=torch.long), torch.arange(5)[None])
    assert np.abs(ref[0, -1].numpy() - logits2[0, -1]).max() <= 1e-4 * np.abs(ref.numpy()).max()
    for want, got in zip([t for kv in ref_present for t in kv], cache2.to_numpy()):
        assert np.abs(want.numpy() - got).max() <= 1e-4 * max(np.abs(want.numpy()).max(), 1e-6)


def test_mask_that_does_not_match_the_cache_is_refused(tiny_gqa):
    _, _, info = tiny_gqa
    backend = OrtBackend(info)
    _, cache = backend.run(np.array([[1, 2]]), np.ones((1, 2), np.int64), np.arange(2)[None], None)
    with pytest.raises(ValueError, match="attention_mask covers 5"):
        backend.run(np.array([[3]]), np.ones((1, 5), np.int64), np.array([[2]]), cache)


def test_generation_matches_torch_through_cache_growth(tiny_gqa, monkeypatch):
    """Greedy and sampled tokens, a left-padded batch, with a cache that starts at 3 + prompt
    positions and has to grow several times."""
    model, _, info = tiny_gqa
    monkeypatch.setattr(InPlaceCache, "capacity_step", 3)
    ref = TorchBackend(model)
    grown = []
    backend = OrtBackend(info)
    real = InPlaceCache.allocate
    monkeypatch.setattr(InPlaceCache, "allocate", classmethod(lambda cls, owner, b, cap, keep: grown.append(cap) or real(owner, b, cap, keep)))
    for s in (SamplingSettings(max_new_tokens=40, greedy=True), SamplingSettings(max_new_tokens=40, seed=7, top_k=50)):
        grown.clear()
        want = [r.tokens for r in generate(ref, PROMPTS, s)]
        got = [r.tokens for r in generate(backend, PROMPTS, s)]
        assert got == want
        assert max(len(t) for t in got) > 20
        assert len(grown) >= 3 and grown == sorted(grown)  # allocated once, then grown at least twice


def test_generation_runs_to_the_context_limit(tiny_gqa):
    model, _, info = tiny_gqa
    s = SamplingSettings(max_new_tokens=500, greedy=True)
    got = generate(OrtBackend(info), ["ROMEO:"], s)[0]
    want = generate(TorchBackend(model), ["ROMEO:"], s)[0]
    assert got.tokens == want.tokens and got.finish_reason == want.finish_reason


def test_beam_search_reorders_the_shared_cache(tiny_gqa):
    model, _, info = tiny_gqa
    s = SamplingSettings(max_new_tokens=12, num_beams=3, length_penalty=0.8)
    for prompt in PROMPTS[:2]:
        want = generate(TorchBackend(model), [prompt], s)[0].tokens
        assert generate(OrtBackend(info), [prompt], s)[0].tokens == want


def test_int8_export_uses_gqa_and_passes_its_gate(bundled_export):
    model, _ = load_model("shakespeare")
    info = bundled_export(Precision.int8)  # made by the export, through its gate
    assert info.meta["fused_operators"]["GroupQueryAttention"] == model.config.n_layer
    assert info.meta["attention"]["in_place_kv"] is True
    assert info.meta["parity"]["status"] == "passed"
    backend = OrtBackend(read_export(info.folder))
    assert backend.in_place_kv
    # The shared cache and the growing cache are the same graph: same tokens either way.
    s = SamplingSettings(max_new_tokens=48, greedy=True)
    growing = OrtBackend(read_export(info.folder), in_place_kv=False)
    assert [r.tokens for r in generate(backend, PROMPTS, s)] == [r.tokens for r in generate(growing, PROMPTS, s)]


def torch_last_logits(model, ids: np.ndarray, mask: np.ndarray) -> np.ndarray:
    """No-cache reference: the whole sequence through the PyTorch model, all logits."""
    with torch.no_grad():
        t_mask = torch.from_numpy(mask)
        pos = (t_mask.cumsum(-1) - 1).clamp(min=0)
        return model(torch.from_numpy(ids), t_mask, pos)[0].numpy()


def test_batched_multi_token_step_on_a_shared_cache(tiny_gqa):
    """A batch of 3 (one row left-padded), 4 tokens on top of a 5-token shared cache: run row by row
    into the same buffers (GroupQueryAttention's CPU kernel refuses the batched shape), and equal to a
    no-cache forward of the whole sequence."""
    model, _, info = tiny_gqa
    backend = OrtBackend(info)
    rng = np.random.default_rng(3)
    ids = rng.integers(0, 50257, (3, 9), dtype=np.int64)
    mask = np.ones((3, 9), dtype=np.int64)
    mask[1, :2] = 0
    _, cache = backend.run(ids[:, :5], mask[:, :5], positions(mask[:, :5], 5), None)
    assert cache.capacity == 5  # a batch's prefill leaves no room (its next step moves the cache) ...
    cache = backend.past_from_numpy(cache.to_numpy())  # ... a cache built from arrays has room
    assert cache.capacity > 9
    buffers = [a.ctypes.data for a in cache.arrays]
    logits, cache2 = backend.run(ids[:, 5:], mask, positions(mask, 4), cache)
    assert isinstance(cache2, InPlaceCache) and cache2.length == 9
    assert [a.ctypes.data for a in cache2.arrays] == buffers  # written in place, row by row
    ref = torch_last_logits(model, ids, mask)[:, 5:]
    assert np.abs(ref - logits).max() <= 1e-4 * np.abs(ref).max()


def test_shared_cache_grows_up_to_the_context_and_no_further(tiny_gqa, monkeypatch):
    model, _, info = tiny_gqa
    monkeypatch.setattr(InPlaceCache, "capacity_step", 16)
    backend = OrtBackend(info)
    n = info.config.n_positions  # 96
    rng = np.random.default_rng(4)
    ids = rng.integers(0, 50257, (2, n), dtype=np.int64)
    mask = np.ones((2, n), dtype=np.int64)
    logits, cache = backend.run(ids[:, :5], mask[:, :5], positions(mask[:, :5], 5), None)
    capacities = [cache.capacity]
    for t in range(5, n):
        logits, cache = backend.run(ids[:, t : t + 1], mask[:, : t + 1], positions(mask[:, : t + 1], 1), cache)
        capacities.append(cache.capacity)
    # a batch's prefill has no room (5), its first decode step moves it to 5 + 16, then it doubles
    assert capacities[:2] == [5, 5 + 16] and capacities[-1] == n and max(capacities) == n
    assert capacities == sorted(capacities) and len(set(capacities)) >= 3  # grew at least twice
    ref = torch_last_logits(model, ids, mask)[:, -1]
    assert np.abs(ref - logits[:, -1]).max() <= 1e-4 * np.abs(ref).max()
    with pytest.raises(ValueError, match="exceed the model's context"):
        backend.run(np.array([[1], [2]]), np.ones((2, n + 1), np.int64), np.array([[n], [n]]), cache)


def test_a_stale_shared_cache_is_refused(tiny_gqa, monkeypatch):
    _, _, info = tiny_gqa
    backend = OrtBackend(info)
    _, cache = backend.run(np.array([[1, 2, 3]]), np.ones((1, 3), np.int64), np.arange(3)[None], None)
    _, newer = backend.run(np.array([[4]]), np.ones((1, 4), np.int64), np.array([[3]]), cache)
    with pytest.raises(ValueError, match="already stepped from"):
        backend.run(np.array([[5]]), np.ones((1, 4), np.int64), np.array([[3]]), cache)
    # The newer cache still steps, and after it moves to larger buffers, it is stale in turn.
    monkeypatch.setattr(InPlaceCache, "capacity_step", 1)
    small = OrtBackend(info)
    _, c1 = small.run(np.array([[1, 2]]), np.ones((1, 2), np.int64), np.arange(2)[None], None)
    _, c2 = small.run(np.array([[3]]), np.ones((1, 3), np.int64), np.array([[2]]), c1)
    _, c3 = small.run(np.array([[4]]), np.ones((1, 4), np.int64), np.array([[3]]), c2)  # grows
    assert c3.capacity > c2.capacity
    with pytest.raises(ValueError, match="already stepped from"):
        small.run(np.array([[4]]), np.ones((1, 4), np.int64), np.array([[3]]), c2)
    backend.run(np.array([[5]]), np.ones((1, 5), np.int64), np.array([[4]]), newer)


def test_in_place_kv_is_read_under_either_key_and_the_old_keyword_still_works(tiny_gqa):
    """Exports record the in-place cache as `in_place_kv`, those made before as `shared_kv_buffer`; a
    reader takes either key. `OrtBackend(shared_kv=...)` and `.shared_kv` still work for one release, warning."""
    from gpt2x.onnx.artifact import ExportInfo

    _, mha_info, info = tiny_gqa
    layout = dict(info.attention)
    assert layout.pop("in_place_kv") is True  # what artifact.py writes
    for key in ("in_place_kv", "shared_kv_buffer"):  # today's key, and older exports'
        for flag in (True, False):
            named = ExportInfo(info.folder, {**info.meta, "attention": {**layout, key: flag}})
            assert OrtBackend(named).in_place_kv is flag
    with pytest.warns(DeprecationWarning, match="in_place_kv"):
        old = OrtBackend(info, shared_kv=False)
    assert old.in_place_kv is False
    with pytest.warns(DeprecationWarning, match="in_place_kv"):
        assert OrtBackend(info).shared_kv is True
    # MultiHeadAttention: in place through its twin on the CPU unless asked not to
    assert OrtBackend(mha_info).in_place_kv is True and OrtBackend(mha_info, in_place_kv=False).in_place_kv is False


def test_an_fp32_export_asked_in_place_runs_a_twin_that_passes_the_fp32_gate(tiny_gqa, monkeypatch):
    """OrtBackend(in_place_kv=True) on an fp32 MultiHeadAttention export runs a GroupQueryAttention twin made in
    memory (optimize.in_place_form): the in-place cache, the whole fp32 gate against PyTorch passed, and the
    greedy tokens of the rewritten export on disk (tests/helpers.as_gqa). Without a twin (weights in a data
    file), asking for the in-place cache is refused in one line."""
    model, mha_info, gqa_info = tiny_gqa
    twin = OrtBackend(mha_info, in_place_kv=True)
    assert twin.in_place_kv is True and twin.attention == gqa_info.attention
    result = parity.check(TorchBackend(model), twin, Precision.fp32)
    assert result["status"] == "passed", result["message"]
    settings = SamplingSettings(max_new_tokens=12, greedy=True)
    assert [r.tokens for r in generate(twin, PROMPTS[:3], settings)] == \
        [r.tokens for r in generate(OrtBackend(gqa_info), PROMPTS[:3], settings)]
    monkeypatch.setenv("GPT2X_GRAPHS", "off")  # not the twin an earlier backend kept (onnx.graph_cache)
    monkeypatch.setattr(optimize, "in_place_form", lambda path: None)  # where the ort backend takes it from
    with pytest.raises(ProviderError, match="cannot update its KV cache in place"):
        OrtBackend(mha_info, in_place_kv=True)


def test_a_graph_whose_weights_are_in_a_data_file_has_no_in_memory_twin(tiny_gqa, tmp_path):
    _, mha_info, _ = tiny_gqa
    import shutil

    from gpt2x.onnx.optimize import in_place_form

    folder = tmp_path / "copy"
    shutil.copytree(mha_info.folder, folder)
    assert in_place_form(folder / "model.onnx") is not None
    (folder / "model.onnx.data").write_bytes(b"")
    assert in_place_form(folder / "model.onnx") is None


def test_unset_buffer_values_are_never_read(tiny_gqa, monkeypatch):
    """The in-place cache leaves new buffers unset (runtime.ort.unset_arrays): filled with NaN instead,
    a left-padded batch that grows its buffers several times, and a served batch whose rows join a
    running one (rows and positions merged into unset buffers), give the PyTorch reference's tokens,
    and every logit stays finite."""
    model, _, info = tiny_gqa
    monkeypatch.setattr(runtime, "unset_arrays", lambda shape, count, dtype: [np.full(shape, np.nan, dtype=dtype) for _ in range(count)])
    monkeypatch.setattr(InPlaceCache, "capacity_step", 3)
    ref, backend = TorchBackend(model), OrtBackend(info)
    assert backend.in_place_kv
    finite, step = [], backend.step

    def checked_step(*args):
        logits, cache = step(*args)
        finite.append(bool(np.isfinite(logits).all()))
        return logits, cache

    backend.step = checked_step
    for s in (SamplingSettings(max_new_tokens=30, greedy=True), SamplingSettings(max_new_tokens=30, seed=7, top_k=50)):
        assert [r.tokens for r in generate(backend, PROMPTS, s)] == [r.tokens for r in generate(ref, PROMPTS, s)]
    s = SamplingSettings(max_new_tokens=12, greedy=True)
    want = [generate(ref, [p], s)[0].tokens for p in PROMPTS]  # each alone: no padding in the reference
    engine = Engine(backend, EngineSettings(max_batch_size=4, batch_wait_s=0, max_join_delay_s=0)).start()
    got: list[list[int]] = [[] for _ in PROMPTS]
    ended = threading.Semaphore(0)

    def sink(i: int):
        def on(out):
            if isinstance(out, TokenOut):
                got[i].append(out.token)
                if i == 0 and len(got[0]) == 3:  # the others join the running batch
                    engine.submit([Row(encode(p), s, sink(j)) for j, p in enumerate(PROMPTS) if j])
            else:
                assert isinstance(out, Finished), out
                ended.release()
        return on

    try:
        engine.submit([Row(encode(PROMPTS[0]), s, sink(0))])
        assert all(ended.acquire(timeout=60) for _ in PROMPTS)
    finally:
        engine.close()
    assert got == want and engine.counters["joins"] >= 1
    assert finite and all(finite)
