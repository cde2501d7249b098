"""The completions API in the shapes vLLM's own clients and tests expect (issue 39): finish_reason on
the chunk of a choice's last token, the keys vLLM always sends, /tokenize's tokenizer tokens, its
error words, the open /health and /version, the JSON content type, stream_options only with stream;
and vLLM's request fields, each honoured (checked against an independent computation made here:
a no-cache forward, gpt2x's own generation, hand-made cases) or refused with a 400 naming it."""

from __future__ import annotations

import json

import pytest
from fastapi.testclient import TestClient

from gpt2x import __version__
from gpt2x.onnx.artifact import read_export
from gpt2x.runtime.ort import OrtBackend
from gpt2x.serve.engine import EngineSettings
from gpt2x.serve.http import local_app
from gpt2x.serve.service import CompletionService
from gpt2x.tokenizer import EOT_ID, encode

KEY = "vllm-shapes-key"
VLLM_KEYS = ("prompt_logprobs", "prompt_token_ids", "token_ids")  # on every choice, null unless asked for


@pytest.fixture(scope="module")
def service(export_dir):
    s = CompletionService(OrtBackend(read_export(export_dir), threads=1), EngineSettings(max_batch_size=4), "shakespeare")
    yield s
    s.close()


@pytest.fixture(scope="module")
def client(service):
    with TestClient(local_app(service)) as c:
        yield c


def post(client, **body) -> dict:
    r = client.post("/v1/completions", json=body)
    assert r.status_code == 200, r.text
    return r.json()


def chunks_of(client, **body) -> list[dict]:
    with client.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
        assert r.status_code == 200, r.read()
        lines = [line for line in r.iter_lines() if line]
    assert lines[-1] == "data: [DONE]"
    return [json.loads(line[len("data: "):]) for line in lines[:-1]]


# ------------------------------------------------------------------ shapes


def test_finish_reason_rides_on_the_last_tokens_chunk(client):
    n = 24
    whole = post(client, prompt="ROMEO:", max_tokens=n, temperature=0)
    text = whole["choices"][0]["text"]
    assert whole["usage"]["completion_tokens"] == n and text.isascii()  # one chunk per token (no split characters)
    chunks = chunks_of(client, prompt="ROMEO:", max_tokens=n, temperature=0)
    pieces = [c["choices"][0] for c in chunks]
    assert len(pieces) == n  # vLLM's count: a chunk per token, none extra for the end
    assert all(p["text"] for p in pieces)
    assert [p["finish_reason"] for p in pieces] == [None] * (n - 1) + ["length"]
    assert "".join(p["text"] for p in pieces) == text


def test_text_held_back_for_a_stop_string_comes_with_the_finish(client):
    whole = post(client, prompt="ROMEO:", max_tokens=12, temperature=0)["choices"][0]["text"]
    stop = whole[-2:] + "\x07never"  # its start is the text's end: the end is held back until the choice ends
    assert post(client, prompt="ROMEO:", max_tokens=12, temperature=0, stop=stop)["choices"][0]["text"] == whole
    pieces = [c["choices"][0] for c in chunks_of(client, prompt="ROMEO:", max_tokens=12, temperature=0, stop=stop)]
    assert "".join(p["text"] for p in pieces) == whole
    assert pieces[-1]["finish_reason"] == "length" and pieces[-1]["text"].endswith(whole[-2:])
    assert all(p["finish_reason"] is None for p in pieces[:-1])


def test_an_end_of_text_ends_the_choice_in_a_chunk_of_its_own(client):
    pieces = [c["choices"][0] for c in chunks_of(client, prompt="KING:", max_tokens=10, logit_bias={str(EOT_ID): 100})]
    assert [(p["text"], p["finish_reason"]) for p in pieces] == [("", "stop")]  # the end-of-text token has no text


def test_vllms_keys_are_always_there(client):
    for choice in post(client, prompt=["a", "b"], max_tokens=2)["choices"]:
        assert all(key in choice and choice[key] is None for key in VLLM_KEYS)
    for chunk in chunks_of(client, prompt="a", max_tokens=2):
        for choice in chunk["choices"]:
            assert all(key in choice and choice[key] is None for key in VLLM_KEYS)


def test_token_strs_are_the_tokenizers_tokens(client):
    # GPT-2's byte-level alphabet, by hand: a space is "Ġ" (U+0120), a newline "Ċ" (U+010A), a tab "ĉ"
    body = client.post("/tokenize", json={"prompt": "Hello world\n\tis", "return_token_strs": True}).json()
    assert body["tokens"] == encode("Hello world\n\tis")
    assert "".join(body["token_strs"]) == "HelloĠworldĊĉis"
    assert client.post("/tokenize", json={"prompt": " is", "return_token_strs": True}).json()["token_strs"] == ["Ġis"]


@pytest.mark.parametrize("body", [{"prompt": [1, 50257]}, {"prompt": [[1], [2, 60000]]}, {"prompt": "a", "stop_token_ids": [50300]}])
def test_an_out_of_vocabulary_id_is_named_so(client, body):
    r = client.post("/v1/completions", json=body)
    assert r.status_code == 400 and "out of vocabulary" in r.json()["error"]["message"], r.text


def test_health_and_version_need_no_key(service):
    with TestClient(local_app(service, api_key=KEY)) as c:
        assert c.get("/health").status_code == 200 and c.get("/health").json()["status"] == "ok"
        assert c.get("/version").json() == {"version": __version__}
        assert c.get("/v1/models").status_code == 401
        assert c.post("/v1/completions", json={"prompt": "a", "max_tokens": 1}).status_code == 401
        schema = c.get("/openapi.json").json()
        assert schema["paths"]["/health"]["get"]["security"] == [] == schema["paths"]["/version"]["get"]["security"]


@pytest.mark.parametrize("path", ["/v1/completions", "/tokenize"])
@pytest.mark.parametrize("content_type", ["application/x-www-form-urlencoded", "text/plain", None])
def test_a_body_that_is_not_declared_json_is_refused(client, path, content_type):
    headers = {"Content-Type": content_type} if content_type else {}
    r = client.post(path, content=json.dumps({"prompt": "a", "max_tokens": 1}).encode(), headers=headers)
    assert r.status_code == 400 and "application/json" in r.json()["error"]["message"], r.text
    ok = client.post(path, content=json.dumps({"prompt": "a", "max_tokens": 1}).encode(),
                     headers={"Content-Type": "application/json; charset=utf-8"})
    assert ok.status_code == 200


@pytest.mark.parametrize("stream", [False, None])
def test_stream_options_need_stream(client, stream):
    body = {"prompt": "a", "max_tokens": 1, "stream_options": {"include_usage": True}}
    if stream is not None:
        body["stream"] = stream
    r = client.post("/v1/completions", json=body)
    assert r.status_code == 400 and r.json()["error"]["param"] == "stream_options"
