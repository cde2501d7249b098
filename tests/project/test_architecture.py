"""The package's structure, checked rather than described: the import contracts (layers, no cycles, no
torch on the ONNX Runtime path), and the ONNX Runtime path run in a process where torch, onnxscript
and transformers cannot be imported at all."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest

from gpt2x.errors import MissingDependencyError

from ..helpers import REPO, run_gpt2x


def test_import_contracts_hold():
    """import-linter's contracts in pyproject.toml: the layers, no cycles (imports inside functions
    counted), and no torch/onnxscript/transformers reachable from the ONNX Runtime path."""
    exe = shutil.which("lint-imports", path=str(REPO / ".venv" / "bin")) or shutil.which("lint-imports")
    assert exe, "import-linter is part of the test extra"
    r = subprocess.run([exe, "--no-cache"], capture_output=True, text=True, encoding="utf-8", cwd=REPO, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "5 kept, 0 broken" in r.stdout


def test_cli_imports_no_torch():
    code = "import sys, gpt2x.cli.app, gpt2x.bench.run, gpt2x.runtime.registry; " \
           "import gpt2x.workflows.backends, gpt2x.workflows.drafts, gpt2x.workflows.exports, gpt2x.workflows.models; " \
           "import gpt2x.workflows.training, gpt2x.workflows.transformers_js; " \
           "[gpt2x.cli.app.command_module(c) for c in gpt2x.cli.app.COMMANDS]; " \
           "print(sorted(m for m in ('torch', 'onnxscript', 'transformers') if m in sys.modules))"
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, encoding="utf-8", timeout=120)
    assert r.returncode == 0 and r.stdout.strip() == "[]", r.stdout + r.stderr


@pytest.fixture(scope="module")
def deployed(tmp_path_factory, export_dir):
    """A folder holding exported/shakespeare-fp32, made by the full install (with torch): a copy of the
    run's shared export."""
    root = tmp_path_factory.mktemp("deploy")
    shutil.copytree(export_dir, root / "exported" / "shakespeare-fp32")
    return root


def test_generate_runs_without_torch_and_gives_the_same_text(deployed):
    args = ("generate", "ROMEO:", "--greedy", "--max-new-tokens", "24", "--seed", "0", "--json")
    with_torch = run_gpt2x(*args, cwd=deployed, blocked=False)
    for extra in ((), ("--onnx", "exported/shakespeare-fp32")):  # the default folder, and a given one
        without = run_gpt2x(*args, *extra, cwd=deployed, blocked=True)
        assert without.returncode == 0, without.stderr
        assert json.loads(without.stdout) == json.loads(with_torch.stdout)
        assert len(json.loads(without.stdout)["tokens"]) > 0


def test_bench_info_inspect_verify_run_without_torch(deployed):
    (deployed / "short.txt").write_text("ROMEO: But soft, what light through yonder window breaks? It is the east.")
    r = run_gpt2x("bench", "--backends", "ort", "--precisions", "fp32", "--prompt-len", "4", "--new-tokens", "6",
                  "--repeat", "1", "--text", "short.txt", "--output", "b.json", cwd=deployed, blocked=True)
    assert r.returncode == 0, r.stderr
    result = json.loads((deployed / "b.json").read_text())
    [parity] = result["parity"]
    assert parity["passed"] is True and parity["source"].startswith("recorded at export")
    assert parity["perplexity"] > 1 and result["reference"]["perplexity"] is None
    assert result["speed"][0]["decode_tokens_per_s"] > 0
    info = run_gpt2x("info", "--json", cwd=deployed, blocked=True)
    assert info.returncode == 0 and json.loads(info.stdout)["providers loadable"]["cpu"] == "ok", info.stderr
    inspect = run_gpt2x("inspect", "gpt2", "--json", cwd=deployed, blocked=True)
    assert inspect.returncode == 0 and json.loads(inspect.stdout)["total_params"] == 124_439_808
    verify = run_gpt2x("verify", "exported/shakespeare-fp32", "--json", cwd=deployed, blocked=True)
    assert verify.returncode == 0 and json.loads(verify.stdout)["ok"] is True, verify.stderr


@pytest.mark.parametrize("args", [
    ("export", "--model", "shakespeare", "--out", "new-export"),
    ("generate", "hi", "--backend", "torch"),
    ("generate", "hi", "--precision", "int8"),  # no int8 export yet: exporting it needs torch
    ("bench", "--backends", "torch,ort", "--precisions", "fp32"),
    ("train", "--corpus", "x.txt", "--out", "m"),
])
def test_what_needs_torch_fails_cleanly_without_it(deployed, args):
    r = run_gpt2x(*args, cwd=deployed, blocked=True)
    assert r.returncode == MissingDependencyError.exit_code, r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 or lines[-1].startswith("error: "), r.stderr
    assert "pip install 'gpt2x[export]'" in lines[-1] and "Traceback" not in r.stderr
    assert not (deployed / "new-export").exists() and not (deployed / "exported" / "shakespeare-int8").exists()


@pytest.mark.parametrize("backend,module,install", [
    ("openvino", "openvino", "pip install 'gpt2x[openvino]'"),
    ("genai", "onnxruntime_genai", "pip install --no-deps 'onnxruntime-genai>=0.18'"),
])
def test_a_runtime_that_is_not_installed_is_one_line(deployed, backend, module, install):
    for args in (("generate", "hi", "--backend", backend), ("bench", "--backends", f"ort,{backend}")):
        r = run_gpt2x(*args, cwd=deployed, blocked=True, block=module)
        assert r.returncode == MissingDependencyError.exit_code, r.stderr
        assert r.stderr.strip().splitlines() == [f"error: the {backend} backend needs {module}, which this install lacks: {install}"]


def test_serve_without_its_extras_is_one_line(deployed):
    r = run_gpt2x("serve", cwd=deployed, blocked=True, block="fastapi")
    assert r.returncode == MissingDependencyError.exit_code, r.stderr
    assert r.stderr.strip().splitlines() == ["error: gpt2x serve needs fastapi: pip install 'gpt2x[serve]'"]
    # One machine's one replica needs no Ray (tests/cli/test_serve.py serves so); Ray Serve needs the ray extra.
    r = run_gpt2x("serve", "--ray", cwd=deployed, blocked=True, block="ray")
    assert r.returncode == MissingDependencyError.exit_code, r.stderr
    assert r.stderr.strip().splitlines() == [
        "error: gpt2x serve --ray serves through Ray Serve, which needs ray: pip install 'gpt2x[ray]'"]
