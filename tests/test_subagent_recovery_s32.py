"""A recovery decision whose next run never started (session 32).

Once ``subagent:recovery_decided`` (respawn or split) was in a failed run's stream, the
supervisor never decided again: if the spawner never started the next run (the process
died between the append and the spawner call, the runtime closed in that window, or the
host's spawner raised), nothing ever did, though the user had been told the run would be
retried. Now a run's ``subagent:spawned`` names the id its recovery gives the next run
(``next_run_id``), and a supervisor starts a named run that is not in the log one
``ghost_sweep_interval_ms`` after the decision; a run's spawn expects an empty stream,
so two supervisors that start it start one run. Each test marked "Was: DEFECT" failed on
the code before the fix.

Real parts: an LMDB store in tmp_path, FakeClock-driven Schedulers, real IoPortals, the
real SupervisorActor, SubAgentActor and Runtime, a child process killed with SIGKILL.
Waits are on the log (woken by appends) or on actors' mailboxes, each bounded.
"""

from __future__ import annotations

import json
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pykka
from click.testing import CliRunner

from stalwart import store as store_module
from stalwart.actors import (
    DeadLetterActor,
    GetRun,
    GetRuns,
    IoPortal,
    Scheduler,
    Spawn,
    SubAgentActor,
    SupervisorActor,
)
from stalwart.channels import MemoryChannel
from stalwart.cli import cli
from stalwart.clock import FakeClock
from stalwart.config import SubagentSettings
from stalwart.events import (
    AnnouncementDelivered,
    AnnouncementQueued,
    Event,
    SubagentRecoveryDecided,
    SubagentSpawned,
    SubagentWatchdogTimeout,
)
from stalwart.runtime import Runtime
from stalwart.store import EventStore, NewEvent
from stalwart.testing import FakeProvider
from tests._raced import RacedOnce
from tests._runtime_support import reap, sigkill
from tests.test_runtime_subagents import config, hang
from tests.test_supervisor import WAIT, Job, until

T0 = 1_800_000_000.0  # the conftest clock's start
S = SubagentSettings()
#: how long a named next run is left to whoever started it
GRACE_S = S.ghost_sweep_interval_ms / 1000
FORMATTING_S = S.class_timeouts_ms.formatting / 1000


def spawns_of(store: EventStore, run_id: str) -> list[SubagentSpawned]:
    return [
        record.event
        for record in store.read_stream(f"session:{run_id}")
        if isinstance(record.event, SubagentSpawned)
    ]


def spawned(store: EventStore, run_id: str) -> SubagentSpawned:
    """The run's spawn, once it is in the log."""
    found: list[SubagentSpawned] = until(store, lambda: spawns_of(store, run_id))
    return found[0]


def recovery_of(store: EventStore, run_id: str) -> SubagentRecoveryDecided | None:
    for record in store.read_stream(f"session:{run_id}"):
        if isinstance(record.event, SubagentRecoveryDecided):
            return record.event
    return None


def left_by_a_crash(
    store: EventStore, run_id: str, decided: SubagentRecoveryDecided, **spawn: Any
) -> None:
    """A run's stream as a process that died right after its recovery decision left it:
    spawned, timed out, its notice delivered, the decision (what ``decide_recovery``
    gives for it), and no next run."""
    events: list[Event] = [
        SubagentSpawned(
            parent="p1",
            task="format the table",
            task_class="formatting",
            timeout_ms=120_000,
            timeout_knob="class_timeouts_ms.formatting",
            channel="chat",
            conversation="conv-1",
            **spawn,
        ),
        SubagentWatchdogTimeout(
            deadline=T0 + FORMATTING_S,
            limit_ms=120_000,
            knob="class_timeouts_ms.formatting",
            elapsed_ms=120_000,
        ),
        AnnouncementQueued(
            announcement_id=f"notice-{run_id}", channel="chat", kind="failure_notice", text="n"
        ),
        AnnouncementDelivered(announcement_id=f"notice-{run_id}", path="announce"),
        decided,
    ]
    at = [T0, *(T0 + FORMATTING_S for _ in events[1:])]
    records = [NewEvent(event=event, ts=ts) for event, ts in zip(events, at, strict=True)]
    store.append(f"session:{run_id}", records)


class Supervisor:
    """A supervisor on the store with the test's spawner, and the runs the spawner starts
    (each a SubAgentActor on a hanging work, counted)."""

    def __init__(
        self,
        store: EventStore,
        clock: FakeClock,
        scheduler: Scheduler,
        portal: IoPortal,
        spawner: Callable[[Spawn], object] | None = None,
    ) -> None:
        self.store, self.clock, self.scheduler, self.portal = store, clock, scheduler, portal
        self.asked: list[Spawn] = []
        self.works_started = 0
        self._lock = threading.Lock()
        self._built = threading.Event()  # a spawn asked at the supervisor's start waits
        self.runs: list[pykka.ActorRef[Any]] = []
        dead_letters = DeadLetterActor.start(
            store=store, clock=clock, scheduler=scheduler, portal=portal, channels={}
        )
        self.ref = SupervisorActor.start(
            store=store,
            clock=clock,
            scheduler=scheduler,
            portal=portal,
            channels={"chat": MemoryChannel("chat")},
            dead_letters=dead_letters,
            spawner=spawner or self.start,
            settings=S,
            announce_timeout_ms=200,
        )
        self._built.set()

    def start(self, spawn: Spawn) -> None:
        """Start the run ``spawn`` asks for (on this thread: the supervisor's)."""
        assert self._built.wait(WAIT)
        self.asked.append(spawn)
        self.runs.append(
            SubAgentActor.start(
                store=self.store,
                clock=self.clock,
                scheduler=self.scheduler,
                portal=self.portal,
                spawn=spawn,
                work=self.work,
                parent=self.ref,
                settings=S,
            )
        )

    async def work(self, report: Any) -> str:
        with self._lock:
            self.works_started += 1
        return await hang(report)

    def barrier(self) -> None:
        """Whatever was told to the supervisor and the runs it started is handled."""
        self.ref.ask(GetRuns(), timeout=WAIT)
        for run in list(self.runs):
            run.ask(GetRun(), timeout=WAIT)


@contextmanager
def parts(clock: FakeClock) -> Iterator[tuple[Scheduler, IoPortal]]:
    """A scheduler and a portal, every actor stopped when the block ends."""
    with Scheduler(clock) as scheduler, IoPortal() as portal:
        try:
            yield scheduler, portal
        finally:
            pykka.ActorRegistry.stop_all(timeout=WAIT)


def drained(portal: IoPortal) -> None:
    """Every call submitted to ``portal`` before this one has begun."""

    async def nothing() -> None:
        return None

    portal.submit(nothing).result(WAIT)


# -- a process killed between the decision and the spawn -----------------------------------

_CHILD = """
import json, os, sys, threading
import anyio, structlog
from stalwart import store as store_module
from stalwart.actors import GetRun, IoPortal, Scheduler, Spawn, SubAgentActor, SupervisorActor
from stalwart.channels import MemoryChannel
from stalwart.clock import FakeClock

def say(what):
    os.write(1, (json.dumps(what) + "\\n").encode())

async def work(report):
    await anyio.sleep_forever()

def spawner(spawn):  # the process is killed before it starts the next run
    say({"respawning": spawn.run_id})
    threading.Event().wait()

structlog.configure(logger_factory=structlog.PrintLoggerFactory(sys.stderr))
clock = FakeClock(start=float(sys.argv[2]))
store = store_module.open(sys.argv[1], clock=clock)
scheduler, portal = Scheduler(clock).start(), IoPortal().start()
supervisor = SupervisorActor.start(
    store=store, clock=clock, scheduler=scheduler, portal=portal,
    channels={"chat": MemoryChannel("chat")}, spawner=spawner,
)
spawn = Spawn(run_id="first", parent="p1", task="format the table",
              task_class="formatting", channel="chat", conversation="conv-1")
run = SubAgentActor.start(store=store, clock=clock, scheduler=scheduler, portal=portal,
                          spawn=spawn, work=work, parent=supervisor)
run.ask(GetRun(), timeout=30)  # started: its watchdog is armed
clock.advance(120)  # the watchdog fires; the supervisor decides a respawn
threading.Event().wait()  # until SIGKILL
"""


# Was: DEFECT: a process killed after `recovery_decided` (respawn) left the retry unstarted for good
def test_a_respawn_a_killed_process_never_started_is_started_by_the_next_runtime(
    tmp_path: Path, fake: FakeProvider, chat: MemoryChannel
) -> None:
    """The child's run times out, its supervisor records the respawn and is killed
    (SIGKILL) inside the spawner call. A runtime started on the log later starts the
    next attempt, under the id the first run's spawn named, once."""
    directory = tmp_path / "store"
    proc = subprocess.Popen(
        [sys.executable, "-c", _CHILD, str(directory), repr(T0)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()  # said inside the spawner: the decision is in the log
        assert line, proc.stderr and proc.stderr.read()
        respawning = json.loads(line)["respawning"]
        sigkill(proc, WAIT)
    finally:
        reap(proc, WAIT)

    clock = FakeClock(start=T0 + FORMATTING_S + GRACE_S)
    with store_module.open(directory, clock=clock) as store:
        [first] = spawns_of(store, "first")
        assert first.next_run_id == respawning
        decided = recovery_of(store, "first")
        assert decided is not None
        assert decided.action == "respawn"
        assert spawns_of(store, respawning) == []  # the child never started it
        with Runtime(config(fake.base_url), store=store, clock=clock, channels={"chat": chat}):
            second = spawned(store, respawning)
            assert (second.attempt, second.task, second.parent) == (2, "format the table", "p1")
        assert len(spawns_of(store, respawning)) == 1


# -- the host's spawner raised ------------------------------------------------------------------


# Was: DEFECT: a spawner that raised once (only logged) left the decided respawn unstarted for good
def test_a_respawn_whose_spawner_raised_is_started_at_a_later_sweep(
    lmdb_store: EventStore, clock: FakeClock
) -> None:
    failures = ["the host's queue was full"]

    with parts(clock) as (scheduler, portal):

        def flaky(spawn: Spawn) -> None:
            if failures:
                raise RuntimeError(failures.pop())
            tree.start(spawn)

        tree = Supervisor(lmdb_store, clock, scheduler, portal, spawner=flaky)
        spawn = Spawn(run_id="first", parent="p1", task="format the table", task_class="formatting")
        tree.start(spawn)
        tree.barrier()  # started: its watchdog is armed
        clock.advance(FORMATTING_S)  # timed out: the respawn is decided, the spawner raises
        decided = until(lmdb_store, lambda: recovery_of(lmdb_store, "first"))
        assert decided.action == "respawn"
        tree.barrier()
        assert failures == []
        assert len(tree.asked) == 1  # only the first run
        named = spawns_of(lmdb_store, "first")[0].next_run_id
        assert named is not None
        assert spawns_of(lmdb_store, named) == []

        clock.advance(GRACE_S)  # the next sweep past the grace starts it
        tree.barrier()
        second = spawned(lmdb_store, named)
        assert second.attempt == 2
        tree.clock.advance(GRACE_S)  # and later sweeps leave it alone
        tree.barrier()
        assert [s.run_id for s in tree.asked] == ["first", named]
        assert len(spawns_of(lmdb_store, named)) == 1


# -- two supervisors on one log ---------------------------------------------------------------


# Was: DEFECT: after a crash, two supervisors on one log started the decided respawn zero times
def test_two_supervisors_start_one_run_for_a_decision_a_crash_left(
    lmdb_store: EventStore, clock: FakeClock
) -> None:
    """Both supervisors find the respawn unstarted and both call their spawner (held
    until both did, so both start an actor for it): one run is spawned, one work runs."""
    left_by_a_crash(
        lmdb_store,
        "first",
        SubagentRecoveryDecided(action="respawn", reason="no_work", attempt=1),
        next_run_id="next",
    )
    clock.set(T0 + FORMATTING_S + GRACE_S)
    both = threading.Barrier(2, timeout=WAIT)
    built = threading.Event()
    trees: list[Supervisor] = []

    def gated(index: int) -> Callable[[Spawn], None]:
        def spawner(spawn: Spawn) -> None:
            both.wait()  # neither starts its run before both found it unstarted
            assert built.wait(WAIT)
            trees[index].start(spawn)

        return spawner

    with parts(clock) as (scheduler, portal):
        trees.append(Supervisor(lmdb_store, clock, scheduler, portal, spawner=gated(0)))
        trees.append(Supervisor(lmdb_store, clock, scheduler, portal, spawner=gated(1)))
        built.set()
        second = spawned(lmdb_store, "next")
        for tree in trees:
            tree.barrier()
        drained(portal)
        assert [len(tree.asked) for tree in trees] == [1, 1]  # both started an actor
        assert second.attempt == 2
        assert len(spawns_of(lmdb_store, "next")) == 1
        assert sum(tree.works_started for tree in trees) == 1


# Was: DEFECT: a run's actor appended a 2nd `subagent:spawned` over another writer's, ran the work
def test_a_runs_actor_does_not_spawn_over_another_writers_spawn(
    lmdb_store: EventStore, clock: FakeClock, scheduler: Scheduler, portal: IoPortal
) -> None:
    """Another writer spawns the run between the actor's read of the empty stream and its
    append: the actor's append conflicts, and it folded that spawn and appended its own
    after it all the same (and ran the work a second time). Now it only watches the run."""
    other = SubagentSpawned(parent="p1", task="format the table", task_class="formatting",
                            timeout_ms=120_000)  # fmt: skip
    raced = RacedOnce(lmdb_store, "session:r1", other)
    raced.armed = True
    job = Job()
    spawn = Spawn(run_id="r1", parent="p1", task="format the table", task_class="formatting")
    ref = SubAgentActor.start(
        store=raced, clock=clock, scheduler=scheduler, portal=portal, spawn=spawn, work=job
    )
    try:
        state = ref.ask(GetRun(), timeout=WAIT)
        drained(portal)
        assert not raced.armed  # the other writer went first
        assert spawns_of(lmdb_store, "r1") == [other]
        assert (state.status, state.version) == ("running", 1)
        assert not job.started.is_set()
    finally:
        ref.stop(timeout=WAIT)


# -- a split ----------------------------------------------------------------------------------


# Was: DEFECT: a split's subtasks a crash left unstarted were never started
def test_a_split_a_crash_left_unstarted_starts_each_subtask_under_its_named_id(
    lmdb_store: EventStore, clock: FakeClock
) -> None:
    left_by_a_crash(
        lmdb_store,
        "first",
        SubagentRecoveryDecided(
            action="split", reason="attempts_exhausted", attempt=3, subtasks=("part a", "part b")
        ),
        attempt=3,
        next_run_id="next",
    )
    clock.set(T0 + FORMATTING_S + GRACE_S)
    with parts(clock) as (scheduler, portal):
        tree = Supervisor(lmdb_store, clock, scheduler, portal)
        first, second = spawned(lmdb_store, "next-1"), spawned(lmdb_store, "next-2")
        tree.barrier()
        assert (first.task, first.attempt, first.split_from) == ("part a", 1, "first")
        assert (second.task, second.attempt, second.split_from) == ("part b", 1, "first")
        assert sorted(spawn.run_id for spawn in tree.asked) == ["next-1", "next-2"]


# -- logs written before the fix, and replay ---------------------------------------------------


def test_an_old_decision_starts_nothing_and_replay_verifies_old_and_new_logs_clean(
    store: EventStore, clock: FakeClock, fake: FakeProvider, chat: MemoryChannel, tmp_path: Path
) -> None:
    """A decision whose run's spawn named no next run (a log written before the field) is
    left as it was: its next run got an id of its own when it was started. The runs the
    runtime respawns now, and that old one, verify clean."""
    left_by_a_crash(
        store, "old", SubagentRecoveryDecided(action="respawn", reason="no_work", attempt=1)
    )
    with Runtime(config(fake.base_url), store=store, clock=clock, channels={"chat": chat}) as rt:
        handle = rt.spawn("p1", "format the table", task_class="formatting", work=hang)
        handle.status()  # started: its watchdog is armed
        clock.advance(FORMATTING_S)
        assert handle.result(WAIT).outcome == "timed_out"
        named = spawns_of(store, handle.run_id)[0].next_run_id
        assert named is not None
        assert spawned(store, named).attempt == 2  # started at once, under the named id
        for _ in range(3):  # sweeps well past the old decision's grace
            clock.advance(GRACE_S)
        rt._parts._supervisor.ask(GetRuns(), timeout=WAIT)  # type: ignore[union-attr]
    attempts = [
        info.stream
        for info in store.streams()
        if any(s.attempt == 2 for s in spawns_of(store, info.stream.removeprefix("session:")))
    ]
    assert attempts == [f"session:{named}"]  # the old run was not started again
    result = CliRunner().invoke(
        cli, ["--store", str(tmp_path / "store"), "replay", "--all", "--verify"]
    )
    assert result.exit_code == 0, result.output
