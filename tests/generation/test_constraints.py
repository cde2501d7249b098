"""Structured output's core (gpt2x.generation.constraints) driven directly by a fake model: seeded
random logits, masked, greedy or sampled, decoded with gpt2x's tokenizer and checked by references
independent of llguidance: `jsonschema` for JSON schemas, `re.fullmatch` for regexes, the options
themselves for choices; the masks themselves against the `regex` module's partial matching and
against the options' prefixes. No backend is needed."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import jsonschema
import numpy as np
import pytest
import regex as partial_regex

from gpt2x.errors import Gpt2xError, MissingDependencyError, UsageError
from gpt2x.generation.constraints import (
    Constraint,
    ConstraintKind,
    ConstraintSpec,
    apply_bitmask,
    lltokenizer,
    mask_rows,
    words,
)
from gpt2x.tokenizer import EOT_ID, VOCAB_SIZE, decode, encode, get_encoding

V = VOCAB_SIZE
MAX_TOKENS = 200

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "member": {"type": "boolean"},
        "tags": {"type": "array", "items": {"enum": ["red", "green", "blue"]}, "maxItems": 3},
        "home": {"type": "object", "properties": {"zip": {"type": "string", "pattern": "^[0-9]{5}$"}}, "required": ["zip"],
                 "additionalProperties": False},
    },
    "required": ["name", "age", "member"],
    "additionalProperties": False,
}
SCHEMAS = [
    PERSON,
    {"type": "array", "items": {"type": "integer", "minimum": -50, "maximum": 50}, "minItems": 1, "maxItems": 4},
    {"enum": ["alpha", 3, None, True]},
    {"type": "object", "properties": {"when": {"type": "string", "format": "date"}, "level": {"enum": ["low", "high"]}},
     "required": ["when", "level"], "additionalProperties": False},
    {"anyOf": [{"type": "boolean"}, {"type": "string", "maxLength": 5}]},
]
REGEXES = [r"[A-Z][a-z]{2,6}-[0-9]{3}", r"(yes|no|maybe)( indeed)?", r"[0-9]{1,3}(\.[0-9]{1,2})? (USD|EUR|GBP)", r"#[0-9a-f]{6}"]
CHOICES = [["red", "reddish", "blue"], ["café", "naïve ☃", "Zürich"], ["positive", "negative", "neutral"]]
# A Lark grammar and a GBNF one, each with an equivalent regex as its independent check.
GRAMMARS = [
    ('start: greeting " " name "!"\ngreeting: "Hello" | "Hi"\nname: /[A-Z][a-z]{1,8}/', r"(Hello|Hi) [A-Z][a-z]{1,8}!"),
    ('root ::= answer " (" digit digit? ")"\nanswer ::= "yes" | "no"\ndigit ::= [0-9]', r"(yes|no) \([0-9][0-9]?\)"),
]


def fake_logits(rng: np.random.Generator, rows: int | None = None) -> np.ndarray:
    """A step's logits from the fake model: seeded normals, spread enough that a few tokens dominate."""
    return (rng.standard_normal(V if rows is None else (rows, V)) * 4).astype(np.float32)


def pick(rng: np.random.Generator, logits: np.ndarray, greedy: bool) -> int:
    if greedy:
        return int(np.argmax(logits))
    p = np.exp(logits.astype(np.float64) - logits.max())
    return int(rng.choice(V, p=p / p.sum()))


def run(spec: ConstraintSpec, seed: int, greedy: bool, max_tokens: int = MAX_TOKENS) -> tuple[list[int], Constraint]:
    """Decode under `spec` until end of text (sampled, or the constraint is done); checks at every
    step that end of text is allowed exactly when the text so far is accepted, alone once done."""
    rng = np.random.default_rng(seed)
    c = Constraint(spec)
    tokens: list[int] = []
    for _ in range(max_tokens):
        allowed = c.allowed()
        assert allowed[EOT_ID] == c.accepting
        if c.done:
            assert np.flatnonzero(allowed).tolist() == [EOT_ID]
            break
        logits = fake_logits(rng)
        c.mask(logits)
        assert np.array_equal(np.isfinite(logits), allowed)
        tok = pick(rng, logits, greedy)
        c.advance(tok)
        if tok == EOT_ID:
            break
        tokens.append(tok)
    return tokens, c


def finished_text(spec: ConstraintSpec, seed: int, greedy: bool) -> str:
    tokens, c = run(spec, seed, greedy)
    assert c.accepting and c.done, f"not finished in {MAX_TOKENS} tokens: {decode(tokens)!r}"
    return decode(tokens)


# ---------------------------------------------------------------- outputs satisfy their constraint


@pytest.mark.parametrize("greedy", [True, False], ids=["greedy", "sampled"])
@pytest.mark.parametrize("schema", SCHEMAS, ids=range(len(SCHEMAS)))
def test_json_schema_outputs_validate(schema, greedy):
    spec = ConstraintSpec.json_schema(schema).validate()
    for seed in range(4):
        text = finished_text(spec, seed, greedy)
        jsonschema.validate(json.loads(text), schema, format_checker=jsonschema.FormatChecker())


def test_json_object_is_an_object():
    spec = ConstraintSpec.json_object()
    texts = []
    for seed in range(6):
        tokens, c = run(spec, seed, greedy=False, max_tokens=400)
        if c.done:
            texts.append(decode(tokens))
            assert isinstance(json.loads(texts[-1]), dict)
        else:  # an unbounded object may outrun the budget: what there is, is no finished object
            with pytest.raises(json.JSONDecodeError):
                json.loads(decode(tokens))
    assert texts  # at least some finished


@pytest.mark.parametrize("greedy", [True, False], ids=["greedy", "sampled"])
@pytest.mark.parametrize("pattern", REGEXES)
def test_regex_outputs_fullmatch(pattern, greedy):
    spec = ConstraintSpec.regex(pattern)
    for seed in range(5):
        text = finished_text(spec, seed, greedy)
        assert re.fullmatch(pattern, text), text


@pytest.mark.parametrize("options", CHOICES, ids=range(len(CHOICES)))
def test_choice_yields_one_of_the_choices(options):
    spec = ConstraintSpec.choice(options)
    seen = set()
    for seed in range(12):
        for greedy in (True, False):
            text = finished_text(spec, seed, greedy)
            assert text in options
            seen.add(text)
    assert len(seen) > 1  # the mask constrains, it does not decide


@pytest.mark.parametrize("grammar,equivalent", GRAMMARS, ids=["lark", "gbnf"])
def test_grammar_outputs_are_in_the_language(grammar, equivalent):
    spec = ConstraintSpec.grammar(grammar).validate()
    for seed in range(5):
        for greedy in (True, False):
            text = finished_text(spec, seed, greedy)
            assert re.fullmatch(equivalent, text), text


# ---------------------------------------------------------------- the masks are exact


def clean_tokens() -> dict[int, str]:
    """Every ordinary token whose bytes are UTF-8 on their own, with its text."""
    enc = get_encoding()
    out = {}
    for t in range(EOT_ID):
        try:
            out[t] = enc.decode_single_token_bytes(t).decode("utf-8")
        except UnicodeDecodeError:
            continue
    return out


def test_regex_masks_equal_partial_matching():
    """At each step of a path, the tokens allowed are those after which the text is still a prefix of
    a match (the `regex` module's partial fullmatch), among tokens that are whole UTF-8."""
    pattern = r"[0-9]{1,3}(\.[0-9]{1,2})? (USD|EUR|GBP)"
    texts = clean_tokens()
    ids = np.fromiter(texts, dtype=np.int64)
    compiled = partial_regex.compile(pattern)
    c = Constraint(ConstraintSpec.regex(pattern))
    prefix = ""
    for piece in ["12", ".", "5", " ", "EU", "R"]:
        allowed = c.allowed()
        want = np.array([compiled.fullmatch(prefix + texts[t], partial=True) is not None for t in ids.tolist()])
        assert np.array_equal(allowed[ids], want), prefix
        assert allowed[EOT_ID] == (re.fullmatch(pattern, prefix) is not None)
        (tok,) = encode(piece)
        c.advance(tok)
        prefix += piece
    assert c.accepting and c.done


def test_choice_masks_equal_option_prefixes():
    """Every token that keeps the text a prefix of an option, and no other; where the options force
    the next bytes ("redd" -> "ish"), only those bytes' first token as GPT-2 spells them."""
    options = ["red", "reddish", "blue"]
    texts = clean_tokens()
    ids = np.fromiter(texts, dtype=np.int64)
    c = Constraint(ConstraintSpec.choice(options))
    prefix = ""
    for piece in ["red", "d", "ish"]:
        allowed = c.allowed()
        want = np.array([any(o.startswith(prefix + texts[t]) for o in options) for t in ids.tolist()])
        forced = c.matcher.compute_ff_bytes()  # bytes every continuation starts with
        if forced:  # llguidance then allows their canonical first token only: a subset of what is valid
            assert not (allowed[ids] & ~want).any() and allowed[encode(forced.decode())[0]], prefix
        else:
            assert np.array_equal(allowed[ids], want), prefix
        assert allowed[EOT_ID] == (prefix in options)
        for tok in encode(piece):
            c.advance(tok)
        prefix += piece
    assert c.done and np.flatnonzero(c.allowed()).tolist() == [EOT_ID]


def test_the_tokenizer_is_gpt2x_vocabulary():
    """llguidance's token bytes are gpt2x's for every id, but token 187 (the lone 0xFF byte, its
    special-token marker, never valid UTF-8) and end of text (special)."""
    tok = lltokenizer()
    enc = get_encoding()
    assert tok.vocab_size == V and tok.eos_token == EOT_ID
    differ = [t for t in range(V) if tok.decode_bytes([t]) != enc.decode_single_token_bytes(t)]
    assert differ in ([187], [187, EOT_ID])
    assert not Constraint(ConstraintSpec.regex(r"(.|\n)*")).allowed()[187]


# ---------------------------------------------------------------- end of text


def test_end_of_text_only_when_accepting():
    c = Constraint(ConstraintSpec.regex(r"[0-9]{2}(x)?"))
    assert not c.allowed()[EOT_ID] and not c.accepting
    with pytest.raises(Gpt2xError, match="not allowed"):
        Constraint(c.spec).advance(EOT_ID)  # refused before the text is accepted
    for tok in encode("12"):
        c.advance(tok)
    assert c.accepting and not c.done and c.allowed()[EOT_ID] and c.allowed().sum() > 1  # may end, may go on
    c.advance(encode("x")[0])
    assert c.done and np.flatnonzero(c.allowed()).tolist() == [EOT_ID]  # nothing else can follow: end of text forced
    logits = np.zeros(V, dtype=np.float32)
    c.mask(logits)
    assert np.isfinite(logits).sum() == 1 and logits[EOT_ID] == 0.0
    c.advance(EOT_ID)
    assert c.done and c.consumed == len(encode("12")) + 2


def test_an_unfinished_output_is_not_accepting():
    c = Constraint(ConstraintSpec.json_schema(PERSON))
    for tok in encode('{"name": "Al'):
        c.advance(tok)
    assert not c.accepting and not c.done and not c.allowed()[EOT_ID]


def test_a_disallowed_token_is_an_error():
    c = Constraint(ConstraintSpec.choice(["yes", "no"]))
    with pytest.raises(Gpt2xError, match="not allowed by the choice"):
        c.advance(encode("maybe")[0])
    with pytest.raises(Gpt2xError):
        c.allowed()  # the matcher has failed: no further mask


# ---------------------------------------------------------------- rollback and drafts


def path(spec: ConstraintSpec, seed: int, n: int) -> tuple[list[int], list[np.ndarray]]:
    """n sampled tokens and the allowed set before each, along one straight path."""
    rng = np.random.default_rng(seed)
    c = Constraint(spec)
    tokens, allowed = [], []
    for _ in range(n):
        allowed.append(c.allowed())
        logits = c.mask(fake_logits(rng))
        tok = pick(rng, logits, greedy=False)
        if tok == EOT_ID:
            break
        c.advance(tok)
        tokens.append(tok)
    return tokens, allowed


LONG = [ConstraintSpec.json_schema(PERSON), ConstraintSpec.regex(r"([a-z]{2,5} ){6,9}[a-z]{2,5}\."),
        ConstraintSpec.grammar('start: item ("; " item)~6..9\nitem: /[A-Z][a-z]{2,4}/ " = " /[0-9]{2}/')]


@pytest.mark.parametrize("spec", LONG, ids=["json", "regex", "lark"])
def test_rollback_then_readvance_equals_the_straight_path(spec):
    tokens, allowed = path(spec, seed=3, n=12)
    assert len(tokens) >= 6
    c = Constraint(spec)
    for tok in tokens:
        c.advance(tok)
    end = c.allowed()
    for back in (1, 3, len(tokens)):
        c.rollback(back)
        assert c.consumed == len(tokens) - back
        for i in range(len(tokens) - back, len(tokens)):
            assert np.array_equal(c.allowed(), allowed[i])
            c.advance(tokens[i])
        assert np.array_equal(c.allowed(), end)
    with pytest.raises(ValueError):
        c.rollback(len(tokens) + 1)


def test_mask_draft_masks_each_position_and_leaves_the_state():
    spec = ConstraintSpec.json_schema(PERSON)
    tokens, allowed = path(spec, seed=5, n=10)
    c = Constraint(spec)
    c.advance(tokens[0])
    draft = tokens[1:6]
    rng = np.random.default_rng(0)
    logits = fake_logits(rng, len(draft) + 1)
    raw = logits.copy()
    c.mask_draft(logits, draft)
    for i in range(len(draft) + 1):
        assert np.array_equal(np.isfinite(logits[i]), allowed[1 + i]), i
        np.testing.assert_array_equal(logits[i][allowed[1 + i]], raw[i][allowed[1 + i]])
    assert c.consumed == 1 and np.array_equal(c.allowed(), allowed[1])  # where it was
    assert c.accepts(draft) == len(draft)
    # A draft refused at its second token: the first two positions are masked, the rest left as they were.
    bad = [draft[0], encode("}}}")[0], draft[1]]
    assert c.accepts(bad) == 1
    logits = fake_logits(rng, 4)
    raw = logits.copy()
    c.mask_draft(logits, bad)
    assert np.array_equal(np.isfinite(logits[0]), allowed[1]) and np.array_equal(np.isfinite(logits[1]), allowed[2])
    assert not np.isfinite(logits[1, bad[1]])  # the refused token: probability 0 where it was drafted
    np.testing.assert_array_equal(logits[2:], raw[2:])
    assert c.consumed == 1 and not c.matcher.is_error()


# ---------------------------------------------------------------- a batch


def test_mask_rows_equals_each_row_masked_alone():
    specs = [ConstraintSpec.json_schema(PERSON), None, ConstraintSpec.regex(REGEXES[0]), ConstraintSpec.choice(CHOICES[0]), None]
    rows = [None if s is None else Constraint(s) for s in specs]
    for c, text in zip(rows, ['{"name', "", "Ab", "re", ""]):
        for tok in encode(text) if c is not None else []:
            c.advance(tok)
    logits = fake_logits(np.random.default_rng(1), len(rows))
    raw = logits.copy()
    mask_rows(logits, rows)
    for i, c in enumerate(rows):
        if c is None:
            np.testing.assert_array_equal(logits[i], raw[i])
        else:
            np.testing.assert_array_equal(logits[i], c.mask(raw[i].copy()))
    full = [Constraint(ConstraintSpec.regex(REGEXES[1])) for _ in range(3)]  # every row constrained: in place
    logits = fake_logits(np.random.default_rng(2), 3)
    view = logits[:, :]
    mask_rows(view, full)
    assert np.isinf(logits).any() and np.array_equal(np.isfinite(logits[0]), full[0].allowed())
    with pytest.raises(ValueError):
        mask_rows(logits, full[:2])


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("vocab", [V, 40, 64, 70])
def test_apply_bitmask_against_bits(dtype, vocab):
    """Token t is kept exactly when bit t % 32 of word t // 32 is set; columns past the mask's words go."""
    rng = np.random.default_rng(vocab)
    n_words = words(min(vocab, 64))  # 70 columns on 2 words: the last 6 are past the mask
    bitmask = rng.integers(-(2**31), 2**31, size=(3, n_words), dtype=np.int64).astype(np.int32)
    logits = rng.standard_normal((3, vocab)).astype(dtype)
    want = logits.copy()
    for b in range(3):
        for t in range(vocab):
            if t >= 32 * n_words or not (int(bitmask[b, t // 32]) >> (t % 32)) & 1:
                want[b, t] = -np.inf
    got = apply_bitmask(logits, bitmask)
    assert got is logits and got.dtype == dtype
    np.testing.assert_array_equal(got, want)


# ---------------------------------------------------------------- invalid specs


INVALID = [
    (ConstraintKind.regex, "(abc", "unclosed group"),
    (ConstraintKind.regex, "(?=a)b", "look-around"),
    (ConstraintKind.regex, "a{3,2}", "repetition"),
    (ConstraintKind.json_schema, '{"type": "foo"}', "/type"),
    (ConstraintKind.json_schema, '{"type": ', "not JSON"),
    (ConstraintKind.json_schema, '[1, 2]', "object or a boolean"),
    (ConstraintKind.json_schema, '{"type": "integer", "minimum": "x"}', "minimum"),
    (ConstraintKind.json_schema, '{"type": "string", "pattern": "(x"}', "pattern"),
    (ConstraintKind.json_schema, '{"not": {"type": "string"}}', "not"),
    (ConstraintKind.json_schema, '{"$ref": "#/$defs/missing"}', "missing"),
    (ConstraintKind.json_schema, "false", "false"),
    (ConstraintKind.grammar, "start: foo", "foo"),
    (ConstraintKind.grammar, 'start: "a" | (', "Expected"),
    (ConstraintKind.grammar, 'thing ::= "a"', "root"),
]


@pytest.mark.parametrize("kind,value,says", INVALID, ids=[f"{k.value}:{v}" for k, v, _ in INVALID])
def test_an_invalid_spec_is_one_usage_line_before_decoding(kind, value, says):
    spec = ConstraintSpec(kind, value)
    with pytest.raises(UsageError) as e:
        spec.validate()
    assert e.value.option == kind.value
    assert "\n" not in str(e.value) and says in str(e.value) and len(str(e.value)) <= 300
    with pytest.raises(UsageError):
        Constraint(spec)  # no matcher for it either


@pytest.mark.parametrize("make,option", [
    (lambda: ConstraintSpec.choice([]), "choice"),
    (lambda: ConstraintSpec("choice", [1, 2]), "choice"),
    (lambda: ConstraintSpec.regex(""), "regex"),
    (lambda: ConstraintSpec("json_object", "{}"), "json_object"),
    (lambda: ConstraintSpec("xml", "<a/>"), "constraint"),
])
def test_malformed_specs_fail_at_construction(make, option):
    with pytest.raises(UsageError) as e:
        make()
    assert e.value.option == option and "\n" not in str(e.value)


def test_specs_are_values():
    a = ConstraintSpec.json_schema({"type": "string"})
    assert a == ConstraintSpec(ConstraintKind.json_schema, json.dumps({"type": "string"})) and hash(a) == hash(ConstraintSpec("json_schema", a.value))
    assert ConstraintSpec.choice(["x", "y"]).value == ("x", "y") and ConstraintSpec("choice", ["x", "y"]) == ConstraintSpec.choice(("x", "y"))
    assert a.validate() is a and a.schema() == {"type": "string"} and ConstraintSpec.json_object().schema() == {"type": "object"}


# ---------------------------------------------------------------- without llguidance


def test_without_llguidance_the_module_imports_and_use_names_the_extra():
    code = (
        "import sys; sys.modules['llguidance'] = None\n"
        "from gpt2x.generation import constraints as c\n"
        "from gpt2x.errors import MissingDependencyError\n"
        "spec = c.ConstraintSpec.regex('[0-9]+')\n"
        "try:\n    spec.validate()\nexcept MissingDependencyError as e:\n    print('MISSING', e)\n"
        "assert not any(m.startswith('llguidance') for m in sys.modules if sys.modules[m] is not None)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, encoding="utf-8", timeout=120)
    assert out.returncode == 0, out.stderr
    assert "MISSING structured output needs llguidance" in out.stdout and "pip install 'gpt2x[structured]'" in out.stdout
    assert MissingDependencyError.exit_code == 10


def test_constraints_run_where_torch_cannot_import():
    """The ONNX Runtime path has no torch: llguidance and its NumPy helpers need none."""
    code = (
        "import sys; sys.modules['torch'] = None; sys.modules['transformers'] = None\n"
        "import numpy as np\n"
        "from gpt2x.generation.constraints import Constraint, ConstraintSpec, mask_rows\n"
        "rows = [Constraint(ConstraintSpec.json_object()), Constraint(ConstraintSpec.regex('[0-9]+'))]\n"
        "logits = mask_rows(np.zeros((2, 50257), dtype=np.float32), rows)\n"
        "assert np.isfinite(logits).sum(axis=1).tolist()[1] > 1\n"
        "print('OK', sorted(m for m in sys.modules if m.split('.')[0] == 'torch' and sys.modules[m] is not None))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, encoding="utf-8", timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "OK []"
