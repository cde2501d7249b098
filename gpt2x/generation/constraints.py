"""Structured output: a `ConstraintSpec` (validated before any decoding) and each row's `Constraint`, llguidance's
matcher on GPT-2's vocabulary masking NumPy logits (no torch). llguidance and jsonschema are imported on first
use, so the decode loop imports without the `structured` extra (docs/commands/generate.md).
"""

from __future__ import annotations

import json
import logging
import os
import re
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from enum import Enum
from functools import lru_cache
from types import ModuleType
from typing import Any

import numpy as np

from ..errors import Gpt2xError, MissingDependencyError, UsageError
from ..tokenizer import EOT_ID, VOCAB_SIZE, get_encoding

log = logging.getLogger(__name__)

STRUCTURED_INSTALL = "pip install 'gpt2x[structured]'"
# JSON as json.dumps writes it: a small model given free whitespace tends to spend its budget on it. A schema's
# own "x-guidance" options override these.
JSON_DEFAULTS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
PARALLEL_FILL_MIN_CORES = 4  # a batch's masks filled on llguidance's thread pool from this many cores
MESSAGE_CHARS = 300  # an error line is cut to this


class ConstraintKind(str, Enum):
    json_schema = "json_schema"  # the text is JSON valid under a JSON schema
    json_object = "json_object"  # the text is a JSON object (OpenAI's response_format json_object)
    regex = "regex"  # the whole text matches a regular expression (Rust regex syntax: no look-around, no backreferences)
    choice = "choice"  # the text is exactly one of a list of strings
    grammar = "grammar"  # the text is in a context-free grammar: llguidance's Lark syntax or llama.cpp's GBNF


# ---------------------------------------------------------------- the optional libraries


def _llguidance() -> ModuleType:
    """llguidance with its NumPy helpers, or MissingDependencyError naming the install command."""
    try:
        import llguidance
        import llguidance.numpy  # noqa: F401
    except ImportError:
        raise MissingDependencyError(f"structured output needs llguidance, which this install lacks: {STRUCTURED_INSTALL}") from None
    return llguidance


def _jsonschema() -> ModuleType:
    try:
        import jsonschema
    except ImportError:
        raise MissingDependencyError(f"JSON schemas need jsonschema, which this install lacks: {STRUCTURED_INSTALL}") from None
    return jsonschema


def require_structured() -> None:
    """Raise MissingDependencyError unless everything structured output needs imports."""
    _llguidance()
    _jsonschema()


@lru_cache(maxsize=4)
def lltokenizer(vocab_size: int = VOCAB_SIZE) -> Any:
    """llguidance's view of GPT-2's BPE, `vocab_size` wide (padded columns never allowed); ~0.2 s, once. Token 187
    (a lone 0xFF byte, llguidance's special-token marker) is never allowed: 0xFF is never in UTF-8 text."""
    llg = _llguidance()
    enc = get_encoding()
    if vocab_size < enc.n_vocab:
        raise UsageError(f"logits of {vocab_size} columns cannot hold GPT-2's {enc.n_vocab} tokens", option="vocab_size")
    return llg.LLTokenizer.from_tiktoken(encoder=enc._mergeable_ranks, special_tokens=enc._special_tokens,
                                         pattern=enc._pat_str, eos_token=EOT_ID, n_vocab=vocab_size)


@lru_cache(maxsize=1)
def _executor() -> Any:
    """llguidance's thread pool for a batch's masks."""
    return _llguidance().LLExecutor()


# ---------------------------------------------------------------- the request


def _one_line(message: str) -> str:
    """An llguidance or jsonschema message on one line (source echoes and carets dropped, `error:` detail kept)."""
    lines = [s.strip() for s in message.splitlines()]
    lines = [s for s in lines if s and not set(s) <= set("^~- ") and not re.match(r"^\d+\s*\|", s)]
    detail = next((s.removeprefix("error: ") for s in lines if s.startswith("error: ")), None)
    head = lines[0] if lines else "invalid"
    text = f"{head.rstrip(':')}: {detail}" if detail and detail != head else head
    return text if len(text) <= MESSAGE_CHARS else text[: MESSAGE_CHARS - 3] + "..."


@dataclass(frozen=True)
class ConstraintSpec:
    """What the generated text must be; build it with the class methods. `value`: schema JSON text, pattern,
    options (a tuple), grammar text, or "" (json_object)."""

    kind: ConstraintKind
    value: str | tuple[str, ...] = ""

    def __post_init__(self) -> None:
        try:
            kind = ConstraintKind(self.kind)
        except ValueError:
            kinds = ", ".join(k.value for k in ConstraintKind)
            raise UsageError(f"unknown constraint kind {self.kind!r} (one of {kinds})", option="constraint") from None
        object.__setattr__(self, "kind", kind)
        if kind is ConstraintKind.choice:
            options = (self.value,) if isinstance(self.value, str) else tuple(self.value)
            if not options or not all(isinstance(o, str) for o in options):
                raise UsageError("choice needs a non-empty list of strings", option=kind.value)
            object.__setattr__(self, "value", options)
        elif kind is ConstraintKind.json_object and self.value:
            raise UsageError("json_object takes no schema (json_schema does)", option=kind.value)
        elif not isinstance(self.value, str):
            raise UsageError(f"{kind.value} takes text, not {type(self.value).__name__}", option=kind.value)
        elif kind in (ConstraintKind.regex, ConstraintKind.grammar, ConstraintKind.json_schema) and not self.value.strip():
            raise UsageError(f"the {kind.value} is empty", option=kind.value)

    @classmethod
    def json_schema(cls, schema: str | Mapping[str, Any] | bool) -> ConstraintSpec:
        """A JSON schema, as JSON text or as its parsed value."""
        return cls(ConstraintKind.json_schema, schema if isinstance(schema, str) else json.dumps(schema))

    @classmethod
    def json_object(cls) -> ConstraintSpec:
        return cls(ConstraintKind.json_object)

    @classmethod
    def regex(cls, pattern: str) -> ConstraintSpec:
        return cls(ConstraintKind.regex, pattern)

    @classmethod
    def choice(cls, options: Sequence[str]) -> ConstraintSpec:
        return cls(ConstraintKind.choice, tuple(options))

    @classmethod
    def grammar(cls, text: str) -> ConstraintSpec:
        """A context-free grammar in llguidance's Lark syntax (`start: ...`) or llama.cpp's GBNF (`root ::= ...`)."""
        return cls(ConstraintKind.grammar, text)

    @property
    def option(self) -> str:
        """The name UsageErrors give as their option: the kind."""
        return self.kind.value

    def validate(self) -> ConstraintSpec:
        """Self, once its schema, regex or grammar compiles; else one UsageError line. Cached."""
        _compiled(self)
        return self

    def schema(self) -> Any:
        """The JSON schema this spec enforces (json_schema, json_object), parsed; None for the others."""
        if self.kind is ConstraintKind.json_object:
            return {"type": "object"}
        if self.kind is ConstraintKind.json_schema:
            return json.loads(self.value)
        return None


def _check_schema(spec: ConstraintSpec) -> Any:
    """The parsed JSON schema, checked against the meta-schema its $schema names (2020-12 by default)."""
    try:
        schema = json.loads(spec.value)
    except json.JSONDecodeError as e:
        raise UsageError(f"the JSON schema is not JSON: {e}", option=spec.option) from None
    if not isinstance(schema, (dict, bool)):
        raise UsageError(f"a JSON schema is an object or a boolean, not {type(schema).__name__}", option=spec.option)
    jsonschema = _jsonschema()
    try:
        jsonschema.validators.validator_for(schema).check_schema(schema)
    except jsonschema.SchemaError as e:
        where = "/".join(str(p) for p in e.absolute_path)
        raise UsageError(f"invalid JSON schema{f' at /{where}' if where else ''}: {_one_line(e.message)}", option=spec.option) from None
    return schema


# The formats llguidance 1.9 enforces (others: "Unknown format"); any other is dropped, an annotation in 2020-12.
LLGUIDANCE_FORMATS = frozenset({"date-time", "date", "time", "duration", "email", "hostname", "ipv4", "ipv6", "uuid", "uri"})
_SCHEMA_KEYS = ("items", "additionalItems", "additionalProperties", "contains", "not", "if", "then", "else",
                "propertyNames", "unevaluatedItems", "unevaluatedProperties")  # a subschema (items: or a list)
_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")  # name -> subschema
_SCHEMA_LISTS = ("allOf", "anyOf", "oneOf", "prefixItems")  # subschemas
JSON_TYPES = frozenset({"null", "boolean", "object", "array", "number", "string", "integer"})


def _json_key(value: Any) -> str:
    """A value as JSON Schema compares them (1 == 1.0, true != 1), as hashable text."""
    def norm(v: Any) -> Any:
        if isinstance(v, float) and v.is_integer():
            return int(v)
        if isinstance(v, list):
            return [norm(x) for x in v]
        if isinstance(v, dict):
            return {k: norm(x) for k, x in v.items()}
        return v
    return json.dumps(norm(value), sort_keys=True)


def _json_type(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, (int, float)):
        return "integer" if isinstance(value, int) or value.is_integer() else "number"
    return {str: "string", list: "array", dict: "object"}[type(value)]


class _Rewrite:
    """A JSON schema made enforceable by llguidance, never admitting a value the original refuses (the rewrites:
    docs/commands/generate.md, structured output)."""

    def __init__(self, root: Any, option: str):
        self.root = root
        self.option = option
        self.unproven: list[str] = []  # why each oneOf left as it is may have two matching branches

    def resolve(self, schema: Any) -> Any:
        """A local `$ref` ("#/...") followed (a few hops); any other schema as it is."""
        for _ in range(8):
            ref = schema.get("$ref") if isinstance(schema, dict) else None
            if not isinstance(ref, str) or not ref.startswith("#"):
                return schema
            target = self.root
            for part in filter(None, ref[1:].split("/")):
                part = part.replace("~1", "/").replace("~0", "~")
                target = target.get(part) if isinstance(target, dict) else None
            if target is None:
                return schema
            schema = target
        return schema

    def types(self, schema: Any) -> set[str] | None:
        """The JSON types a schema admits, as far as its `type`, `const` and `enum` say; None: any."""
        schema = self.resolve(schema)
        if schema is False:
            return set()
        if not isinstance(schema, dict):
            return None
        out: set[str] | None = None
        if isinstance(schema.get("type"), (str, list)):
            named = {schema["type"]} if isinstance(schema["type"], str) else set(schema["type"])
            out = named | ({"integer"} if "number" in named else set())
        values = self.values(schema)
        if values is not None:
            kinds = {_json_type(json.loads(v)) for v in values}
            out = kinds if out is None else {k for k in kinds if k in out or (k == "integer" and "number" in out)}
        return out

    def values(self, schema: Any) -> set[str] | None:
        """The values a schema admits, as `_json_key`s, where `const` or `enum` lists them; else None."""
        schema = self.resolve(schema)
        if not isinstance(schema, dict):
            return None
        if "const" in schema:
            return {_json_key(schema["const"])}
        if isinstance(schema.get("enum"), list):
            return {_json_key(v) for v in schema["enum"]}
        return None

    def disjoint(self, a: Any, b: Any, parent: dict) -> bool:
        """No value matches both branches: disjoint types, values, or values of a property both require."""
        a, b = self.resolve(a), self.resolve(b)
        ta, tb = self._types_within(a, parent), self._types_within(b, parent)
        if _apart(ta, tb) or _apart(self.values(a), self.values(b)):
            return True
        if ta is None or tb is None or ta | tb != {"object"} or not (isinstance(a, dict) and isinstance(b, dict)):
            return False  # a discriminator only sorts objects
        required = set(parent.get("required") or [])
        both = (required | set(a.get("required") or [])) & (required | set(b.get("required") or []))
        return any(_apart(self.values((a.get("properties") or {}).get(name, {})),
                          self.values((b.get("properties") or {}).get(name, {}))) for name in both)

    def _types_within(self, schema: Any, parent: dict) -> set[str] | None:
        """The JSON types a branch admits within its parent's `type` (None: any)."""
        outer = self.types({k: v for k, v in parent.items() if k == "type"})
        types = self.types(schema)
        if outer is None:
            return types
        return outer if types is None else types & outer

    def schema(self, schema: Any, where: str) -> Any:
        if not isinstance(schema, dict):
            return schema
        out = self._subschemas(dict(schema), where)
        if isinstance(out.get("format"), str) and out["format"] not in LLGUIDANCE_FORMATS:
            del out["format"]
        rules = self._one_of(out, schema, where) + _dependency_rules(out)
        if rules:  # beside any anyOf/allOf the schema has: each rule holds too
            out["allOf"] = [*out.get("allOf", []), *rules]
        return out

    def _subschemas(self, out: dict, where: str) -> dict:
        """`out` with each of its subschemas rewritten in place."""
        for key in _SCHEMA_KEYS:
            if key in out:
                value = out[key]
                out[key] = ([self.schema(s, f"{where}/{key}/{i}") for i, s in enumerate(value)] if isinstance(value, list)
                            else self.schema(value, f"{where}/{key}"))
        for key in _SCHEMA_MAPS:
            if isinstance(out.get(key), dict):
                out[key] = {name: self.schema(s, f"{where}/{key}/{name}") for name, s in out[key].items()}
        for key in _SCHEMA_LISTS:
            if isinstance(out.get(key), list):
                out[key] = [self.schema(s, f"{where}/{key}/{i}") for i, s in enumerate(out[key])]
        if isinstance(out.get("dependencies"), dict):  # draft 7: a list of names or a subschema per name
            out["dependencies"] = {name: self.schema(s, f"{where}/dependencies/{name}") for name, s in out["dependencies"].items()}
        return out

    def _one_of(self, out: dict, schema: dict, where: str) -> list[dict]:
        """A oneOf whose branches no value matches two of (`disjoint`) as the rule it then is, anyOf, taken out of
        `out`; one that may have two matching branches left as it is, the reason kept (`unproven`)."""
        if not isinstance(out.get("oneOf"), list):
            return []
        n = len(out["oneOf"])
        pair = next(((i, j) for i in range(n) for j in range(i + 1, n)
                     if not self.disjoint(schema["oneOf"][i], schema["oneOf"][j], schema)), None)
        if pair is None:  # no value matches two branches: exactly one is at least one
            return [{"anyOf": out.pop("oneOf")}]
        self.unproven.append(
            f"oneOf at {where or '/'}: branches {pair[0]} and {pair[1]} may both match a value (no disjoint type, "
            "const/enum, or property both require with disjoint const/enum values tells them apart), so exactly "
            "one cannot be enforced (anyOf can)")
        return []


def _apart(a: set[str] | None, b: set[str] | None) -> bool:
    """Two known sets (of types or values) with nothing in common."""
    return a is not None and b is not None and not (a & b)


def _dependency_rules(out: dict) -> list[dict]:
    """The schema's dependencies (draft 7's, dependentRequired, dependentSchemas), taken out of `out`, as the rules
    they are: a property absent, or present with what it requires."""
    rules = []
    for key in ("dependencies", "dependentRequired", "dependentSchemas"):
        if not isinstance(out.get(key), dict):
            continue
        for name, then in out.pop(key).items():
            present = {"required": [name, *then]} if isinstance(then, list) else {"allOf": [{"required": [name]}, then]}
            rules.append({"anyOf": [{"properties": {name: False}}, present]})
    return rules


def enforceable_schema(schema: Any, option: str = ConstraintKind.json_schema.value) -> tuple[Any, list[str]]:
    """`schema` as llguidance can enforce it (_Rewrite), and why each `oneOf` left as it is was not shown
    exclusive (the reason given if llguidance refuses it too)."""
    rewrite = _Rewrite(schema, option)
    return rewrite.schema(schema, ""), rewrite.unproven


def _grammar_text(spec: ConstraintSpec) -> str:
    """The spec as an llguidance grammar (not yet checked)."""
    llg = _llguidance()
    kind = spec.kind
    if kind is ConstraintKind.json_schema:
        schema = _check_schema(spec)
        if schema is False:
            raise UsageError("invalid JSON schema: false admits no value", option=spec.option)
        try:  # `true` admits any value: {} says the same, and takes options
            enforced, unproven = enforceable_schema(schema or {}, spec.option)
            grammar = llg.LLMatcher.grammar_from_json_schema(json.dumps(enforced), defaults=JSON_DEFAULTS)
        except ValueError as e:
            raise UsageError(f"invalid JSON schema: {_one_line(str(e))}", option=spec.option) from None
        if unproven:  # a oneOf llguidance cannot prove exclusive either: refused with the reason
            failed, messages = llg.LLMatcher.validate_grammar_with_warnings(grammar, lltokenizer())
            if failed and any("oneOf" in m for m in messages):
                raise UsageError(f"JSON schema not enforceable: {unproven[0]}", option=spec.option)
        return grammar
    if kind is ConstraintKind.json_object:
        return llg.LLMatcher.grammar_from_json_schema('{"type": "object"}', defaults=JSON_DEFAULTS)
    if kind is ConstraintKind.regex:
        return llg.LLMatcher.grammar_from_regex(spec.value)
    if kind is ConstraintKind.choice:  # literals in Lark, JSON-escaped as llguidance's own grammar_from("choice") writes them
        return llg.LLMatcher.grammar_from_lark("start: " + " | ".join(json.dumps(o) for o in spec.value))
    try:  # Lark as it is, GBNF converted
        return llg.grammar_from("grammar", spec.value)
    except ValueError as e:
        raise UsageError(f"invalid grammar: {_one_line(str(e))}", option=spec.option) from None


WHAT = {ConstraintKind.json_schema: "JSON schema", ConstraintKind.json_object: "JSON object constraint",
        ConstraintKind.regex: "regex", ConstraintKind.choice: "choice", ConstraintKind.grammar: "grammar"}


@lru_cache(maxsize=256)
def _compiled(spec: ConstraintSpec) -> str:
    """The spec's llguidance grammar, validated against GPT-2's tokenizer; one UsageError line if invalid."""
    llg = _llguidance()
    grammar = _grammar_text(spec)
    failed, messages = llg.LLMatcher.validate_grammar_with_warnings(grammar, lltokenizer())
    if failed:
        message = _one_line(messages[0] if messages else "rejected")
        if spec.kind is ConstraintKind.regex:  # its position is in llguidance's wrapper grammar, not the user's text
            message = re.sub(r'^at \d+\(\d+\): invalid regex .*?: regex parse error', "regex parse error", message)
        raise UsageError(f"invalid {WHAT[spec.kind]}: {message}", option=spec.option)
    for warning in messages:
        log.debug("%s: %s", WHAT[spec.kind], warning)
    return grammar


@lru_cache(maxsize=64)
def _template(spec: ConstraintSpec, vocab_size: int) -> Any:
    """A matcher never advanced: each Constraint deep-copies it (microseconds, where building one takes ~1 ms)."""
    llg = _llguidance()
    return llg.LLMatcher(lltokenizer(vocab_size), _compiled(spec), log_level=0)


# ---------------------------------------------------------------- one row


def words(vocab_size: int) -> int:
    """32-bit words of a bitmask over `vocab_size` tokens."""
    return (vocab_size + 31) // 32


@lru_cache(maxsize=4)
def _bias_table(dtype: np.dtype) -> np.ndarray:
    """(256, 8): per bitmask byte, 0 where its bit (least significant first) is set, -inf where not."""
    bits = np.unpackbits(np.arange(256, dtype=np.uint8)[:, None], axis=1, bitorder="little").astype(bool)
    return np.where(bits, 0.0, -np.inf).astype(dtype)


_scratch = threading.local()  # each thread's bias buffers, reused from step to step


def _bias_buffer(rows: int, n_words: int, dtype: np.dtype) -> np.ndarray:
    """A (rows, 4 words, 8) buffer of `dtype`, this thread's, grown to the largest batch seen."""
    buffers = _scratch.__dict__.setdefault("buffers", {})
    buf = buffers.get((n_words, dtype))
    if buf is None or buf.shape[0] < rows:
        buf = buffers[(n_words, dtype)] = np.empty((rows, 4 * n_words, 8), dtype=dtype)
    return buf[:rows]


def apply_bitmask(logits: np.ndarray, bitmask: np.ndarray) -> np.ndarray:
    """-inf, in place, where the token's bit (t % 32 of word t // 32) is clear, and past the bitmask. One table
    lookup and one add: 0.9 ms at batch 16 on 2 cores, where an unpack and assignment took 4-5, llguidance's ~4."""
    if logits.ndim != 2 or bitmask.ndim != 2 or logits.shape[0] != bitmask.shape[0]:
        raise ValueError(f"logits (B, V) and a bitmask (B, words) row for row, not {logits.shape} and {bitmask.shape}")
    dtype = np.dtype(logits.dtype)
    rows, n_words = bitmask.shape
    cover = n_words * 32
    bias = _bias_buffer(rows, n_words, dtype)  # (B, 4 words, 8): one table row per bitmask byte
    np.take(_bias_table(dtype), np.ascontiguousarray(bitmask).view(np.uint8), axis=0, out=bias)
    bias = bias.reshape(rows, cover)  # (B, 32 words)
    v = logits.shape[1]
    if v <= cover:
        logits += bias[:, :v]
    else:
        logits[:, :cover] += bias
        logits[:, cover:] = -np.inf
    return logits


class Constraint:
    """One row's matcher over its generated tokens (the prompt is not constrained). Not thread-safe."""

    def __init__(self, spec: ConstraintSpec, vocab_size: int = VOCAB_SIZE):
        self.spec = spec
        self.vocab_size = vocab_size
        self.matcher = _template(spec, vocab_size).deep_copy()
        self.consumed = 0  # tokens advanced (end of text included) and not rolled back

    def __repr__(self) -> str:
        return f"Constraint({self.spec.kind.value}, consumed={self.consumed}, accepting={self.accepting}, done={self.done})"

    @property
    def accepting(self) -> bool:
        """The text so far satisfies the constraint: end of text is allowed now."""
        return self.matcher.is_accepting()

    @property
    def done(self) -> bool:
        """Nothing but end of text can follow: a row may end without sampling another token."""
        return self.matcher.is_stopped()

    def check(self) -> None:
        """Gpt2xError if the matcher failed or stopped short of a valid text: its next mask would allow nothing."""
        if self.matcher.is_error():
            raise Gpt2xError(f"the {WHAT[self.spec.kind]} cannot continue: {_one_line(self.matcher.get_error())}")
        if self.matcher.is_stopped() and not self.matcher.is_accepting():
            raise Gpt2xError(f"the {WHAT[self.spec.kind]} stopped before a valid text ({self.matcher.stop_reason()})")

    def fill(self, bitmask: np.ndarray) -> None:
        """Write the next token's bitmask into `bitmask` (words,) int32, C-contiguous."""
        self.check()
        if bitmask.dtype != np.int32 or bitmask.shape != (words(self.vocab_size),) or not bitmask.flags.c_contiguous:
            raise ValueError(f"a bitmask is ({words(self.vocab_size)},) C-contiguous int32, not {bitmask.shape} {bitmask.dtype}")
        self.matcher.unsafe_compute_mask_ptr(bitmask.ctypes.data, bitmask.nbytes)

    def bitmask(self) -> np.ndarray:
        """The next token's bitmask (words,) int32."""
        out = np.empty(words(self.vocab_size), dtype=np.int32)
        self.fill(out)
        return out

    def allowed(self) -> np.ndarray:
        """The tokens that may come next: (vocab_size,) bool."""
        bits = np.unpackbits(self.bitmask().view(np.uint8), bitorder="little")
        return bits[: self.vocab_size].astype(bool)

    def mask(self, logits: np.ndarray) -> np.ndarray:
        """Logits (V,) or (1, V) with the next token's disallowed tokens at -inf, in place; returns them."""
        if logits.ndim == 1:
            apply_bitmask(logits[None], self.bitmask()[None])  # (1, V), a view: the add lands in `logits`
        elif logits.ndim == 2 and logits.shape[0] == 1:
            apply_bitmask(logits, self.bitmask()[None])
        else:
            raise ValueError(f"one row's logits are (V,) or (1, V), not {logits.shape}: mask_rows masks a batch")
        return logits

    def advance(self, token: int) -> None:
        """Take the row's sampled token; a token the mask did not allow is a Gpt2xError, and the row must end."""
        if not self.matcher.consume_token(int(token)):
            raise Gpt2xError(f"token {int(token)} is not allowed by the {WHAT[self.spec.kind]} here: "
                             f"{_one_line(self.matcher.get_error())}")
        self.consumed += 1

    def accepts(self, tokens: Sequence[int]) -> int:
        """How many of `tokens`, in order from the current state, the constraint would take (none is taken)."""
        return self.matcher.validate_tokens([int(t) for t in tokens]) if len(tokens) else 0

    def rollback(self, n: int) -> None:
        """Drop the last `n` advanced tokens (speculative decoding's rejected drafts, with the cache)."""
        if n < 0 or n > self.consumed:
            raise ValueError(f"cannot roll back {n} tokens of {self.consumed}")
        if n and not self.matcher.rollback(n):
            raise Gpt2xError(f"the {WHAT[self.spec.kind]} could not roll back {n} tokens: {_one_line(self.matcher.get_error())}")
        self.consumed -= n

    def mask_draft(self, logits: np.ndarray, draft: Sequence[int]) -> np.ndarray:
        """Verification's logits (K + 1, V) each masked in place for the state it follows; the matcher does not
        move. Positions after a refused draft token stay unmasked: it has probability 0, so verification ends."""
        k = len(draft)
        if logits.ndim != 2 or logits.shape[0] != k + 1:
            raise ValueError(f"a draft of {k} tokens is verified on logits (K + 1, V) = ({k + 1}, V), not {logits.shape}")
        self.check()
        llg = _llguidance()
        bitmask = np.full((k + 1, words(self.vocab_size)), -1, dtype=np.int32)  # (K + 1, words); all allowed where not written
        llg.numpy.fill_next_token_bitmask_par_with_draft_tokens(_executor(), [(self.matcher, 0, [int(t) for t in draft])], bitmask)
        return apply_bitmask(logits, bitmask)


# ---------------------------------------------------------------- a batch


def fill_rows(constraints: Sequence[Constraint], bitmask: np.ndarray) -> None:
    """Row i of `bitmask` gets constraints[i]'s next mask: row by row below PARALLEL_FILL_MIN_CORES cores (on 2,
    llguidance's thread pool was slower at batch 16: benchmarks/results/constraint-cost-cpu-2core.md)."""
    if len(constraints) == 1 or (os.cpu_count() or 1) < PARALLEL_FILL_MIN_CORES:
        for i, c in enumerate(constraints):
            c.fill(bitmask[i])
        return
    for c in constraints:
        c.check()
    _llguidance().numpy.fill_next_token_bitmask_par(_executor(), [(c.matcher, i) for i, c in enumerate(constraints)], bitmask)


def mask_rows(logits: np.ndarray, constraints: Sequence[Constraint | None]) -> np.ndarray:
    """Mask a batch's logits in place, row i by constraints[i] (None: left as is): one bitmask, one NumPy pass."""
    if len(constraints) != logits.shape[0]:
        raise ValueError(f"{len(constraints)} constraints for {logits.shape[0]} rows of logits")
    rows = [i for i, c in enumerate(constraints) if c is not None]
    if not rows:
        return logits
    chosen = [constraints[i] for i in rows]
    if len({c.vocab_size for c in chosen}) > 1:
        raise ValueError("the rows' constraints are over different vocabulary sizes")
    bitmask = np.empty((len(rows), words(chosen[0].vocab_size)), dtype=np.int32)  # (n, words)
    fill_rows(chosen, bitmask)
    if len(rows) == logits.shape[0]:
        apply_bitmask(logits, bitmask)
    else:
        logits[rows] = apply_bitmask(logits[rows], bitmask)  # (n, V): a copy, masked, written back
    return logits
