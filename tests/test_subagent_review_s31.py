"""A review of sub-agent runs and their announcements: which work a respawn runs, a work
that ends in a cancellation of its own, what a retried run's notice quotes, a step budget
the log cannot record, and a run whose first start met a store outage. Each test marked
"Was: DEFECT" failed on the code before its fix for the reason its comment gives.

Real parts only: an LMDB store in tmp_path (PostgreSQL behind a relay the test cuts, for
the outage), the fake provider over loopback, MemoryChannels, a ``FakeClock`` for every
deadline. Waits are on a run's handle, the log
or the channel (each bounded by ``GUARD``); none sleeps for a timeout a fake clock could
fire.
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from collections.abc import Iterator

import anyio
import pytest
from hypothesis import given
from hypothesis import strategies as st

from stalwart.actors import FAILED_SENTENCE, RunReport
from stalwart.channels import MemoryChannel
from stalwart.clock import FakeClock
from stalwart.errors import SpawnRefusedError
from stalwart.events import (
    SubagentArtifact,
    SubagentCompleted,
    SubagentRecoveryDecided,
    SubagentSpawned,
)
from stalwart.runtime import Runtime
from stalwart.runtime._runs import MAX_STEPS
from stalwart.state import RunState, asked_task, continuation_context, continued_task
from stalwart.store import EventStore
from stalwart.testing import FakeProvider
from tests._relay import CuttingRelay, reachable
from tests._runtime_support import GUARD, delivered, has, log_until, of, until
from tests.test_runtime_split import spawns
from tests.test_runtime_subagents import config, hang

#: How long (real seconds) a run that should end at once, with no clock deadline
#: involved, may take before it counts as never ending.
PROMPTLY = 2.0

TASK = "summarise the page"


@pytest.fixture
def rt(
    store: EventStore, clock: FakeClock, fake: FakeProvider, chat: MemoryChannel
) -> Iterator[Runtime]:
    with Runtime(config(fake.base_url), store=store, clock=clock, channels={"chat": chat}) as rt:
        yield rt


def results_of_attempt(store: EventStore, attempt: int, count: int) -> list[str]:
    """The results of the ``count`` runs of ``attempt`` once they all completed."""
    give_up = time.monotonic() + GUARD
    while True:
        head = store.head()  # before the look: an append meanwhile wakes the wait
        found = [
            of(SubagentCompleted, list(store.read_stream(f"session:{run_id}")))
            for run_id, spawned in spawns(store).items()
            if spawned.attempt == attempt
        ]
        if len(found) >= count and all(found):
            return sorted(completed[0].result for completed in found)
        assert time.monotonic() < give_up, f"{count} runs of attempt {attempt} never completed"
        store.wait_for(head + 1, give_up - time.monotonic())


def wait_spawned(store: EventStore, *, attempt: int) -> dict[str, SubagentSpawned]:
    """The runs of ``attempt`` once there is one."""
    give_up = time.monotonic() + GUARD
    while True:
        head = store.head()  # before the look: a spawn appended meanwhile wakes the wait
        found = {run_id: s for run_id, s in spawns(store).items() if s.attempt == attempt}
        if found:
            return found
        assert time.monotonic() < give_up, f"no run of attempt {attempt} was ever spawned"
        store.wait_for(head + 1, give_up - time.monotonic())


# -- which work a respawn runs -----------------------------------------------------------------


# Was: DEFECT: RunLayer remembered a run's `work` by its lineage text, `(parent, task)`
# (stalwart/runtime/_runs.py, `self._works[(spawn.parent, spawn.task)] = (work, agent)`),
# so a host that fans one task out over several works (`for url in urls:
# rt.spawn(session, "summarise the page", work=fetch(url))`: the task says what to do, the
# closure what to do it on) kept only the last one. A respawn looked the lineage up by text
# (`_lineage(parent, task)`: the latest registered wins), so the retry of the first run ran
# the last run's work: its user was announced the other page's summary as the answer, and
# the first page was never summarised. Fix: each run keeps its own lineage (the recovery's
# Spawn says which run it retries: `retry_of`), its work, agent and splitter with it.
def test_a_respawn_runs_the_work_of_the_run_it_retries_not_of_another_with_its_task(
    rt: Runtime, clock: FakeClock, store: EventStore
) -> None:
    calls: list[str] = []

    def summarise(page: str, *, first_hangs: bool) -> object:
        async def work(report: RunReport) -> str:
            calls.append(page)
            if first_hangs and calls.count(page) == 1:
                await anyio.sleep_forever()
            return f"summary of {page}"

        return work

    first = rt.spawn(
        "p1", TASK, task_class="formatting", channel="chat", work=summarise("a", first_hangs=True)
    )
    second = rt.spawn(
        "p1", TASK, task_class="formatting", channel="chat", work=summarise("b", first_hangs=False)
    )
    assert second.result(GUARD).result == "summary of b"
    until(lambda: "a" in calls, what="the first run's work started")
    first.status()  # asked: its watchdog is armed
    clock.advance(rt.config.subagents.class_timeouts_ms.formatting / 1000)
    assert first.result(GUARD).outcome == "timed_out"

    [retried] = results_of_attempt(store, 2, 1)
    assert retried == "summary of a", (
        f"the retry of the run over page a ran another run's work: {retried!r} "
        f"(works called: {calls})"
    )
    assert Counter(calls) == {"a": 2, "b": 1}


def test_two_runs_with_one_task_that_both_time_out_are_each_retried_with_their_own_work(
    rt: Runtime, clock: FakeClock, store: EventStore
) -> None:
    """Before the fix, the first retry ran the other run's work and, once it succeeded,
    the lineage's work was forgotten (``_forget(parent, task)``), so the second retry went
    to a model ("default answer"): a run of the host's own code answered by a model, what
    the ``work_unavailable`` escalation exists to prevent."""
    calls: list[str] = []

    def summarise(page: str) -> object:
        async def work(report: RunReport) -> str:
            calls.append(page)
            if calls.count(page) == 1:
                await anyio.sleep_forever()
            return f"summary of {page}"

        return work

    handles = [
        rt.spawn("p1", TASK, task_class="formatting", channel="chat", work=summarise(page))
        for page in ("a", "b")
    ]
    until(lambda: len(calls) == 2, what="both works started")
    for handle in handles:
        handle.status()  # asked: its watchdog is armed
    clock.advance(rt.config.subagents.class_timeouts_ms.formatting / 1000)
    assert [handle.result(GUARD).outcome for handle in handles] == ["timed_out"] * 2

    assert results_of_attempt(store, 2, 2) == ["summary of a", "summary of b"], calls
    assert Counter(calls) == {"a": 2, "b": 2}


# -- a work that ends in a cancellation of its own ---------------------------------------------


# Was: DEFECT: a work whose coroutine ends with a CancelledError of its own (it awaited a
# task or future that something else cancelled; `task.cancel(); await task`) ends its
# portal future cancelled (stalwart/actors/_portal.py `_run`: "its outcome"), and
# SubAgentActor took every cancelled future for one it cancelled on purpose
# (stalwart/actors/_subagent.py `_work_done`: "cancelled on purpose: the run was
# force-failed") and dropped it. The run sat `running` with no work behind it until its
# watchdog fired, up to `custom_max_ms` (30 min) later, and its user was then told it "did
# not complete in time", a hang of exactly the kind stalwart exists to end at once. Fix:
# the actor marks the cancels it makes; a cancellation it did not make fails the run
# (`subagent:completed` failed, `FAILED_SENTENCE`), at once.
def test_a_work_that_ends_in_a_cancellation_of_its_own_fails_the_run_at_once(
    rt: Runtime, store: EventStore
) -> None:
    async def work(report: RunReport) -> str:
        report.progress(5, step=1)
        cancelled = asyncio.get_running_loop().create_future()
        cancelled.cancel()  # something else gave up on what the work waits for
        await cancelled
        return "unreachable"

    handle = rt.spawn(
        "p1", "fetch the quarterly report", custom_timeout_ms=1_800_000, reason="slow export",
        channel="chat", work=work,
    )  # fmt: skip
    try:
        ended = handle.result(PROMPTLY)  # no clock moves: no deadline can end it
    except TimeoutError:
        pytest.fail("the run whose work ended cancelled is still running, until its watchdog")
    assert ended.outcome == "failed"
    assert FAILED_SENTENCE in ended.notice
    assert "Cancel" not in ended.notice  # static text: never the error's name
    [completed] = of(SubagentCompleted, list(store.read_stream(handle.stream)))
    assert (completed.outcome, completed.result) == ("failed", "")


def test_a_run_its_watchdog_cancels_still_records_no_completion(
    rt: Runtime, clock: FakeClock, store: EventStore
) -> None:
    """The other side of the fix above: the cancel the actor makes itself (its watchdog)
    is still no outcome of the work: the log holds the timeout, never a completion."""
    handle = rt.spawn("p1", "tidy the notes", task_class="formatting", channel="chat", work=hang)
    handle.status()  # asked: its watchdog is armed
    clock.advance(rt.config.subagents.class_timeouts_ms.formatting / 1000)
    assert handle.result(GUARD).outcome == "timed_out"
    log_until(store, handle.stream, has(SubagentRecoveryDecided))  # the end was settled
    assert of(SubagentCompleted, list(store.read_stream(handle.stream))) == []


# -- what a retried run's notice quotes --------------------------------------------------------


# Was: DEFECT: a later attempt's task is the task, a blank line and the continuation
# context (stalwart/actors/_supervisor_fold.py `respawn`: "The last attempt completed steps
# 1-2 and saved <path>. Pick up from step 3."), and the failure notice quoted the run's
# task as recorded (stalwart/actors/_subagent_notice.py `_excerpt`), so the user of a
# short task was told `Sub-agent task "tidy the notes The last attempt completed steps
# 1-2 and s...": ...`: an instruction meant for the next attempt's model, with the paths
# the sub-agent saved, in place of what they asked. Fix: the notice quotes the task as it
# was asked (`stalwart.state.asked_task`, the inverse of `continued_task`).
def test_a_retried_runs_failure_notice_quotes_the_task_not_the_continuation_context(
    rt: Runtime, clock: FakeClock, store: EventStore, chat: MemoryChannel
) -> None:
    async def work(report: RunReport) -> str:
        report.progress(40, step=2)
        report.artifact("/srv/agents/scratch/run-7/notes.md", "ab" * 32)
        await anyio.sleep_forever()
        raise AssertionError("unreachable")

    limit_s = rt.config.subagents.class_timeouts_ms.formatting / 1000
    first = rt.spawn("p1", "tidy the notes", task_class="formatting", channel="chat", work=work)
    log_until(store, first.stream, has(SubagentArtifact))  # its reports are in (watchdog armed)
    clock.advance(limit_s)
    assert first.result(GUARD).outcome == "timed_out"
    [second] = wait_spawned(store, attempt=2)
    assert "\n\nThe last attempt completed steps 1-2" in spawns(store)[second].task
    handle = rt.run(second)
    assert handle is not None
    log_until(store, handle.stream, has(SubagentArtifact))  # the work runs (watchdog armed)
    clock.advance(limit_s)
    ended = handle.result(GUARD)
    assert ended.outcome == "timed_out"
    assert ended.notice.startswith('Sub-agent task "tidy the notes": '), ended.notice
    notices = delivered(rt, chat, 2)
    assert [n.text.split('"')[1] for n in notices] == ["tidy the notes"] * 2, [
        n.text for n in notices
    ]
    assert all("notes.md" not in n.text and "last attempt" not in n.text for n in notices)


@given(
    task=st.text(min_size=1).filter(lambda t: "\n\nThe last attempt " not in t),
    steps=st.lists(st.integers(min_value=1, max_value=50), max_size=3),
)
def test_the_asked_task_survives_any_number_of_continuations(task: str, steps: list[int]) -> None:
    continued = task
    for step in steps:
        state = RunState(stream="session:r", step=step)
        continued = continued_task(continued, continuation_context(state))
    assert asked_task(continued) == task
    assert continued_task(task, "") == task


# -- odd input: a step budget the log cannot record ------------------------------------------


# Was: DEFECT: RunLayer._check (stalwart/runtime/_runs.py) refused a max_steps below 1 but
# took any larger int, and `subagent:spawned` cannot record one past 64 bits (a model's
# `spawn_subagent(max_steps=100000000000000000000)`): the run's actor failed to append
# its spawn at every start, crashed until supervision gave up (three `supervisor:restarted`
# and a `supervisor:gave_up` in the runtime stream, ERROR logs), and the run ended
# `failed` with a notice quoting its task as "(not recorded)". Fix: a step budget over
# MAX_STEPS (2**63 - 1) is refused like any other invalid spawn, before anything is
# appended; one at the limit is recorded and runs.
def test_a_step_budget_the_log_cannot_record_is_refused_before_anything_is_appended(
    rt: Runtime, store: EventStore
) -> None:
    async def work(report: RunReport) -> str:
        return "done"

    head = store.head()
    with pytest.raises(SpawnRefusedError) as refused:
        rt.spawn("p1", "tidy", task_class="formatting", channel="chat", work=work, max_steps=2**70)
    assert refused.value.field == "max_steps"
    assert store.head() == head
    largest = rt.spawn(
        "p1", "tidy", task_class="formatting", channel="chat", work=work, max_steps=MAX_STEPS
    )
    assert largest.result(GUARD).result == "done"


# -- a run whose first start met a store outage ------------------------------------------------


# Was: DEFECT: a run's actor that crashed is started again by RunLayer._restart with
# `_no_work`, a work that raises ("a restarted run does not run its work again"). That is
# right for a run whose spawn is in the log (the actor then never runs a work), but not for
# one whose first start failed before its `subagent:spawned` was recorded (the database
# away for a moment as the host spawned): the restarted actor found no spawn, recorded
# one and ran `_no_work`, so the host's work never ran, the run was recorded `failed` and
# its user was sent "did not complete successfully" for work nobody tried. Fix: the
# restart is given the run's own work (the actor still runs it only for a run whose
# spawn is not in the log).
def test_a_run_whose_first_start_met_a_store_outage_runs_its_work_once_it_restarts(
    relayed_store: EventStore,
    pg_store: EventStore,
    relay: CuttingRelay,
    clock: FakeClock,
    fake: FakeProvider,
    chat: MemoryChannel,
) -> None:
    ran: list[str] = []

    async def work(report: RunReport) -> str:
        ran.append("ran")
        return "the answer"

    channels = {"chat": chat}
    with Runtime(config(fake.base_url), store=relayed_store, clock=clock, channels=channels) as rt:
        rt.session("p1", channel="chat")  # the parent's address, before the outage
        relay.cut_now()  # the database goes away
        handle = rt.spawn("p1", "tidy the notes", task_class="code", channel="chat", work=work)
        until(lambda: (ref := handle.ref) is not None and not ref.is_alive(), what="a crash")
        relay.restore()
        until(lambda: reachable(relayed_store), what="the database back")
        give_up = time.monotonic() + GUARD
        while not handle.done():  # the crash's decision is retried, then the backoff
            assert time.monotonic() < give_up, "the run was never started again"
            clock.advance(0.1)
            time.sleep(0.02)  # real-time: the actors run on their own threads
        ended = handle.result(0)
    assert (ended.outcome, ended.result, ran) == ("succeeded", "the answer", ["ran"])
    records = list(pg_store.read_stream(handle.stream))
    assert [type(r.event) for r in records][:2] == [SubagentSpawned, SubagentCompleted]
