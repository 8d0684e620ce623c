"""The Supervisor on real parts: an LMDB store in tmp_path, a FakeClock-driven Scheduler,
a real IoPortal, MemoryChannels, real SubAgent and DeadLetter actors, and a real child
process SIGKILLed with a run still running.

Nothing here sleeps to wait for an outcome: tests wait on the store's head, on channels
through the portal, on queues and on ``ask`` replies, all with deadlines. The sweeps run
on the fake clock (``clock.advance`` in steps of the sweep interval, then an ``ask`` as a
barrier); only the announce timeout is real time, and small.
"""

from __future__ import annotations

import json
import queue
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from functools import partial
from pathlib import Path
from typing import Any

import anyio
import pykka
import pytest

from stalwart import store as store_module
from stalwart.actors import (
    FAILED_SENTENCE,
    RESEND_GRACE_S,
    SWEPT_SENTENCE,
    TIMED_OUT_SENTENCE,
    DeadLetterActor,
    GetRun,
    GetRuns,
    IoPortal,
    RunReport,
    Scheduler,
    Spawn,
    SubAgentActor,
    SupervisorActor,
    batch_text,
    failure_notice,
)
from stalwart.channels import MemoryChannel, OutboundMessage
from stalwart.clock import FakeClock
from stalwart.config import SubagentSettings
from stalwart.events import (
    AnnouncementDeadLettered,
    AnnouncementDelivered,
    AnnouncementFallbackDirect,
    AnnouncementQueued,
    AnnouncementSendFailed,
    Event,
    SubagentCompleted,
    SubagentGhostSwept,
    SubagentRecoveryDecided,
    SubagentSpawned,
    SubagentSuspicious,
    SubagentWatchdogTimeout,
)
from stalwart.state import RunState
from stalwart.store import EventStore, NewEvent
from tests._runtime_support import advance_until, reap, sigkill

WAIT = 10.0
T0 = 1_800_000_000.0  # the conftest clock's start
S = SubagentSettings()
TICK = S.ghost_sweep_interval_ms / 1000  # 60 s, the heartbeat's too
ANNOUNCE_MS = 200  # the batcher timeout (on the FakeClock)
CHILD = Path(__file__).with_name("_subagent_child.py")


class Job:
    """A run's work: reports what the test tells it to, hangs until cancelled."""

    def __init__(self) -> None:
        self.report: RunReport | None = None
        self.started = threading.Event()
        self.cancelled = threading.Event()

    async def __call__(self, report: RunReport) -> str:
        self.report = report
        self.started.set()
        try:
            await anyio.sleep_forever()
        except anyio.get_cancelled_exc_class():
            self.cancelled.set()
            raise
        return "never"


class Tree:
    """A supervisor, a dead-letter actor and the runs the test (or a respawn) starts."""

    def __init__(
        self, store: EventStore, clock: FakeClock, scheduler: Scheduler, portal: IoPortal
    ) -> None:
        self.store, self.clock, self.scheduler, self.portal = store, clock, scheduler, portal
        self.chat = MemoryChannel("chat")
        self.announcer = MemoryChannel("parent")
        self.spawned: queue.SimpleQueue[Spawn] = queue.SimpleQueue()
        self.jobs: dict[str, Job] = {}
        self.runs: dict[str, pykka.ActorRef[Any]] = {}
        self.respawn = False  # start the respawned runs too
        self.dead_letters = DeadLetterActor.start(
            store=store, clock=clock, scheduler=scheduler, portal=portal, channels={}
        )
        self.supervisor = SupervisorActor.start(
            store=store,
            clock=clock,
            scheduler=scheduler,
            portal=portal,
            channels={"chat": self.chat},
            dead_letters=self.dead_letters,
            spawner=self._spawner,
            settings=S,
            announce_timeout_ms=ANNOUNCE_MS,
            announcer=self.announcer,
        )

    def _spawner(self, spawn: Spawn) -> None:
        if self.respawn:
            self.run(spawn)
        self.spawned.put(spawn)

    def run(self, spawn: Spawn) -> Job:
        job = Job()
        self.jobs[spawn.run_id] = job
        self.runs[spawn.run_id] = SubAgentActor.start(
            store=self.store,
            clock=self.clock,
            scheduler=self.scheduler,
            portal=self.portal,
            spawn=spawn,
            work=job,
            parent=self.supervisor,
            settings=S,
        )
        assert job.started.wait(WAIT)
        self.runs[spawn.run_id].ask(GetRun(), timeout=WAIT)  # started: its watchdog is armed
        return job

    def barrier(self) -> dict[str, Any]:
        runs = self.supervisor.ask(GetRuns(), timeout=WAIT)
        assert isinstance(runs, dict)
        return runs

    def tick(self, count: int = 1) -> None:
        for _ in range(count):
            self.clock.advance(TICK)
            self.barrier()


@contextmanager
def grown(store: EventStore, clock: FakeClock) -> Iterator[Tree]:
    """A tree on its own scheduler and portal, every actor stopped when the block ends."""
    with Scheduler(clock) as scheduler, IoPortal() as portal:
        try:
            yield Tree(store, clock, scheduler, portal)
        finally:
            pykka.ActorRegistry.stop_all(timeout=WAIT)


@pytest.fixture
def tree(lmdb_store: EventStore, clock: FakeClock) -> Iterator[Tree]:
    with grown(lmdb_store, clock) as built:
        yield built


def spawn(run_id: str = "r1", **fields: Any) -> Spawn:
    base: dict[str, Any] = {
        "run_id": run_id,
        "parent": "p1",
        "task": "summarise the report",
        "task_class": "formatting",
        "channel": "chat",
        "conversation": "conv-1",
    }
    return Spawn(**(base | fields))


def stream(store: EventStore, run_id: str) -> list[Event]:
    return [record.event for record in store.read_stream(f"session:{run_id}")]


def until(store: EventStore, check: Callable[[], Any]) -> Any:
    """Wait (on the store's head) until ``check()`` is truthy; return it."""
    deadline = time.monotonic() + WAIT
    while True:
        head = store.head()
        found = check()
        if found:
            return found
        left = deadline - time.monotonic()
        assert left > 0, "the log never reached the expected state"
        store.wait_for(head + 1, left)


def of(events: list[Event], kind: type[Any]) -> list[Any]:
    return [event for event in events if isinstance(event, kind)]


def delivered(portal: IoPortal, channel: MemoryChannel, count: int) -> list[OutboundMessage]:
    return portal.submit(partial(channel.wait_for, count)).result(WAIT)


def timed_out(tree: Tree, run_id: str = "r1", **fields: Any) -> Job:
    """A formatting run (120 s) whose watchdog fired."""
    job = tree.run(spawn(run_id, **fields))
    tree.clock.set(tree.clock.now() + 120)
    assert job.cancelled.wait(WAIT)
    return job


def recovery(tree: Tree, run_id: str) -> SubagentRecoveryDecided:
    found = until(tree.store, lambda: of(stream(tree.store, run_id), SubagentRecoveryDecided))
    [decided] = found
    assert isinstance(decided, SubagentRecoveryDecided)
    return decided


# -- the ghost sweep -------------------------------------------------------------------------


@pytest.mark.slow
def test_a_run_left_running_by_a_killed_process_is_swept_once_with_one_notice(
    tmp_path: Path,
) -> None:
    directory = tmp_path / "store"
    proc = subprocess.Popen(
        [sys.executable, str(CHILD), str(directory), repr(T0)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()  # the child says once its run is in the log
        assert json.loads(line) == {"running": "ghost"}, proc.stderr and proc.stderr.read()
        sigkill(proc, WAIT)
    finally:
        reap(proc, WAIT)

    clock = FakeClock(start=T0)
    with (
        store_module.open(directory, clock=clock) as store,
        Scheduler(clock) as scheduler,
        IoPortal() as portal,
    ):
        tree = Tree(store, clock, scheduler, portal)
        try:
            [run] = tree.barrier().values()
            assert run.run.status == "running"
            tree.tick(11)  # T0 + 660 s: past the watchdog's 600 s, nobody fired it
            assert of(stream(store, "ghost"), SubagentGhostSwept) == []
            tree.tick()  # T0 + 720 s: the run limit + 120 s
            [swept] = of(stream(store, "ghost"), SubagentGhostSwept)
            assert swept == SubagentGhostSwept(
                started_at=T0, grace_ms=120_000, elapsed_ms=720_000, limit_ms=600_000,
                deadline=T0 + 720,
            )  # fmt: skip
            [notice] = delivered(portal, tree.announcer, 1)
            text = failure_notice("research the migration", "swept", 720_000)
            assert (
                text == f'Sub-agent task "research the migration": {SWEPT_SENTENCE} (ran 12m 00s)'
            )
            assert (notice.text, notice.conversation, notice.kind) == (
                text,
                "conv-1",
                "failure_notice",
            )
            again = tree.spawned.get(timeout=WAIT)  # two steps done: continue from step 3
            assert again.attempt == 2
            assert again.task.endswith("Pick up from step 3.")
            tree.tick(5)
            events = until(store, lambda: of(stream(store, "ghost"), AnnouncementDelivered))
            assert len(events) == 1
            log = stream(store, "ghost")
            assert len(of(log, SubagentGhostSwept)) == 1
            assert len(of(log, AnnouncementQueued)) == 1
            assert len(of(log, SubagentRecoveryDecided)) == 1
            assert tree.announcer.attempted == [notice]
            assert tree.chat.attempted == []
        finally:
            pykka.ActorRegistry.stop_all(timeout=WAIT)


# -- the heartbeat sweep ---------------------------------------------------------------------


def test_frozen_tokens_are_flagged_once_and_never_killed(tree: Tree) -> None:
    job = tree.run(spawn(task_class="research"))  # 600 s: expected after 300 s
    assert job.report is not None
    job.report.progress(21_634, 2)
    tree.runs["r1"].ask(GetRun(), timeout=WAIT)
    tree.tick(4)  # T0 + 240 s
    assert of(stream(tree.store, "r1"), SubagentSuspicious) == []
    tree.tick()  # T0 + 300 s: long enough, and frozen for a whole interval
    [flagged] = of(stream(tree.store, "r1"), SubagentSuspicious)
    assert flagged == SubagentSuspicious(
        tokens=21_634, elapsed_ms=300_000, expected_ms=300_000, frozen_ms=300_000,
        interval_ms=60_000,
    )  # fmt: skip
    tree.tick(4)  # T0 + 540 s: the same frozen episode is not reported again
    assert len(of(stream(tree.store, "r1"), SubagentSuspicious)) == 1
    state = tree.runs["r1"].ask(GetRun(), timeout=WAIT)
    assert isinstance(state, RunState)
    assert state.status == "running"
    assert not job.cancelled.is_set()


def test_climbing_tokens_are_healthy_whatever_the_time(tree: Tree) -> None:
    job = tree.run(spawn(task_class="research"))
    assert job.report is not None
    for tick in range(1, 10):  # up to T0 + 540 s, well past the expected 300 s
        tree.clock.advance(TICK / 2)
        job.report.progress(1_000 * tick, tick)
        tree.runs["r1"].ask(GetRun(), timeout=WAIT)
        tree.clock.advance(TICK / 2)
        tree.barrier()
    assert of(stream(tree.store, "r1"), SubagentSuspicious) == []
    assert not job.cancelled.is_set()


# -- recovery --------------------------------------------------------------------------------


def test_a_final_artifact_is_delivered_not_redone(tree: Tree) -> None:
    job = tree.run(spawn())
    assert job.report is not None
    job.report.artifact("out/plan.md", "ab" * 32, final=True)
    tree.runs["r1"].ask(GetRun(), timeout=WAIT)
    tree.clock.set(T0 + 120)
    decided = recovery(tree, "r1")
    assert (decided.action, decided.reason, decided.artifacts) == (
        "deliver",
        "final_artifact",
        ("out/plan.md",),
    )
    tree.barrier()
    assert tree.spawned.empty()


def test_nothing_done_is_respawned_as_it_was_and_a_second_failure_escalates(
    tree: Tree,
) -> None:
    tree.respawn = True
    timed_out(tree)
    assert recovery(tree, "r1").action == "respawn"
    again = tree.spawned.get(timeout=WAIT)
    assert (again.task, again.attempt, again.task_class) == (
        "summarise the report",
        2,
        "formatting",
    )
    job = tree.jobs[again.run_id]
    tree.clock.set(tree.clock.now() + 120)  # the second attempt times out too
    assert job.cancelled.wait(WAIT)
    decided = recovery(tree, again.run_id)
    assert (decided.action, decided.reason, decided.attempt) == (
        "escalate",
        "attempts_exhausted",
        2,
    )
    tree.barrier()
    assert tree.spawned.empty()


def test_partial_work_is_respawned_with_the_continuation_context(tree: Tree) -> None:
    job = tree.run(spawn())
    assert job.report is not None
    job.report.progress(5_000, 3)
    job.report.artifact("out/notes.md", "cd" * 32)
    tree.runs["r1"].ask(GetRun(), timeout=WAIT)
    tree.clock.set(T0 + 120)
    decided = recovery(tree, "r1")
    context = "The last attempt completed steps 1-3 and saved out/notes.md. Pick up from step 4."
    assert (decided.action, decided.reason, decided.context) == (
        "respawn_continue",
        "partial_work",
        context,
    )
    again = tree.spawned.get(timeout=WAIT)
    assert again.task == f"summarise the report\n\n{context}"
    assert (again.attempt, again.parent, again.channel) == (2, "p1", "chat")


# -- the failure notice's paths --------------------------------------------------------------


def notice_events(tree: Tree, kind: type[Any]) -> list[Event]:
    return until(tree.store, partial(notice_events_now, tree, kind))


def notice_events_now(tree: Tree, kind: type[Any]) -> list[Event]:
    return of(stream(tree.store, "r1"), kind)


def test_the_notice_goes_through_the_parents_announcement(tree: Tree) -> None:
    timed_out(tree)
    [message] = delivered(tree.portal, tree.announcer, 1)
    text = f'Sub-agent task "summarise the report": {TIMED_OUT_SENTENCE} (ran 2m 00s)'
    assert message.text == text
    [done] = notice_events(tree, AnnouncementDelivered)
    [queued] = of(stream(tree.store, "r1"), AnnouncementQueued)
    assert queued == AnnouncementQueued(
        announcement_id=done.announcement_id, channel="chat", kind="failure_notice", text=text
    )
    assert done.path == "announce"
    assert tree.chat.attempted == []


def announce_timed_out(tree: Tree) -> None:
    """Move the clock past the hanging announce send's deadline (armed when it started)."""
    fallback = partial(notice_events_now, tree, AnnouncementFallbackDirect)
    advance_until(tree.clock, fallback, ANNOUNCE_MS / 1000)


def test_an_announcement_that_times_out_falls_back_to_a_direct_send(tree: Tree) -> None:
    tree.announcer.hang_next()
    timed_out(tree)
    announce_timed_out(tree)
    [message] = delivered(tree.portal, tree.chat, 1)
    [done] = notice_events(tree, AnnouncementDelivered)
    [fallback] = of(stream(tree.store, "r1"), AnnouncementFallbackDirect)
    assert fallback == AnnouncementFallbackDirect(
        announcement_id=done.announcement_id, timeout_ms=ANNOUNCE_MS, error_class="timeout"
    )
    assert done.path == "direct"
    assert message.idempotency_key == done.announcement_id
    assert tree.announcer.messages == []


def test_a_direct_send_that_fails_too_goes_to_the_dead_letter_queue(tree: Tree) -> None:
    tree.announcer.hang_next()
    tree.chat.fail_next(kind="connect")
    timed_out(tree)
    announce_timed_out(tree)
    [failed] = notice_events(tree, AnnouncementSendFailed)
    assert failed.error_class == "connect"
    [queued] = of(stream(tree.store, "r1"), AnnouncementQueued)

    def dead_lettered() -> list[Any]:
        events = [record.event for record in tree.store.read_stream("deadletter")]
        return of(events, AnnouncementDeadLettered)

    [entry] = until(tree.store, dead_lettered)
    assert (entry.announcement_id, entry.text, entry.conversation, entry.channel) == (
        queued.announcement_id,
        queued.text,
        "conv-1",
        "chat",
    )
    assert of(stream(tree.store, "r1"), AnnouncementDelivered) == []


def test_the_run_and_the_supervisor_share_its_stream_without_losing_a_write(tree: Tree) -> None:
    """The supervisor's suspicious decision lands between two of the run's own writes:
    the run's next append conflicts, it folds the decision and appends again."""
    job = tree.run(spawn(task_class="research"))
    assert job.report is not None
    tree.tick(5)  # T0 + 300 s: frozen since the spawn
    assert len(of(stream(tree.store, "r1"), SubagentSuspicious)) == 1
    job.report.progress(7_000, 4)  # the run's actor folded only up to its own spawn
    state = tree.runs["r1"].ask(GetRun(), timeout=WAIT)
    assert isinstance(state, RunState)
    assert (state.tokens, state.step, state.version) == (7_000, 4, 3)
    assert state.suspected_growth_at == T0  # the supervisor's decision, folded
    tree.tick(2)  # grew at 300 s; frozen again for a whole interval by 420 s
    assert len(of(stream(tree.store, "r1"), SubagentSuspicious)) == 2
    assert state.status == "running"


def run_timed_out(store: EventStore) -> None:
    """Run r9's log: spawned at T0, timed out at T0 + 120, its recovery decided; its
    failure notice not queued yet."""
    store.append(
        "session:r9",
        [
            NewEvent(
                event=SubagentSpawned(
                    parent="p1",
                    task="summarise the report",
                    task_class="formatting",
                    timeout_ms=120_000,
                    timeout_knob="class_timeouts_ms.formatting",
                    channel="chat",
                    conversation="conv-9",
                ),
                ts=T0,
            ),
            NewEvent(
                event=SubagentWatchdogTimeout(
                    deadline=T0 + 120,
                    limit_ms=120_000,
                    knob="class_timeouts_ms.formatting",
                    elapsed_ms=120_000,
                ),
                ts=T0 + 120,
            ),
            NewEvent(
                event=SubagentRecoveryDecided(action="respawn", reason="no_work"), ts=T0 + 120
            ),
        ],
    )


def notice_left_queued(store: EventStore) -> str:
    """:func:`run_timed_out`, its notice queued at T0 + 120 (its send's outcome
    unrecorded: the supervisor that queued it died, or is still sending it); the text."""
    run_timed_out(store)
    text = failure_notice("summarise the report", "timed_out", 120_000)
    notice = AnnouncementQueued(
        announcement_id="n1", channel="chat", kind="failure_notice", text=text
    )
    store.append("session:r9", [NewEvent(event=notice, ts=T0 + 120)])
    return text


def test_a_notice_a_crash_interrupted_is_sent_again_directly_by_the_next_supervisor(
    lmdb_store: EventStore, clock: FakeClock
) -> None:
    text = notice_left_queued(lmdb_store)  # the supervisor that queued it died
    clock.set(T0 + 130)
    with Scheduler(clock) as scheduler, IoPortal() as portal:
        try:
            tree = Tree(lmdb_store, clock, scheduler, portal)
            [message] = delivered(portal, tree.chat, 1)
            assert (message.text, message.idempotency_key, message.conversation) == (
                text,
                "n1",
                "conv-9",
            )
            [done] = until(lmdb_store, lambda: of(stream(lmdb_store, "r9"), AnnouncementDelivered))
            assert done == AnnouncementDelivered(announcement_id="n1", path="direct")
            tree.tick(3)
            assert tree.announcer.attempted == []
            assert len(tree.chat.attempted) == 1
            assert tree.spawned.empty()  # its recovery was decided before the crash
        finally:
            pykka.ActorRegistry.stop_all(timeout=WAIT)


def test_a_notice_another_supervisor_may_still_be_sending_is_sent_again_only_later(
    lmdb_store: EventStore, clock: FakeClock
) -> None:
    """A notice queued a second ago may be in flight from the supervisor of another
    process on the log: it is sent again (directly, once) only when its send could no
    longer be under way (the announce timeout plus ``RESEND_GRACE_S``), at a later sweep."""
    text = notice_left_queued(lmdb_store)
    clock.set(T0 + 121)
    with grown(lmdb_store, clock) as tree:
        tree.barrier()  # the first sweep ran: too young to be sent again

        async def a_few_loop_turns() -> None:  # a send it began would have reached the channel
            for _ in range(20):
                await anyio.sleep(0)

        tree.portal.submit(a_few_loop_turns).result(WAIT)
        assert tree.chat.attempted == []
        assert T0 + 121 + TICK >= T0 + 120 + ANNOUNCE_MS / 1000 + RESEND_GRACE_S
        tree.tick()  # the next sweep
        [message] = delivered(tree.portal, tree.chat, 1)
        assert (message.text, message.idempotency_key) == (text, "n1")
        tree.tick(2)
        assert len(tree.chat.attempted) == 1
        assert tree.announcer.attempted == []


# -- completions a crash lost ------------------------------------------------------------------

#: how long after a success its announcement is owed: announce_max_wait_ms + the timeout
OWED_S = (S.announce_max_wait_ms + ANNOUNCE_MS) / 1000


def succeeded(
    store: EventStore, run_id: str, *, announce: bool | None, result: str = "42 invoices"
) -> None:
    """A run's log as its SubAgent leaves it: spawned, then completed at T0 + 10."""
    store.append(
        f"session:{run_id}",
        [
            NewEvent(
                event=SubagentSpawned(
                    parent="p1", task="count the invoices", task_class="formatting",
                    timeout_ms=120_000, timeout_knob="class_timeouts_ms.formatting",
                    channel="chat", conversation="conv-1", announce=announce,
                ),
                ts=T0,
            ),
            NewEvent(event=SubagentCompleted(result=result), ts=T0 + 10),
        ],
    )  # fmt: skip


def test_a_success_whose_announcement_a_crash_lost_is_announced_directly(
    lmdb_store: EventStore, clock: FakeClock
) -> None:
    succeeded(lmdb_store, "r1", announce=True)  # its announcer died with the batch
    clock.set(T0 + 10 + OWED_S - 1)  # not owed yet: a live announcer may still send it
    with Scheduler(clock) as scheduler, IoPortal() as portal:
        try:
            tree = Tree(lmdb_store, clock, scheduler, portal)
            tree.barrier()
            assert tree.chat.attempted == []
            tree.tick()
            [message] = delivered(portal, tree.chat, 1)
            [queued] = of(stream(lmdb_store, "r1"), AnnouncementQueued)
            assert (queued.kind, queued.channel, queued.text) == (
                "completion",
                "chat",
                batch_text((("r1", "42 invoices"),)),
            )
            assert (message.text, message.idempotency_key, message.conversation) == (
                queued.text,
                queued.announcement_id,
                "conv-1",
            )
            [done] = until(lmdb_store, lambda: of(stream(lmdb_store, "r1"), AnnouncementDelivered))
            assert (done.announcement_id, done.path) == (queued.announcement_id, "direct")
            tree.tick(3)
            assert len(tree.chat.attempted) == 1
            assert tree.announcer.attempted == []
            assert tree.spawned.empty()  # a success is never recovered
        finally:
            pykka.ActorRegistry.stop_all(timeout=WAIT)


@pytest.mark.parametrize("announce", [False, None])
def test_a_success_that_asked_for_no_announcement_gets_none(
    lmdb_store: EventStore, clock: FakeClock, announce: bool | None
) -> None:
    """``announce=False``, or a log written before the field (None): nothing is owed."""
    succeeded(lmdb_store, "r1", announce=announce)
    clock.set(T0 + 10 + OWED_S)
    with Scheduler(clock) as scheduler, IoPortal() as portal:
        try:
            tree = Tree(lmdb_store, clock, scheduler, portal)
            tree.tick(2)
            assert tree.chat.attempted == []
            assert of(stream(lmdb_store, "r1"), AnnouncementQueued) == []
        finally:
            pykka.ActorRegistry.stop_all(timeout=WAIT)


def batch_left_queued(store: EventStore) -> str:
    """Runs r1 and r2 succeeded; their batch b1 was queued at T0 + 11 and its send never
    ended (the announcer's process died, or is still sending it); the batch's text."""
    text = batch_text((("r1", "first"), ("r2", "second")))
    for run_id, result in (("r1", "first"), ("r2", "second")):
        succeeded(store, run_id, announce=True, result=result)
        queued = AnnouncementQueued(
            announcement_id="b1", channel="chat", kind="completion", text=text
        )
        store.append(f"session:{run_id}", [NewEvent(event=queued, ts=T0 + 11)])
    return text


def test_a_batch_a_crash_cut_short_is_sent_again_once_with_its_own_id(
    lmdb_store: EventStore, clock: FakeClock
) -> None:
    text = batch_left_queued(lmdb_store)
    clock.set(T0 + 11 + OWED_S)  # the announcer's send never ended: its process died
    with Scheduler(clock) as scheduler, IoPortal() as portal:
        try:
            tree = Tree(lmdb_store, clock, scheduler, portal)
            [message] = delivered(portal, tree.chat, 1)
            assert (message.text, message.idempotency_key) == (text, "b1")
            for run_id in ("r1", "r2"):
                [done] = until(
                    lmdb_store, lambda r=run_id: of(stream(lmdb_store, r), AnnouncementDelivered)
                )
                assert done == AnnouncementDelivered(announcement_id="b1", path="direct")
            tree.tick(2)
            assert len(tree.chat.attempted) == 1
        finally:
            pykka.ActorRegistry.stop_all(timeout=WAIT)


def test_an_owed_completion_whose_send_fails_is_dead_lettered(
    lmdb_store: EventStore, clock: FakeClock
) -> None:
    succeeded(lmdb_store, "r1", announce=True)
    clock.set(T0 + 10 + OWED_S - 1)
    with Scheduler(clock) as scheduler, IoPortal() as portal:
        try:
            tree = Tree(lmdb_store, clock, scheduler, portal)
            tree.chat.fail_next(kind="connect")
            tree.tick()
            [failed] = until(
                lmdb_store, lambda: of(stream(lmdb_store, "r1"), AnnouncementSendFailed)
            )
            [queued] = of(stream(lmdb_store, "r1"), AnnouncementQueued)
            assert (failed.announcement_id, failed.error_class) == (
                queued.announcement_id,
                "connect",
            )

            def dead_lettered() -> list[Any]:
                events = [record.event for record in lmdb_store.read_stream("deadletter")]
                return of(events, AnnouncementDeadLettered)

            [entry] = until(lmdb_store, dead_lettered)
            assert (entry.announcement_id, entry.text, entry.conversation) == (
                queued.announcement_id,
                queued.text,
                "conv-1",
            )
            tree.tick(2)
            assert len(tree.chat.attempted) == 1  # the queue retries it, not the sweep
        finally:
            pykka.ActorRegistry.stop_all(timeout=WAIT)


def test_a_failed_run_gets_the_static_notice_and_is_respawned(tree: Tree) -> None:
    async def broken(report: RunReport) -> str:
        raise RuntimeError("token sk-secret rejected by /internal/api")

    SubAgentActor.start(
        store=tree.store, clock=tree.clock, scheduler=tree.scheduler, portal=tree.portal,
        spawn=spawn(), work=broken, parent=tree.supervisor, settings=S,
    )  # fmt: skip
    [message] = delivered(tree.portal, tree.announcer, 1)
    assert message.text == f'Sub-agent task "summarise the report": {FAILED_SENTENCE} (ran 0s)'
    assert recovery(tree, "r1").action == "respawn"
    assert tree.spawned.get(timeout=WAIT).attempt == 2
    assert not any("secret" in repr(event) for event in stream(tree.store, "r1"))
