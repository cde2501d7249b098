"""The serving engine's runner: it executes the scheduler's plans (scheduler.SchedulerOutput) on the
backend and decides nothing. It holds the batch in flight (its cache) and the joiners' prefill; the
decode loop (generation.decode) steps the rows, so a served row's tokens are those `gpt2x generate`
gives for the same prompt, settings and seed. What each part of a plan gave comes back as soon as
it is done (scheduler.RunnerOutput), for the scheduler to apply."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np

from ...generation import decode as loop
from ...generation.beam import beam_hypotheses
from ...generation.decode import Event
from ...generation.logprobs import LogprobEntry, token_logprobs
from ...generation.settings import Finish
from ...generation.speculative import Drafter, DraftSettings
from ...numerics import positions
from ...runtime.base import Backend, past_to_fill
from .prefix_cache import PrefixCache
from .request import Row
from .scheduler import NewRow, Regroup, RunnerOutput, SchedulerOutput, Start


@dataclass(eq=False)
class Batch(loop.Batch):
    """A batch in flight (the decode loop's, of rows): its rows, attention mask (B, W), the tokens its
    next step feeds (B,) and its cache (W positions)."""

    rows: list[Row]

    def live(self) -> list[int]:
        return [i for i, r in enumerate(self.rows) if not r.finished]


@dataclass
class Prefill:
    """A prefill under way (Runner.begin, Runner.advance): its rows, the distinct prompts that run (U)
    and which of them each row is (`index`, None when they are all distinct), the tokens to run
    (U, T), left-padded, the attention mask over the past and them (U, K + T), the cache so far, and
    how many of the T columns have run."""

    rows: list[Row]
    prompts: list[list[int]]
    index: np.ndarray | None
    ids: np.ndarray
    mask: np.ndarray
    past: Any
    done: int = 0
    # The prompts' cache as the prefix cache keeps it (KVCache.stored), taken where the ended prefill's cache is handed
    # on to its rows' (a fixed slots' reorder leaves the cache before it holding nothing); else read at the keeping.
    stored: list[np.ndarray] | None = None
    # Its last chunk's (tokens, positions), where that chunk runs in the next decode step's forward and the rows' first
    # tokens are sampled after it (Runner._joined_after_step); None otherwise.
    last: tuple[int, int] | None = None


class Runner:
    """Steps batches of rows on one backend (not thread-safe: the engine's thread only). `counters`
    is the engine's: the runner counts its model steps in it."""

    def __init__(self, backend: Backend, counters: dict[str, int], drafter: Drafter | None = None,
                 draft_settings: DraftSettings | None = None, prefix_cache: PrefixCache | None = None,
                 stepped: Callable[[int, int], None] | None = None):
        self.backend = backend
        # told after each model step: vLLM's iteration tokens (a chunk's prompt tokens, with the first tokens its
        # last chunk samples; one per live row of a decode step) and the positions its cache holds (rows x width)
        self.stepped = stepped or (lambda tokens, positions: None)
        self.prefix_cache = prefix_cache  # with capabilities.takes_past only (a past made from its blocks)
        self.counters = counters
        self.drafter = drafter
        self.draft_settings = draft_settings or DraftSettings()
        self.batch: Batch | None = None  # the batch in flight
        self.prefilling: Prefill | None = None  # the joiners' prefill under way
        self.joined: Batch | None = None  # the joiners, prefilled: merged by the next plan, or dropped
        # Prefills whose prompts' blocks the prefix cache is yet to keep: kept once their first tokens are told (a
        # 512-token prompt's copy is 37 MB at 124M fp32, which its first token need not wait for).
        self._unkept: list[Prefill] = []
        self._keeping_held = False  # the prefix cache may still be copying from the held batch's own cache

    def execute(self, plan: SchedulerOutput) -> Iterator[RunnerOutput]:
        """Run `plan`, each part's outcome yielded as soon as it is done (a draft row's tokens one by one, so that
        they are told as they come): the new rows' prompts scored and their beam searches, the batch let go at its
        end, a draft row, the regroup, a new batch's prefill (where none is held) or the joiners' (beside the one held),
        the joiners' next chunk, the decode step of the batch's rows scheduled."""
        if self._keeping_held and not self._decode_only(plan):  # it may write the cache the prefix cache copies from
            self._settle()
        joined, self.joined = self.joined, None  # the joiners prefilled: merged by this plan's regroup, or dropped
        starts: dict[Start, list[NewRow]] = {}
        for n in plan.scheduled_new_reqs:
            starts.setdefault(n.start, []).append(n)
        yield from self._scored_and_searched(plan.scheduled_new_reqs)
        if plan.finished_req_ids and plan.regroup is None and self.batch is not None \
                and set(self.batch.rows) <= set(plan.finished_req_ids):
            self.reset()  # every row has left: the batch's end
        for n in starts.get(Start.draft, []):
            yield from self._drafted(n.row)
        if plan.regroup is not None:  # before the joiners begin: the rows that left free their cache (fixed slots) first
            self._regroup(plan.regroup, joined)
        prefill = starts.get(Start.prefill, [])
        if prefill and self.batch is None:
            yield from self._new_batch(prefill, starts.get(Start.after, []))
            self._keep_unkept(held=True)
        else:
            yield from self._join(plan, prefill)
        if self.batch is not None and not set(self.batch.rows).isdisjoint(plan.scheduled_cached_reqs):
            yield from self._decode()

    def _decode_only(self, plan: SchedulerOutput) -> bool:
        """Whether `plan` is the held batch's decode step and nothing else: no row taken, leaving or regrouped, no
        prefill under way or joined."""
        return not (plan.scheduled_new_reqs or plan.finished_req_ids or plan.regroup is not None
                    or self.prefilling is not None or self.joined is not None)

    def _settle(self) -> None:
        if self.prefix_cache is not None:
            self.prefix_cache.settle()
        self._keeping_held = False

    def _scored_and_searched(self, new: tuple[NewRow, ...]) -> Iterator[RunnerOutput]:
        """The new rows' prompts scored where they ask, then their beam searches, each whole."""
        for n in new:
            if n.scored:
                yield RunnerOutput(prompt_logprobs={n.row: self.score(n.row)})
        for n in new:
            if n.start is Start.search:
                yield RunnerOutput(hypotheses={n.row: self.search(n.row)})

    def _drafted(self, row: Row) -> Iterator[RunnerOutput]:
        """A row decoded with the draft, a batch of its own, each token yielded as it is accepted."""
        self.counters["batches"] += 1
        for event in self.speculative(row):
            yield RunnerOutput((row,), (event,))

    def _new_batch(self, first: list[NewRow], later: list[NewRow]) -> Iterator[RunnerOutput]:
        """A new batch prefilled whole: its first rows, their first tokens told, then the rows that wait for their
        prefill (Start.after), merged into the batch after them."""
        self.counters["batches"] += 1
        batch, events = self.prefill([n.row for n in first], all(n.cached for n in first))
        yield RunnerOutput(batch.rows, events)
        if later:  # (no batch is held meanwhile: the later prefill runs whole, as a new batch's)
            self._keep_unkept()  # the later rows' prefill may read these prompts' blocks
            joined, events = self.prefill([n.row for n in later], all(n.cached for n in later))
            for unkept in self._unkept:  # read before the merge hands their cache on
                self._read_blocks_now(unkept)
            width = max(batch.mask.shape[1], joined.mask.shape[1])
            batch = self.merge(batch, joined, np.arange(len(first) + len(later)), width)
            yield RunnerOutput(joined.rows, events)
        self.batch = batch

    def _join(self, plan: SchedulerOutput, joiners: list[NewRow]) -> Iterator[RunnerOutput]:
        """The joiners' prefill: begun for `joiners` (rows just taken, beside the batch held); its next chunk of the
        columns scheduled where its rows are."""
        if joiners:
            self.counters["joins"] += 1
            self.prefilling = self.begin([n.row for n in joiners], all(n.cached for n in joiners))
        elif self.prefilling is None or self.prefilling.rows[0] not in plan.scheduled_cached_reqs:
            return
        done = self.advance(self.prefilling, max(plan.num_scheduled_tokens[r] for r in self.prefilling.rows))
        if done is not None:
            self.prefilling = None
            self.joined, events = done
            yield RunnerOutput(self.joined.rows, events, joined=True)
            self._keep_unkept()

    def _regroup(self, regroup: Regroup, joined: Batch | None) -> None:
        """The batch laid out as `regroup` says, the joiners in where its order takes them, else a compaction."""
        joins = joined is not None and int(regroup.order.max()) >= len(self.batch.rows)
        if not joins:
            self.counters["compactions"] += 1
        self.batch = self.merge(self.batch, joined if joins else None, regroup.order, regroup.width)

    def _decode(self) -> Iterator[RunnerOutput]:
        """A decode step of the batch; whether it ran the model (rows cancelled meanwhile end without one)."""
        width = self.batch.mask.shape[1]
        events = self.step(self.batch)
        yield RunnerOutput(self.batch.rows, events, stepped=self.batch.mask.shape[1] > width)
        yield from self._joined_after_step()

    def _joined_after_step(self) -> Iterator[RunnerOutput]:
        """The joiners whose last chunk ran in this decode step's forward (Prefill.last): their first tokens sampled from
        its logits (backend.later_logits), the joined rows held for the next plan to merge."""
        prefill = self.prefilling
        if prefill is None or prefill.last is None:
            return
        self.prefilling = None
        logits = self.backend.later_logits(prefill.past)  # (U, V)
        nxt, events = loop.sample_rows(prefill.rows, logits if prefill.index is None else logits[prefill.index])
        self.joined, events = self._ended(prefill, nxt, events, *prefill.last)
        yield RunnerOutput(self.joined.rows, events, joined=True)
        self._keep_unkept()

    def reset(self) -> None:
        """Let go of every batch held (the batch ended, or failed)."""
        self._settle()
        self.batch = self.prefilling = self.joined = None
        self._unkept.clear()

    def prefill(self, rows: list[Row], cached: bool = True) -> tuple[Batch, list[Event]]:
        """The rows as a new batch, prefilled whole (`begin`, then `advance` to the end), from the prefix cache's blocks
        where `cached`."""
        result = self.advance(self.begin(rows, cached), None)
        assert result is not None
        return result

    def begin(self, rows: list[Row], cached: bool = True) -> Prefill:
        """The rows' prefill, planned and not yet run (`advance` runs it). Rows with the same prompt ids
        (a request's n choices) are prefilled once: the distinct prompts run, and their cache rows
        (`KVCache.reorder`), mask rows and logits are duplicated for the others at the end. (On a
        backend whose cache rows do not move, capabilities.joins_rows False, every row is prefilled:
        onnxruntime-genai reorders by replaying, which would prefill them all again.)

        With a prefix cache and `cached` (the scheduler's choice), each distinct prompt's leading blocks held there
        are its past: the prefill runs on T columns, T the longest rest of a prompt after its cached blocks, every
        row fed its last T tokens (or all of them, left-padded) and its tokens before those taken from the prefix
        cache, so that each row's tokens stay contiguous and right-aligned (as in any left-padded batch).
        `row.cached_tokens` says how many tokens each row took from it."""
        prompts, index = self._distinct([r.prompt_ids for r in rows])
        cache = self.prefix_cache
        hits = [cache.lookup(p, cached) for p in prompts] if cache is not None else [[] for _ in prompts]
        block = cache.block_tokens if cache is not None else 0
        T = max(len(p) - len(h) * block for p, h in zip(prompts, hits))  # columns to run
        cached = [max(0, len(p) - T) for p in prompts]  # tokens before a row's last T: from the prefix cache
        ids, run_mask = loop.left_pad([p[c:] for p, c in zip(prompts, cached)])  # (U, T)
        K = max(cached)
        past = self._past(hits, cached) if K else None
        past_mask = (np.arange(K)[None, :] >= K - np.asarray(cached)[:, None]).astype(np.int64)  # (U, K)
        for row, c in zip(rows, cached if index is None else [cached[i] for i in index]):
            row.cached_tokens = c
        return Prefill(rows, prompts, index, ids, np.concatenate([past_mask, run_mask], axis=1), past)

    def _distinct(self, prompts: list[list[int]]) -> tuple[list[list[int]], np.ndarray | None]:
        """The prompts a prefill runs, each distinct one once where the backend's cache rows move, and which of them
        each row is (None: every row runs its own)."""
        if not self.backend.capabilities.joins_rows:
            return prompts, None
        distinct: dict[tuple[int, ...], int] = {}
        which = [distinct.setdefault(tuple(p), len(distinct)) for p in prompts]
        if len(distinct) == len(prompts):
            return prompts, None
        return [list(p) for p in distinct], np.asarray(which, dtype=np.int64)

    def _past(self, hits: list[list[Any]], cached: list[int]) -> Any:
        """The backend's past made of the prefix cache's blocks (`hits`), each prompt's first `cached` tokens
        right-aligned to the longest."""
        K = max(cached)
        first = next(h for h in hits if h)[0].kv
        layers, heads, _, dim = first.shape
        # Written straight into the buffers the backend's next cache holds, where it offers them (one 37 MB copy fewer
        # for a 512-token past of 124M fp32). Not zero-filled: gather writes each row's last `cached` columns, and
        # only the columns left of them (a shorter row's padding) are zeroed.
        kv, finish = past_to_fill(self.backend, (len(hits), heads, K, dim), layers, first.dtype)  # 2L x (U, H, K, D)
        for u, (h, c) in enumerate(zip(hits, cached)):
            for a in kv:
                a[u, :, : K - c] = 0
            if c:
                self.prefix_cache.gather(h, c, kv, u)
        return finish()

    def advance(self, prefill: Prefill, columns: int | None) -> tuple[Batch, list[Event]] | None:
        """Run the next chunk of a prefill: `columns` of its left-padded prompts (the scheduler's num_scheduled_tokens),
        or fewer where fewer are left, or all that is left (None). When its last column has run, each row's first token
        is sampled: the batch and the events (its prompts' whole blocks kept in the prefix cache once they are told,
        `_keep_unkept`); before that, None. Where chunks mix and rows run, the last chunk too runs in the next decode
        step's forward, and the rows' first tokens come after that step (`_joined_after_step`): None here."""
        T = prefill.ids.shape[1]
        cols = T - prefill.done if columns is None else min(T - prefill.done, columns)
        K = prefill.mask.shape[1] - T
        upto = K + prefill.done + cols
        mask = prefill.mask[:, :upto]
        ids = prefill.ids[:, prefill.done : prefill.done + cols]
        ran = int(mask[:, K + prefill.done :].sum())
        prefill.done += cols
        later = self.backend.capabilities.mixes_chunks  # run in the next decode step's forward
        # The last chunk too where a decode step follows (rows run beside), the first tokens sampled after it: it then
        # costs the rows no forward of its own.
        if prefill.done < T or (later and self.batch is not None and any(not r.finished for r in self.batch.rows)):
            if later:
                prefill.past = self.backend.step_later(ids, mask, positions(mask, cols), prefill.past)
            else:
                _, prefill.past = self.backend.step(ids, mask, positions(mask, cols), prefill.past)
            if prefill.done < T:
                self._ran(ran, mask.size)
            else:
                prefill.last = (ran, mask.size)
            return None
        # The last chunk: the decode loop's step, each row's first token (a prompt run once, told to each of its rows).
        nxt, prefill.past, events = loop.step_rows(self.backend, prefill.rows, ids, mask, positions(mask, cols),
                                                       prefill.past, prefill.index)
        return self._ended(prefill, nxt, events, ran, mask.size)

    def _ended(self, prefill: Prefill, nxt: np.ndarray, events: list[Event], ran: int,
               held: int) -> tuple[Batch, list[Event]]:
        """A prefill whose last chunk has run and whose rows' first tokens are sampled (`nxt`, `events`): its last
        step told (`ran` prompt tokens over `held` positions), its rows as a batch, its prompts' blocks to keep."""
        # vLLM's iteration tokens: the prompt tokens run and the tokens sampled (each row's first, its end of text too)
        self._ran(ran + sum(e.token is not None or e.finish in (Finish.eos, Finish.stop) for e in events), held)
        self._unkept.append(prefill)  # kept once the first tokens are told (_keep_unkept)
        mask, past = prefill.mask, prefill.past
        if prefill.index is not None:
            self._read_blocks_now(prefill)  # before the reorder hands its cache on
            mask, past = mask[prefill.index], past.reorder(prefill.index)  # (B, W), B rows
        return Batch(prefill.rows, mask, nxt, past), events

    def _read_blocks_now(self, prefill: Prefill) -> None:
        """The prefill's cache as the prefix cache keeps it (Prefill.stored), read now where a prefix cache will keep
        it: its cache is about to be handed on to other rows' (a fixed slots' reorder or merge leaves it holding
        nothing)."""
        if self.prefix_cache is not None and prefill.stored is None:
            prefill.stored = prefill.past.stored()

    def _keep_unkept(self, held: bool = False) -> None:
        """The prefills' blocks handed to the prefix cache (`_keep_prefixes`). `held`: their cache is the held batch's,
        which a plan other than its decode step may write (a regroup, a row's slot freed), so that such a plan waits
        for the copy first; a joiners' cache is only read by the merge, and then let go."""
        for prefill in self._unkept:
            self._keep_prefixes(prefill, held)
        self._unkept.clear()

    def _keep_prefixes(self, prefill: Prefill, held: bool = False) -> None:
        """The prompts' whole blocks that the prefix cache lacks, copied into it from the prefill's cache on the
        cache's thread (PrefixCache.keep_later) while the next decode step runs, which writes only new positions;
        anything else that writes the batch's cache, or reads the prefix cache, waits for it first (`execute`)."""
        cache = self.prefix_cache
        if cache is None:
            return
        new = [(u, p) for u, p in enumerate(prefill.prompts) if cache.lacks(p)]
        if new:  # an int8 cache's bytes: no float copy before the first tokens go out
            stored = prefill.past.stored() if prefill.stored is None else prefill.stored
            cache.keep_later(new, stored, prefill.mask.shape[1])  # the copy before, settled
            self._keeping_held = held

    def step(self, batch: Batch) -> list[Event]:
        """One decode step of the batch (generation.decode.step): rows cancelled meanwhile end, and the
        others run and give their next tokens."""
        return loop.step(self.backend, batch, lambda live: self._ran(live, batch.mask.size))

    def _ran(self, tokens: int, held: int) -> None:
        """A model step ran `tokens` tokens over a cache of `held` positions (rows x width): counted, told."""
        self.counters["steps"] += 1
        self.stepped(tokens, held)

    def merge(self, batch: Batch, joined: Batch | None, order: np.ndarray, width: int) -> Batch:
        """The batch whose row i is row order[i] of `batch`'s rows and `joined`'s (numbered after
        them), every row's mask and cache right-aligned to `width` positions. `batch.past` is not used
        afterwards (a cache may reuse its buffers)."""
        rows = batch.rows + ([] if joined is None else joined.rows)
        jmask = np.zeros((0, 1), dtype=np.int64) if joined is None else joined.mask
        jnxt = np.zeros(0, dtype=np.int64) if joined is None else joined.nxt
        n = len(batch.rows)
        # The width is the scheduler's, from its own view of the rows' columns: a column a kept row uses, dropped,
        # would change its tokens silently, so it fails the batch instead.
        for m, kept in ((batch.mask, order[order < n]), (jmask, order[order >= n] - n)):
            if m.shape[1] > width and m[kept, : m.shape[1] - width].any():
                raise RuntimeError(f"a regroup {width} columns wide would drop columns its rows use")
        mask = np.concatenate([_fit(batch.mask, width), _fit(jmask, width)])[order]
        past = batch.past.merge(order, None if joined is None else joined.past, width)
        return Batch([rows[i] for i in order], mask, np.concatenate([batch.nxt, jnxt])[order], past)

    def score(self, row: Row) -> list[LogprobEntry]:
        """The prompt's logprobs: one forward of the prompt alone, no cache, every position's logits;
        position t's distribution scores token t + 1 (the first token has none). The k most likely
        tokens listed are as many as the row's logprobs or prompt_k ask for, whichever is more; each
        prompt token's rank (1: the most likely) is left in `row.prompt_ranks`."""
        ids = np.asarray([row.prompt_ids], dtype=np.int64)
        mask = np.ones_like(ids)
        logits, _ = self.backend.run(ids, mask, positions(mask, ids.shape[1]), None)
        self.counters["steps"] += 1
        scores = logits[0, :-1]  # (T - 1, V): a rank by the logits is the rank by log_softmax
        chosen = scores[np.arange(len(scores)), row.prompt_ids[1:]]
        row.prompt_ranks = [None] + [int(r) + 1 for r in (scores > chosen[:, None]).sum(axis=-1)]
        k = max(row.logprobs or 0, row.prompt_k or 0)
        return [(row.prompt_ids[0], None, None)] + token_logprobs(scores, row.prompt_ids[1:], k)

    def search(self, row: Row) -> list[tuple[list[int], Finish]]:
        """A beam search row's best hypotheses, as many as its beam_rows (the API's use_beam_search),
        searched whole (generation.beam: transformers' beam search)."""
        hypotheses = beam_hypotheses(self.backend, row.prompt_ids, row.settings, len(row.beam_rows))
        self.counters["steps"] += 1
        return hypotheses

    def speculative(self, row: Row) -> Iterator[Event]:
        """One row decoded with the draft (generation.decode.decode: a round's tokens accepted one at a
        time as they are read, so a row cancelled meanwhile ends at its next token and runs no further
        round). Each round is counted before its first token comes out: the prefill and every round
        one target step, the draft's drafted and accepted tokens and its verifications (`drafts`)."""
        counted = dict.fromkeys(("steps", "drafted", "accepted", "drafts"), 0)
        for event in loop.decode(self.backend, [row], self.drafter, self.draft_settings):
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
