"""What one replica serves, independent of the HTTP framework: the backend opened from an export, its engine, its
chat template, and its requests (completion/, chat_completion/) submitted to the engine as rows (pending.Pending),
all or none, before any response is started."""

from __future__ import annotations

import asyncio
import time

from ...generation.speculative import Drafter, DraftSettings
from ...memory import peak_rss_mb, rss_mb
from ...runtime.base import Backend, kv_cache_name
from ...tokenizer import VOCAB_SIZE
from ..core.engine import Engine, EngineClosed, EngineSettings, QueueFull
from ..core.prefix_disk import BlockIdentity
from . import render
from .chat_completion import serving as chat
from .chat_completion.protocol import ChatCompletionRequest
from .chat_completion.template import ChatTemplate
from .completion import serving as completion
from .completion.protocol import CompletionRequest, CompletionResponse
from .completion.serving import ServedModel
from .errors import APIError, json_object
from .pending import Pending, ServedRequest
from .protocol import Health, ModelList


class CompletionService:
    def __init__(self, backend: Backend, engine: EngineSettings, model_id: str, replica: str = "",
                 drafter: Drafter | None = None, draft_settings: DraftSettings | None = None,
                 draft_name: str | None = None, chat_template: ChatTemplate | None = None,
                 blocks: BlockIdentity | None = None):
        self.backend = backend
        self.chat_template = chat_template  # /v1/chat/completions' (chat_completion/template.py); None: a 400 naming the flag
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

    def models(self) -> ModelList:
        return render.model_list(self.model_id, self.created, self.backend.n_positions)

    def health(self) -> Health:
        stats = self.engine.stats()
        if self.drafter is not None:  # the draft, and its acceptance over every request so far (vLLM's terms)
            stats["draft"] = self.draft_name
            stats["acceptance_rate"] = stats["accepted"] / stats["drafted"] if stats["drafted"] else None
        # The native backend's cache form (its in_place_kv, as workflows.export_backend sets it); the others keep their own.
        caps = self.backend.capabilities
        kv_cache = "slots" if caps.mixes_chunks else ("in-place" if self.backend.in_place_kv else "growing") if caps.native else None
        chunk, per_row = self.engine.scheduler.chunk_rule() if self.engine.scheduler.joins else (None, None)  # none join
        return Health(status="ok", model=self.model_id, replica=self.replica, backend=self.backend.name,
                      provider=self.backend.provider.value, **stats, kv_cache=kv_cache, kv_cache_dtype=kv_cache_name(self.backend),
                      prefill_chunk=chunk, prefill_chunk_per_row=per_row, max_rss_mb=peak_rss_mb(), rss_mb=rss_mb())

    @property
    def served(self) -> ServedModel:
        """What its requests are checked against: the model's id, context and vocabulary, and its scheduling."""
        return ServedModel(self.model_id, self.backend.n_positions, min(self.backend.vocab_size, VOCAB_SIZE),
                           self.engine.settings.scheduling_policy == "priority")

    def prepare(self, p: CompletionRequest) -> ServedRequest:
        """A completions request as it is served (a 4xx APIError for what it asks and is not served)."""
        return completion.prepare(p, self.served)

    def prepare_chat(self, p: ChatCompletionRequest) -> ServedRequest:
        """A chat completions request as it is served: its prompt rendered by the replica's chat template."""
        return chat.prepare(p, self.served, self.chat_template)

    def request(self, body: dict) -> ServedRequest:
        """A completions body, already read as a JSON object, as it is served (the Python API's way in)."""
        return self.prepare(completion.validated(body, self.served))

    def chat_request(self, body: dict) -> ServedRequest:
        """A chat completions body, already read as a JSON object, as it is served (the Python API's way in)."""
        return self.prepare_chat(completion.validated(body, self.served, ChatCompletionRequest))

    def parse(self, raw: bytes) -> ServedRequest:
        return self.request(json_object(raw))

    def submit(self, req: ServedRequest) -> Pending:
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

    async def complete(self, pending: Pending) -> CompletionResponse:
        """The whole completions response (completion.complete)."""
        return await completion.complete(pending)
