"""/v1/responses, OpenAI's Responses API over the chat path: through the openai client's responses API (whole and
streamed), each answer checked against gpt2x's own generation of the prompt rendered by hand from the test's chat
template (a role before each message, turns ended by end-of-text): the instructions as a system message first, a
previous_response_id's conversation and output before the new input, structured output validated by jsonschema, the
usage's input tokens those of the hand-rendered prompt; what is not served is a 400 naming the field, an unknown or
unstored previous response a 404."""

from __future__ import annotations

import json

import httpx
import jsonschema
import openai
import pytest
from fastapi.testclient import TestClient

from gpt2x.generation.constraints import ConstraintSpec
from gpt2x.generation.generate import generate
from gpt2x.generation.settings import Finish, SamplingSettings
from gpt2x.serve.openai.chat_completion.template import ChatTemplate
from gpt2x.serve.openai.responses.serving import ResponseStore
from gpt2x.serve.openai.routes import local_app
from gpt2x.tokenizer import decode, encode

from ..helpers import local_service, uvicorn_server

MODEL = "shakespeare"
TEMPLATE = ("{% for m in messages %}{{ m.role }}: {{ m.content }}{{ eos_token }}{% endfor %}"
            "{% if add_generation_prompt %}assistant:{% endif %}")
EOT = "<|endoftext|>"
# The prompts the template makes of these inputs, written out by hand.
GREETING = "Good morrow, my lord."
PROMPT = f"user: Good morrow, my lord.{EOT}assistant:"
KINGLY = "Speak as a king."
KINGLY_PROMPT = f"system: Speak as a king.{EOT}user: Good morrow,\nmy lord.{EOT}assistant:"  # text parts joined by \n
VERDICT = {"type": "object", "properties": {"guilty": {"type": "boolean"}}, "required": ["guilty"],
           "additionalProperties": False}


@pytest.fixture(scope="module")
def service(export_dir):
    s = local_service(export_dir, MODEL, chat_template=ChatTemplate(TEMPLATE, "test"))
    yield s
    s.close()


@pytest.fixture(scope="module")
def base_url(service):
    with uvicorn_server(local_app(service)) as port:
        yield f"http://127.0.0.1:{port}"


@pytest.fixture(scope="module")
def client(base_url):
    return openai.OpenAI(base_url=f"{base_url}/v1", api_key="none", max_retries=0)


@pytest.fixture(scope="module")
def http(base_url):
    with httpx.Client(base_url=base_url, timeout=60) as c:
        yield c


def greedy(reference, prompt: str, tokens: int, constraint: ConstraintSpec | None = None):
    return generate(reference, [prompt], SamplingSettings(greedy=True, max_new_tokens=tokens, constraint=constraint))[0]


def test_a_response_whole_and_streamed_is_the_reference_generation(client, reference):
    """The input string as a user's message: the text is gpt2x's greedy generation of the hand-rendered prompt, cut
    off by max_output_tokens (status incomplete, reason max_output_tokens), usage counting the prompt's tokens; the
    stream's events come in OpenAI's order, numbered, and its deltas make the same text."""
    want = greedy(reference, PROMPT, 8)
    assert want.finish_reason is Finish.length  # the reference ran to the limit: the answer must say incomplete
    whole = client.responses.create(model=MODEL, input=GREETING, max_output_tokens=8, temperature=0)
    assert whole.id.startswith("resp_") and whole.object == "response" and whole.model == MODEL
    assert whole.output_text == decode(want.tokens)
    assert whole.status == "incomplete" and whole.incomplete_details.reason == "max_output_tokens"
    [item] = whole.output
    assert item.type == "message" and item.role == "assistant" and item.id.startswith("msg_") and item.status == "incomplete"
    assert [(c.type, c.annotations) for c in item.content] == [("output_text", [])]
    assert whole.usage.input_tokens == len(encode(PROMPT)) == len(want.prompt_tokens)
    assert whole.usage.output_tokens == 8 and whole.usage.total_tokens == len(encode(PROMPT)) + 8
    assert whole.usage.output_tokens_details.reasoning_tokens == 0 and whole.error is None
    assert (whole.max_output_tokens, whole.temperature, whole.store, whole.tools) == (8, 0, True, [])

    events = list(client.responses.create(model=MODEL, input=GREETING, max_output_tokens=8, temperature=0, stream=True))
    types = [e.type for e in events]
    deltas = [e for e in events if e.type == "response.output_text.delta"]
    assert types == ["response.created", "response.in_progress", "response.output_item.added",
                     "response.content_part.added", *["response.output_text.delta"] * len(deltas),
                     "response.output_text.done", "response.content_part.done", "response.output_item.done",
                     "response.incomplete"]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert events[0].response.status == "in_progress" and events[0].response.output == []
    item_id = events[2].item.id
    assert all(e.item_id == item_id and e.output_index == 0 and e.content_index == 0 for e in deltas)
    assert "".join(e.delta for e in deltas) == events[-4].text == events[-3].part.text == decode(want.tokens)
    last = events[-1].response
    assert last.status == "incomplete" and last.output_text == decode(want.tokens) and last.output[0].id == item_id
    assert (last.usage.input_tokens, last.usage.output_tokens) == (len(want.prompt_tokens), 8)


def test_instructions_are_a_system_message_first_and_text_parts_are_joined(client, reference):
    """instructions become the first message (role system); an input message's input_text parts are joined by a
    newline, as chat joins its text parts."""
    want = greedy(reference, KINGLY_PROMPT, 6)
    got = client.responses.create(model=MODEL, instructions=KINGLY, max_output_tokens=6, temperature=0, input=[
        {"role": "user", "content": [{"type": "input_text", "text": "Good morrow,"},
                                     {"type": "input_text", "text": "my lord."}]}])
    assert got.output_text == decode(want.tokens) and got.instructions == KINGLY
    assert got.usage.input_tokens == len(encode(KINGLY_PROMPT))


def test_previous_response_id_continues_the_conversation(client, reference):
    """The second response's prompt: the first's input and output, then the new input, after the second's own
    instructions (the first's are not carried over, OpenAI's rule). Sending the first's output item back in the
    input (an assistant message of output_text) is the same conversation."""
    first_want = greedy(reference, f"system: {KINGLY}{EOT}{PROMPT}", 6)
    first = client.responses.create(model=MODEL, input=GREETING, instructions=KINGLY, max_output_tokens=6, temperature=0)
    assert first.output_text == decode(first_want.tokens)
    second_prompt = (f"system: Speak plainly.{EOT}user: Good morrow, my lord.{EOT}assistant: {first.output_text}{EOT}"
                     f"user: What news?{EOT}assistant:")
    want = greedy(reference, second_prompt, 6)
    second = client.responses.create(model=MODEL, input="What news?", previous_response_id=first.id,
                                     instructions="Speak plainly.", max_output_tokens=6, temperature=0)
    assert second.previous_response_id == first.id and second.output_text == decode(want.tokens)
    assert second.usage.input_tokens == len(encode(second_prompt))
    by_items = client.responses.create(model=MODEL, instructions="Speak plainly.", max_output_tokens=6, temperature=0,
                                       input=[{"role": "user", "content": GREETING},
                                              first.output[0].model_dump(exclude_none=True),
                                              {"type": "message", "role": "user", "content": "What news?"}])
    assert by_items.output_text == second.output_text and by_items.usage.input_tokens == second.usage.input_tokens
    third_prompt = f"{second_prompt[len('system: Speak plainly.' + EOT):]} {second.output_text}{EOT}user: Go on.{EOT}assistant:"
    third = client.responses.create(model=MODEL, input="Go on.", previous_response_id=second.id, max_output_tokens=4,
                                    temperature=0)
    assert third.output_text == decode(greedy(reference, third_prompt, 4).tokens)  # the chain carries every turn


def test_unstored_and_unknown_previous_responses_are_404(client):
    """store: false keeps nothing: a later previous_response_id naming it is a 404 naming the field, as is one never
    answered."""
    kept_not = client.responses.create(model=MODEL, input=GREETING, max_output_tokens=2, store=False)
    assert kept_not.store is False
    for missing in (kept_not.id, "resp_never"):
        with pytest.raises(openai.NotFoundError) as e:
            client.responses.create(model=MODEL, input="What news?", previous_response_id=missing, max_output_tokens=2)
        assert e.value.status_code == 404 and e.value.body["param"] == "previous_response_id"


def test_the_store_keeps_the_last_responses_only():
    store = ResponseStore(size=2)
    for i in range(3):
        store.put(f"resp_{i}", ({"role": "user", "content": str(i)},))
    assert store.get("resp_0") is None and store.get("resp_2") == ({"role": "user", "content": "2"},) and len(store) == 2


def test_json_schema_text_format_is_kept_to(client, reference):
    """text.format json_schema: the output is JSON satisfying the schema (jsonschema), the same as gpt2x's own
    generation under that constraint, and completed (the JSON ended before max_output_tokens)."""
    want = greedy(reference, PROMPT, 24, ConstraintSpec.json_schema(VERDICT))
    assert want.finish_reason is not Finish.length
    got = client.responses.create(model=MODEL, input=GREETING, max_output_tokens=24, temperature=0, text={
        "format": {"type": "json_schema", "name": "verdict", "schema": VERDICT, "strict": True}})
    jsonschema.validate(json.loads(got.output_text), VERDICT)
    assert got.output_text == decode(want.tokens)
    assert got.status == "completed" and got.incomplete_details is None and got.usage.output_tokens < 24
    assert got.text.format.type == "json_schema" and got.text.format.schema_ == VERDICT


def test_the_sdks_stream_helper_and_parse_read_the_answers(client):
    """The openai SDK's own accumulation of the events (responses.stream: it checks each event against the state it
    built, and its final response is the one response.completed carries) and responses.parse, with a pydantic model
    as the text format: both read the JSON the schema kept the text to, the same answer streamed and whole."""
    from pydantic import BaseModel

    class Verdict(BaseModel):
        guilty: bool

    asked = dict(model=MODEL, input=GREETING, text_format=Verdict, max_output_tokens=24, temperature=0)
    with client.responses.stream(**asked) as stream:
        pieces = [e.delta for e in stream if e.type == "response.output_text.delta"]
        final = stream.get_final_response()
    parsed = client.responses.parse(**asked)
    assert isinstance(parsed.output_parsed, Verdict) and parsed.status == final.status == "completed"
    assert "".join(pieces) == final.output_text == parsed.output_text and final.output_parsed == parsed.output_parsed


def test_a_failure_once_the_stream_began_is_its_last_event(service):
    """An error from the engine after the stream's first events: an `error` event (its code and message), then
    nothing (no [DONE], no response.completed)."""
    import asyncio

    from gpt2x.serve.openai.errors import APIError
    from gpt2x.serve.openai.responses.serving import ResponsesAPI

    class Failing:
        reasons = [None]

        async def events(self):
            raise APIError(500, "the engine failed", "server_error")
            yield  # an async generator

    api = ResponsesAPI(service)
    call = api.parse(json.dumps({"input": GREETING, "stream": True}).encode())

    async def rendered() -> list[str]:
        return [event.render() async for event in api.stream(call, Failing())]

    out = asyncio.run(rendered())
    assert out[-1] == "" and out[-2].startswith("event: error\ndata: ")
    error = json.loads(out[-2].split("data: ", 1)[1])
    assert error == {"type": "error", "sequence_number": 4, "code": "server_error", "message": "the engine failed",
                     "param": None}
    assert [line.split("\n")[0] for line in out[:-2]] == [f"event: response.{t}" for t in (
        "created", "in_progress", "output_item.added", "content_part.added")]
    assert len(api.store) == 0  # a failed response is not kept


@pytest.mark.parametrize("body,param,status", [
    ({"tools": [{"type": "function", "name": "f", "parameters": {}}]}, "tools", 400),
    ({"tool_choice": "required"}, "tool_choice", 400), ({"reasoning": {"effort": "high"}}, "reasoning", 400),
    ({"background": True}, "background", 400), ({"include": ["message.output_text.logprobs"]}, "include", 400),
    ({"truncation": "auto"}, "truncation", 400), ({"conversation": "conv_1"}, "conversation", 400),
    ({"top_logprobs": 2}, "top_logprobs", 400), ({"prompt": {"id": "pmpt_1"}}, "prompt", 400),
    ({"seed": "1"}, "seed", 400), ({"no_repeat_ngram_size": -1}, "no_repeat_ngram_size", 400),
    ({"unknown_field": 1}, "unknown_field", 400), ({"max_output_tokens": 0}, "max_output_tokens", 400),
    ({"max_output_tokens": 100_000}, "max_output_tokens", 400), ({"temperature": 3}, "temperature", 400),
    ({"input": [{"role": "robot", "content": "x"}]}, "input", 400), ({"input": []}, "input", 400),
    ({"input": "x", "previous_response_id": ""}, "previous_response_id", 400),
    ({"text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": "nonsense"}}}}, "text", 400),
    ({"input": " x" * 2000}, "input", 400), ({"model": "gpt-4o"}, "model", 404),
])
def test_what_is_not_served_is_an_error_naming_the_field(http, body, param, status):
    r = http.post("/v1/responses", json={"input": GREETING, "max_output_tokens": 2, **body})
    assert r.status_code == status and r.json()["error"]["param"] == param, r.text


def test_stream_options_is_accepted_and_a_server_without_a_template_names_the_input(http, export_dir):
    """stream_options (OpenAI's include_obfuscation) is answered, not read as the completions body's; without a chat
    template the 400 names input, as chat's names messages."""
    r = http.post("/v1/responses", json={"input": GREETING, "max_output_tokens": 2, "stream": True,
                                         "stream_options": {"include_obfuscation": False}})
    assert r.status_code == 200 and "event: response.incomplete" in r.text, r.text  # cut off by max_output_tokens
    bare = local_service(export_dir, MODEL, batch=1)
    try:
        with TestClient(local_app(bare)) as c:
            r = c.post("/v1/responses", json={"input": GREETING, "max_output_tokens": 2})
    finally:
        bare.close()
    error = r.json()["error"]
    assert r.status_code == 400 and (error["param"], error["code"]) == ("input", "chat_template_missing"), r.text


@pytest.mark.parametrize("item,named", [
    ({"type": "function_call_output", "call_id": "c", "output": "x"}, "function_call_output"),
    ({"role": "user", "content": [{"type": "input_image", "image_url": "http://x"}]}, "input_image"),
    ({"role": "user", "content": [{"type": "output_text", "text": "x"}]}, "output_text"),
])
def test_input_items_not_served_are_400_naming_their_type(http, item, named):
    r = http.post("/v1/responses", json={"input": [item]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "input" and named in r.json()["error"]["message"], r.text


def test_tools_refused_through_the_client(client):
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(model=MODEL, input=GREETING, tools=[{"type": "function", "name": "f", "parameters": {}}])
    assert e.value.body["param"] == "tools"


def without_usage(body: dict) -> dict:
    """The body with a null usage: the SDK's newest usage type also requires input_tokens_details.cache_write_tokens,
    which gpt2x does not count (the SDK itself builds its objects unvalidated, and reads ours)."""
    if "response" in body:
        return {**body, "response": without_usage(body["response"])}
    return {**body, "usage": None} if "usage" in body else body


def test_openapi_and_the_sdk_types_describe_the_answers(service):
    """/openapi.json's route names its request, response and event schemas; a whole answer and each streamed event
    validate against them, and against the openai SDK's own types (validated, not constructed)."""
    from openai.types.responses import Response, ResponseStreamEvent
    from pydantic import TypeAdapter

    with TestClient(local_app(service)) as c:
        doc = c.get("/openapi.json").json()
        op = doc["paths"]["/v1/responses"]["post"]
        assert op["requestBody"]["content"]["application/json"]["schema"]["$ref"].endswith("/ResponsesRequest")
        assert op["responses"]["200"]["content"]["application/json"]["schema"]["$ref"].endswith("/Response")

        def check(instance, name):
            jsonschema.validate(instance, {"$ref": f"#/components/schemas/{name}", "components": doc["components"]})

        body = {"input": GREETING, "max_output_tokens": 3, "metadata": {"act": "1"}, "user": "u"}
        check(body, "ResponsesRequest")
        whole = c.post("/v1/responses", json=body).json()
        check(whole, "Response")
        Response.model_validate(without_usage(whole))
        assert "output_text" not in whole and whole["metadata"] == {"act": "1"} and whole["user"] == "u"
        with c.stream("POST", "/v1/responses", json={**body, "stream": True}) as s:
            lines = [line for line in s.iter_lines() if line]
    assert all(line.startswith(("event: ", "data: ")) for line in lines) and "data: [DONE]" not in lines
    pairs = list(zip(lines[::2], lines[1::2]))
    events = doc["components"]["schemas"]
    for event_line, data_line in pairs:
        data = json.loads(data_line[len("data: "):])
        assert event_line == f"event: {data['type']}"
        jsonschema.validate(data, {"anyOf": [{"$ref": f"#/components/schemas/{name}"} for name in events
                                             if name.startswith("Response") and name.endswith("Event")],
                                   "components": doc["components"]})
        TypeAdapter(ResponseStreamEvent).validate_python(without_usage(data))


def test_metrics_count_responses(http):
    """/metrics counts a responses request as any other: its input and output tokens and its finish, whole and
    streamed."""
    from prometheus_client.parser import text_string_to_metric_families

    def counters() -> dict:
        found = {}
        for family in text_string_to_metric_families(http.get("/metrics").text):
            for sample in family.samples:
                if sample.name in ("vllm:prompt_tokens_total", "vllm:generation_tokens_total"):
                    found[sample.name] = sample.value
                elif sample.name == "vllm:request_success_total" and sample.labels.get("finished_reason") == "length":
                    found["length"] = sample.value
        return found

    before = counters()
    body = {"input": GREETING, "max_output_tokens": 3, "temperature": 0}
    whole = http.post("/v1/responses", json=body).json()
    with http.stream("POST", "/v1/responses", json={**body, "stream": True}) as s:
        assert s.status_code == 200 and "event: response.incomplete" in list(s.iter_lines())
    after = counters()
    assert after["vllm:prompt_tokens_total"] - before["vllm:prompt_tokens_total"] == 2 * whole["usage"]["input_tokens"]
    assert after["vllm:generation_tokens_total"] - before["vllm:generation_tokens_total"] == 2 * 3
    assert after["length"] - before["length"] == 2


def test_vllms_sampling_fields_and_the_repetition_controls_are_honoured(client, reference):
    """vLLM's sampling fields beyond OpenAI's (the repetition controls among them, seed and stop) reach the answer: the
    text is gpt2x's generation of the hand-rendered prompt with the same settings, and not plain greedy's."""
    controls = dict(no_repeat_ngram_size=2, repetition_penalty=1.3, bad_words=["the"])
    plain = greedy(reference, PROMPT, 24)
    want = generate(reference, [PROMPT], SamplingSettings(greedy=True, max_new_tokens=24, **controls))[0]
    assert want.tokens != plain.tokens  # the controls change this answer: a field ignored would show
    got = client.responses.create(model=MODEL, input=GREETING, max_output_tokens=24, temperature=0, extra_body=controls)
    assert got.output_text == decode(want.tokens)
    seeded = dict(top_k=5, seed=11, stop=["\n\n\n\n"])
    want = generate(reference, [PROMPT], SamplingSettings(max_new_tokens=12, top_k=5, seed=11))[0]
    got = client.responses.create(model=MODEL, input=GREETING, max_output_tokens=12, extra_body=seeded)
    assert got.output_text == decode(want.tokens)
