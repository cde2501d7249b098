"""Shared fixtures: tiny GPT-2s with random weights, saved by transformers in Hugging Face layout
(so our loader is tested against files it did not write), and a runner for the real CLI."""

from __future__ import annotations

import os

# No test touches the network: huggingface_hub reads this when it is first imported.
os.environ["HF_HUB_OFFLINE"] = "1"

import socket  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import threading  # noqa: E402
import time  # noqa: E402
from contextlib import contextmanager  # noqa: E402
from pathlib import Path  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402
from hypothesis import settings  # noqa: E402

# CI runs property tests derandomized: the same examples every run, so a failure is reproducible.
settings.register_profile("ci", derandomize=True, print_blob=True)
if os.environ.get("CI"):
    settings.load_profile("ci")

REPO = Path(__file__).resolve().parent.parent
# Prompts of different lengths: generated as one batch, they exercise left padding.
PROMPTS = ["ROMEO:", "The king is dead, and", "What light through yonder window breaks? It is the east"]
TINY = dict(vocab_size=50257, n_positions=64, n_embd=32, n_layer=2, n_head=4)


def make_hf_model(folder: Path, seed: int = 0, safe: bool = True, **overrides):
    """A random-weight transformers GPT2LMHeadModel saved to `folder`; returns the HF model."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(seed)
    cfg = GPT2Config(**{**TINY, **overrides}, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    model = GPT2LMHeadModel(cfg).eval()
    with torch.no_grad():  # larger-than-default weights make differences visible in the logits
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    model.save_pretrained(folder)
    if not safe:  # a pickled checkpoint, as older hub repos have (transformers 5 writes safetensors only)
        from safetensors.torch import load_file

        path = folder / "model.safetensors"
        torch.save(load_file(path), folder / "pytorch_model.bin")
        path.unlink()
    return model


@pytest.fixture(scope="session")
def tiny_hf(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tiny-hf")
    model = make_hf_model(folder)
    return folder, model


@pytest.fixture(scope="session")
def export_dir(tmp_path_factory):
    """The bundled model's fp32 export (parity-gated), made once for the tests that serve or score it;
    they only read it."""
    from gpt2x.choices import Precision
    from gpt2x.workflows import export_by_name

    folder = tmp_path_factory.mktemp("shakespeare") / "shakespeare-fp32"
    export_by_name("shakespeare", folder, Precision.fp32)
    return folder


@pytest.fixture(scope="module")
def reference(export_dir):
    """A second backend over that export, in the test's process: the independent forwards (gpt2x's
    own generation code) that every served answer is checked against."""
    from gpt2x.onnx.artifact import read_export
    from gpt2x.runtime.ort import OrtBackend

    return OrtBackend(read_export(export_dir), threads=1)


def run_cli(*args: str, env: dict | None = None, stdin: str | None = None, timeout: int = 300) -> subprocess.CompletedProcess:
    """`python -m gpt2x ARGS` in a subprocess, as a user runs it."""
    full_env = {k: v for k, v in os.environ.items() if k != "GPT2X_DEBUG"}
    full_env.update({"HF_HUB_OFFLINE": "1", **(env or {})})
    return subprocess.run(
        [sys.executable, "-m", "gpt2x", *args], capture_output=True, text=True, env=full_env,
        input=stdin, timeout=timeout,
    )


@contextmanager
def uvicorn_server(app):
    """`app` on uvicorn, 127.0.0.1 and an ephemeral port, in a thread of this process; yields the port."""
    import uvicorn

    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="off"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.time() + 30
    while not server.started and time.time() < deadline:
        time.sleep(0.05)
    assert server.started
    try:
        yield port
    finally:
        server.should_exit = True
        thread.join(10)
        sock.close()


def cuda_loads() -> bool:
    from gpt2x.runtime.providers import available_providers

    return available_providers()["loadable"]["cuda"] == "ok"


def pytest_collection_modifyitems(config, items):
    """Tests marked `cuda` run wherever ONNX Runtime's CUDA provider loads. Elsewhere they are skipped,
    saying why, unless they were asked for (`-m cuda`): then they run, and fail, rather than report
    a GPU run that did not happen."""
    cuda_items = [item for item in items if item.get_closest_marker("cuda")]
    if not cuda_items or cuda_loads():
        return
    markexpr = config.getoption("markexpr") or ""
    if "cuda" in markexpr and "not cuda" not in markexpr:
        return
    skip = pytest.mark.skip(reason="ONNX Runtime's CUDA provider does not load on this machine (gpt2x info says why)")
    for item in cuda_items:
        item.add_marker(skip)
