"""POST /v1/chat/completions' request and response models (vLLM's entrypoints/openai/chat_completion/protocol.py): the
request is the completions request's sampling fields (protocol.SamplingRequest) with the conversation and chat's own
fields; FastAPI validates the body against it, and the serving reads it as it is. Chat logprobs are answered in
OpenAI's chat shape; vLLM's prompt_logprobs and return_token_ids in vLLM's chat shape (the rendered prompt's on the
response, each choice's token ids on the choice)."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, SerializerFunctionWrapHandler, model_serializer

from ..completion.protocol import without_null
from ..protocol import MAX_CHAT_LOGPROBS, Integer_, PromptLogprob, SamplingRequest, Usage


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


class FunctionDefinition(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)

    name: Annotated[str, Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")] = Field(description="The function's name (OpenAI's "
                                                                             "characters, at most 64).")
    description: str | None = Field(None, description="What the function does (to the chat template, as tools).")
    parameters: dict[str, Any] | None = Field(None, description=(
        "The JSON schema of the function's arguments, which a call's arguments satisfy (none: any JSON object)."))
    strict: bool | None = Field(None, description="Accepted; the arguments always satisfy the schema.")


class ChatTool(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)

    type: Literal["function"]
    function: FunctionDefinition


class FunctionName(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)

    name: str


class NamedToolChoice(BaseModel):
    """tool_choice naming the function every choice calls."""

    model_config = ConfigDict(extra="allow", strict=True)

    type: Literal["function"]
    function: FunctionName


class ChatCompletionRequest(SamplingRequest):
    """The body of POST /v1/chat/completions: the conversation, chat's own fields, and every completions sampling
    field (n, stop strings, structured output, vLLM's extensions). `max_tokens` (or OpenAI's `max_completion_tokens`)
    defaults to what the context leaves (vLLM's). Tools are called where tool_choice asks for a call (`required` or a
    named function), as vLLM calls them without a tool parser: the answer is kept to the tools' JSON."""

    model_config = ConfigDict(extra="allow", strict=True)

    messages: Annotated[list[Message], Field(min_length=1)] = Field(description="The conversation, rendered by the chat template.")
    max_completion_tokens: Integer_(ge=1) | None = Field(None, description="OpenAI's name for max_tokens.")
    logprobs: bool | None = Field(None, description="Each generated token's log-probability, in OpenAI's chat shape.")
    top_logprobs: Integer_(ge=0, le=MAX_CHAT_LOGPROBS) | None = Field(None, description=(
        "With logprobs: the most likely tokens at each position, this many (OpenAI's limit)."))
    add_generation_prompt: bool | None = Field(True, description="vLLM's: the template's assistant turn opening is added.")
    continue_final_message: bool | None = Field(False, description="vLLM's: the last message is continued, not closed.")
    chat_template_kwargs: dict[str, Any] | None = Field(None, description="vLLM's: more variables for the template.")
    echo: bool | None = Field(False, description=(
        "vLLM's: each choice's content begins with the last message's text, where that message is the assistant's "
        "(a reply continued with continue_final_message reads whole)."))
    tools: list[ChatTool] | None = Field(None, description=(
        "Functions the answer may call, handed to the chat template as `tools`. Called with tool_choice required or "
        "a named function; `auto` (OpenAI's default where tools are sent) is refused: no tool calls are read out of "
        "free text."))
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = Field(None, description=(
        "none: a text answer; required: one call or more of the tools (vLLM's: a JSON list of name and parameters, "
        "kept to the tools' schemas); a named function: one call of it, its arguments kept to its parameters."))
    parallel_tool_calls: bool | None = Field(None, description="With tool_choice required, false: one call at most.")


# ------------------------------------------------------------------ the response bodies


class FunctionCall(BaseModel):
    name: str
    arguments: str  # the arguments as JSON text


class ToolCall(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(BaseModel):
    """The answer: its text, or (content null) the tools it calls."""

    role: Literal["assistant"] = "assistant"
    content: str | None
    tool_calls: list[ToolCall] | None = None

    @model_serializer(mode="wrap")
    def _calls_when_called(self, handler: SerializerFunctionWrapHandler):  # no return type: the schema stays the model's
        """`tool_calls` is there where the answer calls tools only (OpenAI's)."""
        return without_null(handler(self), "tool_calls")


class ChatTopLogprob(BaseModel):
    token: str
    logprob: float | None
    bytes: list[int]  # the token's UTF-8 bytes (part of a character, where it is one)


class ChatTokenLogprob(ChatTopLogprob):
    top_logprobs: list[ChatTopLogprob]  # the most likely tokens at this position, most likely first


class ChatLogprobs(BaseModel):
    """A choice's logprobs in OpenAI's chat shape (logprobs: true, top_logprobs: k)."""

    content: list[ChatTokenLogprob] | None


class ChatChoice(BaseModel):
    index: int
    message: ChatMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: Literal["stop", "length", "tool_calls"] | None = None
    token_ids: list[int] | None = None  # vLLM's, with return_token_ids: the choice's generated ids


class ChatCompletionResponse(BaseModel):
    """A whole chat completion (OpenAI's `chat.completion`), with vLLM's keys for the rendered prompt, null unless
    asked for: `prompt_logprobs` (prompt_logprobs) and `prompt_token_ids` (return_token_ids)."""

    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage
    prompt_logprobs: list[dict[str, PromptLogprob] | None] | None = None
    prompt_token_ids: list[int] | None = None


class DeltaFunctionCall(BaseModel):
    name: str | None = None  # in a call's first piece only
    arguments: str

    @model_serializer(mode="wrap")
    def _name_first(self, handler: SerializerFunctionWrapHandler):  # no return type: the schema stays the model's
        return without_null(handler(self), "name")


class DeltaToolCall(BaseModel):
    """A piece of a tool call, streamed: its id, type and name in its first piece, then its arguments' text."""

    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: DeltaFunctionCall

    @model_serializer(mode="wrap")
    def _id_first(self, handler: SerializerFunctionWrapHandler):  # no return type: the schema stays the model's
        return without_null(without_null(handler(self), "id"), "type")


class ChatDelta(BaseModel):
    """A choice's piece of a stream: its role alone in its first chunk (OpenAI's), then its content, or (content
    left out) the pieces of the tool calls it makes."""

    role: Literal["assistant"] | None = None
    content: str | None
    tool_calls: list[DeltaToolCall] | None = None

    @model_serializer(mode="wrap")
    def _role_first(self, handler: SerializerFunctionWrapHandler):  # no return type: the schema stays the model's
        """The role is there in a choice's first chunk only, tool_calls where it calls tools, a null content in the
        first chunk only (OpenAI's)."""
        data = without_null(without_null(handler(self), "role"), "tool_calls")
        return data if "role" in data else without_null(data, "content")


class ChatChunkChoice(BaseModel):
    index: int
    delta: ChatDelta
    logprobs: ChatLogprobs | None = None
    finish_reason: Literal["stop", "length", "tool_calls"] | None = None
    token_ids: list[int] | None = None  # vLLM's, with return_token_ids: the ids this chunk's content came from


class ChatCompletionChunk(BaseModel):
    """One chunk of a streamed chat completion (`chat.completion.chunk`; the usage chunk has no choices). vLLM's keys
    for the prompt come once, on the first chunk that has them: `prompt_token_ids` (return_token_ids) and
    `prompt_logprobs` (prompt_logprobs, once the prompt is scored)."""

    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None
    prompt_logprobs: list[dict[str, PromptLogprob] | None] | None = None
    prompt_token_ids: list[int] | None = None

    @model_serializer(mode="wrap")
    def _usage_once(self, handler: SerializerFunctionWrapHandler):  # no return type: the schema stays the model's
        """Chunks leave `usage` out, as OpenAI's do (the usage chunk carries it)."""
        return without_null(handler(self), "usage")
