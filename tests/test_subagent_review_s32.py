"""A review of sub-agent runs, their announcements and their lineages: what a runtime keeps
of runs the supervisor ended or escalated, and a completion announced twice when its
announcer was late. Each test marked "Was: DEFECT" failed on the code before its fix for
the reason its comment gives.

Real parts only: an LMDB store in tmp_path, the fake provider over loopback,
MemoryChannels, the real Announcer and SupervisorActor, a ``FakeClock`` for every
deadline. Waits are on a run's handle, the log, an actor's mailbox or a channel (each
bounded by ``GUARD``); none sleeps for a timeout a fake clock could fire.
"""

from __future__ import annotations

import threading
import time
from typing import Any

import anyio
import pykka
import pytest

from stalwart.actors import (
    Announcer,
    GetBatches,
    IoPortal,
    RunEnded,
    RunReport,
    Scheduler,
    SupervisorActor,
    Track,
)
from stalwart.channels import MemoryChannel
from stalwart.clock import FakeClock
from stalwart.config import SubagentSettings
from stalwart.events import AnnouncementQueued, SubagentCompleted, SubagentRecoveryDecided
from stalwart.runtime import Runtime
from stalwart.store import EventStore
from stalwart.testing import FakeProvider
from tests._relay import CuttingRelay, reachable
from tests._runtime_support import GUARD, attempted_on, flush, has, log_until, of, until
from tests.test_runtime_subagents import config, hang
from tests.test_supervisor import T0, succeeded


def logged(caplog: pytest.LogCaptureFixture, event: str) -> bool:
    return any(event in record.getMessage() for record in caplog.records)


def ended_after_outage(handle: Any, clock: FakeClock) -> RunEnded:
    """How the run ended, once the store is back: the clock moved on in small steps (a
    retry's or a restart's timer), well short of any run limit."""
    give_up = time.monotonic() + GUARD
    while not handle.done():
        assert time.monotonic() < give_up, "the run never ended after the outage"
        clock.advance(0.1)
        time.sleep(0.02)  # real-time: the actors run on their own threads
    ended = handle.result(0)
    assert isinstance(ended, RunEnded)
    return ended


def tracked_by_announcer(rt: Runtime) -> dict[str, Any]:
    """The runs the runtime's announcer keeps a :class:`Track` of (asked through its
    mailbox, so whatever was told to it before is handled)."""
    ref = rt._parts._announcer  # type: ignore[union-attr]
    assert ref is not None
    ref.ask(GetBatches(), timeout=GUARD)  # what was told before is handled
    announcer = ref._actor_weakref()
    assert announcer is not None
    return dict(announcer._tracked)


# -- what the runtime keeps of runs that ended ----------------------------------------------


# Was: DEFECT: the announcer drops a run's `Track` when the run's actor tells it the run
# ended (`Announcer._ended`), but a run the supervisor ends (swept as a ghost, given up on)
# reaches the runtime through the supervisor's `on_run_ended` (`RunLayer.ended`), never
# through the announcer: its `Track` stayed in `Announcer._tracked` for the process's life
# (and was told again to every restarted announcer). Fix: `RunLayer.ended` tells the
# announcer `Untrack(run_id)`.
def test_a_run_the_supervisor_ends_is_no_longer_tracked_by_the_announcer(
    store: EventStore, clock: FakeClock, fake: FakeProvider, chat: MemoryChannel
) -> None:
    with Runtime(config(fake.base_url), store=store, clock=clock, channels={"chat": chat}) as rt:
        handle = rt.spawn("p1", "format the table", task_class="formatting", work=hang)
        handle.status()
        assert handle.run_id in tracked_by_announcer(rt)
        actor = handle.ref
        assert actor is not None
        actor.stop()  # no watchdog any more: only the ghost sweep ends the run
        settings = rt.config.subagents
        limit_ms = settings.class_timeouts_ms.formatting
        clock.advance(
            (limit_ms + settings.ghost_grace_ms + settings.ghost_sweep_interval_ms) / 1000
        )
        assert handle.result(GUARD).outcome == "swept"
        assert handle.run_id not in tracked_by_announcer(rt)


# Was: DEFECT: `RunLayer` let go of a lineage (the host's `work` callable, its splitter,
# and whatever they hold: a client, a document) only when a run of it succeeded. A run
# that failed and was escalated (attempts exhausted, or `deliver`) was never retried, yet
# its lineage stayed in `RunLayer._lineages` for the process's life: a long-lived process
# grew with every run that failed for good. Fix: a failed run's lineage is kept only until
# its recovery decision is in the log and has spawned what it decided.
def test_the_work_of_a_run_escalated_for_good_is_let_go(
    store: EventStore, clock: FakeClock, fake: FakeProvider, chat: MemoryChannel
) -> None:
    cfg = config(fake.base_url, subagents={"recovery_max_attempts": 1})

    async def quick(report: RunReport) -> str:
        return "done"

    with Runtime(cfg, store=store, clock=clock, channels={"chat": chat}) as rt:
        runs = rt._runs
        assert runs is not None
        failed = rt.spawn("p1", "format the table", task_class="formatting", work=hang)
        failed.status()  # its watchdog is armed
        clock.advance(rt.config.subagents.class_timeouts_ms.formatting / 1000)
        assert failed.result(GUARD).outcome == "timed_out"
        [decided] = of(
            SubagentRecoveryDecided, log_until(store, failed.stream, has(SubagentRecoveryDecided))
        )
        assert decided.action == "escalate"
        # the next run's end is where the runtime reads the decisions it waits for
        assert rt.spawn("p1", "tidy up", task_class="formatting", work=quick).result(GUARD)
        until(lambda: not runs.holds_work(failed.run_id), what="the escalated run's work let go")


def test_a_timed_out_run_keeps_its_work_for_the_attempt_that_retries_it(
    store: EventStore, clock: FakeClock, fake: FakeProvider, chat: MemoryChannel
) -> None:
    """The other side of the fix above: a lineage whose recovery respawns it keeps its
    work until the next attempt runs it, and lets go of it once that attempt succeeds."""
    attempts: list[int] = []

    async def flaky(report: RunReport) -> str:
        attempts.append(len(attempts) + 1)
        if len(attempts) == 1:
            return await hang(report)
        return "second time lucky"

    with Runtime(config(fake.base_url), store=store, clock=clock, channels={"chat": chat}) as rt:
        runs = rt._runs
        assert runs is not None
        first = rt.spawn("p1", "format the table", task_class="formatting", work=flaky)
        first.status()
        clock.advance(rt.config.subagents.class_timeouts_ms.formatting / 1000)
        assert first.result(GUARD).outcome == "timed_out"
        [decided] = of(
            SubagentRecoveryDecided, log_until(store, first.stream, has(SubagentRecoveryDecided))
        )
        assert decided.action == "respawn"
        until(lambda: len(attempts) == 2, what="the second attempt ran the same work")
        until(lambda: not runs.holds_work(first.run_id), what="the lineage let go")


# -- a completion announced twice --------------------------------------------------------------


# Was: DEFECT: a success is owed an announcement `announce_max_wait_ms + announce_timeout_ms`
# (35 s) after it ended; the supervisor's sweep then queues it and sends it directly. The
# announcer appended its own `announcement:queued` without looking at the run's stream or
# expecting a version, so an announcer that was late with its batch (a process paused 35 s,
# a stalled announcer) or whose completion another process's sweep found first sent the
# same result again: the user got the completion twice (a documented "known limit").
# Fix: the announcer reads each run's stream before it queues the batch, leaves out a run
# whose completion is queued already, and appends expecting the version it read (as the
# supervisor does), so only one of the two queues and sends it.
def test_a_completion_the_supervisor_announced_as_owed_is_not_announced_again_by_a_late_announcer(
    lmdb_store: EventStore, clock: FakeClock
) -> None:
    succeeded(lmdb_store, "r1", announce=True, result="42 invoices")  # ended at T0 + 10
    late = FakeClock(start=T0 + 10)  # the announcer's process: paused since the run ended
    clock.set(T0 + 10 + 36)  # the supervisor's: past the 35 s the announcement is owed after
    with (
        Scheduler(late) as announcer_scheduler,
        IoPortal() as announcer_portal,
        Scheduler(clock) as supervisor_scheduler,
        IoPortal() as supervisor_portal,
    ):
        try:
            late_chat, sweep_chat = MemoryChannel("chat"), MemoryChannel("chat")
            announcer = Announcer.start(
                store=lmdb_store,
                clock=late,
                scheduler=announcer_scheduler,
                portal=announcer_portal,
                channels={"chat": late_chat},
            )
            announcer.tell(Track(run_id="r1", parent="p1", channel="chat", conversation="conv-1"))
            announcer.tell(RunEnded(run_id="r1", outcome="succeeded", result="42 invoices"))
            assert "p1" in announcer.ask(GetBatches(), timeout=GUARD)  # its batch is due at +0.5
            SupervisorActor.start(
                store=lmdb_store,
                clock=clock,
                scheduler=supervisor_scheduler,
                portal=supervisor_portal,
                channels={"chat": sweep_chat},
                settings=SubagentSettings(),
                announce_timeout_ms=30_000,
            )  # its first sweep finds the completion owed and sends it directly
            attempted_on(supervisor_portal, sweep_chat, 1)
            late.advance(1)  # the announcer wakes up: its batch is due
            assert announcer.ask(GetBatches(), timeout=GUARD) == {}
            flush(announcer_portal)
        finally:
            pykka.ActorRegistry.stop_all(timeout=GUARD)
    queued = of(AnnouncementQueued, list(lmdb_store.read_stream("session:r1")))
    assert [q.kind for q in queued] == ["completion"]
    assert [m.text for m in sweep_chat.attempted] == [queued[0].text]
    assert late_chat.attempted == []


# -- a run's actor and a store away for a moment -----------------------------------------------


# Was: DEFECT: `SubAgentActor._completed` read and appended with no care for a store error:
# a work that returned while the database was away for a moment (a failover, a network
# blip) crashed the run's actor with its result in hand. The restarted actor does not run
# the work again, so the result was lost and the run sat `running` until its watchdog (up
# to 30 min, a `spawn_subagent` call waiting all that time), then was reported timed out
# and retried. Fix: the work's end is told again a second later while the store is away.
def test_a_result_returned_while_the_store_is_away_is_recorded_once_it_is_back(
    relayed_store: EventStore,
    pg_store: EventStore,
    relay: CuttingRelay,
    clock: FakeClock,
    fake: FakeProvider,
    chat: MemoryChannel,
    caplog: pytest.LogCaptureFixture,
) -> None:
    finish = threading.Event()

    async def work(report: RunReport) -> str:
        while not finish.is_set():
            await anyio.sleep(0.01)  # real-time: the test ends the work while the store is away
        return "the answer"

    channels = {"chat": chat}
    with Runtime(config(fake.base_url), store=relayed_store, clock=clock, channels=channels) as rt:
        rt.session("p1", channel="chat")
        handle = rt.spawn("p1", "tidy the notes", task_class="code", channel="chat", work=work)
        handle.status()  # spawned, its watchdog armed
        actor = handle.ref
        assert actor is not None
        relay.cut_now()  # the database goes away
        finish.set()
        until(
            lambda: logged(caplog, "subagent.completion_deferred") or not actor.is_alive(),
            what="the result met the outage",
        )
        relay.restore()
        until(lambda: reachable(relayed_store), what="the database back")
        ended = ended_after_outage(handle, clock)
    assert (ended.outcome, ended.result) == ("succeeded", "the answer")
    completed = of(SubagentCompleted, list(pg_store.read_stream(handle.stream)))
    assert [c.result for c in completed] == ["the answer"]


# Was: DEFECT: `SubAgentActor._observe` dropped a report the log refuses (`EventError`) but
# not one it could not take: a `report.progress()` while the database was away for a
# moment crashed the run's actor, which cancels the work (`on_failure`). The restarted
# actor does not run it again: the run was lost for a progress report, sat `running`
# until its watchdog and was retried. Fix: such a report is dropped with a warning
# (`subagent.report_unrecorded`), as one the log refuses; the work goes on.
def test_a_report_made_while_the_store_is_away_does_not_end_the_work(
    relayed_store: EventStore,
    pg_store: EventStore,
    relay: CuttingRelay,
    clock: FakeClock,
    fake: FakeProvider,
    chat: MemoryChannel,
    caplog: pytest.LogCaptureFixture,
) -> None:
    go_report, finish = threading.Event(), threading.Event()

    async def work(report: RunReport) -> str:
        while not go_report.is_set():
            await anyio.sleep(0.01)  # real-time: the test has the work report during the outage
        report.progress(120, step=1)
        while not finish.is_set():
            await anyio.sleep(0.01)  # real-time: the work ends once the store is back
        return "the answer"

    channels = {"chat": chat}
    with Runtime(config(fake.base_url), store=relayed_store, clock=clock, channels=channels) as rt:
        rt.session("p1", channel="chat")
        handle = rt.spawn("p1", "tidy the notes", task_class="code", channel="chat", work=work)
        handle.status()
        actor = handle.ref
        assert actor is not None
        relay.cut_now()
        go_report.set()
        until(
            lambda: logged(caplog, "subagent.report_unrecorded") or not actor.is_alive(),
            what="the report met the outage",
        )
        relay.restore()
        until(lambda: reachable(relayed_store), what="the database back")
        finish.set()
        ended = ended_after_outage(handle, clock)
    assert (ended.outcome, ended.result) == ("succeeded", "the answer")
