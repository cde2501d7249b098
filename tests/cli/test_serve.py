"""`gpt2x serve` as a user runs it: bad options are one line and a non-zero exit before anything
starts; a running server answers, and SIGTERM stops it cleanly (exit 0, its port free again). Each
test that starts a server runs on both paths: the embedded default (one replica in the command's
process, no Ray) and Ray Serve (`--ray`, or `--replicas 2`), marked for conftest's Ray group. The
stop as process managers and terminals send it: SIGTERM to the server's whole process group, SIGINT
to its pid, with requests in flight: exit 0 within 10 s, one "stopped" line, every request answered
in full or ended with a clean error, and no process of the server's (Ray's included) left."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from types import SimpleNamespace

import httpx
import psutil  # Ray's dependency, and the test extra's
import pytest
import ray  # noqa: F401 (the test extra's: a broken install fails here, rather than skipping)

from gpt2x.errors import MissingDependencyError
from gpt2x.generation.generate import generate
from gpt2x.generation.settings import SamplingSettings
from gpt2x.onnx.artifact import read_export
from gpt2x.runtime.ort import OrtBackend
from gpt2x.serve.core.engine import Engine, EngineClosed, EngineSettings, Row
from gpt2x.serve.core.outputs import Failed, Output, TokenOut
from gpt2x.tokenizer import decode, encode

from ..helpers import (  # noqa: E402
    assert_one_line_error,  # noqa: E402
    cli,
    read_line,
    run_cli,
    serving,
)

# Every test that starts Ray runs in one pytest-xdist worker, one after another (conftest.RAY_TESTS).
RAY = pytest.mark.xdist_group("ray")

KEY = "sekret-key-42"


@pytest.mark.parametrize("args,code,fragment", [
    (["--replicas", "0"], 2, "--replicas must be at least 1"),
    (["--replicas", "64"], 2, "CPUs"),
    (["--port", "70000"], 2, "--port must be in [0, 65535]"),
    (["--port", "0", "--replicas", "2"], 2, "--port 0 (a port the system chooses) is for one replica in this process"),
    (["--backend", "torch"], 2, "not served"),
    (["--max-batch-size", "0"], 2, "--max-batch-size must be >= 1"),
    (["--precision", "int8"], 2, "is a fp32 export, not int8"),
    (["--scheduling-policy", "lifo"], 2, "--scheduling-policy must be one of fcfs, priority"),
    (["--chat-template", "/nonexistent/template.jinja"], 2, "--chat-template file not found: /nonexistent/template.jinja"),
    (["--allowed-origins", "https://a.example"], 2, "--allowed-origins must be a JSON list of strings"),
    (["--allowed-origins", '["https://a.example"]', "--allowed-methods", '"POST"'], 2, "--allowed-methods must be a JSON list"),
    (["--allow-credentials"], 2, "--allow-credentials needs --allowed-origins"),
    (["--allowed-origins", '["*"]', "--replicas", "2"], 2, "--allowed-origins is served by one replica in this process"),
    (["--api-key-file", "/nonexistent/keys"], 2, "--api-key-file not found: /nonexistent/keys"),
])
def test_bad_options_are_one_line(export_dir, args, code, fragment, capsys, monkeypatch):
    """In this process (a subprocess each took 1-4 s of the suite): a server that started anyway fails the test
    rather than serving."""
    def started(*args, **kwargs):
        raise AssertionError("the command started serving")

    monkeypatch.setattr("gpt2x.serve.single_process.serve_in_process", started)
    monkeypatch.setitem(sys.modules, "gpt2x.serve.ray.deploy", SimpleNamespace(serve_until_stopped=started))
    exit_code, _, err = cli(capsys, "serve", "--onnx", str(export_dir), *args)
    assert_one_line_error(exit_code, err, code, fragment)


def test_an_empty_api_key_file_is_one_line(export_dir, tmp_path):
    keys = tmp_path / "keys"
    keys.write_text("# no key here\n\n")
    r = run_cli("serve", "--onnx", str(export_dir), "--api-key-file", str(keys), timeout=120)
    assert_one_line_error(r.returncode, r.stderr, 2, f"--api-key-file {keys} holds no key")


def test_an_export_without_a_chat_template_is_served_with_the_default_and_says_so(tiny_export):
    """One warning line at start naming the fallback and both flags (llama-server's behaviour), none for the
    bundled model's export, which carries the default; then the start goes on (here to a busy port's one line)."""
    _, _, info = tiny_export()
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = str(busy.getsockname()[1])
        r = run_cli("serve", "--onnx", str(info.folder), "--port", port, timeout=120)
        quiet = run_cli("serve", "--onnx", str(info.folder), "--port", port, "--no-default-chat-template", timeout=120)
    warning, error = r.stderr.strip().splitlines()
    assert warning.startswith(f"warning: {info.folder} has no chat template: /v1/chat/completions uses gpt2x's default")
    assert "--chat-template FILE" in warning and "--no-default-chat-template" in warning
    assert_one_line_error(r.returncode, error, 2, "is in use")
    assert_one_line_error(quiet.returncode, quiet.stderr, 2, "is in use")


def test_missing_export_and_busy_port_are_one_line(export_dir, tmp_path):
    r = run_cli("serve", "--onnx", str(tmp_path / "nothing"), timeout=120)
    assert_one_line_error(r.returncode, r.stderr, 6, "nothing")
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        r = run_cli("serve", "--onnx", str(export_dir), "--port", str(port), timeout=120)
    assert_one_line_error(r.returncode, r.stderr, 2, f"--port {port} on 127.0.0.1 is in use")




def scrape(url: str, **kw) -> dict[str, float]:
    """/metrics as {sample name with its labels: value}."""
    r = httpx.get(f"{url}/metrics", timeout=30, **kw)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    samples = {}
    for line in r.text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            samples[name] = float(value)
    return samples


def test_serve_answers_and_stops_cleanly(export_dir):
    """The server answers, then stops on SIGTERM to its pid. On Ray (a start of it costs the suite about 18 s), the same
    routes are test_ray's, through the same deployment, and the command's stop with what Ray started is
    test_a_signal_stops_the_server_cleanly_within_10_s's. `--port 0`: the port the system chooses, told in the URL."""
    with serving("--onnx", str(export_dir), "--port", "0", "--threads", "1", env={"GPT2X_API_KEY": KEY}) \
            as (proc, ready):
        port = int(ready["url"].rsplit(":", 1)[1])
        assert port > 0 and ready["url"] == f"http://127.0.0.1:{port}"
        assert ready["model"] == "shakespeare" and ready["api_key"] is True
        assert ready["ray"] is None and ready["replicas"] == 1
        assert KEY not in json.dumps(ready)
        auth = {"Authorization": f"Bearer {KEY}"}
        r = httpx.post(f"{ready['url']}/v1/completions", json={"prompt": "ROMEO:", "max_tokens": 4, "temperature": 0},
                       headers=auth, timeout=60)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] <= 4
        whole = r.json()["choices"][0]["text"]
        with httpx.stream("POST", f"{ready['url']}/v1/completions", headers=auth, timeout=60,
                          json={"prompt": "ROMEO:", "max_tokens": 4, "temperature": 0, "stream": True}) as s:
            assert s.status_code == 200 and s.headers["content-type"].startswith("text/event-stream")
            events = [line for line in s.iter_lines() if line]
        assert events[-1] == "data: [DONE]"
        chunks = [json.loads(e[len("data: "):]) for e in events[:-1]]
        assert "".join(c["choices"][0]["text"] for c in chunks) == whole  # greedy: the same text either way
        assert chunks[-1]["choices"][0]["finish_reason"] in ("length", "stop")
        metrics = scrape(ready["url"], headers=auth)
        assert metrics['gpt2x:request_success_total{finished_reason="length",model_name="shakespeare"}'] \
            + metrics['gpt2x:request_success_total{finished_reason="stop",model_name="shakespeare"}'] == 2
        assert metrics['gpt2x:prompt_tokens_total{model_name="shakespeare"}'] == 2 * r.json()["usage"]["prompt_tokens"]
        assert metrics['gpt2x:num_replicas{model_name="shakespeare"}'] == 1
        for route in ("/metrics", "/v1/models"):
            assert httpx.get(f"{ready['url']}{route}", timeout=10).status_code == 401
        for route in ("/health", "/version"):  # open, as vLLM's and llama-server's (a probe has no key)
            assert httpx.get(f"{ready['url']}{route}", timeout=10).status_code == 200
        assert httpx.get(f"{ready['url']}/openapi.json", timeout=10).status_code == 200
        assert psutil.Process(proc.pid).children(recursive=True) == []  # the replica is in the command's process
        signalled = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(STOP_WITHIN_S + 20)
        took = time.monotonic() - signalled
        err = proc.stderr.read()
        assert code == 0, err
        assert took <= STOP_WITHIN_S, f"stopped {took:.1f} s after the signal"
        lines = err.strip().splitlines()
        assert lines[-1] == "stopped" and lines.count("stopped") == 1, err
        assert "Traceback" not in err and "Aborted" not in err, err
        with socket.socket() as s:
            # SO_REUSEADDR: connections the server closed may linger in TIME_WAIT; a listener left behind
            # still makes the bind fail.
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            s.bind(("127.0.0.1", port))  # the port is free again


# `gpt2x serve` in an install without the ray extra: importing ray (or a submodule) raises ImportError,
# and each attempt is written to the file RAY_TRIED names, so that a guarded import is seen too.
WITHOUT_RAY = """
import os, sys

class NoRay:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] == "ray":
            with open(os.environ["RAY_TRIED"], "a") as f:
                f.write(name + "\\n")
            raise ImportError(f"No module named {name!r} (blocked by the test)")
        return None

sys.meta_path.insert(0, NoRay())
sys.argv = ["gpt2x", *sys.argv[1:]]
from gpt2x.cli.app import main
main()
"""


def test_one_machine_serves_without_ray_and_what_needs_ray_names_its_extra(export_dir, reserve_port, reference, tmp_path):
    """With ray unimportable, the default server answers a greedy completion as gpt2x's generation code
    gives it, stops cleanly, and never tries to import ray; --ray, --replicas 2 and --address are
    refused in one line naming the ray extra, before the export is touched."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "RAY_TRIED": str(tmp_path / "refused-ray-imports.txt")}
    for args, why in ((["--ray"], "--ray"), (["--replicas", "2", "--cpus-per-replica", "0.5"], "--replicas 2"),
                      (["--address", "ray://head:10001"], "--address ray://head:10001")):
        r = subprocess.run([sys.executable, "-c", WITHOUT_RAY, "serve", "--onnx", str(tmp_path / "absent"), *args],
                           capture_output=True, text=True, encoding="utf-8", env=env, timeout=120)
        assert r.stderr.strip().splitlines() == [f"error: gpt2x serve {why} serves through Ray Serve, which needs ray: "
                                                 "pip install 'gpt2x[ray]'"], r.stderr
        assert r.returncode == MissingDependencyError.exit_code
    tried = tmp_path / "ray-imports.txt"
    env["RAY_TRIED"] = str(tried)
    port = reserve_port()
    proc = subprocess.Popen([sys.executable, "-c", WITHOUT_RAY, "serve", "--onnx", str(export_dir), "--port", str(port),
                             "--json", "--threads", "1"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, encoding="utf-8", env=env)
    try:
        ready = json.loads(read_line(proc, 180))
        assert ready["ray"] is None and ready["replicas"] == 1
        r = httpx.post(f"{ready['url']}/v1/completions", json={"prompt": "ROMEO:", "max_tokens": 8, "temperature": 0},
                       timeout=60)
        assert r.status_code == 200, r.text
        g = generate(reference, ["ROMEO:"], SamplingSettings(max_new_tokens=8, greedy=True))[0]
        assert r.json()["choices"][0]["text"] == decode(g.tokens) and r.json()["usage"]["completion_tokens"] == len(g.tokens)
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(90)
        err = proc.stderr.read()
        assert code == 0 and err.strip().splitlines()[-1] == "stopped" and "Traceback" not in err, err
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert not tried.exists(), tried.read_text()  # nothing on the way tried ray, guarded or not


def test_kv_cache_serves_an_fp32_export_on_the_slots_by_default_and_other_backends_refuse_it(export_dir, reserve_port,
                                                                                             reference, capsys):
    """The fp32 export by default: /health says the replica's cache is the fixed slots, and a greedy completion is
    gpt2x's generation code's; with --kv-cache in-place the cache is in place (the export's GroupQueryAttention twin),
    with growing it grows, each with the same completion. A backend with its own cache refuses the ort backend's forms in
    one line (in this process: nothing starts; the openvino backend's server takes slots and in-place)."""
    code, _, err = cli(capsys, "serve", "--onnx", str(export_dir), "--backend", "openvino", "--kv-cache", "growing")
    assert_one_line_error(code, err, 2, "--kv-cache growing applies to the ort backend")
    for args, form in (([], "slots"), (["--kv-cache", "in-place"], "in-place"), (["--kv-cache", "growing"], "growing")):
        port = reserve_port()
        proc = subprocess.Popen([sys.executable, "-m", "gpt2x", "serve", "--onnx", str(export_dir), "--port", str(port),
                                 "--json", "--threads", "1", *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, encoding="utf-8",
                                env={**os.environ, "HF_HUB_OFFLINE": "1"})
        try:
            url = json.loads(read_line(proc, 180))["url"]
            health = httpx.get(f"{url}/health", timeout=10).json()
            assert health["kv_cache"] == form and health["kv_cache_dtype"] == "float32"
            r = httpx.post(f"{url}/v1/completions", json={"prompt": "ROMEO:", "max_tokens": 8, "temperature": 0}, timeout=60)
            g = generate(reference, ["ROMEO:"], SamplingSettings(max_new_tokens=8, greedy=True))[0]
            assert r.status_code == 200 and r.json()["choices"][0]["text"] == decode(g.tokens)
        finally:
            proc.send_signal(signal.SIGTERM)
            proc.wait(60)


# ------------------------------------------------------------------ the stop under a process manager


STOP_WITHIN_S = 10.0


def live(processes: dict[int, float]) -> list[int]:
    """The pids of `processes` ({pid: create_time}) still running (the same process, not a zombie)."""
    alive = []
    for pid, created in processes.items():
        try:
            p = psutil.Process(pid)
            if p.create_time() == created and p.status() != psutil.STATUS_ZOMBIE:
                alive.append(pid)
        except psutil.NoSuchProcess:
            pass
    return alive


async def in_flight(url: str, n: int) -> list[tuple]:
    """n long requests, half streamed, sent together: what each ended as (status, how it ended)."""
    async with httpx.AsyncClient(timeout=60) as c:
        async def one(i: int) -> tuple:
            body = {"prompt": "ROMEO:", "max_tokens": 250, "temperature": 1.0, "seed": i}
            if i % 2:
                async with c.stream("POST", f"{url}/v1/completions", json={**body, "stream": True}) as r:
                    lines = [line async for line in r.aiter_lines() if line]
                return "stream", r.status_code, lines
            r = await c.post(f"{url}/v1/completions", json=body)
            return "whole", r.status_code, r.json()

        return await asyncio.gather(*[one(i) for i in range(n)])


def assert_clean(answers: list[tuple]) -> dict:
    """Each request was answered in full or ended with a clean error: a JSON error in OpenAI's shape
    (the queue full: 429; the server stopping: 5xx), or a stream whose last events are an error and
    [DONE]. Returns how many ended each way."""
    ways: dict[str, int] = {}
    for kind, status, body in answers:
        if kind == "whole" and status == 200:
            way = "done"
            assert body["choices"][0]["finish_reason"] in ("length", "stop")
        elif kind == "whole":
            way = f"error {status}"
            assert status in (429, 500, 503) and set(body["error"]) == {"message", "type", "param", "code"}
        elif status != 200:  # refused before the stream began: one JSON error
            way = f"error {status}"
            assert status in (429, 500, 503) and set(json.loads("".join(body))["error"]) == {"message", "type", "param", "code"}
        else:
            assert body[-1] == "data: [DONE]", body[-3:]
            last = json.loads(body[-2][len("data: "):])
            if "error" in last:
                way = "stream error"
                assert last["error"]["message"] == "the server is shutting down"
            else:
                way = "done"
        ways[way] = ways.get(way, 0) + 1
    return ways


# On Ray one way only, SIGTERM to the group (a Ray start costs the suite about 18 s): Ctrl-C in a terminal signals the
# whole foreground group too, and the command's handler is the same for both signals.
@pytest.mark.parametrize("mode,how", [
    pytest.param(mode, how, id=f"{mode}-{how}", marks=[RAY] if mode == "ray" else [])
    for mode, how in (("embedded", "sigterm-to-the-group"), ("embedded", "sigint-to-the-pid"),
                      ("ray", "sigterm-to-the-group"))])
def test_a_signal_stops_the_server_cleanly_within_10_s(export_dir, reserve_port, mode, how):
    """`gpt2x serve` in a session of its own (as systemd and most process managers start it), signalled
    with requests in flight: every request ends cleanly, the command exits 0 within 10 s with one
    "stopped" line, and nothing it started (Ray's GCS, raylet, agents, replicas: its descendants while
    it ran, and its session) is left. Embedded: one replica in the command's process; on Ray: two."""
    port = reserve_port()
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    replicas = ["--replicas", "2"] if mode == "ray" else []
    proc = subprocess.Popen([sys.executable, "-m", "gpt2x", "serve", "--onnx", str(export_dir), "--port", str(port),
                             "--json", "--threads", "1", *replicas, "--max-batch-size", "2", "--max-waiting", "6"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, encoding="utf-8", env=env, start_new_session=True)
    try:
        ready = json.loads(read_line(proc, 180))
        url = ready["url"]
        assert httpx.post(f"{url}/v1/completions", json={"prompt": "ROMEO:", "max_tokens": 3}, timeout=60).status_code == 200
        assert ready["ray"] == ("local" if mode == "ray" else None) and ready["replicas"] == (2 if mode == "ray" else 1)
        started = {p.pid: p.create_time() for p in psutil.Process(proc.pid).children(recursive=True)}
        assert len(started) >= 4 if mode == "ray" else started == {}  # Ray's processes and the replicas; or none
        if mode == "ray":  # the local instance's proxy and replicas took deploy.LOCAL_INSTANCE_ENV (gRPC between them)
            envs = []  # (title, the variable): the two replicas' titles are alike
            for p in psutil.Process(proc.pid).children(recursive=True):
                try:
                    envs.append((" ".join(p.cmdline()), p.environ().get("RAY_SERVE_PROXY_USE_GRPC")))
                except psutil.Error:  # a process that ended meanwhile
                    pass
            actors = [v for t, v in envs if t.startswith(("ray::ProxyActor", "ray::ServeReplica"))]
            assert actors == ["1"] * 3, envs
            assert "RAY_SERVE_PROXY_USE_GRPC" not in os.environ  # the test's own environment did not give it

        result: dict = {}
        load = threading.Thread(target=lambda: result.update(answers=asyncio.run(in_flight(url, 24))))
        load.start()
        time.sleep(1.0)  # the requests are in: each replica decodes two, queues up to six, refuses the rest
        signalled = time.monotonic()
        if how == "sigterm-to-the-group":
            os.killpg(proc.pid, signal.SIGTERM)
        else:
            proc.send_signal(signal.SIGINT)
        code = proc.wait(STOP_WITHIN_S + 20)
        took = time.monotonic() - signalled
        load.join(60)
        out, err = proc.communicate()
        print(f"{mode} {how}: exit {code} {took:.2f} s after the signal; requests: {assert_clean(result['answers'])}")
        assert code == 0, err
        assert took <= STOP_WITHIN_S, f"stopped {took:.1f} s after the signal"
        lines = err.strip().splitlines()
        assert lines[-1] == "stopped" and lines.count("stopped") == 1, err
        assert "Traceback" not in err and "SIGTERM received" not in err and "Aborted" not in err, err
        assert out == "", out  # stdout holds the ready line alone (read above)
        time.sleep(0.5)
        assert live(started) == [], [psutil.Process(pid).cmdline()[:2] for pid in live(started)]
        session = subprocess.run(["ps", "-o", "pid=", "-s", str(proc.pid)], capture_output=True, text=True, encoding="utf-8").stdout.split()
        assert session == [], session
        with socket.socket() as s:
            # SO_REUSEADDR: connections the server closed may linger in TIME_WAIT; a listener left behind
            # still makes the bind fail.
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            s.bind(("127.0.0.1", port))  # the port is free again
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def test_the_engines_stop_ends_what_its_grace_does_not_finish(export_dir):
    """Engine.stop, as a replica's stop runs it: new rows refused, waiting rows told the error at once,
    the row in flight given the grace, then ended with the error, nothing told after; the thread ends."""
    told: dict[int, list] = {0: [], 1: []}

    def sink(i: int):
        def tell(out: Output) -> None:
            told[i].append((time.monotonic(), type(out), out))
            if isinstance(out, TokenOut):
                time.sleep(0.02)  # a slow client: 250 tokens take 5 s, far past the grace
        return tell

    engine = Engine(OrtBackend(read_export(export_dir), threads=1), EngineSettings(max_batch_size=1)).start()
    prompt = encode("ROMEO:")
    rows = [Row(prompt, SamplingSettings(max_new_tokens=250), sink(i), max_tokens=250) for i in (0, 1)]
    engine.submit(rows)  # one runs, one waits (max batch size 1)
    while not told[0]:
        time.sleep(0.01)
    began = time.monotonic()
    assert engine.stop(0.5, "the server is shutting down")
    stopped = time.monotonic()
    assert not engine.alive and 0.5 <= stopped - began < 2.0
    assert [k for _, k, _ in told[1]] == [Failed] and told[1][0][0] - began < 0.2  # the waiting row: at once
    kinds = [k for _, k, _ in told[0]]
    assert kinds[-1] is Failed and set(kinds[:-1]) == {TokenOut} and 10 < len(kinds) < 250
    assert told[0][-1][2] == Failed("the server is shutting down") and told[0][-1][0] - began >= 0.5
    with pytest.raises(EngineClosed):
        engine.submit([Row(prompt, SamplingSettings(max_new_tokens=2), sink(1), max_tokens=2)])
    engine.backend.close()
