"""The HTTP side of a replica: the FastAPI application (its OpenAPI description, `/openapi.json` and
`/docs`), the API key, the body limit, every failure as an OpenAI-style JSON error with its status,
and the routes, declared once (`router`) and mounted by both ways of running a replica: `local_app`
in this process, and ray/deploy.py's Ray Serve ingress.

FastAPI parses each body into its endpoint's request model (completion/protocol.py, chat_completion/protocol.py,
responses/protocol.py, protocol.py's tokenizer bodies) and describes the routes from the models. Before it does, a
route with a body passes the gate (`RequestGate.admit`, by the routes' class, `GatedRoute`): the API key, the body's
type and size (read without going past the limit), the body as a JSON object (NaN, Infinity and a body nested too deeply
to read are one 400), and the model it names (a 404 for one not served). What FastAPI refuses (a RequestValidationError)
is the same 400 as any bad field, naming it.

`/metrics` is Prometheus' text format (metrics.py): the replica's own counters, which the HTTP side
adds to as each request is answered in full, summed with the other replicas' through `exchange`
(metrics.LocalExchange in one process, ray/deploy.py's hub under Ray Serve, to which each answered
request's counts are handed before its last byte is sent).

`/playground` is a chat page in the browser (playground.py), open without the API key, which is typed into the page;
`/` redirects to it.
"""

# No `from __future__ import annotations` here: FastAPI reads the routes' `Request` annotations when
# Ray Serve's ingress analyses its copy of the routes, where a string annotation no longer resolves.
import asyncio
import contextlib
import hmac
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from fastapi import APIRouter, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.middleware.cors import CORSMiddleware
from fastapi.openapi.utils import get_openapi
from fastapi.responses import RedirectResponse, Response, StreamingResponse
from fastapi.routing import APIRoute
from pydantic import BaseModel, ValidationError
from starlette.exceptions import HTTPException

from ...tokenizer import decode, encode
from ...version import __version__
from . import metrics as prom
from . import playground, render
from .chat_completion import serving as chat
from .chat_completion.protocol import ChatCompletionChunk, ChatCompletionRequest, ChatCompletionResponse, Message
from .chat_completion.template import no_template, render_messages
from .completion import serving as completion
from .completion.protocol import CompletionRequest, CompletionResponse
from .errors import APIError, bad, json_object, validation_error
from .pending import Pending, ServedRequest
from .protocol import (
    DetokenizeRequest,
    DetokenizeResponse,
    ErrorResponse,
    Health,
    ModelList,
    TokenizeRequest,
    TokenizeResponse,
    Version,
)
from .responses import protocol as responses_protocol
from .responses.serving import ResponsesAPI
from .service import CompletionService

MAX_BODY_BYTES = 1 << 20  # a request body larger than this is refused (413)
API_KEY_ENV = "GPT2X_API_KEY"
TITLE = "gpt2x"
DESCRIPTION = ("OpenAI-compatible completions from a gpt2x export. Every error is "
               '`{"error": {"message", "type", "param", "code"}}` with a 4xx or 5xx status.')

_ERROR = {"model": ErrorResponse}
_AUTH_ERRORS = {401: {**_ERROR, "description": "A missing or wrong API key (when the server has one)"}}
# Every other 4xx (a wrong method, a client that left) is the same error object; declared, FastAPI adds no 422 of its own.
_OTHER_ERRORS = {"4XX": {**_ERROR, "description": "Any other refusal"}}
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
    response_model=CompletionResponse,
    responses={
        200: {"description": "The completion; with `stream`, server-sent events", "content": {"text/event-stream": {
            "schema": _STREAM_EVENT}}},
        400: {**_ERROR, "description": "A bad field (`param` names it) or a body that is not JSON"},
        **_AUTH_ERRORS,
        404: {**_ERROR, "description": "A model other than the one served"},
        413: {**_ERROR, "description": "A body over the limit"},
        429: {**_ERROR, "description": "The replica's queue is full: retry after Retry-After"},
        **_OTHER_ERRORS,
        500: {**_ERROR, "description": "Generation failed"},
        503: {**_ERROR, "description": "The server is shutting down"},
    },
)
_CHAT_STREAM_EVENT = {"type": "object", "required": ["data"], "properties": {"data": {"anyOf": [
    {"const": "[DONE]"},
    {"type": "string", "contentMediaType": "application/json", "contentSchema": {"anyOf": [
        {"$ref": "#/components/schemas/ChatCompletionChunk"}, {"$ref": "#/components/schemas/ErrorResponse"}]}},
]}}}
CHAT_ROUTE = dict(
    summary="Create a chat completion",
    description="OpenAI's chat completions: the messages rendered by the model's Jinja2 chat template "
                "(--chat-template FILE, else the export's tokenizer_config.json, else gpt2x's default), then "
                "completed with every completions sampling field, n and structured output; streamed with `stream`. "
                "A server started with --no-default-chat-template answers a model with no template 400.",
    response_model=ChatCompletionResponse,
    responses={**COMPLETIONS_ROUTE["responses"], 200: {
        "description": "The chat completion; with `stream`, server-sent events of chat.completion.chunk",
        "content": {"text/event-stream": {"schema": _CHAT_STREAM_EVENT}}}},
)
RESPONSES_ROUTE = dict(
    summary="Create a model response",
    description="OpenAI's Responses API over chat: `instructions` (a system message first), the conversation of "
                f"`previous_response_id` (kept in this replica's memory, the last {responses_protocol.MAX_STORED} with "
                "`store`) and `input`, "
                "rendered by the chat template and completed as chat is, with `max_output_tokens`, `temperature`, "
                "`top_p` and `text.format`; streamed as OpenAI's typed events with `stream`. Tools, reasoning, "
                "background mode, `include` and truncation are refused with a 400 naming the field.",
    response_model=responses_protocol.Response,
    responses={**COMPLETIONS_ROUTE["responses"],
               200: {"description": "The response; with `stream`, server-sent events (`event: TYPE`, `data: JSON`)",
                     "content": {"text/event-stream": {"schema": responses_protocol.STREAM_EVENT}}},
               404: {**_ERROR, "description": "A model other than the one served, or a previous_response_id not stored"}},
)
MODELS_ROUTE = dict(summary="The served model", response_model=ModelList, responses=_AUTH_ERRORS)
HEALTH_ROUTE = dict(summary="The replica's state and counters (no API key needed)", response_model=Health)
# Prometheus' text format, not JSON: left out of the OpenAPI description, as vLLM leaves its /metrics.
METRICS_ROUTE = dict(summary="Prometheus metrics, summed over every replica", include_in_schema=False)


VERSION_ROUTE = dict(summary="gpt2x's version (no API key needed)", response_model=Version)
# A web page, not part of the API: left out of the OpenAPI description, as /metrics is.
PLAYGROUND_ROUTE = dict(summary="The chat playground, a web page (no API key needed)", include_in_schema=False)
ROOT_ROUTE = dict(summary="Redirects to /playground", include_in_schema=False)
# Answered without the API key: /health and /version as vLLM's and llama-server's; the playground because its key is
# typed into the page (it holds nothing secret, and every request it makes carries the key).
OPEN_ROUTES = ("/health", "/version", "/playground", "/")


_BODY_ERRORS = {
    400: {**_ERROR, "description": "A bad field (`param` names it) or a body that is not JSON"},
    **_AUTH_ERRORS,
    404: {**_ERROR, "description": "A model other than the one served"},
    413: {**_ERROR, "description": "A body over the limit"},
    **_OTHER_ERRORS,
}
TOKENIZE_ROUTE = dict(summary="Tokenize a prompt (vLLM's /tokenize)", response_model=TokenizeResponse,
                      responses=_BODY_ERRORS)
DETOKENIZE_ROUTE = dict(summary="Token ids to text (vLLM's /detokenize)", response_model=DetokenizeResponse,
                        responses=_BODY_ERRORS)
# Models that only a stream's events name (no route returns them whole): added to the OpenAPI description, where the
# streams' event schemas refer to them.
EVENT_MODELS = {"ChatCompletionChunk": ChatCompletionChunk, **responses_protocol.EVENT_MODELS}


class Gpt2xApp(FastAPI):
    """FastAPI, with two things its description of the routes cannot say: the models only a stream's events name
    (EVENT_MODELS), and the bearer key, asked for by every route but the open ones, and optional (a server may have
    none)."""

    def openapi(self) -> dict:
        if self.openapi_schema is None:
            schema = get_openapi(title=self.title, version=self.version, description=self.description,
                                 routes=self.routes)
            components = schema.setdefault("components", {})
            for name, model in EVENT_MODELS.items():
                body = model.model_json_schema(ref_template="#/components/schemas/{model}")
                components.setdefault("schemas", {}).update(body.pop("$defs", {}), **{name: body})
            components["securitySchemes"] = {"bearer": {"type": "http", "scheme": "bearer", "description": (
                "The server's API key (--api-key), when it has one")}}
            for route, path in schema.get("paths", {}).items():  # every route asks for the key but the open ones
                for operation in path.values():
                    # the key, or none where the server has none (/openapi.json and /docs are not listed)
                    operation["security"] = [] if route in OPEN_ROUTES else [{"bearer": []}, {}]
            self.openapi_schema = schema
        return self.openapi_schema


def new_app() -> FastAPI:
    """The application, its error handlers in place, its routes still to add."""
    app = Gpt2xApp(title=TITLE, description=DESCRIPTION, version=__version__, docs_url="/docs", redoc_url=None,
                   openapi_url="/openapi.json")
    add_error_handlers(app)
    return app


class JSONBody(Response):
    """A response body (a model), serialised once (render.to_json)."""

    media_type = "application/json"

    def render(self, content: BaseModel | dict) -> bytes:
        return render.to_json(content).encode()


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
    async def invalid(request: Request, e: RequestValidationError) -> Response:
        return error_response(validation_error(list(e.errors())))


class Exchange(Protocol):
    """Where the replicas' metrics meet (metrics.LocalExchange; ray/deploy.py's hub)."""

    shared: bool  # False: this replica alone (nothing to publish)

    async def publish(self, snapshot: dict) -> None: ...

    async def gather(self, own: dict) -> list[dict]: ...


@dataclass(frozen=True)
class Cors:
    """Cross-origin requests from browser pages, as vLLM's flags name them (--allowed-origins, --allowed-methods,
    --allowed-headers, --allow-credentials), answered by FastAPI's CORSMiddleware. Unlike vLLM, whose origins default
    to every one, a server answers no other origin unless given some."""

    origins: tuple[str, ...]
    methods: tuple[str, ...] = ("*",)
    headers: tuple[str, ...] = ("*",)
    credentials: bool = False


def add_cors(app: FastAPI, cors: Cors | None) -> None:
    """The app answering cross-origin requests as `cors` allows (None: none)."""
    if cors is not None:
        app.add_middleware(CORSMiddleware, allow_origins=list(cors.origins), allow_methods=list(cors.methods),
                           allow_headers=list(cors.headers), allow_credentials=cors.credentials)


def api_keys_of(api_key: str | Sequence[str] | None) -> tuple[str, ...]:
    """The keys a server accepts: none, one, or several (vLLM's and llama-server's several keys)."""
    if not api_key:
        return ()
    return (api_key,) if isinstance(api_key, str) else tuple(k for k in api_key if k)


class RequestGate:
    """What a request passes before any model answers it: the API key, and for a body its type, size and model
    (`admit`)."""

    def __init__(self, api_key: str | Sequence[str] | None, max_body_bytes: int = MAX_BODY_BYTES):
        self.api_keys = tuple(k.encode() for k in api_keys_of(api_key))
        self.max_body_bytes = max_body_bytes

    def authorize(self, request: Request) -> None:
        if not self.api_keys:
            return
        given = request.headers.get("authorization", "")
        scheme, _, token = given.partition(" ")
        token_bytes = token.strip().encode()
        # Every key compared, each in constant time: which key matched, or how many there are, takes no other time.
        matched = [hmac.compare_digest(token_bytes, key) for key in self.api_keys]
        if scheme.lower() != "bearer" or not any(matched):
            raise APIError(401, "missing or wrong API key: send Authorization: Bearer KEY", "authentication_error",
                           code="invalid_api_key")

    def _authorized(self, request: Request, answer: Callable[[], BaseModel]) -> Response:
        """`answer()` as JSON once the request's key checks out, else the 401."""
        try:
            self.authorize(request)
        except APIError as e:
            return error_response(e)
        return JSONBody(answer())

    def version(self, request: Request) -> Response:
        """gpt2x's version, open without the API key (vLLM's /version)."""
        return JSONBody(Version(version=__version__))

    async def body(self, request: Request) -> bytes:
        """The body, refused (413) once it exceeds the limit, without reading the rest."""
        media = request.headers.get("content-type", "").split(";", 1)[0].strip().lower()
        if media != "application/json":  # vLLM's check and words (its RequestValidationError: a 400)
            raise APIError(400, "Unsupported Media Type: Only 'application/json' is allowed (send Content-Type: "
                           f"application/json; got {media[:60] or 'none'!r})", code="unsupported_media_type")
        declared = request.headers.get("content-length", "")
        if declared.isdigit() and int(declared) > self.max_body_bytes:
            raise APIError(413, f"the body is {declared} bytes; the limit is {self.max_body_bytes}", code="body_too_large")
        data = bytearray()
        async for chunk in request.stream():
            data += chunk
            if len(data) > self.max_body_bytes:
                raise APIError(413, f"the body exceeds {self.max_body_bytes} bytes", code="body_too_large")
        return bytes(data)

    async def admit(self, request: Request) -> tuple[bytes, dict]:
        """A request with a body, before FastAPI validates it: the key, the body (its type and size) read as a JSON
        object, and the model it names (a 404 for one not served), as (the body, the object)."""
        self.authorize(request)
        raw = await self.body(request)
        data = json_object(raw)
        self.check_model(data.get("model"))
        return raw, data

    def check_model(self, model: Any) -> None:
        """A 404 for a model not served."""
        raise NotImplementedError


class _ReadRequest(Request):
    """A request whose body the gate has read and checked: FastAPI reads it from here (FastAPI's way to change how
    a route's body is read: a Request subclass, given by the route class)."""

    def __init__(self, request: Request, raw: bytes, data: dict):
        super().__init__(request.scope, request.receive)
        self._raw = raw
        self._data = data

    async def body(self) -> bytes:
        return self._raw

    async def json(self) -> Any:
        return self._data


def gated_route(api: Callable[[], RequestGate]) -> type[APIRoute]:
    """The class of the routes with a body: each request passes `api()`'s gate (RequestGate.admit) before FastAPI
    reads and validates its body; a refusal, the gate's or a model's own, is answered in OpenAI's shape."""

    class GatedRoute(APIRoute):
        def get_route_handler(self) -> Callable[[Request], Awaitable[Response]]:
            handler = super().get_route_handler()

            async def gated(request: Request) -> Response:
                try:
                    raw, data = await api().admit(request)
                    # a model's own check may refuse a body in its words (an APIError, which pydantic passes on)
                    return await handler(_ReadRequest(request, raw, data))
                except APIError as e:
                    return error_response(e)

            return gated

    return GatedRoute


class HttpApi(RequestGate):
    """Request handling shared by the routes: authorization, body, errors, and the replica's metrics."""

    def __init__(self, service: CompletionService, api_key: str | Sequence[str] | None, max_body_bytes: int = MAX_BODY_BYTES,
                 exchange: Exchange | None = None):
        super().__init__(api_key, max_body_bytes)
        self.service = service
        self.metrics = prom.ReplicaMetrics(service.engine)
        self.exchange: Exchange = exchange or prom.LocalExchange()
        self.responses_api = ResponsesAPI(service)  # its store of responses is this replica's

    def check_model(self, model: Any) -> None:
        completion.check_model(model, self.service.model_id)

    async def completions(self, body: CompletionRequest, request: Request) -> Response:
        """OpenAI's completions (completion/serving.py)."""
        return await self._serve(request, self.service.prepare, body, completion.stream, completion.complete)

    async def chat_completions(self, body: ChatCompletionRequest, request: Request) -> Response:
        """OpenAI's chat completions (chat_completion/serving.py): the messages rendered by the chat template, then
        served as a completions request is, answered in the chat shapes."""
        return await self._serve(request, self.service.prepare_chat, body, chat.stream, chat.complete)

    async def _serve(self, request: Request, prepare: Callable[[Any], ServedRequest], body: BaseModel,
                     stream: Callable[[Pending], AsyncIterator[render.StreamEvent]],
                     complete: Callable[[Pending], Awaitable[BaseModel]]) -> Response:
        started = time.monotonic()
        try:
            # On a worker thread: a large schema or enum compiles for seconds, which would stall every stream
            req = await asyncio.to_thread(prepare, body)
            pending = self.service.submit(req)
        except APIError as e:
            return error_response(e)
        if req.stream:
            return self._event_stream(stream(pending), pending, started)
        return await self._whole(request, pending, started, complete(pending))

    async def responses(self, body: responses_protocol.ResponsesRequest, request: Request) -> Response:
        """OpenAI's Responses API (responses/): the input, after the instructions and the conversation it continues,
        served as chat is, answered as a `response` object or its stream of typed events."""
        started = time.monotonic()
        api = self.responses_api
        try:
            call = await asyncio.to_thread(api.prepare, body)  # as completions': a schema may compile for seconds
            pending = self.service.submit(call.req)
        except APIError as e:
            return error_response(e)
        if call.req.stream:
            return self._event_stream(api.stream(call, pending), pending, started)
        return await self._whole(request, pending, started, api.complete(call, pending))

    def _event_stream(self, events: AsyncIterator[render.StreamEvent], pending: Any, started: float) -> StreamingResponse:
        return StreamingResponse(self._counted_stream(events, pending, started), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    async def _whole(self, request: Request, pending: Any, started: float, answer: Awaitable[BaseModel]) -> Response:
        """`answer`, the whole body, counted once done. Raced against the client's disconnect: a client that gives
        up frees its rows at the engine's next step (and its places in the queue at once), as vLLM aborts a request
        whose client left."""
        work = asyncio.ensure_future(answer)
        gone = asyncio.ensure_future(client_gone(request))
        try:
            await asyncio.wait({work, gone}, return_when=asyncio.FIRST_COMPLETED)
        except asyncio.CancelledError:  # the server cancelled the handler (Ray Serve does when the client leaves)
            work.cancel()
            self._aborted(pending, started)
            raise
        finally:
            gone.cancel()
        if not work.done():
            work.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await work  # its rows cancelled now (Pending.events' finally)
            self._aborted(pending, started)
            return error_response(APIError(499, "the client closed the request", code="client_closed_request"))
        try:
            body = work.result()
        except APIError as e:
            return error_response(e)
        seconds = time.monotonic() - started
        usage = pending.usage()  # what the body says
        await self._answered(usage.prompt_tokens, usage.completion_tokens,
                             [(reason or "stop", seconds) for reason in pending.reasons], pending)
        return JSONBody(body)

    async def _counted_stream(self, events: AsyncIterator[render.StreamEvent], pending: Any,
                              started: float) -> AsyncIterator[str]:
        """A stream's events rendered as server-sent events as they come; each choice's end timed as
        its finish_reason goes out, and the request counted (and published) before its last event,
        DONE, unless the stream ended in an error (its last events: the error, then DONE)."""
        ended: list[tuple[str, float]] = []
        failed = counted = False
        try:
            async for event in events:
                if event.kind is render.StreamKind.error:
                    failed = True
                elif event.kind is render.StreamKind.done:
                    counted = True
                    if not failed:
                        usage = pending.usage()  # what the usage chunk says
                        await self._answered(usage.prompt_tokens, usage.completion_tokens, ended, pending)
                else:
                    ended += [(reason, time.monotonic() - started) for reason in event.reasons]
                yield event.render()
        finally:
            if not counted:  # the client left mid-stream (the response was cancelled or closed)
                self._aborted(pending, started, ended)

    def _aborted(self, pending: Any, started: float, ended: list[tuple[str, float]] | None = None) -> None:
        """A request whose client left: its choices that had not ended counted as aborted (vLLM's
        finished_reason "abort"), those that had by their reasons, with the tokens of its usage so far.
        Not published to the hub here (a cancelled task awaits nothing more): the replica's next report does."""
        usage = pending.usage()
        seconds = time.monotonic() - started
        done = ended if ended is not None else [(r, seconds) for r in pending.reasons if r is not None]
        self.metrics.answered(usage.prompt_tokens, usage.completion_tokens, done)
        self.metrics.aborted(sum(r is None for r in pending.reasons))

    async def _answered(self, prompt_tokens: int, generation_tokens: int, choices: list[tuple[str, float]],
                        pending: Any) -> None:
        req = pending.req  # per choice its prompt's and its own tokens; per prompt its n and max_tokens
        tokens = [(len(req.prompt_ids[i // req.n]), text.tokens) for i, text in enumerate(pending.texts)]
        self.metrics.answered(prompt_tokens, generation_tokens, choices, tokens, [(req.n, m) for m in req.max_tokens])
        if self.exchange.shared:  # before the answer's end: a scrape after it counts it
            await self.exchange.publish(self.metrics.snapshot())

    def models(self, request: Request) -> Response:
        return self._authorized(request, self.service.models)

    def health(self, request: Request) -> Response:
        """Open without the API key, as vLLM's and llama-server's /health: a load balancer's probe has none."""
        return JSONBody(self.service.health())

    async def prometheus(self, request: Request) -> Response:
        """Every replica's metrics summed, in Prometheus' text format."""
        try:
            self.authorize(request)
        except APIError as e:
            return error_response(e)
        snapshots = await self.exchange.gather(self.metrics.snapshot())
        text = prom.render(prom.merge(snapshots), self.service.model_id)
        return Response(text, media_type=prom.CONTENT_TYPE)

    async def tokenize(self, body: TokenizeRequest, request: Request) -> Response:
        try:
            tokens = encode(self._tokenize_text(body))
        except APIError as e:
            return error_response(e)
        strs = [render.token_str(t) for t in tokens] if body.return_token_strs else None
        return JSONBody(TokenizeResponse(count=len(tokens), max_model_len=self.service.backend.n_positions, tokens=tokens,
                                         token_strs=strs))

    def _tokenize_text(self, p: TokenizeRequest) -> str:
        """The prompt, or the messages as the chat template renders them for /v1/chat/completions (vLLM's)."""
        if (p.prompt is None) == (p.messages is None):
            raise bad("send prompt (a text) or messages (a conversation), one of the two", "prompt")
        if p.prompt is not None:
            return p.prompt
        try:
            messages = [Message.model_validate(m) for m in p.messages]
        except ValidationError as e:
            raise validation_error([{**err, "loc": ("messages", *err["loc"])} for err in e.errors(include_url=False)]) from None
        if not messages:
            raise bad("messages is empty", "messages")
        template = self.service.chat_template
        if template is None:
            raise no_template()
        return render_messages(messages, template, bool(p.add_generation_prompt), bool(p.continue_final_message))

    async def detokenize(self, body: DetokenizeRequest, request: Request) -> Response:
        return JSONBody(DetokenizeResponse(prompt=decode(body.tokens)))


async def client_gone(request: Request) -> None:
    """Returns once the client has disconnected. The body has been read, so the next message the
    server has for this request is its http.disconnect (Starlette's StreamingResponse listens so too)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return
        await asyncio.sleep(0.05)  # a server that hands out empty body messages: no busy loop


def router(api: Callable[[], Any]) -> APIRouter:
    """Every route, declared once: `api()` is the HttpApi that answers a request (local_app's own; on
    Ray Serve, the replica's), or many.Models, which has the same methods and hands each request to its model's.
    The routes with a body are gated (gated_route); FastAPI validates the body as the route's model. Sync routes run
    in FastAPI's thread pool, as they always did."""
    routes = APIRouter()
    bodies = APIRouter(route_class=gated_route(api))

    @bodies.post("/v1/completions", **COMPLETIONS_ROUTE)
    async def completions(body: CompletionRequest, request: Request):
        return await api().completions(body, request)

    @bodies.post("/v1/chat/completions", **CHAT_ROUTE)
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        return await api().chat_completions(body, request)

    @bodies.post("/v1/responses", **RESPONSES_ROUTE)
    async def responses(body: responses_protocol.ResponsesRequest, request: Request):
        return await api().responses(body, request)

    @routes.get("/v1/models", **MODELS_ROUTE)
    def models(request: Request):
        return api().models(request)

    @routes.get("/health", **HEALTH_ROUTE)
    def health(request: Request):
        return api().health(request)

    @routes.get("/version", **VERSION_ROUTE)
    def version(request: Request):
        return api().version(request)

    @routes.get("/metrics", **METRICS_ROUTE)
    async def metrics(request: Request):
        return await api().prometheus(request)

    @routes.get("/playground", **PLAYGROUND_ROUTE)
    async def playground_page():
        body, headers = playground.page()
        return Response(body, media_type="text/html; charset=utf-8", headers=headers)

    @routes.get("/", **ROOT_ROUTE)
    async def root(request: Request):
        # Under the mount's prefix (Ray Serve's route prefix is the ASGI root_path), as the page's own requests are.
        return RedirectResponse(request.scope.get("root_path", "").rstrip("/") + "/playground")

    @bodies.post("/tokenize", **TOKENIZE_ROUTE)
    async def tokenize(body: TokenizeRequest, request: Request):
        return await api().tokenize(body, request)

    @bodies.post("/detokenize", **DETOKENIZE_ROUTE)
    async def detokenize(body: DetokenizeRequest, request: Request):
        return await api().detokenize(body, request)

    routes.include_router(bodies)
    return routes


def local_app(service: CompletionService, api_key: str | Sequence[str] | None = None, max_body_bytes: int = MAX_BODY_BYTES,
              cors: Cors | None = None) -> FastAPI:
    """The replica's application around `service`, in this process (no Ray): the routes Ray Serve's
    ingress serves, for `gpt2x serve` on one machine, tests and embedding (any ASGI server runs it)."""
    http = HttpApi(service, api_key, max_body_bytes)
    app = new_app()
    app.include_router(router(lambda: http))
    add_cors(app, cors)
    return app
