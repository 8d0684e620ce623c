"""Review of the dead-letter queue (session 34): what a channel says will never succeed.

Real parts only: an LMDB store in tmp_path, a real webhook receiver on 127.0.0.1
(tests/test_channels.py's), MemoryChannels, a real Scheduler and IoPortal; time from the
FakeClock. A test marked ``# Was: DEFECT:`` failed on the code before its fix; the others
check a claim the fix relies on.
"""

from __future__ import annotations

import time
from typing import Any

import anyio
import pykka
import pytest

from stalwart.actors import Enqueue, IoPortal, QueueState, Scheduler
from stalwart.channels import Channel, MemoryChannel
from stalwart.clock import FakeClock
from stalwart.events import (
    AnnouncementDeadLetterDelivered,
    AnnouncementDeadLetterExpired,
    AnnouncementDeadLetterRetried,
    AnnouncementSendFailed,
    Event,
)
from stalwart.state import DeadLetterState
from stalwart.store import EventStore, NewEvent
from tests._runtime_support import GUARD, log_until, of
from tests._support_s35 import (
    DEAD_LETTERS,
    append_dead_letter,
    assert_dead_letters_verify,
    dead_lettered,
    failed_send,
    first_send,
    late_reply,
    receiver_of,
    receivers_fixture,  # noqa: F401 (the fixture)
    start_queue,
)
from tests.test_channels import Receiver, Step, webhook

D = DEAD_LETTERS
Delivered = AnnouncementDeadLetterDelivered
Expired = AnnouncementDeadLetterExpired
#: the seed's backoffs after the first (60 + 120 + 240 + 480 s), and then some
EVERY_LATER_RETRY_S = 3_600.0


# -- harness ---------------------------------------------------------------------------------


def closing(portal: IoPortal, channel: Channel) -> None:
    portal.submit(channel.aclose).result(GUARD)


def letters(store: EventStore) -> list[Event]:
    return [record.event for record in store.read_stream("deadletter")]


def quiet_after(ref: pykka.ActorRef[Any], clock: FakeClock, seconds: float) -> DeadLetterState:
    """Move the clock on, then the queue's state once it handled what that fired."""
    clock.advance(seconds)
    state = ref.ask(QueueState(), timeout=GUARD)
    assert isinstance(state, DeadLetterState)
    return state


# -- 1. a message the receiver refuses for good is retried for a quarter of an hour ----------


# Was: DEFECT: a webhook's 401 was retried max_retries times (15 min) and held the
# conversation's later messages behind it all that time
def test_a_retry_the_receiver_refuses_for_good_expires_at_once_and_frees_its_conversation(
    lmdb_store: EventStore,
    clock: FakeClock,
    scheduler: Scheduler,
    portal: IoPortal,
    actors: list[pykka.ActorRef[Any]],
    receivers: list[Receiver],
) -> None:
    """A 401 (a revoked token) says the request will never succeed: retrying it four
    more times over 15 minutes is wasted work, tells the operator nothing until then, and
    holds every later message of the conversation back (in order). It expires at once,
    reason ``rejected``, and the next message goes at its own time."""
    receiver = receiver_of(receivers, Step(status=401), Step(status=200))
    hook = webhook(receiver.url)
    ref = start_queue(lmdb_store, clock, scheduler, portal, {"hook": hook}, actors)
    first = ref.ask(Enqueue("ann-1", "hook", "conv-1", "one", "timeout"), timeout=GUARD)
    second = ref.ask(Enqueue("ann-2", "hook", "conv-1", "two", "timeout"), timeout=GUARD)

    clock.advance(D.retry_base_ms / 1000)  # both entries' first retry is due
    records = log_until(lmdb_store, "deadletter", lambda rs: bool(of(Delivered, rs)))

    [failed] = of(AnnouncementSendFailed, records)
    assert (failed.entry_id, failed.error_class) == (first, "rejected:final")
    [expired] = of(Expired, records)
    assert (expired.entry_id, expired.reason, expired.attempts) == (first, "rejected", 1)
    [delivered] = of(Delivered, records)
    assert delivered.entry_id == second
    state = quiet_after(ref, clock, EVERY_LATER_RETRY_S)
    assert (state.entries, state.expired, state.delivered) == ((), 1, 1)
    assert len(receiver.requests) == 2  # one try of each: the refused one is not sent again
    assert len(letters(lmdb_store)) == len(records)
    closing(portal, hook)
    assert_dead_letters_verify(lmdb_store)


# Was: DEFECT: an answer whose first send was refused for good (HTTP 403) was queued and
# sent five more times
def test_an_answer_whose_first_send_was_refused_for_good_is_expired_at_once_not_resent(
    lmdb_store: EventStore,
    clock: FakeClock,
    scheduler: Scheduler,
    portal: IoPortal,
    actors: list[pykka.ActorRef[Any]],
    receivers: list[Receiver],
) -> None:
    """The sender's own send got a 403 and queued the entry with what it recorded: the
    queue expires it at once (attempts 0), visible in the log, and never sends it."""
    receiver = receiver_of(receivers, Step(status=403))
    hook = webhook(receiver.url)
    reason = first_send(portal, hook, late_reply())
    assert reason == "rejected:final"
    ref = start_queue(lmdb_store, clock, scheduler, portal, {"hook": hook}, actors)
    entry = ref.ask(Enqueue("ann-1", "hook", "conv-1", "one", reason), timeout=GUARD)

    records = log_until(lmdb_store, "deadletter", lambda rs: bool(of(Expired, rs)))

    [expired] = of(Expired, records)
    assert (expired.entry_id, expired.reason, expired.attempts) == (entry, "rejected", 0)
    state = quiet_after(ref, clock, EVERY_LATER_RETRY_S)
    assert (state.entries, state.expired) == ((), 1)
    assert not of(AnnouncementDeadLetterRetried, list(lmdb_store.read_stream("deadletter")))
    assert len(receiver.requests) == 1  # the sender's own send, nothing after it
    closing(portal, hook)
    assert_dead_letters_verify(lmdb_store)


@pytest.mark.parametrize(
    ("kind", "retryable", "word"),
    [
        ("rejected", False, "rejected:final"),
        ("transport", False, "transport:final"),  # a console whose stream is gone
        ("server_error", True, "server_error"),
        ("rate_limited", True, "rate_limited"),
    ],
)
def test_a_send_says_whether_its_failure_is_final(
    portal: IoPortal, kind: str, retryable: bool, word: str
) -> None:
    channel = MemoryChannel("chat")
    channel.fail_next(kind=kind, retryable=retryable)
    assert first_send(portal, channel, late_reply()) == word


def test_a_closed_channel_is_no_final_failure_the_next_runtime_sends_it(
    portal: IoPortal,
) -> None:
    """``closed`` is not retryable on this channel object, but a runtime closing is no
    answer from the receiver: its entries are retried by the next runtime."""
    channel = MemoryChannel("chat")
    anyio.run(channel.aclose)
    assert first_send(portal, channel, late_reply()) == "closed"


def test_a_log_written_before_final_failures_were_marked_keeps_its_retries_and_verifies(
    lmdb_store: EventStore,
    clock: FakeClock,
    scheduler: Scheduler,
    portal: IoPortal,
    actors: list[pykka.ActorRef[Any]],
) -> None:
    """Older logs recorded a refusal as ``rejected``: those entries keep the old rule
    (retried on the backoff), so the retries an older version decided still verify."""
    queued = dead_lettered("e1", announcement_id="ann-1", reason="rejected")
    append_dead_letter(lmdb_store, clock, queued)
    clock.advance(30)
    append_dead_letter(lmdb_store, clock, AnnouncementDeadLetterRetried(entry_id="e1", attempt=1))
    failed = AnnouncementSendFailed(announcement_id="ann-1", error_class="rejected", entry_id="e1")
    append_dead_letter(lmdb_store, clock, failed)
    chat = MemoryChannel("chat")
    ref = start_queue(lmdb_store, clock, scheduler, portal, {"chat": chat}, actors)

    state = quiet_after(ref, clock, 60)  # its second retry, on the old schedule

    records = log_until(lmdb_store, "deadletter", lambda rs: bool(of(Delivered, rs)))
    assert [r.attempt for r in of(AnnouncementDeadLetterRetried, records)] == [1, 2]
    assert not of(Expired, records)
    assert state.expired == 0
    assert_dead_letters_verify(lmdb_store)


# -- 2. a backlog costs the queue n squared to build --------------------------------------------

#: a backlog an hour's outage of a busy deployment leaves behind
BACKLOG = 30_000
#: what 200 more entries may take to queue on top of it, generously (a loaded 2-core
#: machine): about 9 s before the fix (a pass over the queue per entry), 0.3 s after
ENQUEUE_LIMIT_S = 3.0
#: what the queue may take to fold 50,000 entries another runtime queued, generously:
#: about 9 s before the fix (the queue frozen again after every record), 0.3 s after
CATCH_UP_LIMIT_S = 3.0


def backlog(store: EventStore, clock: FakeClock, count: int, first: int = 0) -> None:
    """``count`` entries queued by another runtime, in batches as its senders queue them."""
    for start in range(first, first + count, 1_000):
        batch = [
            dead_lettered(
                f"e{i}",
                announcement_id=f"ann-{i}",
                text="Sorry, that took too long.",
                conversation=f"conv-{i % 50}",
            )
            for i in range(start, min(first + count, start + 1_000))
        ]
        store.append("deadletter", [NewEvent(event=e, ts=clock.now()) for e in batch])


# Was: DEFECT: every Enqueue passed over the whole queue (dedupe, next retry, expiry): with
# 30,000 entries each took about 45 ms, so a backlog of n cost n squared to build
def test_queueing_onto_a_large_backlog_costs_the_same_as_onto_a_small_one(
    lmdb_store: EventStore,
    clock: FakeClock,
    scheduler: Scheduler,
    portal: IoPortal,
    actors: list[pykka.ActorRef[Any]],
) -> None:
    """Senders wait on each Enqueue (up to 5 s) before they go on: during an outage the
    queue must take the next entry as fast with 30,000 queued as with 30."""
    backlog(lmdb_store, clock, BACKLOG)
    ref = start_queue(lmdb_store, clock, scheduler, portal, {"chat": MemoryChannel("chat")}, actors)
    ref.ask(QueueState(), timeout=GUARD * 3)

    started = time.monotonic()
    for index in range(200):
        ref.ask(Enqueue(f"more-{index}", "chat", "conv-new", "text", "timeout"), timeout=GUARD)
    elapsed = time.monotonic() - started

    assert elapsed < ENQUEUE_LIMIT_S, f"200 entries queued in {elapsed:.1f} s"
    state = ref.ask(QueueState(), timeout=GUARD)
    assert len(state.entries) == BACKLOG + 200
    # the first entry of the backlog is retried first: the timer is where it was
    assert scheduler.next_deadline() == clock.now() + D.retry_base_ms / 1000


# Was: DEFECT: the queue froze its whole state again after each record it folded from
# another runtime, so 50,000 entries queued by a peer took about 9 s to take in
def test_a_large_backlog_another_runtime_queued_is_taken_in_in_linear_time(
    lmdb_store: EventStore,
    clock: FakeClock,
    scheduler: Scheduler,
    portal: IoPortal,
    actors: list[pykka.ActorRef[Any]],
) -> None:
    ref = start_queue(lmdb_store, clock, scheduler, portal, {"chat": MemoryChannel("chat")}, actors)
    ref.ask(QueueState(), timeout=GUARD)
    backlog(lmdb_store, clock, 50_000)  # a second worker on the store, during an outage

    started = time.monotonic()
    ref.ask(Enqueue("mine", "chat", "conv-mine", "text", "timeout"), timeout=GUARD * 3)
    elapsed = time.monotonic() - started

    assert elapsed < CATCH_UP_LIMIT_S, f"50,000 entries taken in {elapsed:.1f} s"
    assert len(ref.ask(QueueState(), timeout=GUARD).entries) == 50_001


def test_an_entry_queued_behind_a_long_backoff_is_retried_at_its_own_time_in_order(
    lmdb_store: EventStore,
    clock: FakeClock,
    scheduler: Scheduler,
    portal: IoPortal,
    actors: list[pykka.ActorRef[Any]],
) -> None:
    """The timer re-armed for a new entry alone is the one a look at the whole queue
    gives: an entry of another conversation goes at its 30 s, while one queued behind
    an entry of its own conversation (four retries spent: 480 s) waits for it."""
    append_dead_letter(lmdb_store, clock, dead_lettered("old"))
    for attempt in range(1, 5):
        append_dead_letter(
            lmdb_store, clock, AnnouncementDeadLetterRetried(entry_id="old", attempt=attempt)
        )
        append_dead_letter(lmdb_store, clock, failed_send("old"))
    chat = MemoryChannel("chat")
    chat.fail_next(10)
    ref = start_queue(lmdb_store, clock, scheduler, portal, {"chat": chat}, actors)
    ref.ask(QueueState(), timeout=GUARD)  # started: its timer is armed
    later = clock.now() + 480
    assert scheduler.next_deadline() == later

    behind = ref.ask(Enqueue("ann-behind", "chat", "conv-1", "two", "timeout"), timeout=GUARD)
    assert scheduler.next_deadline() == later
    other = ref.ask(Enqueue("ann-other", "chat", "conv-2", "three", "timeout"), timeout=GUARD)
    assert scheduler.next_deadline() == clock.now() + 30

    quiet_after(ref, clock, 30)
    records = log_until(
        lmdb_store, "deadletter", lambda rs: bool(of(AnnouncementSendFailed, rs)[4:])
    )
    retried = [r.entry_id for r in of(AnnouncementDeadLetterRetried, records)]
    assert retried[4:] == [other]
    assert behind not in retried
