"""The logits processors against transformers' own on the same logits (TemperatureLogitsWarper,
TopKLogitsWarper, TopPLogitsWarper, MinPLogitsWarper, RepetitionPenaltyLogitsProcessor,
MinNewTokensLengthLogitsProcessor, SequenceBiasLogitsProcessor), OpenAI's presence and frequency
penalties and logit_bias on hand-computed cases, and the order the sampler applies them in (vLLM's)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from transformers.generation.logits_process import (
    MinNewTokensLengthLogitsProcessor,
    MinPLogitsWarper,
    NoRepeatNGramLogitsProcessor,
    RepetitionPenaltyLogitsProcessor,
    SequenceBiasLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
    TypicalLogitsWarper,
)

from gpt2x.errors import UsageError
from gpt2x.generation.processors import (
    AllowedTokens,
    BadWords,
    ConstraintMask,
    History,
    LogitBias,
    MinP,
    MinTokens,
    NoRepeatNGram,
    PresenceFrequencyPenalty,
    RepetitionPenalty,
    Temperature,
    TopK,
    TopP,
    TypicalP,
    bad_word_ids,
    processors_for,
    softmax,
)
from gpt2x.generation.sampling import Sampler, masking_dtype, sample_many
from gpt2x.generation.settings import SamplingSettings
from gpt2x.tokenizer import EOT_ID

V = 1000


def transformers_scores(logits: np.ndarray, temperature: float, top_k: int, top_p: float, min_p: float = 0.0) -> np.ndarray:
    """transformers' warpers in vLLM's order (min-p after temperature, before top-k and top-p)."""
    scores = torch.from_numpy(logits.copy())
    ids = torch.zeros((logits.shape[0], 1), dtype=torch.long)
    if temperature != 1.0:
        scores = TemperatureLogitsWarper(temperature)(ids, scores)
    if min_p:
        scores = MinPLogitsWarper(min_p)(ids, scores)
    if top_k:
        scores = TopKLogitsWarper(top_k)(ids, scores)
    if top_p < 1.0:
        scores = TopPLogitsWarper(top_p)(ids, scores)
    return scores.numpy()


def assert_same_scores(ours: np.ndarray, theirs: np.ndarray) -> None:
    assert np.array_equal(np.isinf(ours), np.isinf(theirs))
    kept = ~np.isinf(theirs)
    np.testing.assert_allclose(ours[kept], theirs[kept], rtol=1e-12)


def random_logits(seed: int = 0, rows: int = 4) -> np.ndarray:
    return np.random.default_rng(seed).normal(size=(rows, V)) * 3  # float64: no ties, rounding far from thresholds


@pytest.mark.parametrize("temperature,top_k,top_p,min_p", [
    (1.0, 0, 1.0, 0.0), (0.7, 0, 1.0, 0.0), (1.3, 40, 1.0, 0.0), (1.0, 0, 0.9, 0.0), (0.8, 50, 0.95, 0.0), (1.0, 5, 0.5, 0.0),
    (2.0, 1, 1.0, 0.0), (1.0, 0, 1.0, 0.05), (0.7, 0, 1.0, 0.2), (1.3, 40, 0.9, 0.01), (1.0, 0, 1.0, 1.0),
])
def test_the_chain_keeps_and_scales_what_transformers_does(temperature, top_k, top_p, min_p):
    logits = random_logits()
    settings = SamplingSettings(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p)
    ours = logits.copy()  # a processor may write in place (the sampler hands it its own copy)
    for process in processors_for(settings):
        ours = process(ours)
    theirs = transformers_scores(logits, temperature, top_k, top_p, min_p)
    assert_same_scores(ours, theirs)
    p = Sampler(settings).probabilities(logits)
    want = torch.softmax(torch.from_numpy(theirs), dim=-1).numpy()
    np.testing.assert_allclose(p, want, rtol=1e-9, atol=1e-15)
    if min_p:  # the test can fail: min-p removed something, and the most likely token stayed
        assert np.isinf(ours).any(axis=-1).all() and (np.isfinite(ours[np.arange(4), logits.argmax(-1)])).all()


@pytest.mark.parametrize("min_p", [0.0, 0.01, 0.1, 0.5, 0.99, 1.0])
def test_min_p_is_transformers_min_p_warper(min_p):
    logits = random_logits(3)
    theirs = MinPLogitsWarper(min_p)(torch.zeros((4, 1), dtype=torch.long), torch.from_numpy(logits.copy())).numpy()
    assert_same_scores(MinP(min_p)(logits.copy()), theirs)


def histories(prompts: list[list[int]], outputs: list[list[int]]) -> list[History]:
    return [History(p, o) for p, o in zip(prompts, outputs)]


@pytest.mark.parametrize("penalty", [1.3, 0.7, 2.0])
def test_repetition_penalty_is_transformers_on_prompt_and_output(penalty):
    """transformers' input_ids are the prompt and the generated tokens together: the same tokens. Rows
    of equal total length (transformers takes a rectangle), different prompt/output splits, repeats,
    and logits of both signs on the penalised tokens."""
    rng = np.random.default_rng(1)
    logits = random_logits(1)
    whole = [rng.integers(0, V, 12).tolist() + [7, 7, 8] for _ in range(4)]
    splits = [0, 3, 12, 15]
    rows = histories([w[:s] for w, s in zip(whole, splits)], [w[s:] for w, s in zip(whole, splits)])
    ours = RepetitionPenalty(penalty)(logits.copy(), rows)
    theirs = RepetitionPenaltyLogitsProcessor(penalty)(torch.tensor(whole), torch.from_numpy(logits.copy())).numpy()
    np.testing.assert_allclose(ours, theirs, rtol=1e-12)
    seen = np.zeros_like(logits, dtype=bool)
    for i, w in enumerate(whole):
        seen[i, w] = True
    assert not np.allclose(ours[seen], logits[seen]) and np.array_equal(ours[~seen], logits[~seen])
    assert (logits[seen] > 0).any() and (logits[seen] < 0).any()


def test_min_tokens_is_transformers_min_new_tokens():
    """End-of-text and the stop token ids masked in the rows that have generated fewer than
    min_tokens tokens (transformers: new tokens = input length - prompt length)."""
    logits = np.random.default_rng(2).normal(size=(3, 50257))
    stops = [13, 198]
    prompt = [5, 6, 7]
    for generated in (0, 3, 4, 9):
        rows = histories([prompt] * 3, [[11] * generated] * 3)
        ours = MinTokens(4, [EOT_ID, *stops])(logits.copy(), rows)
        ids = torch.tensor([prompt + [11] * generated] * 3)
        theirs = MinNewTokensLengthLogitsProcessor(len(prompt), 4, [EOT_ID, *stops])(ids, torch.from_numpy(logits.copy()))
        assert_same_scores(ours, theirs.numpy())
        assert np.isinf(ours[:, [EOT_ID, *stops]]).all() == (generated < 4)
    # rows of one call are masked each by its own length; ids beyond a small vocabulary are left out
    mixed = MinTokens(2, [EOT_ID, 3])(np.zeros((2, 6)), histories([[1], [1]], [[], [2, 2]]))
    assert mixed.tolist() == [[0, 0, 0, -np.inf, 0, 0], [0] * 6]


def test_logit_bias_is_transformers_sequence_bias_of_single_tokens():
    logits = random_logits(4)
    bias = {3: 5.0, 17: -100.0, 999: 0.25}
    ours = LogitBias(bias)(logits.copy())
    theirs = SequenceBiasLogitsProcessor([[[t], b] for t, b in bias.items()])(
        torch.zeros((4, 1), dtype=torch.long), torch.from_numpy(logits.copy())).numpy()
    np.testing.assert_allclose(ours, theirs, rtol=1e-12)


def test_hand_computed_logit_bias_and_presence_frequency_penalties():
    """OpenAI's definition (platform.openai.com/docs/advanced-usage, "frequency and presence penalties"):
    mu[j] - c[j] * alpha_frequency - (c[j] > 0) * alpha_presence, c[j] counted over the generated
    tokens only: the prompt's tokens are not penalised."""
    x = np.array([[1.0, 2.0, 3.0, -1.0, 0.5]])
    rows = [History([3, 3, 4], [2, 2, 0, 2])]  # generated: token 0 once, token 2 three times
    got = PresenceFrequencyPenalty(presence=0.25, frequency=0.5)(x.copy(), rows)
    np.testing.assert_allclose(got, [[1.0 - 0.5 - 0.25, 2.0, 3.0 - 1.5 - 0.25, -1.0, 0.5]])
    negative = PresenceFrequencyPenalty(presence=-1.0, frequency=0.0)(x.copy(), rows)  # < 0 encourages repeats
    np.testing.assert_allclose(negative, [[2.0, 2.0, 4.0, -1.0, 0.5]])
    np.testing.assert_allclose(LogitBias({1: 0.5, 4: -100})(x.copy()), [[1.0, 2.5, 3.0, -1.0, -99.5]])
    np.testing.assert_allclose(RepetitionPenalty(2.0)(x.copy(), rows), [[0.5, 2.0, 1.5, -2.0, 0.25]])  # 0, 2, 3, 4 seen
    two = PresenceFrequencyPenalty(0.0, 1.0)(np.zeros((2, 3)), [History([], [1, 1]), History([1], [2])])
    assert two.tolist() == [[0, -2, 0], [0, 0, -1]]  # each row by its own output
    every = SamplingSettings(presence_penalty=0.25, frequency_penalty=0.5, repetition_penalty=2.0, logit_bias={1: 0.5},
                             min_tokens=9, stop_token_ids=[3])
    Sampler(every).scores(x.astype(np.float32), rows)
    assert x.tolist() == [[1.0, 2.0, 3.0, -1.0, 0.5]]  # the sampler's processors write on its own copy only
    f64 = x.copy()
    Sampler(every).scores(f64, rows)
    assert f64.tolist() == x.tolist()  # float64 logits are copied too


def test_no_repeat_ngram_by_hand_and_typical_p_only_when_sampling():
    """Hand-computed: after 5 6 7 5 6 the bigram rule bans 7 (5 6 -> 7 was seen), the trigram rule bans 7 too
    (`5 6` ends the text and `5 6 7` was seen), and 4-grams ban nothing (`7 5 6` occurred once). typical_p is a
    sampling warper (transformers applies it only when sampling): greedy leaves it out; no_repeat_ngram_size stays."""
    h = [History([5, 6], [7, 5, 6], 0)]
    for n, banned in ((2, [7]), (3, [7]), (4, []), (2**67, [])):  # one past int64's range too (a request's), batched
        out = NoRepeatNGram(n)(np.zeros((1, 10)), h)
        assert np.flatnonzero(np.isinf(out[0])).tolist() == banned, n
        out = NoRepeatNGram.for_rows([NoRepeatNGram(n), None])(np.zeros((2, 10)), h * 2)
        assert np.flatnonzero(np.isinf(out[0])).tolist() == banned and not np.isinf(out[1]).any(), n
    assert [type(p) for p in processors_for(SamplingSettings(typical_p=0.5, no_repeat_ngram_size=3))] == [NoRepeatNGram, TypicalP]
    assert [type(p) for p in processors_for(SamplingSettings(greedy=True, typical_p=0.5, no_repeat_ngram_size=3))] == [NoRepeatNGram]


def test_bad_words_as_vllm_defines_them_by_hand():
    """vLLM's rule, worked by hand on GPT-2's tokenizer: "art" is 433 at a text's start and 1242 after a space, both
    one token, so both are banned; "Romeo" is 49 462 78 at the start and 43989 after a space, of another length, so
    vLLM keeps the first form only (its rule). A one-token word is banned at every step, a longer one's last token
    only where the output ends with its others; the prompt is not looked at (generated tokens only)."""
    from gpt2x.tokenizer import encode

    assert bad_word_ids(["art"]) == [[433], [1242]] and bad_word_ids(["  Romeo"]) == [[49, 462, 78]]
    two = encode(" wherefore art")  # 810 754 1242: its last banned only after the others
    proc = BadWords([two])
    V = 50257
    fresh = proc(np.zeros((1, V)), [History(two[:-1], [], 0)])  # the prefix in the prompt only: not banned
    assert not np.isinf(fresh).any()
    after = proc(np.zeros((1, V)), [History([], [5, *two[:-1]], 0)])
    assert np.flatnonzero(np.isinf(after[0])).tolist() == [two[-1]]
    one = BadWords([[42]])(np.zeros((2, V)), [History([], [], 0), History([], [1, 2], 1)])
    assert np.isinf(one[:, 42]).all() and np.isinf(one).sum() == 2
    batched = BadWords.for_rows([BadWords([[42]]), None])(np.zeros((2, V)), [History([], [], 0), History([], [], 1)])
    assert np.isinf(batched[0, 42]) and not np.isinf(batched[1]).any()


def test_the_order_and_what_is_left_out():
    s = SamplingSettings(temperature=0.5, top_k=3, top_p=0.9)
    assert [type(p) for p in processors_for(s)] == [Temperature, TopK, TopP]
    assert processors_for(SamplingSettings()) == []  # OpenAI's defaults change nothing
    assert processors_for(SamplingSettings(greedy=True, top_k=3, min_p=0.5)) == []  # greedy draws nothing
    every = dict(min_tokens=2, logit_bias={1: 1.0}, repetition_penalty=1.2, presence_penalty=0.1,
                 frequency_penalty=0.1, min_p=0.1, top_k=3, top_p=0.9, temperature=0.5)
    assert [type(p) for p in processors_for(SamplingSettings(**every))] == [
        MinTokens, LogitBias, RepetitionPenalty, PresenceFrequencyPenalty, Temperature, MinP, TopK, TopP]  # vLLM's
    greedy = processors_for(SamplingSettings(greedy=True, **every))  # what can move the argmax stays
    assert [type(p) for p in greedy] == [MinTokens, LogitBias, RepetitionPenalty, PresenceFrequencyPenalty]
    assert not any(p.argmax_invariant for p in greedy)
    assert all(p.argmax_invariant for p in processors_for(SamplingSettings(**every))[4:])


def test_the_whole_chain_against_transformers_in_vllms_order():
    """Every processor at once, on rows with their own histories, against transformers' processors
    (and OpenAI's formula for the penalties transformers has not) in vLLM's order."""
    logits = random_logits(5)
    prompts = [[1, 2, 3], [4, 4, 5], [6, 7, 8], [9, 9, 9]]
    outputs = [[10, 11, 10], [12, 1, 12], [13, 13, 13], [14, 2, 15]]
    settings = SamplingSettings(min_tokens=4, stop_token_ids=[20], logit_bias={10: 1.5, 21: -3.0}, repetition_penalty=1.3,
                                presence_penalty=0.4, frequency_penalty=0.3, temperature=0.8, min_p=0.02, top_k=200,
                                top_p=0.95)
    rows = histories(prompts, outputs)
    ours = Sampler(settings).scores(logits, rows)
    ids = torch.tensor([p + o for p, o in zip(prompts, outputs)])
    t = torch.from_numpy(logits.copy())
    t = MinNewTokensLengthLogitsProcessor(3, 4, [20])(ids, t)  # end-of-text (50256) is outside V = 1000
    t = SequenceBiasLogitsProcessor([[[10], 1.5], [[21], -3.0]])(ids, t)
    t = RepetitionPenaltyLogitsProcessor(1.3)(ids, t)
    for i, out in enumerate(outputs):  # OpenAI's formula
        tokens, counts = np.unique(out, return_counts=True)
        t[i, torch.from_numpy(tokens)] -= torch.from_numpy(counts * 0.3 + 0.4)
    theirs = transformers_scores(t.numpy(), 0.8, 200, 0.95, 0.02)
    assert_same_scores(ours, theirs)
    assert np.isinf(ours[:, 20]).all()


def test_greedy_takes_the_argmax_of_the_processed_scores():
    x = np.log(np.array([[0.5, 0.3, 0.2]]))
    plain = Sampler(SamplingSettings(greedy=True))
    assert plain.argmax_only and plain(x).tolist() == [0]
    penalised = Sampler(SamplingSettings(greedy=True, presence_penalty=1.0))
    assert not penalised.argmax_only
    assert penalised(x, [History([0], [])]).tolist() == [0]  # the prompt's tokens are not penalised
    assert penalised(x, [History([], [0])]).tolist() == [1]  # log 0.5 - 1 < log 0.3
    assert Sampler(SamplingSettings(greedy=True, logit_bias={2: 1.0})).greedy(x).tolist() == [2]
    with pytest.raises(ValueError, match="history"):
        penalised(x)  # a processor that reads histories is never given none


def test_greedy_rows_that_only_mask_give_the_masked_argmax_in_float32_and_the_others_stay_float64():
    """Greedy rows whose processors only set -inf (min_tokens, allowed tokens) run them on float32 logits: the tokens
    are the argmax after masking by hand; a penalty or a sampled row keeps float64, and float64 logits stay so."""
    S = SamplingSettings
    rng = np.random.default_rng(3)
    x = rng.standard_normal((3, 500)).astype(np.float32)
    x = np.concatenate([x, np.zeros((3, EOT_ID + 1 - 500), np.float32)], axis=1)
    x[:, EOT_ID] = 50.0  # end-of-text is every row's raw argmax
    x[2, 7] = 40.0  # and token 7 the third row's next best, outside its allowed tokens
    masked = [S(greedy=True, min_tokens=4), S(greedy=True, min_tokens=4, stop_token_ids=[11]),
              S(greedy=True, allowed_token_ids=list(range(0, 300, 2)))]
    samplers = [Sampler(s) for s in masked]
    rows = [History([1], [2], i) for i in range(3)]
    by_hand = x.astype(np.float64)
    by_hand[:2, EOT_ID] = -np.inf
    by_hand[1, 11] = -np.inf
    by_hand[2, [t for t in range(x.shape[1]) if t % 2 or t >= 300]] = -np.inf
    want = by_hand.argmax(axis=-1).tolist()
    assert masking_dtype(x, samplers) == np.float32
    assert sample_many(samplers, x, rows).tolist() == want
    assert [int(s.greedy(x[i : i + 1], [rows[i]])[0]) for i, s in enumerate(samplers)] == want
    assert want[2] != 7 and EOT_ID not in want
    assert masking_dtype(x.astype(np.float16), samplers) == np.float32
    assert masking_dtype(x.astype(np.float64), samplers) == np.float64
    assert masking_dtype(x, samplers + [Sampler(S(greedy=True, repetition_penalty=1.2))]) == np.float64
    assert masking_dtype(x, samplers + [Sampler(S(seed=1, min_tokens=4))]) == np.float64
    assert masking_dtype(x, [Sampler(S(greedy=True, logit_bias={3: 1.0}))]) == np.float64


def test_a_drafted_position_sees_the_drafted_tokens_before_it():
    h = History([1, 2], [3], row="r")
    assert h.extended([]) is h
    e = h.extended([4, 5])
    assert (list(e.prompt), list(e.output), e.row) == ([1, 2], [3, 4, 5], "r") and list(h.output) == [3]


@pytest.mark.parametrize("kw,option", [
    (dict(presence_penalty=2.5), "presence_penalty"), (dict(frequency_penalty=-2.1), "frequency_penalty"),
    (dict(repetition_penalty=0.0), "repetition_penalty"), (dict(repetition_penalty=float("inf")), "repetition_penalty"),
    (dict(min_p=1.5), "min_p"), (dict(min_p=float("nan")), "min_p"), (dict(logit_bias={5: 100.5}), "logit_bias"),
    (dict(logit_bias={50257: 1.0}), "logit_bias"), (dict(stop_token_ids=[-1]), "stop_token_ids"),
    (dict(min_tokens=-1), "min_tokens"), (dict(min_tokens=65, max_new_tokens=64), "min_tokens"), (dict(n=0), "n"),
    (dict(num_beams=2, repetition_penalty=1.2), "num_beams"), (dict(num_beams=2, n=2), "num_beams"),
    (dict(typical_p=0.0), "typical_p"), (dict(typical_p=1.5), "typical_p"), (dict(typical_p=float("nan")), "typical_p"),
    (dict(no_repeat_ngram_size=-1), "no_repeat_ngram_size"), (dict(num_beams=2, no_repeat_ngram_size=2), "num_beams"),
])
def test_bad_processor_settings_are_refused_naming_the_option(kw, option):
    with pytest.raises(UsageError) as e:
        SamplingSettings(**kw)
    assert e.value.option == option and str(e.value).startswith(option)


def test_settings_normalise_bias_and_stop_ids():
    s = SamplingSettings(logit_bias={9: 1, 3: -2.5}, stop_token_ids=[7, 5, 7])
    assert s.logit_bias == ((3, -2.5), (9, 1.0)) and s.stop_token_ids == (7, 5)
    assert hash(s) == hash(SamplingSettings(logit_bias=[(3, -2.5), (9, 1.0)], stop_token_ids=(7, 5)))


def test_hand_computed_cases():
    x = np.log(np.array([[0.5, 0.3, 0.15, 0.05]]))
    assert np.isinf(TopP(0.75)(x)).tolist() == [[False, False, True, True]]  # 0.5 + 0.3 reach 0.75
    assert np.isinf(TopP(0.85)(x)).tolist() == [[False, False, False, True]]  # 0.8 before 0.15; 0.95 before 0.05
    assert np.isinf(TopK(2)(x)).tolist() == [[False, False, True, True]]
    for huge in (4, 2**100):  # k >= V keeps every score, one past int64's range too (a request's top_k, and batched)
        assert not np.isinf(TopK(huge)(x)).any() and not np.isinf(TopK.for_rows([TopK(huge), TopK(2)])(x[[0, 0]])[0]).any()
    assert np.isinf(MinP(0.31)(x)).tolist() == [[False, False, True, True]]  # 0.15 < 0.31 * 0.5
    assert np.isinf(MinP(0.29)(x)).tolist() == [[False, False, False, True]]  # 0.05 < 0.145 <= 0.15
    np.testing.assert_allclose(Temperature(0.5)(x), 2 * x)


def test_overflowing_scores_give_their_mass_to_the_overflowed_tokens():
    """A repetition penalty of 1e-308 divides positive logits of seen tokens to +inf (a temperature of
    1e-310 likewise): no NaN, the +inf tokens share the mass, and nothing else is drawn."""
    x = np.array([[3.0, 2.0, -1.0, 2.5]])
    p = Sampler(SamplingSettings(repetition_penalty=1e-308)).probabilities(x, [History([0, 2], [3])])
    np.testing.assert_array_equal(p, [[0.5, 0.0, 0.0, 0.5]])  # 0 and 3 overflowed (> 1.8e308); 2 went to -1e-308
    p = Sampler(SamplingSettings(temperature=1e-310, top_p=0.9)).probabilities(x)
    assert not np.isnan(p).any() and p[0, 2] == 0 and p.sum() == pytest.approx(1.0)


# ------------------------------------------------------------------ one batch, per-row parameters (issue 38, item 4)

WIDE = 50257  # GPT-2's vocabulary: top-p sorts its largest values first here (V = 1000 sorts the whole row)
SCALES = np.array([3.0, 10.0, 0.3, 3.0, 1.0])[:, None]  # peaked, flat and between: top-p's heads, the whole row


def wide_rows() -> tuple[np.ndarray, list[History]]:
    """Five rows of logits (float64, no ties) and histories with repeats, of different lengths."""
    rng = np.random.default_rng(11)
    logits = rng.normal(size=(5, WIDE)) * SCALES
    outputs = [[], [7, 7], [7, 9, 9, 9], rng.integers(0, 500, 6).tolist(), [9] * 8]
    return logits, [History(rng.integers(0, 500, 4).tolist() + [7], out, i) for i, out in enumerate(outputs)]


def tf(processor, row: np.ndarray, history: History) -> np.ndarray:
    """A transformers processor on one row, its input_ids the row's prompt and output."""
    ids = torch.tensor([[*history.prompt, *history.output]])
    return processor(ids, torch.from_numpy(row[None].copy())).numpy()[0]


# Each row its own processor (None: the row has none); transformers' with that row's parameter
# (None: no transformers processor, the row checked against our own alone only).
PER_ROW = {
    "temperature": ([Temperature(0.7), None, Temperature(1.3), Temperature(0.05), Temperature(2.0)],
                    lambda p, h: TemperatureLogitsWarper(p.temperature)),
    "top_k": ([TopK(5), TopK(50), None, TopK(WIDE + 3), TopK(1)], lambda p, h: TopKLogitsWarper(p.k)),
    "top_p": ([TopP(0.9), TopP(0.5), TopP(0.99), None, TopP(0.3)], lambda p, h: TopPLogitsWarper(p.p)),
    "min_p": ([MinP(0.05), None, MinP(0.3), MinP(1.0), MinP(0.01)], lambda p, h: MinPLogitsWarper(p.min_p)),
    "repetition": ([RepetitionPenalty(1.3), RepetitionPenalty(0.7), None, RepetitionPenalty(2.0), RepetitionPenalty(1.1)],
                   lambda p, h: RepetitionPenaltyLogitsProcessor(p.penalty)),
    "min_tokens": ([MinTokens(3, [EOT_ID, 13]), MinTokens(2, [EOT_ID]), MinTokens(7, [EOT_ID, 198, 13]), None,
                    MinTokens(9, [EOT_ID, 5])],  # rows 0, 2 and 4 short of theirs, row 1 past it
                   lambda p, h: MinNewTokensLengthLogitsProcessor(len(h.prompt), p.min_tokens, p.end_ids.tolist())),
    "logit_bias": ([LogitBias({7: 5.0}), None, LogitBias({7: -3.0, 9: 100.0}), LogitBias({WIDE + 5: 1.0, 3: 2.0}),
                    LogitBias({9: -100.0})],
                   lambda p, h: SequenceBiasLogitsProcessor([[[t], b] for t, b in zip(p.ids.tolist(), p.values.tolist())
                                                             if t < WIDE])),
    "presence_frequency": ([PresenceFrequencyPenalty(0.5, 0.2), None, PresenceFrequencyPenalty(-1.0, 0.0),
                            PresenceFrequencyPenalty(0.0, 1.5), PresenceFrequencyPenalty(2.0, -2.0)], None),
    "allowed": ([AllowedTokens(range(0, 5000, 7)), None, AllowedTokens([7, 9]), AllowedTokens([3, WIDE + 1]), None], None),
    "typical_p": ([TypicalP(0.9), TypicalP(0.5), None, TypicalP(0.99), TypicalP(0.2)],
                  lambda p, h: TypicalLogitsWarper(p.p)),
    # n = 1 bans every token seen; 2 and 3 a token completing a pair or a triple seen before (7 7 7, 9 9 9 ...)
    "no_repeat_ngram": ([NoRepeatNGram(1), NoRepeatNGram(2), None, NoRepeatNGram(1), NoRepeatNGram(3)],
                        lambda p, h: NoRepeatNGramLogitsProcessor(p.n)),
}


def test_min_p_keeps_what_the_probabilities_keep_with_infinities_and_nan():
    """MinP compares logits (s < max s + log min_p), not probabilities: the same tokens as p < min_p * max p on the
    softmax, on rows of GPT-2's width, with +inf scores (their mass shared among them), -inf over most of a row, a
    row of -inf and a NaN; min_p 1 keeps the largest and its ties only."""
    rng = np.random.default_rng(9)
    logits = np.round(rng.normal(size=(6, WIDE)) * 3, 2)
    logits[1, [5, 900]] = np.inf
    logits[2, rng.random(WIDE) < 0.95] = -np.inf
    logits[3] = -np.inf
    logits[4, 77] = np.nan
    logits[5, [3, 4000]] = logits[5].max() + 1.0  # tied largest
    for min_p in (0.05, 0.3, 1.0):
        with np.errstate(invalid="ignore"):
            probs = softmax(logits)
            want = np.where(probs < min_p * probs.max(axis=-1, keepdims=True), -np.inf, logits)
        got = MinP(min_p)(logits.copy())
        assert np.array_equal(got, want, equal_nan=True), min_p
    assert np.flatnonzero(~np.isinf(MinP(1.0)(logits.copy())[5])).tolist() == [3, 4000]


def test_top_p_over_the_wide_vocabulary_keeps_the_stable_orders_prefix_with_ties():
    """TopP's kept tokens are the most likely ones in the stable descending order (equal ones by id) while the mass
    before each is below p: checked against that definition (a stable argsort and its running sum) on rows of GPT-2's
    width whose scores tie in groups of hundreds (rounded), peaked (the head of 256), between (a grown head) and flat
    (the whole row's value sort, the boundary inside a group of equal scores), and on a row of NaN (all removed)."""
    rng = np.random.default_rng(5)
    logits = np.round(rng.normal(size=(5, WIDE)) * np.array([4.0, 1.5, 0.3, 0.05, 1.0])[:, None], 1)
    logits[4] = np.nan
    for p in (0.3, 0.9, 0.999):
        probs = softmax(logits)
        want = np.zeros(logits.shape, dtype=bool)
        for row, keep in zip(probs, want):
            order = np.argsort(-row, kind="stable")
            keep[order] = np.cumsum(row[order]) - row[order] < p
        got = ~np.isinf(TopP(p)(logits))
        assert np.array_equal(got, want), p
        assert not got[4].any() and all(0 < got[r].sum() < WIDE for r in range(4))


def top_p_by_definition(logits: np.ndarray, ps) -> np.ndarray:
    """TopP's kept tokens by its definition: a float64 softmax, a stable descending argsort and its running sum."""
    probs = softmax(logits)
    want = np.zeros(logits.shape, dtype=bool)
    for row, keep, p in zip(probs, want, np.broadcast_to(ps, (len(logits),))):
        order = np.argsort(-row, kind="stable")
        keep[order] = np.cumsum(row[order]) - row[order] < p
    return want


def test_top_p_decided_from_float32_masses_keeps_the_definitions_tokens(monkeypatch):
    """TopP decides most rows from float32 exponentials (their float64 total unknown): the same tokens as the
    definition on peaked, trained-like and flat rows (a head of 1,024, of 8,192, the whole row), rows mostly -inf (after
    top-k), rows of +inf or -inf, ties at the boundary, per-row p, and p set at the definition's own masses before a
    token and a float64 step either side of them (where float32 cannot tell and the float64 way must decide). The
    float64 softmax runs only for the rows the float32 masses cannot settle."""
    from gpt2x.generation import processors

    rng = np.random.default_rng(11)
    scales = np.array([8.0, 5.0, 3.0, 2.0, 1.0, 0.3, 3.0, 3.0, 3.0, 1.0, 4.0, 6.0])
    logits = (rng.standard_normal((len(scales), WIDE)) * scales[:, None]).astype(np.float32).astype(np.float64)
    logits[6, rng.random(WIDE) < 0.999] = -np.inf  # about 50 left
    logits[7, :300] = logits[7].max() + 2.0  # 300 equal scores on top: the boundary falls among them
    logits[8] = np.round(logits[8], 1)  # ties everywhere
    logits[9, 5] = np.inf
    logits[10] = -np.inf
    logits[11, 1000] = logits[11].max() + 30.0  # one token holds nearly all the mass
    float64_rows = []
    real_softmax = processors.softmax
    monkeypatch.setattr(processors, "softmax", lambda s, *a: float64_rows.append(s.shape) or real_softmax(s, *a))
    for p in (0.1, 0.5, 0.9, 0.95, 0.999):
        got = TopP(p)(logits) != -np.inf  # (a kept +inf stays +inf)
        assert np.array_equal(got, top_p_by_definition(logits, p)), p
    assert len(float64_rows) < 5 * len(scales) / 2  # most rows (the peaked ones at every p) without a float64 softmax
    ps = np.linspace(0.2, 0.97, len(scales))
    got = TopP.for_rows([TopP(p) for p in ps])(logits.copy()) != -np.inf
    assert np.array_equal(got, top_p_by_definition(logits, ps))
    # Ties the float32 way cannot see. Two masses a float64 step apart that one division by the total makes equal
    # (the definition then keeps the lower id); and masses equal in float64 (exp(-1e-30) is 1) of tokens whose scores
    # round apart in float32, one of them outside the head of 1,024.
    row = rng.standard_normal(WIDE) - 30.0
    row[0] = 0.0
    # Such a pair as this machine's NumPy computes them, searched for: with masses 1 and about 0.98 twice, the total is
    # about 2.96, and a quotient's mantissa (0.98 / 2.96) below its dividend's lets two adjacent masses divide equal.
    for x in np.linspace(-0.0202, -0.0201, 400):
        row[10], row[11] = x, np.nextafter(x, 1)
        if np.exp(row[10]) != np.exp(row[11]) and softmax(row)[10] == softmax(row)[11]:
            break
    assert np.exp(row[10]) != np.exp(row[11]) and softmax(row)[10] == softmax(row)[11]
    row2 = np.full(WIDE, -20.0)
    row2[1000:2022] = 0.0  # 1,022 tokens
    row2[[3000, 3001]] = -1e-30
    row2[500] = -1.0000002e-30  # below the head's threshold in float32, the same mass in float64
    assert np.exp(row2[500]) == 1.0 and np.float32(row2[500]) < np.float32(row2[3000])
    for r, p in ((row, 0.5), (row2, 1022.5 / 1025)):  # the 2nd of the pair goes; 1,023 of the 1,025 equal stay
        got = TopP(p)(r[None].copy()) != -np.inf
        assert np.array_equal(got, top_p_by_definition(r[None], p)), p
    # p at the definition's mass before the 2nd .. 40th token of the peaked rows, and one float64 step either side
    probs = softmax(logits[:3])
    for r, row in enumerate(probs):
        ranked = np.sort(row)[::-1]
        for before in (np.cumsum(ranked) - ranked)[1:40:3]:
            for p in (np.nextafter(before, 0), before, np.nextafter(before, 1)):
                got = TopP(p)(logits[r : r + 1]) != -np.inf
                assert np.array_equal(got, top_p_by_definition(logits[r : r + 1], p)), (r, p)


def test_top_k_over_the_wide_vocabulary_keeps_what_transformers_does_with_ties_infinities_and_nan():
    """TopK finds the k-th largest from the rows' block maxima down (TOP_K_BLOCK): rows of GPT-2's width with
    ties at the k-th score, -inf over most of the row, the top scores in one block, in the short last one or one
    in each block, per-row ks up to and past the number of blocks (99 here), and a NaN (np.partition's order: the
    largest)."""
    rng = np.random.default_rng(3)
    logits = np.round(rng.normal(size=(8, WIDE)) * 3, 1)  # ties everywhere
    logits[1, rng.random(WIDE) < 0.9] = -np.inf
    logits[2, 512:1024] += 40.0  # the top 512 in one block
    logits[3, -(WIDE % 512):] += 40.0  # ... in the short last block
    logits[4, 7] = np.nan
    logits[6] = -10.0
    logits[6, ::512] = np.arange(WIDE // 512 + 1, 0, -1)  # one high score a block: the k-th is the k-th block maximum
    ks = np.array([1, 50, 200, 99, 50, 100, 60, 512])
    alone = [TopK(int(k))(logits[i : i + 1].copy())[0] for i, k in enumerate(ks)]
    batched = TopK(np.minimum(ks, 99))(logits.copy())  # per-row ks, all within the blocks' reach
    for i, row_k in enumerate(ks):
        for got, k in ((alone[i], row_k), (batched[i], min(row_k, 99))):
            kth = np.partition(logits[i], WIDE - k)[WIDE - k]  # NaN last, as the largest
            np.testing.assert_array_equal(got, np.where(logits[i] < kth, -np.inf, logits[i]))
            if i != 4:
                np.testing.assert_array_equal(got, tf(TopKLogitsWarper(int(k)), logits[i], History([], [])))


@pytest.mark.parametrize("name", PER_ROW)
def test_a_batch_with_per_row_parameters_gives_each_row_what_it_gives_alone(name):
    """One processor made for the batch from each row's own (for_rows, what sample_many runs) gives
    every row exactly what the row's own processor gives it alone, and what transformers' processor
    with that row's parameter gives; a row without one is left as it is."""
    procs, theirs = PER_ROW[name]
    logits, rows = wide_rows()
    kind = type(next(p for p in procs if p is not None))
    batched = kind.for_rows(procs)(logits.copy(), rows)
    for i, (own, h) in enumerate(zip(procs, rows)):
        alone = logits[i] if own is None else own(logits[i : i + 1].copy(), [h])[0]
        np.testing.assert_array_equal(batched[i], alone, err_msg=f"row {i}")
        if own is not None and theirs is not None:
            assert_same_scores(batched[i][None], tf(theirs(own, h), logits[i], h)[None])
    changed = [not np.array_equal(batched[i], logits[i]) for i in range(len(procs))]
    assert sum(changed) >= 3 and not any(c for c, p in zip(changed, procs) if p is None)  # the test can fail


def test_a_batch_of_constraints_masks_each_row_by_its_own():
    """Rows with constraints of their own (a choice, a regex) and rows without: each row masked as its
    own ConstraintMask masks it alone, the others left as they are."""
    from gpt2x.generation.constraints import ConstraintSpec

    procs = [ConstraintMask(ConstraintSpec.choice(["yes", "no"])), None, ConstraintMask(ConstraintSpec.regex("[0-9]+"))]
    logits = np.random.default_rng(12).normal(size=(3, WIDE))
    rows = [History([1], [], i) for i in range(3)]
    batched = ConstraintMask.for_rows(procs)(logits.copy(), rows)
    for i, (own, h) in enumerate(zip(procs, rows)):
        alone = logits[i] if own is None else own(logits[i : i + 1].copy(), [h])[0]
        np.testing.assert_array_equal(batched[i], alone)
    kept = np.isfinite(batched).sum(axis=-1)
    assert kept[1] == WIDE and 0 < kept[0] < kept[2] < WIDE  # a few first tokens of two words; the digit tokens


def test_rows_of_their_own_sample_as_each_alone_whatever_their_processors():
    """sample_many over rows with settings of their own (every processor, greedy rows among them, a
    sampler whose list holds a processor outside ORDER) gives the tokens each Sampler gives alone."""
    S = SamplingSettings
    settings = [S(seed=1, top_p=0.9), S(seed=2, temperature=0.6, top_k=30, top_p=0.8), S(greedy=True),
                S(greedy=True, repetition_penalty=1.5, logit_bias={12: 30.0}), S(seed=3, min_p=0.1, logit_bias={7: 3.0}),
                S(seed=4, presence_penalty=1.0, frequency_penalty=0.5, min_tokens=6, stop_token_ids=[9]),
                S(seed=5, allowed_token_ids=list(range(0, 3000, 3)), temperature=1.4), S(seed=6, top_k=WIDE + 1)]
    logits, rows = wide_rows()
    logits = np.concatenate([logits, logits[:4] * 0.5]).astype(np.float32)
    rows = rows + [History([5, 6], [7] * i, 5 + i) for i in range(4)]

    class Halve:  # a processor sample_many does not know: its row samples alone
        argmax_invariant, reads_history = False, False

        def __call__(self, scores, rows=()):
            return scores / 2

    odd = Sampler(S(seed=7, top_p=0.95))
    odd.processors.insert(0, Halve())
    together = [Sampler(s) for s in settings] + [odd]
    alone = [Sampler(s) for s in settings] + [Sampler(S(seed=7, top_p=0.95))]
    alone[-1].processors.insert(0, Halve())
    for step in range(3):
        x = np.roll(logits, step, axis=-1)
        want = [int(s(x[i : i + 1], [rows[i]])[0]) for i, s in enumerate(alone)]
        assert sample_many(together, x, rows).tolist() == want, step
    assert len(set(want)) > 4
    assert [s.rng.random() for s in together] == [s.rng.random() for s in alone]  # each stream moved as alone


def test_a_batch_keeps_its_processors_across_steps_until_its_rows_change(monkeypatch, reference):
    """vLLM v1's persistent batch state: a batch of rows with samplers of their own makes each processor kind's
    batched form once (for_rows), again only when its rows change (one ended), not at every step; and each row's
    tokens are still those it gives decoded alone."""
    from gpt2x.generation.decode import Sequence, decode, decode_steps
    from gpt2x.tokenizer import encode

    made: list[int] = []
    for_rows = TopK.for_rows.__func__
    monkeypatch.setattr(TopK, "for_rows", classmethod(lambda cls, procs: made.append(len(procs)) or for_rows(cls, procs)))

    def rows():
        return [Sequence(encode("ROMEO:"), SamplingSettings(top_k=5, seed=i, ignore_eos=True), max_tokens=n)
                for i, n in enumerate((3, 8, 8))]

    together = rows()
    steps = list(decode_steps(reference, together))
    assert len(steps) == 8
    # the prefill's rows, then the batch's: once with its three rows, once more when the first has ended
    assert made == [3, 3, 2]
    for row, alone in zip(together, rows()):
        list(decode(reference, [alone]))
        assert alone.tokens == row.tokens and len(row.tokens) == row.max_tokens


def test_each_processor_checks_its_own_fields_and_beam_search_refuses_those_it_does_not_take():
    """A processor carries its validation: a bad value of any processor's field is one UsageError naming it; what a
    processor reads beyond the sampling-only truncations is refused with beam search, every field named."""
    from gpt2x.generation.processors import ORDER, beam_refused_fields

    for kind in ORDER:
        assert kind.fields and all(f in SamplingSettings.__dataclass_fields__ for f in kind.fields), kind
    with pytest.raises(UsageError) as e:
        SamplingSettings(num_beams=2, presence_penalty=0.5, bad_words=("thee",), no_repeat_ngram_size=2, top_p=0.5)
    assert e.value.option == "num_beams"
    assert "presence_penalty, no_repeat_ngram_size, bad_words" in str(e.value) and "top_p" not in str(e.value)
    assert beam_refused_fields(SamplingSettings(typical_p=0.5, temperature=0.7)) == []
