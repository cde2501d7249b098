"""The serving engine's runner: it steps what the scheduler decided, on the backend. A batch is
prefilled, stepped one token per row, and regrouped (rows leaving and joining: the cache's `merge`,
runtime.base.KVCache); a row that asks is scored (its prompt's logprobs); a row with a draft is
decoded speculatively. Tokens are sampled and rows ended by the decode loop's own rules
(generation.decode: `sample_rows`, `Sequence.accept`), so a served row's tokens are those `gpt2x
generate` gives for the same prompt, settings and seed. The runner decides nothing about which rows
run, and tells nobody: it returns the events (generation.decode.Event), which the engine tells.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..generation.decode import Event, decode, left_pad, sample_rows
from ..generation.logprobs import LogprobEntry, token_logprobs
from ..generation.speculative import Drafter, DraftSettings
from ..numerics import positions
from ..runtime.base import Backend
from .scheduler import Row


@dataclass
class Batch:
    """A batch in flight: its rows, attention mask (B, W), the tokens its next step feeds (B,) and its
    cache (W positions)."""

    rows: list[Row]
    mask: np.ndarray
    nxt: np.ndarray
    past: Any

    def live(self) -> list[int]:
        return [i for i, r in enumerate(self.rows) if not r.finished]


class Runner:
    """Steps batches of rows on one backend (not thread-safe: the engine's thread only). `counters`
    is the engine's: the runner counts its model steps in it."""

    def __init__(self, backend: Backend, counters: dict[str, int], drafter: Drafter | None = None,
                 draft_settings: DraftSettings | None = None):
        self.backend = backend
        self.counters = counters
        self.drafter = drafter
        self.draft_settings = draft_settings or DraftSettings()

    def prefill(self, rows: list[Row]) -> tuple[Batch, list[Event]]:
        """The rows as a new left-padded batch, prefilled, each row's first token sampled. Rows with
        the same prompt ids (a request's n choices) are prefilled once: the distinct prompts run, and
        their cache rows (`KVCache.reorder`), mask rows and logits are duplicated for the others. (On a
        backend whose cache rows do not move, capabilities.joins_rows False, every row is prefilled:
        onnxruntime-genai reorders by replaying, which would prefill them all again.)"""
        prompts = [r.prompt_ids for r in rows]
        index = None
        if self.backend.capabilities.joins_rows:
            distinct: dict[tuple[int, ...], int] = {}
            which = [distinct.setdefault(tuple(p), len(distinct)) for p in prompts]
            if len(distinct) < len(rows):
                prompts, index = [list(p) for p in distinct], np.asarray(which, dtype=np.int64)
        ids, mask = left_pad(prompts)  # (U, L): U distinct prompts
        logits, past = self.backend.step(ids, mask, positions(mask, ids.shape[1]), None)  # (U, V)
        self.counters["steps"] += 1
        if index is not None:
            logits, mask, past = logits[index], mask[index], past.reorder(index)  # (B, V), (B, L), B rows
        nxt, events = sample_rows(rows, logits)
        return Batch(rows, mask, nxt, past), events

    def step(self, batch: Batch) -> list[Event]:
        """One decode step of every row (finished rows ride along, masked and unread), and each
        unfinished row's next token."""
        batch.mask = np.concatenate([batch.mask, np.ones((len(batch.rows), 1), dtype=np.int64)], axis=1)
        logits, batch.past = self.backend.step(batch.nxt[:, None], batch.mask, positions(batch.mask, 1), batch.past)
        self.counters["steps"] += 1
        batch.nxt, events = sample_rows(batch.rows, logits)
        return events

    def merge(self, batch: Batch, joined: Batch | None, order: np.ndarray, width: int) -> Batch:
        """The batch whose row i is row order[i] of `batch`'s rows and `joined`'s (numbered after
        them), every row's mask and cache right-aligned to `width` positions. `batch.past` is not used
        afterwards (a cache may reuse its buffers)."""
        rows = batch.rows + ([] if joined is None else joined.rows)
        jmask = np.zeros((0, 1), dtype=np.int64) if joined is None else joined.mask
        jnxt = np.zeros(0, dtype=np.int64) if joined is None else joined.nxt
        mask = np.concatenate([_fit(batch.mask, width), _fit(jmask, width)])[order]
        past = batch.past.merge(order, None if joined is None else joined.past, width)
        return Batch([rows[i] for i in order], mask, np.concatenate([batch.nxt, jnxt])[order], past)

    def score(self, row: Row) -> list[LogprobEntry]:
        """The prompt's logprobs: one forward of the prompt alone, no cache, every position's logits;
        position t's distribution scores token t + 1 (the first token has none)."""
        ids = np.asarray([row.prompt_ids], dtype=np.int64)
        mask = np.ones_like(ids)
        logits, _ = self.backend.run(ids, mask, positions(mask, ids.shape[1]), None)
        self.counters["steps"] += 1
        return [(row.prompt_ids[0], None, None)] + token_logprobs(logits[0, :-1], row.prompt_ids[1:], row.logprobs or 0)

    def speculative(self, row: Row) -> Iterator[Event]:
        """One row decoded with the draft (generation.decode.decode: a round's tokens accepted one at a
        time as they are read, so a row cancelled meanwhile ends at its next token and runs no further
        round). Each round is counted before its first token comes out: the prefill and every round
        one target step, the draft's drafted and accepted tokens and its verifications (`drafts`)."""
        counted = dict.fromkeys(("steps", "drafted", "accepted", "drafts"), 0)
        for event in decode(self.backend, [row], self.drafter, self.draft_settings):
            st = row.speculation
            now = {"steps": 1 + st.drafts + st.plain_steps, "drafted": st.drafted, "accepted": st.accepted,
                   "drafts": st.drafts}
            for name, value in now.items():
                self.counters[name] += value - counted[name]
                counted[name] = value
            yield event


def _fit(mask: np.ndarray, width: int) -> np.ndarray:
    """A mask (B, T) right-aligned to `width` columns: zeros added before, or leading columns dropped."""
    T = mask.shape[1]
    return mask[:, T - width :] if T >= width else np.pad(mask, [(0, 0), (width - T, 0)])
