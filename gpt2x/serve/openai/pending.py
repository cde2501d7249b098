"""A request as the engine serves it, whichever endpoint it came from: `ServedRequest` (the pydantic request as sent,
read as it is, and what is computed from it once: its prompts tokenized, each prompt's token budget, its
SamplingSettings), and `Pending`, its rows in the engine and each choice's text as it is released.

The engine's thread hands each row's outputs (core/outputs.py) to the request's asyncio loop (`LoopPost`);
a request whose consumer goes away (client disconnected, stop string found, server stopping) cancels its rows, which
leave the batch before the next decode step. A request's choices are its rows: n per prompt, prompt by prompt (choice
p * n + i is prompt p's i-th, seeded seed + i, as vLLM numbers and seeds them); the rows of one prompt that are
prefilled together are prefilled once (core/runner.py). `usage` counts each prompt's tokens once, as vLLM does, every
choice's completion tokens, and the prompt tokens the prefix cache held (`prompt_tokens_details.cached_tokens`)."""

from __future__ import annotations

import asyncio
import threading
import time
import uuid
import weakref
from collections import deque
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field, replace
from typing import Any

from ...generation.logprobs import LogprobEntry
from ...generation.settings import Finish, SamplingSettings
from ..core.engine import Engine, Row
from ..core.outputs import Finished, Output, PromptLogprobs, TokenOut
from . import render
from .errors import APIError
from .protocol import SamplingRequest, Usage


@dataclass
class ServedRequest:
    """A request as it is served: `params`, the request as sent (a CompletionRequest or a ChatCompletionRequest, read
    as it is), and what is computed from it once: its prompts (text and ids, truncated), each prompt's token budget
    (capped by the context), its SamplingSettings (each choice's own from `settings`), its stop strings as a tuple, and
    the logprobs it lists (`logprobs`: the k most likely per token, None for none; `logprobs_shape`: the endpoint's
    gatherer, render.ChoiceLogprobs' interface)."""

    params: SamplingRequest
    prompts: list[str]  # each prompt's text (as sent; decoded from its ids for ids or a truncated prompt)
    prompt_ids: list[list[int]]
    max_tokens: list[int]
    sampling: SamplingSettings
    model: str
    logprobs_shape: Callable[[], Any]  # a new gatherer of one choice's logprobs
    n: int = 1  # choices per prompt
    stop: tuple[str, ...] = ()
    logprobs: int | None = None
    echo: bool = False  # the prompt first (completions' echo)
    id: str = field(default_factory=lambda: "cmpl-" + uuid.uuid4().hex)
    created: int = field(default_factory=lambda: int(time.time()))

    @property
    def choices(self) -> int:
        """Choices in the response: n per prompt, prompt by prompt (choice p * n + i: prompt p's i-th)."""
        return len(self.prompts) * self.n

    @property
    def beams(self) -> int:
        """use_beam_search: the n best of n beams, one search per prompt (0: sampling)."""
        return self.sampling.num_beams if self.sampling.num_beams > 1 else 0

    @property
    def stream(self) -> bool:
        return bool(self.params.stream)

    @property
    def include_usage(self) -> bool:
        """A last chunk with the usage (stream_options.include_usage)."""
        return bool(self.params.stream_options and self.params.stream_options.include_usage)

    @property
    def continuous_usage(self) -> bool:
        """Every chunk carries the usage so far (stream_options.continuous_usage_stats, with include_usage)."""
        return self.include_usage and bool(self.params.stream_options.continuous_usage_stats)

    def settings(self, budget: int, i: int = 0) -> SamplingSettings:
        """The sampling settings of a prompt's choice i, whose token budget is `budget` (its max_tokens capped by the
        context): the request's seed + i (vLLM's rule for n's seeds)."""
        return replace(self.sampling, max_new_tokens=max(budget, 1), seed=self.sampling.seed + i,
                       min_tokens=min(self.sampling.min_tokens, max(budget, 1)))


@dataclass(frozen=True, slots=True)
class ChoiceEvent:
    """What one choice released (Pending.events): its text since its last event, its finish_reason on its last,
    the logprobs of the tokens gathered since (None without logprobs), and vLLM's extra keys (token_ids,
    prompt_token_ids, prompt_logprobs)."""

    index: int
    text: str
    finish_reason: str | None = None
    logprobs: Any = None  # what the request's logprobs gatherer took (a chat request's in OpenAI's chat shape)
    extra: dict = field(default_factory=dict)


class LoopPost:
    """Calls handed from the engine's thread to one asyncio loop, which runs all those that arrived before it woke in
    one wake-up: `call_soon_threadsafe` wakes the loop (a write to its pipe) at each call, once per row and token, which
    took the engine's thread 36 us a call, 0.6 ms of a 16-row step (scratch). In order; one per loop (`of`)."""

    _by_loop: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
    _made = threading.Lock()

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.loop = loop
        self._calls: deque = deque()
        self._lock = threading.Lock()
        self._woken = False  # a wake-up is on its way: calls posted meanwhile ride on it

    @classmethod
    def of(cls, loop: asyncio.AbstractEventLoop) -> LoopPost:
        with cls._made:
            post = cls._by_loop.get(loop)
            if post is None:
                post = cls._by_loop[loop] = cls(loop)
            return post

    def __call__(self, fn: Callable[..., Any], *args: Any) -> None:
        with self._lock:
            self._calls.append((fn, args))
            if self._woken:
                return
            self._woken = True
        try:
            self.loop.call_soon_threadsafe(self._run)
        except RuntimeError:  # a closed loop: said to the engine as before, and the next call tries again
            with self._lock:
                self._woken = False
            raise

    def _run(self) -> None:
        with self._lock:
            calls, self._calls = self._calls, deque()
            self._woken = False
        for fn, args in calls:
            fn(*args)


class Pending:
    """A request's rows in the engine (one per choice: n per prompt), the queue their tokens arrive on,
    and each choice's text and logprobs."""

    def __init__(self, req: ServedRequest, loop: asyncio.AbstractEventLoop, engine: Engine):
        self.req = req
        self.engine = engine  # a row's error while it stops is a 503, not a 500
        self.queue: asyncio.Queue = asyncio.Queue()
        params = req.params
        self.prompts = [p for p in req.prompts for _ in range(req.n)]  # each choice's prompt text
        self.texts = [render.ChoiceText(req.stop, req.sampling.min_tokens, bool(params.include_stop_str_in_output))
                      for _ in self.prompts]
        self.logprobs = [None if req.logprobs is None else req.logprobs_shape() for _ in self.prompts]
        self.echo_scored = req.echo and req.logprobs is not None  # the echoed prompt's logprobs come from the engine
        self.scored = self.echo_scored or params.prompt_logprobs is not None  # so do vLLM's prompt_logprobs
        # return_token_ids: each choice's ids not yet sent, and whether its prompt's have been
        self._ids: list[list[int]] = [[] for _ in self.prompts]
        self._prompt_sent = [False] * len(self.prompts)
        self._start = [len(p) if req.echo else 0 for p in self.prompts]  # where the completion's text starts
        self.reasons: list[str | None] = [None] * len(self.prompts)  # each choice's finish_reason, once it ended
        self.rows = [row for p in range(len(req.prompt_ids)) for row in self._prompt_rows(p, loop)]
        # the rows the engine runs (a beam search's other rows are told by its first)
        self.queued = [r for r in self.rows if not (req.beams and r.beam_rows is None)]

    def _prompt_rows(self, p: int, loop: asyncio.AbstractEventLoop) -> list[Row]:
        """Prompt p's n rows, each with its own settings; with beam search one search, by its first row."""
        req = self.req
        rows = []
        post = LoopPost.of(loop)
        for i in range(req.n):
            def sink(out: Output, index: int = p * req.n + i) -> None:
                post(self.queue.put_nowait, (index, out))

            budget = req.max_tokens[p]
            row = Row(req.prompt_ids[p], req.settings(budget, i), sink, req.logprobs, self.scored, budget)
            row.prompt_k = req.params.prompt_logprobs
            row.priority = req.params.priority or 0
            rows.append(row)
        if req.beams:  # each of its n rows one hypothesis
            rows[0].beam_rows = rows
        return rows

    def usage(self) -> Usage:
        """The request's usage: its prompts counted once, and the tokens the prefix cache held for each
        (its first choice's row: a prompt's choices are prefilled together)."""
        cached = sum(self.rows[p * self.req.n].cached_tokens for p in range(len(self.req.prompt_ids)))
        return render.usage(self.req.prompt_ids, self.texts, cached)

    def cancel(self) -> None:
        for row in self.rows:
            row.cancel()  # a no-op for finished rows; frees the rows of a request that left early

    def _note(self, index: int, entry: LogprobEntry | None, offset: int) -> None:
        """A token's logprobs, at `offset` in the choice's text."""
        if entry is not None and self.logprobs[index] is not None:
            self.logprobs[index].add(entry, offset)

    def _taken(self, index: int) -> Any:
        lp = self.logprobs[index]
        return None if lp is None else lp.take()

    def _extra(self, index: int) -> dict:
        """return_token_ids: the ids gathered since the choice's last event (`token_ids`), and with its
        first event its prompt's (`prompt_token_ids`)."""
        if not self.req.params.return_token_ids:
            return {}
        extra = {"token_ids": self._ids[index]}
        self._ids[index] = []
        if not self._prompt_sent[index]:
            self._prompt_sent[index] = True
            extra["prompt_token_ids"] = list(self.req.prompt_ids[index // self.req.n])
        return extra

    def _event(self, index: int, text: str, reason: str | None = None) -> ChoiceEvent:
        return ChoiceEvent(index, text, reason, self._taken(index), self._extra(index))

    def _prompt_event(self, index: int, entries: list[LogprobEntry]) -> ChoiceEvent:
        """What a choice's scored prompt releases: the echoed prompt (with echo and logprobs, its
        logprobs gathered) and vLLM's prompt_logprobs (when asked for)."""
        extra = self._extra(index)
        k = self.req.params.prompt_logprobs
        if k is not None:
            name = render.token_namer(bool(self.req.params.return_tokens_as_token_ids))
            extra["prompt_logprobs"] = render.prompt_logprobs(entries, self.rows[index].prompt_ranks or [], k, name)
        if not self.echo_scored:
            return ChoiceEvent(index, "", None, self._taken(index), extra)
        n = self.req.logprobs or 0  # the engine listed max(logprobs, prompt_logprobs) most likely tokens
        self.logprobs[index].add_prompt([(t, lp, None if top is None else top[:n]) for t, lp, top in entries])
        return ChoiceEvent(index, self.prompts[index], None, self._taken(index), extra)

    def _token(self, index: int, out: TokenOut) -> ChoiceEvent:
        """A choice's token: the text it releases (none while a split character or a possible stop string holds it
        back: an event all the same, as vLLM sends a chunk per token, so that a stream's chunks keep the steps'
        pace), and the choice's end where a stop string or its last token ends it."""
        text = self.texts[index]
        offset = self._start[index] + len(text.text)
        delta = text.push(out.token)
        self._ids[index].append(out.token)
        self._note(index, out.logprob, offset)
        if text.stopped:  # a stop string ended it: the row need not run on
            self.rows[index].cancel()
            self.reasons[index] = "stop"
        elif out.finish is not None:  # its last token: the rest of its text (held back) and its end
            delta += text.finish()
            self.reasons[index] = render.finish_reason(out.finish, text)
        return self._event(index, delta, self.reasons[index])

    def _finished(self, index: int, out: Finished) -> ChoiceEvent:
        text = self.texts[index]
        rest = text.finish()
        # the end-of-text or stop token, not kept: listed last where the request's logprobs shape lists it
        lp = self.logprobs[index]
        if out.reason in (Finish.eos, Finish.stop) and lp is not None and lp.lists_end:
            self._note(index, out.logprob, self._start[index] + len(text.text))
        self.reasons[index] = render.finish_reason(out.reason, text)
        return self._event(index, rest, self.reasons[index])

    def _failed(self, out: Output) -> APIError:
        if out.client:  # Failed by the request's own doing (its constraint): the others went on
            return APIError(400, out.message)
        if self.engine.closing:  # Failed: waiting, or cut short by the server's stop
            return APIError(503, out.message, "server_error", code="unavailable")
        return APIError(500, out.message, "server_error")

    async def events(self) -> AsyncIterator[ChoiceEvent]:
        """Each choice's text as it is released; each choice ends with one event carrying its finish_reason.
        With echo the prompt comes first (once scored, with logprobs). Leaving early cancels every row."""
        if self.req.echo and not self.echo_scored:
            for i, prompt in enumerate(self.prompts):
                yield self._event(i, prompt)
        open_rows = len(self.rows)
        try:
            while open_rows:
                index, out = await self.queue.get()
                if self.texts[index].stopped or self.reasons[index] is not None:
                    continue  # already ended (a stop string, or its last token); what the row sent after is dropped
                if isinstance(out, TokenOut):
                    event = self._token(index, out)
                elif isinstance(out, Finished):
                    event = self._finished(index, out)
                elif isinstance(out, PromptLogprobs):
                    event = self._prompt_event(index, out.entries)
                else:
                    raise self._failed(out)
                open_rows -= self.reasons[index] is not None
                yield event
        finally:
            self.cancel()


async def stream_events(pending: Pending, choices_of: Callable[[ChoiceEvent], list],
                        chunk: Callable[[ChoiceEvent | None, list, Usage | None], Any]) -> AsyncIterator[render.StreamEvent]:
    """A stream's events, completions' or chat's: `chunk(event, choices_of(event), usage so far if asked)` per engine
    event, then a usage chunk (`chunk(None, [], usage)`) if asked for, then DONE; an error once the stream has started
    is its last event."""
    req = pending.req
    try:
        async for event in pending.events():
            usage = pending.usage() if req.continuous_usage else None  # the usage so far, on every chunk
            reason = event.finish_reason
            yield render.StreamEvent(chunk(event, choices_of(event), usage), (reason,) if reason else ())
    except APIError as e:  # the status line is sent already: the error is the last event
        yield render.StreamEvent(e.body(), kind=render.StreamKind.error)
        yield render.STREAM_DONE
        return
    if req.include_usage:
        yield render.StreamEvent(chunk(None, [], pending.usage()))
    yield render.STREAM_DONE
