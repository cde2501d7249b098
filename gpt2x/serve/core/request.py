"""The engine's request: one row being generated, as the scheduler queues and plans it, the runner steps it and the
engine tells its callback what happened (vLLM v1's `Request`)."""

from __future__ import annotations

import time

from ...generation.decode import Sequence
from ...generation.settings import SamplingSettings
from .outputs import Sink


class Row(Sequence):
    """One request's prompt being generated (generation.decode.Sequence, with its own Sampler seeded by
    the request): its callback (`sink`), whether its prompt is scored first, and when it was queued.
    `cancel()` (any thread) makes it leave the batch before the next step."""

    def __init__(self, prompt_ids: list[int], settings: SamplingSettings, sink: Sink, logprobs: int | None = None,
                 prompt_logprobs: bool = False, max_tokens: int | None = None):
        # Tokens to generate: settings.max_new_tokens unless given (0: the prompt is only scored).
        super().__init__(prompt_ids, settings, max_tokens, logprobs)
        self.sink = sink
        self.fails_alone = True  # a row's own failure (its constraint) ends it alone, not its batch
        self.prompt_logprobs = prompt_logprobs  # the prompt scored when the row starts (k = logprobs or 0)
        self.cached_tokens = 0  # prompt tokens whose KV its prefill took from the prefix cache
        self.queued_at = time.monotonic()
        self.scheduled_at: float | None = None  # when the engine took it from the queue
        self.priority = 0  # with the priority policy: lower runs earlier (vLLM's)
        self.prompt_k: int | None = None  # with prompt_logprobs: the most likely tokens listed per prompt position
        self.prompt_ranks: list[int | None] | None = None  # each prompt token's rank, set as it is scored
        # Beam search (settings.num_beams > 1): this row runs the search, and each of these rows (this
        # one first) is told one of the best hypotheses, best first. Only this row is queued.
        self.beam_rows: list[Row] | None = None

    @property
    def finished(self) -> bool:
        return self.finish is not None

    @property
    def remaining(self) -> int:
        return self.limit - len(self.tokens)
