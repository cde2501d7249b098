"""`gpt2x serve --draft`: speculative decoding in the serving engine, one request at a time.

Engine-level, without Ray: greedy rows with a draft (prompt lookup, the int8 export as a model draft)
give the plain engine's tokens, on fp32's growing cache and int8's in-place one; seeded sampled rows
with K fixed give exactly what `generate(..., draft=...)` gives; end of text inside a round, the
token budget, cancellation and stop strings end a row where they should; the draft's counters equal
the speculative runs' own. Then the command: its refusals (a draft beside a batch larger than one, a
draft that is not there) are one line before Ray starts, and one served replica with `--draft ngram`
answers as `generate --draft ngram` does and reports its draft in /health.
"""

from __future__ import annotations

import asyncio
import json
import signal
import time

import pytest

from gpt2x.choices import BackendKind, Precision
from gpt2x.errors import UsageError
from gpt2x.generation.generate import generate
from gpt2x.generation.sampling import Sampler
from gpt2x.generation.settings import SamplingSettings
from gpt2x.generation.speculative import DraftSettings, ModelDrafter, NgramDrafter, control_for, speculative_loop
from gpt2x.onnx.artifact import read_export
from gpt2x.runtime.ort import OrtBackend
from gpt2x.serve.core.engine import Engine, EngineSettings, Row
from gpt2x.serve.openai.service import CompletionService
from gpt2x.serve.replica import prepare_draft
from gpt2x.tokenizer import EOT_ID, decode, encode

from ..helpers import LINES, Collect, DraftSpy, EndsAt, assert_one_line_error, greedy_counts, run_cli

FIXED = DraftSettings(num_speculative_tokens=4, adaptive=False)  # every round drafts K: a seeded sampled run is reproducible
ONE = EngineSettings(max_batch_size=1, batch_wait_s=0)


@pytest.fixture(scope="module")
def exports(bundled_export):
    return {precision: bundled_export(precision).folder for precision in (Precision.fp32, Precision.int8)}


@pytest.fixture(scope="module")
def fp32(exports):
    """The growing cache (the int8 target covers the in-place one)."""
    return OrtBackend(read_export(exports[Precision.fp32]), threads=1, in_place_kv=False)


@pytest.fixture(scope="module")
def int8_draft(exports):
    """The int8 export as a model draft, its cache in place (as open_drafter opens it)."""
    return ModelDrafter(OrtBackend(read_export(exports[Precision.int8]), threads=1), "shakespeare int8")


def make_drafter(kind: str, int8_draft):
    return NgramDrafter() if kind == "ngram" else int8_draft


def cases() -> list[tuple[list[int], SamplingSettings]]:
    """Prompts of different lengths, some repetitive (prompt lookup finds them), budgets from 1 up."""
    out = []
    for i, line in enumerate(LINES[400:406]):
        ids = encode(line[: 12 + 9 * i])
        out.append((ids, SamplingSettings(max_new_tokens=[1, 9, 24, 40, 57, 70][i], greedy=True)))
    out.append((encode("To be, or not to be, to be, or not to be: that is"), SamplingSettings(max_new_tokens=48, greedy=True)))
    out.append(([EOT_ID], SamplingSettings(max_new_tokens=30, greedy=True)))
    return out


def sampled_cases() -> list[tuple[list[int], SamplingSettings]]:
    return [(ids, SamplingSettings(max_new_tokens=s.max_new_tokens, greedy=False, temperature=0.7 + 0.1 * i,
                                   top_k=[0, 50, 20][i % 3], top_p=[1.0, 0.9, 0.95][i % 3], seed=100 + i))
            for i, (ids, s) in enumerate(cases())]


def run_rows(engine: Engine, todo) -> list[Collect]:
    """Every row submitted at once (they queue: one decoded at a time), each one's events."""
    sinks = [Collect() for _ in todo]
    engine.submit([Row(ids, s, sink) for (ids, s), sink in zip(todo, sinks)])
    for sink in sinks:
        assert sink.done.wait(120)
    return sinks


def expected_end(tokens: list[int], settings: SamplingSettings) -> tuple[str, str]:
    return "done", "eos" if len(tokens) < settings.max_new_tokens else "length"


# ------------------------------------------------------------------ the engine


@pytest.mark.parametrize("target", ["fp32", "int8-in-place", "slots"])
@pytest.mark.parametrize("kind", ["ngram", "int8"])
def test_greedy_with_a_draft_equals_the_plain_engine(exports, fp32, int8_draft, kind, target):
    """Adaptive K (the default): the rows mix plain steps and rounds of any K; greedy tokens are the
    target's own either way (the int8 target with its cache in place, rolled back by its length; the fixed slots,
    by their slots' lengths)."""
    if target == "slots":
        from gpt2x.runtime.static_decode import SlotBackend

        backend = SlotBackend(read_export(exports[Precision.fp32]), threads=1, slots=4)
    else:
        backend = fp32 if target == "fp32" else OrtBackend(read_export(exports[Precision.int8]), threads=1)
        assert backend.in_place_kv == (target == "int8-in-place")
    todo = cases()
    plain = Engine(backend, ONE).start()
    spec = Engine(backend, ONE, make_drafter(kind, int8_draft)).start()
    try:
        want = run_rows(plain, todo)
        got = run_rows(spec, todo)
    finally:
        plain.close()
        spec.close()
    for (ids, s), w, g in zip(todo, want, got):
        assert g.tokens == w.tokens and g.end == w.end == expected_end(w.tokens, s), decode(ids)
    stats = spec.stats()
    assert stats["rows"] == len(todo) and stats["tokens"] == sum(len(w.tokens) for w in want)
    assert stats["drafts"] > 0 and 0 < stats["accepted"] <= stats["drafted"] and stats["errors"] == 0


@pytest.mark.parametrize("kind", ["ngram", "int8"])
def test_seeded_sampling_equals_generate_with_the_draft(fp32, int8_draft, kind):
    """The row's own seeded Sampler drives the draft and the acceptance rule: each row's tokens are
    `generate(..., draft=...)`'s (as `gpt2x generate --draft D --no-draft-adaptive` gives them), and
    the engine's draft counters are the runs' own statistics summed."""
    drafter = make_drafter(kind, int8_draft)
    # Four sampled rows: each top_k/top_p pair of sampled_cases, budgets 9 to 57 (the eight took twice the time).
    todo = greedy_and_sampled = cases()[:3] + sampled_cases()[1:5]
    engine = Engine(fp32, ONE, drafter, FIXED).start()
    try:
        got = run_rows(engine, todo)
    finally:
        engine.close()
    totals = {"drafted": 0, "accepted": 0, "drafts": 0}
    for (ids, s), g in zip(greedy_and_sampled, got):
        ref = generate(fp32, [""], s, prompt_ids=[ids], draft=drafter, draft_settings=FIXED)[0]
        assert g.tokens == ref.tokens and g.end == expected_end(ref.tokens, s), (decode(ids), s)
        for name in totals:
            totals[name] += ref.speculation[name]
    stats = engine.stats()
    assert {name: stats[name] for name in totals} == totals and totals["drafts"] > 0
    assert stats["tokens"] == sum(len(g.tokens) for g in got) and stats["batches"] == len(todo)




def test_end_of_text_inside_a_round_ends_the_row(exports):
    """A draft that is the target itself drafts <|endoftext|> and the tokens after it, all accepted:
    the row ends at <|endoftext|> ("stop"), told nothing of the round's later tokens."""
    prompt = encode("ROMEO:")
    at = len(prompt) + 7
    target = EndsAt(OrtBackend(read_export(exports[Precision.fp32]), threads=1), at)
    drafter = ModelDrafter(EndsAt(OrtBackend(read_export(exports[Precision.fp32]), threads=1), at))
    settings = SamplingSettings(max_new_tokens=40, greedy=True)
    chunks = list(speculative_loop(target, drafter, prompt, Sampler(settings), 40, control_for(FIXED)))
    ending = next(c for c in chunks if EOT_ID in c)
    assert ending.index(EOT_ID) < len(ending) - 1  # the case under test: tokens drafted past the end

    engine = Engine(target, ONE, drafter, FIXED).start()
    try:
        (got,) = run_rows(engine, [(prompt, settings)])
    finally:
        engine.close()
    plain = generate(target, [""], settings, prompt_ids=[prompt])[0]
    assert plain.finish_reason == "eos" and len(plain.tokens) == 7
    assert got.tokens == plain.tokens and got.end == ("done", "eos")
    assert engine.stats()["tokens"] == 7 and engine.stats()["rows"] == 1


def test_a_cancelled_row_stops_and_the_next_request_is_served(fp32, int8_draft):
    """Cancelled from its callback at its 5th token (as a stop string or a client leaving cancels it,
    from another thread), the row hears no more tokens, not even the rest of its round; the model
    draft's cache, left mid-sequence, does not leak into the next request."""
    engine = Engine(fp32, ONE, int8_draft, FIXED).start()
    try:
        settings = SamplingSettings(max_new_tokens=200, greedy=True)
        leave = Collect()
        row = Row(encode("JULIET:"), settings, leave)
        leave.after, leave.then = 5, row.cancel
        engine.submit([row])
        assert leave.done.wait(60) and leave.end == ("done", "cancelled") and len(leave.tokens) == 5
        ref = generate(fp32, [""], settings, prompt_ids=[encode("JULIET:")])[0].tokens
        assert leave.tokens == ref[:5]
        stats = engine.stats()
        assert stats["rows"] == 1 and stats["tokens"] == 5 and stats["running"] == 0
        assert stats["steps"] < 5 + 2  # no decoding went on past the round it was cancelled in

        (after,) = run_rows(engine, [(encode("ROMEO:"), SamplingSettings(max_new_tokens=30, greedy=True))])
        assert after.tokens == generate(fp32, [""], SamplingSettings(max_new_tokens=30, greedy=True),
                                        prompt_ids=[encode("ROMEO:")])[0].tokens
    finally:
        engine.close()


def test_a_draft_needs_max_batch_size_1(fp32):
    with pytest.raises(UsageError, match="speculative serving runs at max batch size 1") as e:
        Engine(fp32, EngineSettings(max_batch_size=4), NgramDrafter())
    assert e.value.option == "max_batch_size"
    assert "drafted" not in Engine(fp32, ONE).counters  # the plain engine's counters are as they were


def test_stop_strings_and_health_through_the_service(fp32):
    """A completion request through the replica's service (no HTTP): the stop string cuts the text
    where the plain engine's answer is cut, and /health's answer carries the draft and its acceptance."""
    ref = generate(fp32, [""], SamplingSettings(max_new_tokens=60, greedy=True), prompt_ids=[encode("ROMEO:")])[0].tokens
    full = decode(ref)
    stop = full[10:13]
    spy = DraftSpy(NgramDrafter())  # the proposals the engine received, to count acceptance from the tokens
    service = CompletionService(fp32, ONE, "shakespeare", drafter=spy, draft_settings=FIXED, draft_name="ngram")

    async def ask(**body):
        req = service.parse(json.dumps({"prompt": "ROMEO:", **body}).encode())
        return await service.complete(service.submit(req))

    async def both():
        cut = await ask(max_tokens=60, temperature=0, stop=[stop, "zzzz"])
        return cut, await ask(max_tokens=60, temperature=0)

    try:
        cut, whole = asyncio.run(both())
        assert cut.choices[0].text == full[: full.index(stop)] and cut.choices[0].finish_reason == "stop"
        assert whole.choices[0].text == full and whole.usage.completion_tokens == 60
        # A response ends with its last token's chunk, which can reach the client before the engine's thread
        # has counted the row: wait for the engine to settle.
        deadline = time.monotonic() + 10
        while (h := service.health()).running and time.monotonic() < deadline:
            time.sleep(0.01)
        assert h.draft == "ngram" and h.drafted >= h.accepted and h.drafts > 0 and h.rows == 2
        # Both requests' proposals, counted against the plain greedy tokens (both answers are a prefix of them).
        counts = [greedy_counts(rounds, encode("ROMEO:") + ref) for rounds in spy.runs]
        assert len(counts) == 2 and not any(open_end for *_, open_end in counts)
        drafted, accepted, drafts = (sum(c[i] for c in counts) for i in range(3))
        assert (h.drafted, h.accepted, h.drafts) == (drafted, accepted, drafts)
        assert h.acceptance_rate == accepted / drafted
    finally:
        service.close()


def test_prepare_draft_resolves_before_ray(exports, tmp_path):
    target = read_export(exports[Precision.fp32])
    assert prepare_draft("ngram", target) == "ngram"
    assert prepare_draft(str(exports[Precision.int8]), target) == str(exports[Precision.int8].resolve())
    with pytest.raises(UsageError, match="genai backend"):
        prepare_draft("ngram", target, BackendKind.genai)
    with pytest.raises(Exception, match="draft .*no-such-draft"):
        prepare_draft(str(tmp_path / "no-such-draft"), target)


# ------------------------------------------------------------------ the command


@pytest.mark.parametrize("args,code,fragment", [
    (["--draft", "ngram", "--max-batch-size", "4"], 2,
     "--max-batch-size is 4 with a draft; speculative serving runs at max batch size 1"),
    (["--draft", "./no-such-draft"], 3, "draft ./no-such-draft is neither ngram"),
    (["--draft", "ngram", "--num-speculative-tokens", "0"], 2, "--num-speculative-tokens must be in 1..32"),
])
def test_bad_draft_options_are_one_line(exports, args, code, fragment):
    r = run_cli("serve", "--onnx", str(exports[Precision.fp32]), *args, timeout=120)
    assert_one_line_error(r.returncode, r.stderr, code, fragment)


def test_a_replica_with_a_draft_answers_as_generate_does(exports, fp32, reserve_port):
    """`gpt2x serve --draft ngram --no-draft-adaptive` (max batch size 1 by default with a draft): a
    greedy and a seeded sampled request equal `generate(..., draft=ngram)`, and /health counts the
    draft's tokens. Stopped with SIGTERM."""
    import httpx

    from ..helpers import serving

    with serving("--onnx", str(exports[Precision.fp32]), "--port", str(reserve_port()), "--threads", "1", "--draft",
                 "ngram", "--num-speculative-tokens", "4", "--no-draft-adaptive") as (proc, ready):
        assert ready["draft"] == "ngram" and ready["engine"]["max_batch_size"] == 1
        assert ready["draft_settings"]["num_speculative_tokens"] == 4 and ready["draft_settings"]["adaptive"] is False
        for body, settings in (({"temperature": 0}, SamplingSettings(max_new_tokens=40, greedy=True)),
                               ({"temperature": 0.9, "top_p": 0.95, "seed": 7},
                                SamplingSettings(max_new_tokens=40, temperature=0.9, top_p=0.95, top_k=0, seed=7))):
            r = httpx.post(f"{ready['url']}/v1/completions", json={"prompt": "ROMEO:", "max_tokens": 40, **body}, timeout=60)
            assert r.status_code == 200, r.text
            ref = generate(fp32, ["ROMEO:"], settings, draft=NgramDrafter(), draft_settings=FIXED)[0]
            assert r.json()["choices"][0]["text"] == decode(ref.tokens), body
        h = httpx.get(f"{ready['url']}/health", timeout=10).json()
        assert h["draft"] == "ngram" and h["rows"] == 2 and h["drafted"] >= h["accepted"] and h["drafts"] > 0
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(90) == 0, proc.stderr.read()
