"""The serving scheduler's plans on hand-built arrivals, with no backend: a stand-in for the runner
(`Shapes`) does to the batches' shapes what runner.Runner.execute does (widths and the columns each
row uses), every row sampling a token that is not end of text, and hands the scheduler what it gave
(`Scheduler.update_from_output`); a fake clock times the joins."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import pytest

from gpt2x.errors import UsageError
from gpt2x.generation.decode import Event
from gpt2x.generation.settings import Finish, SamplingSettings
from gpt2x.serve.core.outputs import Failed, Finished, PromptLogprobs, TokenOut
from gpt2x.serve.core.request import Row
from gpt2x.serve.core.scheduler import EngineSettings, NewRow, RowOutput, RunnerOutput, Scheduler, SchedulerOutput, Start

TOKEN = 11  # what every row samples: never end of text


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


class Shape:
    """A batch's shape by hand: rows, the cache's width, and the columns each row uses."""

    def __init__(self, rows: list[Row], width: int, cols: list[int]):
        self.rows, self.width, self.cols = rows, width, cols


class Shapes:
    """The runner's part, on shapes: a prefill is as wide as its longest prompt and samples each row's first token,
    a chunk runs the columns scheduled (fewer where fewer are left), a regroup right-aligns the rows to its width
    (never dropping a column a kept row uses), a decode step ends the rows cancelled meanwhile and, unless none is
    left, adds a column and samples a token for every live row. What it gave goes to update_from_output, whose
    outputs are kept (`told`)."""

    def __init__(self, scheduler: Scheduler):
        self.scheduler = scheduler
        self.batch: Shape | None = None
        self.joined: Shape | None = None
        self.prefilling: tuple[list[Row], int] | None = None
        self.columns: list[int] = []  # the columns each chunk of a joiners' prefill ran
        # Where chunks mix (the fixed slots), the last chunk runs in the decode step's forward: the joiners come after it
        self.mixes = scheduler.mixes
        self.told: list[RowOutput] = []

    def run(self, plan: SchedulerOutput) -> SchedulerOutput:
        self.told += self.scheduler.update_from_output(plan, self.execute(plan))
        return plan

    def execute(self, plan: SchedulerOutput) -> Iterator[RunnerOutput]:
        joined, self.joined = self.joined, None
        new = {n.start: [m.row for m in plan.scheduled_new_reqs if m.start is n.start] for n in plan.scheduled_new_reqs}
        for n in plan.scheduled_new_reqs:
            if n.scored:
                yield RunnerOutput(prompt_logprobs={n.row: [(n.row.prompt_ids[0], None, None)]})
        for row in new.get(Start.search, []):
            yield RunnerOutput(hypotheses={row: []})  # none finished: every one of its rows ends
        if plan.finished_req_ids and plan.regroup is None and set(self.batch.rows) <= set(plan.finished_req_ids):
            self.batch = self.prefilling = None
        for row in new.get(Start.draft, []):
            while not row.finished:
                yield RunnerOutput([row], [Event(0, *row.accept(TOKEN))])
        prefill = new.get(Start.prefill, [])
        if prefill and self.batch is None:
            self.batch = prefilled(prefill + new.get(Start.after, []))
            yield RunnerOutput(self.batch.rows, first_tokens(self.batch.rows))
        else:
            yield from self.join(plan, prefill)
        if plan.regroup is not None:
            b, o = self.batch, plan.regroup
            joins = joined is not None and max(o.order) >= len(b.rows)
            rows = b.rows + (joined.rows if joins else [])
            cols = b.cols + (joined.cols if joins else [])
            assert o.width >= max(cols[i] for i in o.order)  # no column a row uses is dropped
            self.batch = Shape([rows[i] for i in o.order], o.width, [cols[i] for i in o.order])
        if self.batch is not None and not set(self.batch.rows).isdisjoint(plan.scheduled_cached_reqs):
            yield from self.decode()

    def join(self, plan: SchedulerOutput, joiners: list[Row]) -> Iterator[RunnerOutput]:
        if joiners:
            self.prefilling = (joiners, 0)
        elif self.prefilling is None or self.prefilling[0][0] not in plan.scheduled_cached_reqs:
            return
        rows, done = self.prefilling
        width = max(len(r.prompt_ids) for r in rows)
        cols = min(width - done, max(plan.num_scheduled_tokens[r] for r in rows))
        assert all(plan.num_scheduled_tokens[r] == cols for r in rows)  # one prefill: every row runs as many
        self.columns.append(cols)
        self.prefilling = (rows, done + cols)
        if done + cols == width and not (self.mixes and any(not r.finished for r in self.batch.rows)):
            yield self.prefill_ended()

    def prefill_ended(self) -> RunnerOutput:
        self.joined, self.prefilling = prefilled(self.prefilling[0]), None
        return RunnerOutput(self.joined.rows, first_tokens(self.joined.rows), joined=True)

    def decode(self) -> Iterator[RunnerOutput]:
        b = self.batch
        events = [Event(i, None, r.cancelled) for i, r in enumerate(b.rows) if not r.finished and r.cancelled]
        for e in events:
            b.rows[e.row].finish = e.finish
        if all(r.finished for r in b.rows):
            yield RunnerOutput(b.rows, events)  # no model step: the cache is as wide as it was
        else:
            b.width += 1
            b.cols = [c + 1 for c in b.cols]
            events += [Event(i, *r.accept(TOKEN)) for i, r in enumerate(b.rows) if not r.finished]
            yield RunnerOutput(b.rows, events, stepped=True)
        if self.prefilling is not None and self.prefilling[1] == max(len(r.prompt_ids) for r in self.prefilling[0]):
            yield self.prefill_ended()  # its last chunk ran in this step's forward

    def step(self) -> SchedulerOutput:
        return self.run(self.scheduler.schedule())


def prefilled(rows: list[Row]) -> Shape:
    return Shape(rows, max(len(r.prompt_ids) for r in rows), [len(r.prompt_ids) for r in rows])


def first_tokens(rows: list[Row]) -> list[Event]:
    return [Event(i, *r.accept(TOKEN)) for i, r in enumerate(rows)]


def decode(rows: list[Row]) -> SchedulerOutput:
    """The plan of a decode step of these rows, the batch as it is."""
    return SchedulerOutput(scheduled_cached_reqs=tuple(rows), num_scheduled_tokens=dict.fromkeys(rows, 1))


def prefill(rows: list[Row], tokens: int = 4) -> SchedulerOutput:
    """The plan of a new batch of these rows (prompts of `tokens`), prefilled whole."""
    return SchedulerOutput(tuple(NewRow(r, Start.prefill) for r in rows), num_scheduled_tokens=dict.fromkeys(rows, tokens))


def taken(plan: SchedulerOutput, start: Start = Start.prefill) -> list[Row]:
    """The rows a plan takes from the queue that start as `start`."""
    return [n.row for n in plan.scheduled_new_reqs if n.start is start]


def row(prompt: int = 4, tokens: int = 10, clock: Clock | None = None, **kw) -> Row:
    r = Row(list(range(1, prompt + 1)), SamplingSettings(max_new_tokens=tokens), lambda out: None, **kw)
    if clock is not None:
        r.queued_at = clock()
    return r


def engine(n_positions: int = 256, clock: Clock | None = None, mixes: bool = False,
           **settings) -> tuple[Scheduler, Shapes]:
    scheduler = Scheduler(EngineSettings(**{"max_join_delay_s": 0.05, **settings}), n_positions,
                          clock=clock or Clock(), mixes=mixes)
    return scheduler, Shapes(scheduler)


def running(n: int, clock: Clock, tokens: int = 10, **settings) -> tuple[Scheduler, Shapes, list[Row]]:
    """A scheduler whose batch of n rows (prompts of 4, `tokens` tokens each) has been prefilled."""
    scheduler, shapes = engine(clock=clock, **settings)
    rows = [row(tokens=tokens, clock=clock) for _ in range(n)]
    scheduler.submit(rows)
    assert shapes.step() == prefill(rows)
    return scheduler, shapes, rows


def test_a_new_batch_is_the_rows_waiting_prefilled_whole():
    scheduler, shapes = engine(max_batch_size=3)
    rows = [row(), row(), row(), row()]
    scheduler.submit(rows)
    plan = shapes.step()
    assert plan == prefill(rows[:3]) and plan.total_num_scheduled_tokens == 12  # the batch is full: the fourth waits
    assert scheduler.running == 3 and scheduler.in_flight == rows[:3]
    assert all(r.scheduled_at == 1000.0 for r in rows[:3]) and rows[3].scheduled_at is None
    assert scheduler.counts() == (3, 1)


def test_rows_taken_are_scored_searched_or_ended_before_their_prefill():
    scheduler, shapes = engine()
    plain, scored = row(), row(prompt_logprobs=True)
    only_scored = row(prompt_logprobs=True, max_tokens=0)
    gone = row()
    beam = Row([1, 2], SamplingSettings(max_new_tokens=3, num_beams=2), lambda out: None)
    beam.beam_rows = [beam, row()]
    scheduler.submit([plain, gone, scored, only_scored, beam])
    gone.cancel()  # its client left while it waited: it is not taken
    plan = shapes.step()
    assert plan.scheduled_new_reqs == (NewRow(plain, Start.prefill), NewRow(scored, Start.prefill, scored=True),
                                       NewRow(only_scored, Start.end, scored=True, reason=Finish.length),
                                       NewRow(beam, Start.search))
    assert plan.num_scheduled_tokens == {plain: 4, scored: 4}
    assert scheduler.in_flight == [plain, scored, only_scored, beam]
    # what the scored-only row is told: its prompt's logprobs, then its end; the beam search's rows, theirs
    assert [t.output for t in shapes.told if t.row is only_scored] == [PromptLogprobs([(1, None, None)]),
                                                                       Finished(Finish.length)]
    assert [(t.row, t.output, t.ends) for t in shapes.told if t.row in beam.beam_rows] == [
        (r, Finished(Finish.length), True) for r in beam.beam_rows]


def test_a_draft_decodes_a_lone_row_without_logprobs_speculatively():
    scheduler, shapes = engine(max_batch_size=1)
    scheduler.speculative = True
    plain, with_logprobs = row(), row(logprobs=2)
    scheduler.submit([plain, with_logprobs])
    assert shapes.step() == SchedulerOutput((NewRow(plain, Start.draft),), num_scheduled_tokens={plain: 4})
    assert plain.tokens == [TOKEN] * 10 and [t.output for t in shapes.told][-2:] == [
        TokenOut(TOKEN, None, Finish.length), Finished(Finish.length)]  # told token by token, then its end
    assert shapes.step() == prefill([with_logprobs])  # decoded plainly: the target's logprobs


def test_a_join_is_due_when_a_quarter_of_the_batch_waits():
    clock = Clock()
    scheduler, shapes, rows = running(8, clock)
    late = row(clock=clock)
    scheduler.submit([late])
    assert shapes.step() == decode(rows)  # one waits, 8 // 4 = 2 needed, and it has not waited long
    second = row(clock=clock)
    scheduler.submit([second])
    plan = shapes.step()
    assert plan == SchedulerOutput((NewRow(late, Start.prefill), NewRow(second, Start.prefill)),
                                   num_scheduled_tokens={late: 4, second: 4})  # one prompt, its 4 columns
    assert scheduler.in_flight == rows + [late, second] and scheduler.running == 10


def test_a_join_is_due_when_the_oldest_has_waited_max_join_delay():
    clock = Clock()
    scheduler, shapes, rows = running(8, clock)
    late = row(clock=clock)
    scheduler.submit([late])
    clock.now += 0.04
    assert shapes.step() == decode(rows)
    clock.now += 0.02
    assert taken(shapes.step()) == [late]


def test_no_join_without_continuous_batching_or_when_the_batch_is_full():
    clock = Clock()
    scheduler, shapes, rows = running(2, clock, continuous=False)
    scheduler.submit([row(clock=clock)])
    clock.now += 1
    assert shapes.step() == decode(rows) and scheduler.counts() == (2, 1)
    scheduler, shapes, rows = running(2, clock, max_batch_size=2)
    scheduler.submit([row(clock=clock)])
    clock.now += 1
    assert shapes.step() == decode(rows)
    assert not Scheduler(EngineSettings(), 256, joins_rows=False).joins  # a cache that takes no rows: static


def test_joiners_are_prefilled_a_chunk_before_each_step_then_join():
    """A 40-token prompt joining a running row in chunks of 16: 16, 16 and 8 columns, each chunk
    followed by the batch's step, then the regroup that brings the joiner in before the next step."""
    clock = Clock()
    scheduler, shapes, rows = running(1, clock, prefill_chunk=16)
    joiner = row(prompt=40, clock=clock)
    scheduler.submit([joiner])
    plans = [shapes.step() for _ in range(7)]
    assert [p.num_scheduled_tokens.get(joiner) for p in plans] == [16, None, 16, None, 8, 1, 1]
    assert [rows[0] in p.scheduled_cached_reqs for p in plans] == [False, True, False, True, False, True, True]
    assert taken(plans[0]) == [joiner] and all(not p.scheduled_new_reqs for p in plans[1:])
    assert plans[2].scheduled_cached_reqs == plans[4].scheduled_cached_reqs == (joiner,)  # its prefill continues
    assert shapes.columns == [16, 16, 8]
    assert [p.regroup is not None for p in plans] == [False] * 5 + [True, False]
    regroup = plans[5].regroup
    assert regroup.order.tolist() == [0, 1] and regroup.width == 40
    assert shapes.batch.rows == [rows[0], joiner] and scheduler.in_flight == [rows[0], joiner]


def test_a_step_token_budget_leaves_the_chunk_what_the_rows_running_do_not_take():
    """max_num_batched_tokens (vLLM's): 3 rows running, a budget of 10: chunks of 7 columns; once one row has ended, of 8."""
    clock = Clock()
    scheduler, shapes, rows = running(3, clock, prefill_chunk=64, max_num_batched_tokens=10, max_join_delay_s=0)
    joiner = row(prompt=30, clock=clock)
    scheduler.submit([joiner])
    plans = [shapes.step(), shapes.step()]
    rows[0].cancel()
    plans += [shapes.step() for _ in range(5)]
    assert [p.num_scheduled_tokens.get(joiner) for p in plans if joiner in p.num_scheduled_tokens][:4] == [7, 7, 8, 8]
    assert shapes.columns == [7, 7, 8, 8]
    with pytest.raises(UsageError, match="max_num_batched_tokens must be >= 1"):
        EngineSettings(max_num_batched_tokens=0)


def test_joiners_share_a_chunk_and_run_whole_when_no_row_runs():
    clock = Clock()
    scheduler, shapes, rows = running(2, clock, prefill_chunk=16, max_join_delay_s=0)
    joiners = [row(prompt=40, clock=clock), row(prompt=30, clock=clock)]
    scheduler.submit(joiners)
    assert shapes.step().num_scheduled_tokens == dict.fromkeys(joiners, 8) and shapes.columns == [8]  # two prompts
    rows[0].cancel()
    shapes.step()  # its step ends it (cancelled)
    assert rows[0].finished
    plan = shapes.step()  # 2 joiners, 1 row running: the rest at once
    assert plan.num_scheduled_tokens == dict.fromkeys(joiners, 32) and shapes.columns == [8, 32]
    plan = shapes.step()
    assert sorted(plan.regroup.order.tolist()) == [1, 2, 3] and plan.finished_req_ids == (rows[0],)  # row 0 left out
    assert plan.scheduled_cached_reqs == tuple(shapes.batch.rows) and set(plan.scheduled_cached_reqs) == {rows[1], *joiners}
    scheduler, shapes, rows = running(1, clock, prefill_chunk=0, max_join_delay_s=0)
    joiner = row(prompt=40, clock=clock)
    scheduler.submit([joiner])
    assert shapes.step().num_scheduled_tokens == {joiner: 40} and shapes.columns == [40]  # chunking off: whole


def test_joiners_that_outnumber_the_rows_running_are_prefilled_whole():
    """A wave of requests joining one row (vllm bench serve's closed loop): one prefill, not a chunk a step; as many
    joiners as rows running are still chunked."""
    clock = Clock()
    scheduler, shapes, rows = running(1, clock, prefill_chunk=16, max_join_delay_s=0)
    wave = [row(prompt=32, clock=clock) for _ in range(3)]
    scheduler.submit(wave)
    plan = shapes.step()
    assert taken(plan) == wave and plan.num_scheduled_tokens == dict.fromkeys(wave, 32) and shapes.columns == [32]
    assert shapes.step().scheduled_cached_reqs == (rows[0], *wave)  # brought in at the batch's next step
    scheduler, shapes, rows = running(3, clock, prefill_chunk=16, max_join_delay_s=0)
    wave = [row(prompt=32, clock=clock) for _ in range(3)]
    scheduler.submit(wave)
    plan = shapes.step()
    assert plan.num_scheduled_tokens == dict.fromkeys(wave, 16) and shapes.columns == [16]  # one prompt, run once


def test_where_chunks_mix_into_the_decode_step_a_long_prompt_joins_alone_and_a_lone_joiner_is_chunked():
    """On a backend that runs a joiners' chunk in its decode step's forward (the fixed slots): a prompt longer than a
    chunk joins alone (the queue waits behind it), and a lone joiner is chunked even beside fewer rows running, where
    several short ones run whole, in one forward (each chunk of several would be a forward of its own). The last chunk
    runs in the decode step's forward too: the joiners' first tokens come after that step, and the next step's plan
    brings them in (its regroup), with no joiners' plan between."""
    clock = Clock()
    scheduler, shapes, rows = running(4, clock, prefill_chunk=16, max_join_delay_s=0, mixes=True)
    wave = [row(prompt=6, clock=clock), row(prompt=10, clock=clock), row(prompt=40, clock=clock), row(prompt=6, clock=clock)]
    scheduler.submit(wave)  # as many as the rows running: not a wave
    plans = [shapes.step() for _ in range(11)]
    assert [taken(p) for p in plans] == [wave[:2], [], [], [wave[2]], [], [], [], [], [], [], [wave[3]]]
    assert plans[0].num_scheduled_tokens == dict.fromkeys(wave[:2], 10)  # two short joiners: whole
    assert plans[1] == decode(rows) and plans[2].regroup.order.tolist() == list(range(6))  # in after that step
    # alone, a chunk a step, then in at the step after its last
    assert [p.num_scheduled_tokens.get(wave[2]) for p in plans[3:10]] == [16, None, 16, None, 8, None, 1]
    assert [p.regroup is not None for p in plans[3:10]] == [False] * 6 + [True]
    assert shapes.columns == [10, 16, 16, 8, 6]
    for mixes in (True, False):  # more rows waiting than running (a wave): all of them, whole, in one forward
        scheduler, shapes, rows = running(1, clock, prefill_chunk=16, max_join_delay_s=0, mixes=mixes)
        scheduler.submit(wave := [row(prompt=6, clock=clock), row(prompt=10, clock=clock), row(prompt=40, clock=clock)])
        plan = shapes.step()
        assert taken(plan) == wave and plan.num_scheduled_tokens == dict.fromkeys(wave, 40) and shapes.columns == [40]


def test_where_chunks_mix_a_few_long_prompts_join_a_lone_row_one_at_a_time_and_many_as_a_wave():
    """Long prompts (over PREFILL_CHUNK tokens) waiting beside one row running, where chunks mix: two (at most twice the
    rows running and one) join one at a time, chunked, so that the row keeps streaming (two 545-token prompts joining
    whole stopped it for 1.4 s on an AMD EPYC with AVX2); four are a wave, whole, in one forward. Short prompts are a
    wave from two (the test above)."""
    def long_rows(n: int) -> list[Row]:
        made = [row(prompt=300, clock=clock) for _ in range(n)]
        for k, r in enumerate(made):  # prompts of their own: no prefix shared
            r.prompt_ids = [1000 * (k + 1) + t for t in r.prompt_ids]
        return made

    clock = Clock()
    settings = dict(tokens=200, n_positions=1024, prefill_chunk=64, max_join_delay_s=0, mixes=True)
    scheduler, shapes, rows = running(1, clock, **settings)
    joiners = long_rows(2)
    scheduler.submit(joiners)
    plans = [shapes.step() for _ in range(3)]
    assert taken(plans[0]) == joiners[:1] and plans[0].num_scheduled_tokens == {joiners[0]: 64}
    assert plans[1] == decode(rows) and plans[2].num_scheduled_tokens == {joiners[0]: 64}  # the row keeps stepping
    scheduler, shapes, rows = running(1, clock, **settings)
    wave = long_rows(4)
    scheduler.submit(wave)
    plan = shapes.step()
    assert taken(plan) == wave and plan.num_scheduled_tokens == dict.fromkeys(wave, 300) and shapes.columns == [300]


def test_the_batch_regroups_when_half_of_it_has_finished():
    clock = Clock()
    scheduler, shapes, rows = running(4, clock)
    rows[1].cancel()
    assert shapes.step() == decode(rows) and rows[1].finished  # ended by this step
    rows[3].cancel()
    plan = shapes.step()
    assert plan == decode([rows[0], rows[2], rows[3]]) and rows[3].finished  # one of four finished: it rode along
    plan = shapes.step()  # two of four: compacted away
    assert plan.finished_req_ids == (rows[1], rows[3]) and plan.scheduled_cached_reqs == (rows[0], rows[2])
    assert plan.regroup.order.tolist() == [0, 2] and shapes.batch.rows == [rows[0], rows[2]]
    assert scheduler.running == 2


def test_where_rows_leave_at_no_cost_a_finished_row_leaves_at_the_next_step():
    """A cache whose merge moves nothing (the fixed slots: frees_rows): one finished row of four is compacted away at
    once, not carried to half the batch."""
    clock = Clock()
    scheduler, shapes, rows = running(4, clock)
    scheduler.frees_rows = True
    rows[1].cancel()
    assert shapes.step() == decode(rows) and rows[1].finished  # ended by this step
    plan = shapes.step()
    kept = [rows[i] for i in plan.regroup.order.tolist()]
    assert plan.finished_req_ids == (rows[1],) and sorted(plan.regroup.order.tolist()) == [0, 2, 3]
    assert list(plan.scheduled_cached_reqs) == kept and shapes.batch.rows == kept


def test_the_scheduler_keeps_the_batchs_width_from_what_the_runner_gave():
    """The scheduler's own view of the batch: rows of 20 prompt tokens (width 20, then 21 after a step) with a
    12-token joiner in chunks of 4; both rows cancelled, their next decode step ends them without running the model
    (`RunnerOutput.stepped` False), so the cache stays 21 wide, and the joiner, brought in alone, keeps that width
    (12 of 21 used: not worth dropping the rest). Counting that step as a column would have planned 22."""
    scheduler, shapes = engine(max_join_delay_s=0, prefill_chunk=4)
    rows = [row(prompt=20, tokens=50), row(prompt=20, tokens=50)]
    scheduler.submit(rows)
    shapes.step()
    joiner = row(prompt=12, tokens=5)
    scheduler.submit([joiner])
    assert shapes.step().num_scheduled_tokens == {joiner: 4}
    assert shapes.step() == decode(rows) and shapes.batch.width == 21
    for r in rows:
        r.cancel()
    assert shapes.step().num_scheduled_tokens == {joiner: 4}
    assert shapes.step() == decode(rows) and all(r.finished for r in rows) and shapes.batch.width == 21
    assert shapes.step().num_scheduled_tokens == {joiner: 4}  # nobody runs: the rest at once
    plan = shapes.step()
    assert plan.regroup.order.tolist() == [2] and plan.regroup.width == 21 and plan.finished_req_ids == tuple(rows)
    assert shapes.batch.rows == [joiner] and shapes.batch.width == 22  # and its step


def test_a_batch_ends_released_and_the_next_one_starts():
    scheduler, shapes = engine()
    first = row(tokens=3)
    scheduler.submit([first])
    plans = [shapes.step() for _ in range(4)]
    assert plans[0] == prefill([first]) and plans[1:3] == [decode([first])] * 2 and first.finished
    assert plans[3] == SchedulerOutput(finished_req_ids=(first,)) and shapes.batch is None and scheduler.in_flight == []
    second = row()
    scheduler.submit([second])
    assert shapes.step() == prefill([second]) and scheduler.running == 1
    scheduler.close()
    second.cancel()
    while (plan := scheduler.schedule()) is not None:
        shapes.run(plan)
    assert scheduler.running == 0


def test_waiting_rows_run_by_priority_with_the_priority_policy():
    def order(policy: str) -> list[int]:
        scheduler, shapes = engine(max_batch_size=1, scheduling_policy=policy)
        made = []
        for priority in (0, 5, -1, 5, 0):
            r = row(tokens=1)
            r.priority = priority
            made.append(r)
        scheduler.submit(made)
        ran = []
        while len(ran) < len(made):
            plan = shapes.step()
            ran += [made.index(r) for r in taken(plan)]
        return ran

    assert order("priority") == [2, 0, 4, 1, 3]  # lowest first, arrival order among equals (vLLM's)
    assert order("fcfs") == [0, 1, 2, 3, 4]


def test_a_row_that_would_not_fit_the_context_waits_for_a_new_batch():
    """Context 64: a running row at width 40 (and growing) with 19 tokens to go; a joiner of 30 prompt
    tokens and 30 to generate would need 40 + 29 positions beside it, or more: never taken, and nothing
    behind it overtakes it. It starts a batch of its own once the row has ended."""
    clock = Clock()
    scheduler = Scheduler(EngineSettings(max_join_delay_s=0), 64, clock=clock)
    shapes = Shapes(scheduler)
    first = row(prompt=40, tokens=20, clock=clock)
    scheduler.submit([first])
    shapes.step()
    wide, small = row(prompt=30, tokens=30, clock=clock), row(prompt=2, tokens=2, clock=clock)
    scheduler.submit([wide, small])
    plans = [shapes.step() for _ in range(19)]
    assert plans == [decode([first])] * 19 and first.finished and scheduler.counts()[1] == 2
    assert shapes.step() == SchedulerOutput(finished_req_ids=(first,))
    assert taken(shapes.step()) == [wide, small]


def test_a_regroup_drops_the_leading_columns_no_row_uses_when_they_are_half():
    """A long and a short prompt: once the long row ends, the short one uses its prompt and the token
    fed back of the long one's width + 1; a compaction drops the columns no row uses only when they are
    at least half (or the context needs them)."""
    def compacted(long_prompt: int, short_prompt: int, n_positions: int = 256) -> tuple[list[int], int]:
        scheduler, shapes = engine(n_positions)
        long, short = row(prompt=long_prompt, tokens=2), row(prompt=short_prompt, tokens=30)
        scheduler.submit([long, short])
        shapes.step()
        assert shapes.step() == decode([long, short]) and long.finished  # its second token: its budget
        plan = shapes.step()  # half finished
        return plan.regroup.order.tolist(), plan.regroup.width

    assert compacted(40, 4) == ([1], 5)  # 5 of 41 used: dropped
    assert compacted(12, 8) == ([1], 13)  # 9 of 13 used: kept (an in-place cache moves no row)


def test_a_joiner_takes_a_finished_rows_place_and_the_columns_it_was_admitted_with():
    """Context 64: rows of 12, 8 and 8 prompt tokens; once the first has ended (13 columns, the others
    use 9), a joiner of 9 prompt tokens is admitted as if the batch were 9 wide (`take`). It takes the
    ended row's place; the width stays 13 while its tokens fit there, else the unused columns go."""
    def joined(budget: int) -> tuple[list[int], int]:
        scheduler, shapes = engine(64, max_join_delay_s=0)
        rows = [row(prompt=12, tokens=2), row(prompt=8, tokens=30), row(prompt=8, tokens=30)]
        scheduler.submit(rows)
        shapes.step()
        assert shapes.step() == decode(rows) and rows[0].finished
        joiner = row(prompt=9, tokens=budget)
        scheduler.submit([joiner])
        assert taken(shapes.step()) == [joiner]
        plan = shapes.step()
        assert plan.scheduled_cached_reqs == (joiner, rows[1], rows[2]) and plan.finished_req_ids == (rows[0],)
        assert shapes.batch.rows == [joiner, rows[1], rows[2]]
        return plan.regroup.order.tolist(), plan.regroup.width

    assert joined(52) == ([3, 1, 2], 13)  # 13 + 51 positions: fits
    assert joined(55) == ([3, 1, 2], 9)  # 13 + 54 would not


def test_a_failure_gives_up_the_batch():
    clock = Clock()
    scheduler, shapes, rows = running(4, clock)
    assert scheduler.fail() == rows
    assert scheduler.in_flight == []
    nxt = row()
    scheduler.submit([nxt])
    assert shapes.step() == prefill([nxt])  # a new batch: the failed one is gone


def test_schedule_blocks_until_a_row_arrives():
    scheduler, shapes = engine()
    plans = []
    waiter = threading.Thread(target=lambda: plans.append(scheduler.schedule()))
    waiter.start()
    waiter.join(0.2)
    assert waiter.is_alive() and not plans
    r = row()
    scheduler.submit([r])
    waiter.join(5)
    assert plans == [prefill([r])]


def run_out(scheduler: Scheduler, shapes: Shapes, rows: list[Row]) -> None:
    """Steps until `rows` (a batch just prefilled) have finished and the batch is released."""
    while not shapes.step().finished_req_ids:
        pass
    assert all(r.finished for r in rows) and shapes.batch is None


def next_batch_after(scheduler: Scheduler, shapes: Shapes, late_s: float) -> tuple[SchedulerOutput, float]:
    """A row submitted now, a second one `late_s` later from another thread: the next plan, and how long it took
    (the second is taken by it, or left waiting)."""
    first, second = row(), row()
    later = threading.Timer(late_s, lambda: scheduler.submit([second]))
    start = time.monotonic()
    scheduler.submit([first])
    later.start()
    plan = shapes.step()
    took = time.monotonic() - start
    later.join()
    return plan, took


def test_after_a_batch_of_several_rows_a_new_batch_waits_for_requests_arriving_together(monkeypatch):
    """batch_wait_s None (auto): after a batch that ran 2 rows at once, a new batch waits (AUTO_QUIET_S 0.2 s and
    AUTO_BATCH_WAIT_S 0.5 s here, for a margin on a busy machine) for a request arriving 10 ms after the first and
    takes both; after a batch of one row it starts at once, alone; batch_wait_s 0 never waits, a set wait always
    does."""
    from gpt2x.serve.core import scheduler as module

    monkeypatch.setattr(module, "AUTO_BATCH_WAIT_S", 0.5)
    monkeypatch.setattr(module, "AUTO_QUIET_S", 0.2)
    scheduler, shapes = engine(max_batch_size=2)
    assert scheduler.batch_wait() == 0.0  # no batch yet
    pair = [row(tokens=2), row(tokens=2)]
    scheduler.submit(pair)
    assert shapes.step() == prefill(pair)
    run_out(scheduler, shapes, pair)
    assert scheduler.batch_wait() == 0.5
    plan, took = next_batch_after(scheduler, shapes, 0.01)
    assert len(taken(plan)) == 2 and 0.01 <= took < 0.5  # it started once a batch's worth (2) waited
    scheduler, shapes = engine()
    alone = row(tokens=2)
    scheduler.submit([alone])
    shapes.step()
    run_out(scheduler, shapes, [alone])
    assert scheduler.batch_wait() == 0.0
    plan, took = next_batch_after(scheduler, shapes, 0.3)
    assert len(taken(plan)) == 1 and took < 0.25
    for wait, took in ((0.0, 1), (0.3, 2)):
        scheduler, shapes = engine(batch_wait_s=wait, max_batch_size=2)
        scheduler.submit([row(tokens=2)])
        shapes.step()  # a batch of one: a set wait applies all the same
        run_out(scheduler, shapes, list(shapes.batch.rows))
        plan, _ = next_batch_after(scheduler, shapes, 0.05 if wait else 0.3)
        assert len(taken(plan)) == took, wait


def test_after_a_batch_of_one_a_new_batch_waits_where_several_requests_wait_already(monkeypatch):
    """Auto, after a batch of one row: two requests waiting when the batch starts are a wave arriving (vllm bench
    serve's first wave after its c=1 level came as 4 rows, then 12 joining them): it waits, and a third arriving 10 ms
    later comes in too; one request alone does not wait (the test above)."""
    from gpt2x.serve.core import scheduler as module

    monkeypatch.setattr(module, "AUTO_BATCH_WAIT_S", 0.5)
    monkeypatch.setattr(module, "AUTO_QUIET_S", 0.2)
    scheduler, shapes = engine()
    alone = row(tokens=2)
    scheduler.submit([alone])
    shapes.step()
    run_out(scheduler, shapes, [alone])
    wave = [row(tokens=2) for _ in range(3)]
    scheduler.submit([wave[0]])
    scheduler.submit([wave[1]])
    assert scheduler.batch_wait() == 0.5
    timer = threading.Timer(0.01, lambda: scheduler.submit([wave[2]]))
    timer.start()
    plan = shapes.step()
    timer.join()
    assert taken(plan) == wave


def test_an_auto_wait_ends_once_requests_stop_arriving(monkeypatch):
    """Auto, after a batch of 2 rows: requests at 0 and 10 ms, then a pause longer than AUTO_QUIET_S (50 ms here):
    the new batch takes the two, long before AUTO_BATCH_WAIT_S (1 s); the third waits for the next step."""
    from gpt2x.serve.core import scheduler as module

    monkeypatch.setattr(module, "AUTO_BATCH_WAIT_S", 1.0)
    monkeypatch.setattr(module, "AUTO_QUIET_S", 0.05)
    scheduler, shapes = engine()
    pair = [row(tokens=2), row(tokens=2)]
    scheduler.submit(pair)
    shapes.step()
    run_out(scheduler, shapes, pair)
    first, second, third = row(), row(), row()
    timers = [threading.Timer(0.01, lambda: scheduler.submit([second])), threading.Timer(0.6, lambda: scheduler.submit([third]))]
    start = time.monotonic()
    scheduler.submit([first])
    for t in timers:
        t.start()
    plan = shapes.step()
    took = time.monotonic() - start
    for t in timers:
        t.join()
    assert taken(plan) == [first, second] and 0.05 <= took < 0.5
    assert scheduler.counts()[1] == 1  # the third waits


def test_a_waiting_batch_starts_once_a_batchs_worth_waits():
    """A set wait of 10 s ends as soon as max_batch_size rows wait."""
    scheduler, shapes = engine(batch_wait_s=10.0, max_batch_size=2)
    first, second = row(), row()
    threading.Timer(0.01, lambda: scheduler.submit([second])).start()
    start = time.monotonic()
    scheduler.submit([first])
    assert taken(shapes.step()) == [first, second] and time.monotonic() - start < 5


def test_the_request_queue_alone_bounds_orders_takes_and_closes():
    """RequestQueue, apart from the scheduler: at most max_waiting beyond the free places; by priority, arrival
    order among equals; `take` stops at the first row that does not fit (none overtaken); a cancelled row leaves at
    once; `fill` returns at its deadline; closed, it hands back what waits and refuses more."""
    from gpt2x.serve.core.request_queue import EngineClosed, QueueFull, RequestQueue

    q = RequestQueue(max_waiting=2, priority=True)
    a, b, c, d = (row() for _ in range(4))
    a.priority, b.priority, c.priority, d.priority = 1, 0, 1, 0
    q.put([a], free=0)
    q.put([b, c], free=1)  # 3 rows: 2 waiting + 1 free place
    with pytest.raises(QueueFull):
        q.put([d], free=0)
    assert len(q) == 3 and q.oldest() is b  # priority 0 first; a before c (arrival) among the 1s
    c.cancel()
    assert len(q) == 2
    assert q.take(lambda taken, candidate: candidate is not a, most=3) == [b]  # a does not fit: nothing behind it
    started = time.monotonic()
    q.fill(5, lambda: started + 0.05)
    assert 0.04 <= time.monotonic() - started < 1.0
    assert q.close() == [a] and q.closed and not q.wait()
    with pytest.raises(EngineClosed):
        q.put([d], free=8)


class HeldNothing:
    """A prefix cache's view that holds no block (every whole block lacking), 16 tokens a block."""

    block_tokens = 16

    def held(self, ids: list[int]) -> int:
        return 0

    def lacks(self, ids: list[int]) -> bool:
        return True


def test_rows_sharing_a_long_prompt_text_are_planned_after_the_row_they_share_it_with():
    """The prefix policy is the scheduler's: of a new batch, a row whose prompt shares 64 tokens or more (whole blocks
    the cache lacks) with an earlier row's different prompt is planned after it (Start.after), by hand: A and B
    share 80 tokens (5 blocks), C is short, D is A again (prefilled with it once, not after it). Whether each part
    starts from the cache is planned too: with no estimate, yes; with one where a past costs more than running the
    tokens fresh, not for the rows that would find 80 tokens held."""
    shared = list(range(1000, 1080))
    a, b = row(), row()
    a.prompt_ids, b.prompt_ids = shared + [1, 2, 3], shared + [4, 5]
    c, d = row(), row()
    d.prompt_ids = list(a.prompt_ids)
    plans = []
    for estimate in (None, lambda rows, new, past: new + 10 * past):
        scheduler = Scheduler(EngineSettings(max_batch_size=4), 256, clock=Clock(), prefix=HeldNothing(), estimate=estimate)
        for r in (a, b, c, d):
            r.scheduled_at = None
        scheduler.submit([a, b, c, d])
        plans.append(scheduler.schedule())
    for plan in plans:
        assert [(n.row, n.start) for n in plan.scheduled_new_reqs] == [(a, Start.prefill), (b, Start.after),
                                                                       (c, Start.prefill), (d, Start.prefill)]
        assert all(n.cached for n in plan.scheduled_new_reqs if n.start is Start.prefill)
    cached = [plan.scheduled_new_reqs[1].cached for plan in plans]
    assert cached == [True, False]  # 2 + 10 x 80 against 82 tokens fresh


def test_a_large_wave_is_prefilled_in_two_halves():
    """A new batch of 512 prompt tokens or more, where rows join at no cost (the fixed slots): its first rows up to half
    its tokens prefilled first, the rest after them (Start.after); below that, or where the backend's cache copies to
    merge rows or cannot merge them, one prefill."""
    def starts(prompts: list[int], joins_rows: bool = True, frees_rows: bool = True) -> list[Start]:
        scheduler = Scheduler(EngineSettings(max_batch_size=16), 1024, joins_rows=joins_rows, frees_rows=frees_rows,
                              clock=Clock())
        scheduler.submit([row(prompt=p) for p in prompts])
        return [n.start for n in scheduler.schedule().scheduled_new_reqs]

    assert starts([32] * 16) == [Start.prefill] * 8 + [Start.after] * 8
    assert starts([400, 20, 20, 100]) == [Start.prefill] + [Start.after] * 3  # the first row holds half
    assert starts([32] * 15) == [Start.prefill] * 15  # 480 tokens
    assert starts([32] * 16, frees_rows=False) == [Start.prefill] * 16
    assert starts([32] * 16, joins_rows=False, frees_rows=False) == [Start.prefill] * 16


class HeldFirst:
    """A prefix cache holding each prompt's first `tokens` tokens (16 a block)."""

    block_tokens = 16

    def __init__(self, tokens: int) -> None:
        self.tokens = tokens

    def held(self, ids: list[int]) -> int:
        return min(self.tokens, len(ids) - 1)

    def lacks(self, ids: list[int]) -> bool:
        return False


def test_where_rows_on_a_past_run_a_forward_each_the_prefix_cache_is_taken_where_those_forwards_cost_less():
    """On a backend that runs rows on a past a forward each and gives no estimate (the fixed slots without an OpenVINO
    prefill), by hand with FORWARD_TOKENS 24: 16 prompts of 32 tokens holding 16 cost 16 x (16 + 24) = 640 apart against
    512 + 24 fresh, so they run fresh; holding a 512-token prefix of 544, 16 x 56 against 8728, so they take the cache;
    one prompt always takes it; without past_rows_apart, as before, every row does."""
    def cached(prompt: int, held: int, rows: int, apart: bool = True) -> bool:
        scheduler = Scheduler(EngineSettings(max_batch_size=16), 1024, clock=Clock(), prefix=HeldFirst(held),
                              estimate=lambda rows, new, past: None, past_rows_apart=apart)
        waiting = [row(prompt=prompt) for _ in range(rows)]
        for i, r in enumerate(waiting):  # distinct prompts (identical ones run once)
            r.prompt_ids = [1000 * (i + 1) + t for t in range(prompt)]
        scheduler.submit(waiting)
        plan = scheduler.schedule()
        return all(n.cached for n in plan.scheduled_new_reqs)

    assert not cached(32, 16, 16) and cached(544, 512, 16) and cached(32, 16, 1) and cached(32, 16, 16, apart=False)


def test_what_the_runner_gave_is_told_with_the_marks_the_engine_counts_by():
    """update_from_output on a hand-built RunnerOutput of a decode step: a token, a last token (its end follows,
    counted with the token), an end-of-text not kept (told with its logprob, a token sampled all the same), and a
    row whose constraint failed (its own 400, counted as an end, no token)."""
    scheduler, _ = engine()
    going, last, eot, failed = (row() for _ in range(4))
    failed.error = "the constraint cannot continue"
    lp = (50256, -0.5, [])
    events = [Event(0, 7, None), Event(1, 8, Finish.length), Event(2, None, Finish.eos, lp), Event(3, None, Finish.failed)]
    plan = decode([going, last, eot, failed])
    told = list(scheduler.update_from_output(plan, [RunnerOutput([going, last, eot, failed], events, stepped=True)]))
    assert [(t.row, t.output, t.sampled, t.ends) for t in told] == [
        (going, TokenOut(7), True, False),
        (last, TokenOut(8, None, Finish.length), True, True), (last, Finished(Finish.length), False, False),
        (eot, Finished(Finish.eos, lp), True, True),
        (failed, Failed("the constraint cannot continue", client=True), False, True)]


def test_where_chunks_mix_the_backends_own_chunk_is_the_default_and_an_asked_one_wins():
    """A joiner's chunk by default: a base (MIXED_PREFILL_CHUNK, 24, or the backend's: capabilities.mixed_chunk_base)
    and a token per row running on ONNX Runtime's slots, the backend's own where it gives one (capabilities.mixed_chunk:
    the paged slots' 64), and --prefill-chunk over each; where chunks do not mix, 256."""
    settings, asked = EngineSettings(), EngineSettings(prefill_chunk=32)
    assert Scheduler(settings, 1024, mixes=True).chunk_tokens(16) == 24 + 16
    assert Scheduler(settings, 1024, mixes=True, mixed_chunk_base=8).chunk_tokens(3) == 8 + 3
    assert Scheduler(asked, 1024, mixes=True, mixed_chunk_base=8).chunk_tokens(3) == 32
    # as /health says it: tokens + per_row x the rows running; a step budget leaves the rows' tokens, at least one
    assert Scheduler(settings, 1024, mixes=True, mixed_chunk_base=8).chunk_rule() == (8, 1)
    assert Scheduler(asked, 1024, mixes=True).chunk_rule() == (32, 0)
    budget = Scheduler(EngineSettings(max_num_batched_tokens=20), 1024, mixes=True)
    assert budget.chunk_rule() == (20, -1) and [budget.chunk_tokens(n) for n in (4, 19, 30)] == [16, 1, 1]
    assert Scheduler(settings, 1024, mixes=True, mixed_chunk=64).chunk_tokens(16) == 64
    assert Scheduler(asked, 1024, mixes=True, mixed_chunk=64).chunk_tokens(16) == 32
    assert Scheduler(settings, 1024, mixed_chunk=64).chunk_tokens(16) == 256
