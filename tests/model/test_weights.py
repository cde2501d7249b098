"""Loading from local folders and files, and every way loading can fail."""

from __future__ import annotations

import json
import pickle

import pytest
import torch
from safetensors.torch import load_file, save_file

from gpt2x.errors import HubError, ModelNotFoundError, WeightsError
from gpt2x.model.checkpoints import resolve_config
from gpt2x.model.config import GPT2Config
from gpt2x.model.weights import load_model

from ..helpers import TINY, make_hf_model


@pytest.fixture
def folder(tmp_path):
    make_hf_model(tmp_path, seed=5)
    return tmp_path


def rewrite(folder, edit):
    sd = load_file(folder / "model.safetensors")
    edit(sd)
    save_file(sd, folder / "model.safetensors")


def test_lone_safetensors_file_with_inferred_config(tmp_path):
    make_hf_model(tmp_path, seed=6, n_embd=64, n_head=1)  # inference assumes GPT-2's head size 64
    lone = tmp_path / "weights" / "tiny.safetensors"
    lone.parent.mkdir()
    lone.write_bytes((tmp_path / "model.safetensors").read_bytes())
    model, source = load_model(str(lone))
    assert model.config == GPT2Config(**{**TINY, "n_embd": 64, "n_head": 1})
    assert source.kind == "local"


def test_missing_tensor_is_named(folder):
    rewrite(folder, lambda sd: sd.pop("transformer.h.1.mlp.c_fc.bias"))
    with pytest.raises(WeightsError, match=r"missing h\.1\.mlp\.c_fc\.bias"):
        load_model(str(folder))


def test_unexpected_tensor_is_named(folder):
    rewrite(folder, lambda sd: sd.update({"transformer.h.0.attn.extra": torch.zeros(3)}))
    with pytest.raises(WeightsError, match=r"unexpected h\.0\.attn\.extra"):
        load_model(str(folder))


def test_wrong_shape_is_named(folder):
    rewrite(folder, lambda sd: sd.update({"transformer.wpe.weight": torch.zeros(10, 32)}))
    with pytest.raises(WeightsError, match=r"wrong shape wpe\.weight \(10, 32\) \(expected \(64, 32\)\)"):
        load_model(str(folder))


def test_not_a_gpt2_config(folder):
    cfg = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**cfg, "model_type": "llama"}))
    with pytest.raises(WeightsError, match="not a GPT-2 config"):
        load_model(str(folder))


def test_unsupported_variant(folder):
    cfg = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**cfg, "activation_function": "relu"}))
    with pytest.raises(WeightsError, match="activation_function"):
        load_model(str(folder))


def test_folder_without_weights_or_config(tmp_path):
    with pytest.raises(ModelNotFoundError, match="no config.json"):
        load_model(str(tmp_path))
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2"}))
    with pytest.raises(ModelNotFoundError, match="no model.safetensors"):
        load_model(str(tmp_path))


def test_nonexistent_path():
    with pytest.raises(ModelNotFoundError, match="no such file"):
        load_model("./does/not/exist")


class Evil:
    def __reduce__(self):
        return (print, ("pwned",))


def test_pickle_with_code_is_refused(tmp_path):
    make_hf_model(tmp_path, seed=7, safe=False)
    sd = torch.load(tmp_path / "pytorch_model.bin", weights_only=True)
    sd["evil"] = Evil()
    with open(tmp_path / "pytorch_model.bin", "wb") as f:
        pickle.dump(sd, f)
    with pytest.raises(WeightsError, match="never unpickles code"):
        load_model(str(tmp_path))


def test_offline_and_not_cached(monkeypatch, tmp_path):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path))
    import huggingface_hub.constants as c

    monkeypatch.setattr(c, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(c, "HF_HUB_CACHE", str(tmp_path / "hub"))
    with pytest.raises(HubError, match="bundled model 'shakespeare'"):
        load_model("gpt2")


def test_preset_config_needs_no_download():
    assert resolve_config("gpt2-xl").n_layer == 48


def _hub_error(cls, message: str):
    """An instance of a huggingface_hub error without a live HTTP response."""
    e = cls.__new__(cls)
    Exception.__init__(e, message)
    return e


@pytest.fixture
def fake_hub(monkeypatch, tmp_path):
    """huggingface_hub's hf_hub_download served from a local folder (no network): records requests."""
    import huggingface_hub
    from huggingface_hub.errors import EntryNotFoundError

    repo = tmp_path / "repo"
    make_hf_model(repo, seed=9, safe=False)  # a repo with pytorch_model.bin only
    asked = []

    def download(repo_id, filename, revision=None, **kw):
        asked.append((repo_id, filename, revision))
        if not (repo / filename).exists():
            raise _hub_error(EntryNotFoundError, f"{filename} not found")
        return str(repo / filename)

    monkeypatch.setattr(huggingface_hub, "hf_hub_download", download)
    return asked


def test_hub_path_downloads_config_first_then_weights(fake_hub):
    model, source = load_model("someone/tiny-gpt2", revision="abc123")
    assert source.kind == "hub" and source.revision == "abc123"
    assert [f for _, f, _ in fake_hub] == ["config.json", "model.safetensors", "model.safetensors.index.json", "pytorch_model.bin"]
    assert all(r == "abc123" for _, _, r in fake_hub)


@pytest.mark.parametrize("error,expected,fragment", [
    ("RepositoryNotFoundError", ModelNotFoundError, "unknown model"),
    ("RevisionNotFoundError", ModelNotFoundError, "revision"),
    ("HfHubHTTPError", HubError, "hub error"),
])
def test_hub_errors_are_mapped(monkeypatch, error, expected, fragment):
    import huggingface_hub
    import huggingface_hub.errors as hub_errors

    def download(*a, **k):
        raise _hub_error(getattr(hub_errors, error), "500 Server Error\nmore lines")

    monkeypatch.setattr(huggingface_hub, "hf_hub_download", download)
    with pytest.raises(expected, match=fragment):
        load_model("someone/missing")


def test_offline_with_config_cached_but_weights_not(monkeypatch, tmp_path):
    """A cache miss on the weights while offline is the offline error, not 'repo has no weights'."""
    import huggingface_hub
    from huggingface_hub.errors import LocalEntryNotFoundError

    make_hf_model(tmp_path, seed=3)

    def download(repo_id, filename, revision=None, **kw):
        if filename == "config.json":
            return str(tmp_path / "config.json")
        raise _hub_error(LocalEntryNotFoundError, "not cached")

    monkeypatch.setattr(huggingface_hub, "hf_hub_download", download)
    with pytest.raises(HubError, match="not in the local cache"):
        load_model("someone/tiny")


def test_no_dns_means_cache_only_without_retries(monkeypatch, tmp_path):
    """Without DNS for the hub, downloads go straight to the cache (no 25 s of retries)."""
    import socket

    import huggingface_hub

    make_hf_model(tmp_path, seed=4)
    seen = []

    def download(repo_id, filename, revision=None, local_files_only=False, **kw):
        seen.append(local_files_only)
        return str(tmp_path / filename)

    def no_dns(*a, **k):
        raise socket.gaierror(-2, "Name or service not known")

    monkeypatch.setattr(socket, "getaddrinfo", no_dns)
    monkeypatch.setattr(huggingface_hub, "hf_hub_download", download)
    load_model("someone/cached-model")
    assert seen and all(seen)
