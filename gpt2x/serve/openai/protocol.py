"""What every endpoint of the OpenAI layer shares (vLLM's entrypoints/openai/engine/protocol.py): the sampling fields
of a completions or chat completions request (`SamplingRequest`, which each endpoint's request model extends: the
pydantic model *is* the request, read as it is downstream; a logits processor's field it does not declare is derived
from SamplingSettings, `settings_fields`), and the bodies every route answers with (errors, usage, models, health, the
tokenizer's). Types are strict (no "5" for 5); FastAPI validates the bodies against these models
and publishes their schemas in /openapi.json. What each field does: docs/serving-fields.md."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Annotated, Any, Literal, get_args, get_origin, get_type_hints

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, create_model
from pydantic_core import PydanticCustomError

from ...generation.processors import BIAS_RANGE, ORDER, PENALTY_RANGE, LogitsProcessor
from ...generation.settings import SamplingSettings
from ...tokenizer import VOCAB_SIZE

MAX_STOP = 4  # stop strings per request, as OpenAI's limit
MAX_PROMPTS = 64  # prompts per request
DEFAULT_MAX_TOKENS = 16  # OpenAI's default for completions
MAX_LOGPROBS = 5  # OpenAI's limit for the legacy completions' `logprobs`
MAX_CHOICES = 128  # n x prompts per request (OpenAI's n is at most 128)
MAX_STOP_TOKEN_IDS = 64  # stop_token_ids per request
MAX_PROMPT_LOGPROBS = 20  # vLLM's default max_logprobs
MAX_CHAT_LOGPROBS = 20  # OpenAI's limit for chat's `top_logprobs`


def _integral(value: Any) -> Any:
    """A number JSON writes as 2.0 is the integer 2 (as JSON Schema reads it); 2.5 stays a float, refused."""
    return int(value) if isinstance(value, float) and value.is_integer() else value


def Integer_(**bounds: int) -> Any:  # noqa: N802 (a type)
    """An integer within `bounds` (ge, le, ...), strict otherwise: no "5", no true."""
    return Annotated[int, Field(**bounds), BeforeValidator(_integral)]


TokenId = Integer_(ge=0, le=VOCAB_SIZE - 1)
TokenIdKey = Annotated[str, Field(pattern=r"^[0-9]{1,9}$")]  # logit_bias's keys: token ids as JSON object keys
Bias = Annotated[float, Field(ge=-BIAS_RANGE, le=BIAS_RANGE)]
TokenIds = Annotated[list[TokenId], Field(min_length=1)]
StopString = Annotated[str, Field(min_length=1)]


def _only(**bounds) -> Callable[[dict], None]:
    """A field's schema narrowed to the values served (`n`: 1), beyond what its type accepts."""
    def narrow(schema: dict) -> None:
        for option in schema.get("anyOf", [schema]):
            if option.get("type") != "null":
                option.update(bounds)
    return narrow


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)

    include_usage: bool | None = Field(None, description="A last chunk (before `[DONE]`) with the usage and no choices.")
    continuous_usage_stats: bool | None = Field(None, description=(
        "vLLM's: with include_usage, every chunk also carries the usage so far."))


class JsonSchemaFormat(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)

    name: str | None = Field(None, description="The schema's name (not used).")
    description: str | None = Field(None, description="Not used.")
    schema_: dict[str, Any] | bool | None = Field(None, alias="schema", description="The JSON schema the text satisfies.")
    strict: bool | None = Field(None, description="Accepted; the output always satisfies the schema.")


class ResponseFormat(BaseModel):
    """OpenAI's response_format: free text, any JSON object, or JSON satisfying a schema."""

    model_config = ConfigDict(extra="allow", strict=True)

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema", description=(
        "llama-server's: the JSON schema the text satisfies, beside type json_object or json_schema."))


class StructuredOutputs(BaseModel):
    """vLLM's structured_outputs: exactly one of a JSON schema, a regex, a list of choices, a grammar
    (Lark or GBNF), or any JSON object."""

    model_config = ConfigDict(extra="allow", strict=True)

    json_: dict[str, Any] | str | bool | None = Field(None, alias="json", description="A JSON schema (an object or its text).")
    regex: str | None = Field(None, description="The text fully matches this regular expression.")
    choice: Annotated[list[str], Field(min_length=1)] | None = Field(None, description="The text is one of these.")
    grammar: str | None = Field(None, description="A Lark (`start:`) or GBNF (`root ::=`) grammar the text satisfies.")
    json_object: bool | None = Field(None, description="The text is any JSON object.")


class _SamplingFields(BaseModel):
    """The fields a completions and a chat completions request share: OpenAI's sampling fields with vLLM's and
    llama-server's extensions. Unknown fields are allowed here, then ignored (logged once) or refused by name
    (sampling.refuse_unknown)."""

    model_config = ConfigDict(extra="allow", strict=True)

    model: str | None = Field(None, description="The served model's id (GET /v1/models); another is a 404.")
    max_tokens: Integer_(ge=0) | None = Field(None, description=(
        "Tokens to generate, capped by the context; by default as many as the context leaves (chat's, as vLLM's)."))
    temperature: float | None = Field(SamplingSettings.temperature, ge=0, le=2, description="0 = greedy.")
    top_p: float | None = Field(SamplingSettings.top_p, gt=0, le=1)
    top_k: Integer_(ge=-1) | None = Field(None, description="vLLM's: keep the k most likely tokens; -1 or 0 = off (the default).")
    seed: Integer_(ge=0, lt=2**63) | None = Field(None, description="Same seed, settings and prompt: same tokens.")
    stop: (StopString | Annotated[list[StopString], Field(max_length=MAX_STOP)] | None) = Field(
        None, description=f"Up to {MAX_STOP} non-empty strings; the text ends before the first one found.")
    # What is refused beyond a type (n > 1, a suffix, ...) is refused by parse_request, in its own words;
    # the schema says it too (`only`), so that a body valid by the schema is answered.
    n: Integer_(ge=1, le=MAX_CHOICES) | None = Field(1, description=(
        f"Choices per prompt (n x prompts at most {MAX_CHOICES}), each sampled on its own; with a seed, choice i "
        "is seeded seed + i (vLLM's rule). A prompt is prefilled once for its n choices."))
    best_of: Integer_(ge=1) | None = Field(None, description="Only 1 (deprecated by OpenAI, removed in vLLM).",
                                           json_schema_extra=_only(maximum=1))
    stream: bool | None = Field(False, description="Server-sent events, ending with `data: [DONE]`.")
    stream_options: StreamOptions | None = None
    truncate_prompt_tokens: Integer_(ge=1) | None = Field(None, description="vLLM's: keep the prompt's last k tokens.")
    suffix: str | None = Field(None, description="Not supported: refused unless null or empty.", json_schema_extra=_only(maxLength=0))
    presence_penalty: float | None = Field(0.0, ge=-PENALTY_RANGE, le=PENALTY_RANGE, description=(
        "OpenAI's: subtracted from the logit of every token already generated (not the prompt's)."))
    frequency_penalty: float | None = Field(0.0, ge=-PENALTY_RANGE, le=PENALTY_RANGE, description=(
        "OpenAI's: subtracted from a token's logit once per time it was generated (not in the prompt)."))
    logit_bias: dict[TokenIdKey, Bias] | None = Field(None, description=(
        "Token id (as a string) -> bias added to its logit before sampling, in [-100, 100] (OpenAI's range; "
        "vLLM clamps to it). Applied to greedy decoding too."), json_schema_extra=_only(additionalProperties=False))
    repetition_penalty: float | None = Field(None, gt=0, description=(
        "vLLM's (transformers'): the logit of every token in the prompt or the output is divided by it where "
        "positive, multiplied by it where negative; 1 = off (the default)."))
    min_p: float | None = Field(None, ge=0, le=1, description=(
        "vLLM's: drop tokens less likely than min_p times the most likely one; 0 = off (the default)."))
    typical_p: float | None = Field(None, gt=0, le=1, description=(
        "llama-server's and transformers': locally typical sampling, the tokens whose surprise is nearest the "
        "entropy up to this mass; 1 = off (the default). Not applied to greedy decoding."))
    bad_words: Annotated[list[Annotated[str, Field(min_length=1, max_length=200)]], Field(max_length=64)] | None = Field(
        None, description="vLLM's: words never generated (each as it begins a text and after a space; a word's last "
        "token banned where the output ends with its others).")
    no_repeat_ngram_size: Integer_(ge=0) | None = Field(None, description=(
        "transformers': no n-gram of this size occurs twice in the prompt and the output (applied to greedy "
        "decoding too); 0 = off (the default)."))
    dry_multiplier: float | None = Field(None, ge=0, description=(
        "llama-server's DRY (Don't Repeat Yourself) repetition penalty multiplier: a token that would extend a "
        "repetition of n >= dry_allowed_length tokens of the prompt and the output loses dry_multiplier * dry_base ^ "
        "(n - dry_allowed_length) from its logit (greedy decoding too); 0 = off (the default)."))
    dry_base: float | None = Field(None, ge=1, description="llama-server's DRY penalty base, >= 1; 1.75 by default.")
    dry_allowed_length: Integer_(ge=1) | None = Field(None, description=(
        "llama-server's: repetitions up to this many tokens are not penalised by DRY; 2 by default."))
    dry_penalty_last_n: Integer_(ge=-1) | None = Field(None, description=(
        "llama-server's: how many of the last tokens (prompt and output) DRY scans for repetitions; -1 = all "
        "(the default), 0 = off."))
    dry_sequence_breakers: Annotated[list[Annotated[str, Field(min_length=1, max_length=200)]],
                                     Field(min_length=1, max_length=64)] | None = Field(None, description=(
        "llama-server's: strings a DRY repetition never reaches back across (each cut to 40 bytes, as llama.cpp "
        "does); [\"\\n\", \":\", \"\\\"\", \"*\"] by default."))
    min_tokens: Integer_(ge=0) | None = Field(None, description=(
        "vLLM's: the end-of-text token and stop_token_ids cannot be sampled, and stop strings do not "
        "end the text, before this many tokens (at most max_tokens)."))
    stop_token_ids: Annotated[list[TokenId], Field(max_length=MAX_STOP_TOKEN_IDS)] | None = Field(None, description=(
        "vLLM's: a choice ends (finish_reason \"stop\") when it samples one of these tokens, which is not "
        "in its text (listed last in its logprobs, as the end-of-text token is)."))
    ignore_eos: bool | None = Field(None, description=(
        "vLLM's: the end-of-text token does not end a choice (it is kept, as text that decodes to "
        "\"<|endoftext|>\")."))
    response_format: ResponseFormat | None = Field(None, description=(
        "OpenAI's: {\"type\": \"json_object\"} or {\"type\": \"json_schema\", \"json_schema\": {\"schema\": ...}}: "
        "each choice's text is kept to it while it is generated (llguidance); a choice cut off by max_tokens "
        "ends with finish_reason \"length\"."))
    structured_outputs: StructuredOutputs | None = Field(None, description=(
        "vLLM's: one of `json` (a schema), `regex`, `choice`, `grammar` or `json_object`, kept to as "
        "response_format is."))
    json_schema: dict[str, Any] | None = Field(None, description=(
        "llama-server's: a JSON schema each choice's text is kept to, as response_format's is."))
    grammar: str | None = Field(None, description=(
        "llama-server's: a GBNF grammar (`root ::= ...`) each choice's text is kept to, as structured_outputs' is."))
    user: str | None = Field(None, description="Ignored (OpenAI's end-user id, for its abuse monitoring).")
    # vLLM's extensions beyond the sampling fields (docs/serving-fields.md lists every field).
    allowed_token_ids: Annotated[list[TokenId], Field(min_length=1)] | None = Field(None, description=(
        "vLLM's: only these tokens can be sampled (a logits processor; the end-of-text token only if listed)."))
    prompt_logprobs: Integer_() | None = Field(None, description=(
        f"vLLM's: each choice's `prompt_logprobs`, per prompt token (the first null) its log-probability and rank "
        f"and the k most likely tokens', keyed by token id; 0 to {MAX_PROMPT_LOGPROBS} (-1, the whole vocabulary, "
        "is refused)."), json_schema_extra=_only(minimum=0, maximum=MAX_PROMPT_LOGPROBS))
    return_token_ids: bool | None = Field(None, description=(
        "vLLM's: each choice's `prompt_token_ids` and `token_ids` (the ids its text is made of; streamed, "
        "each chunk's own, the prompt's with a choice's first chunk)."))
    return_tokens_as_token_ids: bool | None = Field(None, description=(
        "vLLM's: logprobs name each token `token_id:ID` instead of its text."))
    truncation_side: Literal["left", "right"] | None = Field(None, description=(
        "vLLM's: with truncate_prompt_tokens, keep the prompt's last k tokens (left, the default) or its first k (right)."))
    include_stop_str_in_output: bool | None = Field(None, description=(
        "vLLM's: the stop string that ended a choice is kept at the end of its text."))
    use_beam_search: bool | None = Field(None, description=(
        "vLLM's: the n best of n beams (transformers' beam search, on the raw distribution), one choice each."))
    length_penalty: float | None = Field(None, description=(
        "vLLM's, with use_beam_search: a beam's score is its summed log-probability / length ** length_penalty."))
    priority: Integer_(ge=-(2**31), lt=2**31) | None = Field(None, description=(
        "vLLM's: with --scheduling-policy priority, waiting requests run lowest priority first (arrival order "
        "among equals); any other than 0 is refused under the default fcfs policy."))
    request_id: Annotated[str, Field(min_length=1, max_length=128)] | None = Field(None, description=(
        "vLLM's: the response's id is `cmpl-REQUEST_ID`."))
    add_special_tokens: bool | None = Field(None, description="vLLM's: accepted; GPT-2's tokenizer adds none either way.")
    skip_special_tokens: bool | None = Field(None, description=(
        "vLLM's: accepted and not applied: the one special token's text (<|endoftext|>) appears only with ignore_eos, "
        "and is kept."))
    spaces_between_special_tokens: bool | None = Field(None, description=(
        "vLLM's: accepted; no effect with GPT-2's one special token."))


# A logits processor's field the request reads in a shape of its own, not derived (settings_fields).
OWN_SHAPE = ("constraint",)  # response_format, structured_outputs, and llama-server's json_schema and grammar


def settings_fields(declared: Iterable[str], settings: type = SamplingSettings,
                    processors: Sequence[type[LogitsProcessor]] = ORDER) -> dict[str, Any]:
    """The request fields of the logits processors' SamplingSettings fields that `declared` does not name: each
    optional (null: the settings' default), of the settings' type (a tuple as a JSON list), checked by its processor
    (a 400 naming it), so that a new processor's field is served with no line here."""
    hints = get_type_hints(settings)
    fields: dict[str, Any] = {}
    for name in (f for kind in processors for f in kind.fields):
        if name not in declared and name not in OWN_SHAPE:
            fields[name] = (_json_type(hints[name]) | None, Field(None, description=(
                f"SamplingSettings.{name}, as its logits processor reads it; null: its default.")))
    return fields


def _json_type(hint: Any) -> Any:
    """A settings field's type as JSON carries it: a tuple as a list, an int strict (no 2.5, no true)."""
    if get_origin(hint) is tuple:
        return list[get_args(hint)[0]]
    return Integer_() if hint is int else hint


SamplingRequest = create_model("SamplingRequest", __base__=_SamplingFields, __doc__=_SamplingFields.__doc__,
                               **settings_fields(_SamplingFields.model_fields))


# ------------------------------------------------------------------ the response bodies


class ErrorBody(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    """Every 4xx and 5xx answer."""

    error: ErrorBody


class PromptLogprob(BaseModel):
    """vLLM's prompt_logprobs entry for one candidate token of a prompt position."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


class PromptTokensDetails(BaseModel):
    cached_tokens: int  # prompt tokens whose KV came from the prefix cache (OpenAI's and vLLM's field)


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails


class ModelCard(BaseModel):
    model_config = ConfigDict(extra="allow")  # several models: each card names its export's precision too

    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str
    max_model_len: int


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class Health(BaseModel):
    """The replica's state: its engine's counters (rows, tokens, batches, steps, joins, ...) and memory."""

    model_config = ConfigDict(extra="allow")

    status: Literal["ok"]
    model: str
    replica: str
    backend: str
    provider: str
    running: int
    waiting: int
    kv_cache: Literal["in-place", "growing", "slots"] | None = None  # the ort backend's cache form (None: a backend's own)
    kv_cache_dtype: str | None = None  # the ort and openvino backends' (int8, float32, float16, bfloat16; None: another's)
    # A joining prompt's chunk beside R requests running: prefill_chunk + prefill_chunk_per_row * R tokens (0: whole;
    # per row 1 on the fixed slots, -1 under --max-num-batched-tokens, at least one token then; None: no prompt joins)
    prefill_chunk: int | None = None
    prefill_chunk_per_row: int | None = None
    rss_mb: float | None = None
    max_rss_mb: float | None = None


def _text_to_tokenize(value: Any) -> Any:
    """/tokenize's prompt is a text only (not a completions prompt's lists): said so, rather than every type a union tried."""
    if value is not None and not isinstance(value, str):
        raise PydanticCustomError("tokenize_prompt", "must be a string (the text to tokenize)")
    return value


class TokenizeRequest(BaseModel):
    """The body of POST /tokenize: vLLM's TokenizeCompletionRequest."""

    model_config = ConfigDict(extra="allow", strict=True)

    prompt: Annotated[str | None, BeforeValidator(_text_to_tokenize)] = Field(None, description=(
        "The text to tokenize, as a completion's prompt is (<|endoftext|> is its token). This, or `messages`."))
    messages: list[dict[str, Any]] | None = Field(None, description=(
        "vLLM's TokenizeChatRequest: a conversation, rendered by the chat template as /v1/chat/completions renders "
        "it, then tokenized."))
    add_generation_prompt: bool | None = Field(True, description="With messages: the assistant turn opening added.")
    continue_final_message: bool | None = Field(False, description="With messages: the last message left open.")
    model: str | None = Field(None, description="The served model's id; another is a 404.")
    add_special_tokens: bool | None = Field(True, description="Accepted for vLLM's sake: GPT-2's tokenizer adds none.")
    return_token_strs: bool | None = Field(False, description="Also each token's text (`token_strs`).")


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class Version(BaseModel):
    version: str


class DetokenizeRequest(BaseModel):
    """The body of POST /detokenize: vLLM's DetokenizeRequest."""

    model_config = ConfigDict(extra="allow", strict=True)

    tokens: list[TokenId] = Field(description="Token ids, each in [0, vocabulary).")
    model: str | None = Field(None, description="The served model's id; another is a 404.")


class DetokenizeResponse(BaseModel):
    prompt: str
