"""`gpt2x serve` on Ray Serve (more than one replica, a cluster, or one replica asked to run on Ray;
single_process.py serves one replica in this process without Ray): one deployment whose replicas each
load the export once and batch the requests they are routed (core/engine.py), behind a FastAPI
ingress with the OpenAI routes (openai/routes.py). Several models: a deployment per model, each with its
own replicas, behind a router deployment that routes each request by its `model` (many.py).

The same application runs on a local Ray instance started here (the default, on 127.0.0.1) and on an
existing Ray cluster (`address`), where Ray Serve places the replicas and runs the HTTP proxies;
nothing in the application changes between the two. On a cluster every node needs gpt2x installed
and the export folder at the same path (a shared filesystem, or the same image).

Beside the replicas, one small actor per application (per model with several), its hub (hub.py): each replica hands it
its metrics' snapshot (openai/metrics.py) every REPORT_S where it changed (else every IDLE_REPORT_S) and as each
request is answered, and `/metrics`, whichever replica answers it, sums them all. The hub also carries the stop:
`stop()` tells it, each replica hears it at its next report and stops its engine (engine.Engine.stop: new requests
are a 503, waiting ones end at once with an error, the ones in flight get STOP_GRACE_S to finish and
then end with an error too: an error event in a stream, a JSON error otherwise), and once every
replica says it has drained, Ray Serve removes them with nothing in flight, and Ray is shut down.

Stopping on a signal (`serve_until_stopped`): SIGTERM and SIGINT, to this process or to its whole
process group, stop the server cleanly. The local Ray instance's own processes (GCS, raylet, log
monitor, their agents and workers) are started in sessions of their own
(patches.py's `ray_processes_in_their_own_session`), so that a signal sent to our group reaches this process alone,
which then stops the application and Ray in order; sent to them too, it would take the GCS down under
Ray Serve (whose shutdown then waits out its timeouts, or the driver aborts). Ray's own SIGTERM
handlers are kept out of this process (`rays_sigterm_handlers_left_out`: they exit on the spot), and
abseil's failure handler, which ray.init installs under Python's and which arms a 3-second alarm that
aborts the process (exit code 134), is replaced by ours as soon as ray.init returns. Our handler only
notes the signal; the main thread stops between steps (`StopRequested` while starting). What Ray prints in this
process while it serves (its raylet's reports, its workers' relayed output) goes to stderr
(`rays_driver_output_on_stderr`): stdout carries the ready line alone.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import socket
import subprocess
import threading
import time
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import replace

import ray
from pydantic import BaseModel
from ray import serve
from ray.exceptions import RayError

from ...choices import Progress, no_progress
from ...errors import ServeError, UsageError
from ..core.engine import refuse_batched_draft
from ..openai.protocol import ModelCard
from ..openai.routes import HttpApi, new_app, router
from ..replica import (  # what both paths share; re-exported here for the callers that use Ray Serve
    APP_NAME,
    SHUTTING_DOWN,
    STOP_GRACE_S,
    STOP_SIGNALS,
    ReplicaConfig,
    ServeSettings,
    close_service,
    describe,
    listed_as,
    open_service,
)
from .hub import HUB_NAMESPACE, IDLE_REPORT_S, REPORT_S, MetricsHub
from .many import ModelRouter, answer, model_card
from .patches import ray_processes_in_their_own_session, rays_driver_output_on_stderr, rays_sigterm_handlers_left_out
from .proxy import PROXY_CALLBACK

__all__ = ["APP_NAME", "SHUTTING_DOWN", "STOP_GRACE_S", "ReplicaConfig", "ServeSettings", "describe", "serve_until_stopped",
           "start", "stop"]

log = logging.getLogger(__name__)

REFUSAL_HEADROOM = 64  # requests per replica beyond its batch and queue that reach it only to be refused
HUB_TIMEOUT_S = 5.0  # a call to the hub that takes longer is given up (the metrics are then this replica's)
PUBLISH_TIMEOUT_S = 1.0  # as long as an answered request waits to hand its counts to the hub
# What the processes of a local instance started here take from this process's environment (those of a
# cluster keep their own): Ray Serve's proxy reaches the replicas over gRPC rather than through Ray's
# actor calls, which costs less per streamed chunk (benchmarks/results/serve-ray-transport-cpu-2core), and
# takes gpt2x's middleware (proxy.py: a stream whose replica is lost ends with an error event).
LOCAL_INSTANCE_ENV = {"RAY_SERVE_PROXY_USE_GRPC": "1", "RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH": PROXY_CALLBACK}


class HubExchange:
    """A replica's side of the hub (routes.Exchange): its snapshot handed in, everyone's taken out."""

    shared = True

    def __init__(self, hub, replica: str):
        self.hub = hub
        self.replica = replica
        self._warned = False

    def _unreachable(self, e: BaseException) -> None:
        if not self._warned:  # once: a hub that is gone stays gone
            log.warning("the metrics hub did not answer (%s); /metrics shows this replica's alone", type(e).__name__)
            self._warned = True

    async def publish(self, snapshot: dict) -> None:
        try:
            await asyncio.wait_for(asyncio.wrap_future(self.hub.report.remote(self.replica, snapshot).future()),
                                   PUBLISH_TIMEOUT_S)
        except (RayError, asyncio.TimeoutError) as e:
            self._unreachable(e)

    async def gather(self, own: dict) -> list[dict]:
        try:
            return await asyncio.wait_for(asyncio.wrap_future(self.hub.exchange.remote(self.replica, own).future()),
                                          HUB_TIMEOUT_S)
        except (RayError, asyncio.TimeoutError) as e:
            self._unreachable(e)
            return [own]

    def report(self, snapshot: dict) -> float | None:
        """From the replica's reporting thread: the hub's answer (a stop's grace, or None)."""
        try:
            return ray.get(self.hub.report.remote(self.replica, snapshot), timeout=HUB_TIMEOUT_S)
        except RayError as e:  # GetTimeoutError is one
            self._unreachable(e)
            return None


def _replica_api() -> HttpApi:
    """The HttpApi of the replica a request reached (Ray Serve's replica context: one replica per actor)."""
    return serve.get_replica_context().servable_object.http


# Ray Serve's ingress: the routes of openai/routes.py (/openapi.json and /docs describe them, and need
# no API key), each answered by the replica's own HttpApi.
app = new_app()
app.include_router(router(_replica_api))


class _Replica:
    """One replica: the export loaded once, an engine batching the requests routed here, its metrics handed to its
    hub."""

    def __init__(self, config: ReplicaConfig):
        replica = serve.get_replica_context().replica_id.unique_id
        self.service = open_service(config, replica)
        self.exchange = None
        if config.metrics_hub is not None:
            try:
                self.exchange = HubExchange(ray.get_actor(config.metrics_hub, namespace=HUB_NAMESPACE), replica)
            except ValueError:  # no such actor: the driver that made it is gone
                log.warning("no metrics hub %r: /metrics shows this replica's alone", config.metrics_hub)
        self.http = HttpApi(self.service, config.api_keys, config.max_body_bytes, self.exchange)
        self._closing = threading.Event()
        if self.exchange is not None:
            threading.Thread(target=self._report, name="gpt2x-metrics", daemon=True).start()

    def _report(self) -> None:
        """Every REPORT_S: this replica's snapshot to the hub where it changed since the last it handed in, else
        every IDLE_REPORT_S. When the hub answers that a stop has begun, the engine stops (its requests in flight get
        the grace the hub says), and the replica says it has drained."""
        sent, sent_at = None, 0.0
        while not self._closing.wait(REPORT_S):
            snapshot = self.http.metrics.snapshot()
            values = {key: value for key, value in snapshot.items() if key != "at"}
            if values == sent and time.monotonic() - sent_at < IDLE_REPORT_S:
                continue
            sent, sent_at = values, time.monotonic()
            grace = self.exchange.report(snapshot)
            if grace is not None and not self.http.metrics.drained:
                self.service.engine.stop(grace, SHUTTING_DOWN)
                self.http.metrics.drained = True
                self.exchange.report(self.http.metrics.snapshot())

    def check_health(self) -> None:
        """Ray Serve's periodic check: a replica whose engine thread died is replaced (not one that a
        stop has drained)."""
        if not self.service.engine.alive and not self.http.metrics.drained:
            raise RuntimeError("the engine thread has stopped")

    def __del__(self) -> None:
        closing = getattr(self, "_closing", None)
        if closing is not None:
            closing.set()
        service = getattr(self, "service", None)
        if service is not None:  # the engine stopped: release what this replica opened
            close_service(service)


# Ray Serve's own drain (a replica removed waits for its requests) backs the hub's up: a replica that
# did not hear of the stop gets STOP_GRACE_S + 2 s, and is then killed with whatever it still runs.
_REPLICA_OPTIONS = dict(max_constructor_retry_count=3, graceful_shutdown_timeout_s=STOP_GRACE_S + 2.0,
                        graceful_shutdown_wait_loop_s=0.1, health_check_period_s=5)


@serve.deployment(name="gpt2x", **_REPLICA_OPTIONS)
@serve.ingress(app)
class Gpt2xReplica(_Replica):
    """One replica of the one model served: the routes answered here."""


@serve.deployment(name="gpt2x-model", **_REPLICA_OPTIONS)
class Gpt2xModel(_Replica):
    """One replica of one of several models, behind the router (many.py): each request handed over by it."""

    async def call(self, handler: str, body: BaseModel) -> AsyncIterator[tuple | bytes]:
        async for item in answer(self.http, handler, body):  # a generator method: Ray Serve streams what it yields
            yield item

    def health(self) -> dict:
        return self.service.health().model_dump()

    async def snapshots(self) -> list[dict]:
        """Every replica's of this model (its hub's), this one's included."""
        own = self.http.metrics.snapshot()
        return [own] if self.exchange is None else await self.exchange.gather(own)


# The router's ingress: the same routes, each answered by the router replica's ModelRouter.
router_app = new_app()
router_app.include_router(router(lambda: serve.get_replica_context().servable_object.api))


@serve.deployment(name="gpt2x-router", ray_actor_options={"num_cpus": 0})
@serve.ingress(router_app)
class Gpt2xRouter:
    """The ingress of several models: each request routed by its `model` to that model's deployment."""

    def __init__(self, cards: list[ModelCard], api_keys: tuple[str, ...], max_body_bytes: int, *handles):
        self.api = ModelRouter(cards, {card.id: handle for card, handle in zip(cards, handles)}, api_keys,
                               max_body_bytes)


def hub_name(settings: ServeSettings, model: int | None = None) -> str:
    """The application's hub, or with several models, model number `model`'s."""
    return f"metrics-hub:{settings.app_name}" + ("" if model is None else f":{model}")


_hubs: dict = {}  # the hubs this process made, by name: a named actor lives while a handle to it does
_app_hubs: dict[str, list[str]] = {}  # the hubs' names of each application this process deployed


def _replica_options(config: ReplicaConfig, settings: ServeSettings) -> dict:
    """A model's replicas and their bounded queues: the requests a replica takes are its batch and waiting queue,
    plus REFUSAL_HEADROOM that it answers 429 (JSON, at once); beyond that Ray Serve's proxies queue a bounded
    number, then answer 503."""
    return dict(num_replicas=settings.replicas, ray_actor_options={"num_cpus": settings.cpus_per_replica},
                max_ongoing_requests=config.engine.rows_held + REFUSAL_HEADROOM,
                max_queued_requests=REFUSAL_HEADROOM * settings.replicas)


def application(config: ReplicaConfig, settings: ServeSettings, metrics_hub: str | None = None):
    """The Ray Serve application: the deployment with its replicas and bounded queues (and, with
    `metrics_hub`, the name of the hub its replicas report to)."""
    if metrics_hub is not None:
        config = replace(config, metrics_hub=metrics_hub)
    return Gpt2xReplica.options(**_replica_options(config, settings)).bind(config)


def several_application(configs: list[ReplicaConfig], settings: ServeSettings, metrics_hubs: list[str]):
    """Several models' application: each model a deployment with `settings.replicas` replicas of its own, reporting
    to its own hub, behind the router (as many replicas, no CPU of their own), which takes every request the models
    take."""
    models = []
    for i, (config, hub) in enumerate(zip(configs, metrics_hubs)):
        config = replace(config, metrics_hub=hub)
        models.append(Gpt2xModel.options(name=f"gpt2x-model-{i}", **_replica_options(config, settings)).bind(config))
    cards = [_card(config) for config in configs]
    taken = sum(_replica_options(c, settings)["max_ongoing_requests"] for c in configs) * settings.replicas
    first = configs[0]
    return Gpt2xRouter.options(num_replicas=settings.replicas, max_ongoing_requests=taken,
                               max_queued_requests=REFUSAL_HEADROOM * settings.replicas
                               ).bind(cards, first.api_keys, first.max_body_bytes, *models)


def _card(config: ReplicaConfig) -> ModelCard:
    n_positions, precision, root = listed_as(config)
    return model_card(config.model_id, n_positions, precision, root, config.parent)


def port_free(host: str, port: int) -> bool:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


class StopRequested(Exception):
    """SIGTERM or SIGINT while the server was starting."""


def end_process_groups(processes: list[subprocess.Popen], wait_s: float = 3.0) -> None:
    """Each process's group (each leads its own: ray_processes_in_their_own_session) ended: given
    `wait_s` in all to empty by itself (ray.shutdown's own stop), then killed (SIGKILL). The list is
    emptied."""
    deadline = time.monotonic() + wait_s
    for process in processes:
        while _group_alive(process) and time.monotonic() < deadline:
            time.sleep(0.05)
        if _group_alive(process):
            log.warning("Ray's process %d (%s) outlived the stop; killed", process.pid, process.args[0] if process.args else "?")
            try:
                os.killpg(process.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        process.poll()  # reaped, where it was this process's child
    processes.clear()


def _group_alive(process: subprocess.Popen) -> bool:
    process.poll()  # a child that exited is reaped (not a zombie that keeps its group)
    try:
        os.killpg(process.pid, 0)
    except (ProcessLookupError, PermissionError):
        return False
    return True


_local_processes: list[subprocess.Popen] = []  # the processes of the local Ray instance this process started


def _cancel_alarm() -> None:
    """Disarm abseil's abort timer (Ray's failure signal handler arms a 3 s SIGALRM that aborts the
    process when a SIGTERM reached it); gpt2x sets no alarm of its own."""
    if hasattr(signal, "alarm"):
        signal.alarm(0)


@contextlib.contextmanager
def local_instance_environment():
    """LOCAL_INSTANCE_ENV in os.environ while a local Ray instance starts (its GCS and raylet inherit it,
    and the raylet passes it on to every worker it starts); a variable the user has set keeps its value.
    The environment is as it was afterwards."""
    added = {k: v for k, v in LOCAL_INSTANCE_ENV.items() if k not in os.environ}
    os.environ.update(added)
    try:
        yield
    finally:
        for k in added:
            os.environ.pop(k, None)


def _init_ray(settings: ServeSettings) -> None:
    """ray.init: a local instance (its processes in their own session) or the cluster at `address`,
    with this process's signal handlers left in place (Ray's own SIGTERM handlers exit mid-start). In
    the main thread SIGTERM and SIGINT are also held (blocked) meanwhile, and the threads ray.init
    starts inherit that: a signal reaches this process's main thread, never a thread of Ray's where
    abseil's failure handler (installed by ray.init under Python's) would take it first. The handlers
    this process had are put back (over abseil's) before the signals are unblocked; one that came
    meanwhile is then handled by them."""
    main = threading.current_thread() is threading.main_thread() and hasattr(signal, "pthread_sigmask")
    handlers = {sig: signal.getsignal(sig) for sig in STOP_SIGNALS} if main else {}
    mask = signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS) if main else None
    try:
        local = settings.address is None
        with ray_processes_in_their_own_session(_local_processes if local else []), rays_sigterm_handlers_left_out(), \
                (local_instance_environment() if local else contextlib.nullcontext()):
            # "local": a new instance even where `ray start` left a cluster running on this machine
            # (which ray.init() would otherwise join, and stop() would then shut down).
            ray.init(address=settings.address or "local", include_dashboard=False, logging_level=logging.WARNING,
                     configure_logging=True, namespace="gpt2x")
    except (ConnectionError, RuntimeError, ValueError) as e:
        ray.shutdown()
        end_process_groups(_local_processes, wait_s=1.0)  # what a failed ray.init had started
        raise ServeError(f"could not start or reach Ray at {settings.address or 'a local instance'}: {e}") from None
    finally:
        _restore(handlers)
        if mask is not None:
            signal.pthread_sigmask(signal.SIG_SETMASK, mask)


def _deploy(application, settings: ServeSettings, stopping: threading.Event | None) -> None:
    """The application deployed, and waited for until it runs (every replica loaded): StopRequested
    as soon as `stopping` is set meanwhile, ServeError if its replicas fail to start."""
    serve._run(application, _blocking=False, name=settings.app_name,
               route_prefix=settings.route_prefix, logging_config={"log_level": "WARNING", "enable_access_log": False})
    while True:
        if stopping is not None and stopping.is_set():
            raise StopRequested("stopped while the replicas were loading")
        app = serve.status().applications.get(settings.app_name)
        if app is not None and app.status == "RUNNING":
            return
        if app is not None and app.status == "DEPLOY_FAILED":  # Ray Serve's report of replicas that failed
            raise ServeError(f"the replicas failed to start: {str(app.message).strip().splitlines()[-1][:500]}")
        time.sleep(0.1)


def start(config: ReplicaConfig, settings: ServeSettings, progress: Progress = no_progress,
          stopping: threading.Event | None = None, others: Sequence[ReplicaConfig] = ()) -> str:
    """Start (or join) Ray, run the application and return its URL once every replica has loaded.
    With `stopping`: StopRequested, between steps and while the replicas load, once it is set. With `others`:
    several models, `config`'s first (several_application)."""
    settings.validate()
    if config.draft is not None:
        refuse_batched_draft(config.engine.max_batch_size)
    if settings.address is None and settings.port and not ray.is_initialized() and not port_free(settings.host, settings.port):
        raise UsageError(f"port {settings.port} on {settings.host} is in use", option="port")
    logging.getLogger("ray.serve").setLevel(logging.WARNING)  # the driver's own Serve messages

    def check() -> None:
        if stopping is not None and stopping.is_set():
            raise StopRequested("stopped while starting")

    if not ray.is_initialized():
        progress(f"starting Ray ({settings.address or 'a local instance'})")
        _init_ray(settings)
    check()
    serve.start(http_options={"host": settings.host, "port": settings.port},
                logging_config={"log_level": "WARNING", "enable_access_log": False})
    refuse_other_http_address(settings)
    refuse_a_running_application(settings)
    # The hubs: owned by this process (each ends with it, or when its handle here is dropped: `stop`), in a
    # namespace of their own, one per application, or with several models one per model.
    names = [hub_name(settings, i) for i in range(1 + len(others))] if others else [hub_name(settings)]
    for name in names:
        _hubs[name] = MetricsHub.options(name=name, namespace=HUB_NAMESPACE, get_if_exists=True).remote()
    _app_hubs[settings.app_name] = names
    check()
    models = [config, *others]
    progress(f"loading {settings.replicas} replica(s) of {', '.join(c.model_id for c in models)}")
    _deploy(several_application(models, settings, names) if others else application(config, settings, names[0]),
            settings, stopping)
    return settings.url


def refuse_other_http_address(settings: ServeSettings) -> None:
    """A UsageError, before anything is deployed, where Ray Serve already ran on the cluster listening elsewhere than
    `settings` ask: it keeps the HTTP options it started with (serve.start's apply only to a new one), so the
    application would answer there, not at the URL asked for."""
    try:  # Ray's own record of them (the client's; no public API gives it)
        options = serve.context._get_global_client().http_config
        host, port = str(options.host), int(options.port)
    except (AttributeError, TypeError, ValueError, RayError):  # another Ray's layout: nothing to compare with
        return
    if (host, port) != (settings.host, settings.port):
        raise UsageError(f"Ray Serve on this cluster already listens on {host}:{port} and keeps that address (its HTTP "
                         f"options are set when it starts): give --host {host} --port {port}", option="port")


def refuse_a_running_application(settings: ServeSettings) -> None:
    """A UsageError, before anything is deployed, where the cluster already runs an application of this name (another
    `gpt2x serve --address`'s, or one whose server was killed): Ray Serve would replace it, under its server's feet,
    and the two servers would share its metrics hub and its stop."""
    if settings.app_name in serve.status().applications:
        raise UsageError(f"Ray Serve on this cluster already runs an application named {settings.app_name!r}: this "
                         f"server would replace it; remove it first (`serve shutdown` removes every application, "
                         f"serve.delete({settings.app_name!r}) in Python that one)", option="address")


def drain(settings: ServeSettings, grace: float = STOP_GRACE_S) -> bool:
    """Tell the application's replicas to stop (through the hubs this process made for it: every model's at once) and
    wait until each has: requests in flight get `grace` seconds, then end with an error. True once every replica has
    drained; False when a hub is gone or they did not say so within grace + 2 s."""
    try:
        hubs = [ray.get_actor(name, namespace=HUB_NAMESPACE) for name in _app_hubs[settings.app_name]]
        ray.get([hub.stop.remote(grace) for hub in hubs], timeout=HUB_TIMEOUT_S)
        deadline = time.monotonic() + grace + 2.0
        while time.monotonic() < deadline:
            if all(ray.get([hub.drained.remote() for hub in hubs], timeout=HUB_TIMEOUT_S)):
                return True
            time.sleep(0.05)
    except (RayError, ValueError):  # no hub, or it is gone: Ray Serve's own drain does the rest
        return False
    return False


def stop(settings: ServeSettings, grace: float = STOP_GRACE_S) -> None:
    """Drain the replicas (`drain`), then remove the application, where this process deployed it (a start refused
    leaves the cluster's applications alone); a local Ray (and its Serve, and every process of both) is shut down, a
    cluster keeps running."""
    try:
        if ray.is_initialized() and settings.app_name in _app_hubs:  # deployed by this process: not another server's
            drain(settings, grace)
            # Ray Serve removes the replicas once their last responses are out. A local instance then
            # goes whole with Ray (serve.shutdown would have the controller kill itself under its own
            # graceful_shutdown call, which Ray then reports as a failed task).
            serve.delete(settings.app_name)
    finally:
        for name in _app_hubs.pop(settings.app_name, []):
            _hubs.pop(name, None)  # a hub ends with its last handle
        ray.shutdown()
        end_process_groups(_local_processes)  # what ray.shutdown left of the local instance (nothing, normally)


def serve_until_stopped(config: ReplicaConfig, settings: ServeSettings, ready: Callable[[str], None],
                        progress: Progress = no_progress, grace: float = STOP_GRACE_S,
                        others: Sequence[ReplicaConfig] = ()) -> None:
    """start(), tell `ready` the URL, serve until SIGTERM or SIGINT (to this process or its group),
    then stop() cleanly: requests in flight get `grace` seconds, and Ray's processes are gone when it
    returns. A signal while starting stops what has started, once the step under way (starting Ray,
    starting Serve) is done, or at once while the replicas load; `ready` is then not called. The
    handler only notes the signal: nothing is interrupted inside Ray's code."""
    stopping = threading.Event()
    previous = {sig: signal.getsignal(sig) for sig in STOP_SIGNALS}

    def on_signal(signum, frame) -> None:
        _cancel_alarm()
        stopping.set()

    for sig in STOP_SIGNALS:
        signal.signal(sig, on_signal)
    try:
        with rays_driver_output_on_stderr():  # stdout: the ready line alone
            try:
                try:
                    url = start(config, settings, progress, stopping, others)
                    if not stopping.is_set():
                        ready(url)
                    while not stopping.wait(0.5):
                        pass
                except StopRequested:
                    pass
                progress("stopping")
                stop(settings, grace)
            finally:
                stopping.set()
                if ray.is_initialized() or _local_processes:  # start() failed, or the stop was cut short
                    stop(settings, grace=0.0)
    finally:
        _restore(previous)


def _restore(handlers: dict) -> None:
    for sig, handler in handlers.items():
        if handler is not None:
            signal.signal(sig, handler)
