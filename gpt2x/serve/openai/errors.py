"""Every failure as OpenAI's error: `APIError` (a status, a message, its type, the parameter at fault)
answered as `{"error": {"message", "type", "param", "code"}}` (protocol.ErrorResponse), a body that is not a JSON
object (`json_object`), and pydantic's (or FastAPI's) validation errors turned into one such 400."""

from __future__ import annotations

import json
from typing import Any

from ...tokenizer import VOCAB_SIZE
from .protocol import MAX_PROMPTS, MAX_STOP, ErrorBody, ErrorResponse


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


_TYPE_MISMATCH = ("_type", "_parsing", "is_instance_of", "literal_error", "union_tag")
_UNION_MESSAGES = {
    "prompt": "prompt must be a string, a non-empty list of strings, a non-empty list of token ids, or a non-empty "
              f"list of non-empty token id lists (at most {MAX_PROMPTS} prompts; ids in [0, {VOCAB_SIZE}))",
    "stop": f"stop must be a non-empty string or a list of at most {MAX_STOP} non-empty strings",
}


_TOKEN_ID_FIELDS = ("prompt", "stop_token_ids", "allowed_token_ids", "tokens")


def _in_body(error: dict[str, Any]) -> dict[str, Any]:
    """An error located in the body's fields (FastAPI's locations begin with "body")."""
    loc = tuple(error.get("loc", ()))
    return dict(error, loc=loc[1:] if loc[:1] == ("body",) else loc)


def validation_error(errors: list[dict[str, Any]]) -> APIError:
    """One 400 for pydantic's (or FastAPI's) validation errors: `param` the field at fault, the message
    its first informative error (a bound or a length rather than every type a union tried)."""
    body_errors = [_in_body(e) for e in errors]
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
    return bad(_message(error, param), param)


def _message(error: dict[str, Any], param: str | None) -> str:
    """The error's words, where it is: the field, its list indexes, a nested object's field."""
    loc = error["loc"]
    where = (param or "body") + "".join(f"[{x}]" for x in loc[1:] if isinstance(x, int))
    if len(loc) > 1 and isinstance(loc[1], str) and loc[1].isidentifier() and loc[1] not in ("str", "int", "float", "bool"):
        where += "." + loc[1]  # a nested object's field (stream_options.include_usage), not a union's member
    if error.get("type") == "missing":
        return f"{where} is required"
    shown = json.dumps(error.get("input"), default=str)[:40] if "input" in error else ""
    return f"{where}: {error.get('msg', 'invalid value')}" + (f", got {shown}" if shown else "")


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
