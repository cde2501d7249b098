"""`gpt2x export` as a user runs it: what it prints, --json, --force, --no-check-parity, and that a
forced export that fails its gate leaves the old export exactly as it was. Also the lossy gates
(int8, fp16) shown to fail on perturbed exports, as the fp32 gate is in test_onnx."""

from __future__ import annotations

import json

import numpy as np
import onnx
import pytest
from onnx import numpy_helper

from gpt2x.choices import Precision
from gpt2x.errors import OutputError, ParityError
from gpt2x.evaluate.parity import TOLERANCES, check
from gpt2x.fileio import sha256
from gpt2x.model.weights import load_model
from gpt2x.onnx import build
from gpt2x.onnx.artifact import read_export
from gpt2x.onnx.build import NOT_CHECKED
from gpt2x.runtime.pytorch import TorchBackend
from gpt2x.workflows.exports import export_model

from ..helpers import Noisy, assert_one_line_error, cli, make_hf_model


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tiny-export-cli")
    make_hf_model(folder, seed=5)
    return folder


def test_export_prints_json_and_needs_force(capsys, tiny_dir, tmp_path):
    out = tmp_path / "exp"
    code, stdout, _ = cli(capsys, "export", "--model", str(tiny_dir), "--out", str(out))
    assert code == 0
    lines = stdout.strip().splitlines()
    assert lines[0] == f"exported {tiny_dir} (fp32) to {out}"
    assert lines[1].startswith("fused operators: MultiHeadAttention 2, SkipLayerNormalization")
    assert lines[2].startswith("parity passed on cpu: max |Δlogit|")
    info = read_export(out)
    assert info.meta["parity"]["status"] == "passed"

    code, _, err = cli(capsys, "export", "--model", str(tiny_dir), "--out", str(out))
    assert_one_line_error(code, err, OutputError.exit_code, "pass --force to replace it")
    assert read_export(out).meta == info.meta  # untouched

    code, stdout, _ = cli(capsys, "export", "--model", str(tiny_dir), "--out", str(out), "--force", "--json")
    assert code == 0
    meta = json.loads(stdout)
    assert meta["folder"] == str(out) and meta["precision"] == "fp32" and meta["parity"]["status"] == "passed"
    assert meta["model"]["name"] == str(tiny_dir) and meta["model"]["kind"] == "local"
    assert meta["files"] == {p.name: sha256(p) for p in out.iterdir() if p.name != "gpt2x.json"}
    assert meta["created"] >= info.meta["created"]


def test_an_export_to_a_folder_another_process_is_writing_is_refused(capsys, tiny_dir, tmp_path):
    """Two `gpt2x export --out SAME` at once: the later is refused in one line (exit 9) while the earlier holds the
    folder, where it had replaced the earlier's export unasked; nothing is written."""
    from filelock import FileLock

    out = tmp_path / "same"
    with FileLock(tmp_path / ".same.lock"):  # as the earlier export holds it
        code, _, err = cli(capsys, "export", "--model", str(tiny_dir), "--out", str(out), "--force")
    assert_one_line_error(code, err, OutputError.exit_code, f"another process is writing {out} now")
    assert not out.exists()


def test_an_unwritable_exports_folder_is_one_line_with_exit_9(capsys, monkeypatch, tmp_path):
    """A read-only file system (a container's) under the exports folder: generate's first-use export says so in
    one line and exits 9 (docs/errors.md), where it gave a 71-line traceback and exit 1."""
    import filelock

    def read_only(self, *args, **kwargs):
        raise PermissionError(30, "Read-only file system")

    monkeypatch.setattr(filelock.FileLock, "acquire", read_only)
    monkeypatch.setenv("GPT2X_EXPORTS", str(tmp_path / "exports"))
    code, _, err = cli(capsys, "generate", "ROMEO:", "--max-new-tokens", "2")
    assert_one_line_error(code, err, OutputError.exit_code, f"cannot write to {tmp_path / 'exports'}: Read-only file system")


def test_a_folder_without_an_export_in_an_exports_place_is_named_before_any_work(capsys, monkeypatch, tmp_path):
    """A folder with no gpt2x.json where generate would export: one line naming it and the flag that replaces it
    (not a Python keyword), before any "exporting first"; the folder is left as it was."""
    monkeypatch.setenv("GPT2X_EXPORTS", str(tmp_path))
    squatter = tmp_path / "shakespeare-fp32"
    squatter.mkdir()
    (squatter / "notes.txt").write_text("mine")
    code, _, err = cli(capsys, "generate", "ROMEO:", "--max-new-tokens", "2")
    assert_one_line_error(code, err, OutputError.exit_code, f"{squatter} exists but holds no export (no gpt2x.json)")
    assert "--force" in err and "force=True" not in err
    assert [p.name for p in squatter.iterdir()] == ["notes.txt"]


def test_a_chat_template_given_is_recorded_where_transformers_reads_it_and_a_bad_one_refused(capsys, tiny_dir, tmp_path):
    """--chat-template FILE lands in tokenizer_config.json, which transformers' apply_chat_template reads; a file that
    is not a Jinja2 template is one line (exit 2) before anything is exported; an export of a model other than the
    bundled one records no template unless given."""
    from transformers import AutoTokenizer

    template = tmp_path / "t.jinja"
    template.write_text("{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}")
    code, _, err = cli(capsys, "export", "--model", str(tiny_dir), "--out", str(tmp_path / "t"), "--chat-template", str(template))
    assert code == 0, err
    rendered = AutoTokenizer.from_pretrained(str(tmp_path / "t")).apply_chat_template(
        [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "ho"}], tokenize=False)
    assert rendered == "<user>hi<assistant>ho"
    assert cli(capsys, "export", "--model", str(tiny_dir), "--out", str(tmp_path / "plain"))[0] == 0
    assert "chat_template" not in json.loads((tmp_path / "plain" / "tokenizer_config.json").read_text())
    text = "{% for m in messages %}[{{ m['content'] }}]{% endfor %}"  # the template's text itself, as vLLM takes it
    assert cli(capsys, "export", "--model", str(tiny_dir), "--out", str(tmp_path / "text"), "--chat-template", text)[0] == 0
    assert json.loads((tmp_path / "text" / "tokenizer_config.json").read_text())["chat_template"] == text
    template.write_text("{% for m in messages %}")
    code, _, err = cli(capsys, "export", "--model", str(tiny_dir), "--out", str(tmp_path / "bad"), "--chat-template", str(template))
    assert_one_line_error(code, err, 2, f"--chat-template {template} is not a Jinja2 template")
    assert not (tmp_path / "bad").exists()


def test_no_check_parity_is_recorded(capsys, tiny_dir, tmp_path):
    code, stdout, _ = cli(capsys, "export", "--model", str(tiny_dir), "--out", str(tmp_path / "e"), "--no-check-parity", "--json")
    assert code == 0 and json.loads(stdout)["parity"] == {"status": NOT_CHECKED}


def _perturb_matrix(proto: onnx.ModelProto, scale: float) -> None:
    """Scale the first projection matrix (2-D float initializer) of a traced graph in place."""
    for init in proto.graph.initializer:
        arr = numpy_helper.to_array(init)
        if arr.ndim == 2 and arr.dtype == np.float32 and min(arr.shape) > 8:
            init.CopyFrom(numpy_helper.from_array(arr * scale, init.name))
            return
    raise AssertionError("no projection matrix to perturb")


def test_failed_forced_export_leaves_the_old_one_intact(capsys, tiny_dir, tmp_path, monkeypatch):
    out = tmp_path / "exp"
    assert cli(capsys, "export", "--model", str(tiny_dir), "--out", str(out))[0] == 0
    before = {p.name: sha256(p) for p in out.iterdir()}
    real_fuse = build.fuse

    def fuse_then_perturb(raw, fused, cfg, precision):
        _perturb_matrix(raw, 1.5)
        return real_fuse(raw, fused, cfg, precision)

    monkeypatch.setattr(build, "fuse", fuse_then_perturb)
    code, _, err = cli(capsys, "export", "--model", str(tiny_dir), "--out", str(out), "--force")
    assert_one_line_error(code, err, ParityError.exit_code, "out of tolerance")
    assert {p.name: sha256(p) for p in out.iterdir()} == before
    assert read_export(out).meta["parity"]["status"] == "passed"
    # no partial or old folders left (the lock file beside the folder stays, as a lock file does)
    assert sorted(p.name for p in tmp_path.iterdir()) == [".exp.lock", "exp"]


@pytest.fixture(scope="module")
def tiny_model(tiny_dir):
    return load_model(str(tiny_dir))


def test_int8_gate_fails_a_perturbed_export(tiny_model, tmp_path, monkeypatch):
    """The int8 gate passes the real quantized graph and refuses one whose int8 weights are off."""
    model, source = tiny_model
    info = export_model(model, source, tmp_path / "good", Precision.int8)
    assert info.meta["parity"]["status"] == "passed"  # measured, not skipped
    real_quantize = build.quantize_int8

    def quantize_then_perturb(fused, out):
        ops = real_quantize(fused, out)
        proto = onnx.load(str(out))
        scales = [i for i in proto.graph.initializer if i.name.endswith("_scales")]
        assert scales, "MatMulNBits scales expected"
        for init in scales:  # every int8 block's scale 30% off
            init.CopyFrom(numpy_helper.from_array(numpy_helper.to_array(init) * np.float32(1.3), init.name))
        onnx.save(proto, str(out))
        return ops

    monkeypatch.setattr(build, "quantize_int8", quantize_then_perturb)
    with pytest.raises(ParityError, match="int8 export is out of tolerance"):
        export_model(model, source, tmp_path / "bad", Precision.int8)
    assert not (tmp_path / "bad").exists()




@pytest.mark.parametrize("precision", [Precision.fp16, Precision.int8])
def test_lossy_gates_pass_small_noise_and_fail_large(tiny_model, precision):
    """The fp16 and int8 tolerances applied to the same model with noise on its logits: rounding-sized
    noise passes, noise that changes the next-token distributions fails on KL."""
    model, _ = tiny_model
    ref = TorchBackend(model)
    small = check(ref, Noisy(model, 1e-4), precision)
    assert small["status"] == "passed", small["message"]
    large = check(ref, Noisy(model, 0.5), precision)
    assert large["status"] == "failed" and "mean KL" in large["message"]
    assert large["logits"]["mean_kl"] > TOLERANCES[precision].max_kl


@pytest.mark.cuda
def test_fp16_gate_fails_a_perturbed_export_on_cuda(tiny_model, tmp_path, monkeypatch):
    model, source = tiny_model
    info = export_model(model, source, tmp_path / "good", Precision.fp16)
    assert info.meta["parity"]["status"] == "passed" and info.meta["parity"]["provider"] == "cuda"
    real_fuse = build.fuse

    def fuse_then_perturb(raw, fused, cfg, precision):
        _perturb_matrix(raw, 1.5)
        return real_fuse(raw, fused, cfg, precision)

    monkeypatch.setattr(build, "fuse", fuse_then_perturb)
    with pytest.raises(ParityError, match="fp16 export is out of tolerance"):
        export_model(model, source, tmp_path / "bad", Precision.fp16)
