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

import httpx
import pytest
import ray  # noqa: F401 (the test extra's: a broken install fails here, rather than skipping)

from .conftest import run_cli  # noqa: E402
from .test_cli import assert_one_line_error  # noqa: E402

# Every test that starts Ray runs in one pytest-xdist worker, one after another (conftest.RAY_TESTS).
pytestmark = pytest.mark.xdist_group("ray")

KEY = "sekret-key-42"


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


def test_serve_answers_and_stops_cleanly_on_sigterm(export_dir, reserve_port):
    port = reserve_port()
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


def test_deploys_onto_an_existing_ray_cluster_and_leaves_it_running(export_dir, reserve_port):
    """`ray start --head` (blocking, so that stopping it stops its processes), then `gpt2x serve
    --address` onto it: it answers, and SIGTERM removes the application, not the cluster."""
    ray_exe = os.path.join(os.path.dirname(sys.executable), "ray")
    gcs_port, http_port = reserve_port(), reserve_port()
    # A throwaway cluster without Ray's token authentication (the command would otherwise need the
    # cluster's token, as any Ray driver does); its own process group, so that it can be stopped whole.
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "RAY_USAGE_STATS_ENABLED": "0", "RAY_AUTH_MODE": "disabled"}
    head = subprocess.Popen([ray_exe, "start", "--head", "--block", f"--port={gcs_port}", "--num-cpus=2",
                             "--include-dashboard=false", "--node-ip-address=127.0.0.1"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env, start_new_session=True)
    proc = None
    try:
        address = f"127.0.0.1:{gcs_port}"
        proc = subprocess.Popen([sys.executable, "-m", "gpt2x", "serve", "--onnx", str(export_dir), "--address", address,
                                 "--port", str(http_port), "--json", "--threads", "1"],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
        ready = json.loads(read_line(proc, 240))
        assert ready["ray"] == address
        r = httpx.post(f"http://127.0.0.1:{http_port}/v1/completions", json={"prompt": "ROMEO:", "max_tokens": 3}, timeout=60)
        assert r.status_code == 200 and r.json()["choices"][0]["finish_reason"] in ("length", "stop")
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(90) == 0, proc.stderr.read()
        status = subprocess.run([ray_exe, "status", f"--address={address}"], capture_output=True, text=True, env=env, timeout=60)
        assert status.returncode == 0 and head.poll() is None  # the cluster outlives the command
        assert httpx.get(f"http://127.0.0.1:{http_port}/v1/models", timeout=10).status_code == 404  # the app is gone
    finally:
        if proc is not None and proc.poll() is None:
            proc.kill()
            proc.wait()
        for sig in (signal.SIGTERM, signal.SIGKILL):  # the head and every process it started
            try:
                os.killpg(head.pid, sig)
            except ProcessLookupError:
                break
            time.sleep(3)
        head.wait(30)
