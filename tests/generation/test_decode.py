"""The one decode loop (generation/decode.py): against a no-cache loop over transformers' model, and
on a Markov-chain backend whose next-token distributions are known, so that tokens, draws, finish
reasons and the steps run are computed by hand."""

from __future__ import annotations

import math
import threading
from dataclasses import replace

import numpy as np
import pytest
import torch

from gpt2x.errors import UsageError
from gpt2x.generation import sampling
from gpt2x.generation.decode import Event, Sequence, decode, decode_steps, sample_rows, start, step_rows
from gpt2x.generation.decode import step as step_batch
from gpt2x.generation.processors import History
from gpt2x.generation.sampling import Sampler
from gpt2x.generation.settings import Finish, SamplingSettings
from gpt2x.generation.speculative import DraftSettings, NgramDrafter, control_for, speculative_loop
from gpt2x.model.weights import load_model
from gpt2x.numerics import positions
from gpt2x.runtime.base import Capabilities
from gpt2x.runtime.pytorch import TorchBackend
from gpt2x.tokenizer import EOT_ID

GREEDY = SamplingSettings(greedy=True, max_new_tokens=8)
V = 50257


class Count:
    """A Markov backend's cache: only how many positions it holds."""

    def __init__(self, length: int):
        self.length = length

    def truncate(self, length: int) -> Count:
        return Count(length)


class Markov:
    """Each row's next-token distribution depends only on its last token: `chain[t]` is {token:
    probability}; a token with no entry is followed by <|endoftext|> for sure. Counts its steps and
    records what each step was fed."""

    name = "markov"
    vocab_size = V
    model_name = "markov"
    capabilities = Capabilities(rolls_back=True)

    def __init__(self, chain: dict[int, dict[int, float]], n_positions: int = 64):
        self.chain, self.n_positions = chain, n_positions
        self.fed: list[list[int]] = []  # each step's last input token per row

    def logits(self, token: int) -> np.ndarray:
        row = np.full(V, -1e9, dtype=np.float32)
        for t, p in self.chain.get(token, {EOT_ID: 1.0}).items():
            row[t] = math.log(p)
        return row

    def run(self, ids, mask, pos, past):
        assert mask.shape[1] == (0 if past is None else past.length) + ids.shape[1]
        out = np.stack([np.stack([self.logits(int(t)) for t in row]) for row in ids])  # (B, T, V)
        return out, Count(mask.shape[1])

    def step(self, ids, mask, pos, past):
        self.fed.append(ids[:, -1].tolist())
        logits, past = self.run(ids[:, -1:], mask[:, -1:] if past is None else mask, pos, past)
        return logits[:, -1], Count(mask.shape[1])

    def truncate(self, past, length):
        return past.truncate(length)


class ArgmaxMarkov(Markov):
    """A Markov backend that takes the argmax where its logits are (step_greedy), counting its uses."""

    capabilities = Capabilities(rolls_back=True, argmax_where_logits_are=True)

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.greedy_steps = 0

    def step_greedy(self, ids, mask, pos, past):
        self.greedy_steps += 1
        logits, past = self.step(ids, mask, pos, past)
        return logits.argmax(axis=-1).astype(np.int64), past


def cycle(*tokens: int) -> dict[int, dict[int, float]]:
    """A chain that walks `tokens` in a circle, for sure."""
    return {t: {tokens[(i + 1) % len(tokens)]: 1.0} for i, t in enumerate(tokens)}


def rows_of(events: list[Event], n: int) -> list[list[Event]]:
    out: list[list[Event]] = [[] for _ in range(n)]
    for e in events:
        out[e.row].append(e)
    return out


# ---------------------------------------------------------------- a real model, no cache


@pytest.fixture(scope="module")
def tiny(tiny_hf):
    folder, hf = tiny_hf
    return TorchBackend(load_model(str(folder))[0]), hf


def hf_last_logits(hf, ids: list[int]) -> np.ndarray:
    with torch.no_grad():
        return hf(torch.tensor([ids])).logits[0, -1].double().numpy()


def test_greedy_decode_equals_a_no_cache_argmax_loop(tiny):
    """Left-padded rows of different lengths against each prompt alone, recomputed whole at every token
    by transformers' model (no cache, no padding)."""
    backend, hf = tiny
    prompts = [[464, 3290], [15496, 11, 995, 318, 257, 1332, 13], [50256]]
    seqs = [Sequence(p, GREEDY, max_tokens=10) for p in prompts]
    events = list(decode(backend, seqs))
    for p, seq, mine in zip(prompts, seqs, rows_of(events, 3)):
        ids, want = list(p), []
        while len(want) < 10:
            tok = int(hf_last_logits(hf, ids).argmax())
            if tok == EOT_ID:
                break
            want.append(tok)
            ids.append(tok)
        assert seq.tokens == want and [e.token for e in mine if e.token is not None] == want
        assert seq.finish is (Finish.length if len(want) == 10 else Finish.eos) and mine[-1].finish is seq.finish


def test_rows_with_samplers_of_their_own_draw_as_each_prompt_alone(tiny):
    """Each row samples with its own seeded stream, one uniform per step: inverse-CDF draws from
    softmax(logits / T) of transformers' no-cache logits, with numpy's generator for that seed."""
    backend, hf = tiny
    prompts = [[464, 3290], [15496, 11, 995, 318]]
    settings = [SamplingSettings(temperature=0.9, seed=s, max_new_tokens=8, ignore_eos=True) for s in (3, 11)]
    seqs = [Sequence(p, s) for p, s in zip(prompts, settings)]
    list(decode(backend, seqs))
    for p, s, seq in zip(prompts, settings, seqs):
        rng, ids, want = np.random.default_rng(s.seed), list(p), []
        for _ in range(8):
            z = hf_last_logits(hf, ids) / 0.9
            cdf = np.cumsum(np.exp(z - z.max()))
            want.append(int(np.argmax(cdf >= rng.random() * cdf[-1])))
            ids.append(want[-1])
        assert seq.tokens == want and seq.finish is Finish.length


# ---------------------------------------------------------------- draws, by hand


def running_sum_draws(p: np.ndarray, u: np.ndarray) -> list[int]:
    """The reference: each row's first index whose running sum over the whole row reaches u of its total."""
    return [int(np.searchsorted(c, x * c[-1], side="left")) for c, x in zip(np.cumsum(p, axis=-1), u)]


@pytest.mark.parametrize("block,width,rows", [(4, 10, 4000), (sampling.CDF_BLOCK, 50257, 48), (sampling.CDF_BLOCK, 300, 400)],
                         ids=["blocks of 4 over 10 tokens", "GPT-2's vocabulary", "one block"])
def test_the_draw_by_blocks_is_the_running_sum_over_the_row(monkeypatch, block, width, rows):
    """Sampler.draw sums its inverse CDF by blocks: the same tokens as one running sum over the row, for
    dense rows, rows that are mostly zeros (top-k's, with the mass at a block's edges, in the short last
    block, or in one token), and never a token without mass; one uniform per row from the seed's stream."""
    monkeypatch.setattr(sampling, "CDF_BLOCK", block)
    rng = np.random.default_rng(5)
    p = rng.random((rows, width)) ** 4
    p[rows // 4 : rows // 2] *= rng.random((rows // 4, width)) < 0.1  # a tenth of the tokens keep mass ...
    p[np.arange(rows // 4, rows // 2), rng.integers(0, width, rows // 4)] += 0.5  # ... and one at least
    p[rows // 2 : 3 * rows // 4] = 0.0  # one token with all of it, anywhere
    p[np.arange(rows // 2, 3 * rows // 4), rng.integers(0, width, rows // 4)] = 1.0
    p[3 * rows // 4 :, : -(width % block or block)] = 0.0  # the short last block's tokens alone
    got = Sampler(SamplingSettings(seed=9)).draw(p.copy())
    want = running_sum_draws(p, np.random.default_rng(9).random(rows))
    assert got.tolist() == want
    assert (p[np.arange(rows), got] > 0).all()


def test_a_shared_sampler_draws_for_every_row_while_any_runs():
    """Rows sharing one sampler (generate's batch) take the step's uniforms in row order, a finished
    row's included; a row with a sampler of its own takes one of its own stream per step."""
    uniform = {t: {100: 0.25, 101: 0.25, 102: 0.25, 103: 0.25} for t in (5, 100, 101, 102, 103)}
    backend = Markov({**uniform, 7: {EOT_ID: 1.0}})
    s = SamplingSettings(seed=4, max_new_tokens=6)
    shared = Sampler(s)
    seqs = [Sequence([7], s, sampler=shared), Sequence([5], s, sampler=shared), Sequence([5], s)]
    list(decode(backend, seqs))
    u = np.random.default_rng(4).random((6, 2))  # (steps, shared rows)
    assert seqs[0].tokens == [] and seqs[0].finish is Finish.eos
    assert seqs[1].tokens == [100 + int(x * 4) for x in u[:, 1]]
    assert seqs[2].tokens == [100 + int(x * 4) for x in np.random.default_rng(4).random(6)]


def test_sample_rows_samples_only_the_rows_asked_and_feeds_eot_elsewhere():
    s = SamplingSettings(seed=1, max_new_tokens=4)
    seqs = [Sequence([1], s), Sequence([1], s), Sequence([1], GREEDY)]
    logits = np.stack([Markov({1: {42: 1.0}}).logits(1)] * 3)
    nxt, events = sample_rows(seqs, logits, rows=[0, 2])
    assert nxt.tolist() == [42, EOT_ID, 42]
    assert events == [Event(0, 42, None), Event(2, 42, None)] and seqs[1].tokens == []


def test_greedy_rows_that_only_mask_process_the_steps_logits_in_place_unless_a_row_reads_its_logprobs():
    """min_tokens masks end-of-text: with no row asking for logprobs, the step's float32 logits are masked where they
    are (no copy: nothing reads them after); with one asking, they are left as the model gave them, and its logprobs
    are the raw distribution's (log-softmax by hand), while every row still gets the masked argmax."""
    rng = np.random.default_rng(5)
    raw = rng.standard_normal((3, EOT_ID + 1)).astype(np.float32)
    raw[:, EOT_ID] = 30.0  # every row's raw argmax: masked by min_tokens
    want = np.where(np.arange(EOT_ID + 1) == EOT_ID, -np.inf, raw).argmax(axis=-1).tolist()
    settings = SamplingSettings(greedy=True, min_tokens=4, max_new_tokens=8)
    for asks in (None, 2):
        logits = raw.copy()
        seqs = [Sequence([1], settings), Sequence([1], settings, logprobs=asks), Sequence([1], settings)]
        nxt, events = sample_rows(seqs, logits)
        assert nxt.tolist() == want and EOT_ID not in want
        if asks is None:
            assert np.isneginf(logits[:, EOT_ID]).all()  # processed in place
            np.testing.assert_array_equal(np.delete(logits, EOT_ID, axis=1), np.delete(raw, EOT_ID, axis=1))
        else:
            np.testing.assert_array_equal(logits, raw)
            x = raw[1].astype(np.float64)
            by_hand = x - (x.max() + np.log(np.exp(x - x.max()).sum()))
            tok, lp, _ = events[1].logprob
            assert tok == want[1] and lp == pytest.approx(by_hand[want[1]], rel=1e-5)


def test_logprobs_are_the_raw_distributions():
    """The chosen token's log-probability and the k most likely tokens, from the step's logits before
    temperature; the end-of-text token's too, on the event that ends the row."""
    backend = Markov({5: {100: 0.5, 101: 0.3, 102: 0.2}, 100: {EOT_ID: 0.6, 9: 0.4}})
    [seq] = seqs = [Sequence([5], SamplingSettings(greedy=True, max_new_tokens=5), logprobs=2)]
    events = list(decode(backend, seqs))
    assert [(e.token, e.finish) for e in events] == [(100, None), (None, Finish.eos)]
    tok, lp, top = events[0].logprob
    assert tok == 100 and lp == pytest.approx(math.log(0.5))
    assert [t for t, _ in top] == [100, 101] and [x for _, x in top] == pytest.approx([math.log(0.5), math.log(0.3)])
    assert events[1].logprob[:2] == (EOT_ID, pytest.approx(math.log(0.6)))


# ---------------------------------------------------------------- how rows end


@pytest.mark.parametrize("ignore_eos", [False, True])
def test_ignore_eos_keeps_the_end_of_text_token(ignore_eos):
    backend = Markov({5: {EOT_ID: 1.0}, EOT_ID: {EOT_ID: 1.0}})
    seq = Sequence([5], SamplingSettings(greedy=True, max_new_tokens=4, ignore_eos=ignore_eos))
    events = list(decode(backend, [seq]))
    if ignore_eos:
        assert seq.tokens == [EOT_ID] * 4 and seq.finish is Finish.length and len(backend.fed) == 4
        assert events[-1] == Event(0, EOT_ID, Finish.length)
    else:
        assert seq.tokens == [] and events == [Event(0, None, Finish.eos)] and len(backend.fed) == 1


def test_rows_finishing_at_different_times():
    """A static batch: one list of events per step, each row's events ending with its finish, rows that
    ended fed <|endoftext|> until the last row ends, and no step after it."""
    backend = Markov({**cycle(10, 11, 12), 20: {21: 1.0}})  # 20 -> 21 -> end of text
    seqs = [Sequence([10], GREEDY, max_tokens=2), Sequence([10], GREEDY, max_tokens=5), Sequence([20], GREEDY)]
    steps = list(decode_steps(backend, seqs))
    assert [len(s) for s in steps] == [3, 3, 1, 1, 1] and len(backend.fed) == 5
    assert [s.tokens for s in seqs] == [[11, 12], [11, 12, 10, 11, 12], [21]]
    assert [s.finish for s in seqs] == [Finish.length, Finish.length, Finish.eos]
    for row, mine in enumerate(rows_of([e for s in steps for e in s], 3)):
        assert mine[-1].finish is seqs[row].finish and all(e.finish is None for e in mine[:-1])
    assert backend.fed[2:] == [[12, 12, EOT_ID], [EOT_ID, 10, EOT_ID], [EOT_ID, 11, EOT_ID]]


def test_a_budget_cut_by_the_context_ends_with_context():
    backend = Markov(cycle(10, 11), n_positions=16)
    seqs = [Sequence([10] * 10, GREEDY, max_tokens=20), Sequence([10], GREEDY, max_tokens=3),
            Sequence([10], GREEDY, max_tokens=6)]
    list(decode(backend, seqs))
    assert [len(s.tokens) for s in seqs] == [6, 3, 6]
    assert [s.limit for s in seqs] == [6, 3, 6]
    assert [s.finish for s in seqs] == [Finish.context, Finish.length, Finish.length]


def test_rows_with_no_room_end_before_the_prefill():
    backend = Markov(cycle(10, 11), n_positions=4)
    seqs = [Sequence([10] * 4, GREEDY), Sequence([10], GREEDY, max_tokens=0)]
    assert list(decode_steps(backend, seqs)) == [[Event(0, None, Finish.context), Event(1, None, Finish.length)]]
    assert backend.fed == []
    seq = Sequence([10], GREEDY, max_tokens=0)
    assert list(decode(Markov(cycle(10, 11)), [seq])) == [Event(0, None, Finish.length)]


def test_cancel_mid_stream_ends_that_row_with_its_reason():
    backend = Markov(cycle(10, 11, 12))
    seqs = [Sequence([10], GREEDY), Sequence([11], GREEDY), Sequence([12], GREEDY)]
    events = []
    for e in decode(backend, seqs):
        events.append(e)
        if e.row == 1 and len(seqs[1].tokens) == 3 and e.token is not None:
            seqs[1].cancel(Finish.stop)
    mine = rows_of(events, 3)
    assert [e.token for e in mine[1]] == [12, 10, 11, None] and mine[1][-1].finish is Finish.stop
    assert seqs[1].tokens == [12, 10, 11] and seqs[1].finish is Finish.stop
    assert [len(s.tokens) for s in (seqs[0], seqs[2])] == [8, 8]
    assert seqs[0].finish is seqs[2].finish is Finish.length


def test_cancelling_every_row_runs_no_further_step():
    backend = Markov(cycle(10, 11))
    seqs = [Sequence([10], GREEDY), Sequence([11], GREEDY)]
    steps = decode_steps(backend, seqs)
    next(steps), next(steps)
    seqs[0].cancel()
    other = threading.Thread(target=seqs[1].cancel, args=(Finish.stop,))  # from another thread
    other.start()
    other.join()
    assert list(steps) == [[Event(0, None, Finish.cancelled), Event(1, None, Finish.stop)]]
    assert len(backend.fed) == 2 and [len(s.tokens) for s in seqs] == [2, 2]


# ---------------------------------------------------------------- the greedy fast path, the bench's loop


def test_greedy_rows_take_the_backends_argmax_unless_one_asks_for_logprobs():
    backend = ArgmaxMarkov(cycle(10, 11, 12))
    seqs = [Sequence([10], GREEDY, max_tokens=4), Sequence([12], GREEDY, max_tokens=3)]
    list(decode(backend, seqs))
    assert backend.greedy_steps == 4 and [s.tokens for s in seqs] == [[11, 12, 10, 11], [10, 11, 12]]
    backend = ArgmaxMarkov(cycle(10, 11, 12))
    seqs = [Sequence([10], GREEDY, max_tokens=4), Sequence([12], GREEDY, max_tokens=3, logprobs=0)]
    list(decode(backend, seqs))
    assert backend.greedy_steps == 0 and [s.tokens for s in seqs] == [[11, 12, 10, 11], [10, 11, 12]]


def test_ignore_eos_runs_every_step_through_the_end_of_text():
    """The bench's runs: every row decodes its whole budget, <|endoftext|> ending none (kept as a token)."""
    backend = Markov({5: {EOT_ID: 1.0}, EOT_ID: {6: 1.0}, 6: {EOT_ID: 1.0}})
    settings = replace(GREEDY, ignore_eos=True)
    seqs = [Sequence([5, 5], settings, max_tokens=4), Sequence([6], settings, max_tokens=4)]
    steps = list(decode_steps(backend, seqs))
    assert len(steps) == 4 and [s.tokens for s in seqs] == [[EOT_ID, 6, EOT_ID, 6], [EOT_ID, 6, EOT_ID, 6]]
    assert all(s.finish is Finish.length for s in seqs)


# ---------------------------------------------------------------- with a draft


def test_a_draft_gives_the_same_tokens_and_a_cancel_ends_within_its_round():
    backend = Markov(cycle(10, 11, 12, 13))
    prompt = [10, 11, 12, 13, 10, 11]
    plain = Sequence(prompt, GREEDY, max_tokens=12)
    list(decode(backend, [plain]))
    fixed = DraftSettings(num_speculative_tokens=4, adaptive=False)
    spec = Sequence(prompt, GREEDY, max_tokens=12)
    steps = list(decode_steps(backend, [spec], NgramDrafter(fixed), fixed))
    assert spec.tokens == plain.tokens and spec.finish is Finish.length
    assert [len(s) for s in steps] == [1, 5, 5, 1] and spec.speculation.accepted == 8
    cancelled = Sequence(prompt, GREEDY, max_tokens=12)
    events = []
    for e in decode(backend, [cancelled], NgramDrafter(fixed), fixed):
        events.append(e)
        if len(events) == 3:  # the second token of the first round
            cancelled.cancel()
    assert [e.token for e in events] == plain.tokens[:3] + [None] and events[-1].finish is Finish.cancelled
    with pytest.raises(UsageError, match="one sequence"):
        list(decode(backend, [Sequence(prompt, GREEDY), Sequence(prompt, GREEDY)], NgramDrafter(fixed)))


def test_the_loops_rounds_are_speculative_loops_draw_for_draw():
    """A sampled row decoded with a draft through the loop (a Sequence: Drafted) takes the rounds
    speculative_loop gives for the same seed, round by round: one Speculation under both, no draw moved."""
    uniform = {t: {u: 0.25 for u in (10, 11, 12, 13)} for t in (10, 11, 12, 13)}
    prompt = [10, 11, 12, 13, 10, 11, 12]
    fixed = DraftSettings(num_speculative_tokens=3, adaptive=False)
    settings = SamplingSettings(seed=5, max_new_tokens=24)
    seq = Sequence(prompt, settings)
    steps = list(decode_steps(Markov(uniform), [seq], NgramDrafter(fixed), fixed))
    rounds = list(speculative_loop(Markov(uniform), NgramDrafter(fixed), prompt, Sampler(settings), 24, control_for(fixed)))
    assert [[e.token for e in s] for s in steps] == rounds and len(seq.tokens) == 24
    assert seq.speculation.drafts > 0 and 0 < seq.speculation.accepted < seq.speculation.drafted  # both paths ran


# ---------------------------------------------------------------- a batch, a step at a time (the serving runner's)


def test_a_step_ends_cancelled_rows_first_and_runs_for_the_others():
    """`step` on a `Batch` from `start`: rows cancelled between steps end first, without a token; `ran`
    hears the rows the model step runs for; with none left, no model step runs."""
    backend = ArgmaxMarkov(cycle(10, 11, 12))
    seqs = [Sequence([10], GREEDY), Sequence([11, 12], GREEDY), Sequence([12], GREEDY)]
    batch, events = start(backend, seqs)
    assert events == [Event(0, 11, None), Event(1, 10, None), Event(2, 10, None)] and batch.mask.shape == (3, 2)
    ran: list[int] = []
    assert step_batch(backend, batch, ran.append) == [Event(0, 12, None), Event(1, 11, None), Event(2, 11, None)]
    seqs[1].cancel(Finish.stop)
    assert step_batch(backend, batch, ran.append) == [Event(1, None, Finish.stop), Event(0, 10, None), Event(2, 12, None)]
    assert ran == [3, 2] and batch.mask.shape == (3, 4) and backend.greedy_steps == 3  # greedy: the backend's argmax
    seqs[0].cancel()
    seqs[2].cancel()
    assert step_batch(backend, batch, ran.append) == [Event(0, None, Finish.cancelled), Event(2, None, Finish.cancelled)]
    assert ran == [3, 2] and batch.mask.shape == (3, 4) and len(backend.fed) == 3
    assert [s.tokens for s in seqs] == [[11, 12, 10], [10, 11], [10, 11, 12]]


class Positioned(Markov):
    """A Markov backend that checks each step's position ids against numerics.positions of its mask."""

    def step(self, ids, mask, pos, past):
        assert pos.dtype == np.int64 and pos.tolist() == positions(mask, ids.shape[1]).tolist()
        return super().step(ids, mask, pos, past)


def test_a_batchs_position_ids_are_its_masks():
    """`step` counts each row's positions on (one more a step) rather than summing the mask again: the
    same ids as numerics.positions, left-padded rows and rows that ended included."""
    backend = Positioned(cycle(10, 11, 12))
    seqs = [Sequence([10] * 5, GREEDY, max_tokens=6), Sequence([11], GREEDY, max_tokens=2), Sequence([12, 10], GREEDY)]
    steps = list(decode_steps(backend, seqs))
    assert len(steps) == len(backend.fed) == 8 and [len(s.tokens) for s in seqs] == [6, 2, 8]


def test_step_rows_runs_a_prompt_once_for_each_of_its_rows():
    """A prefill of distinct prompts (U rows) told to every row that has one (`index`): each row samples
    its first token from its prompt's logits with its own sampler, as that row alone."""
    dist = {t: {100: 0.5, 101: 0.5} for t in (5, 6)}
    seqs = [Sequence([5], SamplingSettings(seed=i, max_new_tokens=3)) for i in range(4)] + [Sequence([6], GREEDY)]
    ids, mask, pos = np.array([[5], [6]]), np.ones((2, 1), dtype=np.int64), np.zeros((2, 1), dtype=np.int64)
    nxt, _, events = step_rows(Markov(dist), seqs, ids, mask, pos, None, np.array([0, 0, 0, 0, 1]))
    alone = [next(decode(Markov(dist), [Sequence(s.prompt_ids, s.settings)])).token for s in seqs]
    assert [e.token for e in events] == nxt.tolist() == alone and len(set(alone[:4])) == 2
    backend = ArgmaxMarkov(cycle(5, 6, 7))  # every row greedy: the backend's argmax of each prompt, told to its rows
    nxt, _, events = step_rows(backend, [Sequence([p], GREEDY) for p in (6, 5, 6)], ids, mask, pos, None,
                               np.array([1, 0, 1]))
    assert nxt.tolist() == [e.token for e in events] == [7, 6, 7] and backend.greedy_steps == 1


# ---------------------------------------------------------------- logits processors and stop token ids


def test_a_stop_token_id_ends_the_row_as_stop_without_the_token():
    backend = Markov(cycle(10, 11, 12, 13))
    seq = Sequence([10], replace(GREEDY, stop_token_ids=(12, 99)))
    events = list(decode(backend, [seq]))
    assert events == [Event(0, 11, None), Event(0, None, Finish.stop)] and seq.tokens == [11]
    assert len(backend.fed) == 2  # no step after it
    fixed = DraftSettings(num_speculative_tokens=4, adaptive=False)  # inside a round of drafted tokens too
    spec = Sequence([10, 11, 12, 13, 10], replace(GREEDY, stop_token_ids=(13,)))
    list(decode(Markov(cycle(10, 11, 12, 13)), [spec], NgramDrafter(fixed), fixed))
    assert spec.tokens == [11, 12] and spec.finish is Finish.stop


def test_min_tokens_masks_end_of_text_and_stop_ids_until_reached():
    """Greedy: end of text (0.9) and token 7 (a stop id) are masked until 3 tokens; the backend's
    argmax is not taken (it would end the row at once)."""
    chain = {t: {EOT_ID: 0.6, 7: 0.3, 6: 0.1} for t in (5, 6, 7)}
    backend = ArgmaxMarkov(chain)
    seq = Sequence([5], replace(GREEDY, min_tokens=3, stop_token_ids=(7,)))
    list(decode(backend, [seq]))
    assert seq.tokens == [6, 6, 6] and seq.finish is Finish.eos and backend.greedy_steps == 0
    plain = ArgmaxMarkov(chain)
    seq = Sequence([5], replace(GREEDY, stop_token_ids=(7,)))
    list(decode(plain, [seq]))
    assert seq.tokens == [] and seq.finish is Finish.eos and plain.greedy_steps == 1  # the fast path, unchanged


def test_penalties_read_each_rows_own_history_in_a_shared_sampler_batch():
    """Greedy with the CTRL repetition penalty 1.5 over a chain where every token is followed by 100
    (0.4), 101 (0.35) or 102 (0.25). By hand (logits log p, negative: multiplied by 1.5 once seen):
    prompt [100]: 101 (-1.050 beats -1.374), then 100 (-1.374 beats -1.386 and -1.575), then 100;
    prompt [5]: 100, then 101 (-1.050), then 100 (-1.374 beats -1.386), then 100. Presence 2 (generated
    tokens only): 100, 101, 102, then 100 for ever (every one seen once: the same penalty for all)."""
    chain = {t: {100: 0.4, 101: 0.35, 102: 0.25} for t in (5, 100, 101, 102)}
    settings = replace(GREEDY, max_new_tokens=4, repetition_penalty=1.5)
    shared = Sampler(settings)
    seqs = [Sequence([100], settings, sampler=shared), Sequence([5], settings, sampler=shared)]
    list(decode(ArgmaxMarkov(chain), seqs))
    assert [s.tokens for s in seqs] == [[101, 100, 100, 100], [100, 101, 100, 100]]
    presence = replace(GREEDY, max_new_tokens=6, presence_penalty=2.0)
    seqs = [Sequence([100], presence), Sequence([5, 101], presence)]  # the prompts' tokens do not count
    list(decode(Markov(chain), seqs))
    assert [s.tokens for s in seqs] == [[100, 101, 102, 100, 100, 100]] * 2
    frequency = replace(GREEDY, max_new_tokens=6, frequency_penalty=2.0)
    seqs = [Sequence([100], frequency)]
    list(decode(Markov(chain), seqs))
    assert seqs[0].tokens == [100, 101, 102, 100, 101, 102]


def test_sampled_rows_draw_from_the_processed_distribution():
    """A logit bias of -100 on the likeliest token and min-p 0.7: of the rest, only tokens at least 0.7
    times as likely as the most likely (0.2) stay: 101 and 102, drawn 0.2 : 0.18 over 1000 steps."""
    dist = {100: 0.5, 101: 0.2, 102: 0.18, 103: 0.12}
    settings = SamplingSettings(max_new_tokens=1000, seed=3, logit_bias={100: -100.0}, min_p=0.7)
    seq = Sequence([5], settings)
    list(decode(Markov(dict.fromkeys((5, 100, 101, 102, 103), dist), n_positions=1001), [seq]))
    counts = np.bincount(seq.tokens, minlength=104)[100:]
    assert counts[0] == 0 and counts[3] == 0 and counts.sum() == 1000  # banned; below 0.7 x 0.2
    assert abs(counts[1] / 1000 - 0.2 / 0.38) < 0.06  # 0.526, within about 4 standard deviations (0.016 each)


def test_rows_with_samplers_of_their_own_sample_together_as_each_alone():
    """16 rows with samplers of their own and mixed settings (temperatures, top-k with ties, top-p,
    min-p, greedy, penalties, a bias, min_tokens) sampled in one sample_rows call per step give
    exactly the tokens each row's Sampler gives called alone on its row, over several steps of random
    logits (rounded, so that top-k meets ties); one row finishes early and stops drawing."""
    S = SamplingSettings
    settings = [
        S(seed=1, top_p=0.9), S(seed=2, top_p=0.5), S(seed=3, temperature=0.7, top_p=0.9),
        S(seed=4, temperature=1.3, top_p=0.95), S(seed=5, top_k=5), S(seed=6, top_k=50),
        S(seed=7, top_k=V + 3), S(seed=8, temperature=0.5), S(seed=9), S(seed=10, min_p=0.05, top_k=40),
        S(seed=11, repetition_penalty=1.3, top_p=0.9), replace(GREEDY, seed=12),
        replace(GREEDY, presence_penalty=0.5), S(seed=13, logit_bias={7: 5.0}, min_tokens=3, top_p=0.8),
        S(seed=14, top_p=0.9, max_new_tokens=2), S(seed=15, temperature=0.9, top_k=20, top_p=0.7),
    ]
    settings = [replace(s, ignore_eos=True, max_new_tokens=s.max_new_tokens if s.seed == 14 else 64) for s in settings]
    prompts = [[3 + i, 7, 7 + i] for i in range(len(settings))]
    seqs = [Sequence(p, s) for p, s in zip(prompts, settings)]
    refs = [Sampler(s) for s in settings]
    want: list[list[int]] = [[] for _ in settings]
    rng = np.random.default_rng(0)
    for step in range(6):
        logits = np.round(rng.standard_normal((len(seqs), V)) * 3, 1).astype(np.float32)
        logits[:, 7] += 4.0  # a token the penalties and the bias move near the top
        for i, (seq, ref) in enumerate(zip(seqs, refs)):
            if seq.finish is None:
                want[i].append(int(ref(logits[i : i + 1], [History(prompts[i], list(want[i]), i)])[0]))
        sample_rows(seqs, logits)
        assert [s.tokens for s in seqs] == want, step
    assert seqs[14].finish is Finish.length and len(seqs[14].tokens) == 2
    assert len({tuple(t) for t in want}) == len(want)  # the rows differ: each drew its own
    # their generators moved as they would alone: the next uniform is the same
    assert [s.sampler.rng.random() for s in seqs] == [r.rng.random() for r in refs]
