"""The int8 KV cache (onnx/kvcache.py, evaluate/kvcache.py, runtime/kvdtype.py): GroupQueryAttention's quantization
rule by hand, the rewritten graph against ONNX Runtime's float cache, an int8 export's calibrated scales gated, timed
and recorded, the ONNX Runtime backend and OpenVINO's prefill on the int8 cache against PyTorch without a cache, its
choice from the record, and one line for what cannot be."""

from __future__ import annotations

import json
import shutil

import numpy as np
import onnxruntime as ort
import pytest
import torch
from onnx import TensorProto, helper

from gpt2x.choices import Precision
from gpt2x.cli.export import _graph_line, _kv_timings
from gpt2x.errors import ParityError, ProviderError, UsageError
from gpt2x.evaluate.kvcache import gate_int8_kv
from gpt2x.evaluate.parity import INT8_KV_ON_FP32, TOLERANCES
from gpt2x.numerics import positions
from gpt2x.onnx import build
from gpt2x.onnx import names as io
from gpt2x.onnx.artifact import KV_KEY, KV_SCALES_FILE, METADATA_FILE, ExportInfo, read_export, verify_export
from gpt2x.onnx.kvcache import dequantize, load_scales, quantize, save_scales, with_int8_kv
from gpt2x.runtime import kvdtype
from gpt2x.runtime.ort import OrtBackend
from gpt2x.runtime.pytorch import TorchBackend

from ..helpers import run_cli, torch_last_logits

# ---------------------------------------------------------------- the rule, by hand


def test_quantize_is_round_half_to_even_of_value_over_its_channels_scale_clipped():
    scale = np.array([[0.5, 2.0]], np.float32)  # (H=1, D=2)
    x = np.array([[0.25, 1.0], [0.75, 3.0], [-0.25, 5.0], [100.0, -300.0], [-100.0, 254.0]], np.float32)[None, None]
    # channel 0 (0.5): 0.5 -> 0, 1.5 -> 2, -0.5 -> 0, 200 -> 127, -200 -> -128
    # channel 1 (2.0): 0.5 -> 0, 1.5 -> 2, 2.5 -> 2, -150 -> -128, 127 -> 127
    want = np.array([[0, 0], [2, 2], [0, 2], [127, -128], [-128, 127]], np.int8)
    q = quantize(x, scale)
    assert q.dtype == np.int8 and (q[0, 0] == want).all()
    assert (dequantize(q, scale)[0, 0] == want * scale).all()
    out = np.full((1, 1, 5, 2), 7, np.int8)
    assert quantize(x, scale, out=out) is out and (out[0, 0] == want).all()


def test_the_scales_file_keeps_each_layers_key_and_value(tmp_path):
    scales = np.random.default_rng(0).uniform(0.01, 1, (6, 4, 8)).astype(np.float32)  # 3 layers
    save_scales(tmp_path, scales)
    assert (tmp_path / KV_SCALES_FILE).is_file()
    assert np.array_equal(load_scales(tmp_path, 3), scales)


# ---------------------------------------------------------------- the rewritten graph against ORT's float cache

H, D, CAP = 3, 8, 16


def _one_layer(int8: bool, scales: np.ndarray | None = None) -> bytes:
    """One GroupQueryAttention on a packed QKV, its cache named as an export's layer 0."""
    kv = TensorProto.FLOAT
    past_k, past_v = io.input_names(1)[3:]
    present_k, present_v = io.output_names(1)[1:]
    graph = helper.make_graph(
        [helper.make_node("GroupQueryAttention", ["qkv", "", "", past_k, past_v, "seqlens", "total"],
                          ["out", present_k, present_v], domain="com.microsoft", num_heads=H, kv_num_heads=H)], "one",
        [helper.make_tensor_value_info("qkv", TensorProto.FLOAT, [1, "S", 3 * H * D]),
         helper.make_tensor_value_info(past_k, kv, [1, H, CAP, D]), helper.make_tensor_value_info(past_v, kv, [1, H, CAP, D]),
         helper.make_tensor_value_info("seqlens", TensorProto.INT32, [1]),
         helper.make_tensor_value_info("total", TensorProto.INT32, [])],
        [helper.make_tensor_value_info("out", TensorProto.FLOAT, None),
         helper.make_tensor_value_info(present_k, kv, None), helper.make_tensor_value_info(present_v, kv, None)])
    proto = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18), helper.make_opsetid("com.microsoft", 1)])
    proto.ir_version = 10
    if int8:
        with_int8_kv(proto, scales)
    return proto.SerializeToString()


def _run(model: bytes, qkv, past_k, past_v, length: int):
    session = ort.InferenceSession(model, providers=["CPUExecutionProvider"])
    feeds = dict(zip([i.name for i in session.get_inputs()],
                     [qkv, past_k, past_v, np.array([length + qkv.shape[1] - 1], np.int32), np.array(length + qkv.shape[1], np.int32)]))
    return session.run(None, feeds)


def test_the_int8_graph_stores_what_the_rule_says_and_attends_as_the_float_one():
    """A 2-token step after 5 positions: the new positions' bytes are quantize() of what the float graph stores, the
    past's bytes are left as they were, and the output is the float graph's on the dequantized cache (the new
    positions quantized too: within what that rounding moves)."""
    rng = np.random.default_rng(3)
    scales = rng.uniform(0.02, 0.05, (2, H, D)).astype(np.float32)
    qkv = rng.standard_normal((1, 2, 3 * H * D)).astype(np.float32)
    past8 = [rng.integers(-100, 100, (1, H, CAP, D)).astype(np.int8) for _ in range(2)]
    out8, k8, v8 = _run(_one_layer(True, scales), qkv, *[p.copy() for p in past8], length=5)
    wide = [dequantize(p, s) for p, s in zip(past8, scales)]
    out32, k32, v32 = _run(_one_layer(False), qkv, *wide, length=5)
    for got, want, past, s in ((k8, k32, past8[0], scales[0]), (v8, v32, past8[1], scales[1])):
        assert got.dtype == np.int8
        assert np.array_equal(got[:, :, 5:7], quantize(want[:, :, 5:7], s))
        assert np.array_equal(got[:, :, :5], past[:, :, :5])
    # one new position's key and value each off by half a step at most: the output moves a few of those
    assert np.abs(out8 - out32).max() < 4 * scales.max() * np.abs(qkv).max()


def test_with_int8_kv_refuses_scales_for_another_layer_count():
    proto_bytes = _one_layer(False)
    from onnx import ModelProto

    proto = ModelProto()
    proto.ParseFromString(proto_bytes)
    with pytest.raises(ValueError, match="1 GroupQueryAttention nodes; the scales are for 2 layers"):
        with_int8_kv(proto, np.ones((4, H, D), np.float32))


# ---------------------------------------------------------------- an int8 export with its scales


@pytest.fixture(scope="module")
def tiny(tiny_export, tmp_path_factory):
    """The OpenVINO prefill tests' int8 export (made once per run), copied, and given its int8 KV cache's scales as
    the export gives them (build._int8_kv: calibrated, gated and timed), its files recorded again."""
    model, _, made = tiny_export(Precision.int8, openvino_prefill=True)
    folder = tmp_path_factory.mktemp("kv8") / "export"
    shutil.copytree(made.folder, folder)
    info = ExportInfo(folder, json.loads(json.dumps(made.meta)))
    info.meta[KV_KEY] = build._int8_kv(model, info, lambda i: gate_int8_kv(TorchBackend(model), i, threads=1), lambda m: None)
    (folder / METADATA_FILE).unlink()  # written last, as the export writes it: not one of the files it records
    build._record_files(folder, info.meta)
    (folder / METADATA_FILE).write_text(json.dumps(info.meta))
    info = read_export(folder)
    assert info.int8_kv is not None, info.meta.get(KV_KEY)
    return model, info


def test_the_export_keeps_gated_and_timed_scales(tiny):
    _, info = tiny
    record = info.int8_kv
    line = _graph_line("int8 KV cache", record, _kv_timings, presents=True)  # what `gpt2x export` prints
    assert line.startswith("int8 KV cache: parity passed") and f"after a {record['long']['prompt']}-token prompt" in line
    assert ("; used" if record["use"] else "not used") in line
    assert record["file"] == KV_SCALES_FILE and len(info.meta["files"][KV_SCALES_FILE]) == 64
    verify_export(info.folder)
    tol = TOLERANCES[Precision.int8]
    assert record["parity"]["status"] == "passed" and record["parity"]["logits"]["max_rel"] <= tol.max_rel
    long = record["long"]
    assert long["steps"] > 0 and long["max_rel"] <= tol.max_rel and long["mean_kl"] <= tol.max_kl
    assert record["long_float"]["prompt"] == long["prompt"] and record["long_float"]["max_rel"] <= tol.max_rel
    timing = record["timing"]
    assert timing["pasts"][-1] == info.config.n_positions - 2  # 512, capped below this model's context
    assert all(ms > 0 for ms in timing["float_ms"] + timing["int8_ms"])
    assert record["use"] == (timing["int8_ms"][-1] < timing["float_ms"][-1] * (1 - timing["faster_by"]))


def test_fresh_prompts_keys_and_values_fit_the_scales_unclipped(tiny):
    """Random prompts that calibration never saw: every key and value at most the scales' range (the margin's room)."""
    model, info = tiny
    scales = load_scales(info.folder, info.config.n_layer)
    ids = torch.tensor(np.random.default_rng(9).integers(0, info.config.vocab_size, (8, 40)))
    with torch.no_grad():
        _, presents = model(ids)
    for t, s in zip([t for layer in presents for t in layer], scales):
        assert (t.abs().numpy() <= 127 * s[None, :, None, :]).all()


def _decode(backend, ids, mask, prefill: int):
    """A left-padded prefill of `prefill` tokens, then one token a step: each step's logits."""
    logits, cache = backend.step(ids[:, :prefill], mask[:, :prefill], positions(mask[:, :prefill], prefill), None)
    out = [logits]
    for t in range(prefill, ids.shape[1]):
        logits, cache = backend.step(ids[:, t : t + 1], mask[:, : t + 1], positions(mask[:, : t + 1], 1), cache)
        out.append(logits)
    return out, cache


@pytest.mark.parametrize("prefill", ["onnxruntime", "openvino"])
def test_the_int8_cache_decodes_as_pytorch_without_a_cache(tiny, prefill):
    """Both prefills write the int8 cache (ONNX Runtime's GroupQueryAttention, OpenVINO's graph quantizing in it): every
    step's logits against PyTorch's forward of the whole sequence, and the cache against the float cache's: the first
    layer's within half a step of its scale."""
    model, info = tiny
    tol = TOLERANCES[Precision.int8].max_rel
    rng = np.random.default_rng(4)
    ids = rng.integers(0, info.config.vocab_size, (2, 40))
    mask = np.ones_like(ids)
    mask[0, :3] = 0
    with OrtBackend(info, threads=1, prefill=prefill, kv_cache_dtype="int8") as backend, \
            OrtBackend(info, threads=1, prefill=prefill, kv_cache_dtype="float") as floats:
        assert backend.kv_dtype == np.int8 and floats.kv_dtype == np.float32
        assert backend.prefill_runtime(24, 2) == prefill
        steps, cache = _decode(backend, ids, mask, prefill=24)
        for t, logits in zip(range(24, 41), steps):
            want = torch_last_logits(model, ids[:, :t], mask[:, :t])
            assert np.abs(logits - want).max() / np.abs(want).max() <= tol, t
        _, float_cache = _decode(floats, ids, mask, prefill=24)
        assert all(buf.dtype == np.int8 for buf in cache.buffers.arrays)
        keep = mask.astype(bool)
        for i, (got, want, s) in enumerate(zip(cache.to_numpy(), float_cache.to_numpy(), backend.kv_scales)):
            diff = np.abs(got.transpose(0, 2, 1, 3)[keep] - want.transpose(0, 2, 1, 3)[keep])  # (positions, H, D)
            if i < 2:  # the first layer's key and value come from the same inputs on both caches: half a step apart
                assert (diff <= 0.5 * s + 1e-5).all()
            else:  # later layers' from attention over the quantized cache
                assert diff.max() / np.abs(want).max() <= tol


def test_a_cache_handed_over_as_floats_keeps_its_bytes(tiny):
    _, info = tiny
    ids = np.random.default_rng(5).integers(0, info.config.vocab_size, (1, 12))
    mask = np.ones_like(ids)
    with OrtBackend(info, threads=1, kv_cache_dtype="int8") as backend:
        _, cache = backend.step(ids, mask, positions(mask, 12), None)
        again = backend.past_from_numpy(cache.to_numpy())
        for a, b in zip(cache.filled(), again.filled()):
            assert a.dtype == b.dtype == np.int8 and np.array_equal(a, b)


def test_auto_holds_int8_where_the_record_timed_it_faster(tiny, monkeypatch):
    _, info = tiny
    monkeypatch.delenv(kvdtype.KV_DTYPE_ENV, raising=False)
    for use, dtype in ((True, np.int8), (False, np.float32)):
        meta = json.loads(json.dumps(info.meta))
        meta[KV_KEY]["use"] = use
        with OrtBackend(ExportInfo(info.folder, meta), threads=1) as backend:
            assert backend.kv_dtype == dtype and (backend.kv_scales is not None) == use
    monkeypatch.setenv(kvdtype.KV_DTYPE_ENV, "float")
    meta = json.loads(json.dumps(info.meta))
    meta[KV_KEY]["use"] = True
    with OrtBackend(ExportInfo(info.folder, meta), threads=1) as backend:
        assert backend.kv_dtype == np.float32


def test_int8_is_refused_in_one_line_where_it_cannot_be(tiny, tiny_export):
    _, info = tiny
    with pytest.raises(ProviderError) as e:
        OrtBackend(tiny_export(Precision.int8)[2], threads=1, kv_cache_dtype="int8")
    assert "cannot hold an int8 KV cache: it kept no gated scales" in str(e.value) and "\n" not in str(e.value)
    with pytest.raises(ProviderError, match="it is an fp32 export"):
        OrtBackend(tiny_export(Precision.fp32)[2], threads=1, kv_cache_dtype="int8")
    with pytest.raises(ProviderError, match="not written in place"):
        OrtBackend(info, threads=1, in_place_kv=False, kv_cache_dtype="int8")
    with pytest.raises(UsageError, match="kv-cache-dtype: 'int4' is not one of auto, int8, float"):
        kvdtype.asked("int4")


def test_the_cli_refuses_a_bad_dtype_and_int8_for_a_float_export_in_one_line(own_exports):
    """Both before anything is exported (GPT2X_EXPORTS is this test's own, empty folder). (An fp32 export by name is
    made with the scales: test_an_fp32_export_by_name_is_made_with_the_scales_where_int8_is_asked.)"""
    for args, said in ((["--kv-cache-dtype", "fp8"], "kv-cache-dtype: 'fp8' is not one of auto, int8, float"),
                       (["--precision", "fp16", "--kv-cache-dtype", "int8"],
                        "--kv-cache-dtype int8 is for int8, int4 and fp32 exports; --precision fp16")):
        result = run_cli("generate", "hi", *args)
        assert result.returncode == 2 and said in result.stderr, result.stderr
        assert "Traceback" not in result.stderr and len(result.stderr.strip().splitlines()) == 1
    assert not own_exports.exists() or not any(own_exports.iterdir())


def test_scales_too_narrow_fail_the_gate_and_are_dropped(tiny, tmp_path):
    """Scales a tenth of calibration's range clip nearly every key and value: the long check and the parity check
    fail, and the export goes on without the file."""
    model, info = tiny
    folder = tmp_path / "narrow"
    shutil.copytree(info.folder, folder)
    save_scales(folder, load_scales(folder, info.config.n_layer) / 20)
    narrow = ExportInfo(folder, json.loads(json.dumps(info.meta)))
    with pytest.raises(ParityError, match="int8 KV cache is out of tolerance"):
        gate_int8_kv(TorchBackend(model), narrow, threads=1)
    messages = []
    narrow.meta.pop(KV_KEY)
    record = build._gated(narrow, KV_KEY, {"kept": True}, lambda i: gate_int8_kv(TorchBackend(model), i, threads=1),
                          (folder / KV_SCALES_FILE).unlink, "int8 KV cache", "checking", messages.append)
    assert record["kept"] is False and "out of tolerance" in record["reason"]
    assert not (folder / KV_SCALES_FILE).exists() and "dropped" in messages[-1]


def test_the_env_asks_for_the_scales_and_a_bad_value_is_one_line(monkeypatch):
    monkeypatch.delenv(build.INT8_KV_ENV, raising=False)
    assert build.int8_kv_wanted(None) is True and build.int8_kv_wanted(False) is False
    monkeypatch.setenv(build.INT8_KV_ENV, "0")
    assert build.int8_kv_wanted(None) is False and build.int8_kv_wanted(True) is True
    monkeypatch.setenv(build.INT8_KV_ENV, "2")
    with pytest.raises(UsageError, match="GPT2X_INT8_KV must be 0 or 1"):
        build.int8_kv_wanted(None)


def test_exports_without_them_say_why(tiny_export):
    assert tiny_export(Precision.int8)[2].meta[KV_KEY] == {"kept": False, "reason": "not asked for"}
    assert KV_KEY not in tiny_export(Precision.fp32)[2].meta


# ---------------------------------------------------------------- an fp32 export's int8 cache, where asked for


def test_an_fp32_export_gets_the_scales_only_where_asked(monkeypatch):
    """GPT2X_INT8_KV is the quantized exports' default: it never turns an fp32 export's on, and a bad value is still
    its one line."""
    monkeypatch.delenv(build.INT8_KV_ENV, raising=False)
    fp32 = Precision.fp32
    assert build.int8_kv_wanted(None, fp32) is False and build.int8_kv_wanted(True, fp32) is True
    monkeypatch.setenv(build.INT8_KV_ENV, "1")
    assert build.int8_kv_wanted(None, fp32) is False and build.int8_kv_wanted(False, fp32) is False
    assert build.int8_kv_wanted(True, Precision.bf16) is False
    monkeypatch.setenv(build.INT8_KV_ENV, "yes")
    with pytest.raises(UsageError, match="GPT2X_INT8_KV must be 0 or 1"):
        build.int8_kv_wanted(True, fp32)


@pytest.fixture(scope="module")
def fp32_kv8(tiny_export):
    """An fp32 export made with its int8 KV cache asked for (the export's whole path: calibrated, gated, timed)."""
    model, _, info = tiny_export(Precision.fp32, int8_kv=True)
    return model, info


def test_an_fp32_exports_int8_cache_is_gated_on_its_own_and_used(fp32_kv8):
    """Its gate is INT8_KV_ON_FP32 (fp32's own would refuse any quantized cache), and it is used whatever the timing
    said: it was asked for by name."""
    _, info = fp32_kv8
    record = info.int8_kv
    assert record is not None and record["use"] is True, info.meta.get(KV_KEY)
    tol = INT8_KV_ON_FP32
    assert record["parity"]["tolerance"]["max_rel"] == tol.max_rel < TOLERANCES[Precision.bf16].max_rel * 1.01
    assert record["parity"]["status"] == "passed" and record["parity"]["logits"]["max_rel"] <= tol.max_rel
    assert record["long"]["max_rel"] <= tol.max_rel and record["long"]["mean_kl"] <= tol.max_kl
    # the float cache is the export's own fp32: its long check is fp32's
    assert record["long_float"]["max_rel"] <= TOLERANCES[Precision.fp32].max_rel
    line = _graph_line("int8 KV cache", record, _kv_timings, presents=True)
    assert line.startswith("int8 KV cache: parity passed") and line.endswith(("; used", "; used (asked for: an fp32 export's)"))
    verify_export(info.folder)


def test_an_fp32_exports_int8_cache_decodes_as_pytorch_without_a_cache(fp32_kv8):
    """The ort backend on the export's GroupQueryAttention twin, its cache int8 by the record (auto) and float where
    asked: every step against PyTorch's forward of the whole sequence, the int8 cache within its gate and off the float
    cache's fp32 logits by more than fp32's own gate (the keys and values are quantized, not passed through)."""
    model, info = fp32_kv8
    rng = np.random.default_rng(6)
    ids = rng.integers(0, info.config.vocab_size, (2, 40))
    mask = np.ones_like(ids)
    mask[1, :4] = 0
    with OrtBackend(info, threads=1) as int8, OrtBackend(info, threads=1, kv_cache_dtype="float") as floats:
        assert int8.kv_dtype == np.int8 and floats.kv_dtype == np.float32 and int8.in_place_kv
        got, cache = _decode(int8, ids, mask, prefill=24)
        plain, _ = _decode(floats, ids, mask, prefill=24)
        assert all(buf.dtype == np.int8 for buf in cache.buffers.arrays)
        apart = 0.0
        for t, a, b in zip(range(24, 41), got, plain):
            want = torch_last_logits(model, ids[:, :t], mask[:, :t])
            scale = np.abs(want).max()
            assert np.abs(a - want).max() / scale <= INT8_KV_ON_FP32.max_rel, t
            assert np.abs(b - want).max() / scale <= TOLERANCES[Precision.fp32].max_rel, t
            apart = max(apart, np.abs(a - b).max() / scale)
        assert apart > TOLERANCES[Precision.fp32].max_rel


def test_the_slots_hold_an_fp32_exports_int8_cache(fp32_kv8):
    """The serving engine's fixed slots on the same export: an int8 cache, each row's logits as the ort backend's on
    its own int8 cache (a second runtime path: the slots' fixed-shape graphs) and within the gate of PyTorch's."""
    from gpt2x.runtime.static_decode import SlotDecoder

    model, info = fp32_kv8
    ids = np.random.default_rng(7).integers(0, info.config.vocab_size, (2, 30))
    mask = np.ones_like(ids)
    slots = SlotDecoder(info, slots=4, threads=1)
    assert slots.dtype == np.int8 and slots.kv_scales is not None
    with OrtBackend(info, threads=1) as ort_backend:
        want, _ = _decode(ort_backend, ids, mask, prefill=20)
    slots.prefill_rows(np.array([0, 1]), ids[:, :20])
    for t in range(20, 30):
        logits = slots.step(np.concatenate([ids[:, t], [0, 0]]), take=np.array([0, 1]))
        ref = want[t - 19]
        assert np.abs(logits - ref).max() / np.abs(ref).max() <= 1e-5, t  # a flipped int8 rounding: ~1e-3
        truth = torch_last_logits(model, ids[:, : t + 1], mask[:, : t + 1])
        assert np.abs(logits - truth).max() / np.abs(truth).max() <= INT8_KV_ON_FP32.max_rel, t
    slots.close()


def test_an_fp32_export_by_name_is_made_with_the_scales_where_int8_is_asked(tiny_export, own_exports, monkeypatch):
    """--kv-cache-dtype int8 (its environment variable) and an fp32 export by name: made once with its gated scales, in
    the plain folder's twin, which the ort backend then holds in int8; without it, the plain folder, without them."""
    from gpt2x.workflows.exports import INT8_KV_SUFFIX, ensure_export

    model, source, _ = tiny_export(Precision.fp32)
    monkeypatch.setenv(kvdtype.KV_DTYPE_ENV, "int8")
    heard = []
    info = ensure_export(source.name, Precision.fp32, loaded=(model, source), notice=heard.append)
    assert info.folder.name.endswith("-fp32" + INT8_KV_SUFFIX) and info.folder.parent == own_exports
    assert info.int8_kv is not None and info.int8_kv["use"] is True
    assert "(fp32, with an int8 KV cache)" in heard[0]
    assert ensure_export(source.name, Precision.fp32, loaded=(model, source), notice=heard.append).folder == info.folder
    assert len(heard) == 1  # made once
    with OrtBackend(info, threads=1) as backend:
        assert backend.kv_dtype == np.int8
    monkeypatch.setenv(kvdtype.KV_DTYPE_ENV, "auto")
    plain = ensure_export(source.name, Precision.fp32, loaded=(model, source))
    assert plain.folder.name.endswith("-fp32") and KV_KEY not in plain.meta


def test_an_int8_export_by_name_is_made_where_int8_is_asked_before_it_exists(tiny_export, own_exports, monkeypatch):
    """--kv-cache-dtype int8 before an int8 export by name exists: the export's gates open their backends on the
    export as it stands (no scales until the last gate), not on the cache the process asks for, and the export is then
    held in int8. (It had failed with "cannot hold an int8 KV cache" from its first gate.)"""
    from gpt2x.workflows.exports import ensure_export

    model, source, _ = tiny_export(Precision.int8)
    monkeypatch.setenv(kvdtype.KV_DTYPE_ENV, "int8")
    info = ensure_export(source.name, Precision.int8, loaded=(model, source))
    assert info.folder.name.endswith("-int8") and info.meta["parity"]["status"] == "passed"
    assert info.int8_kv is not None
    with OrtBackend(info, threads=1) as backend:
        assert backend.kv_dtype == np.int8


def test_int8_kv_asked_where_it_cannot_be_had_is_one_line_before_any_export(tmp_path):
    """`gpt2x export --int8-kv` on a precision without the scales, or without the gate that keeps them: exit 2, one
    line, nothing exported."""
    for args, said in ((["--precision", "fp16"], "--int8-kv is for fp32, int8 and int4 exports; fp16 exports keep a float cache"),
                       (["--precision", "fp32", "--no-check-parity"], "it cannot go with --no-check-parity")):
        out = tmp_path / args[1]
        result = run_cli("export", *args, "--int8-kv", "--out", str(out))
        assert result.returncode == 2 and said in result.stderr, result.stderr
        assert "Traceback" not in result.stderr and len(result.stderr.strip().splitlines()) == 1
        assert not out.exists()
