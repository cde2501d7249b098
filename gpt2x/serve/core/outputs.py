"""What the engine tells a row's callback (`Sink`), defined once: its prompt's logprobs first (when
asked), a TokenOut per token, then one Finished or Failed. The service reads them (service.Pending)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from ...generation.logprobs import LogprobEntry
from ...generation.settings import Finish


@dataclass(frozen=True, slots=True)
class TokenOut:
    """A token the row sampled and keeps, with its logprobs (rows that ask). `finish`: the row's end
    when this is its last token (its Finished follows), so that its chunk can carry it."""

    token: int
    logprob: LogprobEntry | None = None
    finish: Finish | None = None


@dataclass(frozen=True, slots=True)
class PromptLogprobs:
    """The row's prompt scored (prompt_logprobs), before its first token: an entry per prompt token,
    the first (id, None, None)."""

    entries: list[LogprobEntry]


@dataclass(frozen=True, slots=True)
class Finished:
    """The row's end, once, last. `logprob`: the end-of-text or stop token's, which ended the row
    without being kept (rows that ask)."""

    reason: Finish
    logprob: LogprobEntry | None = None


@dataclass(frozen=True, slots=True)
class Failed:
    """The row ended in an error (generation failed, or the server stopped), once, last. `client`: the
    request's own doing (its constraint could not go on), not the server's: a 400, its batch unharmed."""

    message: str
    client: bool = False


Output = TokenOut | PromptLogprobs | Finished | Failed
Sink = Callable[[Output], None]
