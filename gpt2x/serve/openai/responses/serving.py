"""OpenAI's Responses API (`POST /v1/responses`), as vLLM's entrypoints/openai/responses serve it: the request's
instructions (a system message first), the conversation of the response it continues (previous_response_id) and its
input are rendered by the chat template to one prompt, which is served as a completions request is
(completion.serving.serve, on the request itself, whose fields the completions body names alike; n always 1); the
answer is one assistant message, whole (a `response` object) or streamed as OpenAI's typed events.

The conversations of the last MAX_STORED responses kept (`store`, true by default) live in this replica's memory
(`ResponseStore`): under Ray Serve, a previous_response_id is found only on the replica that answered it.
"""

from __future__ import annotations

import itertools
import threading
import uuid
from collections import OrderedDict
from collections.abc import AsyncIterator, Callable
from contextlib import aclosing
from dataclasses import dataclass

from pydantic import ValidationError

from ....generation.settings import SamplingSettings
from .. import render
from ..chat_completion.template import no_template
from ..completion.serving import serve
from ..errors import APIError, bad, json_object, validation_error
from ..pending import Pending, ServedRequest
from ..protocol import Usage
from ..service import CompletionService
from . import protocol as p
from .protocol import MAX_STORED

# The fields a completions or chat error may name, as the Responses request names them.
_PARAMS = {"messages": "input", "prompt": "input", "max_tokens": "max_output_tokens", "response_format": "text"}


class ResponseStore:
    """The conversations of the last `size` stored responses by id (each its input messages, the earlier ones it
    continued included, and its output), the oldest dropped first. Read on the request's worker thread (the
    prepare), written on the event loop: one lock."""

    def __init__(self, size: int = MAX_STORED):
        self.size = size
        self._items: OrderedDict[str, tuple[dict, ...]] = OrderedDict()
        self._lock = threading.Lock()

    def get(self, response_id: str) -> tuple[dict, ...] | None:
        with self._lock:
            return self._items.get(response_id)

    def put(self, response_id: str, conversation: tuple[dict, ...]) -> None:
        with self._lock:
            self._items[response_id] = conversation
            while len(self._items) > self.size:
                self._items.popitem(last=False)

    def __len__(self) -> int:
        with self._lock:
            return len(self._items)


@dataclass(frozen=True)
class ResponseCall:
    """A Responses request as it is served, and what its answer echoes and keeps."""

    req: ServedRequest
    params: p.ResponsesRequest
    conversation: tuple[dict, ...]  # the input messages, the earlier conversation's first (not the instructions)
    id: str  # resp_...
    message_id: str  # msg_..., the output message's

    @property
    def store(self) -> bool:
        return self.params.store is not False


@dataclass(frozen=True, slots=True)
class ResponseEvent(render.StreamEvent):
    """One event of a Responses stream, rendered as OpenAI's: `event: TYPE` and `data: JSON`. Its last, after an
    error event, has no body and renders as nothing: the Responses stream has no `[DONE]`."""

    def render(self) -> str:
        if self.body is None:
            return ""
        return f"event: {self.body.type}\ndata: {render.to_json(self.body)}\n\n"


class ResponsesAPI:
    """A replica's Responses API over its service (its chat path), with the store its responses are kept in."""

    def __init__(self, service: CompletionService, store: ResponseStore | None = None):
        self.service = service
        self.store = store if store is not None else ResponseStore()

    def parse(self, raw: bytes) -> ResponseCall:
        """A raw body as it is served (the routes have FastAPI validate theirs: `prepare`)."""
        try:
            params = p.ResponsesRequest.model_validate(json_object(raw))
        except ValidationError as e:
            raise validation_error(e.errors(include_url=False)) from None
        return self.prepare(params)

    def prepare(self, params: p.ResponsesRequest) -> ResponseCall:
        """The request as it is served: every field checked (a 400 naming the one at fault, a 404 for another model or a
        previous_response_id not stored), the conversation rendered by the chat template."""
        _refuse(params)
        n_positions = self.service.backend.n_positions
        if params.max_output_tokens is not None and params.max_output_tokens > n_positions:
            raise bad(f"max_output_tokens must be between 1 and the model's context ({n_positions}), got "
                      f"{params.max_output_tokens}", "max_output_tokens")
        earlier: tuple[dict, ...] = ()
        if params.previous_response_id is not None:
            found = self.store.get(params.previous_response_id)
            if found is None:
                raise APIError(404, f"no response {params.previous_response_id[:100]!r} is stored on this server (it "
                               f"keeps the last {self.store.size} with store: true)", "not_found_error",
                               param="previous_response_id", code="previous_response_not_found")
            earlier = found
        conversation = (*earlier, *_messages(params.input))
        system = ({"role": "system", "content": params.instructions},) if params.instructions is not None else ()
        if not system and not conversation:
            raise bad("input is empty: send a text, or messages", "input")
        template = self.service.chat_template
        try:
            if template is None:
                raise no_template()
            prompt = template.render([{"role": m["role"], "content": _text(m["content"])} for m in (*system, *conversation)],
                                     True, {})
            req = serve(params, [(prompt, None)], params.max_output_tokens, self.service.served)
        except APIError as e:
            raise _renamed(e) from None
        hex_id = req.id.removeprefix("cmpl-")
        return ResponseCall(req, params, conversation, "resp_" + hex_id, "msg_" + uuid.uuid4().hex)

    async def complete(self, call: ResponseCall, pending: Pending) -> p.Response:
        """The whole response, kept in the store (with `store`) once it is done."""
        parts: list[str] = []
        async with aclosing(pending.events()) as events:
            async for event in events:
                parts.append(event.text)
        text = "".join(parts)
        self._keep(call, text)
        return self.response(call, _status(pending), text, pending.usage())

    async def stream(self, call: ResponseCall, pending: Pending) -> AsyncIterator[render.StreamEvent]:
        """OpenAI's events: response.created and .in_progress, the message's output item and its text part added,
        a delta per released piece of text, the text, part and item done, then response.completed (or .incomplete),
        with the usage. A failure once begun is an `error` event, the stream's last."""
        numbers = itertools.count()

        def event(model: Callable[..., p.ResponseStreamEvent], reasons: tuple[str, ...] = (),
                  kind: render.StreamKind = render.StreamKind.chunk, **fields) -> ResponseEvent:
            return ResponseEvent(model(sequence_number=next(numbers), **fields), reasons, kind)

        where = dict(item_id=call.message_id, output_index=0, content_index=0)
        started = self.response(call, "in_progress")
        yield event(p.ResponseLifecycleEvent, type="response.created", response=started)
        yield event(p.ResponseLifecycleEvent, type="response.in_progress", response=started)
        yield event(p.ResponseOutputItemEvent, type="response.output_item.added", output_index=0,
                    item=p.ResponseOutputMessage(id=call.message_id, status="in_progress", content=[]))
        yield event(p.ResponseContentPartEvent, type="response.content_part.added", part=p.ResponseOutputText(text=""),
                    **where)
        parts: list[str] = []
        try:
            async with aclosing(pending.events()) as events:
                async for piece in events:
                    if piece.text:  # the last piece may carry only the end
                        parts.append(piece.text)
                        yield event(p.ResponseTextDeltaEvent, delta=piece.text, **where)
        except APIError as e:  # the status line is sent already: the error is the last event
            yield event(p.ResponseErrorEvent, kind=render.StreamKind.error, code=e.code or e.type, message=e.message,
                        param=e.param)
            yield ResponseEvent(None, kind=render.StreamKind.done)
            return
        text = "".join(parts)
        status = _status(pending)
        part = p.ResponseOutputText(text=text)
        reason = pending.reasons[0] or "stop"
        yield event(p.ResponseTextDoneEvent, (reason,), text=text, **where)  # the choice's end, timed for the metrics
        yield event(p.ResponseContentPartEvent, type="response.content_part.done", part=part, **where)
        yield event(p.ResponseOutputItemEvent, type="response.output_item.done", output_index=0,
                    item=p.ResponseOutputMessage(id=call.message_id, status=status, content=[part]))
        self._keep(call, text)
        done = self.response(call, status, text, pending.usage())
        yield event(p.ResponseLifecycleEvent, kind=render.StreamKind.done, type=f"response.{status}", response=done)

    def response(self, call: ResponseCall, status: str, text: str | None = None,
                 usage: Usage | None = None) -> p.Response:
        """The `response` object: in progress (no output, no usage yet), or done with its text and usage."""
        params = call.params
        output = [] if text is None else [p.ResponseOutputMessage(id=call.message_id, status=status,
                                                                 content=[p.ResponseOutputText(text=text)])]
        incomplete = p.ResponseIncompleteDetails(reason="max_output_tokens") if status == "incomplete" else None
        return p.Response(
            id=call.id, created_at=call.req.created, status=status, incomplete_details=incomplete,
            instructions=params.instructions, max_output_tokens=params.max_output_tokens, metadata=params.metadata or {},
            model=call.req.model, output=output, parallel_tool_calls=params.parallel_tool_calls is not False,
            previous_response_id=params.previous_response_id, store=call.store,
            temperature=SamplingSettings.temperature if params.temperature is None else params.temperature,
            top_p=SamplingSettings.top_p if params.top_p is None else params.top_p,
            text=params.text or p.ResponseTextConfig(), tool_choice=params.tool_choice or "auto",
            usage=None if usage is None else _usage(usage), user=params.user)

    def _keep(self, call: ResponseCall, text: str) -> None:
        if call.store:
            self.store.put(call.id, (*call.conversation, {"role": "assistant", "content": text}))


def _status(pending: Pending) -> str:
    """`incomplete` where the length ran out (max_output_tokens, or the context), as OpenAI's."""
    return "incomplete" if pending.reasons[0] == "length" else "completed"


def _usage(usage: Usage) -> p.ResponseUsage:
    return p.ResponseUsage(
        input_tokens=usage.prompt_tokens, output_tokens=usage.completion_tokens, total_tokens=usage.total_tokens,
        input_tokens_details=p.ResponseInputTokensDetails(cached_tokens=usage.prompt_tokens_details.cached_tokens),
        output_tokens_details=p.ResponseOutputTokensDetails())


def _refuse(params: p.ResponsesRequest) -> None:
    """The fields that would change the answer and are not served: a 400 naming the field, never ignored."""
    if params.tools:
        raise bad("tools: tool calling is not served", "tools")
    if params.tool_choice not in (None, "none", "auto"):
        raise bad("tool_choice: only none or auto (no tools are served)", "tool_choice")
    reasoning = params.reasoning or {}
    if reasoning.get("effort") not in (None, "none") or any(reasoning.get(k) is not None for k in reasoning if k != "effort"):
        raise bad("reasoning: GPT-2 does not reason (no effort or summary is served)", "reasoning")
    if params.background:
        raise bad("background: responses are answered while the request is open (background mode is not served)",
                  "background")
    if params.include:
        raise bad(f"include: {str(params.include[0])[:60]!r} is not served (nothing is added to the output)", "include")
    if params.truncation not in (None, "disabled"):
        raise bad("truncation: only disabled (a conversation longer than the context is a 400)", "truncation")
    if params.top_logprobs:
        raise bad("top_logprobs: logprobs are not served on /v1/responses (send logprobs to /v1/chat/completions)",
                  "top_logprobs")
    if params.conversation is not None:
        raise bad("conversation: conversations are not served (continue one with previous_response_id)", "conversation")
    if params.prompt is not None:
        raise bad("prompt: stored prompt templates are not served (send instructions and input)", "prompt")


def _messages(given: str | list[p.ResponseInputMessage]) -> list[dict]:
    """The input as chat messages: a string a user's message; each message's text parts as chat's text parts."""
    if isinstance(given, str):
        return [{"role": "user", "content": given}]
    return [{"role": m.role, "content": m.content if isinstance(m.content, str)
             else [{"type": "text", "text": part.text} for part in m.content]} for m in given]


def _text(content: str | list[dict]) -> str:
    """A message's text: its text parts joined by a newline, as chat joins a message's parts (Message.text)."""
    return content if isinstance(content, str) else "\n".join(part["text"] for part in content)


def _renamed(e: APIError) -> APIError:
    """A chat error naming the Responses field at fault (input for messages, max_output_tokens, text)."""
    message = e.message
    if e.code == "context_length_exceeded":  # chat's advice names a completions field
        message = message.split(" (", 1)[0] + " (shorten the input, or continue from an earlier response)"
    return APIError(e.status, message, e.type, _PARAMS.get(e.param or "", e.param), e.code)
