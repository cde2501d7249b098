"""`gpt2x serve` on Ray Serve: one deployment whose replicas each load the export once and batch the
requests they are routed (engine.py), behind a FastAPI ingress with OpenAI's completions routes.

The same application runs on a local Ray instance started here (the default, on 127.0.0.1) and on an
existing Ray cluster (`address`), where Ray Serve places the replicas and runs the HTTP proxies;
nothing in the application changes between the two. On a cluster every node needs gpt2x installed
and the export folder at the same path (a shared filesystem, or the same image).
"""

# No `from __future__ import annotations` here: FastAPI reads the routes' `Request` annotations at
# runtime, through Ray Serve's ingress wrapper.
import logging
import os
import signal
import socket
import threading
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import ray
from fastapi import Request
from ray import serve

from ..choices import BackendKind, Progress, ProviderKind, no_progress
from ..errors import ServeError, UsageError
from ..generation.speculative import DraftSettings, ModelDrafter
from ..onnx.artifact import read_export
from ..workflows import export_backend, open_drafter
from .engine import EngineSettings, refuse_batched_draft
from .http import COMPLETIONS_ROUTE, HEALTH_ROUTE, MAX_BODY_BYTES, MODELS_ROUTE, HttpApi, new_app
from .service import CompletionService

APP_NAME = "gpt2x"
REFUSAL_HEADROOM = 64  # requests per replica beyond its batch and queue that reach it only to be refused
app = new_app()  # /openapi.json and /docs describe the routes below (http.py); they need no API key


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
    # ONNX Runtime's in-place KV cache (int8/int4 graphs). None: wherever the graph allows it when not
    # batching, the growing cache when batching; True requires it, False refuses it. A batch's rows
    # leave and join inside the in-place buffers (kvbuffers.merge_rows, copying only the rows that
    # move), but a join that needs more rows than the buffers hold moves every row into fresh memory,
    # whose first touch is slow on this kind of VM, while the growing cache reuses ONNX Runtime's
    # arena: benchmarks/engine_load.py measured int8 at 16 concurrent requests at 471 tok/s growing
    # against 399 in place (that one merge: 562 ms against 24).
    in_place_kv: bool | None = None
    # Speculative decoding (engine.py, at max batch size 1): the draft as the user named it (int4,
    # int8, ngram, a model or export folder; None: none), and what each replica opens next to its
    # backend (workflows.open_drafter): `ngram` or the draft's export folder, resolved and exported by
    # the command before Ray starts (draft.prepare_draft); None: `draft` itself.
    draft: str | None = None
    draft_source: str | None = None
    draft_settings: DraftSettings = field(default_factory=DraftSettings)


@dataclass(frozen=True)
class ServeSettings:
    """Where and how many: replicas, the HTTP address, and the Ray cluster (None: a local one)."""

    replicas: int = 1
    host: str = "127.0.0.1"
    port: int = 8000
    address: str | None = None
    cpus_per_replica: float = 1.0
    route_prefix: str = "/"
    app_name: str = APP_NAME

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


@serve.deployment(name="gpt2x", max_constructor_retry_count=3, graceful_shutdown_timeout_s=20,
                  health_check_period_s=5)
@serve.ingress(app)
class Gpt2xReplica:
    """One replica: the export loaded once, an engine batching the requests routed here."""

    def __init__(self, config: ReplicaConfig):
        info = read_export(Path(config.export))
        in_place = config.in_place_kv
        if in_place is None and config.engine.max_batch_size > 1:
            in_place = False  # a batching replica keeps the growing cache (see ReplicaConfig)
        backend = export_backend(BackendKind(config.backend), info, ProviderKind(config.provider), config.threads,
                                 in_place_kv=in_place)
        drafter = None
        if config.draft is not None:  # on the target's backend and provider; a CPU draft gets 1 thread
            drafter = open_drafter(config.draft_source or config.draft, backend, BackendKind(config.backend),
                                   ProviderKind(config.provider), None, config.draft_settings)
        replica = serve.get_replica_context().replica_id.unique_id
        self.service = CompletionService(backend, config.engine, config.model_id, replica, drafter, config.draft_settings,
                                         config.draft)
        self.http = HttpApi(self.service, config.api_key, config.max_body_bytes)

    @app.post("/v1/completions", **COMPLETIONS_ROUTE)
    async def completions(self, request: Request):
        return await self.http.completions(request)

    @app.get("/v1/models", **MODELS_ROUTE)
    def models(self, request: Request):
        return self.http.models(request)

    @app.get("/health", **HEALTH_ROUTE)
    def health(self, request: Request):
        return self.http.health(request)

    def check_health(self) -> None:
        """Ray Serve's periodic check: a replica whose engine thread died is replaced."""
        if not self.service.engine.alive:
            raise RuntimeError("the engine thread has stopped")

    def __del__(self) -> None:
        service = getattr(self, "service", None)
        if service is not None and service.close():  # the engine stopped: release what this replica opened
            service.backend.close()
            if isinstance(service.drafter, ModelDrafter):
                service.drafter.backend.close()


def application(config: ReplicaConfig, settings: ServeSettings):
    """The Ray Serve application: the deployment with its replicas and bounded queues."""
    engine = config.engine
    return Gpt2xReplica.options(
        num_replicas=settings.replicas,
        ray_actor_options={"num_cpus": settings.cpus_per_replica},
        # Requests a replica takes: its batch and waiting queue, plus REFUSAL_HEADROOM that it answers
        # 429 (JSON, at once). Beyond that Ray Serve's proxies queue a bounded number, then answer 503.
        max_ongoing_requests=engine.max_batch_size + engine.max_waiting + REFUSAL_HEADROOM,
        max_queued_requests=REFUSAL_HEADROOM * settings.replicas,
    ).bind(config)


def port_free(host: str, port: int) -> bool:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


def start(config: ReplicaConfig, settings: ServeSettings, progress: Progress = no_progress) -> str:
    """Start (or join) Ray, run the application and return its URL once every replica has loaded."""
    settings.validate()
    if config.draft is not None:
        refuse_batched_draft(config.engine.max_batch_size)
    if settings.address is None and settings.port and not ray.is_initialized() and not port_free(settings.host, settings.port):
        raise UsageError(f"port {settings.port} on {settings.host} is in use", option="port")
    logging.getLogger("ray.serve").setLevel(logging.WARNING)  # the driver's own Serve messages
    if not ray.is_initialized():
        progress(f"starting Ray ({settings.address or 'a local instance'})")
        try:
            # "local": a new instance even where `ray start` left a cluster running on this machine
            # (which ray.init() would otherwise join, and stop() would then shut down).
            ray.init(address=settings.address or "local", include_dashboard=False, logging_level=logging.WARNING,
                     configure_logging=True, namespace="gpt2x")
        except (ConnectionError, RuntimeError, ValueError) as e:
            raise ServeError(f"could not start or reach Ray at {settings.address or 'a local instance'}: {e}") from None
    serve.start(http_options={"host": settings.host, "port": settings.port},
                logging_config={"log_level": "WARNING", "enable_access_log": False})
    progress(f"loading {settings.replicas} replica(s) of {config.model_id}")
    try:
        serve.run(application(config, settings), name=settings.app_name, route_prefix=settings.route_prefix,
                  logging_config={"log_level": "WARNING", "enable_access_log": False})
    except RuntimeError as e:  # Ray Serve's report of replicas that failed to start
        raise ServeError(f"the replicas failed to start: {str(e).strip().splitlines()[-1][:500]}") from None
    return settings.url


def stop(settings: ServeSettings) -> None:
    """Remove the application; a local Ray (and its Serve) is shut down, a cluster keeps running."""
    try:
        if settings.address is None:
            serve.shutdown()
        else:
            serve.delete(settings.app_name)
    finally:
        ray.shutdown()


def serve_until_stopped(config: ReplicaConfig, settings: ServeSettings, ready: Callable[[str], None],
                        progress: Progress = no_progress) -> None:
    """start(), tell `ready` the URL, serve until SIGTERM or Ctrl-C, then stop() cleanly."""
    stopping = threading.Event()
    previous = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT)}

    def on_signal(signum, frame) -> None:
        stopping.set()

    try:
        url = start(config, settings, progress)
        for sig in previous:  # installed after ray.init, which sets its own
            signal.signal(sig, on_signal)
        ready(url)
        while not stopping.wait(1.0):
            pass
        progress("stopping")
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        if ray.is_initialized():
            stop(settings)


def describe(config: ReplicaConfig, settings: ServeSettings) -> dict:
    """What is served, for the CLI's report (no API key)."""
    draft = {} if config.draft is None else {"draft": config.draft, "draft_settings": asdict(config.draft_settings)}
    return {"url": settings.url, "model": config.model_id, "export": config.export, "backend": config.backend,
            "provider": config.provider, "replicas": settings.replicas, "ray": settings.address or "local",
            "engine": asdict(config.engine), **draft, "api_key": config.api_key is not None}
