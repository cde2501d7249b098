"""Several models behind one server in one process (`gpt2x serve --model A --model B`): `Models` answers the
routes (routes.router's `api()`) as an HttpApi does, and hands each request to the HttpApi of the model its body
names, the body read once (the gate: the key, the size, and a 404 for a model not served) and parsed once (FastAPI).

A body without `model`, or with "", is the first model's, as a single model's server takes it. `/v1/models`,
`/health` and `/metrics` cover every model: /health keeps the first model's fields at the top level, and /metrics
is one exposition with each model's series under its own model_name (metrics.render_models).

Loading (`max_loaded`, `idle_unload_s`): a model not loaded is opened on its first request (that request waits,
as any other for it meanwhile); where `max_loaded` models are loaded, the least recently used idle one (no
request being handed to it, no rows running or waiting) is closed first. A background check, started with the
first request, closes a model idle for `idle_unload_s`. A model reloaded starts its counters again (a Prometheus
counter reset). Every slot's state is changed on the event loop alone; opening and closing run on worker threads.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import Response
from pydantic import BaseModel

from . import metrics as prom
from .errors import APIError
from .protocol import Health, ModelCard, ModelList
from .routes import MAX_BODY_BYTES, Cors, HttpApi, JSONBody, RequestGate, add_cors, error_response, new_app, router
from .service import CompletionService

log = logging.getLogger(__name__)

ROOM_WAIT_S = 60.0  # how long a model to load waits for a loaded one to go idle before its request is a 503
POLL_S = 0.05


def model_named(model: Any, served: Sequence[str]) -> str:
    """The id of the model a body names (absent or "": the first served), a 404 listing the served ids for another."""
    if not isinstance(model, str) or not model:
        return served[0]
    if model not in served:
        listed = ", ".join(repr(m) for m in served)
        raise APIError(404, f"the model {model[:100]!r} does not exist; this server serves {listed}", param="model",
                       code="model_not_found")
    return model


class ModelRoutes(RequestGate):
    """The routes with a body, each handed to the model it names (`_route`, a subclass's: a model in this process, or
    a model's deployment on Ray Serve, ray/many.py), and what every model's server checks and answers alike."""

    def model_ids(self) -> list[str]:
        """The served models' ids, in order: the first answers a body without `model`."""
        raise NotImplementedError

    async def _route(self, handler: str, body: BaseModel, request: Request) -> Response:
        raise NotImplementedError

    def check_model(self, model: Any) -> None:
        model_named(model, self.model_ids())

    async def completions(self, body: BaseModel, request: Request) -> Response:
        return await self._route("completions", body, request)

    async def chat_completions(self, body: BaseModel, request: Request) -> Response:
        return await self._route("chat_completions", body, request)

    async def responses(self, body: BaseModel, request: Request) -> Response:
        return await self._route("responses", body, request)

    async def tokenize(self, body: BaseModel, request: Request) -> Response:
        return await self._route("tokenize", body, request)

    async def detokenize(self, body: BaseModel, request: Request) -> Response:
        return await self._route("detokenize", body, request)

    @staticmethod
    def every_health(every: list[dict]) -> Response:
        """/health of several models: each one's under `models`, the first's at the top level too (a single model's
        server's fields)."""
        return JSONBody(Health(**every[0], models=every))


@dataclass(eq=False)
class ModelSlot:
    """One served model: how to open and close its service, what /v1/models and /health say of it while it is
    not loaded, and its state."""

    model_id: str
    open: Callable[[], CompletionService]  # blocking (seconds): run on a worker thread
    close: Callable[[CompletionService], None]
    max_model_len: int
    precision: str | None = None
    backend: str = ""
    provider: str = ""
    # /v1/models' fields as vLLM's: where the model comes from (its export, or a LoRA adapter's folder), and for an
    # adapter the id of the base it was merged into (None for a base)
    root: str | None = None
    parent: str | None = None
    api: HttpApi | None = None
    loading: asyncio.Future | None = None
    failed: str | None = None  # why its last load failed
    last_used: float = 0.0
    busy: int = 0  # requests routed to it whose rows may not have reached its engine yet
    last_snapshot: dict | None = None  # its metrics when it was last closed

    def idle(self) -> bool:
        if self.api is None or self.busy:
            return False
        stats = self.api.service.engine.stats()
        return not stats.get("running", 0) and not stats.get("waiting", 0)


class Models(ModelRoutes):
    """The routes' answers for several models (module docstring). `max_loaded` None: no limit (every model is
    loaded before the server starts, by `load_all`); `idle_unload_s` None: no model is closed for being idle."""

    def __init__(self, slots: Sequence[ModelSlot], api_key: str | Sequence[str] | None = None,
                 max_body_bytes: int = MAX_BODY_BYTES, max_loaded: int | None = None,
                 idle_unload_s: float | None = None):
        super().__init__(api_key, max_body_bytes)
        self.slots = {slot.model_id: slot for slot in slots}  # in order: the first answers a body without `model`
        self.first = slots[0]
        self.api_key = api_key
        self.max_loaded = max_loaded
        self.idle_unload_s = idle_unload_s
        self.created = int(time.time())
        self.closing = False
        self._watcher: asyncio.Task | None = None

    # -- opening and closing ------------------------------------------------------------------------------

    def _api(self, slot: ModelSlot, service: CompletionService) -> HttpApi:
        return HttpApi(service, self.api_key, self.max_body_bytes)

    def load_all(self, progress: Callable[[str], None] = lambda _: None) -> None:
        """Every model opened now, in order (before the HTTP server starts: no event loop runs yet)."""
        for slot in self.slots.values():
            progress(f"loading {slot.model_id}")
            slot.api = self._api(slot, slot.open())
            slot.last_used = time.monotonic()

    def loaded(self) -> list[CompletionService]:
        return [slot.api.service for slot in self.slots.values() if slot.api is not None]

    def close_all(self) -> None:
        """Every loaded model closed (after the HTTP server stopped)."""
        self.closing = True
        for slot in self.slots.values():
            api, slot.api = slot.api, None
            if api is not None:
                slot.close(api.service)

    async def _loaded(self, slot: ModelSlot) -> HttpApi:
        """The model's HttpApi, opened first where it is not loaded (one load, however many requests wait for it)."""
        self._watch()
        while slot.api is None:
            if self.closing:
                raise APIError(503, "the server is shutting down", "service_unavailable", code="service_unavailable")
            if slot.loading is None:
                slot.loading = asyncio.ensure_future(self._load(slot))
            await asyncio.shield(slot.loading)
        return slot.api

    async def _load(self, slot: ModelSlot) -> None:
        try:
            await self._make_room(slot)
            try:
                service = await asyncio.to_thread(slot.open)
            except Exception as e:  # whatever opening raised: the request gets a 503 naming the model, the log the rest
                log.warning("loading the model %s failed", slot.model_id, exc_info=True)
                slot.failed = f"{type(e).__name__}: {e}"[:300]
                raise APIError(503, f"the model {slot.model_id!r} failed to load ({slot.failed})", "service_unavailable",
                               param="model", code="model_load_failed") from None
            slot.failed = None
            slot.api = self._api(slot, service)
            slot.last_used = time.monotonic()
        finally:
            slot.loading = None  # a failed load is tried again by the model's next request

    async def _make_room(self, slot: ModelSlot) -> None:
        """With `max_loaded`, the least recently used idle model closed until `slot` fits (a 503 after ROOM_WAIT_S
        of every loaded model busy)."""
        if self.max_loaded is None:
            return
        deadline = time.monotonic() + ROOM_WAIT_S
        while True:
            others = [s for s in self.slots.values() if s is not slot and (s.api is not None or s.loading is not None)]
            if len(others) < self.max_loaded:
                return
            idle = [s for s in others if s.idle()]
            if idle:
                await self._unload(min(idle, key=lambda s: s.last_used))
                continue
            if time.monotonic() > deadline:
                raise APIError(503, f"the model {slot.model_id!r} is not loaded and the {len(others)} loaded are all "
                               f"busy (--models-max {self.max_loaded}); retry later", "service_unavailable",
                               param="model", code="model_not_loaded")
            await asyncio.sleep(POLL_S)

    async def _unload(self, slot: ModelSlot) -> None:
        api, slot.api = slot.api, None
        if api is None:
            return
        snapshot = api.metrics.snapshot()
        snapshot["gauges"] = dict.fromkeys(snapshot["gauges"], 0)  # closed: nothing runs or waits
        slot.last_snapshot = snapshot
        log.info("closing the model %s", slot.model_id)
        await asyncio.to_thread(slot.close, api.service)

    def _watch(self) -> None:
        """The idle check, started on the event loop by the first request (no loop runs before)."""
        if self.idle_unload_s is not None and self._watcher is None:
            self._watcher = asyncio.get_running_loop().create_task(self._unload_idle())

    async def _unload_idle(self) -> None:
        while not self.closing:
            await asyncio.sleep(min(1.0, self.idle_unload_s / 4))
            now = time.monotonic()
            for slot in self.slots.values():
                if slot.loading is None and slot.idle() and now - slot.last_used >= self.idle_unload_s:
                    with contextlib.suppress(Exception):  # a close that fails leaves the check running
                        await self._unload(slot)

    # -- routing ------------------------------------------------------------------------------------------

    def model_ids(self) -> list[str]:
        return list(self.slots)

    def slot_of(self, model: Any) -> ModelSlot:
        return self.slots[model_named(model, self.model_ids())]

    async def _route(self, handler: str, body: BaseModel, request: Request) -> Response:
        """The request handed to the HttpApi of the model its body names (the gate passed: routes.gated_route)."""
        slot = self.slot_of(getattr(body, "model", None))
        slot.busy += 1  # before the load: a model with a request on its way is not idle
        try:
            api = await self._loaded(slot)
            return await getattr(api, handler)(body, request)
        except APIError as e:
            return error_response(e)
        finally:
            slot.busy -= 1
            slot.last_used = time.monotonic()

    # -- every model --------------------------------------------------------------------------------------

    def models(self, request: Request) -> Response:
        return self._authorized(request, lambda: ModelList(data=[
            ModelCard(id=slot.model_id, created=self.created, owned_by="gpt2x", max_model_len=slot.max_model_len,
                      precision=slot.precision, root=slot.root, parent=slot.parent) for slot in self.slots.values()]))

    def _health(self, slot: ModelSlot) -> dict:
        api = slot.api
        if api is not None:
            return {**api.service.health().model_dump(), "loaded": True}
        return {"status": "ok", "model": slot.model_id, "replica": "embedded", "backend": slot.backend,
                "provider": slot.provider, "running": 0, "waiting": 0, "loaded": False,
                "loading": slot.loading is not None, "error": slot.failed}

    def health(self, request: Request) -> Response:
        """Open without the API key: every model's state under `models`, the first's at the top level too (a
        single model's server's fields)."""
        return self.every_health([self._health(slot) for slot in self.slots.values()])

    async def prometheus(self, request: Request) -> Response:
        """Every model's series, each under its model_name (a model never loaded has none yet)."""
        try:
            self.authorize(request)
        except APIError as e:
            return error_response(e)
        models = []
        for slot in self.slots.values():
            api = slot.api
            snapshot = api.metrics.snapshot() if api is not None else slot.last_snapshot
            if snapshot is not None:
                models.append((prom.merge([snapshot]), slot.model_id))
        return Response(prom.render_models(models), media_type=prom.CONTENT_TYPE)


def models_app(models: Models, cors: Cors | None = None) -> FastAPI:
    """routes.local_app for several models: the same routes, each answered by `models`."""
    app = new_app()
    app.include_router(router(lambda: models))
    add_cors(app, cors)
    return app
