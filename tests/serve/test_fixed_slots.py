"""`gpt2x serve --kv-cache slots`: a replica on the fixed slots (runtime.static_decode.SlotBackend) with a step token
budget and the prefix cache, its completions against gpt2x's generation code on the export's own backend, what it
answers (prompt logprobs), what it refuses (the option where it does not apply), and /health saying which cache it
runs."""

from __future__ import annotations

import asyncio

import httpx
import numpy as np
import pytest

from gpt2x.generation.generate import generate
from gpt2x.generation.settings import SamplingSettings
from gpt2x.numerics import log_softmax
from gpt2x.serve.core.scheduler import EngineSettings
from gpt2x.tokenizer import decode, encode

from ..helpers import assert_one_line_error, cli

PROMPTS = ["ROMEO:", "Now is the winter of our discontent", "First Citizen:\nBefore we proceed any further, hear me speak."]


@pytest.fixture(scope="module")
def service(export_dir):
    from gpt2x.serve.replica import ReplicaConfig, open_service

    config = ReplicaConfig(export=str(export_dir), model_id="shakespeare", threads=1, fixed_slots=True,
                           engine=EngineSettings(max_batch_size=4, max_join_delay_s=0, max_num_batched_tokens=6))
    service = open_service(config)
    yield service
    service.close()


def test_completions_on_the_slots_are_generate_alone_and_health_says_slots(client, reference):
    r = client.post("/v1/completions", json={"prompt": PROMPTS, "max_tokens": 12, "temperature": 0})
    assert r.status_code == 200, r.text
    for prompt, choice in zip(PROMPTS, r.json()["choices"]):
        want = generate(reference, [prompt], SamplingSettings(max_new_tokens=12, greedy=True))[0]
        assert choice["text"] == decode(want.tokens), prompt
    seeded = {"prompt": PROMPTS[1], "max_tokens": 10, "temperature": 0.9, "seed": 3, "n": 2}
    r = client.post("/v1/completions", json=seeded)  # two rows of one prompt: a slot copied for the second
    want = generate(reference, [PROMPTS[1]], SamplingSettings(max_new_tokens=10, temperature=0.9, seed=3))[0]
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == decode(want.tokens)
    health = client.get("/health").json()
    assert health["kv_cache"] == "slots" and health["kv_cache_dtype"] == "float32"


def test_prompts_that_join_a_running_request_run_their_chunks_in_its_steps(client, service, reference):
    """A request decoding, two more arriving meanwhile: their prompts join in chunks of what the running row leaves of
    the budget of 6 tokens, run in the decode steps' forwards; every text is the prompt's alone."""
    bodies = [{"prompt": p, "max_tokens": m, "temperature": 0} for p, m in ((PROMPTS[0], 150), (PROMPTS[2], 8), (PROMPTS[1], 8))]
    mixed = service.engine.backend.decoder.mixed_runs
    for body, answer in zip(bodies, asyncio.run(staggered(client, bodies))):
        want = generate(reference, [body["prompt"]], SamplingSettings(max_new_tokens=body["max_tokens"], greedy=True))[0]
        assert answer.status_code == 200 and answer.json()["choices"][0]["text"] == decode(want.tokens), body
    assert service.engine.backend.decoder.mixed_runs > mixed


def test_a_prompt_that_starts_as_an_earlier_one_takes_its_blocks_from_the_prefix_cache(client, service, reference):
    """The prefix cache on the slots: prompts sharing a 3-block prefix, sent alone and then while a row decodes (their
    rests joining in chunks of the budget, the first on the cached blocks written into the slot); each text is the
    prompt's alone, and the later prompts' prefixes came from the cache."""
    engine = service.engine
    prefix = PROMPTS[2] * 4  # 15 tokens each: the shared part covers 3 blocks of 16
    prompts = [prefix + " What say you?", prefix + " Speak, speak.", prefix + " Go to."]
    r = client.post("/v1/completions", json={"prompt": prompts[0], "max_tokens": 6, "temperature": 0})
    before = engine.stats()["prefix_cache_hits"]
    bodies = [{"prompt": PROMPTS[0], "max_tokens": 80, "temperature": 0}] + \
        [{"prompt": p, "max_tokens": 6, "temperature": 0} for p in prompts[1:]]
    answers = [r] + asyncio.run(staggered(client, bodies))[1:]
    for prompt, answer in zip(prompts, answers):
        want = generate(reference, [prompt], SamplingSettings(max_new_tokens=6, greedy=True))[0]
        assert answer.status_code == 200 and answer.json()["choices"][0]["text"] == decode(want.tokens), prompt
    assert engine.stats()["prefix_cache_hits"] - before >= 2 * 48


def test_rows_of_one_long_prompt_are_served_and_its_blocks_kept_from_the_slot_they_share(client, service, reference):
    """Two rows of one prompt of several blocks (n=2): prefilled once, the second row's slot a copy of the first's (the
    prompts' cache handed to the batch's). Its blocks are kept by the prefix cache from what the prefill wrote (the
    batch failed here: the prompts' cache, emptied by the hand-over, was read), and a later request finds them."""
    prompt = PROMPTS[2] * 5 + " Speak."
    r = client.post("/v1/completions", json={"prompt": prompt, "max_tokens": 6, "temperature": 0, "n": 2})
    want = decode(generate(reference, [prompt], SamplingSettings(max_new_tokens=6, greedy=True))[0].tokens)
    assert r.status_code == 200, r.text
    assert [c["text"] for c in r.json()["choices"]] == [want, want]
    before = service.engine.stats()["prefix_cache_hits"]
    r = client.post("/v1/completions", json={"prompt": prompt, "max_tokens": 6, "temperature": 0})
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == want
    assert service.engine.stats()["prefix_cache_hits"] - before >= 64


async def staggered(client, bodies: list[dict]) -> list[httpx.Response]:
    """The bodies posted 0.1 s apart, the first's steps under way when the others arrive."""
    transport = httpx.ASGITransport(app=client.app)
    async with httpx.AsyncClient(transport=transport, base_url="http://test", timeout=120) as c:
        async def later(i: int):
            await asyncio.sleep(0.1 * i)
            return await c.post("/v1/completions", json=bodies[i])
        return await asyncio.gather(*[later(i) for i in range(len(bodies))])


def test_prompt_logprobs_and_echo_are_the_prompts_own_forward(client, reference):
    """A prompt's logprobs on the slots (each position's logits, the prompt prefilled into a slot of its own), echo's
    and vLLM's prompt_logprobs, against log_softmax of the export's own backend's forward of the prompt."""
    ids = encode("ROMEO: I will not")
    x = np.asarray([ids])
    logits, _ = reference.run(x, np.ones_like(x), np.arange(len(ids))[None], None)
    want = [float(log_softmax(logits[0])[i - 1, ids[i]]) for i in range(1, len(ids))]
    r = client.post("/v1/completions", json={"prompt": [ids], "max_tokens": 1, "echo": True, "logprobs": 1, "temperature": 0})
    assert r.status_code == 200, r.text
    lps = r.json()["choices"][0]["logprobs"]["token_logprobs"]
    assert lps[0] is None and lps[1:len(ids)] == pytest.approx(want, abs=1e-4)
    r = client.post("/v1/completions", json={"prompt": [ids], "max_tokens": 1, "prompt_logprobs": 0})
    assert r.status_code == 200, r.text
    entries = r.json()["choices"][0]["prompt_logprobs"]
    assert entries[0] is None and [list(e) for e in entries[1:]] == [[str(t)] for t in ids[1:]]
    assert [e[str(t)]["logprob"] for e, t in zip(entries[1:], ids[1:])] == pytest.approx(want, abs=1e-4)


@pytest.mark.parametrize("args,fragment", [
    (["generate", "hi", "--kv-cache", "slots"], "--kv-cache slots is the server's"),
    (["serve", "--kv-cache", "slots", "--precision", "fp16"], "the fixed slots on cpu run fp32, int8, int4 exports"),
    (["serve", "--max-num-batched-tokens", "0"], "--max-num-batched-tokens must be >= 1"),
])
def test_the_option_where_it_does_not_apply_is_one_line(capsys, own_exports, args, fragment):
    code, _, err = cli(capsys, *args)
    assert_one_line_error(code, err, 2, fragment)
    assert not own_exports.exists()  # refused before anything is exported


def test_the_server_runs_the_slots_by_default(tiny_export, monkeypatch):
    """--kv-cache auto (ReplicaConfig.fixed_slots None): an int8 export is served on the fixed slots (/health says so),
    its chunks in the decode steps' forwards the CPU's base for int8 (24 with VNNI or AMX, 8 without:
    test_providers.py checks the choice) and one more per row running, its batch's slots written at start
    where they hold an int8 cache and none of them on a float one (an fp32 export, or a float cache asked for), whose
    pages come as rows use them; an fp32 export on the slots too, its prompts without a prefill session of their own;
    in place where asked, 256-token chunks between the steps; never on another backend. /health says the chunk (none
    where no prompt joins: one row at a time)."""
    from gpt2x.choices import Precision, ProviderKind
    from gpt2x.runtime.kvdtype import KV_DTYPE_ENV
    from gpt2x.runtime.providers import cpu_mixed_chunk_base
    from gpt2x.runtime.static_decode import held_from_start
    from gpt2x.serve.replica import ReplicaConfig, on_slots, open_service

    int8 = tiny_export(Precision.int8, int8_kv=True)[2]
    fp32 = tiny_export(Precision.fp32)[2]
    monkeypatch.setenv(KV_DTYPE_ENV, "int8")  # the cache the tiny export's record may or may not choose
    auto = ReplicaConfig(export=str(int8.folder), model_id="tiny", threads=1, fixed_slots=None)
    fp32_auto = ReplicaConfig(export=str(fp32.folder), model_id="tiny", threads=1, fixed_slots=None)
    assert on_slots(auto, int8) and on_slots(fp32_auto, fp32)
    assert not on_slots(ReplicaConfig(export=str(int8.folder), model_id="tiny", fixed_slots=None, backend="openvino"), int8)
    assert not on_slots(ReplicaConfig(export=str(int8.folder), model_id="tiny", fixed_slots=False), int8)

    assert held_from_start(int8, ProviderKind.cpu, 16) == 16
    service = open_service(auto)
    try:
        health = service.health()
        assert health.kv_cache == "slots" and health.kv_cache_dtype == "int8"
        base = cpu_mixed_chunk_base(Precision.int8)
        assert base in (24, 8) and [service.engine.scheduler.chunk_tokens(n) for n in (0, 1, 16)] == [base, base + 1, base + 16]
        assert (health.prefill_chunk, health.prefill_chunk_per_row) == (base, 1)
    finally:
        service.close()
    monkeypatch.setenv(KV_DTYPE_ENV, "float")
    assert on_slots(auto, int8)
    assert held_from_start(int8, ProviderKind.cpu, 16) == held_from_start(fp32, ProviderKind.cpu, 16) == 0
    for config in (auto, fp32_auto):
        service = open_service(config)
        try:
            health = service.health()
            assert health.kv_cache == "slots" and health.kv_cache_dtype == "float32"
            # no OpenVINO prefill: a wave's prompts together on ONNX Runtime's prefill session
            assert service.engine.backend.decoder._prefill is not None
        finally:
            service.close()
    in_place = open_service(ReplicaConfig(export=str(fp32.folder), model_id="tiny", threads=1, fixed_slots=False))
    try:
        health = in_place.health()
        assert health.kv_cache == "in-place" and in_place.engine.scheduler.chunk_tokens(16) == 256
        assert (health.prefill_chunk, health.prefill_chunk_per_row) == (256, 0)
    finally:
        in_place.close()
    alone = open_service(ReplicaConfig(export=str(fp32.folder), model_id="tiny", threads=1, fixed_slots=False,
                                       engine=EngineSettings(max_batch_size=1)))
    try:  # one row at a time: no prompt joins, so no chunk to say
        assert (alone.health().prefill_chunk, alone.health().prefill_chunk_per_row) == (None, None)
    finally:
        alone.close()
