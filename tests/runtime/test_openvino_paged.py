"""The openvino backend's paged slots (runtime/openvino_paged.py): OpenVINO's paged attention on the export's prefill
graph, checked against PyTorch's forward without a cache, row by row: prompts of several lengths packed in one forward,
chunks on a past, decode steps, a chunk inside a decode step's forward, a slot written, read and copied; greedy
generation through the Backend protocol and the serving engine; bf16 against the openvino backend's gated bf16; when
a server takes them."""

from __future__ import annotations

import sys
import threading

import numpy as np
import pytest
import torch

from gpt2x.choices import BackendKind, KvCache, Precision, ProviderKind
from gpt2x.errors import ArtifactError, ProviderError, UsageError
from gpt2x.evaluate import parity
from gpt2x.generation.generate import generate
from gpt2x.generation.settings import SamplingSettings
from gpt2x.numerics import positions
from gpt2x.onnx.artifact import ExportInfo
from gpt2x.runtime.base import bf16_values
from gpt2x.runtime.kvdtype import KV_DTYPE_ENV
from gpt2x.runtime.openvino import OpenVinoBackend
from gpt2x.runtime.openvino_paged import (
    PagedDecoder,
    PagedSlotBackend,
    paged_by_default,
    paged_kv_precision,
    paged_over_ort,
    paged_refusal,
)
from gpt2x.runtime.openvino_prefill import cpu_has_bf16
from gpt2x.serve.core.engine import Engine, EngineSettings, Row
from gpt2x.serve.core.outputs import Failed, Finished, TokenOut
from gpt2x.serve.replica import ReplicaConfig, on_slots

PROMPTS = [[464, 3616, 286, 1204, 318], [50, 2662], [4944, 46, 25, 198, 13, 11, 8, 1000, 3, 77, 5, 9, 40, 41]]
TOL = 1e-4  # fp32's gate (parity.TOLERANCES[fp32].max_rel)


@pytest.fixture(scope="module")
def fp32(tiny_export):
    """The tiny model and its fp32 export with its OpenVINO prefill graph (block size 32 > its longest row here)."""
    model, _, info = tiny_export(Precision.fp32, openvino_prefill=True)
    assert info.prefill is not None, info.meta.get("openvino_prefill")
    return model, info


def forward(model, ids: list[int], every: bool = False) -> np.ndarray:
    """PyTorch's logits of one whole sequence, no cache: the last position's, or every position's."""
    with torch.no_grad():
        logits, _ = model(torch.tensor([ids]), torch.ones(1, len(ids), dtype=torch.long), torch.arange(len(ids))[None])
    return logits[0].numpy() if every else logits[0, -1].numpy()


def close(ref: np.ndarray, got: np.ndarray, tol: float = TOL) -> bool:
    return float(np.abs(ref - got).max() / np.abs(ref).max()) < tol


def torch_greedy(model, prompt: list[int], n: int) -> list[int]:
    ids = list(prompt)
    for _ in range(n):
        ids.append(int(forward(model, ids).argmax()))
    return ids[len(prompt):]


def test_packed_prompts_chunks_decode_and_mixed_steps_are_pytorchs_without_a_cache(fp32):
    """Every forward packs its rows, each at its own length: two prompts of different lengths (left-padded, the
    padding not run), a chunk on one row's past beside a fresh prompt, a decode step of three rows, then one with
    another prompt's chunk in its forward; each row's logits within fp32's gate of the whole sequence's forward."""
    model, info = fp32
    dec = PagedDecoder(info, slots=4, capacity=64, threads=1)
    rows = {0: list(PROMPTS[0]), 1: list(PROMPTS[1])}
    width = max(len(p) for p in rows.values())
    ids = np.array([[0] * (width - len(p)) + p for p in rows.values()])
    mask = np.array([[0] * (width - len(p)) + [1] * len(p) for p in rows.values()])
    logits = dec.prefill_fresh(np.array([0, 1]), ids, mask)
    for b, slot in enumerate((0, 1)):
        assert close(forward(model, rows[slot]), logits[b])
    assert dec.lengths[:2].tolist() == [5, 2]
    rows[1] += [7, 8, 9]
    rows[2] = PROMPTS[2][:6]
    logits = dec.prefill_held(np.array([1]), [np.array([7, 8, 9])])
    assert close(forward(model, rows[1]), logits[0])
    assert close(forward(model, rows[2]), dec.prefill(2, np.array(rows[2])))
    for _ in range(3):  # decode steps of three slots, each its own length
        tokens = np.zeros(4, np.int64)
        for slot, seq in rows.items():
            tokens[slot] = forward(model, seq).argmax()
        active = np.array([True, True, True, False])
        logits = dec.step(tokens, active, take=np.array([2, 0, 1]))
        for i, slot in enumerate((2, 0, 1)):
            rows[slot].append(int(tokens[slot]))
            assert close(forward(model, rows[slot]), logits[i])
    tokens = np.zeros(4, np.int64)
    for slot, seq in rows.items():
        tokens[slot] = forward(model, seq).argmax()
    assert dec.mixes(np.array([True, True, True, False]), 3, np.array(PROMPTS[0]))
    out, chunk = dec.step_mixed(tokens, np.array([True, True, True, False]), 3, np.array(PROMPTS[0]))
    assert dec.mixed_runs == 1
    for slot in (0, 1, 2):
        rows[slot].append(int(tokens[slot]))
        assert close(forward(model, rows[slot]), out[slot])
    assert close(forward(model, PROMPTS[0]), chunk)
    assert dec.lengths.tolist() == [len(rows[0]), len(rows[1]), len(rows[2]), len(PROMPTS[0])]


def test_openvinos_u8_kv_cache_holds_its_scales_in_the_blocks_and_stays_within_the_int8_kv_gate(fp32):
    """kv_cache_precision "u8" (OpenVINO GenAI's default cache): packed prompts, decode steps and a copied slot, each
    row's logits within the gate of an fp32 export's int8 KV cache (parity.INT8_KV_ON_FP32's max_rel) of PyTorch's
    forward without a cache; another precision is refused."""
    model, info = fp32
    tol = parity.INT8_KV_ON_FP32.max_rel
    dec = PagedDecoder(info, slots=3, capacity=64, threads=1, kv_cache_precision="u8")
    assert {a.dtype for a in dec._arrays} == {np.dtype(np.uint8)}
    key, value = dec._arrays[:2]  # scales beside the positions: the key's rows above them, the value's columns
    assert key.shape[2] > dec.block and value.shape[2] == dec.block and value.shape[3] > key.shape[3]
    rows = {0: list(PROMPTS[2]), 1: list(PROMPTS[0])}
    width = max(len(p) for p in rows.values())
    ids = np.array([[0] * (width - len(p)) + p for p in rows.values()])
    mask = np.array([[0] * (width - len(p)) + [1] * len(p) for p in rows.values()])
    logits = dec.prefill_fresh(np.array([0, 1]), ids, mask)
    assert all(close(forward(model, rows[s]), logits[s], tol) for s in (0, 1))
    dec.copy(0, 2)
    rows[2] = list(rows[0])
    for _ in range(3):
        tokens = np.array([forward(model, rows[s]).argmax() for s in range(3)])
        logits = dec.step(tokens, take=np.arange(3))
        for s in range(3):
            rows[s].append(int(tokens[s]))
            assert close(forward(model, rows[s]), logits[s], tol), s
    with pytest.raises(ValueError, match="kv_cache_precision"):
        PagedDecoder(info, slots=1, capacity=64, threads=1, kv_cache_precision="i4")


def test_a_u8_layout_gpt2x_does_not_read_is_one_line(fp32, monkeypatch):
    """The key's quantization is asked for by channel; where OpenVINO lays the cache out otherwise (here: asked by
    token), the slots refuse in one line rather than read its blocks wrong, and an export's gate records why; an
    OpenVINO that lacks the property is left to its own layout."""
    from gpt2x.evaluate.kvcache import gate_paged_int8_kv
    from gpt2x.runtime import openvino_paged
    from gpt2x.runtime.pytorch import TorchBackend

    monkeypatch.setattr(openvino_paged, "U8_KEY_BY", "BY_TOKEN")
    with pytest.raises(ProviderError, match="lays its u8 KV cache out as .* not as gpt2x reads it"):
        PagedDecoder(fp32[1], slots=1, capacity=64, threads=1, kv_cache_precision="u8")
    record = gate_paged_int8_kv(TorchBackend(fp32[0]), fp32[1], threads=1)  # the export goes on with ORT's cache alone
    assert record["kept"] is False and "not as gpt2x reads it" in record["reason"]
    # an OpenVINO without the property: the plugin's own layout, read where it is this one, else the same one line
    monkeypatch.setattr(openvino_paged, "U8_KEY_MODE", "GPT2X_NO_SUCH_PROPERTY")
    try:
        dec = PagedDecoder(fp32[1], slots=1, capacity=64, threads=1, kv_cache_precision="u8")
    except ProviderError as e:
        assert "not as gpt2x reads it" in str(e)
    else:
        assert dec.quantized_kv and len(dec.prefill(0, np.array(PROMPTS[0]))) == fp32[1].config.vocab_size


def test_a_u8_slot_reads_as_the_float_caches_values_and_a_past_written_into_it_decodes_on(fp32):
    """The u8 blocks OpenVINO wrote, read back (u8_values), are the float cache's keys and values within 2% (the first
    layer's, whose inputs are the same in both, within half a quantization step); those quantized here (u8_blocks) are
    OpenVINO's own blocks, code for code within one rounding; and a past written into a u8 slot (the prefix cache's
    blocks) decodes on within the int8 cache's gate of PyTorch's forward over the whole sequence."""
    from gpt2x.runtime.openvino_paged import u8_blocks

    model, info = fp32
    seq = list(range(200, 240))  # a whole block of 32 positions and 8 of the next
    u8 = PagedDecoder(info, slots=2, capacity=64, threads=1, kv_cache_precision="u8")
    floats = PagedDecoder(info, slots=2, capacity=64, threads=1)
    u8.prefill(0, np.array(seq))
    floats.prefill(0, np.array(seq))
    got, want = u8.read(0), floats.read(0)
    assert [a.dtype for a in got] == [np.dtype(np.float32)] * len(want) and got[0].shape == want[0].shape
    for i, (g, w) in enumerate(zip(got, want)):
        assert np.abs(g - w).max() <= 2e-2 * np.abs(w).max(), i
    for i, (g, w) in enumerate(zip(got[:2], want[:2])):  # the first layer's: its inputs the same in both caches
        key = i == 0
        for part in (slice(0, 32), slice(32, 40)):  # each block: a key's steps per channel over its positions
            x = w[:, part]
            step = np.ptp(x, axis=1 if key else 2, keepdims=True) / 255  # a value's per position over its channels
            assert (np.abs(g[:, part] - x) <= step * 0.5 + 1e-6).all(), (i, part)
        ours = u8_blocks(w[:, :32].reshape(w.shape[0], 1, 32, -1).transpose(1, 0, 2, 3), 32, key=key)
        theirs = u8._arrays[i][:1]
        codes = (Ellipsis, slice(8, None), slice(None)) if key else (Ellipsis, slice(8, None))
        assert ours.shape == theirs.shape and np.abs(ours[codes].astype(int) - theirs[codes].astype(int)).max() <= 1, i
    u8.write(1, want)  # the float cache's past into the other slot, quantized here
    assert u8.lengths[1] == len(seq)
    tol = parity.INT8_KV_ON_FP32.max_rel
    for _ in range(3):
        token = int(forward(model, seq).argmax())
        seq.append(token)
        logits = u8.step(np.array([0, token]), np.array([False, True]), take=np.array([1]))
        assert close(forward(model, seq), logits[0], tol)


def test_a_slot_written_read_and_copied_holds_the_same_sequence(fp32):
    """read() gives a slot's positions as (H, n, D); write() puts them into another slot's blocks and copy() a third,
    each then decoding as the first does; every-position logits of a prefill are PyTorch's at every position."""
    model, info = fp32
    dec = PagedDecoder(info, slots=3, capacity=64, threads=1)
    seq = PROMPTS[2]
    every = dec.prefill(0, np.array(seq), every=True)
    assert every.shape == (len(seq), model.config.vocab_size) and close(forward(model, seq, every=True), every)
    kv = dec.read(0)
    assert len(kv) == 2 * model.config.n_layer and kv[0].shape == (model.config.n_head, len(seq), model.config.n_embd // model.config.n_head)
    dec.write(1, kv)
    dec.copy(0, 2)
    assert [np.array_equal(a, b) for a, b in zip(dec.read(1), kv)] == [True] * len(kv)
    nxt = int(forward(model, seq).argmax())
    logits = dec.step(np.full(3, nxt), take=np.array([0, 1, 2]))
    want = forward(model, seq + [nxt])
    assert all(close(want, row) for row in logits)
    views = dec.views(0, 3, len(seq) + 1)
    assert views[0].shape[:3] == (3, model.config.n_head, len(seq) + 1)
    dec.release(1)
    assert dec.lengths.tolist() == [len(seq) + 1, 0, len(seq) + 1]
    with pytest.raises(ValueError, match="do not fit"):
        dec.prefill(0, np.arange(64 - len(seq)))


def test_generate_and_the_serving_engine_on_the_paged_slots_are_pytorchs_greedy_tokens(fp32):
    """Through the Backend protocol (generate: a left-padded batch, then its decode steps) and through the serving
    engine (rows submitted one after another join the running batch: their chunks run in decode steps' forwards; a
    prompt whose leading blocks a finished one left in the prefix cache), each row's greedy tokens are PyTorch's
    without a cache."""
    model, info = fp32
    backend = PagedSlotBackend(info, threads=1, slots=6, capacity=64)
    backend.warm_up()
    s = SamplingSettings(max_new_tokens=8, greedy=True, ignore_eos=True)
    got = generate(backend, ["", ""], s, prompt_ids=[PROMPTS[0], PROMPTS[1]])
    assert [g.tokens for g in got] == [torch_greedy(model, p, 8) for p in PROMPTS[:2]]
    engine = Engine(backend, EngineSettings(max_batch_size=3)).start()
    try:
        tokens: dict[int, list[int]] = {i: [] for i in range(5)}
        done = threading.Semaphore(0)
        errors: list[str] = []

        def sink_for(i: int):
            def sink(out) -> None:
                if isinstance(out, TokenOut):
                    tokens[i].append(out.token)
                elif isinstance(out, (Finished, Failed)):
                    errors.extend([out.message] if isinstance(out, Failed) else [])
                    done.release()
            return sink

        s = SamplingSettings(max_new_tokens=10, greedy=True, min_tokens=10)
        for i, prompt in enumerate(PROMPTS):
            engine.submit([Row(list(prompt), s, sink_for(i))])
        for _ in PROMPTS:
            assert done.acquire(timeout=120)
        assert not errors
        assert [tokens[i] for i in range(3)] == [torch_greedy(model, p, 10) for p in PROMPTS]
        # a prompt sharing a finished one's leading blocks: they come from the prefix cache, written into its slot
        shared = list(range(100, 140))
        rows = [Row(shared, s, sink_for(3)), Row(shared + [7, 8], s, sink_for(4))]
        for i, row in zip((3, 4), rows):
            tokens[i] = []
            engine.submit([row])
            assert done.acquire(timeout=120)
        assert not errors and rows[1].cached_tokens > 0
        assert [tokens[3], tokens[4]] == [torch_greedy(model, shared, 10), torch_greedy(model, shared + [7, 8], 10)]
    finally:
        engine.close()


@pytest.mark.skipif(not cpu_has_bf16(), reason="this CPU does not compute bf16")
def test_bf16_paged_slots_are_within_the_bf16_gate_of_pytorch(tiny_export):
    """A bf16 export's paged slots compute in bf16 with a bf16 cache: a prompt's and its next steps' logits within
    bf16's gate (parity.TOLERANCES[bf16].max_rel) of PyTorch's fp32, as the openvino backend's bf16 is; its cache read
    back as bf16 values. Served by default on the openvino backend."""
    model, _, info = tiny_export(Precision.bf16, openvino_prefill=True)
    assert info.prefill is not None, info.meta.get("openvino_prefill")
    tol = parity.TOLERANCES[Precision.bf16].max_rel
    dec = PagedDecoder(info, slots=2, capacity=64, threads=1)
    assert dec.dtype == np.uint16
    seq = list(PROMPTS[2])
    assert close(forward(model, seq), dec.prefill(0, np.array(seq)), tol)
    for _ in range(4):
        nxt = int(forward(model, seq).argmax())
        logits = dec.step(np.array([nxt, 0]), take=np.array([0]))
        seq.append(nxt)
        assert close(forward(model, seq), logits[0], tol)
    with torch.no_grad():
        _, presents = model(torch.tensor([seq[:-1]]), torch.ones(1, len(seq) - 1, dtype=torch.long),
                            torch.arange(len(seq) - 1)[None])
    key0 = bf16_values(dec.read(0)[0])[:, : len(seq) - 1]
    assert close(presents[0][0][0].numpy(), key0, tol)
    on_openvino = OpenVinoBackend(info, threads=1)
    ids = np.array([PROMPTS[2]])
    ours, _ = on_openvino.step(ids, np.ones_like(ids), positions(np.ones_like(ids), ids.shape[1]), None)
    assert close(ours[0], PagedDecoder(info, slots=1, capacity=64, threads=1).prefill(0, ids[0]), tol)
    assert paged_by_default(info, ProviderKind.cpu)
    assert on_slots(ReplicaConfig(export=str(info.folder), model_id="b", backend="openvino", fixed_slots=None), info)


def test_which_exports_the_paged_slots_serve_and_refuse(fp32, tiny_export, monkeypatch):
    """By default a bf16 export and an fp32 one with its prefill graph, which a server asked for no backend takes the
    openvino backend for (but with the cache in place, or --prefill, the ort backend's option, or where the fp32 export
    keeps an int8 KV cache, which only the ort backend's slots hold); an int8 export, or one with no prefill graph,
    refused in one line (its server on the ort backend); a graph OpenVINO's rewrite does not take, one line that names
    the way out; --kv-cache slots on the openvino backend refuses int8 before anything is opened."""
    import openvino._offline_transformations as passes

    from gpt2x.cli.options import refuse_kv_cache
    from gpt2x.onnx.artifact import KV_KEY
    from gpt2x.serve.replica import served_backend

    _, info = fp32
    assert paged_by_default(info, ProviderKind.cpu)
    config = ReplicaConfig(export=str(info.folder), model_id="m", backend=BackendKind.openvino.value, fixed_slots=None)
    assert on_slots(config, info)
    assert served_backend(info, ProviderKind.cpu) is BackendKind.openvino
    assert served_backend(info, ProviderKind.cpu, KvCache.slots) is BackendKind.openvino
    assert served_backend(info, ProviderKind.cpu, KvCache.in_place) is BackendKind.ort
    assert served_backend(info, ProviderKind.cpu, ort_asked=True) is BackendKind.ort
    assert served_backend(info, ProviderKind.cuda) is BackendKind.ort
    with monkeypatch.context() as m:  # an environment without openvino, the export made where it was
        m.setitem(sys.modules, "openvino", None)
        assert served_backend(info, ProviderKind.cpu) is BackendKind.ort
    int8_kv = ExportInfo(info.folder, {**info.meta, KV_KEY: {"kept": True, "use": True}})
    assert not paged_over_ort(int8_kv, ProviderKind.cpu) and served_backend(int8_kv, ProviderKind.cpu) is BackendKind.ort
    assert paged_by_default(int8_kv, ProviderKind.cpu)  # but --backend openvino serves it on its paged slots
    paged_u8 = ExportInfo(info.folder, {**info.meta, KV_KEY: {"kept": True, "use": True, "paged": {"kept": True}}})
    assert paged_over_ort(paged_u8, ProviderKind.cpu) and served_backend(paged_u8, ProviderKind.cpu) is BackendKind.openvino
    _, _, int8 = tiny_export(Precision.int8)
    assert "not int8" in paged_refusal(int8, ProviderKind.cpu)
    assert served_backend(int8, ProviderKind.cpu) is BackendKind.ort
    _, _, bare = tiny_export(Precision.fp32)
    assert "no OpenVINO prefill graph" in paged_refusal(bare, ProviderKind.cpu)
    assert served_backend(bare, ProviderKind.cpu) is BackendKind.ort
    with pytest.raises(ProviderError, match="no OpenVINO prefill graph"):
        PagedSlotBackend(bare, threads=1)
    assert "CPU" in paged_refusal(info, ProviderKind.cuda)
    old = ExportInfo(info.folder, {**info.meta, "openvino_prefill": {**info.prefill, "inputs": ["input_ids", "attention_mask", "position_ids"]}})
    assert "takes no past" in paged_refusal(old, ProviderKind.cpu)

    def refused(model):
        raise RuntimeError("Exception from src/core/src/pass/sdpa_to_paged_attention.cpp:76:\nModel is not stateful")

    with monkeypatch.context() as m:
        m.setattr(passes, "paged_attention_transformation", refused)
        with pytest.raises(ArtifactError, match=r"paged attention \(Model is not stateful\): serve it with --kv-cache in-place"):
            PagedSlotBackend(info, threads=1)
    with pytest.raises(UsageError, match="paged slots run fp32 and bf16 exports, not int8"):
        refuse_kv_cache(KvCache.slots, BackendKind.openvino, served=True, precision=Precision.int8)
    refuse_kv_cache(KvCache.in_place, BackendKind.openvino, served=True, precision=Precision.bf16)
    with pytest.raises(UsageError, match="applies to the ort backend"):
        refuse_kv_cache(KvCache.slots, BackendKind.openvino, served=False)


def test_a_server_asked_for_no_backend_serves_an_fp32_export_with_its_graph_on_the_paged_slots(fp32, capsys, monkeypatch):
    """`gpt2x serve --onnx` (in this process, the server replaced by a stand-in that keeps what it was given): the
    openvino backend, whose replica opens its paged slots; --prefill or --kv-cache-dtype on the command line (the ort
    backend's options, not their environment variables, but an int8 cache asked there, which only the ort backend
    holds), a draft (its model runs on the target's runtime), --kv-cache in-place or --backend ort keep the ort
    backend."""
    from gpt2x.serve.replica import open_backend

    from ..helpers import cli

    _, info = fp32
    served = []
    monkeypatch.setattr("gpt2x.serve.single_process.serve_in_process", lambda config, *a, **k: served.append(config))
    monkeypatch.setenv("GPT2X_PREFILL", "onnxruntime")
    monkeypatch.setenv(KV_DTYPE_ENV, "float")  # the option sets it for the process: restored after the test
    for args, backend in (([], "openvino"), (["--prefill", "onnxruntime"], "ort"), (["--kv-cache", "in-place"], "ort"),
                          (["--backend", "ort"], "ort"), (["--draft", "ngram", "--max-batch-size", "1"], "ort"),
                          (["--kv-cache-dtype", "float"], "ort")):
        code, _, err = cli(capsys, "serve", "--onnx", str(info.folder), "--threads", "1", *args)
        assert code in (0, None) and served[-1].backend == backend, (args, err)
        monkeypatch.setenv(KV_DTYPE_ENV, "float")
    monkeypatch.setenv(KV_DTYPE_ENV, "int8")
    code, _, err = cli(capsys, "serve", "--onnx", str(info.folder), "--threads", "1")
    assert code in (0, None) and served[-1].backend == "ort", err
    config = served[0]
    monkeypatch.setenv(KV_DTYPE_ENV, "auto")  # the replica's, started without the int8 asked above
    assert on_slots(config, info)
    with open_backend(config, info) as backend:
        assert isinstance(backend, PagedSlotBackend) and backend.capabilities.mixed_chunk == 24
        assert generate(backend, [""], SamplingSettings(max_new_tokens=6, greedy=True), prompt_ids=[PROMPTS[0]])[0].tokens == \
            torch_greedy(fp32[0], PROMPTS[0], 6)


def test_an_int8_kv_cache_asked_of_a_backend_that_holds_none_is_one_line(fp32, tiny_export, capsys, monkeypatch):
    """--kv-cache-dtype int8 is the ort backend's cache: `gpt2x serve` and `gpt2x generate` on the openvino backend (asked
    for, or a bf16 export's) refuse it in one line before anything is opened, where before they ran a float cache."""
    from ..helpers import assert_one_line_error, cli

    _, info = fp32
    monkeypatch.setattr("gpt2x.serve.single_process.serve_in_process", lambda *a, **k: pytest.fail("served"))
    monkeypatch.setenv(KV_DTYPE_ENV, "auto")  # the option sets it for the process: restored after the test
    exports = [(info, ["--backend", "openvino"])]
    if cpu_has_bf16():
        exports.append((tiny_export(Precision.bf16)[2], []))
    for export, args in exports:
        for command in ("serve", "generate"):
            code, out, err = cli(capsys, command, *(["ROMEO:"] if command == "generate" else []), "--onnx",
                                 str(export.folder), "--threads", "1", "--kv-cache-dtype", "int8", *args)
            assert_one_line_error(code, err, UsageError.exit_code, "--kv-cache-dtype int8 is the ort backend's cache")
            assert "the openvino backend keeps its own" in err and out == "", (command, args)


def test_several_joiners_chunks_run_in_the_decode_steps_one_forward(fp32, monkeypatch):
    """Two prompts held by step_later beside two rows decoding: the next decode step is one forward for all four (where
    ONNX Runtime's slots mix one chunk and run the other alone), each row's logits PyTorch's, the joiners' first
    tokens read from it (later_logits)."""
    model, info = fp32
    backend = PagedSlotBackend(info, threads=1, slots=6, capacity=64)
    forwards = []
    run = PagedDecoder._forward
    monkeypatch.setattr(PagedDecoder, "_forward", lambda self, rows, every=False: forwards.append(len(rows)) or run(self, rows, every))
    ids = np.array([PROMPTS[0]])
    logits, past = backend.step(ids, np.ones_like(ids), positions(np.ones_like(ids), ids.shape[1]), None)
    seq = list(PROMPTS[0])
    joiners = [PROMPTS[1], PROMPTS[2][:6]]
    width = max(map(len, joiners))
    j_ids = np.array([[0] * (width - len(p)) + p for p in joiners])
    j_mask = np.array([[0] * (width - len(p)) + [1] * len(p) for p in joiners])
    later = backend.step_later(j_ids, j_mask, positions(j_mask, width), None)
    nxt = int(forward(model, seq).argmax())
    mask = np.ones((1, len(seq) + 1), np.int64)
    logits, past = backend.step(np.array([[nxt]]), mask, np.array([[len(seq)]]), past)
    assert forwards == [1, 3] and backend.decoder.mixed_runs == 1
    assert close(forward(model, seq + [nxt]), logits[0])
    first = backend.later_logits(later)
    assert all(close(forward(model, p), row) for p, row in zip(joiners, first))


def test_the_cpu_flags_choose_the_paged_chunk(fp32, monkeypatch, tmp_path):
    """A bf16 joiner's chunk in the paged slots' decode step is 64 tokens on a CPU with AMX's bf16 tiles, 40 without them
    (AVX-512 BF16 alone, where a chunk's token costs the step several times more), 64 off x86; an fp32 one's 24 on any
    (f32 compute has no tiles); the backend says so."""
    from gpt2x.runtime import openvino_paged, providers

    here = "amx_bf16" in (providers.x86_flags() or {"amx_bf16"})  # this machine's, before the flags are faked
    cpuinfo, real = tmp_path / "cpuinfo", providers.Path
    monkeypatch.setattr(providers, "Path", lambda p: real(cpuinfo) if p == "/proc/cpuinfo" else real(p))
    monkeypatch.setattr(providers.platform, "machine", lambda: "x86_64")
    try:
        for flags, chunk in (("avx512f avx512_bf16 amx_bf16 amx_tile amx_int8", 64), ("avx512f avx512_bf16", 40),
                             ("avx2 fma", 40)):
            cpuinfo.write_text(f"processor\t: 0\nflags\t\t: {flags}\n")
            openvino_paged.paged_mixed_chunk.cache_clear()
            assert openvino_paged.paged_mixed_chunk() == chunk, flags
            assert openvino_paged.paged_mixed_chunk(Precision.fp32) == 24, flags
        monkeypatch.setattr(providers.platform, "machine", lambda: "aarch64")
        openvino_paged.paged_mixed_chunk.cache_clear()
        assert openvino_paged.paged_mixed_chunk() == 64
    finally:
        openvino_paged.paged_mixed_chunk.cache_clear()
    assert PagedSlotBackend.capabilities.mixed_chunk == (64 if here else 40)
    assert PagedSlotBackend(fp32[1], threads=1, slots=2, capacity=64).capabilities.mixed_chunk == 24


@pytest.fixture(scope="module")
def fp32_kv8(tiny_export):
    """The tiny model's fp32 export made with its int8 KV cache and its OpenVINO prefill graph (--int8-kv
    --openvino-prefill): ONNX Runtime's scales and OpenVINO's u8 cache on the paged slots, each gated."""
    model, _, info = tiny_export(Precision.fp32, openvino_prefill=True, int8_kv=True)
    assert info.prefill is not None and info.int8_kv is not None, info.meta.get("kv_cache")
    return model, info


def test_an_int8_kv_exports_u8_cache_on_the_paged_slots_is_gated_and_decodes_as_pytorch(fp32_kv8, fp32):
    """The export's gate ran OpenVINO's u8 cache on the paged slots through the int8 cache's parity and long checks
    (parity.INT8_KV_ON_FP32); the paged slots hold it by default there (float where asked), and each decode step's
    logits are within that gate of PyTorch's forward without a cache, off the float cache's by more than fp32's own
    gate (the cache is quantized, not passed through). Its cache takes no past made elsewhere, so no prefix cache: the
    serving engine keeps none and decodes PyTorch's greedy tokens. An int8 cache asked of an export without one: one
    line."""
    model, info = fp32_kv8
    record, tol = info.paged_int8_kv, parity.INT8_KV_ON_FP32
    assert record is not None and record["kv_cache_precision"] == "u8", info.int8_kv.get("paged")
    assert record["parity"]["status"] == "passed" and record["parity"]["tolerance"]["max_rel"] == tol.max_rel
    assert record["long"]["max_rel"] <= tol.max_rel and record["long"]["mean_kl"] <= tol.max_kl
    assert paged_kv_precision(info) == paged_kv_precision(info, "int8") == "u8"
    assert paged_kv_precision(info, "float") is None
    with pytest.raises(ProviderError, match="paged slots cannot hold an int8 KV cache"):
        paged_kv_precision(fp32[1], "int8")
    assert paged_kv_precision(fp32[1]) is None
    seq = list(PROMPTS[2])
    with PagedSlotBackend(info, threads=1, slots=4, capacity=64, kv_cache_precision=paged_kv_precision(info)) as u8, \
            PagedSlotBackend(info, threads=1, slots=4, capacity=64) as floats:
        assert u8.kv_dtype == floats.kv_dtype == np.float32  # as the u8 cache's positions are read and written
        assert u8.capabilities.holds_int8_kv and u8.capabilities.kv_cache_dtype == "uint8"
        assert not floats.capabilities.holds_int8_kv and floats.capabilities.kv_cache_dtype is None
        ids = np.array([seq])
        apart = 0.0
        (a, pa), (b, pb) = (x.step(ids, np.ones_like(ids), positions(np.ones_like(ids), len(seq)), None) for x in (u8, floats))
        for _ in range(6):
            want = forward(model, seq)
            scale = np.abs(want).max()
            assert np.abs(a[0] - want).max() / scale <= tol.max_rel and close(want, b[0])
            apart = max(apart, np.abs(a[0] - b[0]).max() / scale)
            seq.append(int(want.argmax()))
            mask = np.ones((1, len(seq)), np.int64)
            a, pa = u8.step(np.array([[seq[-1]]]), mask, np.array([[len(seq) - 1]]), pa)
            b, pb = floats.step(np.array([[seq[-1]]]), mask, np.array([[len(seq) - 1]]), pb)
        assert apart > TOL
        del pa, pb
        engine = Engine(u8, EngineSettings(max_batch_size=2)).start()
        try:  # a prompt, then one sharing its leading blocks: those from the prefix cache, quantized into its slot
            shared = list(range(100, 140))
            settings = SamplingSettings(max_new_tokens=6, greedy=True, min_tokens=6)
            for prompt in (shared, shared + [7, 8]):
                tokens: list[int] = []
                done = threading.Event()
                row = Row(prompt, settings, lambda out, tokens=tokens, done=done:
                          tokens.append(out.token) if isinstance(out, TokenOut) else done.set())
                engine.submit([row])
                assert done.wait(120)
                assert tokens == torch_greedy(model, prompt, 6)
            assert row.cached_tokens > 0
        finally:
            engine.close()


def test_serve_holds_an_int8_kv_exports_u8_cache_on_the_paged_slots(fp32_kv8, fp32, capsys, monkeypatch):
    """`gpt2x serve` on an --int8-kv --openvino-prefill export: its replica opens the openvino backend's paged slots
    with OpenVINO's u8 cache, as asked (--backend openvino, --kv-cache-dtype int8) or not; a float cache with
    --kv-cache-dtype float; the ort backend's slots with --prefill or --backend ort; on an export whose paged slots
    hold no int8 cache, `--backend openvino --kv-cache-dtype int8` is still one line."""
    from gpt2x.serve.replica import open_backend

    from ..helpers import assert_one_line_error, cli

    _, info = fp32_kv8
    served = []
    monkeypatch.setattr("gpt2x.serve.single_process.serve_in_process", lambda config, *a, **k: served.append(config))
    monkeypatch.setenv("GPT2X_PREFILL", "onnxruntime")
    monkeypatch.setenv(KV_DTYPE_ENV, "auto")  # the option sets it for the process: restored after the test
    for args, backend, cache in (([], "openvino", "uint8"), (["--backend", "openvino"], "openvino", "uint8"),
                                 (["--kv-cache-dtype", "int8"], "openvino", "uint8"),
                                 (["--kv-cache-dtype", "float"], "openvino", None),
                                 (["--prefill", "onnxruntime"], "ort", None), (["--backend", "ort"], "ort", None)):
        code, _, err = cli(capsys, "serve", "--onnx", str(info.folder), "--threads", "1", "--max-batch-size", "2", *args)
        assert code in (0, None) and served[-1].backend == backend, (args, err)
        if backend == "openvino":
            with open_backend(served[-1], info) as opened:
                assert isinstance(opened, PagedSlotBackend) and opened.capabilities.kv_cache_dtype == cache, args
        monkeypatch.setenv(KV_DTYPE_ENV, "auto")
    code, out, err = cli(capsys, "serve", "--onnx", str(fp32[1].folder), "--threads", "1", "--backend", "openvino",
                         "--kv-cache-dtype", "int8")
    assert_one_line_error(code, err, UsageError.exit_code, "--kv-cache-dtype int8 is the ort backend's cache")
