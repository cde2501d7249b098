"""A completions request read, checked and turned into what the engine runs: `parse_request` (every
bad field one 400 naming it, a model other than the one served a 404), its sampling fields turned into
one SamplingSettings in one place (`to_sampling_params`, as vLLM's), and the request's other choices
(`CompletionRequest`). Fields that would change the output and are not implemented are refused, not
ignored; fields no API defines are ignored and logged once, as vLLM ignores them."""

from __future__ import annotations

import json
import logging
import os
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

from pydantic import ValidationError

from ...errors import MissingDependencyError, UsageError
from ...generation.constraints import ConstraintKind, ConstraintSpec
from ...generation.processors import ORDER
from ...generation.settings import SamplingSettings
from ...tokenizer import EOT_ID, VOCAB_SIZE, decode, encode
from .errors import APIError, bad, validation_error
from .schema import (
    DEFAULT_MAX_TOKENS,
    MAX_CHOICES,
    MAX_PROMPT_LOGPROBS,
    MAX_STOP,
    CompletionParams,
    StreamOptions,
)

log = logging.getLogger(__name__)
# The logits processors' fields that the completions body names alike (the others it reads in a shape of its own).
PROCESSOR_FIELDS = tuple(f for kind in ORDER for f in kind.fields if f in CompletionParams.model_fields)
_warned: set[str] = set()  # unknown request fields already logged

# vLLM's request fields gpt2x does not implement: a 400 naming the field when given (not null), with why.
REFUSED_FIELDS = {
    "logits_processors": "custom logits processors are not served",
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


@dataclass
class CompletionRequest:
    """A completions request as it is served: its prompts, the sampling settings of its choices (each
    choice's own from `settings`), and what its response carries."""

    prompts: list[str]  # each prompt's text (as sent; decoded from its ids for ids or a truncated prompt)
    prompt_ids: list[list[int]]
    max_tokens: list[int]  # per prompt, capped so that prompt and completion fit the context
    sampling: SamplingSettings = field(default_factory=SamplingSettings)  # to_sampling_params'
    n: int = 1  # choices per prompt (choice i of a prompt seeded seed + i)
    stop: tuple[str, ...] = ()
    stream: bool = False
    include_usage: bool = False
    echo: bool = False
    logprobs: int | None = None  # the k most likely tokens to list per token (None: no logprobs)
    chat_logprobs: bool = False  # logprobs in OpenAI's chat shape (a chat request's logprobs: true)
    chat_echo: str = ""  # vLLM's chat echo: the last message's text, which each choice's content begins with
    prompt_logprobs: int | None = None  # vLLM's: each prompt token's logprob, rank and the k most likely
    return_token_ids: bool = False  # vLLM's prompt_token_ids and token_ids on each choice
    tokens_as_ids: bool = False  # logprobs name tokens `token_id:ID` (return_tokens_as_token_ids)
    include_stop_str: bool = False  # the stop string that ended a choice stays in its text
    continuous_usage: bool = False  # every chunk carries the usage so far (stream_options.continuous_usage_stats)
    priority: int = 0  # vLLM's: lower runs earlier (with the priority scheduling policy)
    model: str = ""
    id: str = field(default_factory=lambda: "cmpl-" + uuid.uuid4().hex)
    created: int = field(default_factory=lambda: int(time.time()))

    @property
    def choices(self) -> int:
        """Choices in the response: n per prompt, prompt by prompt (choice p * n + i: prompt p's i-th)."""
        return len(self.prompts) * self.n

    @property
    def beams(self) -> int:
        """use_beam_search: the n best of n beams, one search per prompt (0: sampling)."""
        return self.sampling.num_beams if self.sampling.num_beams > 1 else 0

    def settings(self, budget: int, i: int = 0) -> SamplingSettings:
        """The sampling settings of a prompt's choice i, whose token budget is `budget` (its max_tokens
        capped by the context): the request's seed + i (vLLM's rule for n's seeds)."""
        return replace(self.sampling, max_new_tokens=max(budget, 1), seed=self.sampling.seed + i,
                       min_tokens=min(self.sampling.min_tokens, max(budget, 1)))


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


def to_sampling_params(p: CompletionParams, n: int, max_tokens: int, vocab_size: int = VOCAB_SIZE) -> SamplingSettings:
    """The request's sampling fields as one SamplingSettings (vLLM's to_sampling_params): the one place
    a sampling field is read. Checked as SamplingSettings checks them, beyond their types and ranges,
    each failure one 400 naming the field: token ids in the model's vocabulary, min_tokens at most
    max_tokens, what beam search does not combine with. Its budget and seed are the request's;
    CompletionRequest.settings gives each choice its own."""
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
    beams: dict[str, Any] = {}
    one_beam = False  # use_beam_search with n = 1: the argmax at every step
    if p.use_beam_search:
        _refuse_with_beams(p)
        if n > 1:
            beams = dict(num_beams=n, length_penalty=1.0 if p.length_penalty is None else p.length_penalty)
        one_beam = n == 1
    # A processor's field the body names alike means what it means there: handed on as it is (None: its default).
    same = {f: v for f in PROCESSOR_FIELDS if (v := getattr(p, f)) is not None}
    try:
        return SamplingSettings(**{
            **same,
            "max_new_tokens": max(max_tokens, min_tokens, 1),
            "temperature": 0.0 if one_beam else same.get("temperature", SamplingSettings.temperature),
            "top_k": max(0, same.get("top_k", SamplingSettings.top_k)),  # vLLM's -1: off, as 0
            "seed": p.seed if p.seed is not None else int.from_bytes(os.urandom(4), "little"),
            "logit_bias": bias, "min_tokens": min_tokens, "stop_token_ids": stop_ids, "ignore_eos": bool(p.ignore_eos),
            "allowed_token_ids": allowed, "constraint": constraint, **beams,
        })
    except UsageError as e:  # what the schema's ranges let through and the settings refuse
        param = "use_beam_search" if e.option == "num_beams" else e.option
        raise bad(str(e).replace("num_beams", "use_beam_search with n"),
                  constraint_param if e.option in {k.value for k in ConstraintKind} else param) from None


def _refuse_with_beams(p: CompletionParams) -> None:
    """What beam search (generation.beam: transformers' beam search on the raw distribution, one search
    per prompt) does not combine with: a 400 naming the field."""
    sampling = {"temperature": (p.temperature, (None, 1.0, 0.0)), "top_p": (p.top_p, (None, 1.0)),
                "top_k": (p.top_k, (None, 0, -1)), "min_p": (p.min_p, (None, 0.0)), "typical_p": (p.typical_p, (None, 1.0))}
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
    except RecursionError:  # a schema's checks recurse once per level of nesting
        raise bad(f"{param}: the schema is nested too deeply", param) from None
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


def json_object(raw: bytes) -> dict:
    """A request body read as a JSON object (NaN and Infinity are not JSON), or a 400."""
    try:
        body = json.loads(raw, parse_constant=_reject_constant)
    except (UnicodeDecodeError, ValueError) as e:
        raise bad(f"the body is not valid JSON: {e}") from None
    except RecursionError:  # Python's parser recurses once per level of nesting
        raise bad("the body is nested too deeply to read") from None
    if not isinstance(body, dict):
        raise bad("the body must be a JSON object")
    return body


def _reject_constant(name: str) -> None:
    raise ValueError(f"{name} is not JSON")


def parse_request(raw: bytes, served_model: str, n_positions: int, vocab_size: int = VOCAB_SIZE) -> CompletionRequest:
    """A validated completions request from the raw body, or an APIError (400 for a bad field, 404
    for a model other than the one served)."""
    return request_from_body(json_object(raw), served_model, n_positions, vocab_size)


def request_from_body(body: dict, served_model: str, n_positions: int, vocab_size: int = VOCAB_SIZE) -> CompletionRequest:
    """parse_request on a body already read as a JSON object (chat's, which renders its prompt first)."""
    model = body.get("model")
    if isinstance(model, str) and model and model != served_model:  # "": the served model (vLLM's and llama-server's)
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
    n = 1 if p.n is None else p.n
    if n * len(ids) > MAX_CHOICES:
        raise bad(f"n x prompts is {n} x {len(ids)} = {n * len(ids)} choices; at most {MAX_CHOICES} per request", "n")
    return CompletionRequest(
        prompts=prompts, prompt_ids=ids,
        max_tokens=[min(max_tokens, n_positions - len(t)) for t in ids],  # capped by the context
        sampling=to_sampling_params(p, n, max_tokens, vocab_size), n=n,
        stop=stop, stream=bool(p.stream), include_usage=bool(options.include_usage),
        continuous_usage=bool(options.include_usage and options.continuous_usage_stats),
        echo=echo, logprobs=p.logprobs, model=served_model, prompt_logprobs=p.prompt_logprobs,
        return_token_ids=bool(p.return_token_ids), tokens_as_ids=bool(p.return_tokens_as_token_ids),
        include_stop_str=bool(p.include_stop_str_in_output), priority=p.priority or 0,
        **({"id": "cmpl-" + p.request_id} if p.request_id else {}),
    )
