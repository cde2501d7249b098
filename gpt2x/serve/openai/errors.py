"""Every failure as OpenAI's error: `APIError` (a status, a message, its type, the parameter at fault)
answered as `{"error": {"message", "type", "param", "code"}}` (schema.ErrorResponse), and pydantic's
(or FastAPI's) validation errors turned into one such 400."""

from __future__ import annotations

import json
from typing import Any

from ...tokenizer import VOCAB_SIZE
from .schema import MAX_PROMPTS, MAX_STOP, ErrorBody, ErrorResponse


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
