"""POST /v1/completions served (vLLM's entrypoints/openai/completion/serving.py): `prepare` checks a CompletionRequest
beyond its schema (every bad field one 400 naming it, a model other than the one served a 404) and computes what is
served (pending.ServedRequest: its prompts tokenized, each prompt's budget, its SamplingSettings); `serve` does so for
any endpoint's prompts, and chat calls it with the prompt its template renders. `complete` and `stream` answer from
the engine's events: the whole CompletionResponse, or its chunks as server-sent events."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from functools import partial
from typing import Any, TypeVar

from pydantic import BaseModel, ValidationError

from ....generation.constraints import ConstraintSpec
from ....tokenizer import EOT_ID, VOCAB_SIZE, decode, encode
from .. import render
from ..errors import APIError, bad, json_object, validation_error
from ..pending import ChoiceEvent, Pending, ServedRequest, stream_events
from ..protocol import DEFAULT_MAX_TOKENS, MAX_CHOICES, MAX_STOP, SamplingRequest, Usage
from ..sampling import refuse_unknown, refuse_unsupported, to_sampling_params
from .protocol import Choice, CompletionRequest, CompletionResponse, Logprobs

M = TypeVar("M", bound=BaseModel)


@dataclass(frozen=True)
class ServedModel:
    """What a request is checked against: the served model's id, its context and vocabulary, and whether its server
    schedules by priority (vLLM's --scheduling-policy priority; otherwise a priority is refused)."""

    id: str
    n_positions: int
    vocab_size: int = VOCAB_SIZE
    priority_scheduling: bool = False


def check_model(given: Any, served: str) -> None:
    """A 404 for a model other than the one served ("" or none: the served one, as vLLM and llama-server take it)."""
    if isinstance(given, str) and given and given != served:
        raise APIError(404, f"the model {given[:100]!r} does not exist; this server serves {served!r}",
                       param="model", code="model_not_found")


def parse_request(raw: bytes, served_model: str, n_positions: int, vocab_size: int = VOCAB_SIZE) -> ServedRequest:
    """A completions request from a raw body, for a server of `served_model` (the routes have FastAPI parse theirs):
    read as a JSON object, validated, prepared."""
    served = ServedModel(served_model, n_positions, vocab_size)
    return prepare(validated(json_object(raw), served), served)


def validated(body: dict, served: ServedModel, model: type[M] = CompletionRequest) -> M:
    """A body already read as a JSON object as an endpoint's request model (a 404 for another model first, as the
    routes check it before the schema): the Python API's way in, where FastAPI does not parse the body."""
    check_model(body.get("model"), served.id)
    try:
        return model.model_validate(body)
    except ValidationError as e:
        raise validation_error(e.errors(include_url=False)) from None


def prepare(p: CompletionRequest, served: ServedModel) -> ServedRequest:
    """The completions request as it is served (a 4xx APIError for what its schema lets through and is not served)."""
    refuse_unknown(p)
    max_tokens = DEFAULT_MAX_TOKENS if p.max_tokens is None else p.max_tokens
    return serve(p, _prompts(p, served.vocab_size), max_tokens, served, logprobs=p.logprobs, echo=bool(p.echo))


def serve(p: SamplingRequest, prompts: list[tuple[str | None, list[int] | None]], max_tokens: int | None,
          served: ServedModel, logprobs: int | None = None, echo: bool = False,
          logprobs_shape: Callable[[], Any] | None = None,
          constraint: tuple[ConstraintSpec, str] | None = None) -> ServedRequest:
    """Any endpoint's request as it is served, given its prompts (each as text or as ids), its token budget (None:
    what the context leaves after the longest prompt, chat's default) and the logprobs it lists (`logprobs_shape`: an
    endpoint's own; by default OpenAI's legacy shape, naming tokens as return_tokens_as_token_ids asks), and an
    endpoint's own structured output (`constraint`, with its field). Checked in the order the fields are read."""
    check_model(p.model, served.id)
    refuse_unsupported(p)
    if max_tokens == 0 and not echo:
        raise bad("max_tokens is 0: nothing to generate (0 is for scoring a prompt, with echo)", "max_tokens")
    if max_tokens is not None and max_tokens > served.n_positions:
        raise bad(f"max_tokens must be between 1 and the model's context ({served.n_positions}), got {max_tokens}",
                  "max_tokens")
    texts, ids = _tokenized(p, prompts, served.n_positions, scoring=max_tokens == 0)
    if max_tokens is None:  # as many as the context leaves (vLLM's chat default)
        max_tokens = max(1, served.n_positions - max(len(t) for t in ids))
    stop = _stop(p)
    n = 1 if p.n is None else p.n
    if n * len(ids) > MAX_CHOICES:
        raise bad(f"n x prompts is {n} x {len(ids)} = {n * len(ids)} choices; at most {MAX_CHOICES} per request", "n")
    sampling = to_sampling_params(p, n, max_tokens, served.vocab_size, {"logprobs": logprobs, "echo": echo}, constraint)
    if p.priority and not served.priority_scheduling:  # vLLM refuses it so too
        raise bad(f"priority is {p.priority}: this server schedules first come, first served; start it "
                  "with --scheduling-policy priority", "priority")
    return ServedRequest(
        params=p, prompts=texts, prompt_ids=ids, sampling=sampling, model=served.id, n=n, stop=stop, logprobs=logprobs,
        echo=echo, max_tokens=[min(max_tokens, served.n_positions - len(t)) for t in ids],  # capped by the context
        logprobs_shape=logprobs_shape or partial(render.ChoiceLogprobs, bool(p.return_tokens_as_token_ids)),
        **({"id": "cmpl-" + p.request_id} if p.request_id else {}))


def _prompts(p: CompletionRequest, vocab_size: int) -> list[tuple[str | None, list[int] | None]]:
    """Each prompt as (text, None) or (None, ids), in order; ids checked against the vocabulary."""
    prompt = p.prompt
    if isinstance(prompt, str):
        return [(prompt, None)]
    if isinstance(prompt[0], str):
        return [(text, None) for text in prompt]
    lists = [prompt] if isinstance(prompt[0], int) else prompt
    for i, ids in enumerate(lists):
        for j, tok in enumerate(ids):
            if not 0 <= tok < vocab_size:
                at = f"prompt[{j}]" if lists is not prompt else f"prompt[{i}][{j}]"
                raise bad(f"{at}: token id {tok} is out of vocabulary (ids are in [0, {vocab_size}))", "prompt")
    return [(None, list(ids)) for ids in lists]


def _tokenized(p: SamplingRequest, prompts: list[tuple[str | None, list[int] | None]], n_positions: int,
               scoring: bool) -> tuple[list[str], list[list[int]]]:
    """Each prompt's text and ids, truncated as asked (truncate_prompt_tokens), each within the context (a completion
    needs one position at least, unless it only scores its prompt)."""
    truncate = p.truncate_prompt_tokens
    if truncate is not None and not truncate < n_positions:
        raise bad(f"truncate_prompt_tokens must be between 1 and {n_positions - 1}, got {truncate}", "truncate_prompt_tokens")
    room = n_positions if scoring else n_positions - 1
    texts, ids = [], []
    for text, tokens in prompts:
        if tokens is None:
            tokens = encode(text) or [EOT_ID]  # an empty prompt starts a document, as gpt2x generate does
        if truncate is not None and len(tokens) > truncate:
            tokens, text = (tokens[:truncate] if p.truncation_side == "right" else tokens[-truncate:]), None
        if len(tokens) > room:
            raise bad(f"the prompt is {len(tokens)} tokens; the model's context is {n_positions} "
                      "(shorten it, or send truncate_prompt_tokens)", "prompt", "context_length_exceeded")
        texts.append(text if _utf8(text) else decode(tokens))
        ids.append(tokens)
    return texts, ids


def _utf8(text: str | None) -> bool:
    """Whether the text can be echoed as sent (a lone surrogate, which the tokenizer replaced, cannot: its ids' text is
    echoed instead)."""
    if text is None:
        return False
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _stop(p: SamplingRequest) -> tuple[str, ...]:
    stop = [p.stop] if isinstance(p.stop, str) else p.stop or []
    if not all(stop):
        raise bad(f"stop must be a non-empty string or a list of at most {MAX_STOP} non-empty strings", "stop")
    return tuple(stop)


# ------------------------------------------------------------------ the answers


def choice(index: int, text: str, reason: str | None, logprobs: dict | None = None, **extra: Any) -> Choice:
    """A choice; `extra`: vLLM's prompt_logprobs, prompt_token_ids and token_ids where asked for."""
    return Choice(index=index, text=text, logprobs=None if logprobs is None else Logprobs(**logprobs),
                  finish_reason=reason, **extra)


def response(req: ServedRequest, choices: list[Choice], usage: Usage | None) -> CompletionResponse:
    return CompletionResponse(id=req.id, created=req.created, model=req.model, choices=choices, usage=usage)


async def complete(pending: Pending) -> CompletionResponse:
    """The whole response, as OpenAI's non-streaming completions answer."""
    req = pending.req
    parts: list[list[str]] = [[] for _ in range(req.choices)]
    reasons: list[str | None] = [None] * req.choices
    extras: list[dict] = [{} for _ in range(req.choices)]
    async for event in pending.events():
        index = event.index
        parts[index].append(event.text)
        reasons[index] = event.finish_reason or reasons[index]
        for key, value in event.extra.items():  # token_ids add up; the prompt's keys come once
            extras[index][key] = extras[index].get(key, []) + value if key == "token_ids" else value
    choices = [choice(i, "".join(p), reasons[i], None if lp is None else lp.whole(), **extras[i])
               for i, (p, lp) in enumerate(zip(parts, pending.logprobs))]
    return response(req, choices, pending.usage())


async def stream(pending: Pending) -> AsyncIterator[render.StreamEvent]:
    """The stream: one chunk per released piece of text (with the logprobs of the tokens it releases), each choice's
    finish_reason on the chunk of its last token (as vLLM's: a chunk of its own only where the choice ends without a
    token of text, at end of text or a stop token id), a usage chunk if asked for, then DONE."""
    req = pending.req

    def choices_of(event: ChoiceEvent) -> list[Choice]:
        return [choice(event.index, event.text, event.finish_reason, event.logprobs, **event.extra)]

    async for event in stream_events(pending, choices_of, lambda _, choices, usage: response(req, choices, usage)):
        yield event
