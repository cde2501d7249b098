"""The completions API as evaluation tools and OpenAI's client use it, in this process without Ray: the
replica's service behind its FastAPI application (openai/routes.py's local_app, the routes and descriptions Ray
Serve serves), through FastAPI's TestClient, an in-process uvicorn on 127.0.0.1 for the `openai`
client, and Schemathesis over the ASGI application for the fuzz.

Every logprob is checked against an independent computation made here: log_softmax of a no-cache
forward (`Backend.run` of the whole sequence on a second backend over the same fp32 export); tokens
against gpt2x's generation code; streamed logprobs against non-streamed ones; token-id prompts
against text prompts; lm-eval's `local-completions` request and its own parsing of the answer.
"""

from __future__ import annotations

import asyncio
import functools
import json
import math
import threading
import time

import numpy as np
import pytest
from fastapi.testclient import TestClient  # noqa: E402

from gpt2x.choices import Precision  # noqa: E402
from gpt2x.generation.generate import generate  # noqa: E402
from gpt2x.generation.settings import Finish, SamplingSettings  # noqa: E402
from gpt2x.generation.speculative import DraftSettings, NgramDrafter  # noqa: E402
from gpt2x.numerics import log_softmax  # noqa: E402
from gpt2x.onnx.artifact import read_export  # noqa: E402
from gpt2x.runtime.ort import OrtBackend  # noqa: E402
from gpt2x.serve.core.engine import EngineSettings  # noqa: E402
from gpt2x.serve.core.outputs import Failed, Finished, Output, PromptLogprobs, TokenOut  # noqa: E402
from gpt2x.serve.openai.completion.protocol import CompletionRequest as CompletionParams  # noqa: E402
from gpt2x.serve.openai.pending import ServedRequest  # noqa: E402
from gpt2x.serve.openai.render import ChoiceText, finish_reason, token_text  # noqa: E402
from gpt2x.serve.openai.routes import Cors, local_app  # noqa: E402
from gpt2x.serve.openai.service import CompletionService  # noqa: E402
from gpt2x.tokenizer import EOT_ID, decode, encode  # noqa: E402

from ..helpers import (  # noqa: E402
    LINES,  # noqa: E402
    EndsAt,  # noqa: E402
    post,
    uvicorn_server,
)

KEY = "api-test-key"
PROMPTS = ["ROMEO:", "What light through yonder window breaks? It is the east", LINES[40], "naïve café ☕ and"]
TOL = 1e-5  # fp32 logits of a batch row against the row alone, as log-probabilities


@pytest.fixture(scope="module")
def service(export_dir):
    backend = OrtBackend(read_export(export_dir), threads=1)
    s = CompletionService(backend, EngineSettings(max_batch_size=8, max_join_delay_s=0), "shakespeare")
    yield s
    s.close()


def streamed(client, **body) -> tuple[dict[int, dict], list[dict]]:
    """Per choice: its text, finish_reason and logprobs, each joined over the stream's chunks."""
    with client.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
        assert r.status_code == 200
        lines = [line for line in r.iter_lines() if line]
    assert lines[-1] == "data: [DONE]"
    out: dict[int, dict] = {}
    chunks = [json.loads(line[6:]) for line in lines[:-1]]
    for chunk in chunks:
        for c in chunk["choices"]:
            got = out.setdefault(c["index"], {"text": "", "finish_reason": None, "logprobs": None})
            got["text"] += c["text"]
            got["finish_reason"] = c["finish_reason"] or got["finish_reason"]
            if c["logprobs"] is not None:
                lp = got["logprobs"] = got["logprobs"] or {k: [] for k in c["logprobs"]}
                for k, v in c["logprobs"].items():
                    lp[k] += v
    return out, chunks


def forward_logprobs(reference, ids: list[int]) -> np.ndarray:
    """log_softmax of every position's logits, one no-cache forward of `ids` alone (T, V)."""
    x = np.asarray([ids], dtype=np.int64)
    mask = np.ones_like(x)
    logits, _ = reference.run(x, mask, np.arange(len(ids), dtype=np.int64)[None], None)
    return log_softmax(logits[0])


def check_entry(lp_row: np.ndarray, token: str, logprob: float, top: dict[str, float], k: int) -> None:
    """One token's logprobs against the distribution `lp_row`: its own, and the k most likely (most
    likely first) plus the chosen one where it is not among them."""
    ids = token_ids()
    assert list(top.values()) == sorted(top.values(), reverse=True)
    assert list(top.values())[:k] == pytest.approx(np.sort(lp_row)[::-1][:k], abs=TOL)
    for name, value in top.items():
        assert value == pytest.approx(lp_row[ids[name]], abs=TOL)
    assert token in top and top[token] == logprob
    assert len(top) == k + (lp_row[ids[token]] < np.sort(lp_row)[::-1][k - 1] - TOL if k else 1)


@functools.lru_cache(maxsize=1)
def token_ids() -> dict[str, int]:
    """Every token's id by the text logprobs list it as (one text per token)."""
    ids = {token_text(t): t for t in range(EOT_ID + 1)}
    assert len(ids) == EOT_ID + 1
    return ids


def check_scored(reference, prompt_ids: list[int], logprobs: dict, k: int, start: int = 0, text: str | None = None):
    """The prompt part of an echo with logprobs: first token null, the others as the forward scores them."""
    lp = forward_logprobs(reference, prompt_ids)
    n = len(prompt_ids)
    assert logprobs["tokens"][:n] == [token_text(t) for t in prompt_ids]
    assert logprobs["token_logprobs"][0] is None and logprobs["top_logprobs"][0] is None
    for i in range(1, n):
        want = lp[i - 1, prompt_ids[i]]
        assert logprobs["token_logprobs"][i] == pytest.approx(want, abs=TOL)
        check_entry(lp[i - 1], logprobs["tokens"][i], logprobs["token_logprobs"][i], logprobs["top_logprobs"][i], k)
    if text is not None:  # each token's text starts at its offset
        offsets = logprobs["text_offset"][:n]
        assert offsets[0] == start and offsets == sorted(offsets)
        for i, t in enumerate(prompt_ids):
            piece = decode([t])
            if "\ufffd" not in piece:
                assert text[offsets[i] - start :].startswith(piece)


# ------------------------------------------------------------------ logprobs and echo


def test_echo_scoring_equals_a_no_cache_forward(client, reference):
    """echo + max_tokens 0 + logprobs: the prompts' text and logprobs only, as lm-eval scores them."""
    body = post(client, prompt=PROMPTS, max_tokens=0, echo=True, logprobs=5)
    assert body["usage"] == {"prompt_tokens": sum(len(encode(p)) for p in PROMPTS), "completion_tokens": 0,
                             "total_tokens": sum(len(encode(p)) for p in PROMPTS),
                             "prompt_tokens_details": {"cached_tokens": 0}}  # scored only: never prefilled
    for i, prompt in enumerate(PROMPTS):
        c = body["choices"][i]
        assert c["index"] == i and c["text"] == prompt and c["finish_reason"] == "length"
        check_scored(reference, encode(prompt), c["logprobs"], 5, 0, prompt)
        assert len(c["logprobs"]["tokens"]) == len(encode(prompt))
    cafe = body["choices"][3]["logprobs"]["tokens"]
    assert any(t.startswith("bytes:\\x") for t in cafe)  # ☕'s bytes split over tokens, written as OpenAI writes them
    assert len(set(cafe)) == len(set(encode(PROMPTS[3])))
    assert post(client, prompt="ROMEO:", max_tokens=0, echo=True)["choices"][0] == {
        "index": 0, "text": "ROMEO:", "logprobs": None, "finish_reason": "length",
        "prompt_logprobs": None, "prompt_token_ids": None, "token_ids": None}  # vLLM's keys, null unless asked for


@pytest.mark.parametrize("sampling", [dict(temperature=0), dict(temperature=0.7, top_k=20, top_p=0.9, seed=3)])
def test_generated_logprobs_are_the_raw_distribution(client, reference, sampling):
    """Each generated token's logprob is log_softmax of the model's logits at its position (raw: not
    the tempered or filtered distribution it was sampled from), and the tokens are generate's."""
    prompt = PROMPTS[1]
    ids = encode(prompt)
    body = post(client, prompt=prompt, max_tokens=24, logprobs=3, echo=True, **sampling)
    c = body["choices"][0]
    settings = SamplingSettings(max_new_tokens=24, greedy=sampling.get("temperature") == 0,
                                **{k: v for k, v in sampling.items() if k != "temperature" or v})
    g = generate(reference, [prompt], settings)[0]
    assert c["text"] == prompt + decode(g.tokens)
    lps = c["logprobs"]
    check_scored(reference, ids, lps, 3, 0, prompt)
    full = ids + g.tokens
    lp = forward_logprobs(reference, full + ([EOT_ID] if g.finish_reason == "eos" else []))
    n = len(ids)
    extra = 1 if g.finish_reason == "eos" else 0  # the end-of-text token is listed last
    assert len(lps["tokens"]) == len(full) + extra and body["usage"]["completion_tokens"] == len(g.tokens)
    for j, tok in enumerate(g.tokens + ([EOT_ID] if extra else [])):
        i = n + j
        assert lps["tokens"][i] == token_text(tok)
        assert lps["token_logprobs"][i] == pytest.approx(lp[i - 1, tok], abs=TOL)
        check_entry(lp[i - 1], lps["tokens"][i], lps["token_logprobs"][i], lps["top_logprobs"][i], 3)
        assert lps["text_offset"][i] == len(prompt + decode(g.tokens[:j]))
        if sampling.get("temperature") == 0:  # greedy: the chosen token is the most likely one
            assert lps["token_logprobs"][i] == max(lps["top_logprobs"][i].values())


@pytest.mark.parametrize("body", [
    dict(prompt=PROMPTS, max_tokens=20, logprobs=2, temperature=0),
    dict(prompt=PROMPTS[:2], max_tokens=20, logprobs=1, echo=True, temperature=0.8, seed=5),
    dict(prompt=PROMPTS[:2], max_tokens=0, logprobs=0, echo=True),
    dict(prompt="ROMEO:", max_tokens=40, logprobs=1, temperature=0, stop=["\n\n", "the"]),
])
def test_streamed_logprobs_equal_the_non_streamed(client, body):
    whole = post(client, **body)
    got, chunks = streamed(client, **body, stream_options={"include_usage": True})
    assert chunks[-1]["usage"] == whole["usage"]
    for c in whole["choices"]:
        s = got[c["index"]]
        assert (s["text"], s["finish_reason"]) == (c["text"], c["finish_reason"])
        assert s["logprobs"] == c["logprobs"]
        assert len(c["logprobs"]["tokens"]) == len(c["logprobs"]["text_offset"]) == len(c["logprobs"]["top_logprobs"])
    if body.get("max_tokens"):
        assert len(chunks) > 10  # token by token


def test_token_id_prompts_equal_text_prompts(client):
    def same(a: dict, b: dict) -> None:
        assert a["choices"] == b["choices"] and a["usage"] == b["usage"]

    ids = [encode(p) for p in PROMPTS]
    for extra in (dict(max_tokens=12, temperature=0, logprobs=2, echo=True), dict(max_tokens=0, echo=True, logprobs=1),
                  dict(max_tokens=10, temperature=0.9, seed=8)):
        same(post(client, prompt=ids, **extra), post(client, prompt=PROMPTS, **extra))
        same(post(client, prompt=ids[1], **extra), post(client, prompt=PROMPTS[1], **extra))
    assert post(client, prompt=[[EOT_ID]], max_tokens=5, temperature=0)["choices"][0]["text"] == \
        post(client, prompt="", max_tokens=5, temperature=0)["choices"][0]["text"]


def test_a_request_as_lm_eval_sends_it(client, reference):
    """lm-eval's `local-completions` loglikelihood request, exactly as it builds it (token ids, echo,
    max_tokens 1, logprobs 1), and its own parsing of the answer: each continuation's log-likelihood
    and greediness equal those computed here from a no-cache forward."""
    from lm_eval.models import openai_completions as lm_eval
    greedy = generate(reference, ["KING HENRY:"], SamplingSettings(max_new_tokens=3, greedy=True))[0].tokens
    pairs = [(encode("ROMEO:"), encode(" I will")), (encode("What light through yonder"), encode(" window breaks")),
             (encode("KING HENRY:"), greedy)]  # the last one is greedy
    inputs = [c + x for c, x in pairs]
    ctxlens = [len(c) for c, _ in pairs]
    model = lm_eval.LocalCompletionsAPI.__new__(lm_eval.LocalCompletionsAPI)
    model.model = "shakespeare"
    payload = model._create_payload(inputs, generate=False, seed=1234)
    assert payload["echo"] is True and payload["max_tokens"] == 1 and payload["logprobs"] == 1
    r = client.post("/v1/completions", json=payload)
    assert r.status_code == 200, r.text
    parsed = lm_eval.LocalCompletionsAPI.parse_logprobs(r.json(), tokens=inputs, ctxlens=ctxlens)
    assert [g for _, g in parsed] == [False, False, True]
    for (ll, greedy), ids, n in zip(parsed, inputs, ctxlens):
        lp = forward_logprobs(reference, ids)
        want = sum(lp[i - 1, ids[i]] for i in range(n, len(ids)))
        assert ll == pytest.approx(want, abs=1e-4)
        assert greedy == all(int(lp[i - 1].argmax()) == ids[i] for i in range(n, len(ids)))


def test_end_of_text_is_listed_last_so_lm_eval_drops_the_right_token(export_dir):
    """A model whose next token is <|endoftext|>: the choice ends ("stop", no text) and lists it last,
    so lm-eval's `token_logprobs[ctxlen:-1]` still covers every prompt token."""
    prompt = encode("ROMEO: I will")
    service = CompletionService(EndsAt(OrtBackend(read_export(export_dir), threads=1), len(prompt)),
                                EngineSettings(), "shakespeare")
    try:
        with TestClient(local_app(service)) as c:
            body = post(c, prompt=[prompt], max_tokens=1, echo=True, logprobs=1, temperature=0)
            streamed_body, _ = streamed(c, prompt=[prompt], max_tokens=1, echo=True, logprobs=1, temperature=0)
    finally:
        service.close()
    choice = body["choices"][0]
    assert choice["finish_reason"] == "stop" and choice["text"] == "ROMEO: I will"
    lps = choice["logprobs"]
    assert len(lps["tokens"]) == len(prompt) + 1 and lps["tokens"][-1] == "<|endoftext|>"
    assert lps["text_offset"][-1] == len("ROMEO: I will") and body["usage"]["completion_tokens"] == 0
    assert lps["token_logprobs"][-1] == max(lps["top_logprobs"][-1].values())
    assert streamed_body[0]["logprobs"] == lps


def test_concurrent_mixed_requests_each_equal_their_reference(client, reference, service):
    """Scoring-only, generating-with-logprobs and plain requests at once: scoring rows start inside a
    running batch (continuous batching), and every answer is what it is alone."""
    bodies = [dict(prompt=LINES[100 + i], max_tokens=[0, 16, 30][i % 3], echo=i % 3 != 2, logprobs=[2, 1, None][i % 3],
                   temperature=0) for i in range(12)]
    before = service.health()

    async def all_at_once():
        import httpx

        transport = httpx.ASGITransport(app=client.app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test", timeout=120) as c:
            return await asyncio.gather(*[c.post("/v1/completions", json=b) for b in bodies])

    answers = asyncio.run(all_at_once())
    for b, a in zip(bodies, answers):
        assert a.status_code == 200, a.text
        c = a.json()["choices"][0]
        ids = encode(b["prompt"])
        if b["max_tokens"]:
            g = generate(reference, [b["prompt"]], SamplingSettings(max_new_tokens=b["max_tokens"], greedy=True))[0]
            assert c["text"] == (b["prompt"] if b["echo"] else "") + decode(g.tokens)
        if b["echo"] and b["logprobs"] is not None:
            check_scored(reference, ids, c["logprobs"], b["logprobs"], 0, b["prompt"])
        if b["logprobs"] is None:
            assert c["logprobs"] is None
    after = service.health()
    assert after.rows - before.rows == len(bodies) and after.errors == before.errors == 0


def test_logprobs_with_a_draft_are_decoded_without_it(export_dir, reference):
    """A replica with a draft decodes a request that asks for logprobs plainly (the target's own
    distribution at each token); others speculatively."""
    backend = OrtBackend(read_export(export_dir), threads=1)
    service = CompletionService(backend, EngineSettings(max_batch_size=1, batch_wait_s=0), "shakespeare",
                                drafter=NgramDrafter(), draft_settings=DraftSettings(num_speculative_tokens=4, adaptive=False),
                                draft_name="ngram")
    prompt = "To be, or not to be, to be, or not to be: that is"
    try:
        with TestClient(local_app(service)) as c:
            plain = post(c, prompt=prompt, max_tokens=30, temperature=0)
            drafts = service.health().drafts
            scored = post(c, prompt=prompt, max_tokens=30, temperature=0, logprobs=2, echo=True)
            assert service.health().drafts == drafts > 0  # no draft round for the logprobs request
    finally:
        service.close()
    assert scored["choices"][0]["text"] == prompt + plain["choices"][0]["text"]
    check_scored(reference, encode(prompt), scored["choices"][0]["logprobs"], 2, 0, prompt)


class Events:
    """A row's callback that records every output; after `after` tokens it calls `then` once."""

    def __init__(self, after: int = 0, then=None):
        self.events: list[Output] = []
        self.done = threading.Event()
        self.after, self.then = after, then

    def __call__(self, out: Output) -> None:
        self.events.append(out)
        if isinstance(out, TokenOut) and self.then and len(self.tokens) == self.after:
            self.then()
            self.then = None
        if isinstance(out, (Finished, Failed)):
            self.done.set()

    @property
    def tokens(self) -> list[int]:
        return [o.token for o in self.events if isinstance(o, TokenOut)]


@pytest.mark.parametrize("kind", ["fp32", "int8-in-place"])
def test_rows_scored_and_with_logprobs_join_a_running_batch(export_dir, bundled_export, kind):
    """Engine level: a greedy row runs; once it has 3 tokens, a scoring-only row (max_tokens 0) and a
    row generating with logprobs and prompt logprobs arrive and join it. The scoring forward runs on
    its own cache (ONNX Runtime's in-place buffers included): the running row's tokens are its tokens
    alone, and the scored logprobs equal a no-cache forward's; events come in the documented order."""
    from gpt2x.serve.core.engine import Engine, Row

    folder = export_dir if kind == "fp32" else bundled_export(Precision.int8).folder
    backend = OrtBackend(read_export(folder), threads=1, in_place_kv=False if kind == "fp32" else None)  # both forms
    assert backend.in_place_kv == (kind == "int8-in-place")
    ref = OrtBackend(read_export(folder), threads=1, in_place_kv=False)
    engine = Engine(backend, EngineSettings(max_batch_size=4, max_join_delay_s=0)).start()
    greedy = SamplingSettings(max_new_tokens=40, greedy=True)
    score_ids, gen_ids = encode(LINES[60]), encode(LINES[61][:30])
    scored, generating = Events(), Events()

    def arrive() -> None:
        engine.submit([Row(score_ids, greedy, scored, logprobs=2, prompt_logprobs=True, max_tokens=0),
                       Row(gen_ids, SamplingSettings(max_new_tokens=12, greedy=True), generating, logprobs=1,
                           prompt_logprobs=True)])

    running = Events(3, arrive)
    try:
        engine.submit([Row(encode("ROMEO:"), greedy, running)])
        for events in (running, scored, generating):
            deadline = time.time() + 60
            while not events.done.is_set() and time.time() < deadline:
                time.sleep(0.01)
            assert events.done.is_set()
        assert engine.stats()["joins"] >= 1 and engine.stats()["errors"] == 0
    finally:
        engine.close()
    assert running.tokens == generate(ref, [""], greedy, prompt_ids=[encode("ROMEO:")])[0].tokens
    assert [type(o) for o in scored.events] == [PromptLogprobs, Finished] and scored.events[-1] == Finished(Finish.length)
    entries = scored.events[0].entries
    lp = forward_logprobs(ref, score_ids)
    assert entries[0] == (score_ids[0], None, None) and [e[0] for e in entries] == score_ids
    for i in range(1, len(score_ids)):
        assert entries[i][1] == pytest.approx(lp[i - 1, score_ids[i]], abs=TOL)
        assert [t for t, _ in entries[i][2]] == [int(t) for t in np.argsort(-lp[i - 1], kind="stable")[:2]]
    kinds = [type(o) for o in generating.events]
    assert kinds[0] is PromptLogprobs and kinds[-1] is Finished
    assert kinds[1:-1] == [TokenOut] * len(generating.tokens)  # each with its logprobs; the end of text's on its end
    end = generating.events[-1]
    assert (end.logprob is not None) == (end.reason is Finish.eos)
    told = [o.logprob for o in generating.events[1:-1]] + ([end.logprob] if end.logprob is not None else [])
    assert [e[0] for e in told[: len(generating.tokens)]] == generating.tokens
    if kind == "fp32":  # batch-invariant: the generated tokens' logprobs are those of the row alone
        lp = forward_logprobs(ref, gen_ids + generating.tokens)
        for j, (tok, value, _) in enumerate(told[: len(generating.tokens)]):
            assert value == pytest.approx(lp[len(gen_ids) - 1 + j, tok], abs=TOL)


# ------------------------------------------------------------------ the sampling fields and n choices


def settings_of(body: dict, max_tokens: int) -> SamplingSettings:
    """The SamplingSettings a request body's sampling fields name (the reference's, for generate())."""
    kw = {k: v for k, v in body.items() if k in SamplingSettings.__dataclass_fields__}
    if "logit_bias" in kw:
        kw["logit_bias"] = {int(t): b for t, b in kw["logit_bias"].items()}
    return SamplingSettings(max_new_tokens=max_tokens, **kw)


GREEDY_BODY = dict(temperature=0)
SAMPLED_BODY = dict(temperature=0.8, seed=11)


@pytest.mark.parametrize("base,field", [
    *[(base, field) for base in (GREEDY_BODY, SAMPLED_BODY) for field in (
        dict(presence_penalty=1.5), dict(frequency_penalty=1.2), dict(repetition_penalty=1.6),
        dict(logit_bias={"198": -100, "11": 4.0}),  # no newline, commas favoured
        dict(presence_penalty=-1.0, frequency_penalty=0.5, repetition_penalty=0.8))],
    (SAMPLED_BODY, dict(min_p=0.2)), (SAMPLED_BODY, dict(min_p=0.05, top_k=40, repetition_penalty=1.2)),
])
def test_each_sampling_field_changes_the_text_as_generate_does(client, reference, base, field):
    """Each field, greedy and sampled: the text generate() gives for the same settings (the
    processors themselves are checked against transformers' in test_processors.py), and not the text
    the request gives without it."""
    prompt = PROMPTS[0]
    body = post(client, prompt=prompt, max_tokens=24, **base, **field)
    want = generate(reference, [prompt], settings_of({**base, **field}, 24))[0]
    c = body["choices"][0]
    assert c["text"] == decode(want.tokens) and body["usage"]["completion_tokens"] == len(want.tokens)
    assert c["text"] != post(client, prompt=prompt, max_tokens=24, **base)["choices"][0]["text"]
    if "logit_bias" in field:
        assert "\n" not in c["text"] and c["text"].count(",") >= 3


def test_n_choices_are_seeded_seed_plus_i_as_vllm_does(client, reference):
    """n = 3 for two prompts: six choices, prompt p's i-th at index p * 3 + i, each the text generate()
    gives with seed + i (vLLM's ParentRequest: child i's seed is seed + i), so a choice equals the
    request with n = 1 and that seed; usage counts each prompt once (as vLLM) and every choice's
    tokens; streamed, each choice equals the whole response's.

    (top_k 20: a left-padded row's fp32 logits differ from the row alone's by about 1e-6, which moves
    the inverse-CDF draw between two neighbouring tail tokens when the uniform lands within that of
    their boundary: measured at seed 7 without top-k. Cutting the tail leaves no such boundaries.)"""
    prompts = [PROMPTS[0], PROMPTS[1]]
    body = post(client, prompt=prompts, n=3, seed=7, temperature=0.9, top_k=20, max_tokens=12, presence_penalty=0.5)
    assert [c["index"] for c in body["choices"]] == list(range(6))
    completion = 0
    for p, prompt in enumerate(prompts):
        for i in range(3):
            want = generate(reference, [prompt], SamplingSettings(max_new_tokens=12, temperature=0.9, top_k=20,
                                                                  seed=7 + i, presence_penalty=0.5))[0]
            assert body["choices"][p * 3 + i]["text"] == decode(want.tokens)
            completion += len(want.tokens)
    assert len({c["text"] for c in body["choices"][:3]}) == 3  # three samples, not one thrice
    alone = post(client, prompt=prompts[1], seed=8, temperature=0.9, top_k=20, max_tokens=12, presence_penalty=0.5)
    assert alone["choices"][0]["text"] == body["choices"][4]["text"]
    assert body["usage"] == {"prompt_tokens": sum(len(encode(p)) for p in prompts), "completion_tokens": completion,
                             "total_tokens": sum(len(encode(p)) for p in prompts) + completion,
                             "prompt_tokens_details": {"cached_tokens": 0}}  # prompts under one block
    got, _ = streamed(client, prompt=prompts, n=3, seed=7, temperature=0.9, top_k=20, max_tokens=12, presence_penalty=0.5)
    assert {i: (g["text"], g["finish_reason"]) for i, g in got.items()} == \
        {c["index"]: (c["text"], c["finish_reason"]) for c in body["choices"]}
    echoed = post(client, prompt=prompts[0], n=2, echo=True, max_tokens=3, seed=1)
    assert [c["text"][: len(prompts[0])] for c in echoed["choices"]] == [prompts[0]] * 2


class Prefills(OrtBackend):
    """ONNX Runtime, recording the rows of every prefill (a step with no cache)."""

    def step(self, ids, mask, pos, past):
        if past is None:
            self.prefills.append(ids.shape[0])
        return super().step(ids, mask, pos, past)


@pytest.mark.parametrize("kind", ["fp32", "int8-in-place"])
def test_identical_prompts_are_prefilled_once(export_dir, bundled_export, kind):
    """The runner prefills the distinct prompts of a batch and duplicates their cache rows
    (KVCache.reorder, the growing cache's and the in-place one's): three choices of one prompt and
    another prompt are a prefill of two rows, and every row then decodes as it would alone (fp32:
    generate's tokens; int8, whose graph is not batch-invariant: the duplicates of one greedy prompt
    alike)."""
    from gpt2x.serve.core.request import Row
    from gpt2x.serve.core.runner import Runner

    folder = export_dir if kind == "fp32" else bundled_export(Precision.int8).folder
    backend = Prefills(read_export(folder), threads=1, in_place_kv=False if kind == "fp32" else None)  # both forms
    backend.prefills = []
    assert backend.in_place_kv == (kind == "int8-in-place")
    sampled = kind == "fp32"
    settings = [SamplingSettings(max_new_tokens=10, temperature=0.9 if sampled else 0, top_k=20, seed=3 + i)
                for i in range(3)]  # top_k: see test_n_choices_are_seeded_seed_plus_i_as_vllm_does
    ids = [encode(PROMPTS[1])] * 3 + [encode(PROMPTS[0])]
    rows = [Row(p, s, lambda out: None) for p, s in zip(ids, settings + settings[:1])]
    runner = Runner(backend, {"steps": 0})
    batch, _ = runner.prefill(rows)
    assert backend.prefills == [2] and batch.past.rows == 4 and batch.mask.shape == (4, len(ids[1]))
    while batch.live():
        runner.step(batch)
    if sampled:
        ref = OrtBackend(read_export(folder), threads=1)
        for row, prompt, s in zip(rows, ids, settings + settings[:1]):
            assert row.tokens == generate(ref, [""], s, prompt_ids=[prompt])[0].tokens
        assert rows[0].tokens != rows[1].tokens
    else:
        assert rows[0].tokens == rows[1].tokens == rows[2].tokens and len(rows[0].tokens) == 10


def test_a_stop_token_id_ends_the_choice_with_stop(client, reference):
    """A token of the greedy text as a stop token id: the choice ends before it ("stop"), without its
    text or its count in usage, and lists it last in its logprobs (as the end-of-text token); with
    min_tokens beyond it, it cannot be sampled until then (the text is generate()'s with both)."""
    prompt = PROMPTS[1]
    g = generate(reference, [prompt], SamplingSettings(max_new_tokens=16, greedy=True))[0]
    stop = g.tokens[5]
    first = g.tokens.index(stop)
    body = post(client, prompt=prompt, max_tokens=16, temperature=0, stop_token_ids=[50000, stop], logprobs=1)
    c = body["choices"][0]
    assert (c["finish_reason"], c["text"]) == ("stop", decode(g.tokens[:first]))
    assert body["usage"]["completion_tokens"] == first
    assert len(c["logprobs"]["tokens"]) == first + 1 and c["logprobs"]["tokens"][-1] == token_text(stop)
    got, _ = streamed(client, prompt=prompt, max_tokens=16, temperature=0, stop_token_ids=[50000, stop], logprobs=1)
    assert (got[0]["text"], got[0]["finish_reason"], got[0]["logprobs"]) == (c["text"], "stop", c["logprobs"])
    held = post(client, prompt=prompt, max_tokens=16, temperature=0, stop_token_ids=[stop], min_tokens=first + 2)
    want = generate(reference, [prompt], SamplingSettings(max_new_tokens=16, greedy=True, stop_token_ids=[stop],
                                                          min_tokens=first + 2))[0]
    assert held["choices"][0]["text"] == decode(want.tokens) and len(want.tokens) >= first + 2
    assert stop not in want.tokens[: first + 2]


class EndsFrom(EndsAt):
    """The backend, with <|endoftext|> made the most likely token from sequence position `at` on."""

    def step(self, ids, mask, pos, past):
        logits, past = self.inner.step(ids, mask, pos, past)
        if mask.shape[1] >= self.at:
            logits[:, EOT_ID] = logits.max() + 10
        return logits, past


def test_min_tokens_and_ignore_eos_on_a_model_that_wants_to_end(export_dir):
    """A model whose next token is always <|endoftext|>: a choice is empty ("stop"); with min_tokens 4
    it has 4 tokens first (greedy: generate()'s with the same settings, on the same model); with
    ignore_eos it runs to max_tokens, the end-of-text tokens kept ("length"); min_tokens also keeps a
    stop string from ending the text before its tokens."""
    prompt = encode("ROMEO:")
    service = CompletionService(EndsFrom(OrtBackend(read_export(export_dir), threads=1), len(prompt)),
                                EngineSettings(), "shakespeare")
    ref = EndsFrom(OrtBackend(read_export(export_dir), threads=1), len(prompt))
    try:
        with TestClient(local_app(service)) as c:
            plain = post(c, prompt=[prompt], max_tokens=10, temperature=0)
            held = post(c, prompt=[prompt], max_tokens=10, temperature=0, min_tokens=4)
            sampled = post(c, prompt=[prompt], max_tokens=10, temperature=1, seed=5, min_tokens=6)
            kept = post(c, prompt=[prompt], max_tokens=5, temperature=0, ignore_eos=True)
            first = decode(generate(ref, [""], SamplingSettings(max_new_tokens=1, greedy=True, min_tokens=1),
                                    prompt_ids=[prompt])[0].tokens)
            deferred = post(c, prompt=[prompt], max_tokens=10, temperature=0, min_tokens=4, stop=[first])
    finally:
        service.close()
    assert (plain["choices"][0]["text"], plain["choices"][0]["finish_reason"]) == ("", "stop")
    want = generate(ref, [""], SamplingSettings(max_new_tokens=10, greedy=True, min_tokens=4), prompt_ids=[prompt])[0]
    assert len(want.tokens) == 4 and want.finish_reason == "eos"
    assert (held["choices"][0]["text"], held["choices"][0]["finish_reason"]) == (decode(want.tokens), "stop")
    assert held["usage"]["completion_tokens"] == 4 and sampled["usage"]["completion_tokens"] == 6
    assert (kept["choices"][0]["text"], kept["choices"][0]["finish_reason"]) == ("<|endoftext|>" * 5, "length")
    assert deferred["choices"][0]["text"] == decode(want.tokens)  # the stop string was the first token's text


def test_min_tokens_defers_stop_strings():
    """ChoiceText: a stop string is looked for only after the text of the first min_tokens tokens."""
    ids = encode(" to be or not to be")
    assert [decode([t]) for t in ids] == [" to", " be", " or", " not", " to", " be"]
    for min_tokens, want in ((0, ""), (1, " to be or not"), (3, " to be or not"), (5, " to be or not to be")):
        text = ChoiceText(stop=(" to",), min_tokens=min_tokens)
        assert "".join(text.push(t) for t in ids) + text.finish() == want, min_tokens


# ------------------------------------------------------------------ validation and the schema


@pytest.mark.parametrize("body,param", [
    ({"prompt": "a", "logprobs": 6}, "logprobs"), ({"prompt": "a", "logprobs": -1}, "logprobs"),
    ({"prompt": "a", "logprobs": True}, "logprobs"), ({"prompt": "a", "max_tokens": 0}, "max_tokens"),
    ({"prompt": "a", "max_tokens": 0, "echo": False, "logprobs": 1}, "max_tokens"),
    ({"prompt": [1, 50257]}, "prompt"), ({"prompt": [[1], [-2]]}, "prompt"), ({"prompt": [[]]}, "prompt"),
    ({"prompt": []}, "prompt"), ({"prompt": [1, "a"]}, "prompt"), ({"prompt": [[1], "a"]}, "prompt"),
    ({"prompt": [1.5]}, "prompt"), ({"prompt": [[1]] * 65}, "prompt"), ({"prompt": [1] * 256}, "prompt"),
    ({"prompt": "a", "stream_options": {"include_usage": 1}}, "stream_options"),
    ({"prompt": "a", "echo": "true"}, "echo"), ({"prompt": "a", "best_of": 2}, "best_of"),
    ({"prompt": "a", "suffix": "x"}, "suffix"),
    # the sampling fields: OpenAI's ranges for its own, vLLM's for its extensions
    ({"prompt": "a", "presence_penalty": 2.5}, "presence_penalty"), ({"prompt": "a", "frequency_penalty": -3}, "frequency_penalty"),
    ({"prompt": "a", "repetition_penalty": 0}, "repetition_penalty"), ({"prompt": "a", "repetition_penalty": -1.5}, "repetition_penalty"),
    ({"prompt": "a", "min_p": 1.5}, "min_p"), ({"prompt": "a", "min_p": -0.1}, "min_p"),
    ({"prompt": "a", "logit_bias": {"50257": 1}}, "logit_bias"), ({"prompt": "a", "logit_bias": {"abc": 1}}, "logit_bias"),
    ({"prompt": "a", "logit_bias": {"5": 101}}, "logit_bias"), ({"prompt": "a", "logit_bias": {"5": "1"}}, "logit_bias"),
    ({"prompt": "a", "logit_bias": [5]}, "logit_bias"), ({"prompt": "a", "stop_token_ids": [50257]}, "stop_token_ids"),
    ({"prompt": "a", "stop_token_ids": "13"}, "stop_token_ids"), ({"prompt": "a", "stop_token_ids": [1.5]}, "stop_token_ids"),
    ({"prompt": "a", "min_tokens": 17}, "min_tokens"), ({"prompt": "a", "min_tokens": -1}, "min_tokens"),
    ({"prompt": "a", "max_tokens": 4, "min_tokens": 5}, "min_tokens"), ({"prompt": "a", "ignore_eos": "yes"}, "ignore_eos"),
    ({"prompt": "a", "n": 0}, "n"), ({"prompt": "a", "n": 129}, "n"), ({"prompt": ["a"] * 64, "n": 3}, "n"),
    ({"prompt": "a", "n": 2.5}, "n"),
])
def test_bad_fields_are_400_naming_the_field(client, body, param):
    r = client.post("/v1/completions", json=body)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and error["message"] and error["type"] == "invalid_request_error"


def test_scoring_may_fill_the_context_a_completion_may_not(client):
    ids = encode(" ".join(LINES[:200]))[:256]
    body = post(client, prompt=ids, max_tokens=0, echo=True, logprobs=0)
    assert len(body["choices"][0]["logprobs"]["tokens"]) == 256
    r = client.post("/v1/completions", json={"prompt": ids, "max_tokens": 1})
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"


def test_fastapi_validation_errors_are_openai_shaped():
    """What FastAPI itself would refuse (a RequestValidationError) is the same 400, `param` the field."""
    from fastapi import Body, FastAPI

    from gpt2x.serve.openai.routes import add_error_handlers

    app = FastAPI()
    add_error_handlers(app)

    @app.post("/typed")
    def typed(max_tokens: int = Body(..., embed=True)):
        return {"ok": max_tokens}

    with TestClient(app) as c:
        r = c.post("/typed", json={"max_tokens": "many"})
        assert r.status_code == 400
        assert r.json()["error"]["param"] == "max_tokens" and r.json()["error"]["type"] == "invalid_request_error"
        r = c.post("/typed", content=b"{")
        assert r.status_code == 400 and set(r.json()["error"]) == {"message", "type", "param", "code"}


def test_openapi_describes_the_api(client):
    r = client.get("/openapi.json")
    assert r.status_code == 200
    schema = r.json()
    components = schema["components"]["schemas"]
    request = components["CompletionRequest"]
    assert request["required"] == ["prompt"]
    assert set(CompletionParams.model_fields) <= set(request["properties"])
    assert request["properties"]["logprobs"]["anyOf"][0] == {"type": "integer", "minimum": 0, "maximum": 5}
    post_op = schema["paths"]["/v1/completions"]["post"]
    assert post_op["requestBody"]["content"]["application/json"]["schema"]["$ref"].endswith("/CompletionRequest")
    ok = post_op["responses"]["200"]["content"]
    assert ok["application/json"]["schema"]["$ref"].endswith("/CompletionResponse") and "text/event-stream" in ok
    for status in ("400", "401", "404", "413", "429"):
        assert post_op["responses"][status]["content"]["application/json"]["schema"]["$ref"].endswith("/ErrorResponse")
    assert "422" not in post_op["responses"]
    assert set(components["ErrorBody"]["properties"]) == {"message", "type", "param", "code"}
    assert set(components["Logprobs"]["properties"]) == {"tokens", "token_logprobs", "top_logprobs", "text_offset"}
    for path, model in (("/v1/models", "ModelList"), ("/health", "Health")):
        assert schema["paths"][path]["get"]["responses"]["200"]["content"]["application/json"]["schema"]["$ref"].endswith(model)
    assert client.get("/docs").status_code == 200


def test_the_api_key_guards_the_routes_not_the_description(service):
    with TestClient(local_app(service, api_key=KEY)) as c:
        assert c.post("/v1/completions", json={"prompt": "a", "max_tokens": 1}).status_code == 401
        assert c.get("/health").status_code == 200  # open, as vLLM's and llama-server's (a probe has no key)
        assert c.get("/openapi.json").status_code == 200
        r = c.post("/v1/completions", json={"prompt": "a", "max_tokens": 1}, headers={"Authorization": f"Bearer {KEY}"})
        assert r.status_code == 200


def test_repetition_controls_are_served(client):
    """no_repeat_ngram_size 2 on a greedy completion: no bigram occurs twice in the prompt and the tokens generated
    (counted here, from return_token_ids); typical_p is a sampling field: refused with beam search and out of (0, 1];
    a seeded typical_p sample is the same twice."""
    body = {"prompt": "ROMEO: O Romeo, Romeo, wherefore art thou Romeo?", "max_tokens": 40, "temperature": 0,
            "no_repeat_ngram_size": 2, "return_token_ids": True, "ignore_eos": True}
    choice = post(client, **body)["choices"][0]
    prompt = encode(body["prompt"])
    ids = prompt + choice["token_ids"]
    assert len(choice["token_ids"]) == 40
    for j in range(len(prompt), len(ids)):  # the bigram each generated token completes was not seen before it
        seen = {tuple(ids[i : i + 2]) for i in range(j - 1)}
        assert (ids[j - 1], ids[j]) not in seen, j
    plain = post(client, prompt="ROMEO:", max_tokens=20, temperature=0)["choices"][0]["text"]
    word = next(w for w in plain.split() if w.isalpha())
    banned = post(client, prompt="ROMEO:", max_tokens=20, temperature=0, bad_words=[word])["choices"][0]["text"]
    assert word in plain.split() and word not in banned.split()  # vLLM's bad_words: the greedy text's own word gone
    sampled = {"prompt": "ROMEO:", "max_tokens": 8, "typical_p": 0.5, "seed": 4}
    assert post(client, **sampled)["choices"][0]["text"] == post(client, **sampled)["choices"][0]["text"]
    for bad_body, param in (({"typical_p": 0}, "typical_p"), ({"typical_p": 1.5}, "typical_p"),
                            ({"no_repeat_ngram_size": -1}, "no_repeat_ngram_size"),
                            ({"typical_p": 0.5, "use_beam_search": True, "n": 2}, "typical_p")):
        r = client.post("/v1/completions", json={"prompt": "a", "max_tokens": 2, **bad_body})
        assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


def test_any_of_several_api_keys_is_accepted_and_every_other_refused(service):
    """Several keys (vLLM's and llama-server's): each one opens the routes, a wrong one, a prefix of one or none is a
    401 in OpenAI's shape."""
    keys = ["first-key-1", "second-key-22"]
    with TestClient(local_app(service, api_key=keys)) as c:
        body = {"prompt": "a", "max_tokens": 1}
        for key in keys:
            assert c.post("/v1/completions", json=body, headers={"Authorization": f"Bearer {key}"}).status_code == 200
        for wrong in ("first-key", "second-key-22x", ""):
            r = c.post("/v1/completions", json=body, headers={"Authorization": f"Bearer {wrong}"})
            assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"


def test_cross_origin_requests_are_answered_only_as_allowed(service):
    """Without --allowed-origins a browser page of another origin gets no CORS headers (the browser then refuses the
    answer); with it, FastAPI's CORSMiddleware answers a preflight and the request for the origins given, and not for
    others (its 400 to a preflight from another origin)."""
    preflight = {"Origin": "https://app.example", "Access-Control-Request-Method": "POST",
                 "Access-Control-Request-Headers": "content-type,authorization"}
    with TestClient(local_app(service)) as c:
        r = c.post("/v1/completions", json={"prompt": "a", "max_tokens": 1}, headers={"Origin": "https://app.example"})
        assert r.status_code == 200 and "access-control-allow-origin" not in r.headers
    cors = Cors(origins=("https://app.example",))
    with TestClient(local_app(service, cors=cors)) as c:
        r = c.options("/v1/completions", headers=preflight)
        assert r.status_code == 200 and r.headers["access-control-allow-origin"] == "https://app.example"
        assert "POST" in r.headers["access-control-allow-methods"]
        r = c.post("/v1/completions", json={"prompt": "a", "max_tokens": 1}, headers={"Origin": "https://app.example"})
        assert r.status_code == 200 and r.headers["access-control-allow-origin"] == "https://app.example"
        r = c.options("/v1/completions", headers={**preflight, "Origin": "https://evil.example"})
        assert r.status_code == 400 and "access-control-allow-origin" not in r.headers


# ------------------------------------------------------------------ the openai client


@pytest.fixture(scope="module")
def base_url(service):
    """The application on uvicorn, 127.0.0.1 and an ephemeral port, in a thread of this process."""
    import uvicorn  # noqa: F401 (uvicorn_server's: missing, the tests fail)
    with uvicorn_server(local_app(service, api_key=KEY)) as port:
        yield f"http://127.0.0.1:{port}/v1"


def test_the_openai_client(base_url, reference):
    import openai
    client = openai.OpenAI(base_url=base_url, api_key=KEY, max_retries=0)
    prompt = "ROMEO:"
    ids = encode(prompt)
    g = generate(reference, [prompt], SamplingSettings(max_new_tokens=16, greedy=True))[0]
    whole = client.completions.create(model="shakespeare", prompt=prompt, max_tokens=16, temperature=0, logprobs=3,
                                      echo=True)
    choice = whole.choices[0]
    assert choice.text == prompt + decode(g.tokens) and whole.usage.completion_tokens == len(g.tokens)
    lps = choice.logprobs
    lp = forward_logprobs(reference, ids + g.tokens)
    assert lps.token_logprobs[0] is None and lps.tokens == [token_text(t) for t in ids + g.tokens]
    for i in range(1, len(ids + g.tokens)):
        tok = (ids + g.tokens)[i]
        assert abs(lps.token_logprobs[i] - lp[i - 1, tok]) < 1e-4
        top = lps.top_logprobs[i]
        assert list(top.values()) == sorted(top.values(), reverse=True) and lps.tokens[i] in top
        assert len(top) in (3, 4)
    assert lps.text_offset == [len(decode((ids + g.tokens)[:i])) for i in range(len(ids + g.tokens))]

    chunks = list(client.completions.create(model="shakespeare", prompt=prompt, max_tokens=16, temperature=0,
                                            logprobs=3, echo=True, stream=True))
    assert len(chunks) > 5
    assert "".join(c.choices[0].text for c in chunks) == choice.text
    joined = [t for c in chunks if c.choices[0].logprobs for t in c.choices[0].logprobs.token_logprobs]
    assert joined == lps.token_logprobs
    assert [c.choices[0].finish_reason for c in chunks][-1] == choice.finish_reason

    several = client.completions.create(model="shakespeare", prompt=[ids, encode(PROMPTS[1])], max_tokens=0, echo=True,
                                        logprobs=1)
    assert [c.text for c in several.choices] == [prompt, PROMPTS[1]]
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="shakespeare", prompt=prompt, logprobs=9)
    assert e.value.status_code == 400 and "logprobs" in str(e.value)
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="gpt-4", prompt=prompt)


# ------------------------------------------------------------------ the fuzz


class CappedService(CompletionService):
    """The service with every completion cut to 4 tokens, so that the fuzz's requests are quick."""

    def prepare(self, p: CompletionParams) -> ServedRequest:
        req = super().prepare(p)
        req.max_tokens = [min(m, 4) for m in req.max_tokens]
        return req


@pytest.fixture(scope="module")
def fuzz_app(export_dir):
    service = CappedService(OrtBackend(read_export(export_dir), threads=1), EngineSettings(max_batch_size=8, max_waiting=16),
                            "shakespeare")
    yield local_app(service)
    service.close()


FUZZ_EXAMPLES = 120  # requests, every one sent however long they take (drawing them is most of the time: about 8 s on a busy VM)


def openai_error_shape(response) -> None:
    """Every 4xx and 5xx is OpenAI's error object, as JSON."""
    if response.status_code < 400:
        return
    content_type = response.headers.get("content-type") or [""]  # Schemathesis' headers: a list per name
    assert content_type[0].startswith("application/json"), response.text[:200]
    error = json.loads(response.text)["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert isinstance(error["message"], str) and error["message"] and isinstance(error["type"], str)
    assert error["param"] is None or isinstance(error["param"], str)


def test_fuzz_from_the_openapi_schema(fuzz_app):
    """Schemathesis, from the served /openapi.json: bodies valid by the schema and bodies that are
    not (its positive and negative modes), FUZZ_EXAMPLES of them, all sent. No request gets a 5xx, each
    answer is what the schema describes (status, content type, body), every 4xx is JSON in OpenAI's
    error shape, and the server answers /health and a completion afterwards.

    (Driven through hypothesis directly: Schemathesis' pytest loader `from_fixture` does not run under
    pytest 9, and a module-level `from_asgi` would load the model at collection.)"""
    import schemathesis
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st
    from schemathesis import GenerationMode
    from schemathesis.checks import content_type_conformance, not_a_server_error, response_schema_conformance, status_code_conformance

    schema = schemathesis.openapi.from_asgi("/openapi.json", fuzz_app)
    ops = {op.path: op for op in (r.ok() for r in schema.get_all_operations())}
    assert {"/v1/completions", "/v1/models", "/health"} <= set(ops)  # and whatever other routes the app has
    completions = ops["/v1/completions"]

    def served(case):  # a valid body names the served model or none (any other name is a 404, also tried)
        if isinstance(case.body, dict) and "model" in case.body:
            case.body["model"] = "shakespeare"
        return case

    strategy = st.one_of(completions.as_strategy(GenerationMode.POSITIVE).map(served),
                         completions.as_strategy(GenerationMode.POSITIVE).map(served),
                         completions.as_strategy(GenerationMode.POSITIVE),
                         completions.as_strategy(GenerationMode.NEGATIVE),
                         *[op.as_strategy() for path, op in sorted(ops.items()) if path != "/v1/completions"])
    statuses: dict[int, int] = {}
    kinds: set[tuple] = set()  # (prompt's type, echo, logprobs, stream) of the requests answered 200
    started = time.monotonic()

    @settings(max_examples=FUZZ_EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck), database=None)
    @given(case=strategy)
    def fuzz(case):
        response = case.call()
        statuses[response.status_code] = statuses.get(response.status_code, 0) + 1
        if response.status_code == 200 and isinstance(case.body, dict):
            kinds.add((type(case.body.get("prompt")).__name__, bool(case.body.get("echo")), case.body.get("logprobs") is not None,
                       bool(case.body.get("stream"))))
        case.validate_response(response, checks=[not_a_server_error, status_code_conformance, content_type_conformance,
                                                 response_schema_conformance])
        openai_error_shape(response)

    fuzz()
    assert sum(statuses.values()) == FUZZ_EXAMPLES, statuses  # every example was sent, however slow the machine
    assert statuses.get(200, 0) >= 10 and statuses.get(400, 0) >= 10, statuses
    assert not any(status >= 500 for status in statuses), statuses
    with TestClient(fuzz_app) as c:
        h = c.get("/health")
        assert h.status_code == 200 and h.json()["status"] == "ok" and h.json()["errors"] == 0
        r = c.post("/v1/completions", json={"prompt": "ROMEO:", "max_tokens": 3, "temperature": 0})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] <= 3
    print(f"fuzz: {sum(statuses.values())} requests in {time.monotonic() - started:.1f} s, statuses {statuses}, "
          f"answered: {sorted(kinds)}")


def test_nan_and_infinity_are_not_json(client):
    for raw in (b'{"prompt": "a", "temperature": NaN}', b'{"prompt": "a", "top_p": Infinity}'):
        r = client.post("/v1/completions", content=raw, headers={"Content-Type": "application/json"})
        assert r.status_code == 400 and r.json()["error"]["message"].startswith("the body is not valid JSON")
    assert math.isfinite(post(client, prompt="a", max_tokens=1, logprobs=5)["choices"][0]["logprobs"]["token_logprobs"][0])


def test_deeply_nested_bodies_and_schemas_are_one_400_in_openais_shape(client):
    """A body 10^5 levels deep (Python's JSON parser recurses per level) and a JSON schema 900 levels deep (the schema's
    checks recurse per level): each a 400 with OpenAI's error object, on completions and on chat, not a 500
    text/plain with a traceback; the server answers the next request."""
    deep = b'{"prompt": "a", "x": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
    for route in ("/v1/completions", "/v1/chat/completions"):
        r = client.post(route, content=deep, headers={"Content-Type": "application/json"})
        assert r.status_code == 400 and r.headers["content-type"].startswith("application/json"), r.text[:200]
        assert r.json()["error"]["message"] == "the body is nested too deeply to read"
    schema = '{"type": "object", "properties": {"a": ' * 450 + '{"type": "string"}' + "}}" * 450  # 900 JSON levels, as text
    body = '{"prompt": "a", "max_tokens": 2, "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": ' \
        + schema + "}}}"
    r = client.post("/v1/completions", content=body, headers={"Content-Type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "response_format", r.text[:300]
    assert "nested too deeply" in r.json()["error"]["message"]
    assert post(client, prompt="a", max_tokens=1)["usage"]["completion_tokens"] == 1


def test_one_finish_list_mapped_to_openais_at_the_edge():
    """The engine's Finish (generation.settings), as OpenAI's finish_reason: end of text and a stop
    string are "stop"; the budget and the context that caps it are "length"."""
    from gpt2x.generation.settings import Finish

    plain = ChoiceText()
    assert [finish_reason(f, plain) for f in (Finish.eos, Finish.length, Finish.context)] == ["stop", "length", "length"]
    cut = ChoiceText(stop=("lo",))
    cut.push(encode("Hello")[0])
    assert cut.stopped and finish_reason(Finish.length, cut) == "stop"
