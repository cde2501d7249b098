"""`gpt2x serve` as a user runs it: bad options are one line and a non-zero exit before anything
starts; a running server answers, and SIGTERM stops it cleanly (exit 0, its port free again)."""

from __future__ import annotations

import json
import os
import select
import signal
import socket
import subprocess
import sys
import time

import pytest

httpx = pytest.importorskip("httpx")
pytest.importorskip("ray")

from gpt2x.choices import Precision  # noqa: E402
from gpt2x.workflows import export_by_name  # noqa: E402

from .conftest import run_cli  # noqa: E402
from .test_cli import assert_one_line_error  # noqa: E402
from .test_serve import free_port  # noqa: E402

KEY = "sekret-key-42"


@pytest.fixture(scope="module")
def export_dir(tmp_path_factory):
    folder = tmp_path_factory.mktemp("serve-cli") / "shakespeare-fp32"
    export_by_name("shakespeare", folder, Precision.fp32)
    return folder


@pytest.mark.parametrize("args,code,fragment", [
    (["--replicas", "0"], 2, "--replicas must be at least 1"),
    (["--replicas", "64"], 2, "CPUs"),
    (["--port", "70000"], 2, "--port must be in [0, 65535]"),
    (["--backend", "torch"], 2, "not served"),
    (["--max-batch-size", "0"], 2, "--max-batch-size must be >= 1"),
    (["--precision", "int8"], 2, "is a fp32 export, not int8"),
])
def test_bad_options_are_one_line(export_dir, args, code, fragment):
    r = run_cli("serve", "--onnx", str(export_dir), *args, timeout=120)
    assert_one_line_error(r.returncode, r.stderr, code, fragment)


def test_missing_export_and_busy_port_are_one_line(export_dir, tmp_path):
    r = run_cli("serve", "--onnx", str(tmp_path / "nothing"), timeout=120)
    assert_one_line_error(r.returncode, r.stderr, 6, "nothing")
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        r = run_cli("serve", "--onnx", str(export_dir), "--port", str(port), timeout=120)
    assert_one_line_error(r.returncode, r.stderr, 2, f"--port {port} on 127.0.0.1 is in use")


def read_line(proc: subprocess.Popen, timeout: float) -> str:
    deadline = time.time() + timeout
    while time.time() < deadline:
        ready, _, _ = select.select([proc.stdout], [], [], 1.0)
        if ready:
            return proc.stdout.readline()
        if proc.poll() is not None:
            break
    raise AssertionError(f"no line from gpt2x serve within {timeout} s: {proc.stderr.read() if proc.poll() is not None else ''}")


def test_serve_answers_and_stops_cleanly_on_sigterm(export_dir):
    port = free_port()
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "GPT2X_API_KEY": KEY}
    proc = subprocess.Popen([sys.executable, "-m", "gpt2x", "serve", "--onnx", str(export_dir), "--port", str(port),
                             "--json", "--threads", "1"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        ready = json.loads(read_line(proc, 180))
        assert ready["url"] == f"http://127.0.0.1:{port}" and ready["model"] == "shakespeare" and ready["api_key"] is True
        assert KEY not in json.dumps(ready)
        r = httpx.post(f"{ready['url']}/v1/completions", json={"prompt": "ROMEO:", "max_tokens": 4},
                       headers={"Authorization": f"Bearer {KEY}"}, timeout=60)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] <= 4
        assert httpx.get(f"{ready['url']}/health", timeout=10).status_code == 401
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(90)
        err = proc.stderr.read()
        assert code == 0, err
        assert err.strip().splitlines()[-1] == "stopped" and "Traceback" not in err
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))  # the port is free again
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
