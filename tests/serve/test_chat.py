"""/v1/chat/completions: the messages rendered by a DialoGPT-style Jinja2 chat template (GPT-2, turns
separated by end-of-text), then completed as the completions API completes that text: checked with
the openai client's chat API against gpt2x's own generation of the hand-rendered prompt, streamed and
not, with n, seeds and structured output; a model with no template is one 400 naming the flag."""

from __future__ import annotations

import json

import numpy as np
import pytest
from fastapi.testclient import TestClient

from gpt2x.generation.generate import generate
from gpt2x.generation.settings import SamplingSettings
from gpt2x.onnx.interop import DEFAULT_CHAT_TEMPLATE
from gpt2x.runtime.ort import OrtBackend
from gpt2x.serve.core.engine import EngineSettings
from gpt2x.serve.openai.chat_completion.protocol import ChatCompletionRequest
from gpt2x.serve.openai.chat_completion.serving import render_prompt
from gpt2x.serve.openai.chat_completion.template import ChatTemplate, find_template
from gpt2x.serve.openai.routes import local_app
from gpt2x.serve.openai.service import CompletionService
from gpt2x.serve.replica import has_chat_template
from gpt2x.tokenizer import decode, encode

from ..helpers import local_service

DIALOGPT = "{% for message in messages %}{{ message.content }}{{ eos_token }}{% endfor %}"
MESSAGES = [{"role": "user", "content": "Good morrow, my lord."}, {"role": "assistant", "content": "What news?"},
            {"role": "user", "content": "The king is dead."}]
RENDERED = "Good morrow, my lord.<|endoftext|>What news?<|endoftext|>The king is dead.<|endoftext|>"  # by hand


@pytest.fixture(scope="module")
def service(export_dir):
    s = local_service(export_dir, chat_template=ChatTemplate(DIALOGPT, "test"))
    yield s
    s.close()



def test_the_openai_chat_api_whole_and_streamed(openai_client, reference):
    want = generate(reference, [RENDERED], SamplingSettings(max_new_tokens=12, greedy=True))[0]
    whole = openai_client.chat.completions.create(model="shakespeare", messages=MESSAGES, max_tokens=12, temperature=0)
    choice = whole.choices[0]
    assert whole.object == "chat.completion" and whole.id.startswith("chatcmpl-")
    assert choice.message.role == "assistant" and choice.message.content == decode(want.tokens)
    assert choice.finish_reason == "length" and whole.usage.completion_tokens == 12
    assert whole.usage.prompt_tokens == len(want.prompt_tokens)
    chunks = list(openai_client.chat.completions.create(model="shakespeare", messages=MESSAGES, max_tokens=12,
                                                         temperature=0, stream=True,
                                                         stream_options={"include_usage": True}))
    pieces = [c for c in chunks if c.choices]
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    assert pieces[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in pieces) == choice.message.content
    assert [c.choices[0].finish_reason for c in pieces][-1] == "length"
    assert chunks[-1].usage.completion_tokens == 12


def test_n_seeds_and_max_completion_tokens_as_the_completions_api(openai_client, reference):
    got = openai_client.chat.completions.create(model="shakespeare", messages=MESSAGES, n=2, seed=7,
                                                max_completion_tokens=10, temperature=1.0)
    for i, choice in enumerate(got.choices):  # choice i seeded seed + i, as a completion's
        want = generate(reference, [RENDERED], SamplingSettings(max_new_tokens=10, seed=7 + i))[0]
        assert choice.message.content == decode(want.tokens)


def test_structured_output_through_chat(openai_client):
    got = openai_client.chat.completions.create(model="shakespeare", messages=MESSAGES, max_tokens=8, n=3, seed=1,
                                                extra_body={"structured_outputs": {"choice": ["aye", "nay"]}})
    assert {c.message.content for c in got.choices} <= {"aye", "nay"}


def test_no_template_is_one_400_naming_the_flag(export_dir):
    plain = local_service(export_dir, "m", batch=1)
    try:
        with TestClient(local_app(plain)) as c:
            r = c.post("/v1/chat/completions", json={"messages": MESSAGES})
            assert r.status_code == 400 and "--chat-template" in r.json()["error"]["message"], r.text
    finally:
        plain.close()


@pytest.mark.parametrize("body,param", [
    ({"messages": []}, "messages"), ({"messages": [{"content": "x"}]}, "messages"),
    ({"messages": MESSAGES, "tools": [{"type": "function"}]}, "tools"),
    ({"messages": MESSAGES, "top_logprobs": 2}, "top_logprobs"), ({"messages": MESSAGES, "temperature": 3}, "temperature"),
    ({"messages": MESSAGES, "logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ({"messages": MESSAGES, "prompt_logprobs": 21}, "prompt_logprobs"), ({"messages": MESSAGES, "return_token_ids": 3}, "return_token_ids"),
    ({"messages": MESSAGES, "bad_words": "x"}, "bad_words"), ({"messages": MESSAGES, "echo": "yes"}, "echo"),
    ({"messages": MESSAGES, "prompt": "x"}, "prompt"),
])
def test_bad_chat_fields_are_400_naming_them(service, body, param):
    with TestClient(local_app(service)) as c:
        r = c.post("/v1/chat/completions", json=body)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


def test_the_template_from_the_export_folder(tmp_path):
    assert find_template(tmp_path, None, default=False) is None
    assert find_template(tmp_path, None).source == DEFAULT_CHAT_TEMPLATE  # none of its own: the default
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": DIALOGPT}))
    assert find_template(tmp_path, None).render(MESSAGES, True, {}) == RENDERED
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": [{"name": "default", "template": DIALOGPT}]}))
    assert find_template(tmp_path, None).render(MESSAGES, True, {}) == RENDERED
    assert find_template(tmp_path, "{{ messages[0].content }}").render(MESSAGES, True, {}) == MESSAGES[0]["content"]


# The default template on MESSAGES, written out by hand: a play's script, the reply opened as ASSISTANT's.
DEFAULT_RENDERED = ("USER:\nGood morrow, my lord.\n\nASSISTANT:\nWhat news?\n\nUSER:\nThe king is dead.\n\n"
                    "ASSISTANT:\n")


def test_the_bundled_export_carries_the_default_template_as_transformers_renders_it(export_dir):
    """The bundled model's export records gpt2x's default template in tokenizer_config.json: transformers'
    apply_chat_template renders it as written out by hand, and so does the server's chat (the prompt it completes)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(export_dir))
    assert tok.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True) == DEFAULT_RENDERED
    body = {"prompt": render_prompt(ChatCompletionRequest.model_validate({"messages": MESSAGES, "max_tokens": 4}),
                                    find_template(export_dir, None, default=False))}
    assert body["prompt"] == DEFAULT_RENDERED


def test_a_model_without_a_template_chats_on_the_default_unless_refused(tiny_export):
    """An export with no template of its own (a random tiny model's): chat renders gpt2x's default, and the answer is
    the completion of that text; with --no-default-chat-template (default=False) a 400 naming the flags."""
    _, _, info = tiny_export()
    assert not has_chat_template(info.folder)
    for default in (True, False):
        served = CompletionService(OrtBackend(info, threads=1), EngineSettings(max_batch_size=1), "m",
                                   chat_template=find_template(info.folder, None, default))
        try:
            with TestClient(local_app(served)) as c:
                r = c.post("/v1/chat/completions", json={"messages": MESSAGES, "max_tokens": 4, "temperature": 0})
                if default:
                    want = generate(OrtBackend(info, threads=1), [DEFAULT_RENDERED], SamplingSettings(max_new_tokens=4, greedy=True))[0]
                    assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] == decode(want.tokens)
                else:
                    error = r.json()["error"]
                    assert r.status_code == 400 and error["code"] == "chat_template_missing", r.text
                    assert "--no-default-chat-template" in error["message"] and "--chat-template" in error["message"]
        finally:
            served.close()


def test_openapi_describes_chat_from_its_models_and_the_answers_validate_against_it(service):
    """/openapi.json's chat route names its request (ChatCompletionRequest) and response (ChatCompletionResponse, and
    ChatCompletionChunk for a stream's events), generated from the models; a whole answer and each streamed chunk
    validate against those schemas (jsonschema, resolving the document's own $refs)."""
    import jsonschema

    with TestClient(local_app(service)) as c:
        doc = c.get("/openapi.json").json()
        op = doc["paths"]["/v1/chat/completions"]["post"]
        assert op["requestBody"]["content"]["application/json"]["schema"]["$ref"].endswith("/ChatCompletionRequest")
        ok = op["responses"]["200"]["content"]
        assert ok["application/json"]["schema"]["$ref"].endswith("/ChatCompletionResponse")
        assert "ChatCompletionChunk" in json.dumps(ok["text/event-stream"])
        assert "messages" in doc["components"]["schemas"]["ChatCompletionRequest"]["required"]

        def check(instance, name):
            jsonschema.validate(instance, {"$ref": f"#/components/schemas/{name}", "components": doc["components"]})

        whole = c.post("/v1/chat/completions", json={"messages": MESSAGES, "max_tokens": 4, "n": 2}).json()
        check(whole, "ChatCompletionResponse")
        assert whole["object"] == "chat.completion" and whole["choices"][1]["message"]["role"] == "assistant"
        body = {"messages": MESSAGES, "max_tokens": 4, "stream": True, "stream_options": {"include_usage": True}}
        with c.stream("POST", "/v1/chat/completions", json=body) as s:
            chunks = [json.loads(line[6:]) for line in s.iter_lines() if line and line != "data: [DONE]"]
        for chunk in chunks:
            check(chunk, "ChatCompletionChunk")
        assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}  # the role alone, first (OpenAI's)
        assert all("role" not in ch["delta"] for chunk in chunks[1:] for ch in chunk["choices"])
        assert "usage" not in chunks[0] and chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 4


def test_the_chat_details_clients_rely_on(service):
    """vLLM's and llama-server's: text content parts joined by a newline, `model: ""` meaning the served model, and
    each streamed choice opened by a chunk with its role and no text."""
    parts = [{"role": "user", "content": [{"type": "text", "text": "Good morrow,"}, {"type": "text", "text": "my lord."}]}]
    body = {"prompt": render_prompt(ChatCompletionRequest.model_validate({"messages": parts}), ChatTemplate(DIALOGPT, "test"))}
    assert body["prompt"] == "Good morrow,\nmy lord.<|endoftext|>"
    with TestClient(local_app(service)) as c:
        r = c.post("/v1/chat/completions", json={"model": "", "messages": MESSAGES, "max_tokens": 2})
        assert r.status_code == 200 and r.json()["model"] == "shakespeare"
        with c.stream("POST", "/v1/chat/completions", json={"messages": MESSAGES, "max_tokens": 3, "n": 2, "stream": True}) as s:
            chunks = [json.loads(line[6:]) for line in s.iter_lines() if line and line != "data: [DONE]"]
    firsts = {}
    for chunk in chunks:
        for choice in chunk["choices"]:
            firsts.setdefault(choice["index"], choice["delta"])
    assert firsts == {0: {"role": "assistant", "content": ""}, 1: {"role": "assistant", "content": ""}}


def test_chat_logprobs_in_openais_chat_shape_equal_a_forward_without_a_cache(service, reference):
    """logprobs: true with top_logprobs 3, whole and streamed: each generated token's text, bytes and log-probability,
    and its 3 most likely alternatives, against log_softmax of the reference backend's forward of the whole text with
    no cache (an independent forward); the streamed chunks carry the same entries as the whole answer."""
    from gpt2x.numerics import positions
    from gpt2x.tokenizer import encode, get_encoding

    body = {"messages": MESSAGES, "max_tokens": 5, "temperature": 0, "logprobs": True, "top_logprobs": 3}
    with TestClient(local_app(service)) as c:
        whole = c.post("/v1/chat/completions", json=body).json()
        with c.stream("POST", "/v1/chat/completions", json={**body, "stream": True}) as s:
            chunks = [json.loads(line[6:]) for line in s.iter_lines() if line and line != "data: [DONE]"]
    content = whole["choices"][0]["logprobs"]["content"]
    streamed = [e for ch in chunks for choice in ch["choices"] if choice["logprobs"] for e in choice["logprobs"]["content"]]
    assert streamed == content and len(content) == 5
    ids = encode(RENDERED)
    enc = get_encoding()
    for entry in content:
        full = np.array([ids])
        mask = np.ones_like(full)
        logits, _ = reference.run(full, mask, positions(mask, full.shape[1]), None)
        row = logits[0, -1].astype(np.float64)
        logp = row - row.max() - np.log(np.exp(row - row.max()).sum())
        best = np.argsort(-logp)[:3]
        chosen = int(best[0])  # greedy
        assert entry["bytes"] == list(enc.decode_single_token_bytes(chosen))
        assert abs(entry["logprob"] - logp[chosen]) < 1e-4
        assert [t["bytes"] for t in entry["top_logprobs"]] == [list(enc.decode_single_token_bytes(int(t))) for t in best]
        assert all(abs(t["logprob"] - logp[int(b)]) < 1e-4 for t, b in zip(entry["top_logprobs"], best))
        ids.append(chosen)
    assert "".join(e["token"] for e in content) == whole["choices"][0]["message"]["content"]


def test_tokenize_takes_messages_as_chat_renders_them(service):
    """vLLM's /tokenize with `messages`: the conversation rendered as /v1/chat/completions renders it (by hand here,
    RENDERED), its tokens those of that text, as many as the chat answer's prompt_tokens; prompt and messages together,
    or neither, is a 400."""
    from gpt2x.tokenizer import encode

    with TestClient(local_app(service)) as c:
        r = c.post("/tokenize", json={"messages": MESSAGES, "return_token_strs": True}).json()
        assert r["tokens"] == encode(RENDERED) and r["count"] == len(r["tokens"]) == len(r["token_strs"])
        answer = c.post("/v1/chat/completions", json={"messages": MESSAGES, "max_tokens": 1}).json()
        assert answer["usage"]["prompt_tokens"] == r["count"]
        for body in ({"messages": MESSAGES, "prompt": "x"}, {}, {"messages": [{"content": "x"}]}):
            bad = c.post("/tokenize", json=body)
            assert bad.status_code == 400 and bad.json()["error"]["param"] in ("prompt", "messages"), bad.text


def test_echo_begins_each_answer_with_the_assistants_last_message(openai_client, reference):
    """vLLM's chat echo: where the last message is the assistant's (here continued, continue_final_message), each
    choice's content is its text and then the completion of the hand-rendered prompt, whole and streamed; where the
    last message is the user's, nothing is echoed."""
    messages = [{"role": "user", "content": "Good morrow, my lord."}, {"role": "assistant", "content": "What news"}]
    want = generate(reference, ["Good morrow, my lord.<|endoftext|>What news"],  # by hand: the last message left open
                    SamplingSettings(max_new_tokens=8, greedy=True))[0]
    extra = {"echo": True, "continue_final_message": True, "add_generation_prompt": False}
    whole = openai_client.chat.completions.create(model="shakespeare", messages=messages, max_tokens=8, temperature=0,
                                                  extra_body=extra)
    assert whole.choices[0].message.content == "What news" + decode(want.tokens)
    assert whole.usage.completion_tokens == len(want.tokens)  # the echoed text is no completion token
    chunks = list(openai_client.chat.completions.create(model="shakespeare", messages=messages, max_tokens=8,
                                                         temperature=0, stream=True, extra_body=extra))
    assert chunks[0].choices[0].delta.role == "assistant" and chunks[1].choices[0].delta.content == "What news"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == whole.choices[0].message.content
    plain = openai_client.chat.completions.create(model="shakespeare", messages=MESSAGES, max_tokens=8, temperature=0)
    echoed = openai_client.chat.completions.create(model="shakespeare", messages=MESSAGES, max_tokens=8, temperature=0,
                                                   extra_body={"echo": True})
    assert echoed.choices[0].message.content == plain.choices[0].message.content


def test_vllms_token_ids_and_prompt_logprobs_on_chat(service, reference):
    """return_token_ids and prompt_logprobs answered in vLLM's chat shape: the rendered prompt's ids and logprobs on
    the response (checked against the hand-rendered prompt and a no-cache forward of it), each choice's generated ids
    on the choice (gpt2x's generation of that prompt), whole and streamed (the prompt's keys once)."""
    from .test_vllm import forward_logprobs

    ids = encode(RENDERED)
    want = generate(reference, [RENDERED], SamplingSettings(max_new_tokens=6, greedy=True))[0]
    body = {"messages": MESSAGES, "max_tokens": 6, "temperature": 0, "return_token_ids": True, "prompt_logprobs": 1}
    with TestClient(local_app(service)) as c:
        whole = c.post("/v1/chat/completions", json=body).json()
        assert whole["prompt_token_ids"] == ids and whole["choices"][0]["token_ids"] == want.tokens
        assert decode(whole["choices"][0]["token_ids"]) == whole["choices"][0]["message"]["content"]
        entries, lp = whole["prompt_logprobs"], forward_logprobs(reference, ids)
        assert len(entries) == len(ids) and entries[0] is None
        for i in range(1, len(ids)):
            assert entries[i][str(ids[i])]["logprob"] == pytest.approx(lp[i - 1][ids[i]], abs=1e-5)
        lines = [line for line in c.post("/v1/chat/completions", json={**body, "stream": True}).text.splitlines()
                 if line.startswith("data: {")]
    chunks = [json.loads(line[len("data: "):]) for line in lines]
    assert [ch["prompt_token_ids"] for ch in chunks if ch.get("prompt_token_ids")] == [ids]
    assert len([ch for ch in chunks if ch.get("prompt_logprobs")]) == 1
    assert [t for ch in chunks for choice in ch["choices"] for t in choice.get("token_ids") or []] == want.tokens
    plain = TestClient(local_app(service)).post("/v1/chat/completions", json={"messages": MESSAGES, "max_tokens": 2}).json()
    assert plain["prompt_token_ids"] is None and plain["prompt_logprobs"] is None and plain["choices"][0]["token_ids"] is None
