"""The HTTP side of a replica: the FastAPI application (its OpenAPI description, `/openapi.json` and
`/docs`), the API key, the body limit, and every failure as an OpenAI-style JSON error with its
status. The routes are wired in deploy.py (Ray Serve's ingress) and, for a replica's service run in
this process without Ray, by `local_app`; both with the route descriptions declared here.

The completions route reads and validates its body itself (protocol.parse_request, with the pydantic
model protocol.CompletionParams), after the API key and the body's size are checked: FastAPI does not
parse it, and the schema of the body is added to the OpenAPI description by `Gpt2xApp.openapi`.
Anything FastAPI itself refuses (a RequestValidationError) is the same 400 as a bad field.
"""

from __future__ import annotations

import hmac
from collections.abc import Callable

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.utils import get_openapi
from fastapi.responses import Response, StreamingResponse
from pydantic import BaseModel
from starlette.exceptions import HTTPException

from .. import __version__
from . import protocol as api
from .protocol import APIError
from .service import CompletionService

MAX_BODY_BYTES = 1 << 20  # a request body larger than this is refused (413)
API_KEY_ENV = "GPT2X_API_KEY"
TITLE = "gpt2x"
DESCRIPTION = ("OpenAI-compatible completions from a gpt2x export. Every error is "
               '`{"error": {"message", "type", "param", "code"}}` with a 4xx or 5xx status.')

_ERROR = {"model": api.ErrorResponse}
_AUTH_ERRORS = {401: {**_ERROR, "description": "A missing or wrong API key (when the server has one)"}}
# One server-sent event of a stream (OpenAPI 3.1: the schema of each event): `data` is a chunk (a
# CompletionResponse with one choice's text and the logprobs of its tokens; the usage chunk has no
# choices), an error that ended the stream, or the last event, `[DONE]`.
_STREAM_EVENT = {"type": "object", "required": ["data"], "properties": {"data": {"anyOf": [
    {"const": "[DONE]"},
    {"type": "string", "contentMediaType": "application/json", "contentSchema": {"anyOf": [
        {"$ref": "#/components/schemas/CompletionResponse"}, {"$ref": "#/components/schemas/ErrorResponse"}]}},
]}}}
COMPLETIONS_ROUTE = dict(
    summary="Create a completion",
    description="OpenAI's legacy completions, with logprobs, echo scoring (echo with max_tokens 0) and "
                "token-id prompts; streamed as server-sent events with `stream`.",
    response_model=api.CompletionResponse,
    responses={
        200: {"description": "The completion; with `stream`, server-sent events", "content": {"text/event-stream": {
            "schema": _STREAM_EVENT}}},
        400: {**_ERROR, "description": "A bad field (`param` names it) or a body that is not JSON"},
        **_AUTH_ERRORS,
        404: {**_ERROR, "description": "A model other than the one served"},
        413: {**_ERROR, "description": "A body over the limit"},
        429: {**_ERROR, "description": "The replica's queue is full: retry after Retry-After"},
        500: {**_ERROR, "description": "Generation failed"},
        503: {**_ERROR, "description": "The server is shutting down"},
    },
    openapi_extra={"requestBody": {"required": True, "content": {"application/json": {
        "schema": {"$ref": "#/components/schemas/CompletionRequest"}}}}},
)
MODELS_ROUTE = dict(summary="The served model", response_model=api.ModelList, responses=_AUTH_ERRORS)
HEALTH_ROUTE = dict(summary="The replica's state and counters", response_model=api.Health, responses=_AUTH_ERRORS)


class Gpt2xApp(FastAPI):
    """FastAPI, with the completions body's schema (CompletionParams) and the optional bearer key in
    its OpenAPI description."""

    def openapi(self) -> dict:
        if self.openapi_schema is None:
            schema = get_openapi(title=self.title, version=self.version, description=self.description,
                                 routes=self.routes)
            body = api.CompletionParams.model_json_schema(ref_template="#/components/schemas/{model}")
            components = schema.setdefault("components", {})
            components.setdefault("schemas", {}).update(body.pop("$defs", {}), CompletionRequest=body)
            components["securitySchemes"] = {"bearer": {"type": "http", "scheme": "bearer", "description": (
                "The server's API key (--api-key), when it has one")}}
            for path in ("/v1/completions", "/v1/models", "/health"):
                for operation in schema.get("paths", {}).get(path, {}).values():
                    operation["security"] = [{"bearer": []}, {}]  # the key, or none where the server has none
            self.openapi_schema = schema
        return self.openapi_schema


def new_app() -> FastAPI:
    """The application, its error handlers in place, its routes still to add."""
    app = Gpt2xApp(title=TITLE, description=DESCRIPTION, version=__version__, docs_url="/docs", redoc_url=None,
                   openapi_url="/openapi.json")
    add_error_handlers(app)
    return app


class JSONBody(Response):
    """A response body model (protocol.py), serialised once (protocol.to_json)."""

    media_type = "application/json"

    def render(self, content: BaseModel) -> bytes:
        return api.to_json(content).encode()


def error_response(e: APIError) -> Response:
    headers = {"Retry-After": "1"} if e.status in (429, 503) else None
    if e.status == 401:
        headers = {"WWW-Authenticate": "Bearer"}
    return JSONBody(e.body(), status_code=e.status, headers=headers)


def add_error_handlers(app: FastAPI) -> None:
    """Unknown routes, wrong methods and anything FastAPI itself refuses answer in OpenAI's error shape."""

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, e: HTTPException) -> Response:
        kind = "not_found_error" if e.status_code == 404 else "invalid_request_error"
        return error_response(APIError(e.status_code, f"{request.method} {request.url.path}: {e.detail}", kind))

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, e: RequestValidationError) -> Response:
        return error_response(api.validation_error(list(e.errors())))


class HttpApi:
    """Request handling shared by the routes: authorization, body, errors."""

    def __init__(self, service: CompletionService, api_key: str | None, max_body_bytes: int = MAX_BODY_BYTES):
        self.service = service
        self.api_key = api_key or None
        self.max_body_bytes = max_body_bytes

    def authorize(self, request: Request) -> None:
        if self.api_key is None:
            return
        given = request.headers.get("authorization", "")
        scheme, _, token = given.partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), self.api_key.encode()):
            raise APIError(401, "missing or wrong API key: send Authorization: Bearer KEY", "authentication_error",
                           code="invalid_api_key")

    async def body(self, request: Request) -> bytes:
        """The body, refused (413) once it exceeds the limit, without reading the rest."""
        declared = request.headers.get("content-length", "")
        if declared.isdigit() and int(declared) > self.max_body_bytes:
            raise APIError(413, f"the body is {declared} bytes; the limit is {self.max_body_bytes}", code="body_too_large")
        data = bytearray()
        async for chunk in request.stream():
            data += chunk
            if len(data) > self.max_body_bytes:
                raise APIError(413, f"the body exceeds {self.max_body_bytes} bytes", code="body_too_large")
        return bytes(data)

    async def completions(self, request: Request):
        try:
            self.authorize(request)
            req = self.service.parse(await self.body(request))
            pending = self.service.submit(req)
        except APIError as e:
            return error_response(e)
        if req.stream:
            return StreamingResponse(self.service.stream(pending), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        try:
            return JSONBody(await self.service.complete(pending))
        except APIError as e:
            return error_response(e)

    def _authorized(self, request: Request, answer: Callable[[], BaseModel]) -> Response:
        """`answer()` as JSON once the request's key checks out, else the 401."""
        try:
            self.authorize(request)
        except APIError as e:
            return error_response(e)
        return JSONBody(answer())

    def models(self, request: Request) -> Response:
        return self._authorized(request, self.service.models)

    def health(self, request: Request) -> Response:
        return self._authorized(request, self.service.health)


def local_app(service: CompletionService, api_key: str | None = None, max_body_bytes: int = MAX_BODY_BYTES) -> FastAPI:
    """The replica's application around `service`, in this process (no Ray): the routes and
    descriptions deploy.py serves, for tests and for embedding (run it with any ASGI server)."""
    app = new_app()
    http = HttpApi(service, api_key, max_body_bytes)

    async def completions(request: Request):
        return await http.completions(request)

    def models(request: Request):
        return http.models(request)

    def health(request: Request):
        return http.health(request)

    app.post("/v1/completions", **COMPLETIONS_ROUTE)(completions)
    app.get("/v1/models", **MODELS_ROUTE)(models)
    app.get("/health", **HEALTH_ROUTE)(health)
    return app
