"""The HTTP side of a replica: the API key, the body limit, and every failure as an OpenAI-style JSON
error with its status. The routes themselves are wired in deploy.py (Ray Serve's ingress)."""

from __future__ import annotations

import hmac
from collections.abc import Callable

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from starlette.exceptions import HTTPException

from .protocol import APIError
from .service import CompletionService

MAX_BODY_BYTES = 1 << 20  # a request body larger than this is refused (413)
API_KEY_ENV = "GPT2X_API_KEY"


def error_response(e: APIError) -> JSONResponse:
    headers = {"Retry-After": "1"} if e.status in (429, 503) else None
    if e.status == 401:
        headers = {"WWW-Authenticate": "Bearer"}
    return JSONResponse(e.body(), status_code=e.status, headers=headers)


def add_error_handlers(app: FastAPI) -> None:
    """Unknown routes, wrong methods and anything FastAPI itself refuses answer in OpenAI's error shape."""

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, e: HTTPException) -> JSONResponse:
        kind = "not_found_error" if e.status_code == 404 else "invalid_request_error"
        return error_response(APIError(e.status_code, f"{request.method} {request.url.path}: {e.detail}", kind))

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, e: RequestValidationError) -> JSONResponse:
        return error_response(APIError(400, f"invalid request: {e.errors()[:1]}"))


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
            return JSONResponse(await self.service.complete(pending))
        except APIError as e:
            return error_response(e)

    def _authorized(self, request: Request, answer: Callable[[], dict]) -> JSONResponse:
        """`answer()` as JSON once the request's key checks out, else the 401."""
        try:
            self.authorize(request)
        except APIError as e:
            return error_response(e)
        return JSONResponse(answer())

    def models(self, request: Request) -> JSONResponse:
        return self._authorized(request, self.service.models)

    def health(self, request: Request) -> JSONResponse:
        return self._authorized(request, self.service.health)
