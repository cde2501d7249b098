"""gpt2x/serve/ray/patches.py against the Ray installed: the private names it patches exist with the
shape it expects, Ray reaches them where the patch replaces them, and each patch takes effect (a
process Ray's own launcher starts lands in a session of its own with the stop signals unblocked; a
SIGTERM handler Ray sets is not set; what Ray's driver prints lands on stderr). A Ray release that breaks any
of them fails here. No Ray instance is started: Ray's launcher runs a plain Python child."""

from __future__ import annotations

import inspect
import json
import os
import signal
import subprocess
import sys

import ray._private.node
import ray._private.services
import ray._private.utils
import ray._private.worker

from gpt2x.serve.ray.patches import ray_processes_in_their_own_session, rays_driver_output_on_stderr, rays_sigterm_handlers_left_out

CHILD = ("import json, os, signal; print(json.dumps({'pid': os.getpid(), 'sid': os.getsid(0), "
         "'blocked': sorted(int(s) for s in signal.pthread_sigmask(signal.SIG_BLOCK, []))}))")


def test_the_private_names_patched_are_there_as_expected():
    services, utils = ray._private.services, ray._private.utils
    assert isinstance(services.ConsolePopen, type) and issubclass(services.ConsolePopen, subprocess.Popen)
    # Ray's launcher looks ConsolePopen up in its module when it runs (the patch replaces that name) and
    # hands it a preexec_fn (the patch wraps it)
    assert "ConsolePopen" in services.start_ray_process.__code__.co_names
    assert "preexec_fn" in inspect.getsource(services.start_ray_process)
    assert list(inspect.signature(utils.set_sigterm_handler).parameters) == ["sigterm_handler"]
    for caller in (ray._private.worker, ray._private.node):  # through the module, not a name bound at import
        assert "ray._private.utils.set_sigterm_handler(" in inspect.getsource(caller), caller.__name__
        assert not hasattr(caller, "set_sigterm_handler"), caller.__name__
    worker = ray._private.worker
    assert list(inspect.signature(worker.print_to_stdstream).parameters) == ["data", "ignore_prefix"]
    # the raylet's reports are printed through the module's name when they come; the relayed output through the
    # function ray.init binds (connect, which ray.init calls: it runs inside the patch)
    assert "print_to_stdstream" in worker.listen_error_messages.__code__.co_names
    assert "functools.partial(print_to_stdstream" in inspect.getsource(worker.connect)
    assert '"is_err": False' in inspect.getsource(worker.listen_error_messages)  # what the patch turns to stderr


def test_rays_processes_start_in_a_session_of_their_own_with_the_stop_signals_unblocked(tmp_path):
    original = ray._private.services.ConsolePopen
    started: list[subprocess.Popen] = []
    out = tmp_path / "child.json"
    mask = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM, signal.SIGINT})  # as _init_ray holds them
    try:
        with ray_processes_in_their_own_session(started), out.open("w") as f:
            info = ray._private.services.start_ray_process([sys.executable, "-c", CHILD], "gpt2x_test", fate_share=False,
                                                           stdout_file=f)
            assert info.process.wait(60) == 0
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, mask)
    child = json.loads(out.read_text())
    assert started == [info.process] and child["pid"] == info.process.pid
    assert child["sid"] == child["pid"] != os.getsid(0)  # it leads a session of its own
    assert int(signal.SIGTERM) not in child["blocked"]  # unblocked by the patch's preexec_fn
    assert int(signal.SIGINT) in child["blocked"]  # Ray's own preexec_fn ran after it (it blocks SIGINT)
    assert ray._private.services.ConsolePopen is original


def test_rays_sigterm_handlers_are_left_out():
    def ours(signum, frame):
        pass

    def rays(signum, frame):
        pass

    previous = signal.signal(signal.SIGTERM, ours)
    original = ray._private.utils.set_sigterm_handler
    try:
        with rays_sigterm_handlers_left_out():
            ray._private.utils.set_sigterm_handler(rays)  # as ray.init and its node call it
            assert signal.getsignal(signal.SIGTERM) is ours
        assert ray._private.utils.set_sigterm_handler is original
        original(rays)  # outside, Ray's call sets its handler: what the patch keeps out
        assert signal.getsignal(signal.SIGTERM) is rays
    finally:
        signal.signal(signal.SIGTERM, previous)


def test_what_rays_driver_prints_goes_to_stderr(capfd):
    original = ray._private.worker.print_to_stdstream
    report = {"lines": ["A worker died or was killed while executing a task"], "pid": "raylet", "is_err": False}
    with rays_driver_output_on_stderr():
        ray._private.worker.print_to_stdstream(dict(report), ignore_prefix=False)  # as listen_error_messages does
    out, err = capfd.readouterr()
    assert out == "" and "A worker died" in err
    assert ray._private.worker.print_to_stdstream is original
    original(dict(report, lines=["outside"]), ignore_prefix=False)  # outside, Ray prints it on stdout
    out, err = capfd.readouterr()
    assert "outside" in out and "outside" not in err


def test_the_server_keeps_rays_driver_output_on_stderr_while_it_serves(capfd, monkeypatch):
    """`gpt2x serve` on Ray (deploy.serve_until_stopped): a raylet report while it serves (a replica died) lands on
    stderr; stdout has what `ready` printed alone."""
    from gpt2x.serve.ray import deploy

    events = []

    def start(config, settings, progress, stopping, others):
        ray._private.worker.print_to_stdstream({"lines": ["A worker died"], "pid": "raylet", "is_err": False}, ignore_prefix=False)
        events.append(stopping)
        return "http://127.0.0.1:1"

    def ready(url):
        print(url, flush=True)
        events[0].set()  # as a signal would

    monkeypatch.setattr(deploy, "start", start)
    monkeypatch.setattr(deploy, "stop", lambda settings, grace: events.append(grace))
    deploy.serve_until_stopped(None, deploy.ServeSettings(), ready)
    out, err = capfd.readouterr()
    assert out == "http://127.0.0.1:1\n" and "A worker died" in err and events[1:] == [deploy.STOP_GRACE_S]
