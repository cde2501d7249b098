"""`gpt2x serve --model BASE --adapter NAME=FOLDER`: random PEFT LoRA adapters on a tiny GPT-2, each merged and exported
once by the command (a second start reuses the exports), served in this process beside the base as models of their
own: each adapter's greedy completion is PEFT's merged model's greedy continuation and its export's, the base's is
unchanged; /v1/models lists each adapter with its base as parent (vLLM's LoRA modules); every refusal is one line,
before any export."""

from __future__ import annotations

import io
from contextlib import redirect_stderr, redirect_stdout
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from peft import IA3Config, PeftModel, get_peft_model

from gpt2x.errors import ModelNotFoundError, WeightsError
from gpt2x.generation.generate import generate
from gpt2x.generation.settings import SamplingSettings
from gpt2x.onnx.artifact import EXPORTS_ENV, read_export
from gpt2x.runtime.ort import OrtBackend
from gpt2x.serve import single_process
from gpt2x.tokenizer import decode, encode

from ..helpers import assert_one_line_error, cli, make_hf_model, served_models
from ..model.test_adapters import CONFIG, hf_base, make_lora

PROMPT = "ROMEO:"
TOKENS = 8


@pytest.fixture(scope="module")
def base_dir(tmp_path_factory):
    folder = tmp_path_factory.mktemp("base")
    make_hf_model(folder, seed=7, **CONFIG)
    return folder


@pytest.fixture(scope="module")
def loras(tmp_path_factory, base_dir):
    """Two adapters: one on every Conv1D layer, one on c_attn only (LoRA's usual target)."""
    root = tmp_path_factory.mktemp("adapters")
    return {"poet": make_lora(root / "poet-lora", hf_base(base_dir), seed=1),
            "legal": make_lora(root / "legal-lora", hf_base(base_dir), seed=2, target_modules=["c_attn"])}


@pytest.fixture(scope="module")
def exports_root(tmp_path_factory):
    return tmp_path_factory.mktemp("exports")


def prepare(capsys, monkeypatch, exports_root, *args: str):
    """The command run up to the server (exports made or found, every check passed): (exit code, stderr, the configs
    it would serve, the base's first)."""
    started = {}

    def serve_in_process(config, settings, ready, progress, others=(), **kw):
        started["configs"] = [config, *others]

    capsys.readouterr()  # what the test printed before (transformers' progress bars) is not the command's
    monkeypatch.setenv(EXPORTS_ENV, str(exports_root))
    monkeypatch.setattr(single_process, "serve_in_process", serve_in_process)
    port = () if "--port" in args else ("--port", "0")  # nothing listens: the server is not started
    code, _, err = cli(capsys, "serve", *args, *port)
    return code, err, started.get("configs")


@pytest.fixture(scope="module")
def served(base_dir, loras, exports_root):
    """The command's configs, the first start's stderr, and a second start's (its exports reused)."""
    capture = _Capture()
    with pytest.MonkeyPatch.context() as mp, redirect_stdout(capture.out), redirect_stderr(capture.err):
        args = ["--model", str(base_dir), *(a for name, f in loras.items() for a in ("--adapter", f"{name}={f}"))]
        first = prepare(capture, mp, exports_root, *args)
        second = prepare(capture, mp, exports_root, *args)
    assert first[0] == 0 and second[0] == 0, first[1] + second[1]
    return first[2], first[1], second


class _Capture:
    """capsys's readouterr for a module-scoped fixture (capsys is a test's): what went to stdout and stderr since."""

    def __init__(self):
        self.out, self.err = io.StringIO(), io.StringIO()

    def readouterr(self):
        out, err = self.out.getvalue(), self.err.getvalue()
        for stream in (self.out, self.err):
            stream.seek(0)
            stream.truncate()
        return SimpleNamespace(out=out, err=err)


def greedy_on(folder) -> str:
    backend = OrtBackend(read_export(Path(folder)), threads=1)
    try:
        return decode(generate(backend, [PROMPT], SamplingSettings(max_new_tokens=TOKENS, greedy=True))[0].tokens)
    finally:
        backend.close()


def pefts_greedy(base_dir, lora_dir) -> str:
    """PEFT's merged model's greedy continuation, token by token (no transformers generation settings involved)."""
    model = PeftModel.from_pretrained(hf_base(base_dir), str(lora_dir)).merge_and_unload().eval()
    ids = list(encode(PROMPT))
    with torch.no_grad():
        for _ in range(TOKENS):
            ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
    return decode(ids[len(encode(PROMPT)):])


@pytest.fixture(scope="module")
def client(served):
    with served_models([single_process.model_slot(c) for c in served[0]]) as c:
        yield c


def complete(client, model: str) -> str:
    r = client.post("/v1/completions", json={"model": model, "prompt": PROMPT, "max_tokens": TOKENS, "temperature": 0})
    assert r.status_code == 200, r.text
    assert r.json()["model"] == model
    return r.json()["choices"][0]["text"]


def test_each_adapter_is_exported_once_merged_and_a_restart_reuses_it(served, loras, exports_root):
    configs, first_err, (_, second_err, second) = served
    ids = [c.model_id for c in configs]
    assert ids[1:] == ["poet", "legal"] and [c.parent for c in configs] == [None, ids[0], ids[0]]
    for config, folder in zip(configs[1:], loras.values()):
        record = read_export(Path(config.export)).meta["model"]["adapter"]
        assert record["path"] == str(folder.resolve()) and record["parity"]["status"] == "passed"
        assert config.export.startswith(str(exports_root))
    assert first_err.count("no export at") == 3  # the base, then each adapter's merged export
    assert "no export at" not in second_err and [c.export for c in second] == [c.export for c in configs]


def test_adapters_answer_as_peft_merged_models_and_the_base_is_unchanged(client, served, base_dir, loras):
    configs = served[0]
    base = complete(client, configs[0].model_id)
    assert base == greedy_on(configs[0].export)
    texts = {}
    for config, (name, folder) in zip(configs[1:], loras.items()):
        texts[name] = complete(client, name)
        assert texts[name] == greedy_on(config.export) == pefts_greedy(base_dir, folder)
    assert len({base, *texts.values()}) == 3  # each adapter changes the model: the routing is seen
    assert complete(client, configs[0].model_id) == base


def test_models_lists_each_adapter_with_its_base_as_parent(client, served, loras):
    configs = served[0]
    cards = client.get("/v1/models").json()["data"]
    base = configs[0].model_id
    assert [(c["id"], c["parent"]) for c in cards] == [(base, None), ("poet", base), ("legal", base)]
    assert [c["root"] for c in cards] == [configs[0].export, *(str(f.resolve()) for f in loras.values())]
    assert all(c["object"] == "model" and c["max_model_len"] == 96 for c in cards)


def test_every_refusal_is_one_line_before_any_export(capsys, monkeypatch, tmp_path, base_dir, loras):
    ia3 = tmp_path / "ia3"
    get_peft_model(hf_base(base_dir), IA3Config(target_modules=["c_attn"], feedforward_modules=[])).save_pretrained(ia3)
    other = tmp_path / "other-base"
    make_hf_model(other, seed=3, n_positions=96, n_embd=64)
    wide = make_lora(tmp_path / "wide-lora", hf_base(other))
    poet = loras["poet"]
    cases = [
        (["--model", str(base_dir), "--adapter", str(poet)], 2, "NAME=FOLDER"),
        (["--model", str(base_dir), "--adapter", f"={poet}"], 2, "NAME=FOLDER"),
        (["--model", str(base_dir), "--adapter", f"a={poet}", "--adapter", f"a={loras['legal']}"], 2, "'a' is served already"),
        (["--model", str(base_dir), "--adapter", f"{base_dir}={poet}"], 2, "served already"),
        (["--model", str(base_dir), "--adapter", f"a={poet}", "--adapter", f"b={tmp_path / 'x' / poet.name}"], 2,
         "one folder name"),
        (["--onnx", str(tmp_path), "--adapter", f"a={poet}"], 2, "exactly one --model"),
        (["--model", str(base_dir), "--model", "gpt2", "--adapter", f"a={poet}"], 2, "exactly one --model"),
        (["--model", str(base_dir), "--adapter", f"a={tmp_path}"], WeightsError.exit_code, "not a PEFT adapter folder"),
        (["--model", str(base_dir), "--adapter", f"a={ia3}"], WeightsError.exit_code, "LoRA adapters only"),
        (["--model", str(base_dir), "--adapter", f"a={wide}"], WeightsError.exit_code, "does not fit the base"),
        (["--model", str(base_dir), "--adapter", f"a={tmp_path / 'missing'}"], ModelNotFoundError.exit_code, "no such adapter folder"),
    ]
    for args, code, fragment in cases:
        got, err, configs = prepare(capsys, monkeypatch, tmp_path / "exports", *args)
        assert configs is None
        assert_one_line_error(got, err, code, fragment)
        assert not (tmp_path / "exports").exists()  # nothing exported, not even the base
