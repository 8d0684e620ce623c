"""No answer is lost between the Agent's send, the dead-letter queue, the durable worker's
leases and passivation: defects a review found, each test failing on the code before its
fix for the reason its docstring names ("Harm").

Real parts only: a real LMDB store in a temp dir, the fake provider over loopback HTTP,
a MemoryChannel, the runtime's own actors; time from the FakeClock.
"""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pykka

from stalwart import store as store_module
from stalwart.actors import AgentStatus, DeadLetterActor
from stalwart.channels import MemoryChannel
from stalwart.clock import FakeClock
from stalwart.config import Config
from stalwart.errors import ConfigError
from stalwart.events import (
    AnnouncementDeadLettered,
    AnnouncementQueued,
    AnnouncementSendFailed,
    SupervisorRestarted,
    TurnCompleted,
    TurnStarted,
)
from stalwart.runtime import Runtime, interrupt
from stalwart.store import EventStore
from stalwart.testing import Answer, FakeProvider, Hang
from tests._runtime_support import GUARD, delivered, has, log_until, of, runtime_config

#: How long a test waits for what a correct runtime does at once, before it fails.
SHORT = 4.0


def _config(fake: FakeProvider, **extra: Any) -> Config:
    return runtime_config(fake.base_url, prompt_timeout_ms=120_000, **extra)


def _until(check: Any, timeout: float = SHORT, clock: FakeClock | None = None) -> bool:
    """Poll ``check()`` until it holds (True) or ``timeout`` real seconds pass (False).
    With a clock, fake time moves on half a second per poll, so that backoffs a correct
    runtime waits out can pass."""
    give_up = time.monotonic() + timeout
    while time.monotonic() < give_up:
        if check():
            return True
        if clock is not None:
            clock.advance(0.5)
        time.sleep(0.02)  # real-time: the actors append on their own threads; poll
    return bool(check())


def _dead_lettered(store: EventStore, announcement_id: str) -> bool:
    return any(
        e.announcement_id == announcement_id
        for e in of(AnnouncementDeadLettered, list(store.read_stream("deadletter")))
    )


def test_a_failed_answer_reaches_the_dead_letters_after_the_next_wake_was_fenced_out(
    store: EventStore, clock: FakeClock, fake: FakeProvider, chat: MemoryChannel
) -> None:
    """The answer to message 1 is being sent when message 2's wake starts (same Agent,
    lease epoch 2). An operator interrupts the session from another process (``stalwart
    session interrupt``: the store claims epoch 3; a worker taking the lease over does
    the same). Then the answer's send fails (channel unreachable / timed out).

    Harm: the Agent records the send's outcome with the *new wake's* fence, the append
    is rejected (FencedError), and the failed answer is neither recorded as
    ``announcement:send_failed`` nor handed to the dead-letter queue: the user never gets
    the answer to message 1, nothing retries it, and the log shows it queued for ever.

    Correct: a send's outcome belongs to the announcement, not to the wake that happens
    to be running; it is recorded and dead-lettered whatever the lease.
    """
    fake.add(Answer(text="first answer"), Hang())  # message 2's model call hangs
    chat.hang_next(1)  # the first answer's send hangs until its send deadline (1.5 s)
    config = _config(fake, dead_letters={"announce_timeout_ms": 1_500})
    with Runtime(config, store=store, clock=clock, channels={"chat": chat}) as rt:
        session = rt.session("s1", channel="chat")
        session.send("one")
        records = log_until(store, "session:s1", has(AnnouncementQueued))
        [queued] = of(AnnouncementQueued, records)
        delivered(rt, chat, 1, attempted=True)  # the answer's send is in flight
        session.send("two")
        fake.wait_for(lambda requests: len(requests) >= 2, GUARD)  # wake 2 is running
        interrupt(store, "s1", "wrong customer", ts=clock.now())  # as the CLI does
        clock.advance(1.5)  # the send deadline passes (on the Clock) and the send fails
        assert _until(lambda: _dead_lettered(store, queued.announcement_id)), (
            "the failed answer never reached the dead-letter queue; session log: "
            f"{[r.type for r in store.read_stream('session:s1')]}"
        )
        # the queue's entry is in the log first, the answer's failure right after it
        failed = of(
            AnnouncementSendFailed, log_until(store, "session:s1", has(AnnouncementSendFailed))
        )
        assert [e.announcement_id for e in failed] == [queued.announcement_id]


def test_a_failed_answer_is_not_lost_while_the_dead_letter_queue_restarts(
    store: EventStore, clock: FakeClock, fake: FakeProvider, chat: MemoryChannel
) -> None:
    """The dead-letter actor crashed and is waiting out its restart backoff (100 ms+;
    a store error crashes it) when an answer's send fails.

    Harm: the Agent records ``announcement:send_failed`` and tells ``Enqueue`` to the
    dead-letter queue's LiveRef, which raises ActorDeadError while the part is down; the
    Agent swallows it. The restarted queue rebuilds only from the ``deadletter`` stream,
    and the Agent never sends a ``send_failed`` announcement again, so the answer is lost
    for good, with no event and no error saying so.

    Correct: an Enqueue told while the queue is down reaches the restarted queue (kept
    until it is back, or made durable first), so the answer is retried and delivered.
    """
    chat.fail_next(1)  # the channel refuses the answer
    with Runtime(_config(fake), store=store, clock=clock, channels={"chat": chat}) as rt:
        session = rt.session("s1", channel="chat")
        [dying] = pykka.ActorRegistry.get_by_class(DeadLetterActor)
        dying.tell(object())  # it does not understand it: it crashes
        log_until(store, "runtime", has(SupervisorRestarted))
        assert not pykka.ActorRegistry.get_by_class(DeadLetterActor)  # down: the backoff
        session.send("hello")
        records = log_until(store, "session:s1", has(AnnouncementSendFailed))
        [failed] = of(AnnouncementSendFailed, records)
        session.ref.ask(AgentStatus(), timeout=GUARD)  # the Agent has told its Enqueue
        clock.advance(0.11)  # the restart backoff passes
        assert _until(lambda: bool(pykka.ActorRegistry.get_by_class(DeadLetterActor)))

        def queued() -> list[str]:
            return [e.announcement_id for e in rt.dead_letters().entries]

        assert _until(lambda: queued() == [failed.announcement_id]), (
            "the failed answer is in no dead-letter entry: it will never be retried"
        )


def test_passivation_does_not_cut_off_a_send_in_flight(
    store: EventStore, clock: FakeClock, fake: FakeProvider, chat: MemoryChannel
) -> None:
    """``activations.passivate_after_ms`` (1 s here) is accepted below
    ``dead_letters.announce_timeout_ms`` (2 s), and passivation looks only at wakes: an
    Agent whose answer is still being sent (a slow channel) is stopped.

    Harm: the send's outcome comes back to a dead actor and is dropped. A failed answer
    is never recorded as ``announcement:send_failed`` nor dead-lettered (the user never
    gets it, unless the session happens to be woken again); a send that succeeded late
    is never recorded as delivered, so the next start sends it a second time.

    Correct: either the config refuses ``passivate_after_ms <= announce_timeout_ms``, or
    an Agent with a send in flight is not passivated until the send has ended.
    """
    refused: str | None = None
    try:
        config = _config(
            fake,
            activations={"passivate_after_ms": 1_000},
            dead_letters={"announce_timeout_ms": 2_000},
        )
    except ConfigError as exc:  # the config refuses what passivation cannot honour
        refused = exc.key or ""
    if refused is not None:
        assert "passivate_after_ms" in refused or "announce_timeout_ms" in refused
        return
    chat.hang_next(1)  # the answer's send hangs until its deadline (2 s on the Clock)
    with Runtime(config, store=store, clock=clock, channels={"chat": chat}) as rt:
        session = rt.session("s1", channel="chat")
        session.send("hello")
        records = log_until(store, "session:s1", has(AnnouncementQueued))
        [queued] = of(AnnouncementQueued, records)
        delivered(rt, chat, 1, attempted=True)  # in flight
        clock.advance(1.5)  # the session has had no wake for passivate_after_ms
        # the sweep runs on its own thread: real time for it to (wrongly) stop the Agent
        # while the send is still in flight, before the send's deadline passes
        _until(lambda: not session.ref.is_alive(), timeout=0.5)
        clock.advance(0.6)  # the send's deadline: it fails
        assert _until(lambda: _dead_lettered(store, queued.announcement_id), timeout=5.0), (
            "the answer's failed send was never recorded nor dead-lettered; session log: "
            f"{[r.type for r in store.read_stream('session:s1')]}"
        )


def _per_status_s(ref: pykka.ActorRef[Any]) -> float:
    """How long the Agent takes over one told AgentStatus (to size the flood below)."""
    count = 2_000
    started = time.monotonic()
    for _ in range(count):
        ref.tell(AgentStatus())
    ref.ask(AgentStatus(), timeout=GUARD)
    return (time.monotonic() - started) / count


def test_passivation_never_strands_a_wake_handed_to_the_agent_it_stops(
    store: EventStore, clock: FakeClock, fake: FakeProvider, chat: MemoryChannel
) -> None:
    """The passivation sweep asks the worker what runs, snapshots when each session last
    had a wake, then stops the idle Agents one by one. A wake the worker hands to one of
    them meanwhile (a user message arriving during the sweep) goes to an Agent the sweep
    has already judged idle: the sweep stops it mid-wake.

    To make the interleaving certain, the first Agent the sweep stops (s0) is busy for
    about a second (its mailbox holds work), as stopping hundreds of idle Agents one by
    one would take; s1's message arrives during that second.

    Harm: the stopped Agent tells no one; the worker still holds s1's lease and renews it
    for ever, so the turn stays ``running``, the user never gets an answer, and every
    later message of s1 waits behind the stranded lease (until the process restarts).

    Correct: a session with a wake handed to it is never passivated (the check and the
    stop are one step with the hand-off), or a stopped Agent gives its wake back so the
    worker retries it: the user gets an answer.
    """
    fake.set_default(Answer(text="default answer"))
    config = _config(fake, activations={"passivate_after_ms": 1_000})
    with Runtime(config, store=store, clock=clock, channels={"chat": chat}) as rt:
        s0 = rt.session("s0", channel="chat")
        s1 = rt.session("s1", channel="chat")
        s0.send("hi")  # s0 has had a wake first: the sweep stops it first
        delivered(rt, chat, 1)
        s1.send("hi")
        delivered(rt, chat, 2)
        busy = s0.ref
        per_status = _per_status_s(busy)
        for _ in range(min(400_000, int(1.0 / max(per_status, 1e-7)))):  # about a second
            busy.tell(AgentStatus())
        fake.add(Answer(text="answer after the sweep", first_delay_ms=1_500))
        start = clock.now()
        sweep = threading.Thread(target=clock.advance, args=(1.0,))  # fires the sweep
        sweep.start()
        assert _until(lambda: clock.now() >= start + 1.0, timeout=GUARD)
        # the sweep has asked the worker what runs and is stopping s0 by now
        time.sleep(0.05)  # real-time: the message must land during the sweep
        s1.send("are you there?")  # handed to s1's Agent, which the sweep judged idle
        sweep.join(GUARD)
        assert not sweep.is_alive()
        answered = _until(lambda: len(chat.messages) >= 3, timeout=5.0, clock=clock)
        records = list(store.read_stream("session:s1"))
        started = {e.turn_id for e in of(TurnStarted, records)}
        ended = {e.turn_id for e in of(TurnCompleted, records)}
        assert answered, (
            f"s1 never answered: turns left running {started - ended}, "
            f"worker still holds {rt.worker().running}"
        )
        assert started == ended


CHILD = Path(__file__).with_name("_dead_letter_peer_child.py")


def test_a_failed_answer_is_dead_lettered_when_another_worker_dead_lettered_first(
    tmp_path: Path, clock: FakeClock, fake: FakeProvider, chat: MemoryChannel
) -> None:
    """Two worker processes share one store (``stalwart worker`` or a ``Runtime`` each,
    as docs/scaling.md runs them); each has its own dead-letter actor on the one
    ``deadletter`` stream. The other process dead-letters an answer of its own; then
    an answer of this process fails.

    Harm: this process's dead-letter actor appends the entry expecting the version it
    folded at start, gets ConcurrencyError (the other process wrote meanwhile) and
    crashes; the restart rebuilds from the log, where the entry never got, so the
    failed answer is lost for good (the Enqueue was a tell; no one retries it).

    Correct: a conflict on the shared stream refolds what the other writer appended and
    appends again (as the health actor does on its stream): the entry is recorded.
    """
    store = store_module.open(tmp_path / "store", clock=clock)
    try:
        chat.fail_next(1)  # this process's answer will be refused
        with Runtime(_config(fake), store=store, clock=clock, channels={"chat": chat}) as rt:
            session = rt.session("s1", channel="chat")
            child = subprocess.run(
                [
                    sys.executable,
                    str(CHILD),
                    str(tmp_path / "store"),
                    fake.base_url,
                    repr(clock.now()),
                ],
                capture_output=True,
                text=True,
                timeout=GUARD,
                cwd=Path(__file__).parent.parent,
                check=False,
            )
            assert child.returncode == 0, child.stderr[-2_000:]
            theirs = json.loads(child.stdout.splitlines()[-1])["dead_lettered"]
            session.send("hello")
            records = log_until(store, "session:s1", has(AnnouncementSendFailed))
            [failed] = of(AnnouncementSendFailed, records)
            session.ref.ask(AgentStatus(), timeout=GUARD)  # the Agent has told its Enqueue

            def ours() -> bool:
                return _dead_lettered(store, failed.announcement_id)

            assert _until(ours, clock=clock), (
                "this process's failed answer never reached the dead-letter stream; "
                f"runtime log: {[r.type for r in store.read_stream('runtime')]}"
            )
            assert _dead_lettered(store, theirs)
    finally:
        store.close()


def test_a_failed_answer_is_queued_before_its_failure_is_recorded(
    store: EventStore, clock: FakeClock, fake: FakeProvider, chat: MemoryChannel
) -> None:
    """The Agent appended ``announcement:send_failed`` and only then told the dead-letter
    queue. A crash between the two left a failure in the log that nobody would retry: the
    next start does not send a failed answer again (it has an outcome) and the queue
    never had it.

    Correct: the queue's ``announcement:dead_lettered`` is in the log before the
    ``announcement:send_failed`` that led to it (a crash between them leaves a queued
    entry, and an answer with no outcome that the next start sends again: at least
    once, never lost)."""
    chat.fail_next(1, kind="server_error")
    with Runtime(_config(fake), store=store, clock=clock, channels={"chat": chat}) as rt:
        rt.session("s1", channel="chat").send("hello")
        [failed] = of(
            AnnouncementSendFailed, log_until(store, "session:s1", has(AnnouncementSendFailed))
        )
        assert _until(lambda: _dead_lettered(store, failed.announcement_id))
        positions = {
            (type(r.event), getattr(r.event, "announcement_id", None)): r.position
            for r in store.read_all()
        }
    queued = positions[(AnnouncementDeadLettered, failed.announcement_id)]
    recorded = positions[(AnnouncementSendFailed, failed.announcement_id)]
    assert queued < recorded, "the failure was recorded before the queue had the answer"
