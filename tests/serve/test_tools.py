"""Chat's tool calls (tool_choice a named function, or required): through OpenAI's client, whole and streamed, each
call's arguments valid against its tool's parameters (jsonschema), and the same text as the structured output the
call stands for (response_format with the same schema, or vLLM's list of name and parameters written out here); the
tools reach the chat template; what is not served is one 400 naming its field."""

from __future__ import annotations

import json

import jsonschema
import pytest

from gpt2x.onnx.interop import DEFAULT_CHAT_TEMPLATE
from gpt2x.serve.openai.chat_completion.protocol import ChatCompletionRequest
from gpt2x.serve.openai.chat_completion.serving import render_prompt
from gpt2x.serve.openai.chat_completion.template import ChatTemplate

from ..helpers import local_service

WEATHER = {"type": "object", "properties": {"city": {"enum": ["Paris", "Rome", "Verona"]}, "unit": {"enum": ["c", "f"]}},
           "required": ["city", "unit"], "additionalProperties": False}
ADD = {"type": "object", "properties": {"a": {"enum": [1, 2, 3]}, "b": {"type": "boolean"}}, "required": ["a", "b"],
       "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "The weather in a city", "parameters": WEATHER}},
         {"type": "function", "function": {"name": "add", "parameters": ADD}}]
SCHEMAS = {"get_weather": WEATHER, "add": ADD}
MESSAGES = [{"role": "user", "content": "What is the weather in Verona?"}]
NAMED = {"type": "function", "function": {"name": "get_weather"}}


@pytest.fixture(scope="module")
def service(export_dir):
    s = local_service(export_dir, chat_template=ChatTemplate(DEFAULT_CHAT_TEMPLATE, "test"))
    yield s
    s.close()



def _stream_calls(chunks) -> tuple[dict[int, dict], dict[int, str]]:
    """Each choice's calls as a client puts them together from the deltas (by index), and its finish reason."""
    calls: dict[int, dict] = {}
    reasons: dict[int, str] = {}
    for chunk in chunks:
        for choice in chunk.choices:
            for piece in choice.delta.tool_calls or ():
                call = calls.setdefault(choice.index, {}).setdefault(piece.index, {"id": None, "name": None, "arguments": ""})
                call["id"] = piece.id or call["id"]
                call["name"] = piece.function.name or call["name"]
                call["arguments"] += piece.function.arguments or ""
            assert choice.delta.content is None, choice  # the calls only
            if choice.finish_reason:
                reasons[choice.index] = choice.finish_reason
    return calls, reasons


def test_a_named_function_is_called_with_arguments_valid_against_its_parameters(openai_client):
    whole = openai_client.chat.completions.create(model="shakespeare", messages=MESSAGES, tools=TOOLS, tool_choice=NAMED, n=3,
                                       seed=5, temperature=1.0, max_tokens=60)
    for choice in whole.choices:
        assert choice.finish_reason == "stop" and choice.message.content is None  # OpenAI's, where the call is forced
        (call,) = choice.message.tool_calls
        assert call.type == "function" and call.function.name == "get_weather" and call.id.startswith("call_")
        jsonschema.validate(json.loads(call.function.arguments), WEATHER)
    # the arguments are the structured output the call stands for: the same seed, the same text
    plain = openai_client.chat.completions.create(model="shakespeare", messages=MESSAGES, n=3, seed=5, temperature=1.0, max_tokens=60,
                                       extra_body={"tools": TOOLS, "tool_choice": "none"},
                                       response_format={"type": "json_schema", "json_schema": {"name": "w", "schema": WEATHER}})
    assert [c.message.tool_calls[0].function.arguments for c in whole.choices] == [c.message.content for c in plain.choices]
    streamed = openai_client.chat.completions.create(model="shakespeare", messages=MESSAGES, tools=TOOLS, tool_choice=NAMED, n=3,
                                          seed=5, temperature=1.0, max_tokens=60, stream=True)
    calls, reasons = _stream_calls(streamed)
    assert reasons == {0: "stop", 1: "stop", 2: "stop"}
    assert [calls[i][0]["arguments"] for i in range(3)] == [c.message.content for c in plain.choices]
    assert all(calls[i][0]["name"] == "get_weather" and calls[i][0]["id"].startswith("call_") for i in range(3))


def test_required_calls_any_tool_as_vllms_list_of_name_and_parameters(openai_client):
    kwargs = {"model": "shakespeare", "messages": MESSAGES, "n": 4, "seed": 11, "temperature": 1.0, "max_tokens": 80}
    whole = openai_client.chat.completions.create(**kwargs, tools=TOOLS, tool_choice="required", parallel_tool_calls=False)
    for choice in whole.choices:
        assert choice.finish_reason == "tool_calls" and choice.message.content is None
        (call,) = choice.message.tool_calls  # parallel_tool_calls false: one
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])
    # vLLM's schema for required, written out: a list of one item, each a tool's name and its arguments
    listed = {"type": "array", "minItems": 1, "maxItems": 1, "items": {"anyOf": [
        {"type": "object", "properties": {"name": {"const": name}, "parameters": schema}, "required": ["name", "parameters"],
         "additionalProperties": False} for name, schema in SCHEMAS.items()]}}
    plain = openai_client.chat.completions.create(**kwargs, response_format={"type": "json_schema", "json_schema": {"name": "l", "schema": listed}})
    want = [json.loads(c.message.content) for c in plain.choices]
    got = [[{"name": t.function.name, "parameters": json.loads(t.function.arguments)} for t in c.message.tool_calls]
           for c in whole.choices]
    assert got == want
    calls, reasons = _stream_calls(openai_client.chat.completions.create(**kwargs, tools=TOOLS, tool_choice="required",
                                                              parallel_tool_calls=False, stream=True))
    assert reasons == {i: "tool_calls" for i in range(4)}
    assert [[{"name": c["name"], "parameters": json.loads(c["arguments"])} for c in calls[i].values()] for i in range(4)] == want


def test_a_list_cut_short_before_one_call_is_complete_is_left_as_its_text(openai_client):
    whole = openai_client.chat.completions.create(model="shakespeare", messages=MESSAGES, tools=TOOLS, tool_choice="required",
                                       max_tokens=4, seed=1)
    choice = whole.choices[0]
    assert choice.finish_reason == "length" and choice.message.tool_calls is None
    assert choice.message.content.startswith("[")  # the list begun, not yet a call
    with pytest.raises(json.JSONDecodeError):
        json.loads(choice.message.content)


def test_the_tools_reach_the_chat_template_and_tool_messages_are_rendered():
    template = ChatTemplate("{% for t in tools %}{{ t.function.name }};{% endfor %}"
                            "{% for m in messages %}{{ m.role }}={{ m.content }}|{% endfor %}", "test")
    turns = [*MESSAGES, {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "rain"}]
    request = ChatCompletionRequest.model_validate({"messages": turns, "tools": TOOLS, "tool_choice": "none"})
    assert render_prompt(request, template) == "get_weather;add;user=What is the weather in Verona?|assistant=|tool=rain|"


@pytest.mark.parametrize("body,param,fragment", [
    ({"tools": TOOLS, "tool_choice": "auto"}, "tool_choice", "tool_choice auto"),
    ({"tools": TOOLS}, "tools", "auto, OpenAI's default"),
    ({"tool_choice": "required"}, "tool_choice", "no tools were sent"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice", "'nope'"),
    ({"tools": [TOOLS[0], TOOLS[0]], "tool_choice": "required"}, "tools", "same name"),
    ({"tools": TOOLS, "tool_choice": NAMED, "echo": True}, "echo", "tool calls"),
    ({"tools": TOOLS, "tool_choice": NAMED, "response_format": {"type": "json_object"}}, "tool_choice", "send one"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "nonsense"}}}],
      "tool_choice": "required"}, "tools", "tools"),
    ({"tools": [{"type": "function", "function": {"name": "no spaces"}}], "tool_choice": "required"}, "tools", "tools"),
    ({"functions": [{"name": "f"}]}, "functions", "send tools"),
])
def test_what_is_not_served_is_one_400_naming_its_field(client, body, param, fragment):
    r = client.post("/v1/chat/completions", json={"messages": MESSAGES, **body})
    error = r.json()["error"]
    assert r.status_code == 400 and error["param"] == param and fragment in error["message"], r.text


def test_a_tools_definitions_are_found_by_its_references_in_the_required_list(openai_client):
    pick = {"$defs": {"Colour": {"enum": ["red", "blue"]}}, "type": "object", "properties": {"c": {"$ref": "#/$defs/Colour"}},
            "required": ["c"], "additionalProperties": False}
    tools = [{"type": "function", "function": {"name": "pick", "parameters": pick}}]
    whole = openai_client.chat.completions.create(model="shakespeare", messages=MESSAGES, tools=tools, tool_choice="required",
                                       parallel_tool_calls=False, n=4, seed=3, temperature=1.0, max_tokens=60)
    for choice in whole.choices:
        (call,) = choice.message.tool_calls
        assert call.function.name == "pick"
        jsonschema.validate(json.loads(call.function.arguments), pick)


def test_required_calls_stream_as_each_completes_and_a_cut_list_keeps_its_complete_calls(openai_client):
    """Without parallel_tool_calls false the list runs on until the model closes it or the length cuts it: the calls
    before a cut are the answer's (finish_reason length), streamed each as soon as its item is complete."""
    kwargs = {"model": "shakespeare", "messages": MESSAGES, "tools": TOOLS, "tool_choice": "required", "n": 3, "seed": 4,
              "temperature": 1.0, "max_tokens": 70}
    whole = openai_client.chat.completions.create(**kwargs)
    want = [[(t.function.name, json.loads(t.function.arguments)) for t in c.message.tool_calls or ()] for c in whole.choices]
    assert sum(len(calls) for calls in want) >= 4, want  # several calls, to stream one by one
    for calls in want:
        for name, arguments in calls:
            jsonschema.validate(arguments, SCHEMAS[name])
    chunks = list(openai_client.chat.completions.create(**kwargs, stream=True))
    calls, reasons = _stream_calls(chunks)
    assert reasons == {c.index: c.finish_reason for c in whole.choices}
    assert [[(c["name"], json.loads(c["arguments"])) for c in calls.get(i, {}).values()] for i in range(3)] == want
    for i, listed in enumerate(want):  # the first call came before the choice's last chunk
        at = [k for k, chunk in enumerate(chunks) for c in chunk.choices if c.index == i and c.delta.tool_calls]
        end = next(k for k, chunk in enumerate(chunks) for c in chunk.choices if c.index == i and c.finish_reason)
        assert len(listed) < 2 or at[0] < end, (i, at, end)
