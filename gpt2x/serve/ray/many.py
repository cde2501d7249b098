"""Several models on Ray Serve (`gpt2x serve --model A --model B --replicas N`, or `--ray`): each model a deployment of
its own with its own replicas (deploy.Gpt2xModel), behind one ingress deployment whose `ModelRouter` answers the routes
as openai/many.Models does in one process: the key, the body's size and a 404 for a model not served checked once,
the body parsed once (FastAPI), then handed to the model's deployment with the route's name (`call`), and its answer
relayed, whole or as the event stream it is.

A client that leaves reaches the model's replica as Ray Serve's cancellation of the call (its rows are freed at the
next step, as on one replica); a model replica lost mid-stream ends the stream with proxy.py's error event. `/v1/models`
lists every model from its export's record; `/health` and `/metrics` ask each model's deployment (its metrics summed
over its replicas by its own hub), each model's series under its own model_name.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Sequence

from fastapi import Request
from fastapi.responses import Response, StreamingResponse
from pydantic import BaseModel
from ray.exceptions import RayError
from ray.serve.exceptions import RayServeException

from ..openai import metrics as prom
from ..openai.errors import APIError
from ..openai.many import ModelRoutes, model_named
from ..openai.protocol import ModelCard, ModelList
from ..openai.routes import MAX_BODY_BYTES, error_response
from .proxy import lost_stream_end

CALL_TIMEOUT_S = 5.0  # a model's /health or /metrics answer that takes longer is reported as not answering
LOST = (RayError, RayServeException)  # a model's replica (or its whole deployment) gone


def handed_request() -> Request:
    """The Request an HttpApi handler is given on a model's replica: the body is handed over already parsed, and the
    client's departure arrives as a cancellation of the call, never as an http.disconnect."""

    async def never():
        await asyncio.Event().wait()

    return Request({"type": "http", "method": "POST", "path": "/", "headers": [], "query_string": b""}, never)


async def answer(http, handler: str, body: BaseModel) -> AsyncIterator[tuple | bytes]:
    """A model replica's side of `ModelRouter._route`: the HttpApi handler's response as (status, headers) first, then
    its body's bytes (a stream's piece by piece)."""
    response = await getattr(http, handler)(body, handed_request())
    yield response.status_code, {k: v for k, v in response.headers.items() if k != "content-length"}
    if isinstance(response, StreamingResponse):
        chunks = response.body_iterator
        try:
            async for chunk in chunks:
                yield chunk.encode() if isinstance(chunk, str) else chunk
        finally:  # a cancelled call (the client left) ends the stream here: its rows are freed
            await chunks.aclose()
    else:
        yield response.body


class ModelRouter(ModelRoutes):
    """The routes' answers for several models, each on its deployment's handle (module docstring). `cards`: /v1/models'
    cards, in order (the first answers a body without `model`); `handles`: each card's deployment, by id."""

    def __init__(self, cards: Sequence[ModelCard], handles: dict, api_key: str | Sequence[str] | None = None,
                 max_body_bytes: int = MAX_BODY_BYTES):
        super().__init__(api_key, max_body_bytes)
        self.cards = list(cards)
        self.ids = [card.id for card in self.cards]
        self.handles = handles

    def model_ids(self) -> list[str]:
        return self.ids

    async def _route(self, handler: str, body: BaseModel, request: Request) -> Response:
        model = model_named(getattr(body, "model", None), self.ids)
        call = self.handles[model].options(stream=True).call.remote(handler, body)
        try:
            status, headers = await call.__anext__()
            if headers.get("content-type", "").startswith("text/event-stream"):
                return StreamingResponse(self._relayed(call), status_code=status, headers=headers)
            whole = b"".join([chunk async for chunk in call])
        except asyncio.CancelledError:  # the client left: the model's replica frees the rows
            call.cancel()
            raise
        except LOST as e:
            return error_response(_unanswered(model, e))
        return Response(whole, status_code=status, headers=headers)

    @staticmethod
    async def _relayed(call) -> AsyncIterator[bytes]:
        finished = False
        try:
            async for chunk in call:
                yield chunk
            finished = True
        except LOST:
            finished = True
            yield lost_stream_end()
        finally:
            if not finished:  # the client left mid-stream
                call.cancel()

    def models(self, request: Request) -> Response:
        return self._authorized(request, lambda: ModelList(data=self.cards))

    def health(self, request: Request) -> Response:
        """Open without the API key: each model's health as one of its replicas answers it, under `models`, the
        first's at the top level too (a single model's server's fields). A model none of whose replicas answers is
        listed with its error. (A sync route: FastAPI runs it on a worker thread, where a call may wait.)"""
        every = []
        for card in self.cards:
            try:
                every.append(self.handles[card.id].health.remote().result(timeout_s=CALL_TIMEOUT_S))
            except (*LOST, TimeoutError) as e:
                every.append({"status": "ok", "model": card.id, "replica": "", "backend": "", "provider": "",
                              "running": 0, "waiting": 0, "error": _unanswered(card.id, e).message})
        return self.every_health(every)

    async def prometheus(self, request: Request) -> Response:
        """Every model's series, each summed over its replicas (by its hub) under its model_name."""
        try:
            self.authorize(request)
        except APIError as e:
            return error_response(e)

        async def summed(model: str) -> tuple[dict, str] | None:
            try:
                return prom.merge(await asyncio.wait_for(self.handles[model].snapshots.remote(), CALL_TIMEOUT_S)), model
            except (*LOST, asyncio.TimeoutError):  # a model whose replicas do not answer has no series this time
                return None

        models = [m for m in await asyncio.gather(*(summed(model) for model in self.ids)) if m is not None]
        return Response(prom.render_models(models), media_type=prom.CONTENT_TYPE)


def _unanswered(model: str, e: BaseException) -> APIError:
    return APIError(503, f"the model {model!r} did not answer ({type(e).__name__}); retry", "service_unavailable",
                    param="model", code="model_unavailable")


def model_card(model_id: str, n_positions: int, precision: str, root: str, parent: str | None) -> ModelCard:
    """/v1/models' card of one of several models, as openai/many.Models lists it."""
    return ModelCard(id=model_id, created=int(time.time()), owned_by="gpt2x", max_model_len=n_positions,
                     precision=precision, root=root, parent=parent)
