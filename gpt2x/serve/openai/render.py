"""What a response carries, rendered once: a choice's text as its tokens arrive (`ChoiceText`: UTF-8
kept whole, stop strings), its logprobs in OpenAI's legacy shape (`ChoiceLogprobs`), the usage, and
the response bodies' JSON and server-sent events (`to_json`, `sse`).

Logprobs are the raw model distribution (log_softmax of the logits, before temperature, top-k and
top-p: vLLM's default), so a request scores the same whatever its sampling settings. A token whose
bytes are not UTF-8 on their own is named `bytes:\\xNN...` (OpenAI's form; vLLM writes U+FFFD), so
that no two tokens collide in a `top_logprobs` dict. The end-of-text token that ends a choice is
listed last with no text, as vLLM lists it (lm-eval reads `token_logprobs[ctxlen:-1]`)."""

from __future__ import annotations

import codecs
import functools
import json
import math
from collections.abc import Callable
from dataclasses import dataclass
from enum import Enum
from functools import cache
from typing import ClassVar

from pydantic import BaseModel

from ...generation.logprobs import LogprobEntry
from ...generation.settings import Finish
from ...tokenizer import StreamDecoder, get_encoding
from .protocol import ModelCard, ModelList, PromptLogprob, PromptTokensDetails, Usage


class ChoiceText:
    """The text of one choice as its tokens arrive: decoded without splitting UTF-8 characters, cut
    at the first stop string, and released only once no stop string can still begin in it. With
    `min_tokens` (vLLM's), a stop string is looked for only after the text of the first min_tokens
    tokens: none ends the choice before it has that many. `include_stop` (vLLM's
    include_stop_str_in_output): the stop string found stays at the end of the text."""

    def __init__(self, stop: tuple[str, ...] = (), min_tokens: int = 0, include_stop: bool = False):
        self.stop = stop
        self.min_tokens = min_tokens
        self.include_stop = include_stop
        self._decoder = StreamDecoder()
        self.text = ""  # decoded so far (cut at a stop string once one is found)
        self.sent = 0  # characters of text released
        self.stopped = False  # a stop string was found
        self.tokens = 0  # completion tokens counted for usage
        self.floor = 0  # where a stop string may begin: after the text of the first min_tokens tokens

    def push(self, token: int) -> str:
        """Text that can be released after `token` (nothing once a stop string has ended the text)."""
        if self.stopped:
            return ""
        self.tokens += 1
        self.text += self._decoder.push(token)
        if self.tokens <= self.min_tokens:
            self.floor = len(self.text)
        return self._release(final=False)

    def finish(self) -> str:
        """The rest of the text, once no more tokens come."""
        if self.stopped:
            return ""
        self.text += self._decoder.flush()
        return self._release(final=True)

    def _release(self, final: bool) -> str:
        if self.stop and not self.stopped:
            start = max(self.floor, self.sent - max(len(s) for s in self.stop))
            hits = [(i, len(s)) for s in self.stop if (i := self.text.find(s, start)) >= 0]
            if hits:
                at, length = min(hits)  # the first stop string found (the shortest of those found there)
                self.text = self.text[: at + (length if self.include_stop else 0)]
                self.stopped = True
                final = True
        end = len(self.text)
        if not final and self.stop:
            end -= self._held_back()
        out = self.text[self.sent : end]
        self.sent = max(self.sent, end)
        return out

    def _held_back(self) -> int:
        """The longest end of the text, after `floor`, that a stop string begins with and is longer than: what may
        not be released yet. Found from the text's side (the earliest position whose rest begins a stop string), so
        the cost is bounded by the text, which the context bounds, however long the stop strings are."""
        text, held = self.text, 0
        for s in self.stop:
            p = max(self.floor, len(text) - len(s) + 1)
            while 0 <= (p := text.find(s[0], p)) < len(text) - held:
                if s.startswith(text[p:]):  # the earliest such position holds back the most
                    held = max(held, len(text) - p)
                    break
                p += 1
        return held


@cache
def token_text(token: int) -> str:
    """A token as logprobs list it: its bytes as UTF-8, or `bytes:\\xNN...` (OpenAI's form) where they
    are not UTF-8 on their own (part of a character)."""
    data = get_encoding().decode_single_token_bytes(token)
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        return "bytes:" + "".join(f"\\x{b:02x}" for b in data)


def token_namer(as_ids: bool) -> Callable[[int], str]:
    """How logprobs name a token: its text, or `token_id:ID` (vLLM's return_tokens_as_token_ids)."""
    return _token_id_name if as_ids else token_text


def _token_id_name(token: int) -> str:
    """A token as vLLM's return_tokens_as_token_ids names it."""
    return f"token_id:{token}"


def prompt_logprobs(entries: list[LogprobEntry], ranks: list[int | None], k: int,
                    name: Callable[[int], str] = token_text) -> list[dict[str, PromptLogprob] | None]:
    """A prompt's logprobs in vLLM's shape: per position (the first null) the k most likely tokens and
    the prompt's own token, keyed by id, each with its log-probability, rank (1: the most likely) and text."""
    out: list[dict[str, PromptLogprob] | None] = []
    for (token, logprob, top), rank in zip(entries, ranks):
        if logprob is None:
            out.append(None)
            continue
        best = {str(t): PromptLogprob(logprob=logprob_value(v), rank=r, decoded_token=name(t))
                for r, (t, v) in enumerate((top or [])[:k], start=1)}
        best.setdefault(str(token), PromptLogprob(logprob=logprob_value(logprob), rank=rank, decoded_token=name(token)))
        out.append(best)
    return out


def logprob_value(value: float | None) -> float | None:
    """A log-probability JSON can carry: -inf (a token a backend masks out) as -9999.0, OpenAI's floor."""
    if value is None or math.isnan(value):
        return None
    return max(float(value), -9999.0)


class ChoiceLogprobs:
    """One choice's logprobs in OpenAI's legacy shape, gathered as its tokens arrive; `take()` hands
    over what was gathered since the last take (a stream chunk carries the logprobs of its tokens).
    `lists_end`: the end-of-text or stop token that ends a choice is listed last (vLLM's)."""

    lists_end: ClassVar[bool] = True

    def __init__(self, as_ids: bool = False):
        self.name = _token_id_name if as_ids else token_text  # return_tokens_as_token_ids: `token_id:ID`
        self.tokens: list[str] = []
        self.token_logprobs: list[float | None] = []
        self.top_logprobs: list[dict[str, float] | None] = []
        self.text_offset: list[int] = []
        self.taken = 0

    def add(self, entry: LogprobEntry, offset: int) -> None:
        token, logprob, top = entry
        self.tokens.append(self.name(token))
        self.token_logprobs.append(logprob_value(logprob))
        if top is None:
            self.top_logprobs.append(None)
        else:
            best = {self.name(t): logprob_value(v) for t, v in top}  # most likely first
            best.setdefault(self.name(token), logprob_value(logprob))  # the chosen token, as OpenAI includes it
            self.top_logprobs.append(best)
        self.text_offset.append(offset)

    def add_prompt(self, entries: list[LogprobEntry], start: int = 0) -> None:
        """A prompt's tokens, their offsets counted from `start` in the prompt's text."""
        utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")
        enc = get_encoding()
        offset = start
        for entry in entries:
            self.add(entry, offset)
            offset += len(utf8.decode(enc.decode_single_token_bytes(entry[0])))

    def whole(self) -> dict:
        return {"tokens": self.tokens, "token_logprobs": self.token_logprobs, "top_logprobs": self.top_logprobs,
                "text_offset": self.text_offset}

    def take(self) -> dict:
        n, self.taken = self.taken, len(self.tokens)
        return {"tokens": self.tokens[n:], "token_logprobs": self.token_logprobs[n:],
                "top_logprobs": self.top_logprobs[n:], "text_offset": self.text_offset[n:]}


def finish_reason(reason: Finish, text: ChoiceText) -> str:
    """OpenAI's finish_reason for a row's Finish: "stop" for end of text or a stop string, "length" for
    the budget (and the context, which caps it)."""
    return "stop" if text.stopped or reason in (Finish.eos, Finish.stop) else "length"


def usage(prompt_ids: list[list[int]], texts: list[ChoiceText], cached_tokens: int = 0) -> Usage:
    """Each prompt's tokens once (as vLLM counts them), every choice's completion tokens, and the
    prompt tokens the prefix cache held."""
    prompt = sum(len(p) for p in prompt_ids)
    completion = sum(t.tokens for t in texts)
    return Usage(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion,
                 prompt_tokens_details=PromptTokensDetails(cached_tokens=cached_tokens))


def to_json(body: BaseModel | dict) -> str:
    """A response body as JSON, compact, as its model serialises it (a chunk without usage leaves the key out, as
    OpenAI's does: the models say so); a dict: as it is."""
    if isinstance(body, dict):
        return json.dumps(body, ensure_ascii=False, separators=(",", ":"))
    return body.model_dump_json()


DONE = "[DONE]"  # what a stream's last server-sent event carries


def sse(body: BaseModel | dict | str) -> str:
    """One server-sent event: `data: JSON` (or `data: [DONE]`) and a blank line."""
    return f"data: {body if isinstance(body, str) else to_json(body)}\n\n"


class StreamKind(Enum):
    chunk = "chunk"  # a chunk of the response
    error = "error"  # an error that ends the stream (DONE follows)
    done = "done"  # the last event


@dataclass(frozen=True, slots=True)
class StreamEvent:
    """One event of a streamed response before it is rendered (`render`): a chunk, with the finish
    reasons of the choices it ends; an error that ends the stream; or the last (STREAM_DONE)."""

    body: BaseModel | dict | None
    reasons: tuple[str, ...] = ()
    kind: StreamKind = StreamKind.chunk

    def render(self) -> str:
        return sse(DONE if self.kind is StreamKind.done else self.body)


STREAM_DONE = StreamEvent(None, kind=StreamKind.done)


def model_list(model: str, created: int, max_model_len: int) -> ModelList:
    return ModelList(data=[ModelCard(id=model, created=created, owned_by="gpt2x", max_model_len=max_model_len)])


@functools.cache
def _byte_chars() -> list[str]:
    """GPT-2's byte-level BPE alphabet: the character that stands for each byte in its vocabulary
    (printable bytes as themselves, the others shifted past 255: a space is "Ġ", a newline "Ċ")."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + extra)
            extra += 1
    return [chars[b] for b in range(256)]


def token_str(token: int) -> str:
    """A token as the tokenizer's vocabulary writes it (transformers' convert_ids_to_tokens, vLLM's
    token_strs): " is" is "Ġis"."""
    table = _byte_chars()
    return "".join(table[b] for b in get_encoding().decode_single_token_bytes(token))
