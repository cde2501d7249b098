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
        """The answer's calls; None where a list was cut short (by the length) and does not parse."""
        if self.named is not None:  # the arguments as generated (cut short, as OpenAI's are at the length)
            return [ToolCall(id=call_id(), function=FunctionCall(name=self.named, arguments=text))]
        try:
            items = json.loads(text)
        except json.JSONDecodeError:
            return None
        return [ToolCall(id=call_id(), function=FunctionCall(
            name=item["name"], arguments=json.dumps(item["parameters"], ensure_ascii=False))) for item in items]

    def finish_reason(self, reason: str | None) -> str | None:
        """OpenAI's: `tool_calls` where the model chose to call (required), `stop` where the call was forced (named)."""
        return "tool_calls" if self.named is None and reason == "stop" else reason


class ToolDeltas:
    """A stream's tool calls, choice by choice: a named function's arguments as they come (the call's id and name in
    the choice's first chunk); with tool_choice required, each choice's calls whole in its last chunk (the list's
    pieces are no calls until it parses), with the logprobs and token ids of its tokens."""

    def __init__(self, plan: ToolPlan, choices: int):
        self.plan = plan
        self.ids = [call_id() for _ in range(choices)]
        self.texts: list[list[str]] = [[] for _ in range(choices)]
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
        self.texts[i].append(event.text)
        if event.logprobs is not None:
            self.logprobs[i] = (self.logprobs[i] or []) + list(event.logprobs.content or ())
        if token_ids is not None:
            self.token_ids[i] = (self.token_ids[i] or []) + token_ids
        if event.finish_reason is None:
            return []
        text = "".join(self.texts[i])
        calls = self.plan.calls(text)
        if calls is None:
            delta, reason = ChatDelta(content=text), event.finish_reason
        else:
            delta = ChatDelta(content=None, tool_calls=[
                DeltaToolCall(index=j, id=c.id, type="function",
                              function=DeltaFunctionCall(name=c.function.name, arguments=c.function.arguments))
                for j, c in enumerate(calls)])
            reason = self.plan.finish_reason(event.finish_reason)
        logprobs = None if self.logprobs[i] is None else ChatLogprobs(content=self.logprobs[i])
        return [ChatChunkChoice(index=i, delta=delta, finish_reason=reason, logprobs=logprobs, token_ids=self.token_ids[i])]


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
