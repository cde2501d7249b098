"""The OpenAI completions API as gpt2x serves it: request validation (every bad field is one
OpenAI-style error with a 4xx status), the response and stream-chunk shapes, and the text of a
choice as tokens arrive (stop strings, UTF-8 split across tokens).

Fields: `prompt` (a string or a list of strings), `max_tokens` (default 16, as OpenAI's; capped by
the context), `temperature` (0 = greedy), `top_p`, `seed`, `stop` (a string or up to 4), `n` (1),
`stream`, `stream_options.include_usage`, `echo`, and two of vLLM's extensions: `top_k` and
`truncate_prompt_tokens` (keep the prompt's last k tokens). Fields that would change the output and
are not supported (`n` > 1, `best_of` > 1, `logprobs`, `suffix`, penalties, `logit_bias`) are refused,
not ignored; unknown fields are ignored, as OpenAI's server does.
"""

from __future__ import annotations

import json
import os
import time
import uuid
from dataclasses import dataclass, field

from ..tokenizer import EOT_ID, StreamDecoder, encode

MAX_STOP = 4  # stop strings per request, as OpenAI's limit
MAX_PROMPTS = 64  # prompts per request
DEFAULT_MAX_TOKENS = 16  # OpenAI's default for completions


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

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def bad(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param=param, code=code)


@dataclass
class CompletionRequest:
    prompts: list[str]
    prompt_ids: list[list[int]]
    max_tokens: list[int]  # per prompt, capped so that prompt and completion fit the context
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int = 0
    stop: tuple[str, ...] = ()
    stream: bool = False
    include_usage: bool = False
    echo: bool = False
    model: str = ""
    id: str = field(default_factory=lambda: "cmpl-" + uuid.uuid4().hex)
    created: int = field(default_factory=lambda: int(time.time()))


def _number(body: dict, name: str, default: float, low: float, high: float, low_open: bool = False) -> float:
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise bad(f"{name} must be a number, got {json.dumps(value)[:40]}", name)
    if not (low < value if low_open else low <= value) or value > high:
        raise bad(f"{name} must be in {'(' if low_open else '['}{low}, {high}], got {value}", name)
    return float(value)


def _integer(body: dict, name: str) -> int | None:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise bad(f"{name} must be an integer, got {json.dumps(value)[:40]}", name)
    return value


def _refuse_unsupported(body: dict) -> None:
    """Fields that would change the output and that gpt2x does not implement: refused, not ignored."""
    if _integer(body, "n") not in (None, 1):
        raise bad("only n=1 is supported: send one request per completion", "n")
    if _integer(body, "best_of") not in (None, 1):
        raise bad("best_of is not supported", "best_of")
    if body.get("logprobs") is not None:
        raise bad("logprobs are not supported", "logprobs")
    if body.get("suffix") is not None:
        raise bad("suffix is not supported", "suffix")
    for name in ("presence_penalty", "frequency_penalty"):
        if _number(body, name, 0.0, -2.0, 2.0) != 0.0:
            raise bad(f"{name} is not supported (only 0)", name)
    if body.get("logit_bias"):
        raise bad("logit_bias is not supported", "logit_bias")


def _prompts(body: dict) -> list[str]:
    prompt = body.get("prompt")
    if prompt is None:
        raise bad("prompt is required", "prompt")
    if isinstance(prompt, str):
        return [prompt]
    if isinstance(prompt, list) and prompt and all(isinstance(p, str) for p in prompt):
        if len(prompt) > MAX_PROMPTS:
            raise bad(f"at most {MAX_PROMPTS} prompts per request, got {len(prompt)}", "prompt")
        return prompt
    raise bad("prompt must be a string or a non-empty list of strings (token ids are not accepted)", "prompt")


def _stop(body: dict) -> tuple[str, ...]:
    stop = body.get("stop")
    if stop is None:
        return ()
    if isinstance(stop, str):
        stop = [stop]
    if not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop) or len(stop) > MAX_STOP:
        raise bad(f"stop must be a non-empty string or a list of at most {MAX_STOP} non-empty strings", "stop")
    return tuple(stop)


def parse_request(raw: bytes, served_model: str, n_positions: int) -> CompletionRequest:
    """A validated completions request from the raw body, or an APIError (400 for a bad field, 404
    for a model other than the one served)."""
    try:
        body = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise bad(f"the body is not valid JSON: {e}") from None
    if not isinstance(body, dict):
        raise bad("the body must be a JSON object")
    model = body.get("model")
    if model is not None and model != served_model:
        raise APIError(404, f"the model {str(model)[:100]!r} does not exist; this server serves {served_model!r}",
                       param="model", code="model_not_found")
    _refuse_unsupported(body)
    prompts = _prompts(body)
    max_tokens = _integer(body, "max_tokens")
    if max_tokens is None:
        max_tokens = DEFAULT_MAX_TOKENS
    if not 1 <= max_tokens <= n_positions:
        raise bad(f"max_tokens must be between 1 and the model's context ({n_positions}), got {max_tokens}", "max_tokens")
    truncate = _integer(body, "truncate_prompt_tokens")
    if truncate is not None and not 1 <= truncate < n_positions:
        raise bad(f"truncate_prompt_tokens must be between 1 and {n_positions - 1}, got {truncate}", "truncate_prompt_tokens")
    ids = []
    for text in prompts:
        tokens = encode(text) or [EOT_ID]  # an empty prompt starts a document, as gpt2x generate does
        if truncate is not None:
            tokens = tokens[-truncate:]
        if len(tokens) >= n_positions:
            raise bad(f"the prompt is {len(tokens)} tokens; the model's context is {n_positions} "
                      "(shorten it, or send truncate_prompt_tokens)", "prompt", "context_length_exceeded")
        ids.append(tokens)
    top_k = _integer(body, "top_k")
    if top_k is not None and top_k < -1:
        raise bad(f"top_k must be -1 or 0 (off) or positive, got {top_k}", "top_k")
    seed = _integer(body, "seed")
    if seed is not None and not 0 <= seed < 2**63:
        raise bad(f"seed must be a non-negative 64-bit integer, got {seed}", "seed")
    for name in ("stream", "echo"):
        if not isinstance(body.get(name, False), (bool, type(None))):
            raise bad(f"{name} must be true or false", name)
    options = body.get("stream_options") or {}
    if not isinstance(options, dict):
        raise bad("stream_options must be an object", "stream_options")
    return CompletionRequest(
        prompts=prompts, prompt_ids=ids,
        max_tokens=[min(max_tokens, n_positions - len(p)) for p in ids],  # capped by the context
        temperature=_number(body, "temperature", 1.0, 0.0, 2.0),
        top_p=_number(body, "top_p", 1.0, 0.0, 1.0, low_open=True),
        top_k=max(0, top_k or 0),
        seed=seed if seed is not None else int.from_bytes(os.urandom(4), "little"),
        stop=_stop(body), stream=bool(body.get("stream")), include_usage=bool(options.get("include_usage")),
        echo=bool(body.get("echo")), model=served_model,
    )


class ChoiceText:
    """The text of one choice as its tokens arrive: decoded without splitting UTF-8 characters, cut
    at the first stop string, and released only once no stop string can still begin in it."""

    def __init__(self, stop: tuple[str, ...] = ()):
        self.stop = stop
        self._decoder = StreamDecoder()
        self.text = ""  # decoded so far (cut at a stop string once one is found)
        self.sent = 0  # characters of text released
        self.stopped = False  # a stop string was found
        self.tokens = 0  # completion tokens counted for usage

    def push(self, token: int) -> str:
        """Text that can be released after `token` (nothing once a stop string has ended the text)."""
        if self.stopped:
            return ""
        self.tokens += 1
        self.text += self._decoder.push(token)
        return self._release(final=False)

    def finish(self) -> str:
        """The rest of the text, once no more tokens come."""
        if self.stopped:
            return ""
        self.text += self._decoder.flush()
        return self._release(final=True)

    def _release(self, final: bool) -> str:
        if self.stop and not self.stopped:
            start = max(0, self.sent - max(len(s) for s in self.stop))
            hits = [i for i in (self.text.find(s, start) for s in self.stop) if i >= 0]
            if hits:
                self.text = self.text[: min(hits)]
                self.stopped = True
                final = True
        end = len(self.text)
        if not final and self.stop:
            end -= max((k for s in self.stop for k in range(1, len(s)) if self.text.endswith(s[:k])), default=0)
        out = self.text[self.sent : end]
        self.sent = max(self.sent, end)
        return out


def finish_reason(engine_reason: str, text: ChoiceText) -> str:
    """OpenAI's finish_reason: "stop" for end of text or a stop string, "length" for the budget."""
    return "stop" if text.stopped or engine_reason == "stop" else "length"


def choice(index: int, text: str, reason: str | None) -> dict:
    return {"index": index, "text": text, "logprobs": None, "finish_reason": reason}


def usage(req: CompletionRequest, texts: list[ChoiceText]) -> dict:
    prompt = sum(len(p) for p in req.prompt_ids)
    completion = sum(t.tokens for t in texts)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def completion(req: CompletionRequest, choices: list[dict], usage_: dict | None) -> dict:
    body = {"id": req.id, "object": "text_completion", "created": req.created, "model": req.model, "choices": choices}
    if usage_ is not None:
        body["usage"] = usage_
    return body


def sse(obj: dict | str) -> str:
    """One server-sent event: `data: JSON` (or `data: [DONE]`) and a blank line."""
    return f"data: {obj if isinstance(obj, str) else json.dumps(obj)}\n\n"


def model_list(model: str, created: int, max_model_len: int) -> dict:
    return {"object": "list", "data": [{"id": model, "object": "model", "created": created, "owned_by": "gpt2x",
                                         "max_model_len": max_model_len}]}
