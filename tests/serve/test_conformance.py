"""A conformance suite of gpt2x serve's own (issue 39, item 8): the behaviours OpenAI's API reference
(completions, chat completions, models) and vLLM's OpenAI-compatible server docs (its extra fields,
/tokenize, /detokenize) describe, request by request, through the openai client and raw HTTP
(httpx). Each test's docstring names the reference behaviour it checks. The references are
independent of the code under test: the openai client's own types and parsing, jsonschema schemas
written here from the reference's object descriptions, and hand-computed cases (GPT-2's token ids,
a forced token's text). Organised by the reference's sections; what tests/test_serve_api.py,
tests/test_serve_vllm.py and tests/test_chat.py check in depth (logprob values, streamed equals
whole, vLLM's extra fields' effects) is not repeated. One server for the module, a few tokens per
request: it runs in a few seconds."""

from __future__ import annotations

import json
import math
import time

import httpx
import jsonschema
import pytest

from gpt2x.onnx.artifact import read_export
from gpt2x.runtime.ort import OrtBackend
from gpt2x.serve.core.engine import EngineSettings
from gpt2x.serve.openai.chat_completion.template import ChatTemplate
from gpt2x.serve.openai.routes import local_app
from gpt2x.serve.openai.service import CompletionService

from ..helpers import uvicorn_server

openai = pytest.importorskip("openai")

KEY = "conformance-key"
MODEL = "shakespeare"
TEMPLATE = "{% for message in messages %}{{ message.content }}{{ eos_token }}{% endfor %}"  # DialoGPT's style
HELLO_WORLD = [15496, 995]  # GPT-2's ids of "Hello world" (its vocabulary, by hand)
THE = 262  # GPT-2's id of " the"

# The objects as OpenAI's reference describes them (required keys and types; extra keys allowed).
USAGE = {"type": "object", "required": ["prompt_tokens", "completion_tokens", "total_tokens"],
         "properties": {k: {"type": "integer", "minimum": 0} for k in ("prompt_tokens", "completion_tokens", "total_tokens")}}
FINISH = {"enum": ["stop", "length", "content_filter"]}
COMPLETION = {
    "type": "object", "required": ["id", "object", "created", "model", "choices", "usage"],
    "properties": {
        "id": {"type": "string", "minLength": 1}, "object": {"const": "text_completion"}, "created": {"type": "integer"},
        "model": {"type": "string"}, "usage": USAGE,
        "choices": {"type": "array", "minItems": 1, "items": {
            "type": "object", "required": ["text", "index", "logprobs", "finish_reason"],
            "properties": {"text": {"type": "string"}, "index": {"type": "integer", "minimum": 0}, "finish_reason": FINISH,
                           "logprobs": {"type": ["object", "null"]}}}}}}
COMPLETION_CHUNK = {
    "type": "object", "required": ["id", "object", "created", "model", "choices"],
    "properties": {"object": {"const": "text_completion"}, "choices": {"type": "array", "items": {
        "type": "object", "required": ["text", "index", "finish_reason"],
        "properties": {"text": {"type": "string"}, "finish_reason": {"anyOf": [FINISH, {"type": "null"}]}}}},
        "usage": {"anyOf": [USAGE, {"type": "null"}]}}}
CHAT = {
    "type": "object", "required": ["id", "object", "created", "model", "choices", "usage"],
    "properties": {
        "object": {"const": "chat.completion"}, "usage": USAGE,
        "choices": {"type": "array", "minItems": 1, "items": {
            "type": "object", "required": ["index", "message", "finish_reason"],
            "properties": {"finish_reason": FINISH, "message": {
                "type": "object", "required": ["role", "content"],
                "properties": {"role": {"const": "assistant"}, "content": {"type": ["string", "null"]}}}}}}}}
CHAT_CHUNK = {
    "type": "object", "required": ["id", "object", "created", "model", "choices"],
    "properties": {"object": {"const": "chat.completion.chunk"}, "choices": {"type": "array", "items": {
        "type": "object", "required": ["index", "delta"], "properties": {"delta": {"type": "object"}}}}}}
ERROR = {"type": "object", "required": ["error"], "properties": {"error": {
    "type": "object", "required": ["message", "type"],
    "properties": {"message": {"type": "string", "minLength": 1}, "type": {"type": "string"}, "param": {"type": ["string", "null"]}}}}}
MODELS = {"type": "object", "required": ["object", "data"], "properties": {
    "object": {"const": "list"}, "data": {"type": "array", "minItems": 1, "items": {
        "type": "object", "required": ["id", "object", "created", "owned_by"],
        "properties": {"id": {"type": "string"}, "object": {"const": "model"}, "created": {"type": "integer"}, "owned_by": {"type": "string"}}}}}}


@pytest.fixture(scope="module")
def base_url(export_dir):
    service = CompletionService(OrtBackend(read_export(export_dir), threads=1), EngineSettings(max_batch_size=8), MODEL,
                                chat_template=ChatTemplate(TEMPLATE, "test"))
    with uvicorn_server(local_app(service, api_key=KEY)) as port:
        yield f"http://127.0.0.1:{port}"
    service.close()


@pytest.fixture(scope="module")
def oa(base_url):
    return openai.OpenAI(base_url=f"{base_url}/v1", api_key=KEY, max_retries=0)


@pytest.fixture(scope="module")
def http(base_url):
    with httpx.Client(base_url=base_url, headers={"Authorization": f"Bearer {KEY}"}, timeout=30) as c:
        yield c


def complete(http, **body) -> dict:
    r = http.post("/v1/completions", json={"model": MODEL, "max_tokens": 4, **body})
    assert r.status_code == 200, r.text
    data = r.json()
    jsonschema.validate(data, COMPLETION)
    return data


def events(http, path: str, **body) -> list[dict]:
    """A stream's server-sent events, parsed; the stream must end with `data: [DONE]`."""
    with http.stream("POST", path, json={"model": MODEL, **body, "stream": True}) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        lines = [line for line in r.iter_lines() if line]
    assert all(line.startswith("data: ") for line in lines) and lines[-1] == "data: [DONE]"
    return [json.loads(line[len("data: "):]) for line in lines[:-1]]


def error_of(r: httpx.Response, status: int = 400) -> dict:
    assert r.status_code == status, r.text
    jsonschema.validate(r.json(), ERROR)
    return r.json()["error"]


# ------------------------------------------------------------------ completions: request fields


def test_prompt_as_a_string_or_token_ids(http):
    """OpenAI: `prompt` may be a string, an array of tokens, or an array of arrays; the same prompt
    by text or by ids is the same request (usage counts GPT-2's 2 tokens of "Hello world")."""
    by_text = complete(http, prompt="Hello world", temperature=0)
    by_ids = complete(http, prompt=HELLO_WORLD, temperature=0)
    by_lists = complete(http, prompt=[HELLO_WORLD], temperature=0)
    assert by_text["usage"]["prompt_tokens"] == 2
    assert by_text["choices"][0]["text"] == by_ids["choices"][0]["text"] == by_lists["choices"][0]["text"]


def test_n_and_a_list_of_prompts_give_one_choice_each_indexed(http):
    """OpenAI: `n` completions per prompt, each choice with its `index`; vLLM orders a batch of
    prompts' choices prompt by prompt (index = prompt * n + sample)."""
    data = complete(http, prompt=["Hello world", "ROMEO:"], n=2, seed=1)
    assert sorted(c["index"] for c in data["choices"]) == [0, 1, 2, 3]
    greedy = complete(http, prompt=["Hello world", "ROMEO:"], n=1, temperature=0, max_tokens=3)["choices"]
    alone = [complete(http, prompt=p, temperature=0, max_tokens=3)["choices"][0]["text"] for p in ("Hello world", "ROMEO:")]
    assert [c["text"] for c in sorted(greedy, key=lambda c: c["index"])] == alone


def test_max_tokens_bounds_the_completion_and_length_says_so(http):
    """OpenAI: `max_tokens` is the most tokens generated; `finish_reason` is "length" when it was the
    limit; usage: total_tokens = prompt_tokens + completion_tokens."""
    data = complete(http, prompt="ROMEO:", max_tokens=3, logit_bias={str(THE): 100}, temperature=0)
    usage, choice = data["usage"], data["choices"][0]
    assert choice["finish_reason"] == "length" and usage["completion_tokens"] == 3
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]


def test_logit_bias_of_100_selects_the_token(http):
    """OpenAI: `logit_bias` maps token ids to a bias in [-100, 100]; 100 should result in exclusive
    selection of the token (here " the", id 262, three times)."""
    assert complete(http, prompt="ROMEO:", max_tokens=3, logit_bias={str(THE): 100}, seed=3)["choices"][0]["text"] == " the" * 3


def test_stop_ends_the_text_before_the_stop_sequence(http):
    """OpenAI: up to 4 `stop` sequences; the returned text will not contain the stop sequence, and
    finish_reason is "stop" when one ended it (" the the the" cut before its first "e t")."""
    data = complete(http, prompt="ROMEO:", max_tokens=3, logit_bias={str(THE): 100}, temperature=0,
                    stop=["e t", "never"])
    assert data["choices"][0]["text"] == " th" and data["choices"][0]["finish_reason"] == "stop"


def test_echo_returns_the_prompt_with_the_completion(http):
    """OpenAI: `echo` echoes back the prompt in addition to the completion."""
    data = complete(http, prompt="ROMEO:", echo=True, max_tokens=2, logit_bias={str(THE): 100})
    assert data["choices"][0]["text"] == "ROMEO: the the"


def test_the_same_seed_gives_the_same_text(http):
    """OpenAI: with `seed`, repeated requests with the same seed and parameters return the same result."""
    texts = {complete(http, prompt="ROMEO:", seed=11, temperature=1.0, max_tokens=6)["choices"][0]["text"] for _ in range(2)}
    assert len(texts) == 1


def test_logprobs_shape(http):
    """OpenAI: `logprobs` k (at most 5) gives `tokens`, `token_logprobs`, `top_logprobs` (up to k
    alternatives, plus the sampled one) and `text_offset`, one per token; log-probabilities <= 0."""
    data = complete(http, prompt="ROMEO:", logprobs=2, max_tokens=4, seed=2)
    lp, text = data["choices"][0]["logprobs"], data["choices"][0]["text"]
    n = data["usage"]["completion_tokens"]
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == len(lp["text_offset"]) == n
    assert all(v <= 0 for v in lp["token_logprobs"]) and all(2 <= len(top) <= 3 for top in lp["top_logprobs"])
    # each offset is where its token stands in the choice's text (vLLM's: the text returned, here without echo)
    assert all(text.startswith(tok, off) for tok, off in zip(lp["tokens"], lp["text_offset"], strict=True))
    assert lp["text_offset"][0] == 0 and "".join(lp["tokens"]) == text
    assert sum(math.exp(v) for v in lp["top_logprobs"][0].values()) <= 1.0 + 1e-6  # a distribution's part


def test_the_openai_client_parses_a_completion(oa):
    """OpenAI's client (its own types): `completions.create` returns a Completion whose fields parse."""
    c = oa.completions.create(model=MODEL, prompt="ROMEO:", max_tokens=2, logit_bias={str(THE): 100}, user="someone")
    assert isinstance(c, openai.types.Completion) and c.object == "text_completion" and c.model == MODEL
    assert c.choices[0].text == " the the" and c.usage.completion_tokens == 2


# ------------------------------------------------------------------ completions: response shape


def test_the_response_object(http):
    """OpenAI: the completion object has `id`, `object` "text_completion", `created` (Unix seconds),
    `model` (the model used) and `usage`."""
    before = int(time.time())
    data = complete(http, prompt="ROMEO:", max_tokens=1)
    assert data["model"] == MODEL and before - 1 <= data["created"] <= time.time() + 1
    assert complete(http, prompt="ROMEO:", max_tokens=1)["id"] != data["id"]  # each response its own id


# ------------------------------------------------------------------ completions: streaming


def test_stream_chunks_and_done(http):
    """OpenAI: with `stream`, tokens arrive as data-only server-sent events, ended by `data: [DONE]`;
    each chunk is a completion object of the same id; the text joins to the whole; the last chunk
    of a choice carries its finish_reason."""
    chunks = events(http, "/v1/completions", prompt="ROMEO:", max_tokens=3, logit_bias={str(THE): 100})
    for chunk in chunks:
        jsonschema.validate(chunk, COMPLETION_CHUNK)
    assert len({c["id"] for c in chunks}) == 1
    assert "".join(ch["text"] for c in chunks for ch in c["choices"]) == " the" * 3
    reasons = [ch["finish_reason"] for c in chunks for ch in c["choices"]]
    assert reasons[-1] == "length" and not any(reasons[:-1])


def test_stream_options_include_usage(http):
    """OpenAI: `stream_options.include_usage` sends one more chunk before [DONE], with the usage and
    an empty `choices`; the other chunks' usage is null."""
    chunks = events(http, "/v1/completions", prompt="ROMEO:", max_tokens=2, stream_options={"include_usage": True})
    *body, last = chunks
    assert last["choices"] == [] and last["usage"]["completion_tokens"] == 2
    assert last["usage"]["total_tokens"] == last["usage"]["prompt_tokens"] + 2
    assert all(c.get("usage") is None for c in body)


def test_the_openai_client_streams(oa):
    """OpenAI's client: `stream=True` yields Completion chunks it parses."""
    chunks = list(oa.completions.create(model=MODEL, prompt="ROMEO:", max_tokens=2, stream=True, logit_bias={str(THE): 100}))
    assert all(isinstance(c, openai.types.Completion) for c in chunks)
    assert "".join(c.choices[0].text for c in chunks if c.choices) == " the the"


# ------------------------------------------------------------------ errors


@pytest.mark.parametrize("body,param", [
    ({"max_tokens": -1}, "max_tokens"),
    ({"n": 0}, "n"),
    ({"temperature": -0.5}, "temperature"),
    ({"top_p": 1.5}, "top_p"),
    ({"presence_penalty": 3}, "presence_penalty"),
    ({"logprobs": 6}, "logprobs"),
    ({"logit_bias": {str(THE): 101}}, "logit_bias"),
    ({"stop": ["a", "b", "c", "d", "e"]}, "stop"),
    ({"prompt": [50257]}, "prompt"),
])
def test_an_invalid_field_is_one_400_naming_it(http, body, param):
    """OpenAI: an invalid request is a 400 whose body is an `error` object with `message`, `type`
    and `param` (the field at fault); vLLM answers the same ranges with a 400 too."""
    r = http.post("/v1/completions", json={"model": MODEL, "prompt": "ROMEO:", "max_tokens": 2, **body})
    assert error_of(r)["param"] == param


def test_malformed_or_missing_prompt_is_a_400_not_a_500(http):
    """A body that is not JSON, or lacks the required `prompt`, is a client error (4xx) in the
    reference's error shape."""
    r = http.post("/v1/completions", content=b"{not json", headers={"Content-Type": "application/json"})
    error_of(r)
    assert "prompt" in error_of(http.post("/v1/completions", json={"model": MODEL}))["message"]


def test_an_unknown_model_is_a_404(http, oa):
    """OpenAI: a model that does not exist is a 404 (the client raises NotFoundError)."""
    error_of(http.post("/v1/completions", json={"model": "gpt-4", "prompt": "x"}), 404)
    with pytest.raises(openai.NotFoundError):
        oa.completions.create(model="gpt-4", prompt="x", max_tokens=1)


def test_a_missing_or_wrong_key_is_a_401(base_url):
    """OpenAI: requests authenticate with `Authorization: Bearer KEY`; without it (or with another
    key) the answer is a 401, which the client raises as AuthenticationError."""
    for headers in ({}, {"Authorization": "Bearer wrong"}):
        error_of(httpx.post(f"{base_url}/v1/completions", json={"model": MODEL, "prompt": "x"}, headers=headers), 401)
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{base_url}/v1", api_key="wrong", max_retries=0).completions.create(model=MODEL, prompt="x")


# ------------------------------------------------------------------ chat completions


MESSAGES = [{"role": "user", "content": "Good morrow."}]


def test_chat_completion_object(http):
    """OpenAI: a chat completion has `object` "chat.completion", choices with a `message` of role
    "assistant" and its `content`, `finish_reason`, and `usage`; `max_completion_tokens` bounds it."""
    r = http.post("/v1/chat/completions", json={"model": MODEL, "messages": MESSAGES, "max_completion_tokens": 2,
                                                "logit_bias": {str(THE): 100}})
    assert r.status_code == 200, r.text
    data = r.json()
    jsonschema.validate(data, CHAT)
    assert data["choices"][0]["message"]["content"] == " the the" and data["choices"][0]["finish_reason"] == "length"
    # the prompt is the template's rendering: each message's content and an end of text, by hand
    assert data["usage"]["prompt_tokens"] == len(http.post("/tokenize", json={"prompt": "Good morrow.<|endoftext|>"}).json()["tokens"])


def test_chat_stream_deltas(http):
    """OpenAI: a streamed chat completion is `chat.completion.chunk` objects whose `delta`s join to
    the message: the first carries the role, the last choice chunk the finish_reason."""
    chunks = events(http, "/v1/chat/completions", messages=MESSAGES, max_tokens=2, logit_bias={str(THE): 100})
    for chunk in chunks:
        jsonschema.validate(chunk, CHAT_CHUNK)
    deltas = [ch for c in chunks for ch in c["choices"]]
    assert deltas[0]["delta"].get("role") == "assistant"
    assert "".join(d["delta"].get("content") or "" for d in deltas) == " the the" and deltas[-1]["finish_reason"] == "length"


def test_the_openai_client_chat_with_n(oa):
    """OpenAI's client: `chat.completions.create` with `n` parses to n choices, indexed 0..n-1."""
    c = oa.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=2, n=2, seed=4)
    assert c.object == "chat.completion" and sorted(ch.index for ch in c.choices) == [0, 1]
    assert all(ch.message.role == "assistant" for ch in c.choices)


def test_chat_errors_name_the_field(http):
    """Chat: `messages` is required, each message needs a role (a 400 in the error shape); a field
    not served (`tools`) is refused naming it rather than ignored."""
    error_of(http.post("/v1/chat/completions", json={"model": MODEL}))
    error_of(http.post("/v1/chat/completions", json={"model": MODEL, "messages": [{"content": "x"}]}))
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    r = http.post("/v1/chat/completions", json={"model": MODEL, "messages": MESSAGES, "tools": tools})
    assert error_of(r)["param"] == "tools"


# ------------------------------------------------------------------ models


def test_models_list(http, oa):
    """OpenAI: GET /v1/models lists model objects (`id`, `object` "model", `created`, `owned_by`);
    the served model is among them."""
    r = http.get("/v1/models")
    assert r.status_code == 200
    jsonschema.validate(r.json(), MODELS)
    assert MODEL in [m.id for m in oa.models.list()]


# ------------------------------------------------------------------ tokenize (vLLM)


def test_tokenize_and_detokenize(http):
    """vLLM: POST /tokenize gives the prompt's `tokens` and their `count` (and `max_model_len`);
    POST /detokenize gives the `prompt` back from the tokens."""
    r = http.post("/tokenize", json={"model": MODEL, "prompt": "Hello world"})
    assert r.status_code == 200, r.text
    data = r.json()
    assert data["tokens"] == HELLO_WORLD and data["count"] == 2 and data["max_model_len"] > 2
    r = http.post("/detokenize", json={"model": MODEL, "tokens": HELLO_WORLD})
    assert r.status_code == 200 and r.json()["prompt"] == "Hello world"
