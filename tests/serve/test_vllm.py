"""The completions API in the shapes vLLM's own clients and tests expect (issue 39): finish_reason on
the chunk of a choice's last token, the keys vLLM always sends, /tokenize's tokenizer tokens, its
error words, the open /health and /version, the JSON content type, stream_options only with stream;
and vLLM's request fields, each honoured (checked against an independent computation made here:
a no-cache forward, gpt2x's own generation, hand-made cases) or refused with a 400 naming it."""

from __future__ import annotations

import json
import threading
import time

import numpy as np
import pytest
from fastapi.testclient import TestClient

from gpt2x import __version__
from gpt2x.generation.beam import beam_search
from gpt2x.generation.processors import AllowedTokens
from gpt2x.generation.settings import SamplingSettings
from gpt2x.numerics import log_softmax
from gpt2x.onnx.artifact import read_export
from gpt2x.runtime.ort import OrtBackend
from gpt2x.serve.core.engine import Engine, EngineSettings, Row
from gpt2x.serve.core.outputs import Failed, Finished, Output, TokenOut
from gpt2x.serve.core.scheduler import Scheduler
from gpt2x.serve.openai.routes import local_app
from gpt2x.tokenizer import EOT_ID, decode, encode

from ..helpers import local_service, post

KEY = "vllm-shapes-key"
VLLM_KEYS = ("prompt_logprobs", "prompt_token_ids", "token_ids")  # on every choice, null unless asked for


@pytest.fixture(scope="module")
def service(export_dir):
    s = local_service(export_dir)
    yield s
    s.close()


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


def test_a_chunk_per_token_where_a_character_spans_tokens(client):
    """vLLM sends a chunk for every token, its text empty while a character split across tokens is incomplete (vllm
    bench serve counts an inter-token gap per chunk): 🤗 is three byte tokens in GPT-2's vocabulary, none a character
    on its own, so the stream holds text back and each token still comes in a chunk of its own."""
    body = dict(prompt="ROMEO:", max_tokens=16, temperature=0, return_token_ids=True,
                structured_outputs={"choice": ["🤗🤗"]})
    whole = post(client, **body)["choices"][0]
    assert whole["text"] == "🤗🤗" and len(whole["token_ids"]) >= 4  # at least two tokens a character
    pieces = [c["choices"][0] for c in chunks_of(client, **body)]
    assert [len(p["token_ids"]) for p in pieces[:-1]] == [1] * (len(pieces) - 1)
    assert [t for p in pieces for t in p["token_ids"]] == whole["token_ids"]
    assert "".join(p["text"] for p in pieces) == "🤗🤗"
    assert [p["text"] for p in pieces].count("") >= 2 and pieces[-1]["finish_reason"] == "stop"


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


# ------------------------------------------------------------------ vLLM's fields


def forward_logprobs(reference, ids: list[int]) -> np.ndarray:
    """log_softmax of every position's logits: one no-cache forward of `ids` alone (T, V)."""
    x = np.asarray([ids], dtype=np.int64)
    logits, _ = reference.run(x, np.ones_like(x), np.arange(len(ids), dtype=np.int64)[None], None)
    return log_softmax(logits[0])


def test_allowed_token_ids_greedy_is_the_argmax_over_the_set(client, reference):
    allowed = sorted(set(encode(" the king and queen of a fair land, the")))
    body = post(client, prompt="ROMEO:", max_tokens=8, temperature=0, allowed_token_ids=allowed, return_token_ids=True)
    got = body["choices"][0]["token_ids"]
    ids = encode("ROMEO:")
    for tok in got:  # each step's argmax among the allowed tokens, from a no-cache forward made here
        lp = forward_logprobs(reference, ids)[-1]
        assert tok == allowed[int(np.argmax(lp[allowed]))]
        ids.append(tok)
    sampled = post(client, prompt=["ROMEO:", "KING:"], max_tokens=30, temperature=1.5, seed=4, n=2,
                   allowed_token_ids=allowed, return_token_ids=True)
    assert all(set(c["token_ids"]) <= set(allowed) and c["token_ids"] for c in sampled["choices"])


def test_allowed_tokens_mask_every_row_of_a_batch():
    scores = np.random.default_rng(0).normal(size=(3, 50)).astype(np.float64)
    out = AllowedTokens([4, 7, 49, 60])(scores.copy(), [])
    assert np.isfinite(out[:, [4, 7, 49]]).all() and (out[:, [4, 7, 49]] == scores[:, [4, 7, 49]]).all()
    assert np.isneginf(np.delete(out, [4, 7, 49], axis=1)).all()


def test_return_token_ids_whole_and_streamed(client):
    body = {"prompt": ["ROMEO:", "JULIET: O"], "max_tokens": 12, "temperature": 0.8, "seed": 3, "return_token_ids": True}
    whole = post(client, **body)
    for i, c in enumerate(whole["choices"]):
        assert c["prompt_token_ids"] == encode(body["prompt"][i])
        assert decode(c["token_ids"]) == c["text"] and len(c["token_ids"]) == 12
    joined: dict[int, list[int]] = {}
    for chunk in chunks_of(client, **body):
        for c in chunk["choices"]:
            first = c["index"] not in joined
            assert (c["prompt_token_ids"] is not None) == first  # the prompt's ids with a choice's first chunk
            joined.setdefault(c["index"], []).extend(c["token_ids"])
    assert [joined[i] for i in range(2)] == [c["token_ids"] for c in whole["choices"]]


def test_tokens_as_token_ids_in_logprobs(client):
    c = post(client, prompt="ROMEO:", max_tokens=6, temperature=0, logprobs=2, return_tokens_as_token_ids=True,
             return_token_ids=True)["choices"][0]
    assert c["logprobs"]["tokens"] == [f"token_id:{t}" for t in c["token_ids"]]
    assert all(k.startswith("token_id:") for top in c["logprobs"]["top_logprobs"] for k in top)


def test_prompt_logprobs_as_vllm_gives_them(client, reference):
    prompt = "What light through yonder window breaks?"
    ids = encode(prompt)
    c = post(client, prompt=prompt, max_tokens=3, temperature=0, prompt_logprobs=2)["choices"][0]
    lp = forward_logprobs(reference, ids)
    entries = c["prompt_logprobs"]
    assert len(entries) == len(ids) and entries[0] is None
    for i in range(1, len(ids)):
        row, tok = lp[i - 1], ids[i]
        best = np.argsort(-row, kind="stable")[:2]
        assert set(entries[i]) == {str(t) for t in best} | {str(tok)}
        mine = entries[i][str(tok)]
        assert mine["logprob"] == pytest.approx(row[tok], abs=1e-5) and mine["decoded_token"] == decode([tok])
        assert mine["rank"] == 1 + int((row > row[tok]).sum())
        assert [entries[i][str(t)]["rank"] for t in best] == [1, 2]
    assert c["logprobs"] is None and len(c["text"]) > 0
    zero = post(client, prompt=prompt, max_tokens=1, prompt_logprobs=0)["choices"][0]["prompt_logprobs"]
    assert [None if e is None else list(e) for e in zero] == [None] + [[str(t)] for t in ids[1:]]


@pytest.mark.parametrize("k", [-1, 21, -2])
def test_prompt_logprobs_out_of_range_is_refused(client, k):
    r = client.post("/v1/completions", json={"prompt": "a", "prompt_logprobs": k})
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt_logprobs", r.text


@pytest.mark.parametrize("side", ["left", "right", None])
def test_truncation_side(client, side):
    prompt = "What light through yonder window breaks? It is the east"
    ids = encode(prompt)
    body = {"prompt": prompt, "max_tokens": 1, "truncate_prompt_tokens": 4, "return_token_ids": True}
    if side:
        body["truncation_side"] = side
    c = post(client, **body)["choices"][0]
    assert c["prompt_token_ids"] == (ids[:4] if side == "right" else ids[-4:])


def test_continuous_usage_stats(client):
    chunks = chunks_of(client, prompt="ROMEO:", max_tokens=10, temperature=0,
                       stream_options={"include_usage": True, "continuous_usage_stats": True})
    used = [c["usage"]["completion_tokens"] for c in chunks if c["choices"]]
    assert used == list(range(1, 11))  # one token a chunk, counted as it goes
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 10
    assert all(c["usage"]["prompt_tokens"] == len(encode("ROMEO:")) for c in chunks)


def test_include_stop_str_in_output(client):
    full = post(client, prompt="ROMEO:", max_tokens=30, temperature=0)["choices"][0]["text"]
    stop = full[8:11]
    at = full.index(stop)
    kept = post(client, prompt="ROMEO:", max_tokens=30, temperature=0, stop=stop, include_stop_str_in_output=True)
    assert kept["choices"][0]["text"] == full[: at + len(stop)] and kept["choices"][0]["finish_reason"] == "stop"


def test_beam_search_gives_the_n_best_beams(client, reference):
    body = post(client, prompt="ROMEO:", max_tokens=8, n=3, use_beam_search=True, return_token_ids=True)
    choices = body["choices"]
    assert len(choices) == 3 and len({tuple(c["token_ids"]) for c in choices}) == 3
    best = beam_search(reference, "ROMEO:", encode("ROMEO:"), SamplingSettings(max_new_tokens=8, num_beams=3))
    assert choices[0]["token_ids"] == best.tokens
    ids = encode("ROMEO:")

    def score(tokens: list[int], ended: bool) -> float:  # summed log-probability / length, from a forward made here
        seq = tokens + ([EOT_ID] if ended else [])
        lp = forward_logprobs(reference, ids + seq)
        return sum(lp[len(ids) - 1 + j, t] for j, t in enumerate(seq)) / len(seq)

    scores = [score(c["token_ids"], c["finish_reason"] == "stop") for c in choices]
    assert scores == sorted(scores, reverse=True)
    streamed = chunks_of(client, prompt="ROMEO:", max_tokens=8, n=3, use_beam_search=True)
    texts = ["".join(p["text"] for ch in streamed for p in ch["choices"] if p["index"] == i) for i in range(3)]
    assert texts == [c["text"] for c in choices]


@pytest.mark.parametrize("body,param", [
    ({"use_beam_search": True, "n": 2, "temperature": 0.7}, "temperature"),
    ({"use_beam_search": True, "n": 2, "logprobs": 1}, "logprobs"),
    ({"use_beam_search": True, "n": 2, "presence_penalty": 1}, "use_beam_search"),
    ({"length_penalty": 0.5}, "length_penalty"), ({"truncation_side": "right"}, "truncation_side"),
    ({"bad_words": "x"}, "bad_words"), ({"bad_words": [""]}, "bad_words"), ({"guided_json": {}}, "guided_json"),
    ({"cache_salt": "s"}, "cache_salt"), ({"use_beam_search": True, "n": 2, "bad_words": ["x"]}, "use_beam_search"),
    ({"logits_processors": ["a.b"]}, "logits_processors"), ({"allowed_token_ids": [50257]}, "allowed_token_ids"),
    ({"allowed_token_ids": []}, "allowed_token_ids"), ({"return_token_ids": 1}, "return_token_ids"),
])
def test_vllm_fields_not_served_so_are_400_naming_them(client, body, param):
    r = client.post("/v1/completions", json={"prompt": "a", "max_tokens": 2, **body})
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


def test_request_id_and_unknown_fields(client):
    body = post(client, prompt="a", max_tokens=1, request_id="abc-1", no_such_field=3, add_special_tokens=True)
    assert body["id"] == "cmpl-abc-1"


# ------------------------------------------------------------------ priority scheduling


def test_priority_order_of_a_hand_built_arrival_order():
    def rows(policy: str) -> list:
        scheduler = Scheduler(EngineSettings(max_batch_size=1, max_waiting=8, scheduling_policy=policy), 256)
        made = []
        for priority in (0, 5, -1, 5, 0):
            row = Row([1, 2], SamplingSettings(max_new_tokens=2), lambda out: None)
            row.priority = priority
            made.append(row)
            scheduler.submit([row])
        order = []
        while True:
            taken = scheduler.take([], None)
            if not taken:
                return [made.index(r) for r in order]
            order += taken

    assert rows("priority") == [2, 0, 4, 1, 3]  # lowest first, arrival order among equals (vLLM's)
    assert rows("fcfs") == [0, 1, 2, 3, 4]


def test_waiting_requests_run_by_priority(export_dir):
    engine = Engine(OrtBackend(read_export(export_dir), threads=1),
                    EngineSettings(max_batch_size=1, scheduling_policy="priority")).start()
    ended: list[str] = []
    first = threading.Event()

    def sink(name: str):
        def tell(out: Output) -> None:
            if isinstance(out, TokenOut):
                first.set()
            elif isinstance(out, (Finished, Failed)):
                ended.append(name)
        return tell

    def row(name: str, priority: int, tokens: int) -> Row:
        r = Row(encode(f"{name}:"), SamplingSettings(max_new_tokens=tokens, greedy=True, ignore_eos=True), sink(name))
        r.priority = priority
        return r

    try:
        engine.submit([row("running", 0, 60)])
        assert first.wait(30)  # it runs; the others wait for its place
        engine.submit([row("late", 10, 3), row("normal", 0, 3), row("urgent", -5, 3)])
        deadline = time.monotonic() + 60
        while len(ended) < 4 and time.monotonic() < deadline:
            time.sleep(0.02)
        assert ended == ["running", "urgent", "normal", "late"]
    finally:
        engine.close()


def test_priority_needs_the_priority_policy(client):
    r = client.post("/v1/completions", json={"prompt": "a", "max_tokens": 1, "priority": 3})
    assert r.status_code == 400 and r.json()["error"]["param"] == "priority"
    assert "--scheduling-policy priority" in r.json()["error"]["message"]
    assert post(client, prompt="a", max_tokens=1, priority=0)["choices"]
