"""The ONNX Runtime backend with an int8 or fp32 export's OpenVINO prefill graph (runtime/prefill.py,
openvino_prefill.py): OpenVINO's prefill, then ONNX Runtime's decode on its own cache, checked against PyTorch's
forward without a cache, row by row, on a left-padded batch, after a merge and a rollback; the choice, forced or read
from the export's timings; and the compute precision its record chose."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

from gpt2x.choices import Precision
from gpt2x.errors import ProviderError, UsageError
from gpt2x.generation.generate import generate
from gpt2x.generation.settings import SamplingSettings
from gpt2x.numerics import positions
from gpt2x.onnx.artifact import ExportInfo
from gpt2x.runtime.ort import OrtBackend
from gpt2x.runtime.prefill import PrefillChoice, estimate_ms

from ..helpers import run_gpt2x

PROMPTS = [[464, 3616, 286, 1204, 318], [50, 2662], [4944, 46, 25, 198, 13, 11, 8, 1000, 3, 77, 5]]


@pytest.fixture(scope="module")
def tiny(tiny_export):
    """The tiny model and its int8 export, gated, with its OpenVINO prefill graph."""
    model, _, info = tiny_export(Precision.int8, openvino_prefill=True)
    assert info.prefill is not None, info.meta.get("openvino_prefill")
    return model, info


@pytest.fixture(scope="module")
def hybrid(tiny):
    with OrtBackend(tiny[1], threads=1, prefill="openvino") as backend:
        yield backend


def full_forward(model, ids: np.ndarray, mask: np.ndarray) -> np.ndarray:
    """PyTorch's last-position logits of whole sequences, no cache."""
    with torch.no_grad():
        t_mask = torch.tensor(mask)
        logits, _ = model(torch.tensor(ids), t_mask, torch.tensor(positions(mask, ids.shape[1])))
    return logits[:, -1].numpy()


def torch_greedy(model, prompt: list[int], n: int) -> list[int]:
    ids = list(prompt)
    for _ in range(n):
        ids.append(int(full_forward(model, np.array([ids]), np.ones((1, len(ids)), np.int64)).argmax()))
    return ids[len(prompt):]


def rel(ref: np.ndarray, got: np.ndarray) -> float:
    return float(np.abs(ref - got).max() / np.abs(ref).max())


def test_the_hybrids_greedy_tokens_are_pytorchs_without_a_cache(tiny, hybrid):
    model, _ = tiny
    assert hybrid.prefill == "openvino" and hybrid.prefill_from == 2
    s = SamplingSettings(max_new_tokens=12, greedy=True, ignore_eos=True)
    for prompt in PROMPTS:
        [got] = generate(hybrid, [""], s, prompt_ids=[prompt])
        assert got.tokens == torch_greedy(model, prompt, 12)


def test_forced_onnxruntime_and_forced_openvino_give_the_same_greedy_tokens(tiny, hybrid):
    s = SamplingSettings(max_new_tokens=16, greedy=True, ignore_eos=True)
    with OrtBackend(tiny[1], threads=1, prefill="onnxruntime") as ort_only:
        assert ort_only.prefill == "onnxruntime" and ort_only.prefill_from is None
        want = [g.tokens for g in generate(ort_only, [""] * 3, s, prompt_ids=PROMPTS)]  # one left-padded batch
    assert [g.tokens for g in generate(hybrid, [""] * 3, s, prompt_ids=PROMPTS)] == want


def left_padded(prompts: list[list[int]]) -> tuple[np.ndarray, np.ndarray]:
    width = max(map(len, prompts))
    ids = np.zeros((len(prompts), width), np.int64)
    mask = np.zeros_like(ids)
    for r, p in enumerate(prompts):
        ids[r, width - len(p):] = p
        mask[r, width - len(p):] = 1
    return ids, mask


def decode(backend, model, ids, mask, cache, steps: int, tol: float = 0.1) -> None:
    """Greedy steps from `cache`, each step's logits checked against PyTorch's no-cache forward of the whole rows."""
    logits = None
    for _ in range(steps):
        want = full_forward(model, ids, mask)
        if logits is not None:
            assert rel(want, logits) < tol
        tok = want.argmax(-1)[:, None]
        ids, mask = np.concatenate([ids, tok], 1), np.concatenate([mask, np.ones_like(tok)], 1)
        logits, cache = backend.step(tok, mask, positions(mask, 1), cache)
    assert rel(full_forward(model, ids, mask), logits) < tol
    return ids, mask, cache


def test_a_left_padded_batch_then_decode_on_onnx_runtime(tiny, hybrid):
    model, _ = tiny
    ids, mask = left_padded(PROMPTS)
    logits, cache = hybrid.step(ids, mask, positions(mask, ids.shape[1]), None)
    assert type(cache).__name__ == "InPlaceCache" and cache.rows == 3 and cache.length == ids.shape[1]
    assert rel(full_forward(model, ids, mask), logits) < 0.1
    decode(hybrid, model, ids, mask, cache, 6)


def test_join_merge_and_truncate_after_an_openvino_prefill(tiny, hybrid):
    """A running row (OpenVINO's prefill, decoded), a row joining it (OpenVINO's prefill), merged right-aligned; then
    decoded, rolled back and decoded again: every step as PyTorch's forward of the whole rows."""
    model, _ = tiny
    a_ids, a_mask = left_padded(PROMPTS[:1])
    _, a_cache = hybrid.step(a_ids, a_mask, positions(a_mask, a_ids.shape[1]), None)
    a_ids, a_mask, a_cache = decode(hybrid, model, a_ids, a_mask, a_cache, 3)
    b_ids, b_mask = left_padded(PROMPTS[2:])
    _, b_cache = hybrid.step(b_ids, b_mask, positions(b_mask, b_ids.shape[1]), None)
    width = max(a_ids.shape[1], b_ids.shape[1])
    merged = a_cache.merge(np.array([0, 1]), b_cache, width)
    ids, mask = left_padded([list(a_ids[0]), list(b_ids[0])])
    assert merged.rows == 2 and merged.length == width
    ids, mask, cache = decode(hybrid, model, ids, mask, merged, 4)
    back = cache.truncate(cache.length - 2)
    decode(hybrid, model, ids[:, :-2], mask[:, :-2], back, 3)


def test_an_fp32_exports_prefill_then_decode_is_pytorchs_without_a_cache(tiny_export):
    """fp32: OpenVINO writes its presents straight into a growing cache's arrays; a second prefill leaves the first
    one's cache as it was; every logit within fp32's gate of PyTorch's (TOLERANCES[fp32].max_rel, 1e-4)."""
    model, _, info = tiny_export(Precision.fp32, openvino_prefill=True)
    assert info.prefill is not None, info.meta.get("openvino_prefill")
    with OrtBackend(info, threads=1, prefill="openvino", in_place_kv=False) as fp32:
        assert fp32.prefill_precision == "f32"
        ids, mask = left_padded(PROMPTS)
        logits, cache = fp32.step(ids, mask, positions(mask, ids.shape[1]), None)
        assert type(cache).__name__ == "GrowingCache" and cache.length == ids.shape[1]
        other, other_mask = left_padded([PROMPTS[1] * 5])
        fp32.step(other, other_mask, positions(other_mask, other.shape[1]), None)
        assert rel(full_forward(model, ids, mask), logits) < 1e-4
        decode(fp32, model, ids, mask, cache, 5, tol=1e-4)
        s = SamplingSettings(max_new_tokens=12, greedy=True, ignore_eos=True)
        [got] = generate(fp32, [""], s, prompt_ids=[PROMPTS[2]])
        assert got.tokens == torch_greedy(model, PROMPTS[2], 12)


def chunked(backend, ids, mask, sizes: list[int]):
    """The prompt's prefill in chunks of `sizes` columns (the first fresh, each next on the past so far): the last
    chunk's logits and the cache."""
    cache, done = None, 0
    for n in sizes:
        done += n
        logits, cache = backend.step(ids[:, done - n : done], mask[:, :done], positions(mask[:, :done], n), cache)
    assert done == ids.shape[1]
    return logits, cache


def test_an_fp32_prompt_chunked_on_openvinos_past_then_decoded_is_pytorchs_without_a_cache(tiny_export):
    """fp32, in place: each chunk after the first reads the past OpenVINO and ONNX Runtime wrote into the buffers and
    writes its own positions after it, for a left-padded batch (its padding in the first chunk); every logit within
    fp32's gate of PyTorch's forward of the whole rows."""
    model, _, info = tiny_export(Precision.fp32, openvino_prefill=True)
    with OrtBackend(info, threads=1, prefill="openvino") as fp32:
        assert fp32.in_place_kv and fp32.prefill_past_from == 2
        calls = []
        real = fp32._openvino_prefill
        fp32._openvino_prefill = lambda *a, **k: calls.append(k.get("past", 0)) or real(*a, **k)
        ids, mask = left_padded([PROMPTS[2] * 3, PROMPTS[0] * 4])  # 33 and 20 tokens
        logits, cache = chunked(fp32, ids, mask, [8, 16, 9])
        assert calls == [0, 8, 24] and type(cache).__name__ == "InPlaceCache" and cache.length == 33
        assert rel(full_forward(model, ids, mask), logits) < 1e-4
        ids, mask, cache = decode(fp32, model, ids, mask, cache, 4, tol=1e-4)
        mask = np.ones((1, cache.length + 2), np.int64)
        with pytest.raises(ValueError, match="holds 2 rows; the step has 1"):
            fp32.step(np.array([[5, 6]]), mask, positions(mask, 2), cache)


def test_once_every_f32_graph_is_compiled_the_graphs_weights_file_is_no_longer_mapped(tiny_export):
    """The graph read from openvino/prefill.bin maps that file (as large as the model's weights); the fresh and the
    on-a-past graphs compiled at f32 hold weights of their own, so once both are, the process maps it no more (its
    prefills still PyTorch's within fp32's gate)."""
    import gc

    model, _, info = tiny_export(Precision.fp32, openvino_prefill=True)
    weights = str((info.folder / "openvino" / "prefill.bin").resolve())

    def mapped() -> bool:
        gc.collect()
        with open("/proc/self/maps", encoding="utf-8") as f:
            return any(line.rstrip().endswith(weights) for line in f)

    with OrtBackend(info, threads=1, prefill="openvino") as fp32:
        assert fp32._openvino_prefill.compiled is not None and mapped()  # the fresh graph alone
        fp32.warm_up()
        assert set(fp32._openvino_prefill._graphs) == {("f32", False), ("f32", True)} and not mapped()
        ids, mask = left_padded(PROMPTS)
        logits, cache = chunked(fp32, ids, mask, [3, ids.shape[1] - 3])
        assert rel(full_forward(model, ids, mask), logits) < 1e-4 and not mapped()


def test_the_openvino_backend_steps_on_an_fp32_exports_graph_with_its_attention_on_a_past_apart(tiny_export):
    """The openvino backend on an fp32 export with the graph: prompts, their next chunks and decode steps all on it, its
    attention on a past rewritten to read the past where it lies (no concatenation of the past and the new positions
    left, each present the new positions themselves), through a growth of the buffers, for a left-padded batch; every
    logit within fp32's gate of PyTorch's forward of the whole rows, and model.onnx compiled only for `run`."""
    from collections import Counter

    import openvino as ov

    from gpt2x.runtime.openvino import OpenVinoBackend
    from gpt2x.runtime.openvino_prefill import attend_past_apart

    model, _, info = tiny_export(Precision.fp32, openvino_prefill=True)
    graph = ov.Core().read_model(str(info.prefill_path))
    apart = attend_past_apart(graph)
    before, after = (Counter(op.get_type_name() for op in g.get_ordered_ops()) for g in (graph, apart))
    assert before["ScaledDotProductAttention"] >= 1 and after["ScaledDotProductAttention"] == 0
    assert all(r.input_value(0).get_node().get_type_name() != "Slice" for r in apart.get_results())
    # no concatenation along the positions left: the past is read where it lies
    assert not [op for op in apart.get_ordered_ops() if op.get_type_name() == "Concat" and op.get_attributes()["axis"] in (2, -2)
                and len(op.get_output_partial_shape(0)) == 4]
    with OpenVinoBackend(info, threads=1) as backend:
        assert backend.decodes_on_graph and backend._full is None
        ids, mask = left_padded([PROMPTS[2] * 3, PROMPTS[0] * 4])  # 33 and 20 tokens
        logits, cache = chunked(backend, ids, mask, [8, 16, 9])
        assert backend.prefill_steps == 3 and rel(full_forward(model, ids, mask), logits) < 1e-4
        capacity = cache.capacity
        ids, mask, cache = decode(backend, model, ids, mask, cache, capacity - cache.length + 2, tol=1e-4)
        assert cache.capacity > capacity and backend._full is None
        every, _ = backend.run(ids[:, :5], mask[:, :5], positions(mask[:, :5], 5), None)
        assert backend._full is not None and every.shape == (2, 5, model.config.vocab_size)


def test_an_int8_batch_chunked_on_a_past_is_the_whole_prompts_prefill(tiny, hybrid):
    """int8: a left-padded batch prefilled in chunks on OpenVINO gives the logits of its prefill in one (to the
    rounding of a different split) and the same next tokens; then every decode step on ONNX Runtime is within int8's
    gate of PyTorch's forward of the whole rows."""
    model, _ = tiny
    ids, mask = left_padded([PROMPTS[2] * 2, PROMPTS[1] * 3])
    whole, _ = hybrid.step(ids, mask, positions(mask, ids.shape[1]), None)
    logits, cache = chunked(hybrid, ids, mask, [5, 12, 5])
    assert rel(whole, logits) < 1e-3 and np.array_equal(whole.argmax(-1), logits.argmax(-1))
    assert rel(full_forward(model, ids, mask), logits) < 0.1
    decode(hybrid, model, ids, mask, cache, 6)


def test_an_export_whose_record_lists_no_past_runs_every_step_on_a_past_on_onnx_runtime(tiny):
    """Exports made before the graph took a past list three inputs: their chunks stay on ONNX Runtime."""
    _, info = tiny
    old = ExportInfo(info.folder, {**info.meta, "openvino_prefill": {**info.prefill, "inputs": ["input_ids", "attention_mask", "position_ids"]}})
    with OrtBackend(old, threads=1, prefill="openvino") as backend:
        assert backend.prefill == "openvino" and backend.prefill_past_from is None
        assert backend.prefill_runtime(8, 2, 16) == "onnxruntime"


def test_warm_up_compiles_every_graph_a_prefill_may_run(tiny, monkeypatch):
    """Fresh and on a past, at the record's one compute precision; none on a past where the record lists no past. Where
    nearly every prompt runs on OpenVINO, its fresh f32 graph is compiled beside the session (a bf16 one is warm_up's
    choice: folded or not)."""
    _, info = tiny
    monkeypatch.setattr("gpt2x.runtime.openvino_prefill.cpu_has_bf16", lambda: True)
    for precision in ("f32", "bf16"):
        record = {**info.prefill, "inference_precision": precision}
        with OrtBackend(ExportInfo(info.folder, {**info.meta, "openvino_prefill": record}), threads=1, prefill="openvino") as both:
            assert set(both._openvino_prefill._graphs) == ({("f32", False)} if precision == "f32" else set())
            both.warm_up()
            assert set(both._openvino_prefill._graphs) == {(precision, False), (precision, True)}
    record = {**info.prefill, "inputs": ["input_ids", "attention_mask", "position_ids"]}
    with OrtBackend(ExportInfo(info.folder, {**info.meta, "openvino_prefill": record}), threads=1, prefill="openvino") as fresh:
        fresh.warm_up()
        assert set(fresh._openvino_prefill._graphs) == {("f32", False)}


def test_a_server_runs_bf16_on_the_int8_weights_folded_where_the_export_gated_that(tiny, monkeypatch):
    """The int8 graph's weights are u8 constants; folded, none is left (f32 weights, the same values). A one-shot
    process compiles its bf16 graphs as they are (folding costs about 1 s on GPT-2 124M); warm_up (gpt2x serve's)
    compiles them from the folded graph, where the export's record says that passed the gate too; never the f32 ones."""
    import openvino as ov

    from gpt2x.runtime import openvino_prefill

    _, info = tiny
    graph = ov.Core().read_model(str(info.prefill_path))

    def weight_types(model):
        return {str(op.get_output_element_type(0)) for op in model.get_ops()
                if op.get_type_name() == "Constant" and len(op.get_output_partial_shape(0)) == 2}

    assert any("uint8" in t for t in weight_types(graph))
    folded = openvino_prefill._folded(graph)
    assert not any("int8" in t for t in weight_types(folded)) and any("float32" in t for t in weight_types(folded))
    assert any("uint8" in t for t in weight_types(graph))  # the graph itself is left as it was
    calls = []
    real = openvino_prefill._folded
    monkeypatch.setattr(openvino_prefill, "_folded", lambda m: calls.append(m) or real(m))
    monkeypatch.setattr(openvino_prefill, "cpu_has_bf16", lambda: True)

    def with_folded(status):
        return ExportInfo(info.folder, {**info.meta, "openvino_prefill": {**info.prefill, "inference_precision": "bf16",
                                                                         "bf16_folded": {"status": status, "message": ""}}})

    with OrtBackend(with_folded("passed"), threads=1, prefill="openvino") as one_shot:
        one_shot._openvino_prefill._graph("bf16", True)
        assert calls == []
    with OrtBackend(with_folded("passed"), threads=1, prefill="openvino") as served:
        served.warm_up()
        assert len(calls) == 2 and served._openvino_prefill.fold_bf16  # bf16, fresh and on a past
    calls.clear()
    with OrtBackend(with_folded("failed"), threads=1, prefill="openvino") as ungated:
        ungated.warm_up()
        assert calls == [] and not ungated._openvino_prefill.fold_bf16


def compiled_precision(backend: OrtBackend) -> str:
    """The compute precision OpenVINO compiled the prefill graph at, as OpenVINO reports it."""
    return backend._openvino_prefill.compiled.get_property("INFERENCE_PRECISION_HINT").get_type_name()


def test_the_records_compute_precision_is_honoured_and_bf16_falls_back_to_f32_without_it(tiny, monkeypatch):
    """bf16 where the record chose it and the CPU has it (its logits then differ from f32 compute's, within int8's
    gate); f32 on a CPU without bf16, where every bf16 record's f32 fallback passed the gate too."""
    from gpt2x.evaluate.prefill import at_compute
    from gpt2x.runtime import openvino_prefill

    model, info = tiny
    ids, mask = left_padded(PROMPTS)
    pos = positions(mask, ids.shape[1])
    with OrtBackend(at_compute(info, "f32"), threads=1, prefill="openvino") as f32:
        assert f32.prefill_precision == compiled_precision(f32) == "f32"
        want = f32.step(ids, mask, pos, None)[0]
    if openvino_prefill.cpu_has_bf16():
        with OrtBackend(at_compute(info, "bf16"), threads=1, prefill="openvino") as bf16:
            assert bf16.prefill_precision == compiled_precision(bf16) == "bf16"
            got = bf16.step(ids, mask, pos, None)[0]
        assert 1e-5 < rel(want, got) < 0.1
    monkeypatch.setattr(openvino_prefill, "cpu_has_bf16", lambda: False)
    with OrtBackend(at_compute(info, "bf16"), threads=1, prefill="openvino") as fallback:
        assert fallback.prefill_precision == compiled_precision(fallback) == "f32"
        assert np.array_equal(fallback.step(ids, mask, pos, None)[0], want)


def test_a_bf16_record_runs_every_prefill_and_chunk_on_openvino_and_an_old_length_record_runs_f32(tiny, monkeypatch):
    """A record computing bf16 puts every prefill and every chunk on a past on OpenVINO whatever the timings said
    (ONNX Runtime computes f32: a timed route would give a prompt other numerics whole than chunked); an f32 record
    keeps its timed route. A record from before that rule, bf16 from a prompt length on, runs f32 at every size:
    its logits are f32's exactly."""
    from gpt2x.evaluate.prefill import at_compute
    from gpt2x.runtime import openvino_prefill

    _, info = tiny
    monkeypatch.setattr(openvino_prefill, "cpu_has_bf16", lambda: True)
    monkeypatch.setenv("GPT2X_PREFILL", "auto")  # the suite's default is onnxruntime (conftest)
    never = {"openvino_from": None, "past": {"openvino_from": None}}
    timed = ExportInfo(info.folder, {**info.meta, "openvino_prefill": {**info.prefill, "timing": never}})
    with OrtBackend(at_compute(timed, "bf16"), threads=1) as bf16:
        assert bf16.prefill_precision == "bf16" and (bf16.prefill_from, bf16.prefill_past_from) == (2, 2)
    with OrtBackend(at_compute(timed, "f32"), threads=1) as f32:
        assert f32.prefill_from is None and f32.prefill_past_from is None
    ids, mask = left_padded(PROMPTS)
    pos = positions(mask, ids.shape[1])
    old = ExportInfo(info.folder, {**info.meta, "openvino_prefill": {**info.prefill, "bf16_from": 2}})
    with OrtBackend(at_compute(info, "f32"), threads=1, prefill="openvino") as f32, \
            OrtBackend(old, threads=1, prefill="openvino") as legacy:
        assert legacy.prefill_precision == compiled_precision(legacy) == "f32"
        assert np.array_equal(legacy.step(ids, mask, pos, None)[0], f32.step(ids, mask, pos, None)[0])


def test_bf16_presents_are_widened_into_their_positions_of_the_cache_exactly():
    """bf16 bits by hand (1.0 is 0x3F80, -2.5 0xC020, 2**-10 0x3A80) into positions [2, 4) of rows [0, 2) of a
    float32 buffer of 3 rows x 6 positions: every other position and row left as it was."""
    import openvino as ov

    from gpt2x.runtime.openvino_prefill import widen

    bits = np.array([0x3F80, 0xC020, 0x3A80, 0x3F80], np.uint16).reshape(1, 1, 2, 2).repeat(2, axis=0)  # (2, H1, T2, D2)
    narrow = ov.Tensor(ov.Type.bf16, ov.Shape([2, 1, 2, 2]))
    narrow.data.view(np.uint16)[...] = bits
    buffer = np.full((3, 1, 6, 2), 7.0, np.float32)
    widen(narrow, buffer, 2, 2, 4)
    assert buffer[:2, 0, 2:4].tolist() == [[[1.0, -2.5], [2.0**-10, 1.0]]] * 2
    untouched = np.ones(buffer.shape, bool)
    untouched[:2, :, 2:4] = False
    assert (buffer[untouched] == 7.0).all()


def test_bf16_integers_are_stored_into_an_int8_cache_exactly():
    """cache_in_int8's bf16 presents hold integers: by hand, 3 is 0x4040, -128 0xC300, 127 0x42FE, -1 0xBF80, 0 0x0000;
    into positions [1, 3) of row 0 of an int8 buffer, the rest left as it was."""
    import openvino as ov

    from gpt2x.runtime.openvino_prefill import widen

    narrow = ov.Tensor(ov.Type.bf16, ov.Shape([1, 1, 2, 3]))
    narrow.data.view(np.uint16)[...] = np.array([0x4040, 0xC300, 0x42FE, 0xBF80, 0x0000, 0x4040], np.uint16).reshape(1, 1, 2, 3)
    buffer = np.full((2, 1, 4, 3), 9, np.int8)
    widen(narrow, buffer, 1, 1, 3)
    assert buffer[0, 0, 1:3].tolist() == [[3, -128, 127], [-1, 0, 3]]
    untouched = np.ones(buffer.shape, bool)
    untouched[0, :, 1:3] = False
    assert (buffer[untouched] == 9).all()


def test_run_and_one_token_steps_stay_on_onnx_runtime_and_a_chunk_on_a_past_runs_on_openvino(tiny, hybrid, monkeypatch):
    calls = []
    real = hybrid._openvino_prefill
    monkeypatch.setattr(hybrid, "_openvino_prefill", lambda *a, **k: calls.append((a[0].shape, k.get("past", 0))) or real(*a, **k))
    ids, mask = left_padded(PROMPTS[:1])
    hybrid.run(ids, mask, positions(mask, ids.shape[1]), None)
    assert calls == []
    _, cache = hybrid.step(ids, mask, positions(mask, ids.shape[1]), None)
    assert calls == [(ids.shape, 0)]
    mask = np.ones((1, ids.shape[1] + 2), np.int64)
    _, cache = hybrid.step(np.array([[5, 6]]), mask, positions(mask, 2), cache)
    assert calls[1:] == [((1, 2), ids.shape[1])]  # the graph reads the 5 positions held
    mask = np.ones((1, ids.shape[1] + 3), np.int64)
    hybrid.step(np.array([[7]]), mask, positions(mask, 1), cache)  # a decode step
    assert len(calls) == 2


def with_timing(info: ExportInfo, openvino_from) -> ExportInfo:
    record = dict(info.prefill, timing={**info.prefill["timing"], "openvino_from": openvino_from})
    return ExportInfo(info.folder, {**info.meta, "openvino_prefill": record})


def test_auto_follows_the_exports_measured_figures(tiny, monkeypatch):
    _, info = tiny
    monkeypatch.delenv("GPT2X_PREFILL", raising=False)
    timing = info.prefill["timing"]
    assert len(timing["lengths"]) == len(timing["onnxruntime_ms"]) == len(timing["openvino_ms"]) == 3  # 8, 32, the context
    with OrtBackend(with_timing(info, None), threads=1) as slower:
        assert slower.prefill == "onnxruntime"
    with OrtBackend(with_timing(info, 8), threads=1) as from8:
        assert from8.prefill == "openvino" and from8.prefill_from == 8
        assert [from8.prefill_runtime(n) for n in (7, 8)] == ["onnxruntime", "openvino"]  # what the bench records
        assert [from8.prefill_runtime(n, rows=2) for n in (3, 4)] == ["onnxruntime", "openvino"]  # by rows x length
        calls = []
        real = from8._openvino_prefill
        from8._openvino_prefill = lambda *a: calls.append(a[0].shape) or real(*a)
        for prompt in PROMPTS:
            ids, mask = left_padded([prompt])
            from8.step(ids, mask, positions(mask, ids.shape[1]), None)
        assert calls == [(1, 11)]  # the 11-token prompt only
        ids, mask = left_padded(PROMPTS[:1] * 2)  # two rows of the 5-token prompt: 10 tokens
        cfg = info.config
        want = real(ids, mask, positions(mask, 5), [np.empty((2, cfg.n_head, 5, cfg.head_dim), np.float32)
                                                     for _ in range(2 * cfg.n_layer)])
        got, _ = from8.step(ids, mask, positions(mask, 5), None)
        assert calls[1:] == [(2, 5)] and np.array_equal(got, want)
    monkeypatch.setenv("GPT2X_PREFILL", "onnxruntime")  # the CLI's --prefill sets it
    with OrtBackend(with_timing(info, 2), threads=1) as forced:
        assert forced.prefill == "onnxruntime"


def test_a_caller_whose_steps_all_run_on_onnx_runtime_never_opens_openvino_and_a_longer_one_opens_it_then(tiny, monkeypatch):
    """`prefill_tokens` below the record's route (a one-shot process's short prompt): OpenVINO's prefill is not opened
    beside the session (its thread would slow the session's creation), and a step that does run there opens it then,
    giving what a backend that opened it at start gives. At or above the route, it is opened at start."""
    import gpt2x.runtime.ort as ort_module

    _, info = tiny
    monkeypatch.delenv("GPT2X_PREFILL", raising=False)
    opened = []
    real_open = ort_module._open_openvino_prefill
    monkeypatch.setattr(ort_module, "_open_openvino_prefill", lambda *a: opened.append(a[-1]) or real_open(*a))
    timing = info.prefill["timing"]
    record = ExportInfo(info.folder, {**info.meta, "openvino_prefill": dict(info.prefill, timing={
        **timing, "openvino_from": 8, "past": {**timing["past"], "openvino_from": 8}})})
    ids, mask = left_padded([PROMPTS[0]])  # 5 tokens: ONNX Runtime's
    long_ids, long_mask = left_padded([PROMPTS[2]])  # 11: OpenVINO's
    with OrtBackend(record, threads=1) as eager:
        assert opened == [True]  # on its thread, compiled there (8 <= PREPARE_PREFILL_FROM)
        want, _ = eager.step(long_ids, long_mask, positions(long_mask, 11), None)
    opened.clear()
    with OrtBackend(record, threads=1, prefill_tokens=7) as later:
        assert later.prefill_runtime(7) == "onnxruntime" and later.prefill_runtime(11) == "openvino"
        later.step(ids, mask, positions(mask, 5), None)
        assert opened == []
        got, _ = later.step(long_ids, long_mask, positions(long_mask, 11), None)
        assert opened == [False] and np.array_equal(got, want)
    with OrtBackend(record, threads=1, prefill_tokens=8):
        assert opened == [False, True]


# `gpt2x generate` in a process of its own that says on stderr, at exit, whether openvino was imported.
IMPORTS_OPENVINO = """
import runpy, sys
sys.argv = ["gpt2x", *sys.argv[1:]]
try:
    runpy.run_module("gpt2x", run_name="__main__")
finally:
    print("openvino imported:", "openvino" in sys.modules, file=sys.stderr)
"""


def test_generate_with_a_short_prompt_never_imports_openvino_and_a_long_one_prefills_there(tiny, tmp_path):
    """A one-shot `gpt2x generate` whose prompt is shorter than where its export runs prefills on OpenVINO does not
    import openvino (0.15 s of a core, beside the session's creation); a prompt long enough does, and its greedy
    tokens are PyTorch's without a cache."""
    import json
    import shutil
    import subprocess
    import sys

    model, info = tiny
    folder = tmp_path / "export"
    shutil.copytree(info.folder, folder)
    meta = json.loads((folder / "gpt2x.json").read_text(encoding="utf-8"))
    timing = meta["openvino_prefill"]["timing"]
    timing["openvino_from"] = timing["past"]["openvino_from"] = 8
    (folder / "gpt2x.json").write_text(json.dumps(meta), encoding="utf-8")
    env = {k: v for k, v in os.environ.items() if k != "GPT2X_PREFILL"}
    for prompt, imported in (("Hi", False), ("ROMEO: But soft, what light through yonder window", True)):
        r = subprocess.run([sys.executable, "-c", IMPORTS_OPENVINO, "--quiet", "generate", prompt, "--onnx", str(folder),
                            "--greedy", "--max-new-tokens", "3", "--json"], capture_output=True, text=True, env=env,
                           encoding="utf-8", timeout=300)
        assert r.returncode == 0 and r.stderr.splitlines()[-1] == f"openvino imported: {imported}", r.stderr
        out = json.loads(r.stdout)
        assert out["tokens"] == torch_greedy(model, out["prompt_tokens"], 3) and len(out["prompt_tokens"]) >= 8 * imported


# The times an int8 GPT-2 124M export recorded on an Intel Xeon (one row; ms at 32 and 256 tokens).
XEON_TIMING = {"batch": 1, "lengths": [32, 256], "onnxruntime_ms": [26.7, 178.2], "openvino_ms": [17.1, 73.6]}


def test_prefill_estimates_follow_the_records_lines():
    """estimate_ms: the line through the record's two times, by hand: OpenVINO's 17.1 + (73.6 - 17.1) / 224 ms a
    token past 32, ONNX Runtime's 26.7 + (178.2 - 26.7) / 224."""
    assert estimate_ms(XEON_TIMING, PrefillChoice.openvino, 480) == pytest.approx(17.1 + 56.5 / 224 * 448)  # 130.1
    assert estimate_ms(XEON_TIMING, PrefillChoice.onnxruntime, 240) == pytest.approx(26.7 + 151.5 / 224 * 208)  # 167.4
    assert estimate_ms(XEON_TIMING, PrefillChoice.onnxruntime, 1) == pytest.approx(26.7 - 151.5 / 224 * 31)
    assert estimate_ms(None, PrefillChoice.openvino, 32) is None
    assert estimate_ms({"lengths": [32], "openvino_ms": [17.1]}, PrefillChoice.openvino, 32) is None


# Chunks on a 256-token past as an export records them (`timing["past"]`; figures of the Xeon's order, by hand).
XEON_PAST = {"past": 256, "lengths": [32, 256], "onnxruntime_ms": [30.0, 153.5], "openvino_ms": [36.0, 73.5],
             "openvino_from": 256}


def test_a_backend_estimates_a_prompt_on_the_runtime_that_runs_it(tiny, tiny_export):
    """OrtBackend.prefill_ms: a fresh prompt on the line of the runtime that runs it (OpenVINO from 8 tokens here), a
    prompt on a past on the line of the chunks timed on a past (OpenVINO from 256 new tokens); an export that timed
    no past (made before its graph took one) runs a past on ONNX Runtime, on the fresh line; no estimate without an
    OpenVINO prefill."""
    _, info = tiny
    timed = with_timing(info, 8)
    timed.meta["openvino_prefill"]["timing"].update(XEON_TIMING, past=XEON_PAST)
    with OrtBackend(timed, threads=1, prefill="auto") as backend:
        assert backend.prefill_ms(15, 32, 0) == pytest.approx(estimate_ms(XEON_TIMING, PrefillChoice.openvino, 480))
        assert backend.prefill_ms(1, 4, 0) == pytest.approx(estimate_ms(XEON_TIMING, PrefillChoice.onnxruntime, 4))
        assert backend.prefill_past_from == 256
        assert backend.prefill_ms(15, 16, 16) == pytest.approx(30.0 + 123.5 / 224 * 208)  # 240 tokens: ONNX Runtime
        assert backend.prefill_ms(2, 128, 16) == pytest.approx(73.5)  # 256 tokens: OpenVINO
        assert [backend.prefill_runtime(n, 2, 16) for n in (127, 128)] == ["onnxruntime", "openvino"]
        assert backend.prefill_runtime(1, 300, 16) == "onnxruntime"  # one token a row: a decode step
    del timed.meta["openvino_prefill"]["timing"]["past"]
    with OrtBackend(timed, threads=1, prefill="auto") as before:
        assert before.prefill_past_from is None and before.prefill_runtime(128, 2, 16) == "onnxruntime"
        assert before.prefill_ms(15, 16, 16) == pytest.approx(estimate_ms(XEON_TIMING, PrefillChoice.onnxruntime, 240))
        assert before.prefill_ms(15, 16, 16) > before.prefill_ms(15, 32, 0)  # the measured case: 250 ms against 140
    with OrtBackend(tiny_export(Precision.int8)[2], threads=1) as plain:
        assert plain.prefill_ms(15, 16, 16) is None


def test_the_fixed_slots_estimate_a_prompt_as_they_run_it(tiny, tiny_export):
    """SlotBackend.prefill_ms, for the scheduler's prefix-cache policy: fresh prompts together on the line of the
    runtime that runs them (OpenVINO from 8 tokens here), rows on a past together on OpenVINO's line of chunks on a past
    from its 256 new tokens, below that each alone, on ONNX Runtime's line; no estimate without an OpenVINO prefill."""
    from gpt2x.runtime.static_decode import SlotBackend

    _, info = tiny
    timed = with_timing(info, 8)
    timed.meta["openvino_prefill"]["timing"].update(XEON_TIMING, past=XEON_PAST)
    slots = SlotBackend(timed, threads=1, slots=2, capacity=32, prefill="auto")
    assert slots.capabilities.estimates_prefill
    assert slots.prefill_ms(15, 32, 0) == pytest.approx(estimate_ms(XEON_TIMING, PrefillChoice.openvino, 480))
    assert slots.prefill_ms(1, 4, 0) == pytest.approx(estimate_ms(XEON_TIMING, PrefillChoice.onnxruntime, 4))
    assert slots.prefill_ms(15, 16, 16) == pytest.approx(15 * (30.0 + 123.5 / 224 * (16 - 32)))  # 15 rows alone
    assert slots.prefill_ms(2, 128, 16) == pytest.approx(73.5)  # 256 tokens: together on OpenVINO
    assert SlotBackend(tiny_export(Precision.int8)[2], threads=1, slots=2, capacity=32).prefill_ms(15, 16, 16) is None


def test_openvino_forced_where_it_cannot_run_and_bad_values_are_one_error(tiny, tiny_export):
    _, info = tiny
    with pytest.raises(UsageError, match="prefill: 'fast' is not one of auto, onnxruntime, openvino"):
        OrtBackend(info, threads=1, prefill="fast")
    fp32 = tiny_export(Precision.fp32)[2]
    with pytest.raises(ProviderError, match="has no OpenVINO prefill graph"):
        OrtBackend(fp32, threads=1, prefill="openvino")
    with OrtBackend(fp32, threads=1) as auto:
        assert auto.prefill == "onnxruntime"


@pytest.mark.parametrize("command", [("generate", "hi"), ("bench",), ("serve",)])
def test_a_bad_prefill_flag_is_one_line_and_exit_2(command, tmp_path):
    r = run_gpt2x(*command, "--prefill", "fast", cwd=tmp_path, blocked=False)
    assert r.returncode == 2
    assert r.stderr.strip().splitlines() == ["error: --prefill: 'fast' is not one of auto, onnxruntime, openvino "
                                             "(the choice or GPT2X_PREFILL)"]


def test_openvino_opened_beside_the_session_is_checked_without_importing_it_and_fails_in_one_line(tiny, monkeypatch):
    """Whether openvino is there is asked of the import system, not by importing it (0.2-0.3 s of a fresh process's
    start, now on the prefill's own thread): blocked, every prompt is prefilled on ONNX Runtime; importable but
    broken, the first prefill raises one ProviderError naming it, where the thread's ImportError would be a traceback."""
    import sys

    _, info = tiny
    monkeypatch.setitem(sys.modules, "openvino", None)  # as an environment without it
    with OrtBackend(info, threads=1) as without:
        assert without.prefill == "onnxruntime" and without.prefill_from is None
    monkeypatch.delitem(sys.modules, "openvino")
    monkeypatch.setitem(sys.modules, "gpt2x.runtime.openvino_prefill", None)  # its import fails on the thread
    with OrtBackend(info, threads=1, prefill="openvino") as broken:
        assert broken.prefill == "openvino"  # the record's route, the graph not opened yet
        ids = np.arange(1, 9)[None]
        mask = np.ones_like(ids)
        for _ in range(2):  # and again at the next prompt, not a NoneType error
            with pytest.raises(ProviderError, match="cannot run the prefill on OpenVINO: openvino does not import"):
                broken.step(ids, mask, positions(mask, 8), None)
