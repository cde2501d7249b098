"""`gpt2x serve` in one process: the embedded default on one machine with one replica.

The replica's application (http.local_app: the same routes, API key, body limit and JSON errors as
deploy.py's Ray Serve ingress) and its engine run in this process under uvicorn, with no Ray and no
proxy hop. Ray Serve (deploy.py) serves more than one replica, a cluster (`address`), or one replica
when asked to (`ServeSettings.ray`); `ServeSettings.embedded` says which of the two a setting gets.

What both paths share lives here, so that the embedded path imports no Ray: what a replica loads
(`ReplicaConfig`, `open_service`, `close_service`), where it serves (`ServeSettings`), and what the
CLI reports (`describe`).

Stopping (`serve_in_process`), as deploy.py's stop does it: SIGTERM and SIGINT, to this process or to
its process group (it has no child processes), are noted by a handler of ours (uvicorn runs in a
thread of its own and installs none); the main thread then stops the engine (engine.Engine.stop: new
requests are a 503, waiting ones end at once with an error, the ones in flight get STOP_GRACE_S to
finish and then end with an error: an error event in a stream, a JSON error otherwise) while uvicorn
still sends their answers, then tells uvicorn to exit (it closes its socket and waits, at most
HTTP_CLOSE_S, for the connections still open), and closes the backend.
"""

from __future__ import annotations

import errno
import logging
import os
import signal
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

from ..choices import BackendKind, Progress, ProviderKind, no_progress
from ..errors import ServeError, UsageError
from ..generation.speculative import DraftSettings, ModelDrafter
from ..onnx.artifact import read_export
from ..tokenizer import get_encoding
from ..workflows.backends import export_backend
from ..workflows.drafts import open_drafter
from .chat import find_template
from .engine import EngineSettings, refuse_batched_draft
from .http import MAX_BODY_BYTES, local_app
from .service import CompletionService

log = logging.getLogger(__name__)

APP_NAME = "gpt2x"
STOP_GRACE_S = 3.0  # at a stop, requests in flight get this long to finish before they end with an error
HTTP_CLOSE_S = 2.0  # after the engine's stop, how long uvicorn waits for the connections still open
STARTUP_S = 60.0  # how long uvicorn may take to listen on the socket it is handed
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)
SHUTTING_DOWN = "the server is shutting down"


@dataclass(frozen=True)
class ReplicaConfig:
    """What every replica needs to load and serve: sent to the replicas, so plain values only."""

    export: str  # the export folder, an absolute path that exists on every node
    model_id: str  # the name clients send as "model" (no request can name another, or a path)
    backend: str = BackendKind.ort.value
    provider: str = ProviderKind.cpu.value
    threads: int | None = None
    engine: EngineSettings = field(default_factory=EngineSettings)
    api_key: str | None = None
    max_body_bytes: int = MAX_BODY_BYTES
    # ONNX Runtime's in-place KV cache (int8/int4 graphs). None: wherever the graph allows it; True
    # requires it, False refuses it. A batch's rows leave and join inside the in-place buffers
    # (kvbuffers.merge_rows, copying only the rows that move), and a step writes only its new
    # positions, where the growing cache copies the whole cache into new tensors every step (at 16
    # rows of ~560 positions, 0.7 GB a step). Fresh buffers are in small pages (ort.unset_arrays), so a
    # join into larger ones no longer pays for zeroing them whole. Measured with gpt2x loadtest on the
    # 2-core VM (2026-11-25, int8, c=16): 545 tok/s in place against 406 growing (TTFT p50 117 against
    # 106 ms), and 97 against 41 tok/s with 544-token prompts sharing 512-token prefixes.
    in_place_kv: bool | None = None
    # Speculative decoding (engine.py, at max batch size 1): the draft as the user named it (int4,
    # int8, ngram, a model or export folder; None: none), and what each replica opens next to its
    # backend (workflows.open_drafter): `ngram` or the draft's export folder, resolved and exported by
    # the command before the server starts (draft.prepare_draft); None: `draft` itself.
    draft: str | None = None
    draft_source: str | None = None
    draft_settings: DraftSettings = field(default_factory=DraftSettings)
    # Under Ray Serve, the application's hub (deploy.MetricsHub), by name: set by deploy.application.
    # None: each replica's /metrics is its own, and a stop is Ray Serve's alone.
    metrics_hub: str | None = None
    # /v1/chat/completions' Jinja2 template: the text of --chat-template's file (None: the export
    # folder's tokenizer_config.json chat_template, if it has one; serve/chat.py)
    chat_template: str | None = None


@dataclass(frozen=True)
class ServeSettings:
    """Where and how many: replicas, the HTTP address, the Ray cluster (None: a local one, or none at
    all when embedded), and `ray`: Ray Serve even for one replica on this machine."""

    replicas: int = 1
    host: str = "127.0.0.1"
    port: int = 8000
    address: str | None = None
    cpus_per_replica: float = 1.0
    route_prefix: str = "/"
    app_name: str = APP_NAME
    ray: bool = False

    @property
    def embedded(self) -> bool:
        """One replica on this machine, in this process (serve_in_process), unless Ray is asked for."""
        return self.replicas == 1 and self.address is None and not self.ray

    def validate(self) -> None:
        if self.replicas < 1:
            raise UsageError(f"replicas must be at least 1, got {self.replicas}", option="replicas")
        if not 0 <= self.port <= 65535:
            raise UsageError(f"port must be in [0, 65535], got {self.port}", option="port")
        if self.cpus_per_replica < 0:
            raise UsageError(f"cpus_per_replica must be >= 0, got {self.cpus_per_replica}", option="cpus_per_replica")
        if self.address is None:
            needed = self.replicas * self.cpus_per_replica
            if needed > (os.cpu_count() or 1):
                raise UsageError(f"replicas: {self.replicas} replicas of {self.cpus_per_replica:g} CPU need {needed:g} CPUs; "
                                 f"this machine has {os.cpu_count()} (fewer replicas, or a smaller cpus_per_replica)",
                                 option="replicas")

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}{self.route_prefix.rstrip('/')}"


def open_service(config: ReplicaConfig, replica: str = "") -> CompletionService:
    """A replica's service: the export's backend (and draft) opened, its engine started."""
    info = read_export(Path(config.export))
    get_encoding()  # built now, not by the first request (~55 ms)
    backend = export_backend(BackendKind(config.backend), info, ProviderKind(config.provider), config.threads,
                             in_place_kv=config.in_place_kv)
    drafter = None
    if config.draft is not None:  # on the target's backend and provider; a CPU draft gets 1 thread
        drafter = open_drafter(config.draft_source or config.draft, backend, BackendKind(config.backend),
                               ProviderKind(config.provider), None, config.draft_settings)
    return CompletionService(backend, config.engine, config.model_id, replica, drafter, config.draft_settings,
                             config.draft, find_template(Path(config.export), config.chat_template))


def close_service(service: CompletionService) -> None:
    """The engine stopped, then what `open_service` opened closed (left open if the engine's thread
    could not be stopped: it still uses them)."""
    if service.close():
        service.backend.close()
        if isinstance(service.drafter, ModelDrafter):
            service.drafter.backend.close()


def describe(config: ReplicaConfig, settings: ServeSettings) -> dict:
    """What is served, for the CLI's report (no API key). `ray`: the cluster's address, "local" (a
    Ray instance of its own), or None (embedded: one process, no Ray)."""
    draft = {} if config.draft is None else {"draft": config.draft, "draft_settings": asdict(config.draft_settings)}
    ray = None if settings.embedded else settings.address or "local"
    return {"url": settings.url, "model": config.model_id, "export": config.export, "backend": config.backend,
            "provider": config.provider, "replicas": settings.replicas, "ray": ray,
            "engine": asdict(config.engine), **draft, "api_key": config.api_key is not None}


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


def serve_in_process(config: ReplicaConfig, settings: ServeSettings, ready: Callable[[str], None],
                     progress: Progress = no_progress, grace: float = STOP_GRACE_S) -> None:
    """The replica and its HTTP server in this process until SIGTERM or SIGINT (to this process or its
    group), then stopped cleanly (see the module's docstring): requests in flight get `grace` seconds.
    `ready` is told the URL once the server listens. A signal while the export loads stops the
    server once it has loaded; `ready` is then not called. Call it from the main thread."""
    import uvicorn  # deferred: the serve extra's, and slow to import

    settings.validate()
    if config.draft is not None:
        refuse_batched_draft(config.engine.max_batch_size)
    stopping = threading.Event()
    previous = {sig: signal.getsignal(sig) for sig in STOP_SIGNALS}

    def on_signal(signum, frame) -> None:
        stopping.set()

    for sig in STOP_SIGNALS:
        signal.signal(sig, on_signal)
    sock = None
    service = None
    server = None
    thread = None
    try:
        sock = listening_socket(settings.host, settings.port)
        progress(f"loading {config.model_id}")
        service = open_service(config, replica="embedded")
        if stopping.is_set():
            raise _Stopping
        server = uvicorn.Server(uvicorn.Config(
            local_app(service, config.api_key, config.max_body_bytes), log_level="warning", access_log=False,
            lifespan="off", timeout_graceful_shutdown=HTTP_CLOSE_S))
        thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, name="gpt2x-http", daemon=True)
        thread.start()
        deadline = time.monotonic() + STARTUP_S
        while not server.started:
            if not thread.is_alive() or time.monotonic() > deadline:
                raise ServeError(f"the HTTP server did not start on {settings.host}:{settings.port}")
            if stopping.wait(0.02):
                raise _Stopping
        ready(settings.url)
        while not stopping.wait(0.5):
            if not thread.is_alive():
                raise ServeError("the HTTP server stopped")
            if not service.engine.alive and not service.engine.closing:
                raise ServeError("the engine's thread stopped")
    except _Stopping:
        pass
    finally:
        try:
            if service is not None:  # new requests 503, waiting ones ended, in-flight ones given the grace
                progress("stopping")
                started = time.monotonic()
                service.engine.stop(grace, SHUTTING_DOWN)
                log.debug("the engine stopped in %.2f s", time.monotonic() - started)
            if server is not None:
                server.should_exit = True
            if thread is not None:
                thread.join(HTTP_CLOSE_S + 3.0)
                if thread.is_alive():
                    log.warning("the HTTP server did not stop within %.0f s", HTTP_CLOSE_S + 3.0)
            if service is not None:
                close_service(service)
        finally:
            if sock is not None:
                sock.close()
            for sig, handler in previous.items():
                if handler is not None:
                    signal.signal(sig, handler)
