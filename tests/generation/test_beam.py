"""Beam search against transformers' `generate(num_beams=N)` on tiny random GPT-2s (one of them
biased towards EOS so that hypotheses really finish), against hand-computed cases on a scripted
backend, and its routing and limits."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from gpt2x.generation import generate as generate_mod
from gpt2x.generation.beam import beam_search, top_k
from gpt2x.generation.generate import generate
from gpt2x.generation.settings import Generation, SamplingSettings
from gpt2x.model.weights import load_model
from gpt2x.runtime.pytorch import TorchBackend
from gpt2x.tokenizer import EOT_ID

from ..helpers import make_hf_model

PROMPTS = [[464, 2068, 7586], [EOT_ID], [40, 1101, 257, 1332, 13, 383]]
GRID = [(n, lp, es) for n in (2, 4) for lp in (1.0, 0.5, 2.0) for es in (True, False)]
MAX_NEW = 20


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """Tiny models run fastest on one thread; on a busy 2-core machine two threads spin and crawl."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def build(folder, eos_bias: float = 0.0):
    """(HF model, our TorchBackend) with the same weights. With eos_bias, ln_f gets a random bias and
    EOS's (tied) embedding points along it, so that EOS is likely but not certain after any token."""
    hf = make_hf_model(folder, seed=1)
    if eos_bias:
        with torch.no_grad():
            b = hf.transformer.ln_f.bias
            b.copy_(torch.randn_like(b))
            hf.transformer.wte.weight[EOT_ID] = b / b.norm() * eos_bias
        hf.save_pretrained(folder)
    return hf, TorchBackend(load_model(str(folder))[0])


@pytest.fixture(scope="module")
def plain(tmp_path_factory):
    return build(tmp_path_factory.mktemp("beam-plain"))


@pytest.fixture(scope="module")
def eosy(tmp_path_factory):
    return build(tmp_path_factory.mktemp("beam-eos"), eos_bias=0.35)


def hf_beam(hf, ids: list[int], n: int, lp: float, es: bool, max_new: int) -> tuple[list[int], bool]:
    """transformers' best beam: generated ids without the EOS, and whether it ended with EOS."""
    x = torch.tensor([ids])
    out = hf.generate(
        x, attention_mask=torch.ones_like(x), num_beams=n, do_sample=False, length_penalty=lp,
        early_stopping=es, max_new_tokens=max_new, eos_token_id=EOT_ID, pad_token_id=EOT_ID,
    )
    gen = out[0, len(ids):].tolist()  # shorter beams are padded with EOS (pad == EOS)
    return (gen[: gen.index(EOT_ID)], True) if EOT_ID in gen else (gen, False)


def ours(backend, ids: list[int], n: int, lp: float, es: bool, max_new: int):
    s = SamplingSettings(num_beams=n, length_penalty=lp, early_stopping=es, max_new_tokens=max_new)
    return generate(backend, ["prompt"], s, prompt_ids=[ids])[0]


def check_against_hf(hf, backend, n, lp, es, max_new=MAX_NEW) -> list:
    results = []
    for ids in PROMPTS:
        g = ours(backend, ids, n, lp, es, max_new)
        want, want_eos = hf_beam(hf, ids, n, lp, es, max_new)
        assert g.tokens == want, (ids, n, lp, es)
        assert g.finish_reason == ("eos" if want_eos else "length"), (ids, n, lp, es)
        assert g.prompt_tokens == ids
        results.append(g)
    return results


# ---------------------------------------------------------------- against transformers


@pytest.mark.parametrize("n,lp,es", GRID)
def test_matches_transformers_without_eos(plain, n, lp, es):
    results = check_against_hf(*plain, n, lp, es)
    assert all(len(g.tokens) == MAX_NEW for g in results)


@pytest.mark.parametrize("n,lp,es", GRID)
def test_matches_transformers_with_eos(eosy, n, lp, es):
    results = check_against_hf(*eosy, n, lp, es)
    assert any(g.finish_reason == "eos" for g in results)  # EOS really finishes hypotheses here


def test_early_stopping_heuristic_matters_and_matches(eosy):
    """With early_stopping=False, transformers keeps going while a running beam could still beat the
    worst finished one; with True it stops once num_beams hypotheses are done. Here the two differ."""
    hf, backend = eosy
    ids, n, lp = PROMPTS[0], 4, 2.0
    eager, patient = (ours(backend, ids, n, lp, es, MAX_NEW) for es in (True, False))
    assert eager.tokens != patient.tokens
    assert len(patient.tokens) > len(eager.tokens)
    assert eager.finish_reason == patient.finish_reason == "eos"
    for g, es in ((eager, True), (patient, False)):
        assert (g.tokens, True) == hf_beam(hf, ids, n, lp, es, MAX_NEW)


class Recording:
    """A backend wrapper that records the widest attention mask and largest position it was given."""

    def __init__(self, inner):
        self.inner, self.n_positions, self.name = inner, inner.n_positions, "recording"
        self.widest = self.last_position = self.steps = 0

    def step(self, input_ids, attention_mask, position_ids, past):
        self.widest = max(self.widest, attention_mask.shape[1])
        self.last_position = max(self.last_position, int(position_ids.max()))
        self.steps += 1
        logits, cache = self.inner.step(input_ids, attention_mask, position_ids, None if past is None else past.cache)
        return logits, RecordingCache(cache)


class RecordingCache:
    """The inner backend's cache, whose reorder checks the rows it is given."""

    def __init__(self, cache):
        self.cache = cache

    def reorder(self, rows):
        assert rows.dtype == np.int64
        return RecordingCache(self.cache.reorder(rows))


def test_context_limit_stops_at_n_positions(plain):
    hf, backend = plain
    ids, n = PROMPTS[2], 2
    room = backend.n_positions - len(ids)
    rec = Recording(backend)
    g = ours(rec, ids, n, 1.0, False, room + 40)
    assert g.finish_reason == "context" and len(g.tokens) == room
    assert rec.widest <= backend.n_positions and rec.last_position < backend.n_positions
    assert (g.tokens, False) == hf_beam(hf, ids, n, 1.0, False, room)  # same as stopping there on purpose


def test_beam_of_one_is_greedy(plain, eosy):
    for _, backend in (plain, eosy):
        for ids in PROMPTS:
            greedy = generate(backend, ["p"], SamplingSettings(greedy=True, max_new_tokens=12), prompt_ids=[ids])[0]
            one = beam_search(backend, "p", ids, SamplingSettings(num_beams=1, early_stopping=True, max_new_tokens=12))
            assert (one.tokens, one.finish_reason) == (greedy.tokens, greedy.finish_reason)


# ---------------------------------------------------------------- scripted backend, by hand

A, B, C = 10, 11, 12
# Next-token probabilities by the last token seen (0 ends the prompt); every other token gets ~0.
TABLE = {
    0: {A: 0.5, B: 0.3, EOT_ID: 0.2},
    A: {EOT_ID: 0.7, C: 0.3},
    B: {B: 0.6, EOT_ID: 0.4},
    C: {EOT_ID: 0.9, A: 0.1},
}


class Scripted:
    """The cache is each row's token list, so a wrong reorder shows up as wrong probabilities."""

    name = "scripted"

    def __init__(self, table=TABLE, n_positions: int = 64):
        self.table, self.n_positions = table, n_positions

    def step(self, input_ids, attention_mask, position_ids, past):
        rows = [list(r) for r in input_ids] if past is None else [p + list(r) for p, r in zip(past.rows, input_ids)]
        for r, m, pos in zip(rows, attention_mask, position_ids):
            assert len(m) == len(r) and m.all() and pos[-1] == len(r) - 1
        logits = np.full((len(rows), 50257), -30.0, dtype=np.float32)
        for i, r in enumerate(rows):
            for tok, p in self.table[int(r[-1])].items():
                logits[i, tok] = math.log(p)
        return logits, TokenCache(rows)


class TokenCache:
    def __init__(self, rows: list[list[int]]):
        self.rows = rows

    def reorder(self, rows):
        return TokenCache([list(self.rows[r]) for r in rows.tolist()])


def run_scripted(lp: float, es: bool = True, max_new: int = 5, **kw):
    s = SamplingSettings(num_beams=2, length_penalty=lp, early_stopping=es, max_new_tokens=max_new)
    return beam_search(Scripted(**kw), "p", [7, 0], s)


def test_scripted_length_penalty_one():
    # step 1: candidates A (-.69), B (-1.20), EOS (-1.61, third, so it may not finish); beams A, B
    # step 2: A EOS -1.05 (finishes: -1.05/2 = -.525), B B -1.71, A C -1.90; beams BB, AC (reordered 1, 0)
    # step 3: A C EOS -2.00 (finishes: -2.00/3 = -.667), BB B -2.23: both slots done -> stop; best [A]
    g = run_scripted(lp=1.0)
    assert (g.tokens, g.finish_reason) == ([A], "eos")


def test_scripted_length_penalty_two_prefers_longer():
    # same search; scores / len**2: [A] EOS -1.05/4 = -.262 < [A, C] EOS -2.00/9 = -.222.
    # Had the step-1 EOS (third candidate) been allowed to finish, both slots would be done after
    # step 2 and the answer would be [A].
    g = run_scripted(lp=2.0)
    assert (g.tokens, g.finish_reason) == ([A, C], "eos")


def test_scripted_length_and_context_limits():
    never_eos = {t: {B: 0.6, C: 0.4} for t in (0, A, B, C)}
    g = run_scripted(lp=1.0, max_new=3, table=never_eos)
    assert (g.tokens, g.finish_reason) == ([B, B, B], "length")
    g = run_scripted(lp=1.0, max_new=10, table=never_eos, n_positions=5)  # prompt 2 + 3 new
    assert (g.tokens, g.finish_reason) == ([B, B, B], "context")
    g = run_scripted(lp=1.0, max_new=10, table=never_eos, n_positions=2)  # no room at all
    assert (g.tokens, g.finish_reason) == ([], "context")


# ---------------------------------------------------------------- routing and helpers


def test_num_beams_one_is_not_routed_here(plain, monkeypatch):
    calls = []

    def spy(backend, prompt, ids, settings):
        calls.append(settings.num_beams)
        return Generation(prompt, ids)

    monkeypatch.setattr(generate_mod, "beam_search", spy)
    _, backend = plain
    out = generate(backend, ["p"], SamplingSettings(greedy=True, max_new_tokens=3), prompt_ids=[PROMPTS[0]])
    assert len(out[0].tokens) == 3 and calls == []
    generate(backend, ["p"], SamplingSettings(num_beams=2, max_new_tokens=3), prompt_ids=[PROMPTS[0]])
    assert calls == [2]


def test_one_result_per_prompt(plain):
    _, backend = plain
    s = SamplingSettings(num_beams=2, max_new_tokens=4)
    out = generate(backend, ["a", "b"], s, prompt_ids=PROMPTS[:2])
    assert [g.prompt for g in out] == ["a", "b"] and [g.prompt_tokens for g in out] == PROMPTS[:2]


def test_top_k_is_stable_on_ties():
    x = np.array([1.0, 3.0, 2.0, 3.0, 2.0, 0.0], dtype=np.float32)
    assert top_k(x, 3).tolist() == [1, 3, 2]
    assert top_k(x, 4).tolist() == [1, 3, 2, 4]
    assert top_k(x, 10).tolist() == [1, 3, 2, 4, 0, 5]
