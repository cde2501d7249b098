"""GPT-2's byte-pair encoding, built offline with tiktoken from the BPE files shipped in the package.
`<|endoftext|>` in user text is the special token 50256, as in transformers' GPT-2 tokenizer."""

from __future__ import annotations

import codecs
import hashlib
import json
import threading
from functools import lru_cache
from importlib import resources
from pathlib import Path

import tiktoken

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


def _byte_of_char() -> dict[str, int]:
    """GPT-2's encoder.json spells each byte as a printable character: the printable Latin-1 bytes as
    themselves, the other 68 as chr(256 + n) in byte order (GPT-2's bytes_to_unicode)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    others = [b for b in range(256) if b not in printable]
    return {chr(b): b for b in printable} | {chr(256 + n): b for n, b in enumerate(others)}


def mergeable_ranks() -> dict[bytes, int]:
    """Every ordinary token's bytes and rank, from encoder.json: tiktoken's ranks from vocab.bpe (tested equal) in a
    seventh of the time, which every process start pays. Both files' sha256 are checked, so they agree."""
    verified_bpe_file("vocab.bpe")
    encoder = json.loads(verified_bpe_file("encoder.json").read_text(encoding="utf-8"))
    to_latin1 = str.maketrans({c: chr(b) for c, b in _byte_of_char().items()})
    return {token.translate(to_latin1).encode("latin-1"): i for token, i in encoder.items() if token != EOT_TOKEN}


def folder_vocabulary_differs(folder: Path) -> str | None:
    """Why a folder's vocab.json and merges.txt are not GPT-2's; None when they are, or are absent."""
    folder = Path(folder)
    vocab, merges = folder / "vocab.json", folder / "merges.txt"
    if vocab.is_file():
        try:
            theirs = json.loads(vocab.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
            return f"its vocab.json cannot be read ({e})"
        if theirs != json.loads(verified_bpe_file("encoder.json").read_text(encoding="utf-8")):
            return "its vocab.json is not GPT-2's vocabulary"
    if merges.is_file():
        def rules(text: str) -> list[str]:
            return [ln for ln in text.splitlines() if ln and not ln.startswith("#version")]
        try:
            theirs = rules(merges.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError) as e:
            return f"its merges.txt cannot be read ({e})"
        if theirs != rules(verified_bpe_file("vocab.bpe").read_text(encoding="utf-8")):
            return "its merges.txt is not GPT-2's merges"
    return None


_building = threading.Lock()


def get_encoding() -> tiktoken.Encoding:
    with _building:  # built once, also while load_in_background's thread builds it
        return _encoding()


@lru_cache(maxsize=1)
def _encoding() -> tiktoken.Encoding:
    ranks = mergeable_ranks()
    return tiktoken.Encoding(
        name="gpt2-gpt2x", pat_str=GPT2_PATTERN, mergeable_ranks=ranks, special_tokens={EOT_TOKEN: EOT_ID}
    )


def load_in_background() -> None:
    """The encoding built on a daemon thread while the caller opens its backend (ONNX Runtime's session creation
    releases the GIL), so that the first encode finds it: 90-120 ms of a fresh process's first token."""
    threading.Thread(target=_build_quietly, name="gpt2x-tokenizer", daemon=True).start()


def _build_quietly() -> None:
    try:
        get_encoding()
    except Gpt2xError:
        pass  # a corrupt file: the caller's own first encode raises it, as one line (a thread's error is a traceback)


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
