"""The OpenAI completions API as gpt2x serves it: the request body (a pydantic model, which is also
the schema /openapi.json publishes), its validation (every bad field is one OpenAI-style error with a
4xx status and the field in `param`), the response and stream-chunk shapes, and the text and logprobs
of a choice as tokens arrive (stop strings, UTF-8 split across tokens).

Fields: `prompt` (a string, a list of strings, a list of token ids, or a list of lists of token ids;
ids in [0, vocab)), `max_tokens` (default 16, as OpenAI's; capped by the context; 0 only with `echo`:
the prompt scored, nothing generated), `temperature` (0 = greedy), `top_p`, `seed` (the sampling
defaults are SamplingSettings', those of `gpt2x generate`: temperature 1, top-p 1, top-k off), `stop` (a string
or up to 4), `n` (choices per prompt, up to 128 choices in all: choice i of a prompt seeded seed + i,
vLLM's rule), `best_of` (1), `stream`, `stream_options.include_usage`, `echo`, `logprobs` (0 to 5),
`presence_penalty` and `frequency_penalty` (OpenAI's, [-2, 2]), `logit_bias` (token id -> bias in
[-100, 100]), `user` (ignored), and vLLM's extensions: `top_k`, `min_p`, `repetition_penalty`,
`min_tokens`, `stop_token_ids`, `ignore_eos`, `allowed_token_ids`, `truncate_prompt_tokens` and
`truncation_side`, `prompt_logprobs`, `return_token_ids`, `return_tokens_as_token_ids`,
`include_stop_str_in_output`, `use_beam_search` (generation.beam) and `request_id`. The sampling ones
map to SamplingSettings fields (generation.processors applies them). Fields that would change the
output and are not supported (`best_of` > 1, `suffix`, vLLM's in REFUSED_FIELDS) are refused with a
400 naming them, not ignored; fields neither OpenAI nor vLLM defines are ignored (and logged once), as
vLLM ignores them. docs/serving-fields.md lists every field.

Logprobs (`logprobs: k`), as OpenAI's legacy completions give them: per token, `tokens` (its text),
`token_logprobs` (its log-probability), `top_logprobs` ({token: logprob} of the k most likely tokens,
most likely first, plus the chosen token where it is not among them) and `text_offset` (where the
token starts in the choice's text; with `echo`, counted from the start of the prompt). They are the
raw model distribution: log_softmax of the logits, before temperature, top-k and top-p (vLLM's
default, `raw_logprobs`), so a request scores the same whatever its sampling settings. A token whose
bytes are not UTF-8 on their own (part of a character) is written `bytes:\\xNN...`, as OpenAI's legacy
completions write such tokens (vLLM writes U+FFFD): every token has its own string, so no two collide
in a `top_logprobs` dict. The end-of-text token that ends a choice (finish_reason "stop") is listed
last, as `<|endoftext|>` with no text, as vLLM lists it (lm-eval reads a prompt's logprobs as
`token_logprobs[ctxlen:-1]`, dropping the one token generated); `usage` does not count it. With
`echo`, the prompt's tokens come first, the first with null logprob and top_logprobs; they come from
one forward of the prompt in the engine (core/engine.py), as its row starts. A replica with a draft
decodes a request with logprobs without the draft. Streamed, each chunk carries the logprobs of the
tokens whose text it releases (a token whose text is held back, part of a character or of a
possible stop string, comes with the chunk that releases it).
"""

from __future__ import annotations

import codecs
import json
import logging
import math
import os
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import cache
from typing import Annotated, Any, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, ValidationError

from ...errors import MissingDependencyError, UsageError
from ...generation.constraints import ConstraintKind, ConstraintSpec
from ...generation.logprobs import LogprobEntry
from ...generation.settings import BIAS_RANGE, PENALTY_RANGE, Finish, SamplingSettings
from ...tokenizer import EOT_ID, VOCAB_SIZE, StreamDecoder, decode, encode, get_encoding

log = logging.getLogger(__name__)
_warned: set[str] = set()  # unknown request fields already logged

MAX_STOP = 4  # stop strings per request, as OpenAI's limit
MAX_PROMPTS = 64  # prompts per request
DEFAULT_MAX_TOKENS = 16  # OpenAI's default for completions
MAX_LOGPROBS = 5  # OpenAI's limit for the legacy completions' `logprobs`
MAX_CHOICES = 128  # n x prompts per request (OpenAI's n is at most 128)
MAX_STOP_TOKEN_IDS = 64  # stop_token_ids per request
MAX_PROMPT_LOGPROBS = 20  # vLLM's default max_logprobs
# vLLM's request fields gpt2x does not implement: a 400 naming the field when given (not null), with why.
REFUSED_FIELDS = {
    "logits_processors": "custom logits processors are not served",
    "bad_words": "bad_words is not implemented (logit_bias -100 bans single tokens)",
    "prompt_embeds": "prompts as embeddings are not served",
    "cache_salt": "cache_salt is not implemented: the prefix cache is shared by every request",
    "kv_transfer_params": "disaggregated prefill is not served",
    "vllm_xargs": "vllm_xargs is not served",
    "guided_json": "guided_json was removed from vLLM: send structured_outputs.json",
    "guided_regex": "guided_regex was removed from vLLM: send structured_outputs.regex",
    "guided_choice": "guided_choice was removed from vLLM: send structured_outputs.choice",
    "guided_grammar": "guided_grammar was removed from vLLM: send structured_outputs.grammar",
    "guided_decoding_backend": "the structured output backend is llguidance, not chosen per request",
    "guided_whitespace_pattern": "guided_whitespace_pattern is not served",
    "structural_tag": "structural_tag is not served",
    "return_logprobs": "not a completions field: send logprobs",
}



class APIError(Exception):
    """An OpenAI-style error: HTTP status, message, type, and the parameter at fault."""

    def __init__(self, status: int, message: str, type: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code

    def body(self) -> ErrorResponse:
        return ErrorResponse(error=ErrorBody(message=self.message, type=self.type, param=self.param, code=self.code))


def bad(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param=param, code=code)


# ------------------------------------------------------------------ the request body

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


class StructuredOutputs(BaseModel):
    """vLLM's structured_outputs: exactly one of a JSON schema, a regex, a list of choices, a grammar
    (Lark or GBNF), or any JSON object."""

    model_config = ConfigDict(extra="allow", strict=True)

    json_: dict[str, Any] | str | bool | None = Field(None, alias="json", description="A JSON schema (an object or its text).")
    regex: str | None = Field(None, description="The text fully matches this regular expression.")
    choice: Annotated[list[str], Field(min_length=1)] | None = Field(None, description="The text is one of these.")
    grammar: str | None = Field(None, description="A Lark (`start:`) or GBNF (`root ::=`) grammar the text satisfies.")
    json_object: bool | None = Field(None, description="The text is any JSON object.")


class CompletionParams(BaseModel):
    """The body of POST /v1/completions: OpenAI's completions request, with vLLM's `top_k` and
    `truncate_prompt_tokens`. Types are strict (no "5" for 5); unknown fields are ignored."""

    model_config = ConfigDict(extra="allow", strict=True, title="CompletionRequest")

    prompt: (str | Annotated[list[str], Field(min_length=1, max_length=MAX_PROMPTS)] | TokenIds
             | Annotated[list[TokenIds], Field(min_length=1, max_length=MAX_PROMPTS)]) = Field(
        description="One prompt (a string, or its token ids) or several (a list of strings, or a list of "
                    "token id lists), each completed as if sent alone: one choice per prompt. An empty "
                    "string starts a document (<|endoftext|>).")
    model: str | None = Field(None, description="The served model's id (GET /v1/models); another is a 404.")
    max_tokens: Integer_(ge=0) | None = Field(DEFAULT_MAX_TOKENS, description="Tokens to generate per prompt, capped by "
                                   "the context; 0 only with `echo` (the prompt scored, nothing generated).")
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
    logprobs: Integer_(ge=0, le=MAX_LOGPROBS) | None = Field(None, description=(
        "Per token: its log-probability under the raw model distribution (log_softmax of the logits, "
        "before temperature, top-k and top-p) and the `logprobs` most likely tokens."))
    echo: bool | None = Field(False, description="The prompt before the completion (and its tokens' logprobs "
                              "with `logprobs`).")
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


class PromptTokensDetails(BaseModel):
    cached_tokens: int  # prompt tokens whose KV came from the prefix cache (OpenAI's and vLLM's field)


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails


class CompletionResponse(BaseModel):
    """A whole completion, or one chunk of a stream (`text/event-stream`: `data: {chunk}` events, then
    `data: [DONE]`; the chunks have this shape, the usage chunk an empty `choices`)."""

    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[Choice]
    usage: Usage | None = None


class ModelCard(BaseModel):
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
    rss_mb: float | None = None
    max_rss_mb: float | None = None


# ------------------------------------------------------------------ validation


_TYPE_MISMATCH = ("_type", "_parsing", "is_instance_of", "literal_error", "union_tag")
_UNION_MESSAGES = {
    "prompt": "prompt must be a string, a non-empty list of strings, a non-empty list of token ids, or a non-empty "
              f"list of non-empty token id lists (at most {MAX_PROMPTS} prompts; ids in [0, {VOCAB_SIZE}))",
    "stop": f"stop must be a non-empty string or a list of at most {MAX_STOP} non-empty strings",
}


_TOKEN_ID_FIELDS = ("prompt", "stop_token_ids", "allowed_token_ids", "tokens")


def validation_error(errors: list[dict[str, Any]]) -> APIError:
    """One 400 for pydantic's (or FastAPI's) validation errors: `param` the field at fault, the message
    its first informative error (a bound or a length rather than every type a union tried)."""
    body_errors = [dict(e, loc=tuple(e.get("loc", ()))[1:] if tuple(e.get("loc", ()))[:1] == ("body",)
                        else tuple(e.get("loc", ()))) for e in errors]
    if not body_errors:
        return bad("invalid request")
    informative = [e for e in body_errors if not str(e.get("type", "")).endswith(_TYPE_MISMATCH)]
    error = (informative or body_errors)[0]
    loc = error["loc"]
    param = str(loc[0]) if loc else None
    if param in _UNION_MESSAGES and not informative:
        return bad(_UNION_MESSAGES[param], param)
    if param in _TOKEN_ID_FIELDS and error.get("type") == "less_than_equal" and isinstance(error.get("input"), int):
        # a token id past the vocabulary (the schema's bound): vLLM's words for it
        return bad(f"{param}: token id {error['input']} is out of vocabulary (ids are in [0, {VOCAB_SIZE}))", param)
    where = (param or "body") + "".join(f"[{x}]" for x in loc[1:] if isinstance(x, int))
    if len(loc) > 1 and isinstance(loc[1], str) and loc[1].isidentifier() and loc[1] not in ("str", "int", "float", "bool"):
        where += "." + loc[1]  # a nested object's field (stream_options.include_usage), not a union's member
    shown = json.dumps(error.get("input"), default=str)[:40] if "input" in error else ""
    message = f"{where}: {error.get('msg', 'invalid value')}" + (f", got {shown}" if shown else "")
    if error.get("type") == "missing":
        message = f"{where} is required"
    return bad(message, param)


def _reject_constant(name: str) -> None:
    raise ValueError(f"{name} is not JSON")


@dataclass
class CompletionRequest:
    prompts: list[str]  # each prompt's text (as sent; decoded from its ids for ids or a truncated prompt)
    prompt_ids: list[list[int]]
    max_tokens: list[int]  # per prompt, capped so that prompt and completion fit the context
    temperature: float = SamplingSettings.temperature  # 0: greedy (SamplingSettings' rule)
    top_p: float = SamplingSettings.top_p
    top_k: int = SamplingSettings.top_k  # 0: off
    seed: int = 0
    stop: tuple[str, ...] = ()
    stream: bool = False
    include_usage: bool = False
    echo: bool = False
    logprobs: int | None = None  # the k most likely tokens to list per token (None: no logprobs)
    n: int = 1  # choices per prompt (choice i of a prompt seeded seed + i)
    presence_penalty: float = SamplingSettings.presence_penalty
    frequency_penalty: float = SamplingSettings.frequency_penalty
    repetition_penalty: float = SamplingSettings.repetition_penalty
    logit_bias: tuple[tuple[int, float], ...] = ()
    min_p: float = SamplingSettings.min_p
    min_tokens: int = SamplingSettings.min_tokens
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    constraint: ConstraintSpec | None = None  # structured output (response_format or structured_outputs)
    allowed_token_ids: tuple[int, ...] = ()  # only these can be sampled (() = all)
    prompt_logprobs: int | None = None  # vLLM's: each prompt token's logprob, rank and the k most likely
    return_token_ids: bool = False  # vLLM's prompt_token_ids and token_ids on each choice
    tokens_as_ids: bool = False  # logprobs name tokens `token_id:ID` (return_tokens_as_token_ids)
    include_stop_str: bool = False  # the stop string that ended a choice stays in its text
    continuous_usage: bool = False  # every chunk carries the usage so far (stream_options.continuous_usage_stats)
    beams: int = 0  # use_beam_search: the n best of n beams (0: sampling)
    priority: int = 0  # vLLM's: lower runs earlier (with the priority scheduling policy)
    length_penalty: float = SamplingSettings.length_penalty
    model: str = ""
    id: str = field(default_factory=lambda: "cmpl-" + uuid.uuid4().hex)
    created: int = field(default_factory=lambda: int(time.time()))

    @property
    def choices(self) -> int:
        """Choices in the response: n per prompt, prompt by prompt (choice p * n + i: prompt p's i-th)."""
        return len(self.prompts) * self.n

    def settings(self, budget: int, i: int = 0) -> SamplingSettings:
        """The sampling settings of a prompt's choice i, whose token budget is `budget` (its max_tokens
        capped by the context): the request's seed + i (vLLM's rule for n's seeds)."""
        return SamplingSettings(
            max_new_tokens=max(budget, 1), temperature=self.temperature,  # 0: greedy (SamplingSettings' rule)
            top_k=self.top_k, top_p=self.top_p, seed=self.seed + i, ignore_eos=self.ignore_eos,
            presence_penalty=self.presence_penalty, frequency_penalty=self.frequency_penalty,
            repetition_penalty=self.repetition_penalty, logit_bias=self.logit_bias, min_p=self.min_p,
            min_tokens=min(self.min_tokens, max(budget, 1)), stop_token_ids=self.stop_token_ids,
            constraint=self.constraint, allowed_token_ids=self.allowed_token_ids,
            **(dict(num_beams=self.beams, length_penalty=self.length_penalty) if self.beams else {}),
        )


def _refuse_unsupported(p: CompletionParams) -> None:
    """Fields that would change the output and that gpt2x does not implement: refused, not ignored.
    Fields no API defines are ignored, as vLLM ignores them, and logged (once per name)."""
    for name, value in (p.model_extra or {}).items():
        if name in REFUSED_FIELDS:
            if value is not None:
                raise bad(f"{name} is not supported: {REFUSED_FIELDS[name]}", name)
        elif name not in _warned:
            _warned.add(name)
            log.warning("ignoring the completions request field %r, which neither OpenAI nor vLLM defines", name[:64])
    if p.prompt_logprobs is not None and not 0 <= p.prompt_logprobs <= MAX_PROMPT_LOGPROBS:
        whole = " (-1, the whole vocabulary, is not served)" if p.prompt_logprobs == -1 else ""
        raise bad(f"prompt_logprobs must be between 0 and {MAX_PROMPT_LOGPROBS}, got {p.prompt_logprobs}{whole}",
                  "prompt_logprobs")
    if p.length_penalty not in (None, 1.0) and not p.use_beam_search:
        raise bad("length_penalty applies to beam search only: send use_beam_search", "length_penalty")
    if p.truncation_side is not None and p.truncate_prompt_tokens is None:
        raise bad("truncation_side needs truncate_prompt_tokens", "truncation_side")
    if p.best_of not in (None, 1):
        raise bad("best_of is not supported (deprecated by OpenAI and removed from vLLM): use n for several "
                  "choices", "best_of")
    if p.suffix:
        raise bad("suffix is not supported", "suffix")


def _token_ids_in(ids: list[int], vocab_size: int, name: str) -> None:
    for tok in ids:
        if not 0 <= tok < vocab_size:
            raise bad(f"{name}: token id {tok} is out of vocabulary (ids are in [0, {vocab_size}))", name)


def _sampling(p: CompletionParams, n_prompts: int, max_tokens: int, vocab_size: int) -> dict[str, Any]:
    """The sampling fields of the request, checked as SamplingSettings checks them (one 400 naming the
    field), beyond their types and ranges: n x prompts, token ids in the model's vocabulary,
    min_tokens at most max_tokens."""
    n = 1 if p.n is None else p.n
    if n * n_prompts > MAX_CHOICES:
        raise bad(f"n x prompts is {n} x {n_prompts} = {n * n_prompts} choices; at most {MAX_CHOICES} per request", "n")
    bias = {int(k): v for k, v in (p.logit_bias or {}).items()}
    _token_ids_in(list(bias), vocab_size, "logit_bias")
    stop_ids = list(p.stop_token_ids or [])
    _token_ids_in(stop_ids, vocab_size, "stop_token_ids")
    allowed = list(p.allowed_token_ids or [])
    _token_ids_in(allowed, vocab_size, "allowed_token_ids")
    min_tokens = p.min_tokens or 0
    if max_tokens and min_tokens > max_tokens:
        raise bad(f"min_tokens must be at most max_tokens ({max_tokens}), got {min_tokens}", "min_tokens")
    constraint, constraint_param = _constraint(p)
    fields = dict(
        constraint=constraint,
        presence_penalty=p.presence_penalty or 0.0, frequency_penalty=p.frequency_penalty or 0.0,
        repetition_penalty=SamplingSettings.repetition_penalty if p.repetition_penalty is None else p.repetition_penalty,
        logit_bias=bias, min_p=p.min_p or 0.0, min_tokens=min_tokens, stop_token_ids=stop_ids,
        ignore_eos=bool(p.ignore_eos), allowed_token_ids=allowed,
    )
    beams = {}
    if p.use_beam_search:
        _refuse_with_beams(p)
        beams = dict(num_beams=n, length_penalty=1.0 if p.length_penalty is None else p.length_penalty) if n > 1 else {}
    try:
        checked = SamplingSettings(max_new_tokens=max(max_tokens, min_tokens, 1), **fields, **beams)
    except UsageError as e:  # what the schema's ranges let through and the settings refuse
        param = "use_beam_search" if e.option == "num_beams" else e.option
        raise bad(str(e).replace("num_beams", "use_beam_search with n"),
                  constraint_param if e.option in {k.value for k in ConstraintKind} else param) from None
    out = dict(fields, n=n, logit_bias=checked.logit_bias, stop_token_ids=checked.stop_token_ids,
               allowed_token_ids=checked.allowed_token_ids)
    if p.use_beam_search:  # n = 1: one beam, the argmax at every step
        out.update(beams=n if n > 1 else 0, length_penalty=checked.length_penalty, greedy=n == 1)
    return out


def _refuse_with_beams(p: CompletionParams) -> None:
    """What beam search (generation.beam: transformers' beam search on the raw distribution, one search
    per prompt) does not combine with: a 400 naming the field."""
    sampling = {"temperature": (p.temperature, (None, 1.0, 0.0)), "top_p": (p.top_p, (None, 1.0)),
                "top_k": (p.top_k, (None, 0, -1)), "min_p": (p.min_p, (None, 0.0))}
    for name, (value, neutral) in sampling.items():
        if value not in neutral:
            raise bad(f"{name} is {value}: beam search scores the raw distribution (use_beam_search takes no "
                      "sampling settings)", name)
    for name in ("stop", "logprobs", "prompt_logprobs", "min_tokens"):
        if getattr(p, name):
            raise bad(f"{name} is not served with use_beam_search", name)
    if p.echo:
        raise bad("echo is not served with use_beam_search", "echo")


def _constraint(p: CompletionParams) -> tuple[ConstraintSpec | None, str | None]:
    """The request's structured-output constraint and the field it came from (one of response_format
    and structured_outputs, with one constraint), or (None, None)."""
    given = []
    if p.response_format is not None and p.response_format.type != "text":
        fmt = p.response_format
        if fmt.type == "json_object":
            given.append((ConstraintSpec.json_object(), "response_format"))
        elif fmt.json_schema is None or fmt.json_schema.schema_ is None:
            raise bad("response_format of type json_schema needs json_schema.schema", "response_format")
        else:
            given.append((_spec(ConstraintSpec.json_schema, fmt.json_schema.schema_, "response_format"), "response_format"))
    if p.structured_outputs is not None:
        so = p.structured_outputs
        kinds = [(name, value) for name, value in (("json", so.json_), ("regex", so.regex), ("choice", so.choice),
                                                    ("grammar", so.grammar)) if value is not None]
        kinds += [("json_object", True)] if so.json_object else []
        if len(kinds) != 1:
            raise bad("structured_outputs takes exactly one of json, regex, choice, grammar and json_object, got "
                      + (", ".join(k for k, _ in kinds) or "none"), "structured_outputs")
        name, value = kinds[0]
        build = {"json": ConstraintSpec.json_schema, "regex": ConstraintSpec.regex, "choice": ConstraintSpec.choice,
                 "grammar": ConstraintSpec.grammar, "json_object": lambda _: ConstraintSpec.json_object()}[name]
        given.append((_spec(build, value, "structured_outputs"), "structured_outputs"))
    if len(given) > 1:
        raise bad("response_format and structured_outputs each set a constraint: send one", "structured_outputs")
    return given[0] if given else (None, None)


def _spec(build: Callable[[Any], ConstraintSpec], value: Any, param: str) -> ConstraintSpec:
    try:
        return build(value).validate()  # an invalid schema, regex or grammar: a 400, before any work
    except UsageError as e:
        raise bad(f"{param}: {e}", param) from None
    except MissingDependencyError as e:
        raise APIError(501, str(e), param=param, code="not_implemented") from None


def _prompts(p: CompletionParams, vocab_size: int) -> tuple[list[str | None], list[list[int] | None]]:
    """Each prompt as text (None for ids) and as ids (None for text), in order."""
    prompt = p.prompt
    if isinstance(prompt, str):
        return [prompt], [None]
    if isinstance(prompt[0], str):
        return list(prompt), [None] * len(prompt)
    lists = [prompt] if isinstance(prompt[0], int) else prompt
    for i, ids in enumerate(lists):
        for j, tok in enumerate(ids):
            if not 0 <= tok < vocab_size:
                at = f"prompt[{j}]" if lists is not prompt else f"prompt[{i}][{j}]"
                raise bad(f"{at}: token id {tok} is out of vocabulary (ids are in [0, {vocab_size}))", "prompt")
    return [None] * len(lists), [list(ids) for ids in lists]


def _stop(p: CompletionParams) -> tuple[str, ...]:
    stop = [p.stop] if isinstance(p.stop, str) else p.stop or []
    if not all(stop):
        raise bad(f"stop must be a non-empty string or a list of at most {MAX_STOP} non-empty strings", "stop")
    return tuple(stop)


def parse_request(raw: bytes, served_model: str, n_positions: int, vocab_size: int = VOCAB_SIZE) -> CompletionRequest:
    """A validated completions request from the raw body, or an APIError (400 for a bad field, 404
    for a model other than the one served)."""
    try:
        body = json.loads(raw, parse_constant=_reject_constant)
    except (UnicodeDecodeError, ValueError) as e:
        raise bad(f"the body is not valid JSON: {e}") from None
    if not isinstance(body, dict):
        raise bad("the body must be a JSON object")
    model = body.get("model")
    if isinstance(model, str) and model != served_model:
        raise APIError(404, f"the model {model[:100]!r} does not exist; this server serves {served_model!r}",
                       param="model", code="model_not_found")
    try:
        p = CompletionParams.model_validate(body)
    except ValidationError as e:
        raise validation_error(e.errors(include_url=False)) from None
    _refuse_unsupported(p)
    if p.stream_options is not None and not p.stream:
        raise bad("stream_options can only be given with stream: true", "stream_options")
    echo = bool(p.echo)
    max_tokens = DEFAULT_MAX_TOKENS if p.max_tokens is None else p.max_tokens
    if max_tokens == 0 and not echo:
        raise bad("max_tokens is 0: nothing to generate (0 is for scoring a prompt, with echo)", "max_tokens")
    if max_tokens > n_positions:
        raise bad(f"max_tokens must be between 1 and the model's context ({n_positions}), got {max_tokens}", "max_tokens")
    truncate = p.truncate_prompt_tokens
    if truncate is not None and not truncate < n_positions:
        raise bad(f"truncate_prompt_tokens must be between 1 and {n_positions - 1}, got {truncate}", "truncate_prompt_tokens")
    texts, given_ids = _prompts(p, vocab_size)
    prompts, ids = [], []
    room = n_positions if max_tokens == 0 else n_positions - 1  # a completion needs one position at least
    for text, tokens in zip(texts, given_ids):
        if tokens is None:
            tokens = encode(text) or [EOT_ID]  # an empty prompt starts a document, as gpt2x generate does
        if truncate is not None and len(tokens) > truncate:
            tokens, text = (tokens[:truncate] if p.truncation_side == "right" else tokens[-truncate:]), None
        if text is not None and not text.isascii():
            try:
                text.encode("utf-8")
            except UnicodeEncodeError:  # a lone surrogate, which the tokenizer replaced: echo what it read
                text = None
        if len(tokens) > room:
            raise bad(f"the prompt is {len(tokens)} tokens; the model's context is {n_positions} "
                      "(shorten it, or send truncate_prompt_tokens)", "prompt", "context_length_exceeded")
        prompts.append(text if text is not None else decode(tokens))
        ids.append(tokens)
    stop = _stop(p)
    options = p.stream_options or StreamOptions()
    sampling = _sampling(p, len(ids), max_tokens, vocab_size)
    one_beam = sampling.pop("greedy", False)  # use_beam_search with n = 1: greedy decoding
    return CompletionRequest(
        prompts=prompts, prompt_ids=ids,
        max_tokens=[min(max_tokens, n_positions - len(t)) for t in ids],  # capped by the context
        temperature=0.0 if one_beam else SamplingSettings.temperature if p.temperature is None else p.temperature,
        top_p=SamplingSettings.top_p if p.top_p is None else p.top_p,
        top_k=SamplingSettings.top_k if p.top_k is None else max(0, p.top_k),  # vLLM's -1: off, as 0
        seed=p.seed if p.seed is not None else int.from_bytes(os.urandom(4), "little"),
        stop=stop, stream=bool(p.stream), include_usage=bool(options.include_usage),
        continuous_usage=bool(options.include_usage and options.continuous_usage_stats),
        echo=echo, logprobs=p.logprobs, model=served_model, prompt_logprobs=p.prompt_logprobs,
        return_token_ids=bool(p.return_token_ids), tokens_as_ids=bool(p.return_tokens_as_token_ids),
        include_stop_str=bool(p.include_stop_str_in_output), priority=p.priority or 0, **sampling,
        **({"id": "cmpl-" + p.request_id} if p.request_id else {}),
    )


# ------------------------------------------------------------------ a choice's text and logprobs


class ChoiceText:
    """The text of one choice as its tokens arrive: decoded without splitting UTF-8 characters, cut
    at the first stop string, and released only once no stop string can still begin in it. With
    `min_tokens` (vLLM's), a stop string is looked for only after the text of the first min_tokens
    tokens: none ends the choice before it has that many. `include_stop` (vLLM's
    include_stop_str_in_output): the stop string found stays at the end of the text."""

    def __init__(self, stop: tuple[str, ...] = (), min_tokens: int = 0, include_stop: bool = False):
        self.stop = stop
        self.min_tokens = min_tokens
        self.include_stop = include_stop
        self._decoder = StreamDecoder()
        self.text = ""  # decoded so far (cut at a stop string once one is found)
        self.sent = 0  # characters of text released
        self.stopped = False  # a stop string was found
        self.tokens = 0  # completion tokens counted for usage
        self.floor = 0  # where a stop string may begin: after the text of the first min_tokens tokens

    def push(self, token: int) -> str:
        """Text that can be released after `token` (nothing once a stop string has ended the text)."""
        if self.stopped:
            return ""
        self.tokens += 1
        self.text += self._decoder.push(token)
        if self.tokens <= self.min_tokens:
            self.floor = len(self.text)
        return self._release(final=False)

    def finish(self) -> str:
        """The rest of the text, once no more tokens come."""
        if self.stopped:
            return ""
        self.text += self._decoder.flush()
        return self._release(final=True)

    def _release(self, final: bool) -> str:
        if self.stop and not self.stopped:
            start = max(self.floor, self.sent - max(len(s) for s in self.stop))
            hits = [(i, len(s)) for s in self.stop if (i := self.text.find(s, start)) >= 0]
            if hits:
                at, length = min(hits)  # the first stop string found (the shortest of those found there)
                self.text = self.text[: at + (length if self.include_stop else 0)]
                self.stopped = True
                final = True
        end = len(self.text)
        if not final and self.stop:
            end -= max((k for s in self.stop for k in range(1, len(s))
                        if self.text.endswith(s[:k]) and end - k >= self.floor), default=0)
        out = self.text[self.sent : end]
        self.sent = max(self.sent, end)
        return out


@cache
def token_text(token: int) -> str:
    """A token as logprobs list it: its bytes as UTF-8, or `bytes:\\xNN...` (OpenAI's form) where they
    are not UTF-8 on their own (part of a character)."""
    data = get_encoding().decode_single_token_bytes(token)
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        return "bytes:" + "".join(f"\\x{b:02x}" for b in data)


def token_namer(as_ids: bool) -> Callable[[int], str]:
    """How logprobs name a token: its text, or `token_id:ID` (vLLM's return_tokens_as_token_ids)."""
    return _token_id_name if as_ids else token_text


def _token_id_name(token: int) -> str:
    """A token as vLLM's return_tokens_as_token_ids names it."""
    return f"token_id:{token}"


def prompt_logprobs(entries: list[LogprobEntry], ranks: list[int | None], k: int,
                    name: Callable[[int], str] = token_text) -> list[dict[str, PromptLogprob] | None]:
    """A prompt's logprobs in vLLM's shape: per position (the first null) the k most likely tokens and
    the prompt's own token, keyed by id, each with its log-probability, rank (1: the most likely) and text."""
    out: list[dict[str, PromptLogprob] | None] = []
    for (token, logprob, top), rank in zip(entries, ranks):
        if logprob is None:
            out.append(None)
            continue
        best = {str(t): PromptLogprob(logprob=_logprob(v), rank=r, decoded_token=name(t))
                for r, (t, v) in enumerate((top or [])[:k], start=1)}
        best.setdefault(str(token), PromptLogprob(logprob=_logprob(logprob), rank=rank, decoded_token=name(token)))
        out.append(best)
    return out


def _logprob(value: float | None) -> float | None:
    """A log-probability JSON can carry: -inf (a token a backend masks out) as -9999.0, OpenAI's floor."""
    if value is None or math.isnan(value):
        return None
    return max(float(value), -9999.0)


class ChoiceLogprobs:
    """One choice's logprobs in OpenAI's legacy shape, gathered as its tokens arrive; `take()` hands
    over what was gathered since the last take (a stream chunk carries the logprobs of its tokens)."""

    def __init__(self, as_ids: bool = False):
        self.name = _token_id_name if as_ids else token_text  # return_tokens_as_token_ids: `token_id:ID`
        self.tokens: list[str] = []
        self.token_logprobs: list[float | None] = []
        self.top_logprobs: list[dict[str, float] | None] = []
        self.text_offset: list[int] = []
        self.taken = 0

    def add(self, entry: LogprobEntry, offset: int) -> None:
        token, logprob, top = entry
        self.tokens.append(self.name(token))
        self.token_logprobs.append(_logprob(logprob))
        if top is None:
            self.top_logprobs.append(None)
        else:
            best = {self.name(t): _logprob(v) for t, v in top}  # most likely first
            best.setdefault(self.name(token), _logprob(logprob))  # the chosen token, as OpenAI includes it
            self.top_logprobs.append(best)
        self.text_offset.append(offset)

    def add_prompt(self, entries: list[LogprobEntry], start: int = 0) -> None:
        """A prompt's tokens, their offsets counted from `start` in the prompt's text."""
        utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")
        enc = get_encoding()
        offset = start
        for entry in entries:
            self.add(entry, offset)
            offset += len(utf8.decode(enc.decode_single_token_bytes(entry[0])))

    def whole(self) -> dict:
        return {"tokens": self.tokens, "token_logprobs": self.token_logprobs, "top_logprobs": self.top_logprobs,
                "text_offset": self.text_offset}

    def take(self) -> dict:
        n, self.taken = self.taken, len(self.tokens)
        return {"tokens": self.tokens[n:], "token_logprobs": self.token_logprobs[n:],
                "top_logprobs": self.top_logprobs[n:], "text_offset": self.text_offset[n:]}


def finish_reason(reason: Finish, text: ChoiceText) -> str:
    """OpenAI's finish_reason for a row's Finish: "stop" for end of text or a stop string, "length" for
    the budget (and the context, which caps it)."""
    return "stop" if text.stopped or reason in (Finish.eos, Finish.stop) else "length"


# The response bodies are the models above (the schema /openapi.json publishes), built once here and
# serialised once (to_json): what a client receives is what the schema says.


def choice(index: int, text: str, reason: str | None, logprobs: dict | None = None, **extra: Any) -> Choice:
    """A choice; `extra`: vLLM's prompt_logprobs, prompt_token_ids and token_ids where asked for."""
    return Choice(index=index, text=text, logprobs=None if logprobs is None else Logprobs(**logprobs), finish_reason=reason,
                  **extra)


def usage(req: CompletionRequest, texts: list[ChoiceText], cached_tokens: int = 0) -> Usage:
    """Each prompt's tokens once (as vLLM counts them), every choice's completion tokens, and the
    prompt tokens the prefix cache held."""
    prompt = sum(len(p) for p in req.prompt_ids)
    completion = sum(t.tokens for t in texts)
    return Usage(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion,
                 prompt_tokens_details=PromptTokensDetails(cached_tokens=cached_tokens))


def completion(req: CompletionRequest, choices: list[Choice], usage_: Usage | None) -> CompletionResponse:
    return CompletionResponse(id=req.id, created=req.created, model=req.model, choices=choices, usage=usage_)


def to_json(body: BaseModel | dict) -> str:
    """A response body as JSON (compact; a dict: chat.py's bodies). A completion without usage
    (a stream's chunks) leaves the key out, as OpenAI's does; every other field is there, null where
    it has no value."""
    if isinstance(body, dict):
        return json.dumps(body, ensure_ascii=False, separators=(",", ":"))
    exclude = {"usage"} if isinstance(body, CompletionResponse) and body.usage is None else None
    return body.model_dump_json(exclude=exclude)


DONE = "[DONE]"  # a stream's last event


def sse(body: BaseModel | dict | str) -> str:
    """One server-sent event: `data: JSON` (or `data: [DONE]`) and a blank line."""
    return f"data: {body if isinstance(body, str) else to_json(body)}\n\n"


@dataclass(frozen=True, slots=True)
class StreamEvent:
    """One event of a streamed response before it is rendered (`sse`): a chunk, with the finish
    reasons of the choices it ends; an error that ends the stream; or the last, DONE."""

    body: BaseModel | dict | str
    reasons: tuple[str, ...] = ()
    error: bool = False


def model_list(model: str, created: int, max_model_len: int) -> ModelList:
    return ModelList(data=[ModelCard(id=model, created=created, owned_by="gpt2x", max_model_len=max_model_len)])
