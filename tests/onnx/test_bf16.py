"""The bf16 precision (docs/export.md): an export of the fp32 weights recorded as bf16, gated at bf16 compute on the
backend whose record runs it (OpenVINO: ONNX Runtime's CPU provider has no bf16 MatMul on x86), chosen by default for
it; the backends that do not run it, and a CPU without bf16, refuse it in one line before any work."""

from __future__ import annotations

from dataclasses import asdict

import numpy as np
import onnx
import pytest

from gpt2x.choices import BackendKind, Precision, ProviderKind
from gpt2x.errors import ProviderError, UsageError
from gpt2x.evaluate.metrics import logit_stats
from gpt2x.evaluate.parity import TOLERANCES, greedy_agreement
from gpt2x.numerics import positions
from gpt2x.runtime import openvino_prefill
from gpt2x.runtime.registry import capabilities_of, default_backend, unsupported

from ..helpers import assert_one_line_error, cli, torch_last_logits

needs_bf16 = pytest.mark.skipif(not openvino_prefill.cpu_has_bf16(), reason="this CPU does not compute bf16")


@pytest.fixture(scope="module")
def exports(tiny_export):
    """The tiny model's bf16 export and its fp32 one, both gated."""
    model, _, bf16 = tiny_export(Precision.bf16)
    return model, bf16, tiny_export(Precision.fp32)[2]


def _last_logits(info, ids, mask):
    from gpt2x.runtime.openvino import OpenVinoBackend

    with OpenVinoBackend(info, threads=1) as backend:
        return backend.step(ids, mask, positions(mask, ids.shape[1]), None)[0]


def test_bf16_is_run_by_the_backends_whose_record_says_so_and_is_their_default():
    assert [k for k in BackendKind if k is not BackendKind.torch and capabilities_of(k).runs(Precision.bf16)] == \
        [BackendKind.openvino]
    assert default_backend(Precision.bf16) is BackendKind.openvino
    assert default_backend(Precision.fp32) is default_backend(Precision.int8) is BackendKind.ort
    assert default_backend(Precision.fp16, ProviderKind.cuda) is BackendKind.ort
    error = unsupported(BackendKind.ort, ProviderKind.cpu, Precision.bf16)
    assert isinstance(error, UsageError) and str(error).endswith("bf16 is run by the openvino backend")


@needs_bf16
def test_the_bf16_export_holds_fp32_weights_and_passes_its_own_gate_at_bf16_compute(exports):
    model, info, _ = exports
    assert info.precision is Precision.bf16 and info.prefill is None
    graph = onnx.load(str(info.model_path), load_external_data=False)
    floats = {t.data_type for t in graph.graph.initializer} - {onnx.TensorProto.INT64, onnx.TensorProto.INT32}
    assert floats == {onnx.TensorProto.FLOAT}  # computed in bf16, stored fp32
    parity = info.meta["parity"]
    assert (parity["status"], parity["backend"], parity["precision"]) == ("passed", "openvino", "bf16")
    assert parity["tolerance"] == asdict(TOLERANCES[Precision.bf16])


@needs_bf16
def test_the_bf16_export_computes_bf16_within_its_tolerance_of_pytorch_and_not_as_fp32(exports):
    """Independent references: PyTorch's fp32 logits, and the fp32 export on the same runtime at f32 compute."""
    import openvino as ov

    from gpt2x.runtime.openvino import OpenVinoBackend

    model, info, fp32 = exports
    rng = np.random.default_rng(3)
    ids = rng.integers(0, info.config.vocab_size, (3, 20), dtype=np.int64)
    mask = np.ones_like(ids)
    mask[0, :4] = 0
    want = torch_last_logits(model, ids, mask)
    got, f32 = _last_logits(info, ids, mask), _last_logits(fp32, ids, mask)
    tol = TOLERANCES[Precision.bf16]
    stats = logit_stats(want, got)
    assert stats["max_rel"] <= tol.max_rel and stats["mean_kl"] <= tol.max_kl
    # it really computed bf16: farther from PyTorch than fp32's gate allows, where the fp32 export is within it
    assert not np.array_equal(got, f32)
    assert stats["max_rel"] > TOLERANCES[Precision.fp32].max_rel >= logit_stats(want, f32)["max_rel"]
    with OpenVinoBackend(info, threads=1) as backend:
        assert backend.compiled.get_property("INFERENCE_PRECISION_HINT") == ov.Type.bf16
        from gpt2x.runtime.pytorch import TorchBackend

        assert greedy_agreement(TorchBackend(model), backend, 16)["share"] >= tol.min_greedy


@needs_bf16
def test_a_bf16_export_is_refused_in_one_line_by_a_backend_that_does_not_run_it(exports):
    from gpt2x.runtime.ort import OrtBackend

    _, info, _ = exports
    with pytest.raises(UsageError, match="is a bf16 export, which the ort backend does not run on cpu"):
        OrtBackend(info)


@needs_bf16
def test_generate_on_a_bf16_folder_defaults_to_the_backend_that_runs_it(exports, capsys):
    import json

    _, info, _ = exports
    code, out, err = cli(capsys, "generate", "ROMEO:", "--onnx", str(info.folder), "--greedy", "--max-new-tokens", "4",
                         "--json")
    assert code == 0, err
    assert json.loads(out)["backend"] == "openvino"
    code, _, err = cli(capsys, "generate", "ROMEO:", "--onnx", str(info.folder), "--backend", "ort")
    assert_one_line_error(code, err, UsageError.exit_code, "the ort backend does not run bf16")


@needs_bf16
def test_the_offline_api_serves_a_bf16_folder_on_the_backend_that_runs_it_with_generates_tokens(exports):
    """gpt2x.LLM without a backend takes the export's default one, as the commands do (it had been ort, which refused
    bf16), and its greedy tokens are the decode loop's on that backend."""
    from gpt2x.generation.generate import generate
    from gpt2x.generation.settings import SamplingSettings
    from gpt2x.runtime.openvino import OpenVinoBackend
    from gpt2x.serve.offline import LLM, SamplingParams

    _, info, _ = exports
    with LLM(str(info.folder), threads=1) as llm:
        assert llm.service.backend.name == "openvino"
        [out] = llm.generate(["ROMEO:"], SamplingParams(temperature=0, max_tokens=6))
    with OpenVinoBackend(info, threads=1) as backend:
        [want] = generate(backend, ["ROMEO:"], SamplingSettings(greedy=True, max_new_tokens=6))
    assert out.outputs[0].token_ids == want.tokens


@pytest.mark.parametrize("args", [
    ("export", "--precision", "bf16", "--out", "never"),
    ("generate", "ROMEO:", "--precision", "bf16"),
    ("serve", "--precision", "bf16"),
    ("bench", "--precisions", "fp32,bf16"),
])
def test_bf16_on_a_cpu_without_it_is_refused_in_one_line_before_any_work(args, capsys, monkeypatch, tmp_path):
    """Nothing loaded nor exported: no model load nor export may even start."""
    from gpt2x.workflows import exports, models

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(openvino_prefill, "cpu_has_bf16", lambda: False)
    monkeypatch.setattr(models, "load_model", lambda *a, **k: pytest.fail("loaded a model"))
    monkeypatch.setattr(exports, "export_model", lambda *a, **k: pytest.fail("exported"))
    code, _, err = cli(capsys, *args)
    assert_one_line_error(code, err, UsageError.exit_code, "bf16 needs a CPU that computes bf16 (AVX-512 BF16 or AMX)")
    assert not (tmp_path / "never").exists()


def test_a_bf16_export_on_a_cpu_without_bf16_is_refused_by_the_backend(tiny_export, monkeypatch):
    """An export folder carried to a CPU without bf16: refused on opening, not run at another precision than gated."""
    from gpt2x.onnx.artifact import ExportInfo
    from gpt2x.runtime import openvino, openvino_prefill

    _, _, fp32 = tiny_export(Precision.fp32)
    info = ExportInfo(fp32.folder, {**fp32.meta, "precision": "bf16"})
    monkeypatch.setattr(openvino_prefill, "cpu_has_bf16", lambda: False)
    with pytest.raises(ProviderError, match="is a bf16 export, which needs a CPU that computes bf16"):
        openvino.OpenVinoBackend(info, threads=1)


@needs_bf16
def test_the_openvino_backends_bf16_cache_is_half_a_float32_one_and_steps_as_float32_io_bit_for_bit(exports):
    """At bf16 compute the openvino backend's cache holds bf16 bits, read and written as they are (bf16_io), where it
    held float32 that the graph converted whole to bf16 at every step: half the memory, and a decode step's logits and
    new keys and values, bit for bit, those of model.onnx compiled as it is (float32 past and presents) on the same
    past (a bf16's bits are a float32's upper half)."""
    import openvino as ov

    from gpt2x.onnx import names as io
    from gpt2x.runtime.openvino import OpenVinoBackend

    _, info, _ = exports
    cfg = info.config
    ids = np.random.default_rng(5).integers(0, cfg.vocab_size, (2, 13), dtype=np.int64)
    mask = np.ones_like(ids)
    with OpenVinoBackend(info, threads=1) as backend:
        _, cache = backend.step(ids[:, :12], mask[:, :12], positions(mask[:, :12], 12), None)
        assert all(a.dtype.itemsize == 2 for a in cache.arrays)
        past = [(a.astype(np.uint32) << 16).view(np.float32) for a in cache.arrays]  # (B, H, capacity, D), masked after 12
        logits, cache = backend.step(ids[:, 12:], mask, positions(mask, 1), cache)
        new = [(a[:, :, 12:13].astype(np.uint32) << 16).view(np.float32) for a in cache.arrays]
        assert [np.array_equal(a, b) for a, b in zip(cache.to_numpy(), [np.concatenate([p[:, :, :12], n], 2)
                                                                        for p, n in zip(past, new)])] == [True] * len(new)
    capacity = past[0].shape[2]
    wide = np.zeros((2, capacity + 1), np.int64)
    wide[:, :12] = wide[:, capacity] = 1
    core = ov.Core()
    plain = core.compile_model(core.read_model(str(info.model_path)), "CPU", {
        "INFERENCE_NUM_THREADS": 1, "INFERENCE_PRECISION_HINT": "bf16", "PERFORMANCE_HINT": "LATENCY",
        "ENABLE_CPU_PINNING": False})
    out = plain({io.INPUT_IDS: ids[:, 12:], io.ATTENTION_MASK: wide, io.POSITION_IDS: np.full((2, 1), 12, np.int64),
                 **dict(zip(io.input_names(cfg.n_layer)[3:], past))})
    assert np.array_equal(out[io.LOGITS][:, -1], logits)
    for name, want in zip(io.output_names(cfg.n_layer)[1:], new):
        assert np.array_equal(out[name][:, :, capacity:], want), name
