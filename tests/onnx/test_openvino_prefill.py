"""An int8 or fp32 export's OpenVINO prefill graph (onnx/openvino_prefill.py, evaluate/prefill.py): written with its
files recorded and checked like the others, gated on its own at the export's tolerances (a perturbed graph is dropped
and the export goes on; bf16 compute where asked for, gated the same way), timed beside ONNX Runtime's prefill,
and left out, saying so, where openvino and nncf do not import."""

from __future__ import annotations

import json
import shutil
from dataclasses import asdict

import pytest

from gpt2x.choices import Precision
from gpt2x.errors import ArtifactError, ParityError, UsageError
from gpt2x.evaluate.parity import TOLERANCES
from gpt2x.evaluate.prefill import gate_prefill
from gpt2x.onnx import openvino_prefill
from gpt2x.onnx.artifact import PREFILL_BIN, PREFILL_XML, ExportInfo, read_export, verify_export
from gpt2x.runtime.pytorch import TorchBackend

from ..helpers import run_gpt2x


@pytest.fixture(scope="module")
def tiny(tiny_export):
    return tiny_export(Precision.int8, openvino_prefill=True)


def test_the_int8_export_keeps_a_gated_and_timed_prefill_graph(tiny):
    _, _, info = tiny
    record = info.prefill
    assert record is not None and record["files"] == [PREFILL_XML, PREFILL_BIN]
    for name in record["files"]:  # recorded as every other file: size and sha256
        assert info.meta["sizes"][name] == (info.folder / name).stat().st_size > 0
        assert len(info.meta["files"][name]) == 64
    verify_export(info.folder)
    parity, tol = record["parity"], TOLERANCES[Precision.int8]
    assert parity["status"] == "passed" and parity["tolerance"]["max_rel"] == tol.max_rel
    assert parity["logits"]["max_rel"] <= tol.max_rel and parity["logits"]["present_max_rel"] <= tol.max_rel
    assert any(c["padded"] and c["batch"] > 1 for c in parity["logits"]["cases"])  # a left-padded batch
    assert parity["greedy"]["share"] >= tol.min_greedy
    timing = record["timing"]
    assert timing["lengths"] == [8, 32, info.config.n_positions - 1]  # 128 and 256 capped at the tiny model's context
    assert all(ms > 0 for ms in timing["onnxruntime_ms"] + timing["openvino_ms"])
    assert record["outputs"][0] == "logits" and len(record["outputs"]) == 1 + 2 * info.config.n_layer


def test_the_int8_graph_carries_its_activation_group_and_the_runtime_compiles_at_it(tiny):
    """The group size is in the graph (the one the gate ran), not the runtime's config, which must not override it:
    OpenVINO's own default is 32."""
    from gpt2x.runtime.openvino_prefill import OpenVinoPrefill

    _, _, info = tiny
    assert openvino_prefill.ACTIVATION_GROUP != 32
    compiled = OpenVinoPrefill(info, threads=1).compiled
    assert int(compiled.get_property("DYNAMIC_QUANTIZATION_GROUP_SIZE")) == openvino_prefill.ACTIVATION_GROUP
    assert str(openvino_prefill.ACTIVATION_GROUP) in info.prefill["weights"]


def test_the_export_computes_at_f32_on_every_cpu_unless_bf16_is_asked_for(tiny):
    """No timing chooses the compute precision (a CPU with bf16 and one without make the same record): a size-chosen
    bf16 ran a whole prompt at bf16 and its chunks at f32, and a cached prefix's rest other than a fresh prompt."""
    _, _, info = tiny
    record = info.prefill
    assert record["inference_precision"] == "f32" and "bf16_from" not in record and "bf16" not in record


def test_bf16_asked_for_is_gated_at_bf16_as_run_and_folded_and_recorded_with_its_f32_fallback(tiny, monkeypatch):
    """On a CPU with bf16 (both of CI's classes have it), the real gates: bf16's (`parity`, int8's tolerance), the
    folded graph's, and f32's as the fallback; on one without, one line before anything runs."""
    from gpt2x.evaluate import prefill
    from gpt2x.runtime.openvino_prefill import cpu_has_bf16

    model, _, info = tiny
    if not cpu_has_bf16():
        with pytest.raises(UsageError, match="needs a CPU that computes bf16"):
            gate_prefill(TorchBackend(model), info, compute="bf16")
        return
    timed = []
    monkeypatch.setattr(prefill, "time_prefills", lambda i, threads=None: timed.append(i.prefill["inference_precision"]) or {})
    record = gate_prefill(TorchBackend(model), info, compute="bf16")
    assert record["inference_precision"] == "bf16" and timed == ["bf16"]
    tol = asdict(TOLERANCES[Precision.int8])
    assert record["parity"]["status"] == "passed" and record["parity"]["tolerance"] == tol
    assert record["parity_f32"]["status"] == "passed" and record["parity_f32"]["tolerance"] == tol
    assert record["bf16_folded"]["status"] == "passed"
    # bf16's logits are not f32's: the gate ran at bf16 (both within int8's bound). Compared on the mean over every
    # position: the worst one may be a decode step's, which runs on ONNX Runtime in both gates (on a Xeon with AMX
    # the two maxima were equal to the last bit).
    assert record["parity"]["logits"]["mean_kl"] != record["parity_f32"]["logits"]["mean_kl"]


def test_bf16_prefill_compute_is_refused_in_one_line_where_it_cannot_be_had(monkeypatch, tmp_path):
    """fp32's gate refuses bf16's rounding, and a CPU without bf16 cannot run it: said before anything is exported."""
    from gpt2x.runtime import openvino_prefill as runtime_prefill

    r = run_gpt2x("export", "--precision", "fp32", "--prefill-compute", "bf16", "--out", "x", cwd=tmp_path, blocked=False)
    assert r.returncode == 2 and "--prefill-compute bf16 is for int8 exports" in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1 and not (tmp_path / "x").exists()
    from gpt2x.workflows.exports import check_prefill_compute

    monkeypatch.setattr(runtime_prefill, "cpu_has_bf16", lambda: False)
    with pytest.raises(UsageError, match="needs a CPU that computes bf16"):
        check_prefill_compute(Precision.int8, "bf16")


def test_the_fp32_export_keeps_a_prefill_graph_gated_at_fp32s_tolerances(tiny_export):
    """f32 weights (no nncf) and fp32's gate (1e-4 of the logits' scale)."""
    model, _, info = tiny_export(Precision.fp32, openvino_prefill=True)
    record, tol = info.prefill, TOLERANCES[Precision.fp32]
    assert record is not None and record["weights"].startswith("f32")
    assert info.meta["sizes"][PREFILL_BIN] >= 4 * model.wte.weight.numel()  # 4 bytes a weight: not compressed
    parity = record["parity"]
    assert parity["status"] == "passed" and parity["tolerance"]["max_rel"] == tol.max_rel
    assert parity["logits"]["max_rel"] <= tol.max_rel and parity["logits"]["present_max_rel"] <= tol.max_rel
    assert parity["greedy"]["share"] == 1.0 and record["inference_precision"] == "f32"
    verify_export(info.folder)


def test_a_changed_prefill_graph_is_refused_on_load(tiny, tmp_path):
    _, _, info = tiny
    copy = tmp_path / "copy"
    shutil.copytree(info.folder, copy)
    with open(copy / PREFILL_BIN, "ab") as f:
        f.write(b"\0")
    with pytest.raises(ArtifactError, match="openvino/prefill.bin is corrupt or changed"):
        read_export(copy)


def perturbed(convert):
    """convert_prefill on a copy of the model with one projection nudged: a graph that is not the model's."""
    def convert_perturbed(model, folder, *args):
        import copy

        import torch

        bad = copy.deepcopy(model)
        with torch.no_grad():
            w = bad.h[0].mlp.c_proj.weight  # noise, not a constant: the next LayerNorm would remove a constant shift
            w.add_(torch.randn(w.shape, generator=torch.Generator().manual_seed(0)) * 0.5)
        return convert(bad, folder, *args)

    return convert_perturbed


def test_a_perturbed_prefill_graph_fails_its_gate_and_the_export_goes_on_without_it(tiny, tmp_path, monkeypatch):
    model, source, _ = tiny
    monkeypatch.setattr(openvino_prefill, "convert_prefill", perturbed(openvino_prefill.convert_prefill))
    said = []
    from gpt2x.workflows.exports import export_model

    info = export_model(model, source, tmp_path / "out", Precision.int8, progress=said.append, openvino_prefill=True)
    assert info.prefill is None
    record = info.meta["openvino_prefill"]
    assert record["kept"] is False and "the OpenVINO prefill is out of tolerance" in record["reason"]
    assert not (info.folder / "openvino").exists()
    assert not any(name.startswith("openvino/") for name in info.meta["files"])
    assert info.meta["parity"]["status"] == "passed"  # model.onnx is the model's: its gate passed
    assert any(m.startswith("OpenVINO prefill graph dropped: the OpenVINO prefill is out of tolerance") for m in said)
    verify_export(info.folder)
    # The gate alone on that graph beside the good export's model.onnx: refused against PyTorch on the real model.
    bad = tmp_path / "bad"
    shutil.copytree(info.folder, bad)
    meta = json.loads((bad / "gpt2x.json").read_text())
    meta["openvino_prefill"] = {"kept": True, "files": openvino_prefill.convert_prefill(model, bad)}
    with pytest.raises(ParityError, match="the OpenVINO prefill is out of tolerance"):
        gate_prefill(TorchBackend(model), ExportInfo(bad, meta))


def test_an_export_without_openvino_still_works_and_says_so(tiny_hf, tmp_path):
    folder, _ = tiny_hf
    r = run_gpt2x("export", "--model", str(folder), "--precision", "int8", "--out", "out", cwd=tmp_path,
                  blocked=True, block="openvino,nncf")
    assert r.returncode == 0, r.stderr
    assert "OpenVINO prefill graph: not kept (openvino, nncf not installed)" in r.stdout
    info = read_export(tmp_path / "out")
    assert info.prefill is None and not (tmp_path / "out" / "openvino").exists()
    assert info.meta["parity"]["status"] == "passed"


def test_whether_an_export_gets_the_graph_when_not_said(tiny, tmp_path, monkeypatch):
    """GPT2X_OPENVINO_PREFILL: 1 or 0 (unset: int8 only); anything else is one UsageError line, before any work."""
    from gpt2x.onnx.build import OPENVINO_PREFILL_ENV, openvino_prefill_wanted
    from gpt2x.workflows.exports import export_model

    model, source, _ = tiny
    monkeypatch.delenv(OPENVINO_PREFILL_ENV, raising=False)
    assert openvino_prefill_wanted(None) is True and openvino_prefill_wanted(False) is False
    assert openvino_prefill_wanted(None, Precision.fp32) is False and openvino_prefill_wanted(True, Precision.fp32) is True
    monkeypatch.setenv(OPENVINO_PREFILL_ENV, "1")
    assert openvino_prefill_wanted(None, Precision.fp32) is True
    monkeypatch.setenv(OPENVINO_PREFILL_ENV, "0")
    assert openvino_prefill_wanted(None) is False and openvino_prefill_wanted(True) is True
    info = export_model(model, source, tmp_path / "off", Precision.int8)
    assert info.meta["openvino_prefill"] == {"kept": False, "reason": "not asked for"} and info.prefill is None
    monkeypatch.setenv(OPENVINO_PREFILL_ENV, "yes")
    with pytest.raises(UsageError, match="GPT2X_OPENVINO_PREFILL must be 0 or 1"):
        export_model(model, source, tmp_path / "bad", Precision.int8)
    assert not (tmp_path / "bad").exists()


def test_chunks_on_a_past_switch_to_openvino_where_the_two_lines_cross():
    """The 2-core Xeon's record of chunks on a 256-token past (ONNX Runtime 26.208 and 164.865 ms at 32 and 256
    tokens, OpenVINO 25.427 and 75.331): under 5% faster at 32, so the timed lengths alone said 256; the margins
    (0.95 ORT - OV) -0.529 and 81.291 cross 0.00647 of the way, 1.45 tokens past 32, so from 34."""
    from gpt2x.evaluate.prefill import crossover

    assert crossover([32, 256], [26.208, 164.865], [25.427, 75.331]) == 34
    assert crossover([32, 128, 256], [26.2, 60.0, 164.9], [25.4, 40.0, 75.3]) == 35  # 32 + 96 x 0.51 / 17.51, up
    # Faster at every timed length: from the shortest; shorter prompts, never timed, stay on ONNX Runtime.
    assert crossover([8, 32, 256], [10.4, 26.2, 164.9], [8.7, 20.0, 75.3]) == 8
    assert crossover([32, 256], [26.2, 164.9], [30.0, 160.0]) is None
