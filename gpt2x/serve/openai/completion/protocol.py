"""POST /v1/completions' request and response models (vLLM's entrypoints/openai/completion/protocol.py): the request
is the pydantic model FastAPI validates the body against and the serving reads as it is; the response is built once
(serving.py) and serialised once (render.to_json)."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, SerializerFunctionWrapHandler, model_serializer

from ..protocol import (
    DEFAULT_MAX_TOKENS,
    MAX_LOGPROBS,
    MAX_PROMPTS,
    Integer_,
    PromptLogprob,
    SamplingRequest,
    TokenIds,
    Usage,
)


class CompletionRequest(SamplingRequest):
    """The body of POST /v1/completions: OpenAI's completions request, with vLLM's `top_k` and
    `truncate_prompt_tokens`. Types are strict (no "5" for 5); unknown fields are ignored."""

    model_config = ConfigDict(extra="allow", strict=True)

    prompt: (str | Annotated[list[str], Field(min_length=1, max_length=MAX_PROMPTS)] | TokenIds
             | Annotated[list[TokenIds], Field(min_length=1, max_length=MAX_PROMPTS)]) = Field(
        description="One prompt (a string, or its token ids) or several (a list of strings, or a list of "
                    "token id lists), each completed as if sent alone: one choice per prompt. An empty "
                    "string starts a document (<|endoftext|>).")
    max_tokens: Integer_(ge=0) | None = Field(DEFAULT_MAX_TOKENS, description="Tokens to generate per prompt, capped by "
                                   "the context; 0 only with `echo` (the prompt scored, nothing generated).")
    logprobs: Integer_(ge=0, le=MAX_LOGPROBS) | None = Field(None, description=(
        "Per token: its log-probability under the raw model distribution (log_softmax of the logits, "
        "before temperature, top-k and top-p) and the `logprobs` most likely tokens."))
    echo: bool | None = Field(False, description="The prompt before the completion (and its tokens' logprobs "
                              "with `logprobs`).")


class Logprobs(BaseModel):
    tokens: list[str]
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]


class Choice(BaseModel):
    """One choice (or a stream chunk's piece of one). vLLM's keys are always there, null unless asked
    for: `prompt_logprobs` (prompt_logprobs), `prompt_token_ids` and `token_ids` (return_token_ids)."""

    index: int
    text: str
    logprobs: Logprobs | None = None
    finish_reason: Literal["stop", "length"] | None = None
    prompt_logprobs: list[dict[str, PromptLogprob] | None] | None = None
    prompt_token_ids: list[int] | None = None
    token_ids: list[int] | None = None


class CompletionResponse(BaseModel):
    """A whole completion, or one chunk of a stream (`text/event-stream`: `data: {chunk}` events, then
    `data: [DONE]`; the chunks have this shape, the usage chunk an empty `choices`)."""

    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[Choice]
    usage: Usage | None = None

    @model_serializer(mode="wrap")
    def _usage_once(self, handler: SerializerFunctionWrapHandler):  # no return type: the schema stays the model's
        """A stream's chunks leave `usage` out, as OpenAI's do (the whole response and the usage chunk carry it)."""
        return without_null(handler(self), "usage")


def without_null(data: dict[str, Any], key: str) -> dict[str, Any]:
    """`data` without `key` where it is null (a key a body has only when it has a value)."""
    if data.get(key, 0) is None:
        del data[key]
    return data


