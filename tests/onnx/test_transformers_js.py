"""The transformers.js folder (`gpt2x export --layout transformers.js`, gpt2x.onnx.transformers_js):
its files and names, each graph checked against its source export by ONNX Runtime, its metadata, the
one-line errors, that a failed write leaves nothing, and (with benchmarks/interop's node_modules, or
GPT2X_REQUIRE_TRANSFORMERS_JS=1) transformers.js itself in Node generating gpt2x's tokens.

Exports of the bundled model go to tmp folders (never the repository's exported/), without the
parity gate: what is tested is the copy, not the export."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest

from gpt2x.choices import Precision
from gpt2x.errors import ArtifactError, OutputError, UsageError
from gpt2x.fileio import sha256
from gpt2x.onnx import interop
from gpt2x.onnx import names as io
from gpt2x.onnx import transformers_js as tjs
from gpt2x.onnx.artifact import EXPORTS_ENV, read_export
from gpt2x.workflows.exports import export_model
from gpt2x.workflows.models import load_model

from ..helpers import REPO, assert_one_line_error, cli

PRECISIONS = (Precision.fp32, Precision.int8, Precision.int4)


@pytest.fixture(scope="module")
def exports(tmp_path_factory, bundled_export):
    """A tmp folder whose exported/ holds shakespeare-{fp32,int8,int4} (links to the run's shared
    exports: the layout ensure_export looks for under GPT2X_EXPORTS)."""
    root = tmp_path_factory.mktemp("tjs-exports")
    infos = {p: bundled_export(p) for p in PRECISIONS}
    (root / "exported").mkdir()
    for info in infos.values():
        (root / "exported" / info.folder.name).symlink_to(info.folder, target_is_directory=True)
    return root, infos


@pytest.fixture(scope="module")
def written(exports, tmp_path_factory):
    _, infos = exports
    out = tmp_path_factory.mktemp("tjs-out") / "shakespeare-transformers.js"
    return tjs.write_transformers_js(list(infos.values())[::-1], out)  # any order in, fp32/int8/int4 out


def test_files_and_names(written):
    folder = written.folder
    want = sorted(["onnx/model.onnx", "onnx/model_quantized.onnx", "onnx/model_q4.onnx", tjs.SOURCES_FILE,
                   *tjs.TOP_FILES])
    assert written.files == want
    assert sorted(str(p.relative_to(folder)) for p in folder.rglob("*") if p.is_file()) == want  # nothing else, no temporaries
    assert not [p for p in folder.parent.iterdir() if p.name.startswith(".")]  # no partial folder left beside it
    cfg = json.loads((folder / interop.HF_CONFIG_FILE).read_text())
    assert cfg["model_type"] == "gpt2" and cfg["use_cache"] is True
    assert cfg["transformers.js_config"] == {"dtype": "fp32"}
    source = Path(written.meta["onnx"]["onnx/model.onnx"]["source"])
    for name in tjs.TOP_FILES:  # interop.py's files, config.json with transformers.js_config added
        if name != interop.HF_CONFIG_FILE:
            assert (folder / name).read_bytes() == (source / name).read_bytes(), name
    assert cfg == json.loads((source / interop.HF_CONFIG_FILE).read_text()) | {"transformers.js_config": {"dtype": "fp32"}}


def test_metadata_records_the_sources(written, exports):
    _, infos = exports
    meta = tjs.read_sources(written.folder)
    assert meta == written.meta
    assert meta["model"]["name"] == "shakespeare" and meta["default_dtype"] == "fp32"
    assert list(meta["onnx"]) == [tjs.ONNX_FILES[p] for p in PRECISIONS]
    for p in PRECISIONS:
        graph = meta["onnx"][tjs.ONNX_FILES[p]]
        assert graph["precision"] == p.value and graph["dtype"] == tjs.DTYPES[p]
        assert Path(graph["source"]) == infos[p].folder.resolve()
        assert graph["sha256"] == infos[p].meta["files"]["model.onnx"] == sha256(written.folder / tjs.ONNX_FILES[p])
    assert meta["files"] == {n: sha256(written.folder / n) for n in tjs.TOP_FILES}


def test_each_graph_gives_its_source_exports_logits(written, exports):
    """An independent check of the copies: ONNX Runtime on each copied graph and on its source export,
    the same random prompt and an empty past, the same logits (and the Optimum I/O names)."""
    _, infos = exports
    cfg = infos[Precision.fp32].config
    rng = np.random.default_rng(0)
    ids = rng.integers(0, cfg.vocab_size, size=(2, 7), dtype=np.int64)
    feed = {io.INPUT_IDS: ids, io.ATTENTION_MASK: np.ones_like(ids), io.POSITION_IDS: np.tile(np.arange(7), (2, 1))}
    for i in range(cfg.n_layer):
        for name in (io.past_key(i), io.past_value(i)):
            feed[name] = np.zeros((2, cfg.n_head, 0, cfg.head_dim), dtype=np.float32)
    for p in PRECISIONS:
        copy = ort.InferenceSession(str(written.folder / tjs.ONNX_FILES[p]), providers=["CPUExecutionProvider"])
        source = ort.InferenceSession(str(infos[p].model_path), providers=["CPUExecutionProvider"])
        assert [i.name for i in copy.get_inputs()] == io.input_names(cfg.n_layer)
        assert [o.name for o in copy.get_outputs()] == io.output_names(cfg.n_layer)
        got, want = copy.run([io.LOGITS], feed)[0], source.run([io.LOGITS], feed)[0]
        assert got.shape == (2, 7, cfg.vocab_size)
        np.testing.assert_array_equal(got, want)


def test_bad_inputs_are_one_clear_error(exports, tmp_path, tiny_hf):
    _, infos = exports
    out = tmp_path / "out"
    with pytest.raises(UsageError, match="no exports given"):
        tjs.write_transformers_js([], out)
    with pytest.raises(UsageError, match="two fp32 exports"):
        tjs.write_transformers_js([infos[Precision.fp32], infos[Precision.fp32]], out)
    fp16 = read_export(infos[Precision.fp32].folder)
    fp16.meta = fp16.meta | {"precision": "fp16"}
    with pytest.raises(UsageError, match="fp16 export"):
        tjs.write_transformers_js([fp16], out)
    other = export_model(*load_model(str(tiny_hf[0])), tmp_path / "tiny", Precision.int8, check_parity=False)
    with pytest.raises(ArtifactError, match="different models"):
        tjs.write_transformers_js([infos[Precision.fp32], other], out)
    with pytest.raises(UsageError, match="not fp16"):
        tjs.check_precisions([Precision.fp16])
    assert not out.exists() and sorted(p.name for p in tmp_path.iterdir()) == ["tiny"]


def test_external_data_is_refused(exports, tmp_path):
    _, infos = exports
    folder = tmp_path / "ext"
    shutil.copytree(infos[Precision.fp32].folder, folder)
    info = read_export(folder)  # read first: the re-saved graph no longer matches gpt2x.json's sizes
    proto = onnx.load(str(folder / "model.onnx"))
    onnx.save_model(proto, str(folder / "model.onnx"), save_as_external_data=True, location="model.onnx.data")
    with pytest.raises(ArtifactError, match="external data"):
        tjs.write_transformers_js([info], tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_failure_leaves_nothing_and_keeps_the_old_folder(exports, written, tmp_path, monkeypatch):
    _, infos = exports
    out = tmp_path / "x-transformers.js"
    with pytest.raises(OutputError, match="exists"):
        tjs.write_transformers_js([infos[Precision.fp32]], written.folder)
    tjs.write_transformers_js([infos[Precision.fp32]], out)
    before = {p: p.read_bytes() for p in out.rglob("*") if p.is_file()}

    def broken_copy(info, dest):
        dest.write_bytes(b"half")
        raise ArtifactError("copy failed")

    monkeypatch.setattr(tjs, "_copy_checked", broken_copy)
    with pytest.raises(ArtifactError, match="copy failed"):
        tjs.write_transformers_js([infos[Precision.int4]], out, force=True)
    assert {p: p.read_bytes() for p in out.rglob("*") if p.is_file()} == before  # the old folder, untouched
    assert sorted(p.name for p in tmp_path.iterdir()) == [out.name]  # no partial folder left


def test_a_changed_source_graph_is_refused(exports, tmp_path):
    _, infos = exports
    folder = tmp_path / "changed"
    shutil.copytree(infos[Precision.int4].folder, folder)
    data = bytearray((folder / "model.onnx").read_bytes())
    data[-1] ^= 1  # same size, so read_export does not notice; the copy's sha256 does
    (folder / "model.onnx").write_bytes(bytes(data))
    with pytest.raises(ArtifactError, match="changed since export"):
        tjs.write_transformers_js([read_export(folder)], tmp_path / "out")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["changed"]


def test_cli_and_workflow(exports, capsys, monkeypatch):
    """`gpt2x export --layout transformers.js` through export_transformers_js: the exports in
    exported/MODEL-PRECISION reused, the default folder, --json, --force, the one-line errors."""
    root, infos = exports
    monkeypatch.chdir(root)
    monkeypatch.setenv(EXPORTS_ENV, str(root / "exported"))
    code, out, err = cli(capsys, "export", "--layout", "transformers.js", "--precision", "int4")
    assert code == 0, err
    folder = root / "exported/shakespeare-transformers.js"
    lines = out.strip().splitlines()
    assert lines[0] == f"wrote shakespeare for transformers.js to {folder}"
    assert lines[1].startswith("  onnx/model_q4.onnx  dtype q4  (from ") and "shakespeare-int4" in lines[1]
    meta = tjs.read_sources(folder)
    assert list(meta["onnx"]) == ["onnx/model_q4.onnx"] and meta["default_dtype"] == "q4"
    assert meta["onnx"]["onnx/model_q4.onnx"]["sha256"] == infos[Precision.int4].meta["files"]["model.onnx"]

    code, _, err = cli(capsys, "export", "--layout", "transformers.js")
    assert_one_line_error(code, err, OutputError.exit_code, "pass --force to replace it")

    code, out, err = cli(capsys, "export", "--layout", "transformers.js", "--force", "--json")
    assert code == 0, err
    result = json.loads(out)
    assert result["folder"] == str(folder) and result["layout"] == "transformers.js"
    assert list(result["onnx"]) == [tjs.ONNX_FILES[p] for p in PRECISIONS]
    assert "onnx/model_quantized.onnx" in result["contents"] and result["files"] == tjs.read_sources(folder)["files"]

    code, _, err = cli(capsys, "export", "--layout", "transformers.js", "--precision", "fp16", "--out", "x")
    assert_one_line_error(code, err, UsageError.exit_code, "not fp16")
    code, _, err = cli(capsys, "export", "--layout", "transformers.js", "--no-check-parity", "--out", "x")
    assert_one_line_error(code, err, UsageError.exit_code, "--no-check-parity")
    assert not Path("x").exists()
    code, _, err = cli(capsys, "export", "--layout", "webgpu")
    assert code == 2 and "webgpu" in err


NODE_MODULES = REPO / "benchmarks" / "interop" / "node_modules" / "@huggingface" / "transformers"


def test_transformers_js_in_node_generates_gpt2x_tokens(exports, tmp_path):
    """benchmarks/check_interop.py --transformers-js on the bundled model's fp32 and int4 exports:
    transformers.js loads the folder in Node and its greedy tokens and prompt ids are gpt2x's."""
    if not (NODE_MODULES.is_dir() and shutil.which("node")):
        reason = "transformers.js is not installed (npm ci --prefix benchmarks/interop) or node is not on PATH"
        if os.environ.get("GPT2X_REQUIRE_TRANSFORMERS_JS") == "1":
            pytest.fail(reason + ", and GPT2X_REQUIRE_TRANSFORMERS_JS=1 requires it")
        pytest.skip(reason)
    _, infos = exports
    out = tmp_path / "interop"
    run = subprocess.run([sys.executable, str(REPO / "benchmarks" / "check_interop.py"), "--transformers-js",
                          "--onnx", str(infos[Precision.fp32].folder), "--onnx", str(infos[Precision.int4].folder),
                          "--new-tokens", "24", "--out", str(out)], capture_output=True, text=True, encoding="utf-8", timeout=600)
    assert run.returncode == 0, run.stdout + run.stderr
    results = json.loads(out.with_suffix(".json").read_text())
    assert results["passed"] and results["transformers.js"]["tokenizer"]["ids_equal"]
    dtypes = results["transformers.js"]["dtypes"]
    assert set(dtypes) == {"fp32", "q4"}
    for dtype, d in dtypes.items():
        assert d["loaded_our_file"] and d["tokens_equal"] and d["batch"]["tokens_equal"], (dtype, d)
        assert all(len(t) > 0 for t in d["transformers_js_tokens"])
