"""The Responses API's bodies as gpt2x serves them (pydantic models, which /openapi.json publishes): the request
(`ResponsesRequest`), the `response` object, and the typed events of its stream. Field by field as OpenAI's API
reference describes them; what gpt2x does with each request field: docs/serving/api.md#responses.

A field that would change the answer and is not served is declared here so that its refusal names it (serving.py
refuses it), and its schema is narrowed to what is served, so that a body valid by the published schema is answered.
Input items other than messages are refused by their type before the schema's checks (`_served_items`).
"""

from __future__ import annotations

from typing import Annotated, Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, create_model, model_validator

from ..errors import bad
from ..protocol import MAX_CHAT_LOGPROBS, Integer_, JsonSchemaFormat, ResponseFormat, SamplingRequest
from ..sampling import PROCESSOR_FIELDS

MAX_METADATA = 16  # OpenAI's limit: key-value pairs per request
MAX_STORED = 1000  # responses whose conversations a replica keeps for previous_response_id (the oldest dropped first)
NULL_ONLY = {"type": "null"}  # the schema of a field declared only to be refused by name
_PART_TYPES = ("input_text", "output_text")  # the content parts served (output_text in assistant messages only)


# ------------------------------------------------------------------ text.format (the request's, echoed in the response)


class ResponseFormatText(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    type: Literal["text"] = "text"


class ResponseFormatJsonObject(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    type: Literal["json_object"]


class ResponseFormatJsonSchema(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, serialize_by_alias=True)

    type: Literal["json_schema"]
    name: str | None = Field(None, description="The schema's name (not used).")
    description: str | None = Field(None, description="Not used.")
    schema_: dict[str, Any] = Field(alias="schema", description="The JSON schema the text satisfies.")
    strict: bool | None = Field(None, description="Accepted; the output always satisfies the schema.")


TextFormat = Annotated[ResponseFormatText | ResponseFormatJsonObject | ResponseFormatJsonSchema,
                       Field(discriminator="type")]


class ResponseTextConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    format: TextFormat = Field(default_factory=ResponseFormatText, description=(
        "Free text, any JSON object, or JSON satisfying a schema, kept to while generated (chat's response_format)."))
    verbosity: Literal["medium"] | None = Field(None, description="Only medium (the default): GPT-2 has no other.")


# ------------------------------------------------------------------ the request


class ResponseInputText(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)

    type: Literal["input_text"]
    text: str


class ResponseInputOutputText(BaseModel):
    """An earlier answer's text, as an assistant message of the input carries it (an output item sent back)."""

    model_config = ConfigDict(extra="allow", strict=True)  # its annotations and logprobs do not change the prompt

    type: Literal["output_text"]
    text: str


class ResponseInputMessage(BaseModel):
    """A message of the input: OpenAI's easy input message, or an input or output message item."""

    model_config = ConfigDict(extra="allow", strict=True)  # an output item's id, status and phase

    type: Literal["message"] | None = None
    role: Literal["user", "assistant", "system", "developer"]
    content: str | list[Annotated[ResponseInputText | ResponseInputOutputText, Field(discriminator="type")]]


class _ResponsesFields(BaseModel):
    """The body of POST /v1/responses. Types are strict (no "5" for 5); an unknown field is a 400, as OpenAI's. Beyond
    OpenAI's fields, vLLM's sampling fields (SAMPLING_FIELDS), as the completions body takes them."""

    model_config = ConfigDict(extra="forbid", strict=True, title="ResponsesRequest")

    input: str | list[ResponseInputMessage] = Field(description=(
        "The user's text, or a list of messages (roles user, assistant, system, developer; text content), rendered "
        "with the instructions and the earlier conversation by the chat template."))
    instructions: str | None = Field(None, description=(
        "A system message put first. Not carried over to a response that continues this one (OpenAI's rule)."))
    model: str | None = Field(None, description="The served model's id (GET /v1/models) or \"\"; another is a 404.")
    max_output_tokens: Integer_(ge=1) | None = Field(None, description=(
        "Tokens to generate at most (by default, as many as the context leaves); a response cut off by it is "
        "`incomplete`."))
    temperature: float | None = Field(None, ge=0, le=2, description="0 = greedy; 1 by default.")
    top_p: float | None = Field(None, gt=0, le=1, description="Nucleus sampling; 1 (off) by default.")
    text: ResponseTextConfig | None = None
    stream: bool | None = Field(False, description="Server-sent events, each `event: TYPE` and `data: JSON`.")
    previous_response_id: Annotated[str, Field(min_length=1)] | None = Field(None, description=(
        "A stored response of this replica's to continue: its input and output come before this input."))
    store: bool | None = Field(True, description=(
        f"Keep the response for previous_response_id (the last {MAX_STORED} kept, in the answering replica's memory)."))
    metadata: Annotated[dict[Annotated[str, Field(max_length=64)], Annotated[str, Field(max_length=512)]],
                        Field(max_length=MAX_METADATA)] | None = Field(None, description="Echoed in the response.")
    user: str | None = Field(None, description="Echoed in the response; not used.")
    parallel_tool_calls: bool | None = Field(None, description="Accepted; no tools are served.")
    max_tool_calls: Integer_(ge=0) | None = Field(None, description="Accepted; no tools are served.")
    service_tier: str | None = Field(None, description="Accepted; one tier is served.")
    prompt_cache_key: str | None = Field(None, description="Accepted; the prefix cache is shared by every request.")
    prompt_cache_retention: str | None = Field(None, description="Accepted; the prefix cache keeps what it can hold.")
    safety_identifier: str | None = Field(None, description="Accepted; not used.")
    # Its own name inside: `stream_options` is the completions body's (include_usage), which this body lacks.
    responses_stream_options: dict[str, Any] | None = Field(None, alias="stream_options", description=(
        "Accepted (include_obfuscation); no effect."))
    # Refused unless absent or neutral (serving.py says why, naming the field); the schema narrowed to what is served.
    tools: list[dict[str, Any]] | None = Field(None, description="Not served: only an empty list.",
                                               json_schema_extra={"maxItems": 0})
    tool_choice: str | dict[str, Any] | None = Field(None, description="Only none or auto (no tools are served).",
                                                     json_schema_extra={"enum": ["none", "auto", None]})
    reasoning: dict[str, Any] | None = Field(None, description="Only without an effort or summary: GPT-2 does not reason.",
                                             json_schema_extra={"properties": {
                                                 "effort": {"enum": [None, "none"]}, "summary": NULL_ONLY,
                                                 "generate_summary": NULL_ONLY}})
    background: bool | None = Field(None, description="Only false: a response is answered while its request is open.",
                                    json_schema_extra={"enum": [False, None]})
    include: list[str] | None = Field(None, description="Not served: only an empty list.",
                                      json_schema_extra={"maxItems": 0})
    truncation: Literal["auto", "disabled"] | None = Field(None, description=(
        "Only disabled: a conversation longer than the context is a 400."), json_schema_extra={"enum": ["disabled", None]})
    top_logprobs: Integer_(ge=0, le=MAX_CHAT_LOGPROBS) | None = Field(None, description=(
        "Only 0: logprobs are not served here (include is refused)."), json_schema_extra={"maximum": 0})
    conversation: str | dict[str, Any] | None = Field(None, description=(
        "Not served: continue a conversation with previous_response_id."), json_schema_extra=NULL_ONLY)
    prompt: dict[str, Any] | None = Field(None, description="Not served (stored prompt templates).",
                                          json_schema_extra=NULL_ONLY)

    # What serving reads of a completions or chat request (completion.serving.serve, the sampling settings, Pending)
    # and this body does not take: not asked for. The request is served as it is, with the completions body's names.
    n: ClassVar[None] = None
    best_of: ClassVar[None] = None
    suffix: ClassVar[None] = None
    stream_options: ClassVar[None] = None
    ignore_eos: ClassVar[None] = None
    stop_token_ids: ClassVar[None] = None
    structured_outputs: ClassVar[None] = None
    json_schema: ClassVar[None] = None  # llama-server's; text.format is this body's
    grammar: ClassVar[None] = None
    use_beam_search: ClassVar[None] = None
    length_penalty: ClassVar[None] = None
    include_stop_str_in_output: ClassVar[None] = None
    truncate_prompt_tokens: ClassVar[None] = None
    truncation_side: ClassVar[None] = None
    prompt_logprobs: ClassVar[None] = None
    return_token_ids: ClassVar[None] = None
    return_tokens_as_token_ids: ClassVar[None] = None
    priority: ClassVar[None] = None
    request_id: ClassVar[None] = None
    add_special_tokens: ClassVar[None] = None
    skip_special_tokens: ClassVar[None] = None
    spaces_between_special_tokens: ClassVar[None] = None

    @property
    def max_tokens(self) -> int | None:
        return self.max_output_tokens

    @property
    def response_format(self) -> ResponseFormat | None:
        """text.format in the completions body's shape (None: free text)."""
        fmt = self.text.format if self.text is not None else None
        if isinstance(fmt, ResponseFormatJsonObject):
            return ResponseFormat(type="json_object")
        if isinstance(fmt, ResponseFormatJsonSchema):
            return ResponseFormat(type="json_schema", json_schema=JsonSchemaFormat(
                name=fmt.name, description=fmt.description, schema=fmt.schema_, strict=fmt.strict))
        return None

    @model_validator(mode="before")
    @classmethod
    def _served_items(cls, body: Any) -> Any:
        """Input items other than messages, and content other than text, refused by their type before the schema's
        checks, whose words would be about a message's missing role. A 400 naming `input` (an APIError, which pydantic
        passes on as it is)."""
        items = body.get("input") if isinstance(body, dict) else None
        for i, item in enumerate(items if isinstance(items, list) else ()):
            if isinstance(item, dict):  # else the schema's check says what it must be
                _served_item(i, item)
        return body


def _served_item(i: int, item: dict) -> None:
    kind = item.get("type")
    if kind not in (None, "message"):
        raise bad(f"input[{i}]: items of type {str(kind)[:60]!r} are not served (only messages: roles and text)", "input")
    content = item.get("content")
    for j, part in enumerate(content if isinstance(content, list) else ()):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in _PART_TYPES:
            raise bad(f"input[{i}].content[{j}]: content of type {str(kind)[:60]!r} is not served (only input_text, "
                      "and output_text in assistant messages)", "input")
        if kind == "output_text" and item.get("role") != "assistant":
            raise bad(f"input[{i}].content[{j}]: output_text is an assistant message's content", "input")


# vLLM's sampling fields beyond OpenAI's (its ResponsesRequest takes top_k, repetition_penalty, seed, ...): every
# logits processor's field the completions body names, the seed and stop strings, each as the completions body
# declares it, handed on to the chat request as it is (serving._chat_request).
SAMPLING_FIELDS = tuple(f for f in (*PROCESSOR_FIELDS, "seed", "stop") if f not in _ResponsesFields.model_fields)
ResponsesRequest = create_model(
    "ResponsesRequest", __base__=_ResponsesFields, __doc__=_ResponsesFields.__doc__,
    **{f: (SamplingRequest.model_fields[f].annotation, SamplingRequest.model_fields[f]) for f in SAMPLING_FIELDS})


# ------------------------------------------------------------------ the response


class ResponseOutputText(BaseModel):
    type: Literal["output_text"] = "output_text"
    text: str
    annotations: list[dict[str, Any]] = Field(default_factory=list, max_length=0)  # none: no files or citations


class ResponseOutputMessage(BaseModel):
    """The response's one output item: the assistant's message."""

    type: Literal["message"] = "message"
    id: str
    role: Literal["assistant"] = "assistant"
    status: Literal["in_progress", "completed", "incomplete"]
    content: list[ResponseOutputText]


class ResponseIncompleteDetails(BaseModel):
    reason: Literal["max_output_tokens"]  # max_output_tokens ran out, or the context did


class ResponseInputTokensDetails(BaseModel):
    cached_tokens: int  # input tokens whose KV came from the prefix cache


class ResponseOutputTokensDetails(BaseModel):
    reasoning_tokens: int = 0  # GPT-2 does not reason


class ResponseUsage(BaseModel):
    input_tokens: int
    input_tokens_details: ResponseInputTokensDetails
    output_tokens: int
    output_tokens_details: ResponseOutputTokensDetails
    total_tokens: int


class Response(BaseModel):
    """OpenAI's `response` object. `output_text` is not a field: OpenAI's SDKs compute it from `output`."""

    id: str  # resp_...
    object: Literal["response"] = "response"
    created_at: int
    status: Literal["in_progress", "completed", "incomplete"]  # incomplete: max_output_tokens (or the context) ran out
    background: Literal[False] = False
    error: None = None  # a stream that fails ends with an `error` event; a request that fails is a 4xx or 5xx
    incomplete_details: ResponseIncompleteDetails | None = None
    instructions: str | None = None
    max_output_tokens: int | None = None
    metadata: dict[str, str]
    model: str
    output: list[ResponseOutputMessage]  # empty until the answer is done (the stream's first events)
    parallel_tool_calls: bool
    previous_response_id: str | None = None
    store: bool
    temperature: float
    text: ResponseTextConfig
    tool_choice: Literal["none", "auto"]
    tools: list[dict[str, Any]] = Field(default_factory=list, max_length=0)
    top_p: float
    truncation: Literal["disabled"] = "disabled"
    usage: ResponseUsage | None = None  # null until the answer is done
    user: str | None = None


# ------------------------------------------------------------------ the stream's events (each `event: TYPE`, `data: JSON`)


class ResponseLifecycleEvent(BaseModel):
    """The response as it stands: created and in progress first, completed (or incomplete) last, with its usage."""

    type: Literal["response.created", "response.in_progress", "response.completed", "response.incomplete"]
    sequence_number: int
    response: Response


class ResponseOutputItemEvent(BaseModel):
    type: Literal["response.output_item.added", "response.output_item.done"]
    sequence_number: int
    output_index: int
    item: ResponseOutputMessage


class ResponseContentPartEvent(BaseModel):
    type: Literal["response.content_part.added", "response.content_part.done"]
    sequence_number: int
    item_id: str
    output_index: int
    content_index: int
    part: ResponseOutputText


class ResponseTextDeltaEvent(BaseModel):
    type: Literal["response.output_text.delta"] = "response.output_text.delta"
    sequence_number: int
    item_id: str
    output_index: int
    content_index: int
    delta: str
    logprobs: list[dict[str, Any]] = Field(default_factory=list, max_length=0)  # not served


class ResponseTextDoneEvent(BaseModel):
    type: Literal["response.output_text.done"] = "response.output_text.done"
    sequence_number: int
    item_id: str
    output_index: int
    content_index: int
    text: str
    logprobs: list[dict[str, Any]] = Field(default_factory=list, max_length=0)


class ResponseErrorEvent(BaseModel):
    """A failure once the stream has begun: its last event (no `[DONE]` follows: OpenAI's Responses stream has none)."""

    type: Literal["error"] = "error"
    sequence_number: int
    code: str | None = None
    message: str
    param: str | None = None


ResponseStreamEvent = (ResponseLifecycleEvent | ResponseOutputItemEvent | ResponseContentPartEvent | ResponseTextDeltaEvent
                       | ResponseTextDoneEvent | ResponseErrorEvent)
# The event models by name, added to the OpenAPI description (no route returns them whole).
EVENT_MODELS: dict[str, type[BaseModel]] = {model.__name__: model for model in (
    ResponseLifecycleEvent, ResponseOutputItemEvent, ResponseContentPartEvent, ResponseTextDeltaEvent,
    ResponseTextDoneEvent, ResponseErrorEvent)}
# One server-sent event of the stream (OpenAPI 3.1: the schema of each event): its type, and its JSON.
STREAM_EVENT = {"type": "object", "required": ["event", "data"], "properties": {
    "event": {"type": "string"},
    "data": {"type": "string", "contentMediaType": "application/json", "contentSchema": {"anyOf": [
        {"$ref": f"#/components/schemas/{name}"} for name in EVENT_MODELS]}}}}
