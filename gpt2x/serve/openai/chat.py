"""OpenAI's chat completions (`POST /v1/chat/completions`) on top of the completions engine: the
messages rendered to one prompt by the model's Jinja2 chat template, as transformers'
`apply_chat_template` and vLLM render them (a sandboxed environment; `messages`,
`add_generation_prompt`, `bos_token`, `eos_token`, `raise_exception`), then completed as a
completions request with the same sampling fields, `n`, stop strings and structured output
(request.parse_request checks them all), and answered in the chat shapes (`chat.completion`, and
`chat.completion.chunk` events whose first delta carries the role).

The template: `--chat-template FILE`, else the `chat_template` of the export folder's
tokenizer_config.json (where transformers and vLLM read a model's), else gpt2x's default (a play's
script: onnx.interop.DEFAULT_CHAT_TEMPLATE), unless the server was started with
`--no-default-chat-template`: then one 400 that names the flags. Chat logprobs are answered in OpenAI's chat shape
(ChatTokenLogprobs); vLLM's `echo` begins each choice's content with the last message's, where that is the
assistant's (chat_echo); vLLM's prompt_logprobs and return_token_ids are answered in vLLM's chat shape (the rendered
prompt's on the response, each choice's token ids on the choice); tools are refused, not ignored.
"""

from __future__ import annotations

import time
import uuid
from functools import cached_property
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from ...onnx.interop import DEFAULT_CHAT_TEMPLATE, TOKENIZER_CONFIG_FILE, chat_template_of
from ...tokenizer import encode, get_encoding
from . import render, schema
from .errors import APIError, bad, validation_error
from .request import CompletionRequest

CHAT_TEMPLATE_FLAG = "--chat-template"
EOS_TOKEN = "<|endoftext|>"
# What the chat body adds to or changes from the completions body (the rest is passed on as it is).
_CHAT_ONLY = ("messages", "max_completion_tokens", "logprobs", "top_logprobs", "tools", "tool_choice",
              "parallel_tool_calls", "functions", "function_call", "add_generation_prompt", "continue_final_message",
              "chat_template", "chat_template_kwargs", "documents", "echo", "prompt", "modalities", "audio",
              "reasoning_effort", "store", "metadata", "prediction", "web_search_options", "service_tier")
_REFUSED = {"tools": "tools are not served", "tool_choice": "tools are not served",
            "functions": "functions are not served", "function_call": "functions are not served",
            "documents": "documents are not served", "audio": "audio is not served",
            "prediction": "predicted outputs are not served", "web_search_options": "web search is not served",
            "chat_template": "a request's own chat_template is not served (the server's is used)"}


class TextPart(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)

    type: Literal["text"]
    text: str


class Message(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)

    role: Annotated[str, Field(min_length=1)]
    content: str | list[TextPart] | None = None
    name: str | None = None

    def text(self) -> str:
        if self.content is None:
            return ""
        # Text parts joined by a newline, as vLLM joins them (a client splitting a message into parts keeps its lines)
        return self.content if isinstance(self.content, str) else "\n".join(p.text for p in self.content)


class ChatParams(BaseModel):
    """The fields the chat route reads itself; every other is a completions field (schema.CompletionParams)."""

    model_config = ConfigDict(extra="allow", strict=True, title="ChatCompletionRequest")

    messages: Annotated[list[Message], Field(min_length=1)] = Field(description="The conversation, rendered by the chat template.")
    max_completion_tokens: schema.Integer_(ge=1) | None = Field(None, description="OpenAI's name for max_tokens.")
    logprobs: bool | None = Field(None, description="Each generated token's log-probability, in OpenAI's chat shape.")
    top_logprobs: schema.Integer_(ge=0, le=schema.MAX_CHAT_LOGPROBS) | None = Field(None, description=(
        "With logprobs: the most likely tokens at each position, this many (OpenAI's limit)."))
    add_generation_prompt: bool | None = Field(True, description="vLLM's: the template's assistant turn opening is added.")
    continue_final_message: bool | None = Field(False, description="vLLM's: the last message is continued, not closed.")
    chat_template_kwargs: dict[str, Any] | None = Field(None, description="vLLM's: more variables for the template.")
    echo: bool | None = Field(False, description=(
        "vLLM's: each choice's content begins with the last message's text, where that message is the assistant's "
        "(a reply continued with continue_final_message reads whole)."))


class ChatTemplate:
    """A Jinja2 chat template, compiled once in a sandbox (templates come from model folders)."""

    def __init__(self, source: str, origin: str):
        self.source = source
        self.origin = origin  # where it came from, for messages

    @cached_property
    def _template(self):
        from jinja2.sandbox import ImmutableSandboxedEnvironment  # deferred: the serve extra's

        def raise_exception(message: str) -> None:
            raise bad(f"the chat template refused the messages: {message}", "messages")

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        env.globals["raise_exception"] = raise_exception
        return env.from_string(self.source)

    def render(self, messages: list[dict], add_generation_prompt: bool, extra: dict[str, Any]) -> str:
        from jinja2 import TemplateError

        try:
            return self._template.render(messages=messages, add_generation_prompt=add_generation_prompt,
                                         bos_token=EOS_TOKEN, eos_token=EOS_TOKEN, **extra)
        except TemplateError as e:
            raise bad(f"the chat template ({self.origin}) failed on these messages: {e}", "messages") from None


DEFAULT_ORIGIN = "gpt2x's default chat template"


def find_template(export_folder: Path, given: str | None, default: bool = True) -> ChatTemplate | None:
    """`given` (the text of --chat-template's file), else the export folder's own (export_template), else with
    `default` gpt2x's default template (llama-server's behaviour: chat works out of the box), else None."""
    if given is not None:
        return ChatTemplate(given, CHAT_TEMPLATE_FLAG)
    own = export_template(export_folder)
    if own is None and default:
        return ChatTemplate(DEFAULT_CHAT_TEMPLATE, DEFAULT_ORIGIN)
    return own


def export_template(export_folder: Path) -> ChatTemplate | None:
    """The export folder's tokenizer_config.json chat_template (a string, or transformers' list of named templates:
    "default"), else None."""
    found = chat_template_of(export_folder)
    if isinstance(found, list):  # [{"name": ..., "template": ...}]
        named = {t.get("name"): t.get("template") for t in found if isinstance(t, dict)}
        found = named.get("default")
    path = export_folder / TOKENIZER_CONFIG_FILE
    return ChatTemplate(found, str(path)) if isinstance(found, str) and found else None


def render_messages(messages: list[Message], template: ChatTemplate, add_generation_prompt: bool = True,
                    continue_final_message: bool = False, extra: dict[str, Any] | None = None) -> str:
    """The conversation as the prompt the template makes of it (vLLM's `continue_final_message`: the last message
    left open, the text ending where its content does)."""
    rendered = [{**m.model_dump(exclude_none=True, exclude={"content"}), "content": m.text()} for m in messages]
    prompt = template.render(rendered, add_generation_prompt and not continue_final_message, extra or {})
    if continue_final_message:
        last = rendered[-1]["content"]
        cut = prompt.rfind(last)
        prompt = prompt[: cut + len(last)] if last and cut >= 0 else prompt
    return prompt


def no_template() -> APIError:
    return bad("this model has no chat template and the server was started with --no-default-chat-template: "
               f"start it with {CHAT_TEMPLATE_FLAG} FILE (a Jinja2 chat template, as transformers' "
               "tokenizer_config.json chat_template), or export with one (gpt2x export --chat-template FILE)",
               "messages", "chat_template_missing")


def chat_echo(body: dict) -> str:
    """vLLM's chat echo: the text each choice's content begins with, the last message's where it is the assistant's
    (the role the answer is in), else none. Read after completion_body has checked the body."""
    if not body.get("echo"):
        return ""
    last = Message.model_validate(body["messages"][-1])
    return last.text() if last.role == "assistant" else ""


def logprobs_asked(body: dict) -> int | None:
    """The chat body's logprobs as the completions request counts them: the most likely tokens listed per token
    (top_logprobs, 0 by default), or None without logprobs. Read after completion_body has checked the body."""
    return (body.get("top_logprobs") or 0) if body.get("logprobs") else None


def completion_body(body: dict, template: ChatTemplate | None, n_positions: int) -> dict:
    """The chat body (read as a JSON object: request.json_object) as the completions body it is served as, handed
    on as it is (request.request_from_body): its prompt rendered, max_completion_tokens as max_tokens (by default,
    as many as the context leaves: vLLM's), the chat-only fields taken out."""
    try:
        p = ChatParams.model_validate(body)
    except ValidationError as e:
        raise validation_error(e.errors(include_url=False)) from None
    for name, why in _REFUSED.items():
        if body.get(name) not in (None, [], "none"):
            raise bad(f"{name}: {why}", name)
    if p.top_logprobs is not None and not p.logprobs:
        raise bad("top_logprobs needs logprobs: true", "top_logprobs")
    if "prompt" in body:
        raise bad("prompt is not a chat completions field (send messages)", "prompt")
    if template is None:
        raise no_template()
    prompt = render_messages(p.messages, template, bool(p.add_generation_prompt), bool(p.continue_final_message),
                             p.chat_template_kwargs or {})
    completions = {k: v for k, v in body.items() if k not in _CHAT_ONLY}
    completions["prompt"] = prompt
    if p.max_completion_tokens is not None:
        completions["max_tokens"] = p.max_completion_tokens
    elif body.get("max_tokens") is None:  # chat's default: as many as the context leaves (vLLM's)
        completions["max_tokens"] = max(1, n_positions - max(1, len(encode(prompt))))
    return completions


def chat_id(completion_id: str) -> str:
    return "chatcmpl-" + completion_id.removeprefix("cmpl-") if completion_id else "chatcmpl-" + uuid.uuid4().hex


def response(req: CompletionRequest, texts: list[str], reasons: list[str | None], usage: schema.Usage,
             logprobs: list[schema.ChatLogprobs | None] | None = None, extras: list[dict] | None = None,
             prompt: dict | None = None) -> schema.ChatCompletionResponse:
    """The whole chat completion; `extras`: each choice's vLLM keys (token_ids), `prompt`: the prompt's
    (prompt_token_ids, prompt_logprobs), where asked for."""
    logprobs = logprobs or [None] * len(texts)
    extras = extras or [{}] * len(texts)
    return schema.ChatCompletionResponse(
        id=chat_id(req.id), created=req.created, model=req.model, usage=usage, **(prompt or {}),
        choices=[schema.ChatChoice(index=i, message=schema.ChatMessage(content=text), finish_reason=reason, logprobs=lp,
                                   **extra)
                 for i, (text, reason, lp, extra) in enumerate(zip(texts, reasons, logprobs, extras))])


def chunk(req: CompletionRequest, choices: list[schema.ChatChunkChoice], usage: schema.Usage | None = None,
          prompt: dict | None = None) -> schema.ChatCompletionChunk:
    return schema.ChatCompletionChunk(id=chat_id(req.id), created=req.created or int(time.time()), model=req.model,
                                      choices=choices, usage=usage, **(prompt or {}))


def delta(index: int, text: str, reason: str | None, first: bool, logprobs: schema.ChatLogprobs | None = None,
          token_ids: list[int] | None = None) -> schema.ChatChunkChoice:
    """One choice's piece of a stream: its role alone first (`first`), then its content (with its tokens' logprobs and,
    with return_token_ids, their ids)."""
    return schema.ChatChunkChoice(index=index, delta=schema.ChatDelta(role="assistant" if first else None, content=text),
                                  finish_reason=reason, logprobs=logprobs, token_ids=token_ids)


PROMPT_KEYS = ("prompt_token_ids", "prompt_logprobs")  # vLLM's keys for the rendered prompt: the response's on chat


class ChatTokenLogprobs:
    """One choice's logprobs in OpenAI's chat shape, gathered as its tokens arrive (render.ChoiceLogprobs' interface:
    `add`, `take` since the last take, `whole`): each token's text, log-probability and UTF-8 bytes, and its most
    likely alternatives."""

    def __init__(self) -> None:
        self.content: list[schema.ChatTokenLogprob] = []
        self.taken = 0

    def add(self, entry, offset: int = 0) -> None:
        token, logprob, top = entry
        alternatives = [_top(t, v) for t, v in top or ()]
        self.content.append(schema.ChatTokenLogprob(**_top(token, logprob).model_dump(), top_logprobs=alternatives))

    def take(self) -> schema.ChatLogprobs:
        n, self.taken = self.taken, len(self.content)
        return schema.ChatLogprobs(content=self.content[n:])

    def whole(self) -> schema.ChatLogprobs:
        return schema.ChatLogprobs(content=list(self.content))


def _top(token: int, logprob: float | None) -> schema.ChatTopLogprob:
    data = get_encoding().decode_single_token_bytes(token)
    return schema.ChatTopLogprob(token=render.token_text(token), logprob=render.logprob_value(logprob), bytes=list(data))
