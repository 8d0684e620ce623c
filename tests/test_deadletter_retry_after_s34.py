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

from typing import Any

import pykka
import pytest

from stalwart.actors import Drain, Enqueue, IoPortal, Scheduler
from stalwart.channels import Delivery, MemoryChannel, OutboundMessage
from stalwart.channels._send import LONGEST_HINT_MS, RetryAfterNoted
from stalwart.cli._replay import verify_store
from stalwart.clock import FakeClock
from stalwart.errors import ChannelError
from stalwart.events import (
    AnnouncementDeadLetterDelivered,
    AnnouncementDeadLettered,
    AnnouncementDeadLetterExpired,
    AnnouncementDeadLetterRetried,
    AnnouncementSendFailed,
    ProviderRecovered,
)
from stalwart.state import DeadLetterState
from stalwart.store import EventStore, NewEvent
from tests._runtime_support import GUARD, of
from tests._support_s35 import (
    DEAD_LETTERS,
    BusyUntil,
    append_dead_letter,
    assert_dead_letters_verify,
    busy_receiver,
    dead_lettered,
    dead_letters,
    failed_send,
    first_send,
    late_reply,
    queue_settled,
    receivers_fixture,  # noqa: F401 (the fixture)
    start_queue,
    step_queues,
)
from tests.test_channels import Receiver, webhook

D = DEAD_LETTERS
Delivered = AnnouncementDeadLetterDelivered
Expired = AnnouncementDeadLetterExpired
Retried = AnnouncementDeadLetterRetried
#: longer than every backoff of the seed's schedule together (30 + 60 + 120 + 240 + 480 s)
HALF_AN_HOUR_S = 1_800.0


# -- harness ---------------------------------------------------------------------------------


def run_queue(
    ref: pykka.ActorRef[Any], clock: FakeClock, scheduler: Scheduler, *, for_s: float
) -> DeadLetterState:
    """Move the clock from one of the queue's deadlines to the next (each send ended and
    recorded before the next step) until the queue is empty or ``for_s`` have passed."""
    [state] = step_queues(clock, scheduler, (ref,), for_s=for_s, done=lambda s: not s[0].entries)
    return state


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
    ref = start_queue(lmdb_store, clock, scheduler, portal, {"hook": hook}, actors)
    entry = ref.ask(Enqueue("ann-1", "hook", "conv-1", "one", "timeout"), timeout=GUARD)

    state = run_queue(ref, clock, scheduler, for_s=D.max_age_ms / 1000)

    log = dead_letters(lmdb_store)
    [failed] = of(AnnouncementSendFailed, log)
    assert (failed.entry_id, failed.error_class) == (entry, "server_error")
    assert failed.retry_after_ms == 1_800_000
    assert [r.attempt for r in of(Retried, log)] == [1, 2]
    [delivered] = of(Delivered, log)
    assert (delivered.entry_id, delivered.attempts) == (entry, 2)
    assert not of(Expired, log)
    assert script.asked_at == [start + 30, start + 30 + HALF_AN_HOUR_S]
    assert (state.entries, state.delivered) == ((), 1)
    assert_dead_letters_verify(lmdb_store)


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
    ref = start_queue(lmdb_store, clock, scheduler, portal, {"hook": hook}, actors)
    entry = ref.ask(Enqueue("ann-1", "hook", "conv-1", "one", "timeout"), timeout=GUARD)

    state = run_queue(ref, clock, scheduler, for_s=2 * D.max_age_ms / 1000)

    log = dead_letters(lmdb_store)
    [expired] = of(Expired, log)
    assert (expired.entry_id, expired.reason, expired.attempts) == (entry, "max_age", 1)
    assert expired.age_ms == D.max_age_ms
    assert script.asked_at == [start + 30]
    assert (state.entries, state.expired) == ((), 1)
    assert_dead_letters_verify(lmdb_store)


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
    reason = first_send(portal, noted, late_reply())
    assert (reason, noted.retry_after_ms) == ("server_error", 1_800_000)
    ref = start_queue(lmdb_store, clock, scheduler, portal, {"hook": hook}, actors)
    enqueue = Enqueue("ann-1", "hook", "conv-1", "one", reason, retry_after_ms=1_800_000)
    entry = ref.ask(enqueue, timeout=GUARD)

    run_queue(ref, clock, scheduler, for_s=D.max_age_ms / 1000)

    log = dead_letters(lmdb_store)
    [queued] = of(AnnouncementDeadLettered, log)
    assert queued.retry_after_ms == 1_800_000
    [delivered] = of(Delivered, log)
    assert (delivered.entry_id, delivered.attempts) == (entry, 1)
    assert script.asked_at == [start, start + HALF_AN_HOUR_S]
    assert_dead_letters_verify(lmdb_store)


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
    ref = start_queue(lmdb_store, clock, scheduler, portal, {"hook": hook}, actors)
    ref.ask(Enqueue("ann-1", "hook", "conv-1", "one", "timeout"), timeout=GUARD)

    run_queue(ref, clock, scheduler, for_s=D.max_age_ms / 1000)

    [failed] = of(AnnouncementSendFailed, dead_letters(lmdb_store))
    assert failed.retry_after_ms == 5_000
    assert script.asked_at == [start + 30, start + 90]
    assert_dead_letters_verify(lmdb_store)


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
    ref = start_queue(lmdb_store, clock, scheduler, portal, {"hook": hook, "other": other}, actors)
    first = ref.ask(Enqueue("ann-1", "hook", "conv-1", "one", "timeout"), timeout=GUARD)
    clock.advance(30)
    assert queue_settled(ref).entries[0].retry_after_ms == 1_800_000
    second = ref.ask(Enqueue("ann-2", "hook", "conv-1", "two", "timeout"), timeout=GUARD)
    elsewhere = ref.ask(Enqueue("ann-3", "other", "conv-2", "three", "timeout"), timeout=GUARD)
    recovered = NewEvent(event=ProviderRecovered(provider="main"), ts=clock.now())
    lmdb_store.append("provider:main", [recovered])

    ref.tell(Drain("main"))
    queue_settled(ref)

    drained = [r.entry_id for r in of(Retried, dead_letters(lmdb_store)) if r.reason == "drain"]
    assert drained == [elsewhere]
    assert [m.text for m in other.messages] == ["three"]
    assert script.asked_at == [start + 30]
    state = run_queue(ref, clock, scheduler, for_s=D.max_age_ms / 1000)
    delivered = [d.entry_id for d in of(Delivered, dead_letters(lmdb_store))]
    assert delivered == [elsewhere, first, second]
    assert script.asked_at == [start + 30, *[start + 30 + HALF_AN_HOUR_S] * 2]
    assert (state.entries, state.delivered) == ((), 3)
    assert_dead_letters_verify(lmdb_store)


# -- what replay re-derives ------------------------------------------------------------------


def test_replay_flags_a_retry_recorded_before_the_receivers_retry_after(
    lmdb_store: EventStore, clock: FakeClock
) -> None:
    """The hint is part of the re-derived decision: a retry recorded an hour early (on
    the old backoff) is a finding of ``replay --verify``, which names when it was due."""
    append_dead_letter(lmdb_store, clock, dead_lettered("e1", channel="hook"))
    clock.advance(30)
    append_dead_letter(lmdb_store, clock, Retried(entry_id="e1", attempt=1))
    failed = failed_send("e1", retry_after_ms=1_800_000)
    append_dead_letter(lmdb_store, clock, failed)
    clock.advance(60)
    append_dead_letter(lmdb_store, clock, Retried(entry_id="e1", attempt=2))

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
    append_dead_letter(lmdb_store, clock, dead_lettered("e1", channel="hook"))
    clock.advance(30)
    append_dead_letter(lmdb_store, clock, Retried(entry_id="e1", attempt=1))
    append_dead_letter(lmdb_store, clock, AnnouncementSendFailed(**old_failure))
    [*_, last] = dead_letters(lmdb_store)
    assert isinstance(last.event, AnnouncementSendFailed)
    assert last.event.retry_after_ms is None
    script = BusyUntil(clock, clock.now(), retry_after="1800")  # takes the next at once
    hook = webhook(busy_receiver(receivers, script).url)
    ref = start_queue(lmdb_store, clock, scheduler, portal, {"hook": hook}, actors)
    failed_at = clock.now()

    run_queue(ref, clock, scheduler, for_s=D.max_age_ms / 1000)

    assert script.asked_at == [failed_at + 60]
    assert of(Delivered, dead_letters(lmdb_store))
    assert_dead_letters_verify(lmdb_store)


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
    first_send(portal, noted, late_reply())
    assert noted.retry_after_ms == hint
