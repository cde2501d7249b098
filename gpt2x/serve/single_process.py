"""`gpt2x serve` in one process (the default: one replica on this machine): the replica's application
(openai/routes.py's `local_app`, the same routes as the Ray Serve ingress) and its engine under
uvicorn, with no Ray and no proxy hop. Ray Serve (ray/deploy.py) serves more than one replica, a
cluster, or one replica when asked to; `ServeSettings.embedded` says which a setting gets.

Stopping (`serve_in_process`): SIGTERM and SIGINT, to this process or its group, are noted by our
handler; the main thread then stops the engine (Engine.stop: requests in flight get the grace) while
uvicorn still sends their answers, tells uvicorn to exit (at most HTTP_CLOSE_S for the connections
still open), and closes the backend (docs/serving/index.md#stopping). uvicorn runs in a thread of its
own and installs no handler; the process has no children, so a signal to its group reaches it alone.
"""

from __future__ import annotations

import errno
import logging
import signal
import socket
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import replace

from ..choices import Progress, no_progress
from ..errors import ServeError, UsageError
from .core.engine import refuse_batched_draft
from .openai.many import Models, ModelSlot, models_app
from .openai.routes import local_app
from .replica import (
    SHUTTING_DOWN,
    STOP_GRACE_S,
    STOP_SIGNALS,
    ReplicaConfig,
    ServeSettings,
    close_service,
    listed_as,
    open_service,
)

log = logging.getLogger(__name__)

HTTP_CLOSE_S = 2.0  # after the engine's stop, how long uvicorn waits for the connections still open
STARTUP_S = 60.0  # how long uvicorn may take to listen on the socket it is handed


def listening_socket(host: str, port: int) -> socket.socket:
    """A socket bound to host:port and listening (UsageError when the port is taken)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(2048)
    except OSError as e:
        sock.close()
        if e.errno != errno.EADDRINUSE:
            raise UsageError(f"cannot listen on port {port} on {host}: {e.strerror or e}", option="port") from None
        raise UsageError(f"port {port} on {host} is in use", option="port") from None
    sock.set_inheritable(True)
    return sock


class _Stopping(Exception):
    """SIGTERM or SIGINT while the server was starting."""


def model_slot(config: ReplicaConfig) -> ModelSlot:
    """One of several models (openai/many.py): opened and closed as a single model's replica is. A LoRA adapter's
    export (config.parent) is listed with its adapter's folder as root, as vLLM lists a LoRA module."""
    n_positions, precision, root = listed_as(config)
    return ModelSlot(config.model_id, lambda: open_service(config, replica="embedded"), close_service, n_positions,
                     precision, config.backend, config.provider, root=root, parent=config.parent)


class _One:
    """A single model's server (the default): its service opened before the server starts, local_app around it."""

    def __init__(self, config: ReplicaConfig):
        self.config = config
        self.service = None

    def load(self, progress: Progress) -> None:
        progress(f"loading {self.config.model_id}")
        self.service = open_service(self.config, replica="embedded")

    def app(self):
        config = self.config
        return local_app(self.service, config.api_keys, config.max_body_bytes, config.cors)

    def loaded(self) -> list:
        return [] if self.service is None else [self.service]

    def close_all(self) -> None:
        if self.service is not None:
            close_service(self.service)


class _Many:
    """Several models (openai/many.py's Models), every one loaded before the server starts unless `max_loaded`
    or `idle_unload_s` loads them on demand."""

    def __init__(self, configs: Sequence[ReplicaConfig], max_loaded: int | None, idle_unload_s: float | None):
        first = configs[0]
        self.models = Models([model_slot(c) for c in configs], first.api_keys, first.max_body_bytes, max_loaded,
                             idle_unload_s)
        self.cors = first.cors
        self.on_demand = max_loaded is not None

    def load(self, progress: Progress) -> None:
        if not self.on_demand:
            self.models.load_all(progress)

    def app(self):
        return models_app(self.models, self.cors)

    def loaded(self) -> list:
        return self.models.loaded()

    def close_all(self) -> None:
        self.models.close_all()


def serve_in_process(config: ReplicaConfig, settings: ServeSettings, ready: Callable[[str], None],
                     progress: Progress = no_progress, grace: float = STOP_GRACE_S, others: Sequence[ReplicaConfig] = (),
                     max_loaded: int | None = None, idle_unload_s: float | None = None) -> None:
    """The replica and its HTTP server in this process until SIGTERM or SIGINT (to this process or its
    group), then stopped cleanly (see the module's docstring): requests in flight get `grace` seconds.
    `ready` is told the URL once the server listens. A signal while the export loads stops the
    server once it has loaded; `ready` is then not called. Call it from the main thread.
    `others`: more models served by the same server (openai/many.py), routed by the body's `model`;
    `max_loaded` and `idle_unload_s` load and close them on demand (many.Models)."""
    import uvicorn  # deferred: the serve extra's, and slow to import

    settings.validate()
    for each in (config, *others):
        if each.draft is not None:
            refuse_batched_draft(each.engine.max_batch_size)
    several = bool(others) or max_loaded is not None or idle_unload_s is not None
    served = _Many([config, *others], max_loaded, idle_unload_s) if several else _One(config)
    stopping = threading.Event()
    previous = {sig: signal.getsignal(sig) for sig in STOP_SIGNALS}

    def on_signal(signum, frame) -> None:
        stopping.set()

    for sig in STOP_SIGNALS:
        signal.signal(sig, on_signal)
    sock = None
    http: tuple | None = None
    try:
        sock = listening_socket(settings.host, settings.port)
        if settings.port == 0:  # the port the system chose: the URL told is where the server answers
            settings = replace(settings, port=sock.getsockname()[1])
        served.load(progress)
        if stopping.is_set():
            raise _Stopping
        server = uvicorn.Server(uvicorn.Config(
            served.app(), log_level="warning", access_log=False,
            lifespan="off", timeout_graceful_shutdown=HTTP_CLOSE_S))
        http = (server, threading.Thread(target=server.run, kwargs={"sockets": [sock]}, name="gpt2x-http", daemon=True))
        http[1].start()
        _wait_started(*http, settings, stopping)
        ready(settings.url)
        _watch(served, http[1], stopping)
    except _Stopping:
        pass
    finally:
        try:
            _stop(served, http, progress, grace)
        finally:
            if sock is not None:
                sock.close()
            for sig, handler in previous.items():
                if handler is not None:
                    signal.signal(sig, handler)


def _wait_started(server, thread: threading.Thread, settings: ServeSettings, stopping: threading.Event) -> None:
    """Until the uvicorn server on `thread` has started: a ServeError where it does not within STARTUP_S, _Stopping
    where a signal came first."""
    deadline = time.monotonic() + STARTUP_S
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise ServeError(f"the HTTP server did not start on {settings.host}:{settings.port}")
        if stopping.wait(0.02):
            raise _Stopping


def _watch(served, thread: threading.Thread, stopping: threading.Event) -> None:
    """Until a signal: a ServeError where the HTTP server's thread or an engine's stops on its own."""
    while not stopping.wait(0.5):
        if not thread.is_alive():
            raise ServeError("the HTTP server stopped")
        # an engine closed on purpose (a model unloaded by many.Models) is `closing`
        if any(not s.engine.alive and not s.engine.closing for s in served.loaded()):
            raise ServeError("the engine's thread stopped")


def _stop(served, http: tuple | None, progress: Progress, grace: float) -> None:
    """The engines stopped (new requests 503, waiting ones ended, in-flight ones given the grace), then the HTTP
    server, then every model closed."""
    services = served.loaded()
    if services:
        progress("stopping")
        started = time.monotonic()
        stop_engines(services, grace)
        log.debug("the engines stopped in %.2f s", time.monotonic() - started)
    if http is not None:
        server, thread = http
        server.should_exit = True
        thread.join(HTTP_CLOSE_S + 3.0)
        if thread.is_alive():
            log.warning("the HTTP server did not stop within %.0f s", HTTP_CLOSE_S + 3.0)
    served.close_all()


def stop_engines(services: list, grace: float) -> None:
    """Every engine stopped at once (each gives its requests the grace): several models take one grace, not one each."""
    if len(services) == 1:
        services[0].engine.stop(grace, SHUTTING_DOWN)
        return
    threads = [threading.Thread(target=s.engine.stop, args=(grace, SHUTTING_DOWN), daemon=True) for s in services]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
