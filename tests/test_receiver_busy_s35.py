"""A receiver that asked to be sent nothing for a while is sent nothing by the next sends
either (session 35).

A webhook receiver that answers 503 with ``Retry-After: 600`` has its hint recorded with
the failure, and the dead-letter queue waits for it before retrying that entry. But
nothing held back the next send to the same receiver: another session's reply, another
entry's retry, due a second after the refusal, was sent at once, refused again and
dead-lettered. Now such a send does not go out: it fails at once as ``receiver_busy``
with what is left of the wait as its hint, and the queue sends it once the wait is over.

Real parts only: an LMDB store in tmp_path, the fake provider over loopback HTTP, real
webhook receivers on 127.0.0.1 that answer 503 with a Retry-After while they are busy (by
the FakeClock's time), a real Scheduler and IoPortal, the runtime's own actors; the
requests each receiver got are counted; the log checked with ``replay --verify``'s own
verification.
"""

from __future__ import annotations

from typing import Any

import pykka

from stalwart.actors import Enqueue, IoPortal, Scheduler
from stalwart.actors._send import noting, retry_after_of, send_by_clock
from stalwart.channels import RECEIVER_BUSY, Channel, OutboundMessage
from stalwart.cli._replay import verify_store
from stalwart.clock import FakeClock
from stalwart.events import (
    AnnouncementDeadLetterDelivered,
    AnnouncementDeadLettered,
    AnnouncementDeadLetterRetried,
    AnnouncementSendFailed,
)
from stalwart.runtime import Runtime
from stalwart.store import EventStore
from stalwart.testing import FakeProvider
from tests._runtime_support import GUARD, has, log_until, of, runtime_config
from tests._support_s35 import (
    DEAD_LETTERS,
    BusyUntil,
    assert_dead_letters_verify,
    busy_receiver,
    dead_letters,
    receiver_of,
    receivers_fixture,  # noqa: F401 (the fixture)
    start_queue,
    step_queues,
)
from tests.test_channels import Receiver, webhook

#: what a busy receiver asks for (s): far past the channel's own retry cap (2 s)
ASKED_S = 600
#: how far the test moves the clock at a time while the receiver is busy
STEP_S = 30


def reply_to(conversation: str, key: str) -> OutboundMessage:
    return OutboundMessage(conversation=conversation, text="the answer", idempotency_key=key)


def send_now(
    portal: IoPortal, scheduler: Scheduler, clock: FakeClock, channel: Channel, key: str
) -> tuple[str | None, int | None]:
    """A sender's send of a reply (conversation ``c-<key>``) through the runtime's send
    layer: its outcome's word and the hint it records with a failure."""
    noted = noting(channel)
    message = reply_to(f"c-{key}", key)
    word = send_by_clock(portal, scheduler, clock, noted, message, GUARD).result(GUARD + 1)
    return word, retry_after_of(noted, word)


# -- the Agent's replies ---------------------------------------------------------------------


# Was: DEFECT: another session's reply to a webhook that had answered 503 + Retry-After: 600
# a second before was sent at once (refused again, one more request to a receiver that
# asked for quiet) instead of waiting for the receiver's time
def test_a_second_sessions_reply_is_not_sent_while_the_receiver_asked_to_wait(
    store: EventStore, clock: FakeClock, fake: FakeProvider, receivers: list[Receiver]
) -> None:
    start = clock.now()
    script = BusyUntil(clock, start + ASKED_S, retry_after=str(ASKED_S))
    hook = webhook(busy_receiver(receivers, script).url)
    config = runtime_config(fake.base_url)
    with Runtime(config, store=store, clock=clock, channels={"hook": hook}) as rt:
        rt.session("s1", channel="hook").send("hello")
        log_until(store, "session:s1", has(AnnouncementSendFailed))
        clock.advance(1)
        rt.session("s2", channel="hook").send("hello")
        failing = log_until(store, "session:s2", has(AnnouncementSendFailed))

        [failed] = of(AnnouncementSendFailed, failing)
        assert (failed.error_class, failed.retry_after_ms) == (RECEIVER_BUSY, 599_000)
        queued = log_until(store, "deadletter", has(AnnouncementDeadLettered, 2))
        assert [e.retry_after_ms for e in of(AnnouncementDeadLettered, queued)] == [
            600_000,
            599_000,
        ]
        assert script.asked_at == [start]

        rt.dead_letters()  # the entries' timers are armed
        while clock.now() < start + ASKED_S - STEP_S:
            clock.advance(STEP_S)
            rt.dead_letters()  # the timers that fired are told and handled
            assert not of(AnnouncementDeadLetterRetried, dead_letters(store)), "retried early"
        clock.advance(start + ASKED_S - clock.now())
        log_until(store, "deadletter", has(AnnouncementDeadLetterDelivered, 2))

        assert script.asked_at == [start, start + ASKED_S, start + ASKED_S]
    assert verify_store(store, None).findings == ()


# -- the dead-letter queue's own retries -------------------------------------------------------


# Was: DEFECT: an entry's retry due while another entry's receiver had asked for ten minutes
# of quiet was sent to it at once, refused again, instead of waiting for the receiver's time
def test_a_retry_due_while_the_receiver_asked_to_wait_waits_without_a_request(
    lmdb_store: EventStore,
    clock: FakeClock,
    scheduler: Scheduler,
    portal: IoPortal,
    actors: list[pykka.ActorRef[Any]],
    receivers: list[Receiver],
) -> None:
    """Entry 1's first retry (at 30 s) is refused for ten minutes; entry 2 (another
    conversation, queued 10 s later) is due at 40 s: not sent, it waits what is left."""
    start = clock.now()
    script = BusyUntil(clock, start + 30 + ASKED_S, retry_after=str(ASKED_S))
    hook = webhook(busy_receiver(receivers, script).url)
    ref = start_queue(lmdb_store, clock, scheduler, portal, {"hook": hook}, actors)
    first = ref.ask(Enqueue("ann-1", "hook", "conv-1", "one", "timeout"), timeout=GUARD)
    clock.advance(10)
    second = ref.ask(Enqueue("ann-2", "hook", "conv-2", "two", "timeout"), timeout=GUARD)

    [state] = step_queues(
        clock,
        scheduler,
        (ref,),
        for_s=DEAD_LETTERS.max_age_ms / 1000,
        done=lambda s: not s[0].entries,
    )

    log = dead_letters(lmdb_store)
    failures = {
        f.entry_id: (f.error_class, f.retry_after_ms) for f in of(AnnouncementSendFailed, log)
    }
    assert failures == {first: ("server_error", 600_000), second: (RECEIVER_BUSY, 590_000)}
    assert script.asked_at == [start + 30, start + 30 + ASKED_S, start + 30 + ASKED_S]
    assert (state.entries, state.delivered) == ((), 2)
    assert_dead_letters_verify(lmdb_store)


# -- the send layer ----------------------------------------------------------------------------


# Was: DEFECT: a send a second after its receiver answered 503 + Retry-After: 86400 went out
# (refused again); now it waits, at most an hour, and another receiver is not held back
def test_a_receivers_wait_holds_back_its_next_send_for_at_most_an_hour(
    clock: FakeClock, scheduler: Scheduler, portal: IoPortal, receivers: list[Receiver]
) -> None:
    start = clock.now()
    script = BusyUntil(clock, start + 3600, retry_after="86400")
    hook = webhook(busy_receiver(receivers, script).url)
    other = receiver_of(receivers)
    elsewhere = webhook(other.url)  # the same name, another url: another receiver

    assert send_now(portal, scheduler, clock, hook, "k1") == ("server_error", 86_400_000)
    clock.advance(1)
    assert send_now(portal, scheduler, clock, hook, "k2") == (RECEIVER_BUSY, 3_599_000)
    assert send_now(portal, scheduler, clock, elsewhere, "k3") == (None, None)
    clock.advance(3598)
    assert send_now(portal, scheduler, clock, hook, "k4") == (RECEIVER_BUSY, 1_000)
    assert script.asked_at == [start]

    clock.advance(1)  # an hour on: asked again, once
    assert send_now(portal, scheduler, clock, hook, "k5") == (None, None)
    assert script.asked_at == [start, start + 3600]
    assert [r.headers["idempotency-key"] for r in other.requests] == ["k3"]


def test_a_wait_shorter_than_the_queues_first_backoff_holds_nothing_back(
    clock: FakeClock, scheduler: Scheduler, portal: IoPortal, receivers: list[Receiver]
) -> None:
    # 10 s escapes the channel (its retries wait at most 5 s) but is shorter than the
    # dead-letter queue's 30 s: the next send goes out rather than wait for the queue
    start = clock.now()
    script = BusyUntil(clock, start + 1, retry_after="10")
    hook = webhook(busy_receiver(receivers, script).url)
    assert send_now(portal, scheduler, clock, hook, "k1") == ("server_error", 10_000)
    clock.advance(1)
    assert send_now(portal, scheduler, clock, hook, "k2") == (None, None)
    assert script.asked_at[-1] == start + 1
