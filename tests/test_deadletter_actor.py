"""The DeadLetter actor on real parts: an LMDB store in tmp_path, a FakeClock-driven
Scheduler, a real IoPortal and MemoryChannels; and a real child process SIGKILLed after
it queued an entry.

Nothing here sleeps to wait for an outcome: tests wait on the store's head
(``store.wait_for``), on a channel through the portal (``MemoryChannel.wait_for``) and on
``ask`` replies, all with deadlines. Deadlines are reached with ``clock.set(at)``, which
lands on ``at`` exactly, so "1 ms before" and "at" are exact boundaries.
"""

from __future__ import annotations

import json
import queue
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from functools import partial
from pathlib import Path
from typing import Any, cast

import anyio
import pykka
import pytest

from stalwart import store as store_module
from stalwart.actors import (
    DeadLetterActor,
    Drain,
    Enqueue,
    InFlight,
    IoPortal,
    QueueState,
    Scheduler,
)
from stalwart.channels import Channel, MemoryChannel, OutboundMessage
from stalwart.clock import FakeClock
from stalwart.config import DeadLetterSettings
from stalwart.events import (
    AnnouncementDeadLetterDelivered,
    AnnouncementDeadLettered,
    AnnouncementDeadLetterExpired,
    AnnouncementDeadLetterRetried,
    AnnouncementSendFailed,
    Event,
    RecordedEvent,
)
from stalwart.state import (
    DEADLETTER,
    DeadLetterState,
    apply_deadletter,
    decide_drain,
    decide_expiry,
    decide_retries,
    retry_at,
)
from stalwart.store import EventStore, NewEvent

WAIT = 10.0  # seconds any one step may take before the test fails rather than hangs
MS = 0.001
T0 = 1_800_000_000.0  # the conftest clock's start
D = DeadLetterSettings()
CHILD = Path(__file__).with_name("_deadletter_child.py")


# -- harness ---------------------------------------------------------------------------------


@pytest.fixture
def chat() -> MemoryChannel:
    return MemoryChannel("chat")


class Queue:
    """Starts DeadLetter actors on the test's parts and stops every one at teardown."""

    def __init__(
        self, store: EventStore, clock: FakeClock, scheduler: Scheduler, portal: IoPortal
    ) -> None:
        self.store, self.clock, self.scheduler, self.portal = store, clock, scheduler, portal
        self.refs: list[pykka.ActorRef[Any]] = []

    def start(
        self, channels: Mapping[str, Channel], settings: DeadLetterSettings = D
    ) -> pykka.ActorRef[Any]:
        ref = DeadLetterActor.start(
            store=self.store,
            clock=self.clock,
            scheduler=self.scheduler,
            portal=self.portal,
            channels=channels,
            settings=settings,
        )
        self.refs.append(ref)
        return ref

    def stop(self) -> None:
        for ref in self.refs:
            ref.stop(block=True, timeout=WAIT)


@pytest.fixture
def dead_letters(
    lmdb_store: EventStore, clock: FakeClock, scheduler: Scheduler, portal: IoPortal
) -> Iterator[Queue]:
    harness = Queue(lmdb_store, clock, scheduler, portal)
    try:
        yield harness
    finally:
        try:
            harness.stop()
        finally:
            pykka.ActorRegistry.stop_all(timeout=WAIT)  # the last resort


def ask(ref: pykka.ActorRef[Any], message: object) -> Any:
    return ref.ask(message, timeout=WAIT)


def state_of(ref: pykka.ActorRef[Any]) -> DeadLetterState:
    """The actor's state, once it handled every message told before this one."""
    state = ask(ref, QueueState())
    assert isinstance(state, DeadLetterState)
    return state


def enqueue(ref: pykka.ActorRef[Any], name: str, channel: str = "chat") -> str:
    entry_id = ask(ref, Enqueue(f"a-{name}", channel, f"conv-{name}", f"text {name}", "timeout"))
    assert isinstance(entry_id, str)
    return entry_id


def events(store: EventStore, count: int) -> list[Event]:
    """The ``deadletter`` stream once it holds ``count`` events (the only stream here)."""
    assert store.wait_for(count, WAIT) >= count, f"the log never reached {count} events"
    return [record.event for record in store.read_stream("deadletter")]


def settle(ref: pykka.ActorRef[Any], store: EventStore, count: int) -> list[Event]:
    """``events(store, count)``, then a barrier: the actor finished handling what led to
    them (its timer is re-armed), so the clock may move on."""
    log = events(store, count)
    state_of(ref)
    return log


def attempted(portal: IoPortal, channel: MemoryChannel, count: int) -> list[OutboundMessage]:
    """Wait (on the portal's loop) until ``channel`` was given ``count`` sends."""
    return portal.submit(partial(channel.wait_for, count, attempted=True)).result(WAIT)


def quiet_until(queue: Queue, ref: pykka.ActorRef[Any], deadline: float) -> None:
    """Move to 1 ms before ``deadline``: nothing is sent, nothing appended, the timer waits."""
    head = queue.store.head()
    queue.clock.set(deadline - MS)
    state_of(ref)  # the actor has handled whatever the clock fired
    assert ask(ref, InFlight()) == ()
    assert queue.store.head() == head
    assert queue.scheduler.next_deadline() == deadline


def check_replay(store: EventStore, settings: DeadLetterSettings = D) -> None:
    """Every decision in the log is what its policy gives on the state before it, at its ts
    and with the test's ``settings``: an expiry decide_expiry's, a ``backoff`` retry
    decide_retries', a ``drain`` retry decide_drain's for its provider."""
    state = DEADLETTER.initial("deadletter")
    for record in store.read_stream("deadletter"):
        event = record.event
        decided: Sequence[Event] = [event]  # a fact (an entry, an outcome): nothing to decide
        if isinstance(event, AnnouncementDeadLetterExpired):
            decided = decide_expiry(
                state, record.ts, max_age_ms=settings.max_age_ms, max_retries=settings.max_retries
            )
        elif isinstance(event, AnnouncementDeadLetterRetried) and event.reason == "backoff":
            assert event.provider is None, record
            decided = decide_retries(
                state,
                record.ts,
                max_retries=settings.max_retries,
                base_ms=settings.retry_base_ms,
                cap_ms=settings.retry_cap_ms,
            )
        elif isinstance(event, AnnouncementDeadLetterRetried):
            assert event.provider is not None, record
            decided = decide_drain(state, event.provider)
        assert event in decided, record
        state = apply_deadletter(state, record)


class Appends:
    """A store that keeps the events of each append, one list per append (a batch)."""

    def __init__(self, store: EventStore) -> None:
        self.store = store
        self.batches: list[list[Event]] = []

    def append(
        self, stream: str, events: Sequence[Event | NewEvent], *args: Any, **kwargs: Any
    ) -> list[RecordedEvent]:
        records = self.store.append(stream, events, *args, **kwargs)
        self.batches.append([record.event for record in records])
        return records

    def __getattr__(self, name: str) -> Any:
        return getattr(self.store, name)

    def retries(self) -> list[list[Event]]:
        """The batches that decided retries."""
        return [
            batch
            for batch in self.batches
            if any(isinstance(e, AnnouncementDeadLetterRetried) for e in batch)
        ]


def recording(queue: Queue) -> Appends:
    """Make the actors ``queue`` starts from now on append through an :class:`Appends`."""
    spy = Appends(queue.store)
    queue.store = cast(EventStore, spy)
    return spy


def next_retry(ref: pykka.ActorRef[Any], settings: DeadLetterSettings = D) -> float:
    [entry] = state_of(ref).entries
    return retry_at(entry, base_ms=settings.retry_base_ms, cap_ms=settings.retry_cap_ms)


# -- retries ---------------------------------------------------------------------------------


def test_retried_on_schedule_then_delivered(
    dead_letters: Queue, chat: MemoryChannel, lmdb_store: EventStore, portal: IoPortal
) -> None:
    ref = dead_letters.start({"chat": chat})
    entry_id = enqueue(ref, "1")
    [queued] = events(lmdb_store, 1)
    assert queued == AnnouncementDeadLettered(
        entry_id=entry_id,
        announcement_id="a-1",
        channel="chat",
        text="text 1",
        reason="timeout",
        conversation="conv-1",
    )
    chat.fail_next(2)
    # backoff 30 s, then 60 s, then 120 s after each attempt
    for attempt, deadline in enumerate((T0 + 30, T0 + 90, T0 + 210), start=1):
        assert next_retry(ref) == deadline
        quiet_until(dead_letters, ref, deadline)
        dead_letters.clock.set(deadline)
        assert len(attempted(portal, chat, attempt)) == attempt
        log = settle(ref, lmdb_store, 1 + 2 * attempt)  # a decision, then its outcome
        assert log[-2] == AnnouncementDeadLetterRetried(entry_id=entry_id, attempt=attempt)
        state = state_of(ref)
        if attempt < 3:
            assert log[-1] == AnnouncementSendFailed(
                announcement_id="a-1", error_class="server_error", entry_id=entry_id
            )
            assert state.entries[0].attempts == attempt
            assert state.entries[0].last_attempt_at == deadline
    assert log[-1] == AnnouncementDeadLetterDelivered(entry_id=entry_id, attempts=3)
    assert (state.entries, state.delivered, state.expired) == ((), 1, 0)
    message = OutboundMessage(
        conversation="conv-1", text="text 1", idempotency_key="a-1", thread=None
    )
    assert chat.messages == [message]
    assert chat.attempted == [message] * 3  # the same idempotency key on every attempt
    assert dead_letters.scheduler.pending() == 0  # an empty queue arms nothing
    check_replay(lmdb_store)


def test_retries_due_at_one_tick_are_decided_in_one_append(
    dead_letters: Queue, chat: MemoryChannel, lmdb_store: EventStore
) -> None:
    spy = recording(dead_letters)
    ref = dead_letters.start({"chat": chat})
    ids = [enqueue(ref, "1"), enqueue(ref, "2")]  # both at T0: both due at T0 + 30
    dead_letters.clock.set(T0 + 30)
    log = settle(ref, lmdb_store, 6)
    retried = [AnnouncementDeadLetterRetried(entry_id=i, attempt=1) for i in ids]
    assert log[2:4] == retried  # in enqueue order, before either outcome
    assert spy.retries() == [retried]
    delivered = [e for e in log if isinstance(e, AnnouncementDeadLetterDelivered)]
    assert log[4:] == delivered
    assert sorted((e.entry_id, e.attempts) for e in delivered) == sorted((i, 1) for i in ids)
    assert state_of(ref).entries == ()
    check_replay(lmdb_store)


def test_failing_sends_are_counted_then_expired_as_retries_exhausted(
    dead_letters: Queue, chat: MemoryChannel, lmdb_store: EventStore, portal: IoPortal
) -> None:
    chat.fail_next(100, kind="rate_limited")
    ref = dead_letters.start({"chat": chat})
    entry_id = enqueue(ref, "1")
    deadline = T0
    for attempt in range(1, D.max_retries + 1):
        deadline += min(D.retry_cap_ms, D.retry_base_ms * 2 ** (attempt - 1)) / 1000
        assert next_retry(ref) == deadline
        quiet_until(dead_letters, ref, deadline)
        dead_letters.clock.set(deadline)
        attempted(portal, chat, attempt)
        settle(ref, lmdb_store, 1 + 2 * attempt)
        if attempt < D.max_retries:
            assert state_of(ref).entries[0].attempts == attempt
    assert deadline == T0 + 30 + 60 + 120 + 240 + 480
    log = events(lmdb_store, 2 + 2 * D.max_retries)
    failed = AnnouncementSendFailed(
        announcement_id="a-1", error_class="rate_limited", entry_id=entry_id
    )
    assert log[1:-1] == [
        event
        for attempt in range(1, D.max_retries + 1)
        for event in (AnnouncementDeadLetterRetried(entry_id=entry_id, attempt=attempt), failed)
    ]
    assert log[-1] == AnnouncementDeadLetterExpired(
        entry_id=entry_id,
        age_ms=930_000,
        max_age_ms=D.max_age_ms,
        attempts=D.max_retries,
        reason="retries_exhausted",
        max_retries=D.max_retries,
    )
    state = state_of(ref)
    assert (state.entries, state.delivered, state.expired) == ((), 0, 1)
    assert len(chat.attempted) == D.max_retries
    assert chat.messages == []
    assert dead_letters.scheduler.pending() == 0
    check_replay(lmdb_store)


def test_expires_after_max_age_while_retries_are_pending(
    dead_letters: Queue, chat: MemoryChannel, lmdb_store: EventStore, portal: IoPortal
) -> None:
    slow = DeadLetterSettings(retry_base_ms=1_500_000, retry_cap_ms=3_000_000)  # 25 min, 50 min
    chat.fail_next(100)
    ref = dead_letters.start({"chat": chat}, slow)
    entry_id = enqueue(ref, "1")
    dead_letters.clock.set(T0 + 1500)
    attempted(portal, chat, 1)
    log = settle(ref, lmdb_store, 3)
    assert [type(e) for e in log[1:]] == [AnnouncementDeadLetterRetried, AnnouncementSendFailed]
    assert next_retry(ref, slow) == T0 + 4500  # after the hour: still pending at expiry
    quiet_until(dead_letters, ref, T0 + 3600)
    dead_letters.clock.set(T0 + 3600)
    log = events(lmdb_store, 4)
    assert log[-1] == AnnouncementDeadLetterExpired(
        entry_id=entry_id,
        age_ms=3_600_000,
        max_age_ms=3_600_000,
        attempts=1,
        reason="max_age",
        max_retries=5,
    )
    assert state_of(ref).entries == ()
    assert len(chat.attempted) == 1
    assert dead_letters.scheduler.pending() == 0
    check_replay(lmdb_store, slow)


def test_a_hanging_channel_is_bounded_by_the_announce_timeout(
    dead_letters: Queue, chat: MemoryChannel, lmdb_store: EventStore, portal: IoPortal
) -> None:
    quick = DeadLetterSettings(announce_timeout_ms=100)  # on the FakeClock
    chat.hang_next(1)
    ref = dead_letters.start({"chat": chat}, quick)
    entry_id = enqueue(ref, "1")
    dead_letters.clock.set(T0 + 30)
    attempted(portal, chat, 1)  # the send started (and hangs): its deadline is armed
    dead_letters.clock.advance(0.1)
    log = settle(ref, lmdb_store, 3)
    assert log[1:] == [
        AnnouncementDeadLetterRetried(entry_id=entry_id, attempt=1),
        AnnouncementSendFailed(announcement_id="a-1", error_class="timeout", entry_id=entry_id),
    ]
    dead_letters.clock.set(T0 + 90.1)  # the retry counts from the failure (at T0 + 30.1)
    log = settle(ref, lmdb_store, 5)
    assert log[3:] == [
        AnnouncementDeadLetterRetried(entry_id=entry_id, attempt=2),
        AnnouncementDeadLetterDelivered(entry_id=entry_id, attempts=2),
    ]
    check_replay(lmdb_store, quick)


def test_an_unknown_channel_is_a_failed_send(
    dead_letters: Queue, chat: MemoryChannel, lmdb_store: EventStore
) -> None:
    ref = dead_letters.start({"chat": chat})
    entry_id = enqueue(ref, "1", channel="gone")
    dead_letters.clock.set(T0 + 30)
    assert settle(ref, lmdb_store, 3)[1:] == [
        AnnouncementDeadLetterRetried(entry_id=entry_id, attempt=1),
        AnnouncementSendFailed(
            announcement_id="a-1", error_class="unknown_channel", entry_id=entry_id
        ),
    ]
    assert chat.attempted == []


# -- drain -----------------------------------------------------------------------------------


def test_provider_recovered_drains_every_entry_at_once(
    dead_letters: Queue, lmdb_store: EventStore, portal: IoPortal
) -> None:
    chat, pager = MemoryChannel("chat"), MemoryChannel("pager")
    spy = recording(dead_letters)
    ref = dead_letters.start({"chat": chat, "pager": pager})
    ids = [enqueue(ref, "1"), enqueue(ref, "2", channel="pager")]
    dead_letters.clock.set(T0 + 10)
    ids.append(enqueue(ref, "3"))
    ref.tell(Drain("openai"))  # long before any retry is due
    log = settle(ref, lmdb_store, 9)
    drained = [
        AnnouncementDeadLetterRetried(entry_id=i, attempt=1, reason="drain", provider="openai")
        for i in ids
    ]
    assert log[3:6] == drained  # in enqueue order, every one decided before any send ended
    assert spy.retries() == [drained]  # in one append
    delivered = [e for e in log if isinstance(e, AnnouncementDeadLetterDelivered)]
    assert log[6:] == delivered
    assert sorted(e.entry_id for e in delivered) == sorted(ids)
    assert {e.attempts for e in delivered} == {1}
    assert [m.idempotency_key for m in chat.messages] == ["a-1", "a-3"]
    assert [m.idempotency_key for m in pager.messages] == ["a-2"]
    state = state_of(ref)
    assert (state.entries, state.delivered) == ((), 3)
    assert dead_letters.clock.now() == T0 + 10
    assert dead_letters.scheduler.pending() == 0
    check_replay(lmdb_store)


def test_a_drain_never_starts_a_second_send_of_an_entry_in_flight(
    dead_letters: Queue, chat: MemoryChannel, lmdb_store: EventStore, portal: IoPortal
) -> None:
    ref = dead_letters.start({"chat": chat})
    stuck = enqueue(ref, "1")
    chat.hang_next(1)  # the default 30 s timeout: it stays in flight for this test
    dead_letters.clock.set(T0 + 30)
    attempted(portal, chat, 1)
    other = enqueue(ref, "2")
    assert ask(ref, InFlight()) == (stuck,)
    ref.tell(Drain("openai"))
    ref.tell(Drain("anthropic"))  # finds one entry in flight, the other in flight or gone
    settle(ref, lmdb_store, 5)  # and both drains handled
    log = events(lmdb_store, 5)
    assert log[1] == AnnouncementDeadLetterRetried(entry_id=stuck, attempt=1)  # its backoff
    assert log[3:] == [
        AnnouncementDeadLetterRetried(entry_id=other, attempt=1, reason="drain", provider="openai"),
        AnnouncementDeadLetterDelivered(entry_id=other, attempts=1),
    ]
    assert ask(ref, InFlight()) == (stuck,)
    assert [m.idempotency_key for m in chat.attempted] == ["a-1", "a-2"]
    assert lmdb_store.head() == 5  # no drain decided a retry of stuck, nor "anthropic" any
    check_replay(lmdb_store)


# -- restarts --------------------------------------------------------------------------------


def test_a_restart_resumes_the_retries(
    dead_letters: Queue, chat: MemoryChannel, lmdb_store: EventStore, portal: IoPortal
) -> None:
    chat.fail_next(1)
    first = dead_letters.start({"chat": chat})
    one = enqueue(first, "1")
    dead_letters.clock.set(T0 + 30)  # one's first retry fails
    settle(first, lmdb_store, 3)
    dead_letters.clock.set(T0 + 40)
    two = enqueue(first, "2")
    before = state_of(first)
    first.stop(block=True, timeout=WAIT)
    assert dead_letters.scheduler.pending() == 0  # a stopped actor leaves no timer behind

    second = dead_letters.start({"chat": chat})
    assert state_of(second) == before
    quiet_until(dead_letters, second, T0 + 70)  # two's first retry
    dead_letters.clock.set(T0 + 70)
    assert settle(second, lmdb_store, 6)[-2:] == [
        AnnouncementDeadLetterRetried(entry_id=two, attempt=1),
        AnnouncementDeadLetterDelivered(entry_id=two, attempts=1),
    ]
    quiet_until(dead_letters, second, T0 + 90)  # one's second retry
    dead_letters.clock.set(T0 + 90)
    assert settle(second, lmdb_store, 8)[-2:] == [
        AnnouncementDeadLetterRetried(entry_id=one, attempt=2),
        AnnouncementDeadLetterDelivered(entry_id=one, attempts=2),
    ]
    assert [m.idempotency_key for m in chat.messages] == ["a-2", "a-1"]
    check_replay(lmdb_store)


def test_a_restart_after_a_deadline_passed_retries_at_once(
    dead_letters: Queue, chat: MemoryChannel, lmdb_store: EventStore
) -> None:
    first = dead_letters.start({"chat": chat})
    entry_id = enqueue(first, "1")
    first.stop(block=True, timeout=WAIT)
    dead_letters.clock.set(T0 + 45)  # down while the retry fell due
    dead_letters.start({"chat": chat})
    assert events(lmdb_store, 3)[1:] == [
        AnnouncementDeadLetterRetried(entry_id=entry_id, attempt=1),
        AnnouncementDeadLetterDelivered(entry_id=entry_id, attempts=1),
    ]
    check_replay(lmdb_store)


def test_a_retry_decided_but_cut_short_by_a_stop_is_decided_again_after_the_restart(
    dead_letters: Queue, chat: MemoryChannel, lmdb_store: EventStore, portal: IoPortal
) -> None:
    chat.hang_next(1)
    first = dead_letters.start({"chat": chat})
    entry_id = enqueue(first, "1")
    dead_letters.clock.set(T0 + 30)
    attempted(portal, chat, 1)  # decided and in flight, when the actor stops
    first.stop(block=True, timeout=WAIT)
    retried = AnnouncementDeadLetterRetried(entry_id=entry_id, attempt=1)
    assert events(lmdb_store, 2)[1:] == [retried]  # no outcome: the attempt does not count

    second = dead_letters.start({"chat": chat})  # its retry is past due: at once
    assert settle(second, lmdb_store, 4)[1:] == [
        retried,
        retried,  # the same attempt, decided again
        AnnouncementDeadLetterDelivered(entry_id=entry_id, attempts=1),
    ]
    assert [m.idempotency_key for m in chat.attempted] == ["a-1", "a-1"]
    check_replay(lmdb_store)


def test_a_restart_resumes_the_expiry(
    dead_letters: Queue, lmdb_store: EventStore, portal: IoPortal
) -> None:
    down = MemoryChannel("chat")
    down.fail_next(100)
    slow = DeadLetterSettings(retry_base_ms=1_500_000, retry_cap_ms=3_000_000)
    first = dead_letters.start({"chat": down}, slow)
    entry_id = enqueue(first, "1")
    dead_letters.clock.set(T0 + 1500)
    settle(first, lmdb_store, 3)
    first.stop(block=True, timeout=WAIT)

    second = dead_letters.start({"chat": down}, slow)
    quiet_until(dead_letters, second, T0 + 3600)
    dead_letters.clock.set(T0 + 3600)
    expired = settle(second, lmdb_store, 4)[-1]
    assert isinstance(expired, AnnouncementDeadLetterExpired)
    assert (expired.entry_id, expired.reason, expired.attempts) == (entry_id, "max_age", 1)
    check_replay(lmdb_store, slow)


# -- a real crash ----------------------------------------------------------------------------


class Child:
    """``tests/_deadletter_child.py`` in its own process; its stdout lines on a queue."""

    def __init__(self, directory: Path) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, str(CHILD), str(directory), repr(T0)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        self.lines: queue.SimpleQueue[str | None] = queue.SimpleQueue()
        self.err: list[str] = []
        self.pumps = [
            threading.Thread(target=self._pump, args=(self.proc.stdout, self.lines.put)),
            threading.Thread(target=self._pump, args=(self.proc.stderr, self.err.append)),
        ]
        for pump in self.pumps:
            pump.start()

    @staticmethod
    def _pump(pipe: Any, put: Callable[[Any], None]) -> None:
        for line in pipe:
            put(line.rstrip("\n"))
        put(None)

    def expect(self, until: float) -> dict[str, str]:
        try:
            line = self.lines.get(timeout=max(0.0, until - time.monotonic()))
        except queue.Empty:
            pytest.fail(f"the child said nothing in time; stderr:\n{''.join(self.err)}")
        assert line is not None, f"the child ended early:\n{''.join(map(str, self.err))}"
        said = json.loads(line)
        assert isinstance(said, dict)
        assert "error" not in said, said
        return said

    def kill(self) -> None:
        self.proc.send_signal(signal.SIGKILL)
        assert self.proc.wait(WAIT) == -signal.SIGKILL, "the child died before the kill"

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(WAIT)
        for pump in self.pumps:
            pump.join(WAIT)
        for pipe in (self.proc.stdout, self.proc.stderr):
            if pipe is not None:
                pipe.close()


@pytest.mark.slow
@pytest.mark.parametrize("how", ["retry", "drain"])
def test_an_entry_queued_just_before_a_crash_is_delivered_once_after_it(
    tmp_path: Path, how: str
) -> None:
    directory = tmp_path / "store"
    child = Child(directory)
    try:
        until = time.monotonic() + 30
        entry_id = child.expect(until)["enqueued"]  # in the log: the ask returned
        # the child says "failed" once the retry's decision and its failed send are in
        assert child.expect(until) == {"failed": entry_id}
        child.kill()
    finally:
        child.close()

    clock = FakeClock(start=T0 + 30)  # where the child's clock stood
    chat = MemoryChannel("chat")
    with (
        store_module.open(directory, clock=clock) as store,
        Scheduler(clock) as scheduler,
        IoPortal() as portal,
    ):
        harness = Queue(store, clock, scheduler, portal)
        try:
            ref = harness.start({"chat": chat})
            [entry] = state_of(ref).entries
            assert (entry.entry_id, entry.attempts, entry.conversation) == (entry_id, 1, "conv-1")
            if how == "retry":
                quiet_until(harness, ref, T0 + 90)
                clock.set(T0 + 90)
                retried = AnnouncementDeadLetterRetried(entry_id=entry_id, attempt=2)
            else:
                ref.tell(Drain("openai"))
                retried = AnnouncementDeadLetterRetried(
                    entry_id=entry_id, attempt=2, reason="drain", provider="openai"
                )
            log = settle(ref, store, 5)
            assert log[-2:] == [
                retried,
                AnnouncementDeadLetterDelivered(entry_id=entry_id, attempts=2),
            ]
            # exactly once: later drains and deadlines find nothing to send
            ref.tell(Drain("openai"))
            clock.set(T0 + 2 * 3600)
            state = state_of(ref)
            assert (state.entries, state.delivered, state.expired) == ((), 1, 0)
            assert [type(e) for e in events(store, 5)] == [
                AnnouncementDeadLettered,
                AnnouncementDeadLetterRetried,
                AnnouncementSendFailed,
                AnnouncementDeadLetterRetried,
                AnnouncementDeadLetterDelivered,
            ]
            assert store.head() == 5
            assert chat.messages == [
                OutboundMessage(conversation="conv-1", text="text 1", idempotency_key="a-1")
            ]
            assert len(chat.attempted) == 1
            check_replay(store)
        finally:
            harness.stop()


# -- the portal ------------------------------------------------------------------------------


def test_the_portal_runs_a_coroutine_and_calls_back_with_its_outcome() -> None:
    async def double(x: int) -> int:
        await anyio.sleep(0)
        return 2 * x

    async def refuse() -> None:
        raise ValueError("no")

    with IoPortal() as portal:
        called: queue.SimpleQueue[int] = queue.SimpleQueue()
        future = portal.submit(double, 21)
        future.add_done_callback(lambda f: called.put(f.result()))
        assert called.get(timeout=WAIT) == 42
        failing = portal.submit(refuse)
        assert isinstance(failing.exception(WAIT), ValueError)  # an error is an outcome too


def test_stopping_the_portal_cancels_what_is_in_flight() -> None:
    started = threading.Event()

    async def hang() -> None:
        started.set()
        await anyio.sleep_forever()

    portal = IoPortal().start()
    future = portal.submit(hang)
    assert started.wait(WAIT)
    portal.stop()
    assert future.cancelled()
    assert not portal.running
    with pytest.raises(RuntimeError, match="not running"):
        portal.submit(hang)
    with portal:  # a stopped portal starts again
        assert portal.submit(anyio.sleep, 0).result(WAIT) is None
