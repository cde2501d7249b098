"""What `gpt2x serve` adds to Ray Serve's HTTP proxy, through Ray's documented hook for it: the proxy process
imports `middlewares` from RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH (a local instance's processes take it from
deploy.LOCAL_INSTANCE_ENV; a cluster's nodes are given it by whoever starts them, docs/serving/deployment.md).

A replica that dies mid-stream leaves the proxy with a started response and no end: Ray's proxy then returns, and
the connection closes with the chunked body unfinished, which a client reads as a network error, not the server's.
`StreamEnd` ends such an event stream as gpt2x's own errors end one: an error event in OpenAI's shape, then
`[DONE]`.
"""

from __future__ import annotations

import asyncio

from starlette.middleware import Middleware
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from ..openai import render
from ..openai.errors import APIError

PROXY_CALLBACK = "gpt2x.serve.ray.proxy:middlewares"
REPLICA_LOST = ("the replica serving this stream stopped before the stream's end (Ray Serve starts another): "
                "the text above is incomplete; send the request again")


def lost_stream_end() -> bytes:
    """The last bytes of a stream whose replica was lost: its error event, then [DONE]."""
    error = render.StreamEvent(APIError(500, REPLICA_LOST, "server_error", code="replica_lost").body(),
                               kind=render.StreamKind.error)
    return (error.render() + render.STREAM_DONE.render()).encode()


class StreamEnd:
    """ASGI middleware: an HTTP event stream (text/event-stream) the app left unfinished, returning or failing after
    its start, is finished with `lost_stream_end`. Other responses, and a stream whose client left (cancelled), pass
    as they are."""

    def __init__(self, app: ASGIApp):
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        stream = {"open": False}

        async def watched(message: Message) -> None:
            if message["type"] == "http.response.start":
                headers = dict(message.get("headers") or [])
                stream["open"] = headers.get(b"content-type", b"").startswith(b"text/event-stream")
            elif message["type"] == "http.response.body" and not message.get("more_body", False):
                stream["open"] = False
            await send(message)

        try:
            await self.app(scope, receive, watched)
        except asyncio.CancelledError:
            raise
        except Exception:
            if not stream["open"]:
                raise
        if stream["open"]:
            await send({"type": "http.response.body", "body": lost_stream_end(), "more_body": False})


def middlewares() -> list[Middleware]:
    """What RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH names: the proxy's middlewares."""
    return [Middleware(StreamEnd)]
