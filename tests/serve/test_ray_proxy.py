"""gpt2x/serve/ray/proxy.py: what `gpt2x serve` adds to Ray Serve's HTTP proxy. Ray's hook for it is there in the Ray
installed (its proxy calls the function an environment variable names and takes the middlewares it returns), a local
instance's processes are given that variable, and the middleware ends an event stream its app left unfinished as
gpt2x ends a stream on an error. No Ray instance is started (tests/serve/test_ray.py kills a replica mid-stream)."""

from __future__ import annotations

import asyncio
import json

import pytest
from ray.serve._private import constants, http_util
from starlette.middleware import Middleware

from gpt2x.serve.ray.deploy import LOCAL_INSTANCE_ENV
from gpt2x.serve.ray.proxy import PROXY_CALLBACK, StreamEnd

SSE = [(b"content-type", b"text/event-stream; charset=utf-8")]
JSON = [(b"content-type", b"application/json")]
CHUNK = b'data: {"choices":[{"text":"ROMEO"}]}\n\n'


def test_rays_proxy_takes_the_middlewares_the_variable_names_and_a_local_instance_is_given_it(monkeypatch):
    name = "RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH"
    assert LOCAL_INSTANCE_ENV[name] == PROXY_CALLBACK
    assert getattr(constants, name) is None  # read from the environment when Ray Serve is imported (the proxy's process)
    monkeypatch.setattr(http_util, name, PROXY_CALLBACK)
    options = http_util.configure_http_middlewares(http_util.HTTPOptions())
    [added] = options.middlewares
    assert isinstance(added, Middleware) and added.cls is StreamEnd


def run(app) -> list[dict]:
    """The messages `StreamEnd(app)` sends for one HTTP request."""
    sent: list[dict] = []

    async def send(message):
        sent.append(message)

    async def receive():
        return {"type": "http.request", "body": b"", "more_body": False}

    asyncio.run(StreamEnd(app)({"type": "http", "method": "POST", "path": "/v1/completions", "headers": []}, receive, send))
    return sent


def app_that(headers, bodies: list[tuple[bytes, bool]], then: Exception | None = None):
    async def app(scope, receive, send):
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        for body, more in bodies:
            await send({"type": "http.response.body", "body": body, "more_body": more})
        if then is not None:
            raise then

    return app


def events(messages: list[dict]) -> list[str]:
    body = b"".join(m.get("body", b"") for m in messages if m["type"] == "http.response.body").decode()
    assert body.endswith("\n\n") and all(e.startswith("data: ") for e in body[:-2].split("\n\n"))
    return [e[len("data: "):] for e in body[:-2].split("\n\n")]


@pytest.mark.parametrize("then", [None, RuntimeError("the replica died")], ids=["returned", "raised"])
def test_a_stream_left_unfinished_ends_with_an_error_event_then_done(then):
    sent = run(app_that(SSE, [(CHUNK, True)], then))
    assert sent[-1]["type"] == "http.response.body" and sent[-1]["more_body"] is False
    *chunks, error, done = events(sent)
    assert chunks == [CHUNK.decode()[len("data: "):-2]] and done == "[DONE]"
    body = json.loads(error)["error"]  # OpenAI's error shape, as gpt2x's own stream errors
    assert body["type"] == "server_error" and body["code"] == "replica_lost" and "send the request again" in body["message"]
    assert set(body) == {"message", "type", "param", "code"}


def test_finished_streams_and_other_responses_pass_unchanged():
    finished = [(CHUNK, True), (b"data: [DONE]\n\n", False)]
    assert run(app_that(SSE, finished)) == [{"type": "http.response.start", "status": 200, "headers": SSE}] + [
        {"type": "http.response.body", "body": b, "more_body": m} for b, m in finished]
    unfinished_json = run(app_that(JSON, [(b'{"id":', True)]))
    assert len(unfinished_json) == 2  # not an event stream: nothing added

    async def failing(scope, receive, send):
        raise RuntimeError("no replica")

    with pytest.raises(RuntimeError):  # an app that fails before its response starts: the proxy's to answer
        run(failing)
