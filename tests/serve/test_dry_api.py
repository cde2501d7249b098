"""llama-server's DRY fields on /v1/completions, /v1/chat/completions and the offline API: the tokens generate()
gives for the same settings (greedy and seeded, several prompts in one request batched with per-row parameters), and
bad values a 400 naming the field (processors.Dry itself: tests/generation/test_dry.py)."""

from __future__ import annotations

import pytest

from gpt2x.generation.generate import generate
from gpt2x.generation.processors import Dry
from gpt2x.generation.settings import SamplingSettings
from gpt2x.serve.openai.chat_completion.template import ChatTemplate
from gpt2x.tokenizer import decode

from ..helpers import local_service, post

DIALOGPT = "{% for message in messages %}{{ message.content }}{{ eos_token }}{% endfor %}"
MESSAGES = [{"role": "user", "content": "Good morrow, my lord."}]
RENDERED = "Good morrow, my lord.<|endoftext|>"  # by hand
DRY = {"dry_multiplier": 2.0, "dry_base": 1.5, "dry_allowed_length": 2, "dry_penalty_last_n": 64,
       "dry_sequence_breakers": [":"]}


@pytest.fixture(scope="module")
def service(export_dir):
    s = local_service(export_dir, chat_template=ChatTemplate(DIALOGPT, "test"))
    yield s
    s.close()


def settings(max_tokens: int, **body) -> SamplingSettings:
    return SamplingSettings(max_new_tokens=max_tokens, **{**body, "dry_sequence_breakers": tuple(body["dry_sequence_breakers"])})


def test_completions_give_what_generate_gives(client, reference, monkeypatch):
    """Greedy and seeded sampling with every DRY field: generate()'s tokens, not those of the request without them
    (greedy loops from ROMEO:; the sample from a repetitive prompt repeats it); three prompts in one request (each a
    row with its own parameters: the engine's batch) as each alone."""
    for prompt, sampling in (("ROMEO:", {"temperature": 0}),
                             ("To be, or not to be, to be, or not to be, to be, or not", {"temperature": 0.5, "seed": 5})):
        body = {"prompt": prompt, "max_tokens": 32, "ignore_eos": True, **sampling, **DRY}
        got = post(client, **body)["choices"][0]["text"]
        want = generate(reference, [prompt], settings(32, ignore_eos=True, **sampling, **DRY))[0]
        assert got == decode(want.tokens)
        assert got != post(client, **{k: v for k, v in body.items() if not k.startswith("dry_")})["choices"][0]["text"]
    batches = []
    for_rows = Dry.for_rows.__func__
    monkeypatch.setattr(Dry, "for_rows", classmethod(lambda cls, procs: batches.append(len(procs)) or for_rows(cls, procs)))
    prompts = ["ROMEO:", "KING HENRY:", "To be, or not to be"]
    choices = post(client, prompt=prompts, max_tokens=24, temperature=0, **DRY)["choices"]
    assert 3 in batches  # the three rows sampled together, each by its own processor
    for prompt, choice in zip(prompts, sorted(choices, key=lambda c: c["index"])):
        assert choice["text"] == decode(generate(reference, [prompt], settings(24, greedy=True, **DRY))[0].tokens)


def test_chat_honours_them(client, reference):
    body = {"messages": MESSAGES, "max_tokens": 24, "temperature": 0}
    r = client.post("/v1/chat/completions", json={**body, **DRY})
    assert r.status_code == 200, r.text
    want = generate(reference, [RENDERED], settings(24, greedy=True, **DRY))[0]
    assert r.json()["choices"][0]["message"]["content"] == decode(want.tokens)
    plain = client.post("/v1/chat/completions", json=body).json()["choices"][0]["message"]["content"]
    assert plain != decode(want.tokens)


@pytest.mark.parametrize("field,param", [
    ({"dry_multiplier": -1}, "dry_multiplier"), ({"dry_base": 0.5}, "dry_base"), ({"dry_allowed_length": 0}, "dry_allowed_length"),
    ({"dry_allowed_length": 2.5}, "dry_allowed_length"), ({"dry_penalty_last_n": -2}, "dry_penalty_last_n"),
    ({"dry_sequence_breakers": []}, "dry_sequence_breakers"), ({"dry_sequence_breakers": [""]}, "dry_sequence_breakers"),
    ({"dry_sequence_breakers": "\n"}, "dry_sequence_breakers"),
    ({"dry_multiplier": 0.8, "use_beam_search": True, "n": 2}, "use_beam_search"),
])
def test_bad_values_are_a_400_naming_the_field(client, field, param):
    for route, body in (("/v1/completions", {"prompt": "a"}), ("/v1/chat/completions", {"messages": MESSAGES})):
        r = client.post(route, json={**body, "max_tokens": 2, **field})
        assert r.status_code == 400 and r.json()["error"]["param"] == param, (route, r.text)


def test_the_offline_api_takes_them(export_dir, reference):
    from gpt2x import LLM, SamplingParams

    with LLM(str(export_dir), threads=1, max_batch_size=2) as llm:
        [out] = llm.generate("ROMEO:", SamplingParams(max_tokens=24, temperature=0, **DRY))
        [plain] = llm.generate("ROMEO:", SamplingParams(max_tokens=24, temperature=0))
    want = generate(reference, ["ROMEO:"], settings(24, greedy=True, **DRY))[0]
    assert out.outputs[0].token_ids == want.tokens != plain.outputs[0].token_ids
