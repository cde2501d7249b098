"""Structured output through every path that decodes: generate() on every backend (greedy and
sampled), a served batch whose rows each have their own constraint, speculative decoding, the API
(response_format, structured_outputs, streamed and not) and `gpt2x generate`'s options. A finished
output is checked with an independent reference: jsonschema for a schema, re.fullmatch for a regex,
membership for a choice; greedy tokens are checked against a second backend (PyTorch)."""

from __future__ import annotations

import json
import re
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import jsonschema
import numpy as np
import pytest
from fastapi.testclient import TestClient

from gpt2x.choices import BackendKind, Precision
from gpt2x.errors import Gpt2xError
from gpt2x.generation.constraints import ConstraintSpec
from gpt2x.generation.generate import generate
from gpt2x.generation.settings import Finish, SamplingSettings
from gpt2x.generation.speculative import DraftSettings, ModelDrafter, NgramDrafter
from gpt2x.model.weights import load_model
from gpt2x.onnx.artifact import read_export
from gpt2x.runtime.ort import OrtBackend
from gpt2x.runtime.pytorch import TorchBackend
from gpt2x.serve.core.engine import Engine, EngineSettings, Row
from gpt2x.serve.core.outputs import Failed, Finished, TokenOut
from gpt2x.serve.openai.routes import local_app
from gpt2x.serve.openai.service import CompletionService
from gpt2x.tokenizer import decode, encode
from gpt2x.workflows.backends import export_backend

from ..helpers import cli

SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 99}},
          "required": ["name", "age"], "additionalProperties": False}
REGEX = r"[A-Z][a-z]{1,8} (loves|hates) [A-Z][a-z]{1,8}\."
CHOICES = ["yes", "no", "perhaps not"]
SPECS = {"json": ConstraintSpec.json_schema(SCHEMA), "regex": ConstraintSpec.regex(REGEX), "choice": ConstraintSpec.choice(CHOICES)}
PROMPTS = ["ROMEO:", "JULIET: Tell me, good nurse,"]
EXAMPLES = ('{"name": "Tybalt", "age": 30} {"name": "Romeo", "age": 16} Romeo loves Juliet. Tybalt hates Romeo. '
            'perhaps not, yes, no. {"name": "')


def satisfied(kind: str, text: str) -> bool:
    if kind == "json":
        jsonschema.validate(json.loads(text), SCHEMA)
        return True
    if kind == "regex":
        return re.fullmatch(REGEX, text) is not None
    return text in CHOICES


@pytest.fixture(scope="module")
def torch_backend():
    return TorchBackend(load_model("shakespeare")[0])


@pytest.fixture(scope="module")
def backends(bundled_export, torch_backend):
    fp32, int8 = bundled_export(Precision.fp32), bundled_export(Precision.int8)
    opened = {"torch": torch_backend, "ort-fp32": OrtBackend(fp32, threads=1), "ort-int8": OrtBackend(int8, threads=1),
              "openvino": export_backend(BackendKind.openvino, fp32, threads=1),
              "genai": export_backend(BackendKind.genai, fp32, threads=1),
              "web": export_backend(BackendKind.web, fp32, threads=1)}
    yield opened
    for b in opened.values():
        b.close()


@pytest.mark.parametrize("name", ["torch", "ort-fp32", "ort-int8", "openvino", "genai", "web"])
def test_every_backend_keeps_to_the_constraint_greedy_and_sampled(backends, name):
    backend = backends[name]
    for kind, spec in SPECS.items():
        for s in (SamplingSettings(max_new_tokens=48, greedy=True, constraint=spec),
                  SamplingSettings(max_new_tokens=48, seed=4, constraint=spec)):
            for g in generate(backend, PROMPTS, s):
                assert g.finish_reason is Finish.eos, (name, kind, decode(g.tokens))  # bounded: each finishes
                assert satisfied(kind, decode(g.tokens)), (name, kind, decode(g.tokens))
    if name in ("ort-fp32", "openvino", "genai", "web"):  # fp32: the PyTorch reference's greedy tokens
        for spec in SPECS.values():
            s = SamplingSettings(max_new_tokens=48, greedy=True, constraint=spec)
            assert [g.tokens for g in generate(backend, PROMPTS, s)] == [g.tokens for g in generate(backends["torch"], PROMPTS, s)]


def test_a_cut_off_says_length_and_unconstrained_text_differs(torch_backend):
    spec = ConstraintSpec.regex("[a-z]+")  # unbounded: only max_new_tokens ends it
    g = generate(torch_backend, ["ROMEO:"], SamplingSettings(max_new_tokens=6, seed=1, constraint=spec))[0]
    assert g.finish_reason is Finish.length and len(g.tokens) == 6 and re.fullmatch("[a-z]+", decode(g.tokens))
    free = generate(torch_backend, ["ROMEO:"], SamplingSettings(max_new_tokens=6, seed=1))[0]
    assert not re.fullmatch("[a-z]+", decode(free.tokens))  # the model alone writes other text here


def test_served_rows_each_keep_their_own_constraint(bundled_export):
    """One batch, rows joining it, each with its own constraint (or none): each row's tokens are those
    it gets alone from generate(), and satisfy its constraint."""
    backend = OrtBackend(bundled_export(Precision.int8), threads=1)
    plan = [("json", 0), ("regex", 1), ("choice", 0), (None, 1), ("json", 1), ("regex", 0)]
    settings = [SamplingSettings(max_new_tokens=40, greedy=i % 2 == 0, seed=i, constraint=SPECS[k] if k else None)
                for i, (k, _) in enumerate(plan)]
    got: list[list[int]] = [[] for _ in plan]
    ends: list[Finish | None] = [None] * len(plan)
    done = threading.Semaphore(0)
    engine = Engine(backend, EngineSettings(max_batch_size=4, batch_wait_s=0, max_join_delay_s=0)).start()

    def sink(i):
        def on(out):
            if isinstance(out, TokenOut):
                got[i].append(out.token)
            elif isinstance(out, Finished):
                ends[i] = out.reason
                done.release()
            else:
                raise AssertionError(out)
        return on

    try:
        engine.submit([Row(encode(PROMPTS[p]), settings[i], sink(i)) for i, (_, p) in enumerate(plan)])
        assert all(done.acquire(timeout=60) for _ in plan)
    finally:
        engine.close()
        backend.close()
    alone_backend = OrtBackend(bundled_export(Precision.int8), threads=1)
    for i, (kind, p) in enumerate(plan):
        alone = generate(alone_backend, [PROMPTS[p]], settings[i])[0]
        assert got[i] == alone.tokens and ends[i] is alone.finish_reason, i
        if kind:
            assert ends[i] is Finish.eos and satisfied(kind, decode(got[i])), (i, decode(got[i]))
    assert engine.counters["errors"] == 0


# A choice past llguidance's Earley row limit (2,000 items): it validates, then its matcher fails at the first token.
TOO_MANY_CHOICES = [f"w{i}" for i in range(2500)]
TOO_MANY = ConstraintSpec.choice(TOO_MANY_CHOICES)


def test_a_row_whose_constraint_fails_ends_alone_and_its_batch_goes_on(bundled_export):
    """One batch of four rows, one with a constraint that fails as it runs: that row is told Failed (the request's
    own doing: client), nothing else; the other three get the tokens they get alone from generate(); the engine
    counts no batch error. generate() itself, with no batch to protect, raises the failure in one line."""
    backend = OrtBackend(bundled_export(Precision.int8), threads=1)
    settings = [SamplingSettings(max_new_tokens=12, greedy=True, constraint=TOO_MANY if i == 1 else SPECS["regex"] if i == 2 else None)
                for i in range(4)]
    outs: list[list] = [[] for _ in settings]
    done = threading.Semaphore(0)
    engine = Engine(backend, EngineSettings(max_batch_size=4, batch_wait_s=0, max_join_delay_s=0)).start()

    def sink(i):
        def on(out):
            outs[i].append(out)
            if isinstance(out, (Finished, Failed)):
                done.release()
        return on

    try:
        engine.submit([Row(encode(PROMPTS[i % 2]), settings[i], sink(i)) for i in range(4)])
        assert all(done.acquire(timeout=60) for _ in settings)
    finally:
        engine.close()
    failed = outs[1][-1]
    assert isinstance(failed, Failed) and failed.client and "max is 2000" in failed.message, outs[1]
    assert sum(isinstance(o, TokenOut) for o in outs[1]) <= 1  # the first, which its mask allowed and its matcher refused
    for i in (0, 2, 3):
        alone = generate(backend, [PROMPTS[i % 2]], settings[i])[0]
        assert [o.token for o in outs[i] if isinstance(o, TokenOut)] == alone.tokens, i
        assert isinstance(outs[i][-1], Finished) and outs[i][-1].reason is alone.finish_reason
    assert engine.counters["errors"] == 0
    with pytest.raises(Gpt2xError, match="max is 2000"):
        generate(backend, [PROMPTS[0]], settings[1])
    backend.close()


def test_the_api_answers_a_failing_constraint_400_and_the_requests_beside_it_200(client):
    """Six requests at once, one with a constraint that fails as it runs: that one a 400 in OpenAI's shape (streamed:
    its error event, then DONE), the five others answered whole."""
    bad = {"prompt": "ROMEO:", "max_tokens": 8, "structured_outputs": {"choice": TOO_MANY_CHOICES}}
    good = {"prompt": "ROMEO:", "max_tokens": 8, "temperature": 0}
    with ThreadPoolExecutor(6) as pool:
        answers = list(pool.map(lambda body: client.post("/v1/completions", json=body), [good, good, bad, good, good, good]))
    assert answers[2].status_code == 400 and "max is 2000" in answers[2].json()["error"]["message"], answers[2].text
    assert all(r.status_code == 200 and r.json()["choices"][0]["finish_reason"] for i, r in enumerate(answers) if i != 2)
    with client.stream("POST", "/v1/completions", json={**bad, "stream": True}) as s:
        lines = [line for line in s.iter_lines() if line]
    assert lines[-1] == "data: [DONE]" and "max is 2000" in json.loads(lines[-2][6:])["error"]["message"]


def test_a_request_is_read_and_its_schema_compiled_off_the_event_loop(client, monkeypatch):
    """A schema can take seconds to compile (a 60,000-value enum: about 1.6 s here, 0.3-0.9 once llguidance's
    tokenizer is built). Stood in for by a parse that takes 1.5 s: meanwhile /health answers well within 0.9 s (at once,
    but for a busy machine: the suite's other worker stalled one 0.56 s), as every other request and stream would; read
    on the event loop, each waited the whole parse (1.4 s)."""
    target = client.service
    real = target.prepare

    def slow(request):
        time.sleep(1.5)  # sleeps release the GIL, as llguidance's compile does
        return real(request)

    monkeypatch.setattr(target, "prepare", slow)
    with ThreadPoolExecutor(1) as pool:
        pending = pool.submit(client.post, "/v1/completions", json={"prompt": "ROMEO:", "max_tokens": 1})
        time.sleep(0.1)  # the slow request is being read
        waits = []
        while not pending.done():
            started = time.perf_counter()
            assert client.get("/health").status_code == 200
            waits.append(time.perf_counter() - started)
        assert pending.result().status_code == 200, pending.result().text
    assert waits and max(waits) < 0.9, waits


@pytest.mark.parametrize("draft", ["ngram", "int4 model"])
def test_speculative_decoding_keeps_the_constraint_and_greedy_tokens(torch_backend, bundled_export, draft):
    """Prompt lookup drafts tokens the matcher may refuse (rejected, rolled back); a draft model
    samples its drafts through the same mask, its matcher rolled back with the rejected tokens."""
    fixed = DraftSettings(num_speculative_tokens=4, adaptive=False)
    drafter_backend = OrtBackend(bundled_export(Precision.int4), threads=1) if draft != "ngram" else None

    def drafter():
        return NgramDrafter(fixed) if drafter_backend is None else ModelDrafter(drafter_backend)

    prompts = PROMPTS + [EXAMPLES]  # the last has text of each form, for prompt lookup to draft from
    drafted = accepted = 0
    for kind, spec in SPECS.items():
        greedy = SamplingSettings(max_new_tokens=48, greedy=True, constraint=spec)
        plain = generate(torch_backend, prompts, greedy)
        spec_runs = generate(torch_backend, prompts, greedy, draft=drafter(), draft_settings=fixed)
        assert [g.tokens for g in spec_runs] == [g.tokens for g in plain], kind
        drafted += sum(g.speculation["drafted"] for g in spec_runs)
        accepted += sum(g.speculation["accepted"] for g in spec_runs)
        sampled = generate(torch_backend, prompts, SamplingSettings(max_new_tokens=48, seed=9, constraint=spec),
                           draft=drafter(), draft_settings=fixed)
        for g in sampled:
            assert g.finish_reason is Finish.eos and satisfied(kind, decode(g.tokens)), (kind, decode(g.tokens))
    assert accepted > 0 and drafted > accepted  # drafts were verified, and some rejected (rolled back)


@pytest.fixture(scope="module")
def client(export_dir):
    service = CompletionService(OrtBackend(read_export(export_dir), threads=1), EngineSettings(max_batch_size=8), "shakespeare")
    with TestClient(local_app(service)) as c:
        c.service = service  # what the tests may stand in for
        yield c
    service.close()


@pytest.mark.parametrize("body,kind", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA}}}, "json"),
    ({"structured_outputs": {"json": SCHEMA}}, "json"),
    ({"structured_outputs": {"regex": REGEX}}, "regex"),
    ({"structured_outputs": {"choice": CHOICES}}, "choice"),
    # llama-server's own: a schema beside response_format's type, its json_schema and grammar (GBNF) fields
    ({"response_format": {"type": "json_object", "schema": SCHEMA}}, "json"),
    ({"json_schema": SCHEMA}, "json"),
    ({"grammar": 'root ::= "yes" | "no" | "perhaps not"'}, "choice"),
])
def test_the_api_keeps_each_choice_to_the_constraint(client, body, kind):
    request = {"prompt": PROMPTS, "max_tokens": 48, "n": 2, "seed": 3, **body}
    r = client.post("/v1/completions", json=request)
    assert r.status_code == 200, r.text
    choices = r.json()["choices"]
    assert len(choices) == 4
    for c in choices:
        assert c["finish_reason"] == "stop" and satisfied(kind, c["text"]), c
    with client.stream("POST", "/v1/completions", json={**request, "stream": True}) as s:
        chunks = [json.loads(line[6:]) for line in s.iter_lines() if line and line != "data: [DONE]"]
    texts = {i: "".join(ch["text"] for chunk in chunks for ch in chunk["choices"] if ch["index"] == i) for i in range(4)}
    assert texts == {c["index"]: c["text"] for c in choices}  # streamed: the same text


def test_json_object_gives_an_object(client):
    r = client.post("/v1/completions", json={"prompt": "ROMEO:", "max_tokens": 60, "temperature": 0,
                                             "response_format": {"type": "json_object"}})
    c = r.json()["choices"][0]
    assert c["finish_reason"] in ("stop", "length")
    if c["finish_reason"] == "stop":
        assert isinstance(json.loads(c["text"]), dict)
    else:
        assert c["text"].startswith("{")


@pytest.mark.parametrize("body,param,words", [
    ({"structured_outputs": {"regex": "(ab"}}, "structured_outputs", "invalid regex"),
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": {"type": "objekt"}}}}, "response_format", "invalid JSON schema"),
    ({"structured_outputs": {"grammar": "start: foo"}}, "structured_outputs", "invalid grammar"),
    ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs", "exactly one"),
    ({"response_format": {"type": "json_object"}, "structured_outputs": {"regex": "a"}}, "structured_outputs", "send one"),
    ({"structured_outputs": {"regex": "a+"}, "ignore_eos": True}, "ignore_eos", "ignore_eos"),
    ({"json_schema": {"type": "objekt"}}, "json_schema", "invalid JSON schema"),
    ({"grammar": "root ::= ("}, "grammar", "invalid grammar"),
    ({"json_schema": SCHEMA, "grammar": 'root ::= "a"'}, "grammar", "send one"),
    ({"response_format": {"type": "text", "schema": SCHEMA}}, "response_format", "type text takes no schema"),
    ({"response_format": {"type": "json_schema", "schema": SCHEMA, "json_schema": {"schema": SCHEMA}}}, "response_format",
     "send one"),
])
def test_a_bad_constraint_is_a_400_before_any_work(client, body, param, words):
    r = client.post("/v1/completions", json={"prompt": "ROMEO:", "max_tokens": 8, **body})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and words in error["message"] and "\n" not in error["message"]


def test_the_cli_takes_each_constraint_and_refuses_a_bad_one(tmp_path, export_dir, capsys):
    """In this process (eight subprocesses took 10 s of the suite; test_docs runs the README's example as a user
    does)."""
    schema = tmp_path / "person.json"
    schema.write_text(json.dumps(SCHEMA))
    grammar = tmp_path / "g.lark"
    grammar.write_text('start: "to be" | "not to be"')
    for options, check in ((["--json-schema", str(schema)], lambda t: satisfied("json", t)),
                           (["--regex", REGEX], lambda t: satisfied("regex", t)),
                           (["--choice", "yes", "--choice", "no"], lambda t: t in ("yes", "no")),
                           (["--grammar", str(grammar)], lambda t: t in ("to be", "not to be"))):
        code, stdout, stderr = cli(capsys, "generate", "ROMEO:", "--onnx", str(export_dir), "--max-new-tokens", "48",
                                   "--seed", "1", "--json", *options)
        assert code == 0, stderr
        out = json.loads(stdout)  # one JSON line: one prompt, one sample
        assert out["finish_reason"] == "eos" and check(out["text"]), out
    overlapping = tmp_path / "overlapping.json"
    overlapping.write_text(json.dumps(REFUSED["overlapping-strings"]))
    for options, words in ((["--regex", "(ab"], "invalid regex"), (["--regex", "a", "--choice", "a"], "one structured-output option"),
                           (["--grammar", str(tmp_path / "missing.lark")], "grammar file not found"),
                           (["--json-schema", str(overlapping)], "oneOf at /properties/code: branches 0 and 1 may both match")):
        code, stdout, stderr = cli(capsys, "generate", "ROMEO:", "--onnx", str(export_dir), *options)
        assert code == 2 and words in stderr and len(stderr.strip().splitlines()) == 1, stderr
        assert stdout == ""


def test_constraints_need_no_torch_and_accept_numpy_logits_of_any_row_count():
    from gpt2x.generation.processors import ConstraintMask, History

    mask = ConstraintMask(SPECS["choice"])
    scores = np.zeros((2, 50257))
    rows = [History([1], [], "a"), History([1], [], "b")]
    out = mask(scores, rows)
    allowed = [set(np.flatnonzero(np.isfinite(r))) for r in out]
    firsts = {encode(c)[0] for c in CHOICES}
    assert allowed[0] == allowed[1] and firsts <= allowed[0]


# ------------------------------------------------------------------ real-world schemas (issue 39, item 7)

# Written by hand in the style of public real-world schemas: the keywords llguidance lacks (oneOf,
# formats it does not know, draft-7 dependencies) rewritten to what it enforces without admitting a
# value the original refuses; each instance's verdict is jsonschema's on the ORIGINAL schema.
NAME = {"type": "string", "maxLength": 8}
DRAFT7 = "http://json-schema.org/draft-07/schema#"
REAL_WORLD = {
    "payment-discriminated": {  # a const discriminator both branches require
        "type": "object", "required": ["payment"], "additionalProperties": False,
        "properties": {"payment": {"oneOf": [
            {"type": "object", "required": ["method", "last4"], "additionalProperties": False,
             "properties": {"method": {"const": "card"}, "last4": {"type": "string", "pattern": "^[0-9]{4}$"}}},
            {"type": "object", "required": ["method"], "additionalProperties": False,
             "properties": {"method": {"const": "cash"}, "tip": {"type": "integer", "minimum": 0, "maximum": 9}}}]}}},
    "shape-enum-refs": {  # draft 7: branches by $ref, an enum discriminator
        "$schema": DRAFT7, "type": "object", "required": ["kind"],
        "definitions": {"circle": {"type": "object", "required": ["kind", "r"], "additionalProperties": False,
                                   "properties": {"kind": {"enum": ["circle", "disc"]}, "r": {"type": "integer", "minimum": 1, "maximum": 9}}},
                        "square": {"type": "object", "required": ["kind", "side"], "additionalProperties": False,
                                   "properties": {"kind": {"enum": ["square"]}, "side": {"type": "integer", "minimum": 1, "maximum": 9}}}},
        "oneOf": [{"$ref": "#/definitions/circle"}, {"$ref": "#/definitions/square"}]},
    "id-by-type": {  # disjoint types
        "type": "object", "required": ["id"], "additionalProperties": False,
        "properties": {"id": {"oneOf": [{"type": "integer", "minimum": 0, "maximum": 999}, {"type": "string", "pattern": "^[a-z]{2,6}$"}, {"type": "null"}]}}},
    "formats": {  # url and country-code: annotations llguidance does not know; uuid... it does not need
        "type": "object", "required": ["homepage", "country"], "additionalProperties": False,
        "properties": {"homepage": {"type": "string", "format": "url", "maxLength": 16},
                       "country": {"type": "string", "format": "country-code", "pattern": "^[A-Z]{2}$"}}},
    "dependencies-names": {  # draft 7: credit_card needs billing_address
        "$schema": DRAFT7, "type": "object", "required": ["name"], "additionalProperties": False,
        "properties": {"name": NAME, "credit_card": {"type": "string", "pattern": "^[0-9]{4}$"}, "billing_address": NAME},
        "dependencies": {"credit_card": ["billing_address"]}},
    "dependencies-schema": {  # draft 7: a subschema per name
        "$schema": DRAFT7, "type": "object", "required": ["name"], "additionalProperties": False,
        "properties": {"name": NAME, "coupon": {"type": "string", "pattern": "^[A-Z]{3}$"}, "discount": {"type": "integer", "minimum": 0, "maximum": 99}},
        "dependencies": {"coupon": {"required": ["discount"], "properties": {"discount": {"minimum": 5}}}}},
    "dependent-required": {  # 2020-12's own spelling
        "type": "object", "required": ["name"], "additionalProperties": False,
        "properties": {"name": NAME, "email": {"type": "string", "format": "email", "maxLength": 16}, "verified": {"type": "boolean"}},
        "dependentRequired": {"verified": ["email"]}},
}
INSTANCES = {  # json.dumps's layout (the matcher's); in the properties' order
    "payment-discriminated": [{"payment": {"method": "card", "last4": "1234"}}, {"payment": {"method": "cash", "tip": 3}},
                              {"payment": {"method": "cash"}}, {"payment": {"method": "card"}},
                              {"payment": {"method": "card", "tip": 3}}, {"payment": {"method": "cheque"}}],
    "shape-enum-refs": [{"kind": "circle", "r": 3}, {"kind": "disc", "r": 3}, {"kind": "square", "side": 2},
                        {"kind": "square", "r": 3}, {"kind": "circle"}, {"kind": "oval", "r": 3}],
    "id-by-type": [{"id": 7}, {"id": "abc"}, {"id": None}, {"id": 7.5}, {"id": "A"}, {"id": True}],
    "formats": [{"homepage": "https://x.io", "country": "FR"}, {"homepage": "not a url", "country": "ZZ"},
                {"homepage": "x", "country": "fra"}],
    "dependencies-names": [{"name": "Ann"}, {"name": "Ann", "credit_card": "1234", "billing_address": "Rome"},
                           {"name": "Ann", "billing_address": "Rome"}, {"name": "Ann", "credit_card": "1234"}],
    "dependencies-schema": [{"name": "Ann"}, {"name": "Ann", "coupon": "ABC", "discount": 10}, {"name": "Ann", "discount": 1},
                            {"name": "Ann", "coupon": "ABC"}, {"name": "Ann", "coupon": "ABC", "discount": 1}],
    "dependent-required": [{"name": "Ann"}, {"name": "Ann", "email": "a@b.io", "verified": True},
                           {"name": "Ann", "email": "a@b.io"}, {"name": "Ann", "verified": False}],
}
REFUSED = {  # oneOf branches that may both match: exactly one cannot be enforced
    "overlapping-strings": {"type": "object", "required": ["code"],
                            "properties": {"code": {"oneOf": [{"type": "string", "maxLength": 5}, {"type": "string", "pattern": "^[a-z]+$"}]}}},
    "discriminator-not-required": {"oneOf": [
        {"type": "object", "properties": {"kind": {"const": "a"}, "x": {"type": "integer"}}, "required": ["x"]},
        {"type": "object", "properties": {"kind": {"const": "b"}, "y": {"type": "integer"}}, "required": ["y"]}]},
}


def valid(schema, instance) -> bool:
    """jsonschema's verdict under the schema's own draft, formats as annotations (the spec's default)."""
    return jsonschema.validators.validator_for(schema)(schema).is_valid(instance)


def matcher_takes(spec: ConstraintSpec, text: str) -> bool:
    """The constraint takes every token of `text` and may end there."""
    from gpt2x.generation.constraints import Constraint

    c, tokens = Constraint(spec), encode(text)
    if c.accepts(tokens) < len(tokens):
        return False
    for t in tokens:
        c.advance(t)
    return c.accepting


@pytest.mark.parametrize("name", sorted(INSTANCES))
def test_real_world_keywords_are_enforced_as_the_original_schema_says(name):
    schema = REAL_WORLD[name]
    spec = ConstraintSpec.json_schema(schema).validate()
    verdicts = [valid(schema, i) for i in INSTANCES[name]]
    assert True in verdicts and False in verdicts  # the cases cut both ways
    assert [matcher_takes(spec, json.dumps(i)) for i in INSTANCES[name]] == verdicts


def test_real_world_schemas_generated_validate_against_the_original(torch_backend):
    for name, schema in REAL_WORLD.items():
        spec = ConstraintSpec.json_schema(schema)
        finished = 0
        for s in (SamplingSettings(max_new_tokens=60, greedy=True, constraint=spec), SamplingSettings(max_new_tokens=60, seed=5, constraint=spec)):
            for g in generate(torch_backend, PROMPTS, s):
                if g.finish_reason is Finish.eos:
                    assert valid(schema, json.loads(decode(g.tokens))), (name, decode(g.tokens))
                    finished += 1
        assert finished, name  # not vacuous: some outputs finish


@pytest.mark.parametrize("name", sorted(REAL_WORLD))
def test_real_world_schemas_served_validate_against_the_original(client, name):
    schema = REAL_WORLD[name]
    finished = 0
    for body in ({"response_format": {"type": "json_schema", "json_schema": {"name": name, "schema": schema}}},
                 {"structured_outputs": {"json": schema}}):
        r = client.post("/v1/completions", json={"prompt": PROMPTS[0], "max_tokens": 60, "n": 2, "seed": 2, **body})
        assert r.status_code == 200, r.text
        for c in r.json()["choices"]:
            if c["finish_reason"] == "stop":
                assert valid(schema, json.loads(c["text"])), (name, c["text"])
                finished += 1
    assert finished  # not vacuous: some outputs finish


@pytest.mark.parametrize("name", sorted(REFUSED))
def test_a_oneof_that_may_match_twice_is_one_400_naming_it(client, name):
    schema = REFUSED[name]
    for body, param in (({"response_format": {"type": "json_schema", "json_schema": {"name": name, "schema": schema}}}, "response_format"),
                        ({"structured_outputs": {"json": schema}}, "structured_outputs")):
        r = client.post("/v1/completions", json={"prompt": "ROMEO:", "max_tokens": 8, **body})
        assert r.status_code == 400, r.text
        error = r.json()["error"]
        assert error["param"] == param and "oneOf" in error["message"] and "both match" in error["message"], error
    with pytest.raises(Exception, match="oneOf"):
        ConstraintSpec.json_schema(schema).validate()


def test_llguidance_knows_the_formats_kept_and_not_those_dropped():
    """LLGUIDANCE_FORMATS as llguidance has them: each kept one compiles as a format; a dropped one alone
    would be refused by llguidance (so dropping it is what makes it accepted)."""
    import llguidance

    from gpt2x.generation.constraints import JSON_DEFAULTS, LLGUIDANCE_FORMATS, lltokenizer

    def compiles(fmt):
        g = llguidance.LLMatcher.grammar_from_json_schema(json.dumps({"type": "string", "format": fmt}), defaults=JSON_DEFAULTS)
        return not llguidance.LLMatcher.validate_grammar_with_warnings(g, lltokenizer())[0]
    assert all(compiles(f) for f in LLGUIDANCE_FORMATS)
    assert not any(compiles(f) for f in ("url", "country-code", "uri-reference", "iri"))
    ConstraintSpec.json_schema({"type": "string", "format": "url"}).validate()
