"""The scheduler of one server replica: one thread owns the backend and decodes every request in
flight as one left-padded batch.

Requests that arrive together start as one batch (prefill, then one decode step per token for all
rows). A row that finishes (end of text, its token budget, or cancelled because its client left or
hit a stop string) stops being read at once and leaves the batch's cache at the next regrouping, so
the batch stops computing rows nobody reads. With continuous batching on, waiting requests also join
a running batch between decode steps: they are prefilled on their own (one batch of joiners), sample
their first token, and their cache is merged into the batch's with `Backend.merge`, every row
right-aligned to the batch's width (left padding, masked out). A join is made only when every row
keeps room in the model's context; a backend that cannot take a cache from elsewhere
(onnxruntime-genai) batches statically.

How rows are laid out is chosen for caches that move rows in place (ONNX Runtime's in-place cache and
OpenVINO's, kvbuffers.merge_rows), where a merge costs only the rows it moves: a live row keeps its
place where that is inside the new batch, joiners take the places of rows that left, and only live
rows beyond the new batch size move, into the remaining holes. The batch keeps its width unless a
joiner's prompt is wider (every row then moves right: unavoidable, since all rows share the width),
and leading mask columns no row uses are dropped only when that pays for moving every row: when they
are at least half the width, or when the context needs them for the rows' remaining tokens (see
`_width`). Caches merged through the host (ONNX Runtime's growing cache, PyTorch) are copied whole at
every merge, whatever the layout.

Every row samples with its own Sampler seeded by its request, one uniform per step: the tokens are
those `gpt2x generate` gives for the same prompt, settings and seed (generation.sampling).
Callers submit from any thread and hear of their tokens through a callback run on the engine thread;
the waiting queue is bounded (QueueFull), never grown without limit.

With a draft (speculative decoding, generation/speculative.py) the engine decodes one request at a
time: a replica with a draft runs at max batch size 1, each request decoded by `speculative_loop`
with its own Sampler and a DraftControl of its own, so its tokens are those of `gpt2x generate
--draft` for the same prompt, settings and seed (for a seeded sampled request: with the draft's K
fixed, `adaptive` off, since adaptive K follows measured timings). A round yields 1 to K + 1
tokens, each told to the row's callback in turn; a row cancelled meanwhile hears no more of them and
stops there, before the next round. The counters add the draft's drafted and accepted tokens and its
verifications (`drafts`), as SpecStats counts them. A row that asks for logprobs is decoded without the
draft (plain steps, on its own): its logprobs are the target's distribution at each of its tokens,
and its tokens those of `gpt2x generate` without a draft.

Logprobs (a row's `logprobs` = k, for rows that ask only): at each token the row samples, the raw
model distribution, log_softmax of the step's logits before temperature, top-k and top-p (vLLM's
`raw_logprobs`), gives the chosen token's log-probability and the k most likely tokens. A row that
also asks for its prompt's (`prompt_logprobs`, the API's echo with logprobs) is scored when it
starts, on the engine thread (the backend is not thread-safe): one no-cache forward of its prompt
alone, every position's logits (`Backend.run`), before it is prefilled; a row with no token to
generate (the API's max_tokens 0) ends there, "length", without joining a batch.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from ..errors import UsageError
from ..generation.generate import left_pad
from ..generation.sampling import Sampler
from ..generation.settings import Finish, SamplingSettings
from ..generation.speculative import Drafter, DraftSettings, SpecStats, control_for, speculative_loop
from ..numerics import log_softmax, positions
from ..runtime.base import Backend
from ..tokenizer import EOT_ID

log = logging.getLogger(__name__)

# What a row's callback hears: ("token", id) for each token, then once ("done", reason) with reason a
# generation.settings.Finish: eos (end of text), length (its token budget) or cancelled; or ("error",
# message). A row with logprobs also hears ("logprob", (id, logprob, [(id, logprob), ...])) before
# each ("token", id), and before the ("done", Finish.eos) of the end-of-text token; with prompt_logprobs, first ("prompt", [entry
# per prompt token]), the first entry (id, None, None).
Sink = Callable[[str, object], None]
# What the engine tells of one token: its id, its log-probability (None for a prompt's first token)
# and the k most likely tokens with theirs (None for a prompt's first token). Defined here only.
LogprobEntry = tuple[int, float | None, list[tuple[int, float]] | None]
SCORE_CHUNK = 64  # positions whose log_softmax is computed at once (float64, vocab wide)


class QueueFull(RuntimeError):
    """The waiting queue is at its bound: the request is refused, not queued."""


class EngineClosed(RuntimeError):
    """The engine is shutting down and takes no more requests."""


@dataclass(frozen=True)
class EngineSettings:
    max_batch_size: int = 16  # rows decoded together; 1 = no batching
    max_waiting: int = 64  # rows waiting for a place in the batch; more are refused (QueueFull)
    continuous: bool = True  # waiting rows join a running batch between decode steps
    batch_wait_s: float = 0.002  # a new batch waits this long after its first request for others
    max_join_delay_s: float = 0.05  # a waiting request joins a running batch after at most this long

    def __post_init__(self) -> None:
        if self.max_batch_size < 1:
            raise UsageError(f"max_batch_size must be >= 1, got {self.max_batch_size}", option="max_batch_size")
        if self.max_waiting < 0:
            raise UsageError(f"max_waiting must be >= 0, got {self.max_waiting}", option="max_waiting")
        for name in ("batch_wait_s", "max_join_delay_s"):
            if getattr(self, name) < 0:
                raise UsageError(f"{name} must be >= 0, got {getattr(self, name)}", option=name)


SPECULATIVE_BATCH = "speculative serving runs at max batch size 1 (one request decoded at a time with its draft)"


def refuse_batched_draft(max_batch_size: int, option: str = "max_batch_size") -> None:
    """A draft decodes one request at a time: refused, in one line, with a larger batch."""
    if max_batch_size != 1:
        raise UsageError(f"{option} is {max_batch_size} with a draft; {SPECULATIVE_BATCH}", option=option)


class Row:
    """One prompt being generated: its ids, settings, sampler and callback. `cancel()` (any thread)
    makes it leave the batch before the next step."""

    def __init__(self, prompt_ids: list[int], settings: SamplingSettings, sink: Sink, logprobs: int | None = None,
                 prompt_logprobs: bool = False, max_tokens: int | None = None):
        self.prompt_ids = prompt_ids
        self.settings = settings
        self.sampler = Sampler(settings)
        self.sink = sink
        self.logprobs = logprobs  # None: none; k: each token's logprob and the k most likely tokens
        self.prompt_logprobs = prompt_logprobs  # the prompt scored when the row starts (k = logprobs or 0)
        # Tokens to generate: settings.max_new_tokens unless given (0: the prompt is only scored).
        self.max_tokens = settings.max_new_tokens if max_tokens is None else max_tokens
        self.queued_at = time.monotonic()
        self.produced = 0
        self.finished = False
        self.cancelled = False

    def cancel(self) -> None:
        self.cancelled = True

    @property
    def remaining(self) -> int:
        return self.max_tokens - self.produced


class Engine:
    """A batch scheduler over one backend, run by its own thread (`start`, `close`)."""

    def __init__(self, backend: Backend, settings: EngineSettings = EngineSettings(), drafter: Drafter | None = None,
                 draft_settings: DraftSettings | None = None):
        if drafter is not None:
            refuse_batched_draft(settings.max_batch_size)
        self.backend = backend
        self.settings = settings
        self.drafter = drafter  # speculative decoding, one row at a time (see the module's docstring)
        self.draft_settings = draft_settings or DraftSettings()
        # Joining needs a backend whose rows can join a running batch's cache: else static batches.
        self.joins = settings.continuous and backend.capabilities.joins_rows and settings.max_batch_size > 1
        self._waiting: deque[Row] = deque()
        self._cond = threading.Condition()
        self._closed = False
        self._thread = threading.Thread(target=self._loop, name="gpt2x-engine", daemon=True)
        self.running = 0
        self._batch: list[Row] = []  # the rows of the batch in flight (the engine thread's)
        self.counters = {"rows": 0, "tokens": 0, "batches": 0, "steps": 0, "joins": 0, "compactions": 0, "errors": 0}
        if drafter is not None:
            self.counters.update(drafted=0, accepted=0, drafts=0)

    # -- the callers' side (any thread)

    def start(self) -> Engine:
        self._thread.start()
        return self

    def submit(self, rows: list[Row]) -> None:
        """Queue rows, all or none. Each row's prompt and budget must fit the context together."""
        n = self.backend.n_positions
        for row in rows:
            if not row.prompt_ids or len(row.prompt_ids) + row.max_tokens > n or row.max_tokens < 0:
                raise ValueError(f"{len(row.prompt_ids)} prompt tokens + {row.max_tokens} new exceed the context ({n})")
            if row.settings.num_beams != 1:
                raise ValueError("the engine samples; beam search is not served")
        with self._cond:
            if self._closed:
                raise EngineClosed("the server is shutting down")
            if len(self._waiting) + len(rows) > self.settings.max_waiting:
                self._waiting = deque(r for r in self._waiting if not r.cancelled)  # clients that left
            if len(self._waiting) + len(rows) > self.settings.max_waiting + self._free_places():
                raise QueueFull(f"{len(self._waiting)} requests are waiting (the limit is {self.settings.max_waiting})")
            self._waiting.extend(rows)
            self._cond.notify()

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def _free_places(self) -> int:
        return max(0, self.settings.max_batch_size - self.running)

    def stats(self) -> dict:
        with self._cond:
            return {"running": self.running, "waiting": len(self._waiting), **self.counters}

    def close(self, timeout: float = 10.0) -> bool:
        """Refuse new rows, let the thread finish the batch in flight (rows still waiting are told the
        server is shutting down), and join it. True once the thread has stopped; False, with a warning
        in the log, when it is still running after `timeout` seconds (a step that does not return):
        the backend is then left open, for the thread still uses it."""
        with self._cond:
            self._closed = True
            left = list(self._waiting)
            self._waiting.clear()
            self._cond.notify_all()
        for row in left:
            self._tell(row, "error", "the server is shutting down")
        if self._thread.is_alive():
            self._thread.join(timeout)
        if self._thread.is_alive():
            log.warning("the engine's thread did not stop within %.0f s (a step is still running); left running", timeout)
            return False
        return True

    # -- the engine thread

    def _tell(self, row: Row, kind: str, value: object) -> None:
        try:
            row.sink(kind, value)
        except Exception:  # a callback that fails (its client is gone) cancels its row, nothing more
            log.exception("a row's callback failed; cancelling the row")
            row.cancel()

    def _take(self, rows: list[Row], width: int | None) -> list[Row]:
        """Waiting rows (FIFO) that fit beside `rows`, a batch whose cache can be made `width` wide
        (None: a new batch). Stops at the first that does not fit, so no request is overtaken forever."""
        taken: list[Row] = []
        with self._cond:
            while self._waiting and len(rows) + len(taken) < self.settings.max_batch_size:
                candidate = self._waiting[0]
                if candidate.cancelled:
                    self._waiting.popleft()
                    continue
                if not self._fits(rows, taken + [candidate], width):
                    break
                taken.append(self._waiting.popleft())
            self.running = len(rows) + len(taken)
        return taken

    def _fits(self, rows: list[Row], joiners: list[Row], width: int | None) -> bool:
        """Whether every row keeps room in the context for its remaining tokens once `joiners` join a
        batch whose cache can be made `width` wide (None: they start a new one). The merged cache is
        at least as wide as that and the joiners' prompts; a running row samples its next token one
        position further, a joiner its first from its own prefill."""
        joiners = [r for r in joiners if r.remaining > 0]  # a row that is only scored never joins the cache
        if not joiners:
            return True
        new_width = max(len(r.prompt_ids) for r in joiners)
        if width is not None:
            new_width = max(width, new_width)
        need = max([r.remaining for r in rows if not r.finished] + [r.remaining - 1 for r in joiners])
        return new_width + need <= self.backend.n_positions

    def _loop(self) -> None:
        while True:
            with self._cond:
                while not self._waiting and not self._closed:
                    self._cond.wait()
                if self._closed and not self._waiting:
                    self.running = 0
                    return
            if self.settings.batch_wait_s and len(self._waiting) < self.settings.max_batch_size:
                time.sleep(self.settings.batch_wait_s)  # let requests that arrive together batch together
            rows = self._take([], None)
            if not rows:
                continue
            self._batch = rows
            try:
                rows = self._start(rows)
                if rows:
                    self._batch = rows
                if self.drafter is not None and len(rows) == 1 and rows[0].logprobs is None:
                    self._run_speculative(rows[0])
                elif rows:  # with a draft: a row that asks for logprobs, decoded plainly
                    self._run_batch(rows)
            except Exception as e:  # the batch fails; the engine and the other batches go on
                log.exception("a batch failed")
                self.counters["errors"] += 1
                for row in self._batch:
                    if not row.finished:
                        row.finished = True
                        self._tell(row, "error", f"generation failed: {e}")
            with self._cond:
                self.running = 0

    def _run_batch(self, rows: list[Row]) -> None:
        """Prefill `rows`, then decode until every row (including any that joined) has finished.

        Finished rows ride along, masked and unread, until a join regroups the batch or half the
        batch has finished (a merge through the host copies the whole cache, so rows do not leave one
        by one); joins wait until enough requests are waiting (a quarter of the batch) or the oldest
        has waited `max_join_delay_s`."""
        self.counters["batches"] += 1
        mask, logits, past = self._prefill(rows)
        nxt = self._sample(rows, logits)
        while True:
            live = [i for i, r in enumerate(rows) if not r.finished]
            if not live:
                return
            joiners = []
            if self.joins and self._join_due(len(live)):
                joiners = self._take([rows[i] for i in live], mask.shape[1] - _unused_columns(mask[live]))
                if joiners:
                    self._batch = rows + joiners
                    joiners = self._start(joiners)
            if joiners or 2 * len(live) <= len(rows):
                self._batch = rows + joiners  # told of a failure from here on
                rows, mask, nxt, past = self._regroup(rows, live, joiners, mask, nxt, past)
                self._batch = rows
            with self._cond:
                self.running = sum(not r.finished for r in rows)
            mask = np.concatenate([mask, np.ones((len(rows), 1), dtype=np.int64)], axis=1)
            logits, past = self.backend.step(nxt[:, None], mask, positions(mask, 1), past)
            self.counters["steps"] += 1
            nxt = self._sample(rows, logits)

    def _run_speculative(self, row: Row) -> None:
        """One row decoded with the draft: each round's tokens told in turn, until end of text, the
        row's budget, or its cancellation (checked before each token, so a cancelled row stops
        within the round it was cancelled in and runs no further round). A round is counted before
        its tokens are told, so the counters include it once its caller has heard them."""
        self.counters["batches"] += 1
        stats = SpecStats()
        counted = dict.fromkeys(("steps", "drafted", "accepted", "drafts"), 0)
        loop = speculative_loop(self.backend, self.drafter, row.prompt_ids, row.sampler, row.max_tokens,
                                control_for(self.draft_settings), stats)
        try:
            for chunk in loop:
                now = {"steps": 1 + stats.drafts + stats.plain_steps,  # the prefill and every round: one target step each
                       "drafted": stats.drafted, "accepted": stats.accepted, "drafts": stats.drafts}
                for name, value in now.items():
                    self.counters[name] += value - counted[name]
                    counted[name] = value
                for tok in chunk:
                    if self._deliver(row, tok):
                        return
                if row.cancelled:  # cancelled with the round's last token: no further round
                    self._end(row, Finish.cancelled)
                    return
            if not row.finished:  # the loop yields the budget exactly, whose last token ended the row: a safeguard
                self._end(row, Finish.length)
        finally:
            loop.close()

    def _start(self, rows: list[Row]) -> list[Row]:
        """What rows do before their prefill: those that asked are told their prompt's logprobs, those
        with no token to generate end ("length"), those cancelled while waiting end. Returns the rows
        that go on to generate."""
        going = []
        for row in rows:
            if row.cancelled:
                self._end(row, Finish.cancelled)
                continue
            if row.prompt_logprobs:
                self._tell(row, "prompt", self._score(row))
            if row.remaining <= 0:
                self._end(row, Finish.length)
            else:
                going.append(row)
        return going

    def _score(self, row: Row) -> list[LogprobEntry]:
        """The prompt's logprobs: one forward of the prompt alone, no cache, every position's logits;
        position t's distribution scores token t + 1 (the first token has none)."""
        ids = np.asarray([row.prompt_ids], dtype=np.int64)
        mask = np.ones_like(ids)
        logits, _ = self.backend.run(ids, mask, positions(mask, ids.shape[1]), None)
        self.counters["steps"] += 1
        return [(row.prompt_ids[0], None, None)] + token_logprobs(logits[0, :-1], row.prompt_ids[1:], row.logprobs or 0)

    def _end(self, row: Row, reason: Finish) -> None:
        row.finished = True
        self.counters["rows"] += 1
        self._tell(row, "done", reason)

    def _deliver(self, row: Row, tok: int) -> bool:
        """Tell a row its next token (or that it ended: cancelled, end of text, its budget); whether it
        has finished. A row with logprobs was told the token's logprobs just before."""
        if row.cancelled:
            self._end(row, Finish.cancelled)
            return True
        if tok == EOT_ID:
            self._end(row, Finish.eos)
            return True
        row.produced += 1
        self.counters["tokens"] += 1
        self._tell(row, "token", tok)
        if row.remaining <= 0:
            self._end(row, Finish.length)
            return True
        return False

    def _join_due(self, live: int) -> bool:
        with self._cond:
            if not self._waiting or live >= self.settings.max_batch_size:
                return False
            waited = time.monotonic() - self._waiting[0].queued_at
        return len(self._waiting) >= max(1, live // 4) or waited >= self.settings.max_join_delay_s

    def _prefill(self, rows: list[Row]):
        ids, mask = left_pad([r.prompt_ids for r in rows])
        logits, past = self.backend.step(ids, mask, positions(mask, ids.shape[1]), None)
        self.counters["steps"] += 1
        return mask, logits, past

    def _regroup(self, rows: list[Row], live: list[int], joiners: list[Row], mask: np.ndarray, nxt: np.ndarray, past):
        """The batch with its finished rows gone and `joiners` (prefilled here on their own, their
        first token sampled) in: rows laid out by `_layout`, the cache merged by `Backend.merge` at the
        width `_width` picks. Returns the batch's rows, mask, next tokens and cache."""
        jlive: list[int] = []
        jpast = None
        if joiners:
            self.counters["joins"] += 1
            jmask, jlogits, jpast = self._prefill(joiners)
            jnxt = self._sample(joiners, jlogits)
            jlive = [i for i, r in enumerate(joiners) if not r.finished]
            if not jlive and 2 * len(live) > len(rows):  # every joiner ended at its first token
                return rows, mask, nxt, past
        else:
            jmask, jnxt = np.zeros((0, 1), dtype=np.int64), np.zeros(0, dtype=np.int64)
        if not jlive:
            self.counters["compactions"] += 1
        order = _layout(live, len(rows), [len(rows) + j for j in jlive])
        width = self._width(mask, jmask, [rows[i] for i in live] + [joiners[j] for j in jlive], live, jlive)
        merged_mask = np.concatenate([_fit(mask, width), _fit(jmask, width)])[order]
        merged_past = self.backend.merge(past, order, jpast if jlive else None, width)
        return [(rows + joiners)[i] for i in order], merged_mask, np.concatenate([nxt, jnxt])[order], merged_past

    def _width(self, mask: np.ndarray, jmask: np.ndarray, kept: list[Row], live: list[int], jlive: list[int]) -> int:
        """The merged cache's width: the batch's own (or the joiners', when wider: every row moves right
        then anyway), unless dropping the leading columns no kept row uses pays for moving every row
        (in an in-place cache): when they are at least half of it, when a joiner moves every row
        anyway, or when the rows' remaining tokens need the room (`_fits` counted on it)."""
        jwidth = jmask.shape[1] - _unused_columns(jmask[jlive]) if jlive else 0
        keep = max(mask.shape[1], jwidth)
        least = max(mask.shape[1] - _unused_columns(mask[live]), jwidth)
        need = max(r.remaining for r in kept)
        if 2 * least <= keep or keep > mask.shape[1] or keep + need > self.backend.n_positions:
            return least
        return keep

    def _sample(self, rows: list[Row], logits: np.ndarray) -> np.ndarray:
        """Each row's next token from its own sampler; tokens are told to the rows' callbacks, and
        rows that end are marked finished (and told why)."""
        nxt = np.full(len(rows), EOT_ID, dtype=np.int64)
        for i, row in enumerate(rows):
            if row.finished:  # riding along until the batch is compacted
                continue
            if row.cancelled:
                self._end(row, Finish.cancelled)
                continue
            tok = int(row.sampler(logits[i : i + 1])[0])
            nxt[i] = tok
            if row.logprobs is not None:
                self._tell(row, "logprob", token_logprobs(logits[i : i + 1], [tok], row.logprobs)[0])
            self._deliver(row, tok)
        return nxt


def token_logprobs(logits: np.ndarray, chosen: list[int], k: int) -> list[LogprobEntry]:
    """For each row of `logits` (T, V) and its chosen token: (token, its log-probability, the k most
    likely tokens with theirs, most likely first), under the raw distribution log_softmax(logits)."""
    out: list[LogprobEntry] = []
    for start in range(0, len(chosen), SCORE_CHUNK):
        lp = log_softmax(logits[start : start + SCORE_CHUNK])
        for row, tok in zip(lp, chosen[start : start + SCORE_CHUNK]):
            top: list[tuple[int, float]] = []
            if k:
                best = np.argpartition(-row, k - 1)[:k]
                best = best[np.argsort(-row[best], kind="stable")]
                top = [(int(t), float(row[t])) for t in best]
            out.append((int(tok), float(row[tok]), top))
    return out


def _unused_columns(mask: np.ndarray) -> int:
    """Leading columns of a mask (B, T) that are 0 in every row."""
    used = mask.any(axis=0)
    return int(np.argmax(used)) if used.any() else mask.shape[1]


def _fit(mask: np.ndarray, width: int) -> np.ndarray:
    """A mask (B, T) right-aligned to `width` columns: zeros added before, or leading columns dropped."""
    T = mask.shape[1]
    return mask[:, T - width :] if T >= width else np.pad(mask, [(0, 0), (width - T, 0)])


def _layout(live: list[int], n: int, joining: list[int]) -> np.ndarray:
    """Which row of the batch (0..n-1) or of the joiners (n onward, in `joining`) each row of the
    regrouped batch is: a live row keeps its place where that is inside the new batch; joiners and
    the live rows beyond it take the places of rows that left. A cache that moves rows in place then
    copies only those."""
    size = len(live) + len(joining)
    order = np.full(size, -1, dtype=np.int64)
    staying = [i for i in live if i < size]
    order[staying] = staying
    order[order < 0] = [i for i in live if i >= size] + joining
    return order
