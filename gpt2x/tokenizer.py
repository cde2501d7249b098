"""GPT-2's byte-pair encoding, built offline with tiktoken from the BPE files shipped in the package.

`<|endoftext|>` written in user text is encoded as the special token 50256 (the document separator),
as transformers' GPT-2 tokenizer does; everything else is ordinary text.
"""

from __future__ import annotations

import codecs
import hashlib
from functools import lru_cache
from importlib import resources

import tiktoken
from tiktoken.load import data_gym_to_mergeable_bpe_ranks

from .errors import Gpt2xError

EOT_TOKEN = "<|endoftext|>"
EOT_ID = 50256
VOCAB_SIZE = 50257
# tiktoken's regular expression for the gpt2 encoding.
GPT2_PATTERN = r"""'(?:[sdmt]|ll|ve|re)| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
# The official files, byte-identical to the ones tiktoken's gpt2 encoding downloads.
BPE_SHA256 = {
    "encoder.json": "196139668be63f3b5d6574427317ae82f612a97c5d1cdaf36ed2256dbf636783",
    "vocab.bpe": "1ce1664773c50f3e0cc8842619a93edc4624525b728b188a9e0be33b7726adc5",
}


def bpe_file(name: str):
    return resources.files("gpt2x") / "data" / "bpe" / name


def verified_bpe_file(name: str):
    """The shipped BPE file `name` once its sha256 is checked; a changed file is a one-line error."""
    path = bpe_file(name)
    want = BPE_SHA256[name]
    got = hashlib.sha256(path.read_bytes()).hexdigest()
    if got != want:
        raise Gpt2xError(f"tokenizer file {path} is corrupt (sha256 {got[:12]}..., expected {want[:12]}...); reinstall gpt2x")
    return path


@lru_cache(maxsize=1)
def get_encoding() -> tiktoken.Encoding:
    paths = {name: str(verified_bpe_file(name)) for name in BPE_SHA256}
    ranks = data_gym_to_mergeable_bpe_ranks(vocab_bpe_file=paths["vocab.bpe"], encoder_json_file=paths["encoder.json"])
    return tiktoken.Encoding(
        name="gpt2-gpt2x", pat_str=GPT2_PATTERN, mergeable_ranks=ranks, special_tokens={EOT_TOKEN: EOT_ID}
    )


def encode(text: str) -> list[int]:
    return get_encoding().encode(text, allowed_special={EOT_TOKEN})


def decode(ids: list[int]) -> str:
    return get_encoding().decode(list(ids))


class StreamDecoder:
    """Turns tokens into text one at a time without splitting multi-byte UTF-8 characters."""

    def __init__(self) -> None:
        self._enc = get_encoding()
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def push(self, token: int) -> str:
        return self._utf8.decode(self._enc.decode_single_token_bytes(token))

    def flush(self) -> str:
        return self._utf8.decode(b"", final=True)
