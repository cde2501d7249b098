"""Our offline tiktoken encoding against transformers' GPT2TokenizerFast built from the same files."""

from __future__ import annotations

import threading
import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import GPT2TokenizerFast

from gpt2x import tokenizer
from gpt2x.tokenizer import EOT_ID, StreamDecoder, bpe_file, decode, encode

SAMPLES = [
    "Hello world",
    "ROMEO:\nBut soft, what light through yonder window breaks?",
    "   leading and trailing   ",
    "tabs\tand\nnewlines\r\n\n\nruns",
    "I'm, you're, we've, they'll, he'd, it's, 'tis",
    "3.14159 1,000,000 2026-11-21 0x1F",
    "naïve café résumé — “quotes” ‘single’",
    "日本語のテキスト 中文 한국어",
    "emoji 😀👍🏽 family 👨‍👩‍👧",
    "a<|endoftext|>b",
    "<|endoftext|>",
    "",
    "x" * 300,
    "Ἐν ἀρχῇ ἦν ὁ λόγος",
]


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """transformers' tokenizer from the same two files, under the names its loader expects."""
    folder = tmp_path_factory.mktemp("hf-tokenizer")
    (folder / "vocab.json").write_bytes(bpe_file("encoder.json").read_bytes())
    (folder / "merges.txt").write_bytes(bpe_file("vocab.bpe").read_bytes())
    tok = GPT2TokenizerFast.from_pretrained(folder)
    assert len(tok) == 50257
    return tok


@pytest.mark.parametrize("text", SAMPLES)
def test_encode_matches_transformers(reference, text):
    assert encode(text) == reference(text)["input_ids"]
    assert decode(encode(text)) == text


def test_ranks_read_from_encoder_json_equal_tiktokens_own_derivation_from_the_merges():
    from tiktoken.load import data_gym_to_mergeable_bpe_ranks

    reference = data_gym_to_mergeable_bpe_ranks(vocab_bpe_file=str(bpe_file("vocab.bpe")),
                                                encoder_json_file=str(bpe_file("encoder.json")))
    assert tokenizer.mergeable_ranks() == reference and len(reference) == 50256


def test_known_ids_and_eot():
    assert encode("Hello world") == [15496, 995]  # from the data README
    assert encode("a<|endoftext|>b")[1] == EOT_ID


def test_corrupt_bpe_file_is_refused(monkeypatch, tmp_path):
    bad = tmp_path / "vocab.bpe"
    bad.write_bytes(bpe_file("vocab.bpe").read_bytes() + b"x")
    monkeypatch.setattr(tokenizer, "bpe_file", lambda name: bad if name == "vocab.bpe" else bpe_file(name))
    tokenizer._encoding.cache_clear()
    try:
        with pytest.raises(tokenizer.Gpt2xError, match="corrupt"):
            tokenizer.get_encoding()
    finally:
        tokenizer._encoding.cache_clear()


@settings(max_examples=200, deadline=None)
@given(st.text())
def test_round_trip_any_text(text):
    assert decode(encode(text)) == text


@settings(max_examples=100, deadline=None)
@given(st.text(min_size=1))
def test_stream_decoder_equals_decode(text):
    d = StreamDecoder()
    ids = encode(text)
    assert "".join(d.push(t) for t in ids) + d.flush() == decode(ids)


def test_the_encoding_built_on_a_thread_is_built_once_and_is_the_one_every_caller_gets(monkeypatch):
    """load_in_background (a command's, while its backend opens) and a caller that asks meanwhile: one build, waited for."""
    builds = []
    real = tokenizer.mergeable_ranks

    def slow_ranks():
        builds.append(threading.current_thread().name)
        time.sleep(0.2)  # the caller below asks while the thread builds
        return real()

    monkeypatch.setattr(tokenizer, "mergeable_ranks", slow_ranks)
    tokenizer._encoding.cache_clear()
    try:
        tokenizer.load_in_background()
        time.sleep(0.05)
        enc = tokenizer.get_encoding()
        assert builds == ["gpt2x-tokenizer"] and tokenizer.get_encoding() is enc
        assert enc.encode("Hello world") == [15496, 995]  # transformers' GPT-2 tokenizer's ids
    finally:
        tokenizer._encoding.cache_clear()


def test_a_corrupt_file_found_on_the_thread_is_the_callers_one_line_not_the_threads_traceback(monkeypatch, tmp_path):
    bad = tmp_path / "vocab.bpe"
    bad.write_bytes(bpe_file("vocab.bpe").read_bytes() + b"x")
    monkeypatch.setattr(tokenizer, "bpe_file", lambda name: bad if name == "vocab.bpe" else bpe_file(name))
    seen = []
    monkeypatch.setattr(threading, "excepthook", lambda args: seen.append(args.exc_type))
    tokenizer._encoding.cache_clear()
    try:
        tokenizer.load_in_background()
        with pytest.raises(tokenizer.Gpt2xError, match="corrupt"):
            tokenizer.get_encoding()
        time.sleep(0.1)  # the thread has ended
        assert seen == []
    finally:
        tokenizer._encoding.cache_clear()
