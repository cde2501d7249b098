"""What one replica serves, independent of the HTTP framework: the backend opened from an export,
its engine, and completions as a whole response or as a stream of server-sent events.

The engine's thread hands each row's outputs (core/outputs.py) to the request's asyncio loop
(call_soon_threadsafe); a request whose consumer goes away (client disconnected, stop string found,
server stopping) cancels its rows, which leave the batch before the next decode step. A stream is
handed to the HTTP side as typed events (render.StreamEvent), rendered there once.

A request's choices are its rows: n per prompt (`n`), prompt by prompt (choice p * n + i is prompt
p's i-th, seeded seed + i, as vLLM numbers and seeds them); the rows of one prompt that are prefilled
together are prefilled once (core/runner.py's Runner.begin). `usage` counts each prompt's tokens once, as vLLM
does, every choice's completion tokens, and the prompt tokens the prefix cache held
(`prompt_tokens_details.cached_tokens`).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

from ...generation.settings import Finish
from ...generation.speculative import Drafter, DraftSettings
from ...memory import peak_rss_mb, rss_mb
from ...runtime.base import Backend
from ...tokenizer import VOCAB_SIZE
from ..core.engine import Engine, EngineClosed, EngineSettings, LogprobEntry, QueueFull, Row
from ..core.outputs import Finished, Output, PromptLogprobs, TokenOut
from ..core.prefix_disk import BlockIdentity
from . import chat, render, schema
from .errors import APIError, bad
from .request import CompletionRequest, json_object, request_from_body


class CompletionService:
    def __init__(self, backend: Backend, engine: EngineSettings, model_id: str, replica: str = "",
                 drafter: Drafter | None = None, draft_settings: DraftSettings | None = None,
                 draft_name: str | None = None, chat_template: chat.ChatTemplate | None = None,
                 blocks: BlockIdentity | None = None):
        self.backend = backend
        self.chat_template = chat_template  # /v1/chat/completions' (chat.py); None: a 400 naming the flag
        self.model_id = model_id
        self.replica = replica  # which replica answered /health (Ray Serve's replica id)
        self.created = int(time.time())
        self.drafter = drafter
        self.draft_name = draft_name or (drafter.name if drafter is not None else None)  # as the user named it
        # `blocks`: what the export's prefix-cache blocks are kept under on disk (EngineSettings.prefix_cache_dir)
        self.engine = Engine(backend, engine, drafter, draft_settings, blocks).start()

    def close(self) -> bool:
        """Stop the engine (Engine.close: False when its thread could not be stopped). The backend and
        the draft are the caller's, who made them, to close."""
        return self.engine.close()

    def models(self) -> schema.ModelList:
        return render.model_list(self.model_id, self.created, self.backend.n_positions)

    def health(self) -> schema.Health:
        stats = self.engine.stats()
        if self.drafter is not None:  # the draft, and its acceptance over every request so far (vLLM's terms)
            stats["draft"] = self.draft_name
            stats["acceptance_rate"] = stats["accepted"] / stats["drafted"] if stats["drafted"] else None
        # The native backend's cache form (its in_place_kv, as workflows.export_backend sets it); the others keep their own.
        native = self.backend.capabilities.native
        kv_cache = ("in-place" if self.backend.in_place_kv else "growing") if native else None
        kv_dtype = np.dtype(self.backend.kv_dtype).name if native else None
        return schema.Health(status="ok", model=self.model_id, replica=self.replica, backend=self.backend.name,
                          provider=self.backend.provider.value, **stats, kv_cache=kv_cache, kv_cache_dtype=kv_dtype,
                          max_rss_mb=peak_rss_mb(), rss_mb=rss_mb())

    def parse(self, raw: bytes) -> CompletionRequest:
        return self.request(json_object(raw))

    def request(self, body: dict) -> CompletionRequest:
        """A completions body, already read as a JSON object, as the request it is served as (a 4xx APIError)."""
        req = request_from_body(body, self.model_id, self.backend.n_positions, min(self.backend.vocab_size, VOCAB_SIZE))
        if req.priority and self.engine.settings.scheduling_policy != "priority":  # vLLM refuses it so too
            raise bad(f"priority is {req.priority}: this server schedules first come, first served; start it "
                          "with --scheduling-policy priority", "priority")
        return req

    def parse_chat(self, raw: bytes) -> CompletionRequest:
        """A chat completions body as the completions request it is served as (chat.py)."""
        return self.chat_request(json_object(raw))

    def chat_request(self, body: dict) -> CompletionRequest:
        """A chat completions body, already read as a JSON object, as the completions request it is served as
        (chat.py), its logprobs in chat's shape."""
        req = self.request(chat.completion_body(body, self.chat_template, self.backend.n_positions))
        k = chat.logprobs_asked(body)
        req = replace(req, chat_echo=chat.chat_echo(body))
        return req if k is None else replace(req, logprobs=k, chat_logprobs=True)

    async def complete_chat(self, pending: Pending) -> schema.ChatCompletionResponse:
        """The whole chat response (`chat.completion`), with vLLM's token ids and prompt logprobs where asked for: the
        choices' ids on each choice, the rendered prompt's on the response."""
        req = pending.req
        texts: list[list[str]] = [[] for _ in range(req.choices)]
        extras: list[dict] = [{} for _ in range(req.choices)]
        prompt: dict = {}
        async for event in pending.events():
            texts[event.index].append(event.text)
            for key, value in event.extra.items():  # the prompt's keys once (one prompt on chat); token_ids add up
                if key in chat.PROMPT_KEYS:
                    prompt.setdefault(key, value)
                else:
                    extras[event.index][key] = extras[event.index].get(key, []) + value
        logprobs = [None if lp is None else lp.whole() for lp in pending.logprobs]
        echo = req.chat_echo
        return chat.response(req, [echo + "".join(t) for t in texts], pending.reasons, pending.usage(), logprobs, extras,
                             prompt)

    async def stream_chat(self, pending: Pending) -> AsyncIterator[render.StreamEvent]:
        """Chat's stream: `chat.completion.chunk`s, each choice's first with its role alone (no text yet: OpenAI's and
        vLLM's, which clients wait for), then its text (with vLLM's token ids, and the prompt's keys once, where asked
        for), a usage chunk if asked for, then DONE."""
        req = pending.req
        for i in range(req.choices):
            usage = pending.usage() if req.continuous_usage else None
            yield render.StreamEvent(chat.chunk(req, [chat.delta(i, "", None, first=True)], usage))
        if req.chat_echo:  # vLLM's echo: the last message's text, each choice's first content
            for i in range(req.choices):
                usage = pending.usage() if req.continuous_usage else None
                yield render.StreamEvent(chat.chunk(req, [chat.delta(i, req.chat_echo, None, first=False)], usage))
        prompt_sent: set[str] = set()

        def delta(event: ChoiceEvent) -> list[schema.ChatChunkChoice]:
            return [chat.delta(event.index, event.text, event.finish_reason, first=False, logprobs=event.logprobs,
                               token_ids=event.extra.get("token_ids"))]

        def chunk(event: ChoiceEvent | None, choices: list, usage: schema.Usage | None) -> schema.ChatCompletionChunk:
            extra = {} if event is None else event.extra
            prompt = {k: extra[k] for k in chat.PROMPT_KEYS if k in extra and k not in prompt_sent}
            prompt_sent.update(prompt)
            return chat.chunk(req, choices, usage, prompt)

        async for event in _events(pending, delta, chunk):
            yield event

    def submit(self, req: CompletionRequest) -> Pending:
        """Queue the request's rows (its choices) in the engine (all or none), before any response is
        started: more rows than the engine can ever hold waiting and running is a 400, a full queue a
        429, a server shutting down a 503."""
        pending = Pending(req, asyncio.get_running_loop(), self.engine)
        most = self.engine.settings.rows_held
        if len(pending.rows) > most:
            param = "n" if req.n > 1 else "prompt"
            raise APIError(400, f"{len(pending.rows)} choices ({len(req.prompts)} prompts x n = {req.n}) exceed the "
                               f"{most} rows this server queues and runs at once; send fewer", param=param)
        try:
            self.engine.submit(pending.queued)
        except QueueFull as e:
            raise APIError(429, f"the server is at capacity ({e}); retry later", "rate_limit_exceeded",
                               code="queue_full") from None
        except EngineClosed:
            raise APIError(503, "the server is shutting down", "server_error", code="unavailable") from None
        return pending

    async def complete(self, pending: Pending) -> schema.CompletionResponse:
        """The whole response, as OpenAI's non-streaming completions answer."""
        req = pending.req
        parts: list[list[str]] = [[] for _ in range(req.choices)]
        reasons: list[str | None] = [None] * req.choices
        extras: list[dict] = [{} for _ in range(req.choices)]
        async for event in pending.events():
            index = event.index
            parts[index].append(event.text)
            reasons[index] = event.finish_reason or reasons[index]
            for key, value in event.extra.items():  # token_ids add up; the prompt's keys come once
                extras[index][key] = extras[index].get(key, []) + value if key == "token_ids" else value
        choices = [render.choice(i, "".join(p), reasons[i], None if lp is None else lp.whole(), **extras[i])
                   for i, (p, lp) in enumerate(zip(parts, pending.logprobs))]
        return render.completion(req, choices, pending.usage())

    async def stream(self, pending: Pending) -> AsyncIterator[render.StreamEvent]:
        """The stream: one chunk per released piece of text (with the logprobs of the tokens it
        releases), each choice's finish_reason on the chunk of its last token (as vLLM's: a chunk of
        its own only where the choice ends without a token of text, at end of text or a stop token
        id), a usage chunk if asked for, then DONE."""
        req = pending.req

        def choice(event: ChoiceEvent) -> list:
            return [render.choice(event.index, event.text, event.finish_reason, event.logprobs, **event.extra)]

        async for event in _events(pending, choice, lambda _, choices, usage: render.completion(req, choices, usage)):
            yield event


async def _events(pending: Pending, choices_of: Callable[[ChoiceEvent], list],
                  chunk: Callable[[ChoiceEvent | None, list, schema.Usage | None], Any]) -> AsyncIterator[render.StreamEvent]:
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


@dataclass(frozen=True, slots=True)
class ChoiceEvent:
    """What one choice released (Pending.events): its text since its last event, its finish_reason on its last,
    the logprobs of the tokens gathered since (None without logprobs), and vLLM's extra keys (token_ids,
    prompt_token_ids, prompt_logprobs)."""

    index: int
    text: str
    finish_reason: str | None = None
    logprobs: dict | schema.ChatLogprobs | None = None  # a chat request's in OpenAI's chat shape
    extra: dict = field(default_factory=dict)


class Pending:
    """A request's rows in the engine (one per choice: n per prompt), the queue their tokens arrive on,
    and each choice's text and logprobs."""

    def __init__(self, req: CompletionRequest, loop: asyncio.AbstractEventLoop, engine: Engine):
        self.req = req
        self.engine = engine  # a row's error while it stops is a 503, not a 500
        self.queue: asyncio.Queue = asyncio.Queue()
        self.prompts = [p for p in req.prompts for _ in range(req.n)]  # each choice's prompt text
        self.texts = [render.ChoiceText(req.stop, req.sampling.min_tokens, req.include_stop_str) for _ in self.prompts]
        self.logprobs = [None if req.logprobs is None else chat.ChatTokenLogprobs() if req.chat_logprobs
                         else render.ChoiceLogprobs(req.tokens_as_ids) for _ in self.prompts]
        self.echo_scored = req.echo and req.logprobs is not None  # the echoed prompt's logprobs come from the engine
        self.scored = self.echo_scored or req.prompt_logprobs is not None  # so do vLLM's prompt_logprobs
        # return_token_ids: each choice's ids not yet sent, and whether its prompt's have been
        self._ids: list[list[int]] = [[] for _ in self.prompts]
        self._prompt_sent = [False] * len(self.prompts)
        self._start = [len(p) if req.echo else 0 for p in self.prompts]  # where the completion's text starts
        self.reasons: list[str | None] = [None] * len(self.prompts)  # each choice's finish_reason, once it ended
        self.rows = []
        for p, (ids, budget) in enumerate(zip(req.prompt_ids, req.max_tokens)):
            for i in range(req.n):
                def sink(out: Output, index: int = p * req.n + i) -> None:
                    loop.call_soon_threadsafe(self.queue.put_nowait, (index, out))

                row = Row(ids, req.settings(budget, i), sink, req.logprobs, self.scored, budget)
                row.prompt_k = req.prompt_logprobs
                row.priority = req.priority
                self.rows.append(row)
            if req.beams:  # one search per prompt, by its first row; each of its n rows one hypothesis
                group = self.rows[p * req.n : (p + 1) * req.n]
                group[0].beam_rows = group
        # the rows the engine runs (a beam search's other rows are told by its first)
        self.queued = [r for r in self.rows if not (req.beams and r.beam_rows is None)]

    def usage(self) -> schema.Usage:
        """The request's usage: its prompts counted once, and the tokens the prefix cache held for each
        (its first choice's row: a prompt's choices are prefilled together)."""
        cached = sum(self.rows[p * self.req.n].cached_tokens for p in range(len(self.req.prompt_ids)))
        return render.usage(self.req, self.texts, cached)

    def cancel(self) -> None:
        for row in self.rows:
            row.cancel()  # a no-op for finished rows; frees the rows of a request that left early

    def _note(self, index: int, entry: LogprobEntry | None, offset: int) -> None:
        """A token's logprobs, at `offset` in the choice's text."""
        if entry is not None and self.logprobs[index] is not None:
            self.logprobs[index].add(entry, offset)

    def _taken(self, index: int) -> dict | None:
        lp = self.logprobs[index]
        return None if lp is None else lp.take()

    def _extra(self, index: int) -> dict:
        """return_token_ids: the ids gathered since the choice's last event (`token_ids`), and with its
        first event its prompt's (`prompt_token_ids`)."""
        if not self.req.return_token_ids:
            return {}
        extra = {"token_ids": self._ids[index]}
        self._ids[index] = []
        if not self._prompt_sent[index]:
            self._prompt_sent[index] = True
            extra["prompt_token_ids"] = list(self.req.prompt_ids[index // self.req.n])
        return extra

    def _prompt_event(self, index: int, entries: list[LogprobEntry]) -> tuple[str, dict]:
        """What a choice's scored prompt releases: the echoed prompt (with echo and logprobs, its
        logprobs gathered) and vLLM's prompt_logprobs (when asked for)."""
        extra = self._extra(index)
        k = self.req.prompt_logprobs
        if k is not None:
            extra["prompt_logprobs"] = render.prompt_logprobs(entries, self.rows[index].prompt_ranks or [], k,
                                                           render.token_namer(self.req.tokens_as_ids))
        if not self.echo_scored:
            return "", extra
        n = self.req.logprobs or 0  # the engine listed max(logprobs, prompt_logprobs) most likely tokens
        self.logprobs[index].add_prompt([(t, lp, None if top is None else top[:n]) for t, lp, top in entries])
        return self.prompts[index], extra

    async def events(self) -> AsyncIterator[ChoiceEvent]:
        """Each choice's text as it is released; each choice ends with one event carrying its finish_reason.
        With echo the prompt comes first (once scored, with logprobs). Leaving early cancels every row."""
        if self.req.echo and not self.echo_scored:
            for i, prompt in enumerate(self.prompts):
                yield ChoiceEvent(i, prompt, None, self._taken(i), self._extra(i))
        open_rows = len(self.rows)
        try:
            while open_rows:
                index, out = await self.queue.get()
                text = self.texts[index]
                if text.stopped or self.reasons[index] is not None:
                    continue  # already ended (a stop string, or its last token); what the row sent after is dropped
                if isinstance(out, TokenOut):
                    offset = self._start[index] + len(text.text)
                    delta = text.push(out.token)
                    self._ids[index].append(out.token)
                    self._note(index, out.logprob, offset)
                    if text.stopped:  # a stop string ended it: the row need not run on
                        self.rows[index].cancel()
                        open_rows -= 1
                        self.reasons[index] = "stop"
                        yield ChoiceEvent(index, delta, "stop", self._taken(index), self._extra(index))
                    elif out.finish is not None:  # its last token: the rest of its text (held back) and its end
                        open_rows -= 1
                        delta += text.finish()
                        self.reasons[index] = render.finish_reason(out.finish, text)
                        yield ChoiceEvent(index, delta, self.reasons[index], self._taken(index), self._extra(index))
                    elif delta:
                        yield ChoiceEvent(index, delta, None, self._taken(index), self._extra(index))
                elif isinstance(out, Finished):
                    open_rows -= 1
                    rest = text.finish()
                    # the end-of-text or stop token, not kept: listed last in a completion's logprobs, not in chat's
                    if out.reason in (Finish.eos, Finish.stop) and not self.req.chat_logprobs:
                        self._note(index, out.logprob, self._start[index] + len(text.text))
                    self.reasons[index] = render.finish_reason(out.reason, text)
                    yield ChoiceEvent(index, rest, self.reasons[index], self._taken(index), self._extra(index))
                elif isinstance(out, PromptLogprobs):
                    released, extra = self._prompt_event(index, out.entries)
                    yield ChoiceEvent(index, released, None, self._taken(index), extra)
                elif out.client:  # Failed by the request's own doing (its constraint): the others went on
                    raise APIError(400, out.message)
                elif self.engine.closing:  # Failed: waiting, or cut short by the server's stop
                    raise APIError(503, out.message, "server_error", code="unavailable")
                else:
                    raise APIError(500, out.message, "server_error")
        finally:
            self.cancel()
