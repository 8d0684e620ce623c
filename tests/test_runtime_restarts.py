"""The Runtime restarts its infrastructure actors: health, dead letters, supervisor, announcer,
the activation worker.

Each is crashed for real (told an object it does not understand); the runtime decides the
restart as for a session (one_for_one, intensity, backoff: ``supervisor:restarted`` naming
the part), starts it again after the backoff (a ``FakeClock`` drives it), and everything
that held the old ref reaches the new actor. A real LMDB store, the fake provider over
loopback, a MemoryChannel; tests wait on futures, on the log and on the channel.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anyio
import anyio.to_thread
import lmdb
import pykka
import pytest

from stalwart import store as store_module
from stalwart.actors import (
    GAVE_UP_TEXT,
    ActivationWorker,
    Announcer,
    DeadLetterActor,
    Enqueue,
    ProviderHealthActor,
    RunReport,
    SupervisorActor,
)
from stalwart.channels import MemoryChannel
from stalwart.clock import FakeClock
from stalwart.config import Config, parse_config
from stalwart.events import (
    AnnouncementDeadLetterDelivered,
    AnnouncementDelivered,
    AnnouncementQueued,
    ProviderCallFailed,
    ProviderDegraded,
    ProviderRecovered,
    SessionCreated,
    SubagentCompleted,
    SupervisorGaveUp,
    SupervisorRestarted,
    TurnCompleted,
)
from stalwart.runtime import RunHandle, Runtime
from stalwart.store import EventStore, NewEvent
from stalwart.testing import Answer, FakeProvider
from tests._runtime_support import GUARD, delivered, has, log_until, of

AGENT: dict[str, Any] = {
    "provider": "main",
    "model": "m1",
    "prompt_timeout_ms": 5_000,
    "retry_prompt_timeout_ms": 5_000,
    "max_retries": 0,
}


def config(base_url: str) -> Config:
    return parse_config(
        {
            "providers": {"main": {"kind": "openai", "base_url": base_url}},
            "agents": {"default": dict(AGENT)},
            # a retry only after the health window: what delivers a dead letter is the drain
            "dead_letters": {"retry_base_ms": 120_000},
        }
    )


@pytest.fixture
def rt(
    store: EventStore, clock: FakeClock, fake: FakeProvider, chat: MemoryChannel
) -> Iterator[Runtime]:
    with Runtime(config(fake.base_url), store=store, clock=clock, channels={"chat": chat}) as rt:
        yield rt


def only(kind: type[pykka.Actor]) -> pykka.ActorRef[Any]:
    """The one running actor of ``kind`` (pykka's registry: no runtime internals)."""
    [ref] = pykka.ActorRegistry.get_by_class(kind)
    return ref


def crash(
    rt: Runtime, store: EventStore, kind: type[pykka.Actor], part: str, count: int = 1
) -> Any:
    """Crash the running ``kind`` actor for real; the decision that follows (the
    ``count``-th on ``part``), once the runtime has armed its restart."""
    only(kind).tell(object())  # it does not understand it: an unhandled exception
    decided = (SupervisorRestarted, SupervisorGaveUp)
    records = log_until(store, "runtime", has(decided, count))
    with rt._restarts_lock:  # the decision is appended, then its timer armed, under it
        pass
    decision = of(decided, records)[-1]
    assert (decision.actor, decision.reason) == (part, "TypeError")
    return decision


def restart(
    rt: Runtime, store: EventStore, clock: FakeClock, kind: type[pykka.Actor], part: str
) -> pykka.ActorRef[Any]:
    """Crash it, see the restart decided, let the backoff pass: the new actor."""
    dying = only(kind)
    restarted = crash(rt, store, kind, part)
    assert isinstance(restarted, SupervisorRestarted)
    assert (restarted.restarts, restarted.backoff_ms) == (1, 100)
    assert not pykka.ActorRegistry.get_by_class(kind)  # down during the backoff
    clock.advance(0.11)
    fresh = only(kind)
    assert fresh is not dying
    assert not dying.is_alive()
    return fresh


def fail(store: EventStore, clock: FakeClock, *agents: str) -> None:
    """Failed calls to ``main`` from ``agents`` (two agents within the window degrade it)."""
    events = [
        NewEvent(
            event=ProviderCallFailed(
                provider="main", model="m1", agent=agent, error_class="HTTPStatusError", status=503
            ),
            ts=clock.now(),
        )
        for agent in agents
    ]
    store.append("provider:main", events)


# -- each part ------------------------------------------------------------------------------


def test_a_crashed_health_actor_is_restarted_and_still_decides_a_degradation(
    rt: Runtime, store: EventStore, clock: FakeClock
) -> None:
    restart(rt, store, clock, ProviderHealthActor, "health:main")
    assert not rt.health()["main"].degraded  # it answers again, folded from its stream
    fail(store, clock, "a", "b")
    log_until(store, "provider:main", has(ProviderDegraded))
    assert rt.health()["main"].degraded
    assert rt.health_view.is_degraded("main")
    assert len(of(ProviderDegraded, list(store.read_stream("provider:main")))) == 1


def test_a_crashed_dead_letter_actor_keeps_its_queue_and_a_recovery_drains_it(
    rt: Runtime, store: EventStore, clock: FakeClock, chat: MemoryChannel
) -> None:
    enqueue = Enqueue(
        announcement_id="ann-1", channel="chat", conversation="c1", text="hello", reason="Boom"
    )
    entry_id = only(DeadLetterActor).ask(enqueue, timeout=GUARD)
    restart(rt, store, clock, DeadLetterActor, "deadletter")
    [entry] = rt.dead_letters().entries  # rebuilt from the log
    assert entry.entry_id == entry_id

    fail(store, clock, "a", "b")
    log_until(store, "provider:main", has(ProviderDegraded))
    clock.advance(rt.config.health.window_ms / 1000 + 1)  # a quiet window: recovered
    log_until(store, "provider:main", has(ProviderRecovered))
    # the recovery's Drain reached the new actor, which delivered the entry
    log_until(store, "deadletter", has(AnnouncementDeadLetterDelivered))
    [message] = delivered(rt, chat, 1)
    assert (message.text, message.conversation) == ("hello", "c1")
    queue = rt.dead_letters()
    assert (queue.entries, queue.delivered) == ((), 1)


def test_a_crashed_supervisor_is_restarted_and_still_restarts_a_crashed_agent(
    rt: Runtime, store: EventStore, clock: FakeClock
) -> None:
    session = rt.session("s1", channel="chat")
    restart(rt, store, clock, SupervisorActor, "supervisor")
    assert rt.runs() == {}  # it answers again
    dying = session.ref
    dying.tell(object())  # the Agent crashes: the new supervisor decides its restart
    records = log_until(store, "runtime", has(SupervisorRestarted, 2))
    assert of(SupervisorRestarted, records)[-1].actor == "session:s1"
    rt.runs()  # the supervisor has armed the restart
    clock.advance(0.11)
    assert session.ref is not dying
    assert session.status(timeout=GUARD).idle


def gated_run(rt: Runtime) -> tuple[RunHandle, threading.Event]:
    """A run whose work answers "the answer" once the returned gate is set."""
    gate = threading.Event()

    async def gated(report: RunReport) -> str:
        await anyio.to_thread.run_sync(gate.wait)
        return "the answer"

    handle = rt.spawn("p1", "write code", task_class="code", channel="chat", work=gated)
    handle.status()  # started: the announcer tracks it
    return handle, gate


def announced(rt: Runtime, handle: RunHandle, clock: FakeClock, chat: MemoryChannel) -> None:
    """The run succeeded, and its batch went out after the debounce."""
    assert handle.result(GUARD).outcome == "succeeded"
    clock.advance(rt.config.subagents.announce_debounce_ms / 1000 + 0.01)
    [message] = delivered(rt, chat, 1)
    assert message.text == "Sub-agent task completed:\nthe answer"


def test_a_crashed_announcer_is_restarted_and_still_announces_a_run_tracked_before(
    rt: Runtime, store: EventStore, clock: FakeClock, chat: MemoryChannel
) -> None:
    handle, gate = gated_run(rt)
    try:
        restart(rt, store, clock, Announcer, "announcer")
        assert rt.announcements() == {}  # it answers again
    finally:
        gate.set()
    announced(rt, handle, clock, chat)  # the run's parent ref: the new actor


def test_a_run_that_ends_while_the_announcer_is_down_is_announced_after_its_restart(
    rt: Runtime, store: EventStore, clock: FakeClock, chat: MemoryChannel
) -> None:
    """The run's end, told during the restart's backoff, is held and told to the new one."""
    handle, gate = gated_run(rt)
    restarted = crash(rt, store, Announcer, "announcer")
    assert isinstance(restarted, SupervisorRestarted)
    gate.set()  # the run ends while no announcer runs
    log_until(store, f"session:{handle.run_id}", has(SubagentCompleted))
    clock.advance(0.11)  # the backoff: the announcer runs again
    announced(rt, handle, clock, chat)


def test_a_batch_lost_with_the_announcer_is_announced_by_the_supervisors_sweep(
    rt: Runtime, store: EventStore, clock: FakeClock, chat: MemoryChannel
) -> None:
    async def quick(report: RunReport) -> str:
        return "the answer"

    handle = rt.spawn("p1", "write code", task_class="code", channel="chat", work=quick)
    assert handle.result(GUARD).outcome == "succeeded"
    assert list(rt.announcements()) == ["p1"]  # batched, not sent yet
    restart(rt, store, clock, Announcer, "announcer")  # the batch dies with it
    assert rt.announcements() == {}
    settings = rt.config.subagents
    owed_s = (settings.announce_max_wait_ms + rt.config.dead_letters.announce_timeout_ms) / 1000
    clock.advance(owed_s)
    assert chat.attempted == []  # owed, but the next sweep finds it
    clock.advance(settings.ghost_sweep_interval_ms / 1000)
    [message] = delivered(rt, chat, 1)
    assert message.text == "Sub-agent task completed:\nthe answer"
    records = log_until(store, f"session:{handle.run_id}", has(AnnouncementDelivered))
    [queued] = of(AnnouncementQueued, records)
    assert (queued.kind, message.idempotency_key) == ("completion", queued.announcement_id)
    assert of(AnnouncementDelivered, records)[0].path == "direct"
    clock.advance(settings.ghost_sweep_interval_ms / 1000)
    rt.runs()  # a barrier: the sweep ran
    assert len(chat.attempted) == 1


@pytest.mark.slow
def test_a_completion_a_sigkilled_process_never_announced_is_announced_by_the_next_one(
    tmp_path: Path, fake: FakeProvider, chat: MemoryChannel
) -> None:
    directory = tmp_path / "store"
    t0 = 1_800_000_000.0
    script = Path(__file__).with_name("_announce_child.py")
    argv = [sys.executable, str(script), str(directory), str(t0)]
    with subprocess.Popen(argv, stdout=subprocess.PIPE) as child:
        try:
            assert child.stdout is not None
            said = json.loads(child.stdout.readline() or "{}")
            assert "ended" in said, said
        finally:
            child.send_signal(signal.SIGKILL)
            child.wait(GUARD)
    run_id = said["ended"]
    clock = FakeClock(start=t0 + 60)  # the next process starts a minute later
    channels = {"chat": chat}
    with Runtime(config(fake.base_url), store=directory, clock=clock, channels=channels) as rt:
        [message] = delivered(rt, chat, 1)  # the supervisor's first sweep, at its start
        assert message.text == "Sub-agent task completed:\nthe answer"
        records = log_until(rt.store, f"session:{run_id}", has(AnnouncementDelivered))
        assert [e.path for e in of(AnnouncementDelivered, records)] == ["direct"]


def test_a_crashed_activation_worker_is_restarted_and_runs_the_messages_sent_meanwhile(
    rt: Runtime, store: EventStore, clock: FakeClock, chat: MemoryChannel, fake: FakeProvider
) -> None:
    session = rt.session("s1", channel="chat", conversation="c1")
    dying, owner = only(ActivationWorker), rt.worker(timeout=GUARD).owner
    restarted = crash(rt, store, ActivationWorker, "activations")
    assert isinstance(restarted, SupervisorRestarted)
    fake.add(Answer(text="still here"))
    session.send("are you there?")  # durable at once; no worker leases it yet

    clock.advance(0.11)

    fresh = only(ActivationWorker)
    assert fresh is not dying
    [reply] = delivered(rt, chat, 1)
    assert reply.text == "still here"
    log_until(store, "session:s1", has(TurnCompleted))
    assert rt.worker(timeout=GUARD).owner != owner  # a new owner, as a new process would be


# -- intensity --------------------------------------------------------------------------------


def test_a_part_that_keeps_crashing_is_given_up_on_with_no_notice(
    rt: Runtime, store: EventStore, clock: FakeClock, chat: MemoryChannel
) -> None:
    for count, backoff_ms in enumerate([100, 200, 400], 1):
        restarted = crash(rt, store, Announcer, "announcer", count)
        assert (restarted.restarts, restarted.backoff_ms) == (count, backoff_ms)
        clock.advance(backoff_ms / 1000 + 0.005)
        only(Announcer)
    gave_up = crash(rt, store, Announcer, "announcer", 4)
    assert isinstance(gave_up, SupervisorGaveUp)
    assert (gave_up.restarts, gave_up.session) == (3, None)
    clock.advance(10.0)
    assert not pykka.ActorRegistry.get_by_class(Announcer)
    assert not of(AnnouncementQueued, list(store.read_stream("runtime")))  # nobody to tell
    assert rt.dead_letters().entries == ()  # the other parts run on
    assert rt.runs() == {}


def test_a_part_that_fails_while_starting_is_reported_and_given_up_on(
    tmp_path: Path, clock: FakeClock, fake: FakeProvider, chat: MemoryChannel
) -> None:
    """pykka stops an actor whose ``on_start`` raises without calling ``on_failure``: an
    Agent that could not read its session's stream at start died untold (no restart,
    nothing in the ``runtime`` stream, the user never told). Now the failing start is a
    crash like any other: restarted with backoff, then given up on, all in the log, and
    the user gets the give-up notice."""
    directory = tmp_path / "store"
    with store_module.open(directory, clock=clock) as first:  # type: ignore[attr-defined]
        created = SessionCreated(agent="default", channel="chat")
        [record] = first.append("session:s1", [created])
    env = lmdb.open(str(directory), max_dbs=8)  # a record its fold cannot decode
    try:
        log_db = env.open_db(b"log")  # before the write transaction: it opens its own
        with env.begin(write=True) as txn:
            txn.put(record.position.to_bytes(8, "big"), b"\xc1garbage", db=log_db)
    finally:
        env.close()
    with (
        store_module.open(directory, clock=clock) as store,  # type: ignore[attr-defined]
        Runtime(config(fake.base_url), store=store, clock=clock, channels={"chat": chat}) as rt,
    ):
        rt.session("s1", channel="chat")
        for count, backoff_ms in enumerate([100, 200, 400], 1):
            records = log_until(store, "runtime", has(SupervisorRestarted, count))
            restarted = [r.event for r in records if isinstance(r.event, SupervisorRestarted)]
            assert (restarted[-1].actor, restarted[-1].backoff_ms) == ("session:s1", backoff_ms)
            clock.advance(backoff_ms / 1000 + 0.005)
        [gave_up] = of(SupervisorGaveUp, log_until(store, "runtime", has(SupervisorGaveUp)))
        assert (gave_up.actor, gave_up.reason) == ("session:s1", "CorruptRecordError")
        [notice] = delivered(rt, chat, 1)
        assert notice.text == GAVE_UP_TEXT
