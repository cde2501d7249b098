"""POST /v1/chat/completions served (vLLM's entrypoints/openai/chat_completion/serving.py): the conversation rendered
to one prompt by the chat template (template.py), then served as a completions request is (completion.serving.serve:
the same checks, sampling fields, `n`, stop strings and structured output), and answered in the chat shapes
(`chat.completion`, and `chat.completion.chunk` events whose first delta carries the role).

Chat logprobs are gathered in OpenAI's chat shape (ChatTokenLogprobs); vLLM's `echo` begins each choice's content with
the last message's, where that is the assistant's (`chat_echo`); vLLM's prompt_logprobs and return_token_ids are
answered in vLLM's chat shape (the rendered prompt's on the response, each choice's token ids on the choice); tools are
called where tool_choice asks for a call, the answer kept to the tools' JSON (tools.py)."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator
from typing import ClassVar

from ....tokenizer import get_encoding
from .. import render
from ..completion.serving import ServedModel, serve
from ..errors import bad
from ..pending import ChoiceEvent, Pending, ServedRequest, stream_events
from ..protocol import Usage
from ..sampling import refuse_unknown
from .protocol import (
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatDelta,
    ChatLogprobs,
    ChatMessage,
    ChatTokenLogprob,
    ChatTopLogprob,
)
from .template import ChatTemplate, no_template, render_messages
from .tools import ToolDeltas, tool_plan

# OpenAI's chat fields gpt2x does not serve: a 400 naming the field when given (other than null, [] or "none").
_REFUSED = {"functions": "functions are not served (send tools)",
            "function_call": "functions are not served (send tool_choice)",
            "documents": "documents are not served", "audio": "audio is not served",
            "prediction": "predicted outputs are not served", "web_search_options": "web search is not served",
            "chat_template": "a request's own chat_template is not served (the server's is used)"}
# OpenAI's chat fields accepted and not used (nothing they ask for changes GPT-2's answer): not logged as unknown.
_IGNORED = ("modalities", "reasoning_effort", "store", "metadata", "service_tier")
PROMPT_KEYS = ("prompt_token_ids", "prompt_logprobs")  # vLLM's keys for the rendered prompt: the response's on chat


def render_prompt(p: ChatCompletionRequest, template: ChatTemplate | None) -> str:
    """The conversation as the prompt the template makes of it (vLLM's `continue_final_message`: the last message
    left open), or the 400 naming the flags where the server has no template."""
    if template is None:
        raise no_template()
    tools = {"tools": [t.model_dump(exclude_none=True) for t in p.tools]} if p.tools else {}  # as vLLM hands them
    return render_messages(p.messages, template, bool(p.add_generation_prompt), bool(p.continue_final_message),
                           {**tools, **(p.chat_template_kwargs or {})})


def prepare(p: ChatCompletionRequest, served: ServedModel, template: ChatTemplate | None) -> ServedRequest:
    """The chat request as it is served: its prompt rendered, then served as a completions request is, with
    max_completion_tokens for max_tokens (by default, as many as the context leaves: vLLM's), its logprobs in chat's
    shape."""
    extra = p.model_extra or {}
    for name, why in _REFUSED.items():
        if extra.get(name) not in (None, [], "none"):
            raise bad(f"{name}: {why}", name)
    if p.top_logprobs is not None and not p.logprobs:
        raise bad("top_logprobs needs logprobs: true", "top_logprobs")
    if "prompt" in extra:
        raise bad("prompt is not a chat completions field (send messages)", "prompt")
    refuse_unknown(p, ignored=(*_REFUSED, *_IGNORED))
    plan = tool_plan(p)
    if plan is not None and p.echo:
        raise bad("echo is not served with tool calls (the answer is the calls)", "echo")
    prompt = render_prompt(p, template)
    max_tokens = p.max_tokens if p.max_completion_tokens is None else p.max_completion_tokens
    k = (p.top_logprobs or 0) if p.logprobs else None  # the most likely tokens listed per token
    return serve(p, [(prompt, None)], max_tokens, served, logprobs=k, logprobs_shape=ChatTokenLogprobs,
                 constraint=None if plan is None else plan.constraint())


def chat_echo(p: ChatCompletionRequest) -> str:
    """vLLM's chat echo: the text each choice's content begins with, the last message's where it is the assistant's
    (the role the answer is in), else none."""
    last = p.messages[-1]
    return last.text() if p.echo and last.role == "assistant" else ""


def chat_id(completion_id: str) -> str:
    return "chatcmpl-" + completion_id.removeprefix("cmpl-") if completion_id else "chatcmpl-" + uuid.uuid4().hex


def response(req: ServedRequest, texts: list[str], reasons: list[str | None], usage: Usage,
             logprobs: list[ChatLogprobs | None], extras: list[dict], prompt: dict) -> ChatCompletionResponse:
    """The whole chat completion; `extras`: each choice's vLLM keys (token_ids), `prompt`: the prompt's
    (prompt_token_ids, prompt_logprobs), where asked for. Where the request asks for tool calls, each choice's text
    is read as its calls (a list cut short by the length: the calls before the cut; not one: its text)."""
    plan = tool_plan(req.params)
    choices = []
    for i, (text, reason, lp, extra) in enumerate(zip(texts, reasons, logprobs, extras)):
        calls = None if plan is None else plan.calls(text)
        message = ChatMessage(content=text) if calls is None else ChatMessage(content=None, tool_calls=calls)
        reason = reason if calls is None else plan.finish_reason(reason)
        choices.append(ChatChoice(index=i, message=message, finish_reason=reason, logprobs=lp, **extra))
    return ChatCompletionResponse(id=chat_id(req.id), created=req.created, model=req.model, usage=usage, **prompt,
                                  choices=choices)


def chunk(req: ServedRequest, choices: list[ChatChunkChoice], usage: Usage | None = None,
          prompt: dict | None = None) -> ChatCompletionChunk:
    return ChatCompletionChunk(id=chat_id(req.id), created=req.created, model=req.model, choices=choices, usage=usage,
                               **(prompt or {}))


def delta(index: int, text: str, reason: str | None, first: bool, logprobs: ChatLogprobs | None = None,
          token_ids: list[int] | None = None) -> ChatChunkChoice:
    """One choice's piece of a stream: its role alone first (`first`), then its content (with its tokens' logprobs and,
    with return_token_ids, their ids)."""
    return ChatChunkChoice(index=index, delta=ChatDelta(role="assistant" if first else None, content=text),
                           finish_reason=reason, logprobs=logprobs, token_ids=token_ids)


async def complete(pending: Pending) -> ChatCompletionResponse:
    """The whole chat response (`chat.completion`), with vLLM's token ids and prompt logprobs where asked for: the
    choices' ids on each choice, the rendered prompt's on the response."""
    req = pending.req
    texts: list[list[str]] = [[] for _ in range(req.choices)]
    extras: list[dict] = [{} for _ in range(req.choices)]
    prompt: dict = {}
    async for event in pending.events():
        texts[event.index].append(event.text)
        for key, value in event.extra.items():  # the prompt's keys once (one prompt on chat); token_ids add up
            if key in PROMPT_KEYS:
                prompt.setdefault(key, value)
            else:
                extras[event.index][key] = extras[event.index].get(key, []) + value
    logprobs = [None if lp is None else lp.whole() for lp in pending.logprobs]
    echo = chat_echo(req.params)
    return response(req, [echo + "".join(t) for t in texts], pending.reasons, pending.usage(), logprobs, extras, prompt)


async def stream(pending: Pending) -> AsyncIterator[render.StreamEvent]:
    """Chat's stream: `chat.completion.chunk`s, each choice's first with its role alone (no text yet: OpenAI's and
    vLLM's, which clients wait for), then its text (with vLLM's token ids, and the prompt's keys once, where asked
    for), a usage chunk if asked for, then DONE."""
    req = pending.req
    echo = chat_echo(req.params)
    plan = tool_plan(req.params)
    calls = None if plan is None else ToolDeltas(plan, req.choices)
    for first, text in ((True, ""), (False, echo)) if echo else ((True, ""),):  # echo: each choice's first content
        for i in range(req.choices):
            usage = pending.usage() if req.continuous_usage else None
            opening = delta(i, text, None, first=first) if calls is None else calls.first(i)
            yield render.StreamEvent(chunk(req, [opening], usage))
    prompt_sent: set[str] = set()

    def choices_of(event: ChoiceEvent) -> list[ChatChunkChoice]:
        if calls is not None:
            return calls.of(event)
        return [delta(event.index, event.text, event.finish_reason, first=False, logprobs=event.logprobs,
                      token_ids=event.extra.get("token_ids"))]

    def chunk_of(event: ChoiceEvent | None, choices: list, usage: Usage | None) -> ChatCompletionChunk:
        extra = {} if event is None else event.extra
        prompt = {k: extra[k] for k in PROMPT_KEYS if k in extra and k not in prompt_sent}
        prompt_sent.update(prompt)
        return chunk(req, choices, usage, prompt)

    async for event in stream_events(pending, choices_of, chunk_of):
        if not _empty(event.body):  # a required list's pieces, held until an item is complete
            yield event


def _empty(body) -> bool:
    return isinstance(body, ChatCompletionChunk) and not body.choices and body.usage is None and \
        body.prompt_token_ids is None and body.prompt_logprobs is None


class ChatTokenLogprobs:
    """One choice's logprobs in OpenAI's chat shape, gathered as its tokens arrive (render.ChoiceLogprobs' interface:
    `add`, `take` since the last take, `whole`): each token's text, log-probability and UTF-8 bytes, and its most
    likely alternatives. The end-of-text token that ends a choice is not listed (`lists_end`: OpenAI's chat lists none)."""

    lists_end: ClassVar[bool] = False

    def __init__(self) -> None:
        self.content: list[ChatTokenLogprob] = []
        self.taken = 0

    def add(self, entry, offset: int = 0) -> None:
        token, logprob, top = entry
        alternatives = [_top(t, v) for t, v in top or ()]
        self.content.append(ChatTokenLogprob(**_top(token, logprob).model_dump(), top_logprobs=alternatives))

    def take(self) -> ChatLogprobs:
        n, self.taken = self.taken, len(self.content)
        return ChatLogprobs(content=self.content[n:])

    def whole(self) -> ChatLogprobs:
        return ChatLogprobs(content=list(self.content))


def _top(token: int, logprob: float | None) -> ChatTopLogprob:
    data = get_encoding().decode_single_token_bytes(token)
    return ChatTopLogprob(token=render.token_text(token), logprob=render.logprob_value(logprob), bytes=list(data))
