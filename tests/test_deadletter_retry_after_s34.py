"""The dead-letter queue and a receiver's Retry-After (session 34).

A webhook whose receiver asks for longer than the channel's own retry cap stops at once
and leaves the wait to its caller: the queue records the receiver's hint with the failure
(``retry_after_ms``) and waits at least that long before the entry's next retry.

Real parts only: an LMDB store in tmp_path, a real webhook receiver on 127.0.0.1 that
answers 503 with a Retry-After while it is busy (by the FakeClock's time), a real
Scheduler and IoPortal; time from the FakeClock, each step taken to the queue's next
deadline; the log checked with ``replay --verify``'s own verification.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import pykka
import pytest

from stalwart.actors import (
    DeadLetterActor,
    Drain,
    Enqueue,
    InFlight,
    IoPortal,
    QueueState,
    Scheduler,
)
from stalwart.channels import Channel, Delivery, MemoryChannel, OutboundMessage, send_within
from stalwart.channels._send import LONGEST_HINT_MS, RetryAfterNoted
from stalwart.cli._replay import verify_store
from stalwart.clock import FakeClock
from stalwart.config import DeadLetterSettings
from stalwart.errors import ChannelError
from stalwart.events import (
    AnnouncementDeadLetterDelivered,
    AnnouncementDeadLettered,
    AnnouncementDeadLetterExpired,
    AnnouncementDeadLetterRetried,
    AnnouncementSendFailed,
    Event,
    ProviderRecovered,
    RecordedEvent,
)
from stalwart.state import DeadLetterState
from stalwart.store import EventStore, NewEvent
from tests._runtime_support import GUARD, of
from tests.test_channels import Receiver, Step, webhook

D = DeadLetterSettings()
Delivered = AnnouncementDeadLetterDelivered
Expired = AnnouncementDeadLetterExpired
Retried = AnnouncementDeadLetterRetried
#: longer than every backoff of the seed's schedule together (30 + 60 + 120 + 240 + 480 s)
HALF_AN_HOUR_S = 1_800.0
#: how long a test waits for a real send to end (on a loaded machine, generously)
SEND_WAIT_S = 15.0


# -- harness ---------------------------------------------------------------------------------


class BusyUntil:
    """A receiver's script by the FakeClock's time: 503 with ``Retry-After`` (what it was
    told to ask for) until ``until``, then 200 (a :class:`Receiver`'s ``steps``)."""

    def __init__(self, clock: FakeClock, until: float, retry_after: str) -> None:
        self.clock = clock
        self.until = until
        self.retry_after = retry_after
        self.asked_at: list[float] = []

    def __bool__(self) -> bool:
        return True

    def popleft(self) -> Step:
        now = self.clock.now()
        self.asked_at.append(now)
        if now < self.until:
            return Step(status=503, headers={"retry-after": self.retry_after})
        return Step(status=200)


@pytest.fixture
def receivers() -> Iterator[list[Receiver]]:
    made: list[Receiver] = []
    try:
        yield made
    finally:
        for receiver in made:
            receiver.close()


def busy_receiver(receivers: list[Receiver], script: BusyUntil) -> Receiver:
    receiver = Receiver()
    receiver.steps = script  # type: ignore[assignment]  # answers by the clock, not in turn
    receivers.append(receiver)
    return receiver


def queue(
    store: EventStore,
    clock: FakeClock,
    scheduler: Scheduler,
    portal: IoPortal,
    channels: dict[str, Channel],
    actors: list[pykka.ActorRef[Any]],
) -> pykka.ActorRef[Any]:
    ref = DeadLetterActor.start(
        store=store,
        clock=clock,
        scheduler=scheduler,
        portal=portal,
        channels=channels,
        settings=D,
        runtime="rt-a",
    )
    actors.append(ref)
    return ref


def settled(ref: pykka.ActorRef[Any]) -> DeadLetterState:
    """The queue's state once no send of it is in flight and their outcomes are recorded."""
    give_up = time.monotonic() + SEND_WAIT_S
    while ref.ask(InFlight(), timeout=GUARD):
        assert time.monotonic() < give_up, "a send never ended"
        time.sleep(0.01)  # real-time: a real HTTP send on the portal's loop
    state = ref.ask(QueueState(), timeout=GUARD)  # after the outcomes' own message
    assert isinstance(state, DeadLetterState)
    return state


def run_queue(
    ref: pykka.ActorRef[Any], clock: FakeClock, scheduler: Scheduler, *, for_s: float
) -> DeadLetterState:
    """Move the clock from one of the queue's deadlines to the next (each send ended and
    recorded before the next step) until the queue is empty or ``for_s`` have passed."""
    until = clock.now() + for_s
    while True:
        state = settled(ref)
        due = scheduler.next_deadline()
        if not state.entries or due is None or due > until:
            return state
        clock.advance(max(0.0, due - clock.now()))


def message() -> OutboundMessage:
    return OutboundMessage(
        conversation="conv-1", text="Sorry, that took too long.", idempotency_key="ann-1"
    )


def records(store: EventStore) -> list[RecordedEvent]:
    return list(store.read_stream("deadletter"))


def assert_verifies(store: EventStore) -> None:
    report = verify_store(store, None)
    assert [f for f in report.findings if f.stream == "deadletter"] == []


def append(store: EventStore, clock: FakeClock, event: Event) -> None:
    store.append("deadletter", [NewEvent(event=event, ts=clock.now())])


def queued(entry_id: str = "e1", **fields: Any) -> AnnouncementDeadLettered:
    return AnnouncementDeadLettered(
        entry_id=entry_id,
        announcement_id=f"ann-{entry_id}",
        channel="hook",
        text="one",
        reason="timeout",
        conversation="conv-1",
        **fields,
    )


# -- a retry the receiver asked to hold off -------------------------------------------------


# Was: DEFECT: a receiver's Retry-After of half an hour was not recorded: the queue retried
# on its own 30 s..480 s backoff, five refused sends, and the entry expired
# retries_exhausted, though waiting as asked would have delivered it within its max age
def test_a_retry_waits_for_the_receivers_retry_after_and_delivers_within_the_max_age(
    lmdb_store: EventStore,
    clock: FakeClock,
    scheduler: Scheduler,
    portal: IoPortal,
    actors: list[pykka.ActorRef[Any]],
    receivers: list[Receiver],
) -> None:
    """The first retry (30 s) meets a receiver busy for half an hour (503, Retry-After
    1800, above the channel's 2 s cap: it stops at once). The failure is recorded with
    the hint, the next retry is due when the receiver said and delivers, and the
    receiver is sent nothing in between."""
    start = clock.now()
    script = BusyUntil(clock, start + 30 + HALF_AN_HOUR_S, retry_after="1800")
    hook = webhook(busy_receiver(receivers, script).url)
    ref = queue(lmdb_store, clock, scheduler, portal, {"hook": hook}, actors)
    entry = ref.ask(Enqueue("ann-1", "hook", "conv-1", "one", "timeout"), timeout=GUARD)

    state = run_queue(ref, clock, scheduler, for_s=D.max_age_ms / 1000)

    log = records(lmdb_store)
    [failed] = of(AnnouncementSendFailed, log)
    assert (failed.entry_id, failed.error_class) == (entry, "server_error")
    assert failed.retry_after_ms == 1_800_000
    assert [r.attempt for r in of(Retried, log)] == [1, 2]
    [delivered] = of(Delivered, log)
    assert (delivered.entry_id, delivered.attempts) == (entry, 2)
    assert not of(Expired, log)
    assert script.asked_at == [start + 30, start + 30 + HALF_AN_HOUR_S]
    assert (state.entries, state.delivered) == ((), 1)
    assert_verifies(lmdb_store)


# Was: DEFECT: a receiver that asked for longer than the entry's max age was sent four more
# refused retries, and the entry expired retries_exhausted
def test_a_retry_after_past_the_max_age_lets_the_entry_expire_at_its_max_age_unsent(
    lmdb_store: EventStore,
    clock: FakeClock,
    scheduler: Scheduler,
    portal: IoPortal,
    actors: list[pykka.ActorRef[Any]],
    receivers: list[Receiver],
) -> None:
    start = clock.now()
    script = BusyUntil(clock, start + 2 * D.max_age_ms / 1000, retry_after="7200")
    hook = webhook(busy_receiver(receivers, script).url)
    ref = queue(lmdb_store, clock, scheduler, portal, {"hook": hook}, actors)
    entry = ref.ask(Enqueue("ann-1", "hook", "conv-1", "one", "timeout"), timeout=GUARD)

    state = run_queue(ref, clock, scheduler, for_s=2 * D.max_age_ms / 1000)

    log = records(lmdb_store)
    [expired] = of(Expired, log)
    assert (expired.entry_id, expired.reason, expired.attempts) == (entry, "max_age", 1)
    assert expired.age_ms == D.max_age_ms
    assert script.asked_at == [start + 30]
    assert (state.entries, state.expired) == ((), 1)
    assert_verifies(lmdb_store)


# Was: DEFECT: the receiver's Retry-After with the send that queued an entry could not reach
# the queue (Enqueue had no hint): its first retry went at 30 s, while the receiver was busy
def test_an_entry_queued_with_its_first_sends_retry_after_waits_for_it(
    lmdb_store: EventStore,
    clock: FakeClock,
    scheduler: Scheduler,
    portal: IoPortal,
    actors: list[pykka.ActorRef[Any]],
    receivers: list[Receiver],
) -> None:
    """A sender's own send, through :class:`RetryAfterNoted`, meets the busy receiver: it
    queues the entry with the hint, and the queue's first retry waits for it."""
    start = clock.now()
    script = BusyUntil(clock, start + HALF_AN_HOUR_S, retry_after="1800")
    hook = webhook(busy_receiver(receivers, script).url)
    noted = RetryAfterNoted(hook)
    reason = portal.submit(send_within, noted, message(), GUARD).result(GUARD + 1)
    assert (reason, noted.retry_after_ms) == ("server_error", 1_800_000)
    ref = queue(lmdb_store, clock, scheduler, portal, {"hook": hook}, actors)
    enqueue = Enqueue("ann-1", "hook", "conv-1", "one", reason, retry_after_ms=1_800_000)
    entry = ref.ask(enqueue, timeout=GUARD)

    run_queue(ref, clock, scheduler, for_s=D.max_age_ms / 1000)

    log = records(lmdb_store)
    [dead_lettered] = of(AnnouncementDeadLettered, log)
    assert dead_lettered.retry_after_ms == 1_800_000
    [delivered] = of(Delivered, log)
    assert (delivered.entry_id, delivered.attempts) == (entry, 1)
    assert script.asked_at == [start, start + HALF_AN_HOUR_S]
    assert_verifies(lmdb_store)


def test_the_queue_never_retries_sooner_than_its_own_backoff_for_a_short_hint(
    lmdb_store: EventStore,
    clock: FakeClock,
    scheduler: Scheduler,
    portal: IoPortal,
    actors: list[pykka.ActorRef[Any]],
    receivers: list[Receiver],
) -> None:
    """A Retry-After of 5 s (above the channel's 2 s cap, below the queue's 60 s backoff
    after a first retry) changes nothing: the second retry is due at its backoff."""
    start = clock.now()
    script = BusyUntil(clock, start + 31, retry_after="5")
    hook = webhook(busy_receiver(receivers, script).url)
    ref = queue(lmdb_store, clock, scheduler, portal, {"hook": hook}, actors)
    ref.ask(Enqueue("ann-1", "hook", "conv-1", "one", "timeout"), timeout=GUARD)

    run_queue(ref, clock, scheduler, for_s=D.max_age_ms / 1000)

    [failed] = of(AnnouncementSendFailed, records(lmdb_store))
    assert failed.retry_after_ms == 5_000
    assert script.asked_at == [start + 30, start + 90]
    assert_verifies(lmdb_store)


# Was: DEFECT: a provider's recovery drained an entry whose receiver had asked to wait,
# spending one of its attempts (its last: expired retries_exhausted) on a refused send
def test_a_drain_leaves_an_entry_the_receiver_asked_to_wait_and_its_conversation(
    lmdb_store: EventStore,
    clock: FakeClock,
    scheduler: Scheduler,
    portal: IoPortal,
    actors: list[pykka.ActorRef[Any]],
    receivers: list[Receiver],
) -> None:
    """The receiver asked for half an hour at the first retry; a provider recovers
    meanwhile. The drain sends the other conversation's entry at once, but neither the
    entry the receiver asked to wait nor the one queued after it in its conversation
    (sent now, it would be read first): both go, in order, when the receiver said."""
    start = clock.now()
    script = BusyUntil(clock, start + 30 + HALF_AN_HOUR_S, retry_after="1800")
    hook = webhook(busy_receiver(receivers, script).url)
    other = MemoryChannel("other")
    ref = queue(lmdb_store, clock, scheduler, portal, {"hook": hook, "other": other}, actors)
    first = ref.ask(Enqueue("ann-1", "hook", "conv-1", "one", "timeout"), timeout=GUARD)
    clock.advance(30)
    assert settled(ref).entries[0].retry_after_ms == 1_800_000
    second = ref.ask(Enqueue("ann-2", "hook", "conv-1", "two", "timeout"), timeout=GUARD)
    elsewhere = ref.ask(Enqueue("ann-3", "other", "conv-2", "three", "timeout"), timeout=GUARD)
    recovered = NewEvent(event=ProviderRecovered(provider="main"), ts=clock.now())
    lmdb_store.append("provider:main", [recovered])

    ref.tell(Drain("main"))
    settled(ref)

    drained = [r.entry_id for r in of(Retried, records(lmdb_store)) if r.reason == "drain"]
    assert drained == [elsewhere]
    assert [m.text for m in other.messages] == ["three"]
    assert script.asked_at == [start + 30]
    state = run_queue(ref, clock, scheduler, for_s=D.max_age_ms / 1000)
    delivered = [d.entry_id for d in of(Delivered, records(lmdb_store))]
    assert delivered == [elsewhere, first, second]
    assert script.asked_at == [start + 30, *[start + 30 + HALF_AN_HOUR_S] * 2]
    assert (state.entries, state.delivered) == ((), 3)
    assert_verifies(lmdb_store)


# -- what replay re-derives ------------------------------------------------------------------


def test_replay_flags_a_retry_recorded_before_the_receivers_retry_after(
    lmdb_store: EventStore, clock: FakeClock
) -> None:
    """The hint is part of the re-derived decision: a retry recorded an hour early (on
    the old backoff) is a finding of ``replay --verify``, which names when it was due."""
    append(lmdb_store, clock, queued())
    clock.advance(30)
    append(lmdb_store, clock, Retried(entry_id="e1", attempt=1))
    failed = AnnouncementSendFailed(
        announcement_id="ann-e1",
        error_class="server_error",
        entry_id="e1",
        retry_after_ms=1_800_000,
    )
    append(lmdb_store, clock, failed)
    clock.advance(60)
    append(lmdb_store, clock, Retried(entry_id="e1", attempt=2))

    report = verify_store(lmdb_store, None)

    [finding] = [f for f in report.findings if f.stream == "deadletter"]
    assert "went 1740000 ms early" in str(finding)


def test_a_log_written_before_hints_were_recorded_keeps_its_schedule_and_verifies(
    lmdb_store: EventStore,
    clock: FakeClock,
    scheduler: Scheduler,
    portal: IoPortal,
    actors: list[pykka.ActorRef[Any]],
    receivers: list[Receiver],
) -> None:
    """Records of an older version have no ``retry_after_ms``: the retries it decided on
    the backoff alone still verify, and the queue goes on on that schedule."""
    old_failure = {"announcement_id": "ann-e1", "error_class": "server_error", "entry_id": "e1"}
    append(lmdb_store, clock, queued())
    clock.advance(30)
    append(lmdb_store, clock, Retried(entry_id="e1", attempt=1))
    append(lmdb_store, clock, AnnouncementSendFailed(**old_failure))
    [*_, last] = records(lmdb_store)
    assert isinstance(last.event, AnnouncementSendFailed)
    assert last.event.retry_after_ms is None
    script = BusyUntil(clock, clock.now(), retry_after="1800")  # takes the next at once
    hook = webhook(busy_receiver(receivers, script).url)
    ref = queue(lmdb_store, clock, scheduler, portal, {"hook": hook}, actors)
    failed_at = clock.now()

    run_queue(ref, clock, scheduler, for_s=D.max_age_ms / 1000)

    assert script.asked_at == [failed_at + 60]
    assert of(Delivered, records(lmdb_store))
    assert_verifies(lmdb_store)


class Refusing:
    """A host's own channel whose receiver asked for ``retry_after`` seconds."""

    name = "own"

    def __init__(self, retry_after: float, *, retryable: bool = True) -> None:
        self.retry_after = retry_after
        self.retryable = retryable

    async def send(self, message: OutboundMessage) -> Delivery:
        raise ChannelError(
            "busy",
            kind="rate_limited",
            retryable=self.retryable,
            channel=self.name,
            retry_after=self.retry_after,
        )

    async def aclose(self) -> None:
        """Nothing held."""


@pytest.mark.parametrize(
    ("channel", "hint"),
    [
        (Refusing(0.0004), 1),  # rounded up: never sooner than asked
        (Refusing(1e300), LONGEST_HINT_MS),  # still an integer the log holds
        (Refusing(float("nan")), None),
        (Refusing(60, retryable=False), None),  # final: expires, no retry to wait for
    ],
)
def test_a_hint_is_noted_in_whole_milliseconds_the_log_can_hold(
    portal: IoPortal, channel: Refusing, hint: int | None
) -> None:
    noted = RetryAfterNoted(channel)
    portal.submit(send_within, noted, message(), GUARD).result(GUARD + 1)
    assert noted.retry_after_ms == hint
