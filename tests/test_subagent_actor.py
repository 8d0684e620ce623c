"""The SubAgent actor on real parts: an LMDB store in tmp_path, a FakeClock-driven
Scheduler and a real IoPortal.

Nothing here sleeps to wait for an outcome: tests wait on the store's head, on a
``threading.Event`` the work sets, on the parent's queue and on ``ask`` replies, all with
deadlines. Deadlines are reached with ``clock.set(at)``, which lands on ``at`` exactly.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Iterator
from typing import Any

import anyio
import pykka
import pytest

from stalwart.actors import (
    FAILED_SENTENCE,
    TIMED_OUT_SENTENCE,
    GetRun,
    IoPortal,
    RunEnded,
    RunReport,
    Scheduler,
    Spawn,
    SubAgentActor,
    failure_notice,
)
from stalwart.actors._subagent import _WorkDone
from stalwart.clock import FakeClock
from stalwart.config import SubagentSettings
from stalwart.errors import SpawnRefusedError
from stalwart.events import (
    Event,
    SubagentCompleted,
    SubagentProgress,
    SubagentSpawned,
    SubagentWatchdogTimeout,
)
from stalwart.state import STEP_KNOB, RunState
from stalwart.store import EventStore

WAIT = 10.0
MS = 0.001
T0 = 1_800_000_000.0  # the conftest clock's start
S = SubagentSettings()


class Job:
    """A run's work: reports what it is told, then waits until released (or cancelled)."""

    def __init__(self, result: str = "done", *, error: bool = False) -> None:
        self.result = result
        self.error = error
        self.started = threading.Event()
        self.cancelled = threading.Event()
        self.report: RunReport | None = None
        self._gate: anyio.Event | None = None

    async def __call__(self, report: RunReport) -> str:
        self.report = report
        self._gate = anyio.Event()
        report.progress(100, 1)
        self.started.set()
        try:
            await self._gate.wait()
        except anyio.get_cancelled_exc_class():
            self.cancelled.set()
            raise
        if self.error:
            raise RuntimeError("secret internal details /home/op/.key")
        return self.result

    def release(self, portal: IoPortal) -> None:
        assert self.started.wait(WAIT)
        portal.submit(self._open).result(WAIT)

    async def _open(self) -> None:
        assert self._gate is not None
        self._gate.set()


class Parent(pykka.ThreadingActor):
    """Records what it is told."""

    def __init__(self, told: queue.SimpleQueue[Any]) -> None:
        super().__init__()
        self.told = told

    def on_receive(self, message: Any) -> None:
        self.told.put(message)


class Harness:
    def __init__(
        self, store: EventStore, clock: FakeClock, scheduler: Scheduler, portal: IoPortal
    ) -> None:
        self.store, self.clock, self.scheduler, self.portal = store, clock, scheduler, portal
        self.told: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self.parent = Parent.start(self.told)

    def start(self, job: Job, **spawn: Any) -> pykka.ActorRef[Any]:
        fields: dict[str, Any] = {"run_id": "r1", "parent": "p1", "task": "research the thing"}
        return SubAgentActor.start(
            store=self.store,
            clock=self.clock,
            scheduler=self.scheduler,
            portal=self.portal,
            spawn=Spawn(**(fields | spawn)),
            work=job,
            parent=self.parent,
            settings=S,
        )

    def ended(self) -> RunEnded:
        message = self.told.get(timeout=WAIT)
        assert isinstance(message, RunEnded)
        return message


@pytest.fixture
def harness(lmdb_store: EventStore, clock: FakeClock) -> Iterator[Harness]:
    with Scheduler(clock) as scheduler, IoPortal() as portal:
        try:
            yield Harness(lmdb_store, clock, scheduler, portal)
        finally:
            pykka.ActorRegistry.stop_all(timeout=WAIT)


def run_of(ref: pykka.ActorRef[Any]) -> RunState:
    state = ref.ask(GetRun(), timeout=WAIT)
    assert isinstance(state, RunState)
    return state


def log(store: EventStore, count: int, stream: str = "session:r1") -> list[Event]:
    assert store.wait_for(count, WAIT) >= count, f"the log never reached {count} events"
    return [record.event for record in store.read_stream(stream)]


def started(harness: Harness, job: Job, **spawn: Any) -> pykka.ActorRef[Any]:
    """A run whose spawn and first progress are in the log."""
    ref = harness.start(job, **spawn)
    assert job.started.wait(WAIT)
    log(harness.store, 2)
    run_of(ref)  # the progress is folded
    return ref


def quiet_at(harness: Harness, ref: pykka.ActorRef[Any], at: float) -> None:
    head = harness.store.head()
    harness.clock.set(at)
    assert run_of(ref).status == "running"
    assert harness.store.head() == head
    assert harness.told.empty()


# -- the watchdog ----------------------------------------------------------------------------


def test_a_ten_minute_run_times_out_at_600_s_exactly_once(harness: Harness) -> None:
    job = Job()
    ref = started(harness, job, task_class="research")
    spawned, progress = log(harness.store, 2)
    assert isinstance(spawned, SubagentSpawned)
    assert (spawned.timeout_ms, spawned.timeout_knob, spawned.parent) == (
        600_000,
        "class_timeouts_ms.research",
        "p1",
    )
    assert progress == SubagentProgress(tokens=100, step=1)

    quiet_at(harness, ref, T0 + 600 - MS)  # 599.999 s: nothing
    assert not job.cancelled.is_set()

    harness.clock.set(T0 + 600)
    ended = harness.ended()
    expected = 'Sub-agent task "research the thing": ' + TIMED_OUT_SENTENCE + " (ran 10m 00s)"
    assert ended == RunEnded(run_id="r1", outcome="timed_out", notice=expected)
    assert ended.notice == failure_notice("research the thing", "timed_out", 600_000)
    assert job.cancelled.wait(WAIT), "the work was not cancelled"
    *_, fired = log(harness.store, 3)
    assert fired == SubagentWatchdogTimeout(
        deadline=T0 + 600, limit_ms=600_000, knob="class_timeouts_ms.research", elapsed_ms=600_000
    )

    # the result that was already on its way when the watchdog fired: recorded, not delivered
    ref.tell(_WorkDone("late result"))
    *_, late = log(harness.store, 4)
    assert late == SubagentCompleted(outcome="succeeded", result="late result")
    state = run_of(ref)
    assert (state.status, state.late_completion, state.result) == (
        "timed_out",
        True,
        "late result",
    )
    ref.tell(_WorkDone("later still"))
    harness.clock.set(T0 + 1200)
    run_of(ref)
    assert harness.store.head() == 4  # one watchdog, one late result
    assert harness.told.empty()


def test_a_run_that_completes_in_time_is_delivered_and_its_watchdog_disarmed(
    harness: Harness,
) -> None:
    job = Job("the answer")
    ref = started(harness, job, task_class="code")
    assert job.report is not None
    job.report.artifact("out/a.md", "ab" * 32, final=True)
    job.release(harness.portal)
    assert harness.ended() == RunEnded(run_id="r1", outcome="succeeded", result="the answer")
    events = log(harness.store, 4)
    assert events[-1] == SubagentCompleted(outcome="succeeded", result="the answer")
    assert run_of(ref).status == "succeeded"
    assert harness.scheduler.next_deadline() is None
    harness.clock.set(T0 + 3600)
    run_of(ref)
    assert harness.store.head() == 4


def test_a_failed_work_is_told_with_static_text_only(harness: Harness) -> None:
    job = Job(error=True)
    started(harness, job, task_class="formatting")
    harness.clock.set(T0 + 42)
    job.release(harness.portal)
    ended = harness.ended()
    assert ended.outcome == "failed"
    assert ended.notice == f'Sub-agent task "research the thing": {FAILED_SENTENCE} (ran 42s)'
    assert "secret" not in ended.notice
    *_, completed = log(harness.store, 3)
    assert completed == SubagentCompleted(outcome="failed", result="")


@pytest.mark.parametrize(
    ("max_steps", "limit_s", "knob"),
    [
        (3, 180, STEP_KNOB),  # 3 x 60 s < 600 s: the step budget binds
        (10, 600, "class_timeouts_ms.research"),  # equal: the run limit
        (20, 600, "class_timeouts_ms.research"),  # 1200 s > 600 s: the run limit
    ],
)
def test_max_steps_times_per_step_binds_when_smaller(
    harness: Harness, max_steps: int, limit_s: int, knob: str
) -> None:
    job = Job()
    ref = started(harness, job, task_class="research", max_steps=max_steps)
    quiet_at(harness, ref, T0 + limit_s - MS)
    harness.clock.set(T0 + limit_s)
    assert harness.ended().outcome == "timed_out"
    *_, fired = log(harness.store, 3)
    assert isinstance(fired, SubagentWatchdogTimeout)
    assert (fired.limit_ms, fired.knob) == (limit_s * 1000, knob)


# -- refused spawns --------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("spawn", "field"),
    [
        (
            {"task_class": "custom", "custom_timeout_ms": 1_800_001, "reason": "long"},
            "custom_timeout_ms",
        ),
        ({"task_class": "custom", "custom_timeout_ms": 60_000}, "reason"),
        ({"custom_timeout_ms": 60_000, "reason": "   "}, "reason"),
        ({"task_class": "custom"}, "custom_timeout_ms"),
    ],
)
def test_a_spawn_without_a_valid_timeout_is_refused_before_anything_is_appended(
    harness: Harness, spawn: dict[str, Any], field: str
) -> None:
    with pytest.raises(SpawnRefusedError) as refused:
        harness.start(Job(), **spawn)
    assert refused.value.field == field
    assert harness.store.head() == 0
    assert harness.scheduler.next_deadline() is None


def test_a_custom_timeout_up_to_30_minutes_with_a_reason_is_allowed(harness: Harness) -> None:
    job = Job()
    ref = started(
        harness, job, task_class="custom", custom_timeout_ms=1_800_000, reason="a deep audit"
    )
    spawned, _ = log(harness.store, 2)
    assert isinstance(spawned, SubagentSpawned)
    assert (spawned.timeout_ms, spawned.timeout_knob, spawned.timeout_reason) == (
        1_800_000,
        "custom_timeout_ms",
        "a deep audit",
    )
    quiet_at(harness, ref, T0 + 1800 - MS)
    harness.clock.set(T0 + 1800)
    assert harness.ended().outcome == "timed_out"


def test_reports_after_the_force_fail_are_dropped(harness: Harness) -> None:
    job = Job()
    ref = started(harness, job, task_class="formatting")
    harness.clock.set(T0 + 120)
    harness.ended()
    assert job.report is not None
    job.report.progress(500, 9)
    assert run_of(ref).tokens == 100
    assert harness.store.head() == 3
