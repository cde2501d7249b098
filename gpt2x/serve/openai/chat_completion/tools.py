"""Chat's tool calls, as vLLM makes them without a tool parser: where tool_choice asks for a call, the answer is kept
to the tools' JSON while it is generated (structured output), then read as the calls. A named function: the answer is
its arguments, kept to its parameters' schema. `required`: the answer is a JSON list of `{"name", "parameters"}`, one
item or more, each kept to one tool's schema (vLLM's shape). `auto` would need the calls read out of free text, which
GPT-2 was not trained to write: it is refused, as vLLM refuses it without a tool parser."""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass
from typing import Any

from ..errors import bad
from ..pending import ChoiceEvent
from ..sampling import json_schema_constraint
from .protocol import (
    ChatChunkChoice,
    ChatCompletionRequest,
    ChatDelta,
    ChatLogprobs,
    ChatTokenLogprob,
    DeltaFunctionCall,
    DeltaToolCall,
    FunctionCall,
    FunctionDefinition,
    NamedToolChoice,
    ToolCall,
)

ANY_ARGUMENTS = {"type": "object"}  # a function sent without parameters takes any JSON object


@dataclass(frozen=True)
class ToolPlan:
    """What a request's tool_choice asks of every choice: one call of `named`, its arguments kept to `schema`; or
    (`named` None) one call or more, the answer a list that `schema` describes."""

    schema: dict[str, Any]
    named: str | None

    def constraint(self):
        return json_schema_constraint(self.schema, "tools"), "tool_choice"

    def calls(self, text: str) -> list[ToolCall] | None:
        """The answer's calls: a named function's arguments as generated (cut short by the length, as OpenAI's are),
        or the required list's complete items (those before a cut); None where not one item is complete."""
        if self.named is not None:
            return [ToolCall(id=call_id(), function=FunctionCall(name=self.named, arguments=text))]
        items, _ = listed_items(text, 0)
        return [as_call(item) for item in items] or None

    def finish_reason(self, reason: str | None) -> str | None:
        """OpenAI's: `tool_calls` where the model chose to call (required), `stop` where the call was forced (named)."""
        return "tool_calls" if self.named is None and reason == "stop" else reason


class ToolDeltas:
    """A stream's tool calls, choice by choice: a named function's arguments as they come (the call's id and name in
    the choice's first chunk); with tool_choice required, each call whole as soon as its item of the list is complete
    (a piece of an item is no call yet), with the logprobs and token ids of the tokens since the last chunk."""

    def __init__(self, plan: ToolPlan, choices: int):
        self.plan = plan
        self.ids = [call_id() for _ in range(choices)]
        self.texts = [""] * choices
        self.parsed = [0] * choices  # where each choice's list was read up to
        self.sent = [0] * choices  # each choice's calls streamed so far
        self.logprobs: list[list[ChatTokenLogprob] | None] = [None] * choices
        self.token_ids: list[list[int] | None] = [None] * choices

    def first(self, index: int) -> ChatChunkChoice:
        """The choice's first chunk: the role (and a named function's call, its arguments to come)."""
        named = self.plan.named
        calls = None if named is None else [DeltaToolCall(index=0, id=self.ids[index], type="function",
                                                          function=DeltaFunctionCall(name=named, arguments=""))]
        return ChatChunkChoice(index=index, delta=ChatDelta(role="assistant", content=None, tool_calls=calls))

    def of(self, event: ChoiceEvent) -> list[ChatChunkChoice]:
        """The event's piece of its choice's calls (none while a required list is incomplete)."""
        token_ids = event.extra.get("token_ids")
        if self.plan.named is not None:
            piece = [DeltaToolCall(index=0, function=DeltaFunctionCall(arguments=event.text))]
            return [ChatChunkChoice(index=event.index, delta=ChatDelta(content=None, tool_calls=piece),
                                    finish_reason=event.finish_reason, logprobs=event.logprobs, token_ids=token_ids)]
        i = event.index
        self.texts[i] += event.text
        if event.logprobs is not None:
            self.logprobs[i] = (self.logprobs[i] or []) + list(event.logprobs.content or ())
        if token_ids is not None:
            self.token_ids[i] = (self.token_ids[i] or []) + token_ids
        items, self.parsed[i] = listed_items(self.texts[i], self.parsed[i])
        reason = event.finish_reason
        if not items and reason is None:
            return []  # held, with its logprobs and token ids, until a call is complete or the choice ends
        if reason is not None and not self.sent[i] and not items:  # not one call: the text, as the whole answer has
            delta = ChatDelta(content=self.texts[i])
        else:
            calls = [as_call(item) for item in items]
            delta = ChatDelta(content=None, tool_calls=[
                DeltaToolCall(index=self.sent[i] + j, id=c.id, type="function",
                              function=DeltaFunctionCall(name=c.function.name, arguments=c.function.arguments))
                for j, c in enumerate(calls)] or None)
            self.sent[i] += len(calls)
            reason = reason if reason is None else self.plan.finish_reason(reason)
        logprobs = None if self.logprobs[i] is None else ChatLogprobs(content=self.logprobs[i])
        token_ids, self.logprobs[i], self.token_ids[i] = self.token_ids[i], None, None
        return [ChatChunkChoice(index=i, delta=delta, finish_reason=reason, logprobs=logprobs, token_ids=token_ids)]


def as_call(item: dict[str, Any]) -> ToolCall:
    """One item of the required list (`{"name", "parameters"}`) as a call."""
    arguments = json.dumps(item["parameters"], ensure_ascii=False)
    return ToolCall(id=call_id(), function=FunctionCall(name=item["name"], arguments=arguments))


_DECODER = json.JSONDecoder()


def listed_items(text: str, at: int) -> tuple[list[dict[str, Any]], int]:
    """The complete items of a JSON list being generated, from offset `at` (0: the list's start, else where an
    earlier call stopped), and the offset after the last of them: the constraint writes the list, so each item is an
    object and a failed decode is one not yet complete."""
    items: list[dict[str, Any]] = []
    if at == 0:
        at = text.find("[") + 1
        if at == 0:
            return items, 0
    while True:
        while at < len(text) and text[at] in " \t\r\n,":
            at += 1
        if at >= len(text) or text[at] == "]":
            return items, at
        try:
            item, end = _DECODER.raw_decode(text, at)
        except json.JSONDecodeError:
            return items, at
        items.append(item)
        at = end


def call_id() -> str:
    return "call_" + uuid.uuid4().hex[:24]


def tool_plan(p: ChatCompletionRequest) -> ToolPlan | None:
    """The calls the request asks for, None for a text answer (tool_choice none, or no tools); a 400 naming the field
    for what is not served."""
    tools = [t.function for t in p.tools or ()]
    choice = p.tool_choice if p.tool_choice is not None else ("auto" if tools else "none")  # OpenAI's default
    if choice == "none":
        return None
    names = [f.name for f in tools]
    if len(set(names)) < len(names):
        raise bad("tools: two tools have the same name", "tools")
    if isinstance(choice, NamedToolChoice):
        named = next((f for f in tools if f.name == choice.function.name), None)
        if named is None:
            raise bad(f"tool_choice names the function '{choice.function.name}', which is not among the tools "
                      f"({', '.join(names) or 'none were sent'})", "tool_choice")
        return ToolPlan(named.parameters or ANY_ARGUMENTS, named.name)
    if not tools:
        raise bad(f"tool_choice is {choice}, and no tools were sent", "tool_choice")
    if choice == "auto":  # named by the field sent: tools alone ask for auto (OpenAI's default)
        given = "tool_choice auto" if p.tool_choice is not None else "tools without tool_choice (auto, OpenAI's default)"
        raise bad(f"{given}: calls read out of free text are not served (GPT-2 was not trained to write them); send "
                  "tool_choice required, or a named function, and the answer is kept to the tools' JSON",
                  "tool_choice" if p.tool_choice is not None else "tools")
    return ToolPlan(_any_of(tools, one=p.parallel_tool_calls is False), None)


def _any_of(tools: list[FunctionDefinition], one: bool) -> dict[str, Any]:
    """vLLM's schema for tool_choice required: a list of calls, each `{"name": one tool's, "parameters": its
    arguments}`. Each tool's `$defs` move to the top, where their `#/$defs/...` references find them."""
    defs: dict[str, Any] = {}
    items = []
    for f in tools:
        parameters = dict(f.parameters or ANY_ARGUMENTS)
        for name, schema in parameters.pop("$defs", {}).items():
            if defs.setdefault(name, schema) != schema:
                raise bad(f"tools: two tools define '$defs/{name}' differently", "tools")
        items.append({"type": "object", "properties": {"name": {"const": f.name}, "parameters": parameters},
                      "required": ["name", "parameters"], "additionalProperties": False})
    schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": items}}
    if one:
        schema["maxItems"] = 1
    if defs:
        schema["$defs"] = defs
    return schema
