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
from collections.abc import Callable, Iterator, Mapping
from functools import partial
from pathlib import Path
from typing import Any

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
    AnnouncementSendFailed,
    Event,
)
from stalwart.state import DEADLETTER, DeadLetterState, apply_deadletter, decide_expiry, retry_at
from stalwart.store import EventStore

WAIT = 10.0  # seconds any one step may take before the test fails rather than hangs
MS = 0.001
T0 = 1_800_000_000.0  # the conftest clock's start
D = DeadLetterSettings()
CHILD = Path(__file__).with_name("_deadletter_child.py")


# -- harness ---------------------------------------------------------------------------------


@pytest.fixture
def scheduler(clock: FakeClock) -> Iterator[Scheduler]:
    with Scheduler(clock) as scheduler:
        yield scheduler


@pytest.fixture
def portal() -> Iterator[IoPortal]:
    with IoPortal() as portal:
        yield portal


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


def check_replay(store: EventStore) -> None:
    """Every expiry in the log is what decide_expiry gives on the state before it, at its ts."""
    state = DEADLETTER.initial("deadletter")
    for record in store.read_stream("deadletter"):
        if isinstance(record.event, AnnouncementDeadLetterExpired):
            decided = decide_expiry(
                state, record.ts, max_age_ms=D.max_age_ms, max_retries=D.max_retries
            )
            assert record.event in decided
        state = apply_deadletter(state, record)


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
        log = settle(ref, lmdb_store, 1 + attempt)
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
        settle(ref, lmdb_store, 1 + attempt)
        if attempt < D.max_retries:
            assert state_of(ref).entries[0].attempts == attempt
    assert deadline == T0 + 30 + 60 + 120 + 240 + 480
    log = events(lmdb_store, 2 + D.max_retries)
    assert [type(e) for e in log[1:-1]] == [AnnouncementSendFailed] * D.max_retries
    assert {e.error_class for e in log[1:-1]} == {"rate_limited"}  # type: ignore[attr-defined]
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
    settle(ref, lmdb_store, 2)
    assert next_retry(ref, slow) == T0 + 4500  # after the hour: still pending at expiry
    quiet_until(dead_letters, ref, T0 + 3600)
    dead_letters.clock.set(T0 + 3600)
    log = events(lmdb_store, 3)
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
    check_replay(lmdb_store)


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
    log = settle(ref, lmdb_store, 2)
    assert log[-1] == AnnouncementSendFailed(
        announcement_id="a-1", error_class="timeout", entry_id=entry_id
    )
    dead_letters.clock.set(T0 + 90.1)  # the retry counts from the failure (at T0 + 30.1)
    log = settle(ref, lmdb_store, 3)
    assert log[-1] == AnnouncementDeadLetterDelivered(entry_id=entry_id, attempts=2)


def test_an_unknown_channel_is_a_failed_send(
    dead_letters: Queue, chat: MemoryChannel, lmdb_store: EventStore
) -> None:
    ref = dead_letters.start({"chat": chat})
    entry_id = enqueue(ref, "1", channel="gone")
    dead_letters.clock.set(T0 + 30)
    assert settle(ref, lmdb_store, 2)[-1] == AnnouncementSendFailed(
        announcement_id="a-1", error_class="unknown_channel", entry_id=entry_id
    )
    assert chat.attempted == []


# -- drain -----------------------------------------------------------------------------------


def test_provider_recovered_drains_every_entry_at_once(
    dead_letters: Queue, lmdb_store: EventStore, portal: IoPortal
) -> None:
    chat, pager = MemoryChannel("chat"), MemoryChannel("pager")
    ref = dead_letters.start({"chat": chat, "pager": pager})
    ids = [enqueue(ref, "1"), enqueue(ref, "2", channel="pager")]
    dead_letters.clock.set(T0 + 10)
    ids.append(enqueue(ref, "3"))
    ref.tell(Drain("openai"))  # long before any retry is due
    log = settle(ref, lmdb_store, 6)
    delivered = [e for e in log if isinstance(e, AnnouncementDeadLetterDelivered)]
    assert sorted(e.entry_id for e in delivered) == sorted(ids)
    assert {e.attempts for e in delivered} == {1}
    assert [m.idempotency_key for m in chat.messages] == ["a-1", "a-3"]
    assert [m.idempotency_key for m in pager.messages] == ["a-2"]
    state = state_of(ref)
    assert (state.entries, state.delivered) == ((), 3)
    assert dead_letters.clock.now() == T0 + 10
    assert dead_letters.scheduler.pending() == 0


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
    ref.tell(Drain("anthropic"))
    log = settle(ref, lmdb_store, 3)
    assert log[-1] == AnnouncementDeadLetterDelivered(entry_id=other, attempts=1)
    state_of(ref)  # both drains handled
    assert ask(ref, InFlight()) == (stuck,)
    assert [m.idempotency_key for m in chat.attempted] == ["a-1", "a-2"]
    assert lmdb_store.head() == 3


# -- restarts --------------------------------------------------------------------------------


def test_a_restart_resumes_the_retries(
    dead_letters: Queue, chat: MemoryChannel, lmdb_store: EventStore, portal: IoPortal
) -> None:
    chat.fail_next(1)
    first = dead_letters.start({"chat": chat})
    one = enqueue(first, "1")
    dead_letters.clock.set(T0 + 30)  # one's first retry fails
    settle(first, lmdb_store, 2)
    dead_letters.clock.set(T0 + 40)
    two = enqueue(first, "2")
    before = state_of(first)
    first.stop(block=True, timeout=WAIT)
    assert dead_letters.scheduler.pending() == 0  # a stopped actor leaves no timer behind

    second = dead_letters.start({"chat": chat})
    assert state_of(second) == before
    quiet_until(dead_letters, second, T0 + 70)  # two's first retry
    dead_letters.clock.set(T0 + 70)
    assert settle(second, lmdb_store, 4)[-1] == AnnouncementDeadLetterDelivered(
        entry_id=two, attempts=1
    )
    quiet_until(dead_letters, second, T0 + 90)  # one's second retry
    dead_letters.clock.set(T0 + 90)
    assert settle(second, lmdb_store, 5)[-1] == AnnouncementDeadLetterDelivered(
        entry_id=one, attempts=2
    )
    assert [m.idempotency_key for m in chat.messages] == ["a-2", "a-1"]


def test_a_restart_after_a_deadline_passed_retries_at_once(
    dead_letters: Queue, chat: MemoryChannel, lmdb_store: EventStore
) -> None:
    first = dead_letters.start({"chat": chat})
    entry_id = enqueue(first, "1")
    first.stop(block=True, timeout=WAIT)
    dead_letters.clock.set(T0 + 45)  # down while the retry fell due
    dead_letters.start({"chat": chat})
    assert events(lmdb_store, 2)[-1] == AnnouncementDeadLetterDelivered(
        entry_id=entry_id, attempts=1
    )


def test_a_restart_resumes_the_expiry(
    dead_letters: Queue, lmdb_store: EventStore, portal: IoPortal
) -> None:
    down = MemoryChannel("chat")
    down.fail_next(100)
    slow = DeadLetterSettings(retry_base_ms=1_500_000, retry_cap_ms=3_000_000)
    first = dead_letters.start({"chat": down}, slow)
    entry_id = enqueue(first, "1")
    dead_letters.clock.set(T0 + 1500)
    settle(first, lmdb_store, 2)
    first.stop(block=True, timeout=WAIT)

    second = dead_letters.start({"chat": down}, slow)
    quiet_until(dead_letters, second, T0 + 3600)
    dead_letters.clock.set(T0 + 3600)
    expired = settle(second, lmdb_store, 3)[-1]
    assert isinstance(expired, AnnouncementDeadLetterExpired)
    assert (expired.entry_id, expired.reason, expired.attempts) == (entry_id, "max_age", 1)


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
        assert child.expect(until) == {"failed": entry_id}  # its first retry failed too
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
            else:
                ref.tell(Drain("openai"))
            log = settle(ref, store, 3)
            assert log[-1] == AnnouncementDeadLetterDelivered(entry_id=entry_id, attempts=2)
            # exactly once: later drains and deadlines find nothing to send
            ref.tell(Drain("openai"))
            clock.set(T0 + 2 * 3600)
            state = state_of(ref)
            assert (state.entries, state.delivered, state.expired) == ((), 1, 0)
            assert [type(e) for e in events(store, 3)] == [
                AnnouncementDeadLettered,
                AnnouncementSendFailed,
                AnnouncementDeadLetterDelivered,
            ]
            assert store.head() == 3
            assert chat.messages == [
                OutboundMessage(conversation="conv-1", text="text 1", idempotency_key="a-1")
            ]
            assert len(chat.attempted) == 1
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
