"""llama.cpp's DRY repetition sampler (processors.Dry): hand-computed penalties on short histories (the allowed
length's boundary, the base's exponent, the longest of several earlier matches, overlapping matches, sequence
breakers of one and two tokens cutting a match, the penalty_last_n window, the exponent's cap), a batch with per-row
parameters, the penalties kept across steps checked against a brute force of the rule (with histories that roll
back, as speculative decoding's), bad values refused, and greedy generation on the bundled model: DRY stops its loops,
and speculative decoding gives what plain decoding gives.

Every expected score is written here, worked out by hand from the rule: a token t that would extend the longest
suffix of the context that occurred earlier followed by t, of n >= allowed_length tokens, loses
multiplier * base ** (n - allowed_length)."""

from __future__ import annotations

import math

import numpy as np
import pytest

from gpt2x.cli.generate import dry_breakers
from gpt2x.errors import UsageError
from gpt2x.generation.generate import generate
from gpt2x.generation.processors import (
    BadWords,
    Dry,
    History,
    NoRepeatNGram,
    Temperature,
    TopK,
    beam_refused_fields,
    dry_breaker_sequences,
    processors_for,
)
from gpt2x.generation.settings import SamplingSettings
from gpt2x.generation.speculative import DraftSettings, NgramDrafter
from gpt2x.tokenizer import decode, encode

WIDTH = 300  # past every id used here (GPT-2's ":" is 25, "\n" 198)
COLON, NEWLINE = 25, 198
A, B, C, D, E = 32, 33, 34, 35, 36  # GPT-2's "A" .. "E": none holds a breaker


def penalised(history, multiplier=1.0, base=2.0, allowed=2, last_n=-1, breakers=(), prompt=0) -> dict[int, float]:
    """The scores Dry leaves on a row of zeros after `history` (its first `prompt` ids the prompt): {token: score}
    for the tokens it moved."""
    h = History(list(history[:prompt]), list(history[prompt:]), "row")
    row = Dry(multiplier, base, allowed, last_n, breakers)(np.zeros((1, WIDTH)), [h])[0]
    return {int(t): float(row[t]) for t in np.flatnonzero(row)}


def test_the_gpt2_tokens_the_hand_cases_use():
    assert decode([COLON]) == ":" and decode([NEWLINE]) == "\n" and decode([A, B, C, D, E]) == "ABCDE"
    assert encode("\n\n") == [628]


def test_the_allowed_length_boundary_and_the_base_exponent():
    """1 2 3 4 9 1 2: the suffix `1 2` occurred once before (ending at the second token), followed by 3: n = 2, so 3
    loses 1 * 2 ** 0 with allowed length 2 and nothing with 3. One token on, `1 2 3` (n = 3) was followed by 4:
    2 ** 1 = 2 with allowed length 2, 2 ** 0 = 1 with 3, nothing with 4; multiplier 0.5 and base 3 with allowed
    length 1: 0.5 * 3 ** 2 = 4.5. The prompt counts as the output does (llama-server feeds it to the sampler)."""
    assert penalised([1, 2, 3, 4, 9, 1, 2]) == {3: -1.0}
    assert penalised([1, 2, 3, 4, 9, 1, 2], allowed=3) == {}
    assert penalised([1, 2, 3, 4, 9, 1, 2, 3]) == {4: -2.0}
    assert penalised([1, 2, 3, 4, 9, 1, 2, 3], allowed=3) == {4: -1.0}
    assert penalised([1, 2, 3, 4, 9, 1, 2, 3], allowed=4) == {}
    assert penalised([1, 2, 3, 4, 9, 1, 2, 3], multiplier=0.5, base=3.0, allowed=1) == {4: -4.5}
    assert penalised([1, 2, 3, 4, 9, 1, 2, 3], multiplier=0.5, base=3.0, allowed=1, prompt=4) == {4: -4.5}


def test_the_longest_earlier_match_wins_and_matches_may_overlap():
    """7 1 2 5 3 1 2 6 0 7 1 2: `7 1 2` occurred followed by 5 (n = 3: 2 ** 1), `1 2` followed by 6 (n = 2: 2 ** 0).
    3 1 2 9 0 1 2 9 5 3 1 2: 9 follows both a match of 3 and one of 2: the longest counts, once (2, not 1, not 3).
    4 4 4 4: the first three 4s repeat the last three (overlapping them), followed by 4: n = 3; after 4 4 4, n = 2."""
    assert penalised([7, 1, 2, 5, 3, 1, 2, 6, 0, 7, 1, 2]) == {5: -2.0, 6: -1.0}
    assert penalised([3, 1, 2, 9, 0, 1, 2, 9, 5, 3, 1, 2]) == {9: -2.0}
    assert penalised([4, 4, 4, 4]) == {4: -2.0}
    assert penalised([4, 4, 4]) == {4: -1.0}
    assert penalised([4, 4]) == {}


def test_a_sequence_breaker_cuts_a_match_and_is_never_penalised():
    """1 : 2 3 4 0 1 : 2 3: `1 : 2 3` (n = 4) was followed by 4: 2 ** 2 = 4 without breakers; with ":" a breaker the
    match stops after it (2 tokens: 2 ** 0 = 1). 2 3 : 9 2 3: `2 3` was followed by ":", which loses 1 without
    breakers and nothing when it is one (a token holding a breaker is never penalised)."""
    history = [1, COLON, 2, 3, 4, 0, 1, COLON, 2, 3]
    assert penalised(history) == {4: -4.0}
    assert penalised(history, breakers=(":",)) == {4: -1.0}
    assert penalised(history, breakers=("\n", ":", '"', "*")) == {4: -1.0}  # llama-server's default
    assert penalised([2, 3, COLON, 9, 2, 3]) == {COLON: -1.0}
    assert penalised([2, 3, COLON, 9, 2, 3], breakers=(":",)) == {}


def test_a_breaker_of_two_tokens_as_llama_cpp_makes_it():
    """"\\n\\n" is one token (628), which holds it; "\\n" (198) ends with its first byte, so 198 198 is the breaker too
    (llama.cpp's sequences: a token ending with a proper prefix, then the rest's tokens). One newline alone breaks
    nothing for it: A B \\n C D E A B \\n C D keeps its match of 5 (2 ** 3 = 8) where the breaker "\\n" leaves 2 (1);
    A B \\n \\n C D E A B \\n \\n C D: the match of 6 (2 ** 4) stops after the second pair (2: 1). A newline that is not
    a breaker by itself is penalised as any token (A B \\n C A B: 1), one that is is not."""
    seqs = dry_breaker_sequences("\n\n")
    assert (628, ()) in seqs and (NEWLINE, (NEWLINE,)) in seqs
    assert (COLON, ()) in dry_breaker_sequences(":") and all(not tail for _, tail in dry_breaker_sequences(":"))
    one = [A, B, NEWLINE, C, D, E, A, B, NEWLINE, C, D]
    assert penalised(one) == {E: -8.0} and penalised(one, breakers=("\n\n",)) == {E: -8.0}
    assert penalised(one, breakers=("\n",)) == {E: -1.0}
    two = [A, B, NEWLINE, NEWLINE, C, D, E, A, B, NEWLINE, NEWLINE, C, D]
    assert penalised(two) == {E: -16.0} and penalised(two, breakers=("\n\n",)) == {E: -1.0}
    assert penalised([A, B, NEWLINE, C, A, B], breakers=("\n\n",)) == {NEWLINE: -1.0}
    assert penalised([A, B, NEWLINE, C, A, B], breakers=("\n",)) == {}


def test_breaker_sequences_are_llama_cpps_read_literally():
    """get_overlapping_token_sequences, its loop transcribed: for each token's text, if it holds the breaker, the token
    alone; else at each position where the breaker's first byte is and the text from there on begins the breaker, the
    token followed by the rest's tokens. A breaker of several characters, one with a two-byte character (its first
    byte ends some tokens: the rest's tokens start with a lone byte's), one cut at 40 bytes."""
    from gpt2x.tokenizer import VOCAB_SIZE, get_encoding

    enc = get_encoding()

    def tokens_of(rest: bytes) -> list[int]:
        """The rest's tokens: a lone byte at either end (a character cut) its one-byte token, the text between BPE's."""
        first = [enc.encode_single_token(rest[:1])] if 0x80 <= rest[0] < 0xC0 else []
        last = [enc.encode_single_token(rest[-1:])] if rest[-1] >= 0xC0 else []
        return first + enc.encode_ordinary(rest[len(first) : len(rest) - len(last)].decode()) + last

    words = [enc.decode_single_token_bytes(t) for t in range(VOCAB_SIZE)]
    for breaker in ("ing", "é:", "x" * 39 + "é"):
        want = set()
        b = breaker.encode()[:40]
        for t, word in enumerate(words):
            if b in word:
                want.add((t, ()))
                continue
            for pos in range(len(word)):
                if word[pos] == b[0] and b.startswith(word[pos:]):
                    want.add((t, tuple(tokens_of(b[len(word) - pos :])[:20])))
        assert set(dry_breaker_sequences(breaker)) == want, breaker


def test_only_the_last_penalty_last_n_tokens_are_scanned():
    """1 2 3 9 8 7 1 2 3: `1 2 3` was followed by 9 (n = 3: 2). The last 8 tokens begin at the first 2: the match
    is `2 3` (1); the last 7 begin at the first 3: a match of 1, under the allowed length."""
    history = [1, 2, 3, 9, 8, 7, 1, 2, 3]
    assert penalised(history) == {9: -2.0}
    assert penalised(history, last_n=9) == penalised(history, last_n=100) == {9: -2.0}
    assert penalised(history, last_n=8) == {9: -1.0}
    assert penalised(history, last_n=7) == {}


def test_the_exponent_is_capped_below_float32s_largest_value():
    """llama.cpp's max_exponent: floor(88.7228391 / ln base), 80 for base 3 (88.72 / 1.0986 = 80.76). Ninety 4s: the
    next 4 extends a match of 89, exponent 87, capped at 80."""
    assert penalised([4] * 90, base=3.0) == {4: -(3.0**80)}
    assert penalised([4] * 40, base=3.0) == {4: -(3.0**37)}  # under the cap: 39 - 2


def test_a_batch_with_per_row_parameters_gives_each_row_what_it_gives_alone():
    """for_rows: each row with its own multiplier, base, allowed length, window and breakers (one row without DRY),
    each given what it gives alone, which is the hand-computed value above."""
    rows = [History([1, 2, 3, 4, 9, 1, 2], [3], "a"), History([7, 7, 7], [], "b"),
            History([1, 2, 3, 9, 8, 7], [1, 2, 3], "c"), History([1, COLON, 2, 3, 4, 0, 1, COLON, 2, 3], [], "d"),
            History([4, 4, 4, 4], [], "e")]
    procs = [Dry(0.5, 3.0, 1, -1, ()), None, Dry(1.0, 2.0, 2, 8, ()), Dry(1.0, 2.0, 2, -1, (":",)), Dry(2.0, 1.0, 2, -1)]
    want = [{4: -4.5}, {}, {9: -1.0}, {4: -1.0}, {4: -2.0}]
    scores = Dry.for_rows(procs)(np.zeros((len(rows), WIDTH)), rows)
    for i, (own, h) in enumerate(zip(procs, rows)):
        got = {int(t): float(scores[i, t]) for t in np.flatnonzero(scores[i])}
        assert got == want[i], i
        if own is not None:
            alone = Dry(own.multiplier, own.base, own.allowed_length, own.penalty_last_n, own.breakers)
            np.testing.assert_array_equal(scores[i], alone(np.zeros((1, WIDTH)), [h])[0])


def brute_force(ids: list[int], multiplier: float, base: float, allowed: int, last_n: int, breaker: int | None,
                width: int) -> np.ndarray:
    """The rule read literally, O(n^2): every earlier position's match with the window's end, cut at the last breaker."""
    window = ids if last_n < 0 else ids[max(0, len(ids) - last_n) :]
    limit = len(window)
    if breaker is not None and breaker in window:
        limit = len(window) - 1 - max(i for i, t in enumerate(window) if t == breaker)
    longest: dict[int, int] = {}
    for j in range(len(window) - 1):
        n = 0
        while n <= j and window[j - n] == window[-1 - n]:
            n += 1
        n = min(n, limit)
        if n >= allowed and window[j + 1] != breaker:
            longest[window[j + 1]] = max(longest.get(window[j + 1], 0), n)
    out = np.zeros(width)
    for t, n in longest.items():
        out[t] -= multiplier * base ** (n - allowed)
    return out


def test_the_matches_kept_across_steps_are_the_rule_read_literally():
    """Random histories over three tokens (long repeats), called step by step on one row as the decode loop does,
    with drafted positions that roll back (speculative decoding), long new rows (the matches computed at once) and
    the window: each step's scores are the brute force's."""
    rng = np.random.default_rng(0)
    for allowed, last_n, breakers, breaker in ((2, -1, (), None), (1, 12, (), None), (3, -1, (":",), COLON)):
        alphabet = [5, 6, 7] + ([COLON] if breaker else [])
        proc = Dry(0.5, 1.75, allowed, last_n, breakers)
        ids = [int(t) for t in rng.choice(alphabet, 60)]  # more than the kept lengths: computed at once
        for _ in range(150):
            if rng.random() < 0.25:  # a rejected draft: back a few tokens
                del ids[len(ids) - int(rng.integers(1, 6)) :]
            ids.append(int(rng.choice(alphabet, p=[0.4, 0.3, 0.2, 0.1] if breaker else [0.5, 0.3, 0.2])))
            got = proc(np.zeros((1, WIDTH)), [History(ids[:10], ids[10:], "row")])[0]
            np.testing.assert_allclose(got, brute_force(ids, 0.5, 1.75, allowed, last_n, breaker, WIDTH))


@pytest.mark.parametrize("kw,option", [
    (dict(dry_multiplier=-0.1), "dry_multiplier"), (dict(dry_multiplier=math.nan), "dry_multiplier"),
    (dict(dry_multiplier=math.inf), "dry_multiplier"), (dict(dry_base=0.9), "dry_base"),
    (dict(dry_base=math.inf), "dry_base"), (dict(dry_allowed_length=0), "dry_allowed_length"),
    (dict(dry_allowed_length=1.5), "dry_allowed_length"), (dict(dry_penalty_last_n=-2), "dry_penalty_last_n"),
    (dict(dry_sequence_breakers="\n"), "dry_sequence_breakers"), (dict(dry_sequence_breakers=["\n", ""]), "dry_sequence_breakers"),
    (dict(dry_sequence_breakers=[3]), "dry_sequence_breakers"), (dict(dry_sequence_breakers=None), "dry_sequence_breakers"),
    (dict(num_beams=2, dry_multiplier=0.8), "num_beams"),
])
def test_bad_values_are_refused_naming_the_field(kw, option):
    with pytest.raises(UsageError) as e:
        SamplingSettings(**kw)
    assert e.value.option == option and str(e.value).startswith(option)


def test_where_dry_runs():
    """Off at multiplier 0 and at penalty_last_n 0; greedy decoding applies it (it moves logits), after the bans and
    before temperature and the truncations; beam search refuses it; breakers kept as a tuple."""
    assert processors_for(SamplingSettings(dry_base=3.0, dry_allowed_length=5)) == []
    assert processors_for(SamplingSettings(dry_multiplier=0.8, dry_penalty_last_n=0)) == []
    assert [type(p) for p in processors_for(SamplingSettings(greedy=True, dry_multiplier=0.8))] == [Dry]
    kinds = [type(p) for p in processors_for(SamplingSettings(temperature=0.7, top_k=5, dry_multiplier=0.8,
                                                              no_repeat_ngram_size=3, bad_words=("thee",)))]
    assert kinds == [NoRepeatNGram, BadWords, Dry, Temperature, TopK]
    s = SamplingSettings(dry_multiplier=0.8, dry_sequence_breakers=["\n"])
    assert s.dry_sequence_breakers == ("\n",) and hash(s) == hash(SamplingSettings(dry_multiplier=0.8, dry_sequence_breakers=("\n",)))
    assert beam_refused_fields(SamplingSettings(dry_multiplier=0.8, dry_base=2.0)) == ["dry_multiplier", "dry_base"]
    assert SamplingSettings().dry_sequence_breakers == ("\n", ":", '"', "*")


def test_the_cli_breakers_as_llama_cpp_reads_them():
    """--dry-sequence-breaker: the default without one; the ones given replace it; `none` clears."""
    assert dry_breakers(None) == ("\n", ":", '"', "*")
    assert dry_breakers([";", "\n"]) == (";", "\n")
    assert dry_breakers(["none"]) == () and dry_breakers(["none", "x"]) == ("x",)


def longest_repeat(ids: list[int]) -> int:
    """The length of the longest n-gram that occurs twice (overlaps included)."""
    best = 0
    for n in range(1, len(ids)):
        grams = [tuple(ids[i : i + n]) for i in range(len(ids) - n + 1)]
        if len(set(grams)) == len(grams):
            break
        best = n
    return best


def test_greedy_dry_stops_the_loops_plain_greedy_falls_into(reference):
    """Greedy from "ROMEO:" loops (a line of many tokens comes back again and again); with a strong DRY and no
    breakers no n-gram of more than allowed_length + 1 tokens occurs twice in the prompt and output. With an n-gram
    drafter (whose drafts DRY rejects, rolling its matches back), speculative decoding gives the same tokens."""
    plain = generate(reference, ["ROMEO:"], SamplingSettings(max_new_tokens=64, greedy=True))[0]
    assert longest_repeat(plain.prompt_tokens + plain.tokens) >= 10
    settings = SamplingSettings(max_new_tokens=64, greedy=True, dry_multiplier=3.0, dry_allowed_length=2,
                                dry_sequence_breakers=())
    dry = generate(reference, ["ROMEO:"], settings)[0]
    assert len(dry.tokens) == 64 and longest_repeat(dry.prompt_tokens + dry.tokens) <= 3
    drafted = generate(reference, ["ROMEO:"], settings, draft=NgramDrafter(),
                       draft_settings=DraftSettings(num_speculative_tokens=4, adaptive=False))[0]
    assert drafted.tokens == dry.tokens
    assert drafted.speculation["drafted"] > drafted.speculation["accepted"] > 0
