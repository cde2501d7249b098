"""A request's sampling fields (protocol.SamplingRequest, shared by completions and chat) as one SamplingSettings, in
one place (`to_sampling_params`, as vLLM's), and the fields refused or ignored: fields that would change the output and
are not implemented are refused, not ignored; fields no API defines are ignored and logged once, as vLLM ignores them.
Every failure is one 400 naming the field."""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Mapping
from typing import Any

from ...errors import MissingDependencyError, UsageError
from ...generation.constraints import ConstraintKind, ConstraintSpec
from ...generation.processors import ORDER
from ...generation.settings import SamplingSettings
from .errors import APIError, bad
from .protocol import MAX_PROMPT_LOGPROBS, SamplingRequest

log = logging.getLogger(__name__)
# The logits processors' fields that the request names alike (the others it reads in a shape of its own).
PROCESSOR_FIELDS = tuple(f for kind in ORDER for f in kind.fields if f in SamplingRequest.model_fields)
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


def refuse_unknown(p: SamplingRequest, ignored: tuple[str, ...] = ()) -> None:
    """The fields the request model does not declare: a refused one (REFUSED_FIELDS) given a 400 saying why, one of
    the endpoint's `ignored` dropped, any other ignored and logged once per name (vLLM ignores them)."""
    for name, value in (p.model_extra or {}).items():
        if name in REFUSED_FIELDS:
            if value is not None:
                raise bad(f"{name} is not supported: {REFUSED_FIELDS[name]}", name)
        elif name not in ignored and name not in _warned:
            _warned.add(name)
            log.warning("ignoring the request field %r, which neither OpenAI nor vLLM defines", name[:64])


def refuse_unsupported(p: SamplingRequest) -> None:
    """The declared fields whose values are not served, or not with the others given: a 400 naming the field."""
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
    if p.stream_options is not None and not p.stream:
        raise bad("stream_options can only be given with stream: true", "stream_options")


def _token_ids_in(ids: list[int], vocab_size: int, name: str) -> None:
    for tok in ids:
        if not 0 <= tok < vocab_size:
            raise bad(f"{name}: token id {tok} is out of vocabulary (ids are in [0, {vocab_size}))", name)


def to_sampling_params(p: SamplingRequest, n: int, max_tokens: int, vocab_size: int,
                       scored: Mapping[str, Any] | None = None,
                       constraint: tuple[ConstraintSpec, str] | None = None) -> SamplingSettings:
    """The request's sampling fields as one SamplingSettings (vLLM's to_sampling_params): the one place a sampling
    field is read. Checked as SamplingSettings checks them, beyond their types and ranges, each failure one 400 naming
    the field: token ids in the model's vocabulary, min_tokens at most max_tokens, what beam search does not combine
    with (`scored`: the endpoint's own fields that ask for logprobs or an echo, by name; `constraint`: an endpoint's
    own structured output and its field, chat's tool calls). Its budget and seed are the request's;
    ServedRequest.settings gives each choice its own."""
    bias = {int(k): v for k, v in (p.logit_bias or {}).items()}
    _token_ids_in(list(bias), vocab_size, "logit_bias")
    stop_ids = list(p.stop_token_ids or [])
    _token_ids_in(stop_ids, vocab_size, "stop_token_ids")
    allowed = list(p.allowed_token_ids or [])
    _token_ids_in(allowed, vocab_size, "allowed_token_ids")
    min_tokens = p.min_tokens or 0
    if max_tokens and min_tokens > max_tokens:
        raise bad(f"min_tokens must be at most max_tokens ({max_tokens}), got {min_tokens}", "min_tokens")
    constraint, constraint_param = _constraint(p, constraint)
    beams = _beams(p, n, scored or {})
    # A processor's field the request names alike means what it means there: handed on as it is (None: its default).
    same = {f: v for f in PROCESSOR_FIELDS if (v := getattr(p, f)) is not None}
    try:
        return SamplingSettings(**{
            **same,
            "max_new_tokens": max(max_tokens, min_tokens, 1),
            "temperature": same.get("temperature", SamplingSettings.temperature),
            "top_k": max(0, same.get("top_k", SamplingSettings.top_k)),  # vLLM's -1: off, as 0
            "seed": p.seed if p.seed is not None else int.from_bytes(os.urandom(4), "little"),
            "logit_bias": bias, "min_tokens": min_tokens, "stop_token_ids": stop_ids, "ignore_eos": bool(p.ignore_eos),
            "allowed_token_ids": allowed, "constraint": constraint, **beams,
        })
    except UsageError as e:  # what the schema's ranges let through and the settings refuse
        param = "use_beam_search" if e.option == "num_beams" else e.option
        raise bad(str(e).replace("num_beams", "use_beam_search with n"),
                  constraint_param if e.option in {k.value for k in ConstraintKind} else param) from None


def _beams(p: SamplingRequest, n: int, scored: Mapping[str, Any]) -> dict[str, Any]:
    """use_beam_search's settings: the n best of n beams (n > 1), or the argmax at every step (n = 1)."""
    if not p.use_beam_search:
        return {}
    _refuse_with_beams(p, scored)
    if n == 1:
        return {"temperature": 0.0}
    return {"num_beams": n, "length_penalty": 1.0 if p.length_penalty is None else p.length_penalty}


def _refuse_with_beams(p: SamplingRequest, scored: Mapping[str, Any]) -> None:
    """What beam search (generation.beam: transformers' beam search on the raw distribution, one search per prompt)
    does not combine with: a 400 naming the field."""
    sampling = {"temperature": (p.temperature, (None, 1.0, 0.0)), "top_p": (p.top_p, (None, 1.0)),
                "top_k": (p.top_k, (None, 0, -1)), "min_p": (p.min_p, (None, 0.0)), "typical_p": (p.typical_p, (None, 1.0))}
    for name, (value, neutral) in sampling.items():
        if value not in neutral:
            raise bad(f"{name} is {value}: beam search scores the raw distribution (use_beam_search takes no "
                      "sampling settings)", name)
    served = {"stop": p.stop, "prompt_logprobs": p.prompt_logprobs, "min_tokens": p.min_tokens, **scored}
    for name in ("stop", "logprobs", "prompt_logprobs", "min_tokens", "echo"):
        if served.get(name):
            raise bad(f"{name} is not served with use_beam_search", name)


def _constraint(p: SamplingRequest, own: tuple[ConstraintSpec, str] | None) -> tuple[ConstraintSpec | None, str | None]:
    """The request's structured-output constraint and the field it came from (one of response_format,
    structured_outputs and the endpoint's `own`, with one constraint), or (None, None)."""
    given = [c for c in (_response_format(p), _structured_outputs(p), *_llama_server(p), own) if c is not None]
    if len(given) > 1:
        fields = " and ".join(param for _, param in given)
        raise bad(f"{fields} each set a constraint: send one", given[-1][1])
    return given[0] if given else (None, None)


def json_schema_constraint(schema: dict[str, Any], param: str) -> ConstraintSpec:
    """A JSON schema's constraint, checked (one 400 naming `param` for a schema that cannot be served)."""
    return _spec(ConstraintSpec.json_schema, schema, param)


def _response_format(p: SamplingRequest) -> tuple[ConstraintSpec, str] | None:
    fmt = p.response_format
    if fmt is None or fmt.type == "text":
        if fmt is not None and fmt.schema_ is not None:
            raise bad("response_format of type text takes no schema (send type json_object or json_schema)",
                      "response_format")
        return None
    inner = fmt.json_schema.schema_ if fmt.json_schema is not None else None
    if fmt.schema_ is not None and inner is not None:
        raise bad("response_format has a schema and json_schema.schema: send one", "response_format")
    schema = fmt.schema_ if fmt.schema_ is not None else inner  # llama-server's place for it, or OpenAI's
    if schema is not None:
        return _spec(ConstraintSpec.json_schema, schema, "response_format"), "response_format"
    if fmt.type == "json_object":
        return ConstraintSpec.json_object(), "response_format"
    raise bad("response_format of type json_schema needs json_schema.schema", "response_format")


def _llama_server(p: SamplingRequest) -> list[tuple[ConstraintSpec, str] | None]:
    """llama-server's own fields: `json_schema` (a schema) and `grammar` (GBNF)."""
    return [None if p.json_schema is None else (_spec(ConstraintSpec.json_schema, p.json_schema, "json_schema"), "json_schema"),
            None if p.grammar is None else (_spec(ConstraintSpec.grammar, p.grammar, "grammar"), "grammar")]


_BUILDS: dict[str, Callable[[Any], ConstraintSpec]] = {
    "json": ConstraintSpec.json_schema, "regex": ConstraintSpec.regex, "choice": ConstraintSpec.choice,
    "grammar": ConstraintSpec.grammar, "json_object": lambda _: ConstraintSpec.json_object()}


def _structured_outputs(p: SamplingRequest) -> tuple[ConstraintSpec, str] | None:
    so = p.structured_outputs
    if so is None:
        return None
    kinds = [(name, value) for name, value in (("json", so.json_), ("regex", so.regex), ("choice", so.choice),
                                                ("grammar", so.grammar)) if value is not None]
    kinds += [("json_object", True)] if so.json_object else []
    if len(kinds) != 1:
        raise bad("structured_outputs takes exactly one of json, regex, choice, grammar and json_object, got "
                  + (", ".join(k for k, _ in kinds) or "none"), "structured_outputs")
    name, value = kinds[0]
    return _spec(_BUILDS[name], value, "structured_outputs"), "structured_outputs"


def _spec(build: Callable[[Any], ConstraintSpec], value: Any, param: str) -> ConstraintSpec:
    try:
        return build(value).validate()  # an invalid schema, regex or grammar: a 400, before any work
    except UsageError as e:
        raise bad(f"{param}: {e}", param) from None
    except RecursionError:  # a schema's checks recurse once per level of nesting
        raise bad(f"{param}: the schema is nested too deeply", param) from None
    except MissingDependencyError as e:
        raise APIError(501, str(e), param=param, code="not_implemented") from None
