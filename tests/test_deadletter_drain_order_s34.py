"""A provider's recovery drains the dead-letter queue in each conversation's order, across
runtimes too (session 34).

Two runtimes' queues on one store: while one of them sends a conversation's earlier
entry, the other's drain must not send the later ones (they would be read first, and the
earlier one may still fail and come later).

Real parts only: an LMDB store in tmp_path, two DeadLetterActors (runtimes ``rt-a`` and
``rt-b``) on it, a MemoryChannel recording what arrived in order, a real Scheduler and
IoPortal; time from the FakeClock; the log checked with ``replay --verify``'s own
verification.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import anyio
import pykka
import pytest

from stalwart.actors import Drain, Enqueue, InFlight, IoPortal, QueueState, Scheduler
from stalwart.channels import Channel, Delivery, MemoryChannel, OutboundMessage
from stalwart.cli._replay import verify_store
from stalwart.clock import FakeClock
from stalwart.events import (
    AnnouncementDeadLetterDelivered,
    AnnouncementDeadLetterRetried,
    ProviderRecovered,
)
from stalwart.store import EventStore, NewEvent
from tests._runtime_support import GUARD, of
from tests._support_s35 import (
    DEAD_LETTERS,
    SEND_WAIT_S,
    append_dead_letter,
    assert_dead_letters_verify,
    dead_lettered,
    dead_letters,
    queues_settled,
    start_queue,
    step_queues,
)

D = DEAD_LETTERS
Retried = AnnouncementDeadLetterRetried
Delivered = AnnouncementDeadLetterDelivered
#: a send's own limit, and how long another runtime leaves an entry whose retry has no outcome
SEND_S = D.announce_timeout_ms / 1000
HOLD_S = SEND_S + 5


# -- harness ---------------------------------------------------------------------------------


def hanging(chat: MemoryChannel, ref: pykka.ActorRef[Any], clock: FakeClock) -> str:
    """Have ``ref`` retry the first entry queued (due ``retry_base_ms`` after it), whose
    send hangs: its id, once the send is under way."""
    chat.hang_next()
    clock.advance(D.retry_base_ms / 1000)
    [sending] = ref.ask(InFlight(), timeout=GUARD)
    give_up = time.monotonic() + SEND_WAIT_S
    while not chat.attempted:
        assert time.monotonic() < give_up, "the send never started"
        time.sleep(0.01)  # real-time: the send starts on the portal's loop
    return str(sending)


def delivered(store: EventStore) -> list[str]:
    return [d.entry_id for d in of(Delivered, dead_letters(store))]


def run_queues(
    store: EventStore,
    clock: FakeClock,
    scheduler: Scheduler,
    refs: tuple[pykka.ActorRef[Any], ...],
    *,
    until_delivered: int,
) -> None:
    """Move the clock from one deadline to the next (every send ended and recorded
    before the next step) until ``until_delivered`` entries were delivered."""

    def done(_: object) -> bool:
        return len(delivered(store)) >= until_delivered

    step_queues(clock, scheduler, refs, for_s=D.max_age_ms / 1000, done=done)


def recover(store: EventStore, clock: FakeClock) -> None:
    store.append(
        "provider:main", [NewEvent(event=ProviderRecovered(provider="main"), ts=clock.now())]
    )


# -- a drain beside another runtime's send ----------------------------------------------------


# Was: DEFECT: a drain sent a conversation's later reply while another runtime's retry of
# an earlier one was still in flight: the later reply was shown first
def test_a_drain_leaves_the_later_entries_of_a_conversation_another_runtime_is_sending(
    lmdb_store: EventStore,
    clock: FakeClock,
    scheduler: Scheduler,
    portal: IoPortal,
    actors: list[pykka.ActorRef[Any]],
) -> None:
    """Runtime A retries the first reply; its send hangs (a slow receiver) and then times
    out. Meanwhile the provider recovers and runtime B drains: it sends another
    conversation's entry, but neither the first reply (A's send of it may be under way)
    nor the second, queued after it: the second arrives after the first, never before."""
    chat = MemoryChannel("chat")
    channels: dict[str, Channel] = {"chat": chat}
    rt_a = start_queue(lmdb_store, clock, scheduler, portal, channels, actors, "rt-a")
    first = rt_a.ask(Enqueue("ann-1", "chat", "conv-1", "one", "timeout"), timeout=GUARD)
    second = rt_a.ask(Enqueue("ann-2", "chat", "conv-1", "two", "timeout"), timeout=GUARD)
    assert hanging(chat, rt_a, clock) == first
    rt_b = start_queue(lmdb_store, clock, scheduler, portal, channels, actors, "rt-b")
    elsewhere = rt_b.ask(Enqueue("ann-3", "chat", "conv-2", "three", "timeout"), timeout=GUARD)
    recover(lmdb_store, clock)

    rt_b.tell(Drain("main"))
    queues_settled(rt_b)

    drained = [r.entry_id for r in of(Retried, dead_letters(lmdb_store)) if r.reason == "drain"]
    assert drained == [elsewhere]
    assert [m.text for m in chat.messages] == ["three"]
    clock.advance(SEND_S)  # A's send times out: the first reply is still to come
    run_queues(lmdb_store, clock, scheduler, (rt_a, rt_b), until_delivered=3)
    assert [m.text for m in chat.messages] == ["three", "one", "two"]
    assert delivered(lmdb_store) == [elsewhere, first, second]
    assert_dead_letters_verify(lmdb_store)


def test_a_drain_beside_its_own_send_queues_the_later_entries_behind_it(
    lmdb_store: EventStore,
    clock: FakeClock,
    scheduler: Scheduler,
    portal: IoPortal,
    actors: list[pykka.ActorRef[Any]],
) -> None:
    """The runtime whose send of the first reply is in flight drains the second behind
    it: sent once the first delivered (not before), and the log verifies (replay, which
    knows nothing of what was in flight, re-derives a drain of both)."""
    chat = MemoryChannel("chat")
    rt_a = start_queue(lmdb_store, clock, scheduler, portal, {"chat": chat}, actors, "rt-a")
    first = rt_a.ask(Enqueue("ann-1", "chat", "conv-1", "one", "timeout"), timeout=GUARD)
    second = rt_a.ask(Enqueue("ann-2", "chat", "conv-1", "two", "timeout"), timeout=GUARD)
    assert hanging(chat, rt_a, clock) == first
    recover(lmdb_store, clock)

    rt_a.tell(Drain("main"))
    assert rt_a.ask(InFlight(), timeout=GUARD) == (first, second)
    assert chat.messages == []
    clock.advance(SEND_S)  # the first times out: the second is held back, not sent
    run_queues(lmdb_store, clock, scheduler, (rt_a,), until_delivered=2)

    assert [m.text for m in chat.messages] == ["one", "two"]
    assert delivered(lmdb_store) == [first, second]
    assert_dead_letters_verify(lmdb_store)


# -- what replay re-derives ------------------------------------------------------------------


# Was: DEFECT: replay --verify re-derived the same drain, so a log in which a later reply
# was drained beside another runtime's send of an earlier one verified clean
def test_replay_flags_a_drain_beside_another_runtimes_send_of_an_earlier_entry(
    lmdb_store: EventStore, clock: FakeClock
) -> None:
    append_dead_letter(lmdb_store, clock, dead_lettered("e1", text="e1"))
    append_dead_letter(lmdb_store, clock, dead_lettered("e2", text="e2"))
    clock.advance(D.retry_base_ms / 1000)
    append_dead_letter(lmdb_store, clock, Retried(entry_id="e1", attempt=1, runtime="rt-a"))
    clock.advance(1)
    recover(lmdb_store, clock)
    drain = Retried(entry_id="e2", attempt=1, reason="drain", provider="main", runtime="rt-b")
    append_dead_letter(lmdb_store, clock, drain)

    report = verify_store(lmdb_store, None)

    [finding] = [f for f in report.findings if f.stream == "deadletter"]
    assert "entry 'e1', queued before it in its conversation, was being sent" in str(finding)


@pytest.mark.parametrize(
    ("drainer", "after_s"),
    [("rt-a", 1.0), ("rt-b", HOLD_S)],
    ids=["the-sender-itself", "after-the-sender-is-taken-for-dead"],
)
def test_replay_accepts_a_drain_behind_an_earlier_send_that_no_longer_holds_it(
    lmdb_store: EventStore, clock: FakeClock, drainer: str, after_s: float
) -> None:
    """The runtime sending the first entry drains the second behind its own send; another
    runtime drains it once that send's hold ran out (its sender died)."""
    append_dead_letter(lmdb_store, clock, dead_lettered("e1", text="e1"))
    append_dead_letter(lmdb_store, clock, dead_lettered("e2", text="e2"))
    clock.advance(D.retry_base_ms / 1000)
    append_dead_letter(lmdb_store, clock, Retried(entry_id="e1", attempt=1, runtime="rt-a"))
    clock.advance(after_s)
    recover(lmdb_store, clock)
    drain = Retried(entry_id="e2", attempt=1, reason="drain", provider="main", runtime=drainer)
    append_dead_letter(lmdb_store, clock, drain)

    assert_dead_letters_verify(lmdb_store)


# -- a drain's later sends, under way after the one before them ---------------------------------


class Gated:
    """A channel whose sends wait until the test lets their text through (a slow
    receiver): ``attempted`` and ``delivered`` in the order they came."""

    name = "chat"

    def __init__(self) -> None:
        self.attempted: list[str] = []
        self.delivered: list[str] = []
        self._open: set[str] = set()

    def release(self, text: str) -> None:
        self._open.add(text)

    async def send(self, message: OutboundMessage) -> Delivery:
        self.attempted.append(message.text)
        while message.text not in self._open:
            await anyio.sleep(0.005)  # real-time: until the test lets it through
        self.delivered.append(message.text)
        return Delivery(channel=self.name, attempts=1)

    async def aclose(self) -> None:
        """Nothing held."""


def wait_until(condition: Callable[[], bool], what: str) -> None:
    give_up = time.monotonic() + SEND_WAIT_S
    while not condition():
        assert time.monotonic() < give_up, what
        time.sleep(0.01)  # real-time: sends run on the portal's loop


# Was: DEFECT: a drained entry sent behind an earlier one of its conversation was held
# against other runtimes only from its recorded retry: once the earlier send took a while,
# another runtime sent it again while its first send was still under way
def test_another_runtime_leaves_an_entry_whose_drained_send_began_after_the_one_before_it(
    lmdb_store: EventStore,
    clock: FakeClock,
    scheduler: Scheduler,
    portal: IoPortal,
    actors: list[pykka.ActorRef[Any]],
) -> None:
    """Runtime A drains a conversation's two replies; the receiver takes 20 s over the
    first, so the second's send begins 20 s after its retry was recorded. Runtime B must
    leave it alone for a send's limit (and the grace) after that, not after the record:
    one send of it, not two."""
    gated = Gated()
    channels: dict[str, Channel] = {"chat": gated}
    rt_a = start_queue(lmdb_store, clock, scheduler, portal, channels, actors, "rt-a")
    first = rt_a.ask(Enqueue("ann-1", "chat", "conv-1", "one", "timeout"), timeout=GUARD)
    second = rt_a.ask(Enqueue("ann-2", "chat", "conv-1", "two", "timeout"), timeout=GUARD)
    recover(lmdb_store, clock)
    rt_a.tell(Drain("main"))
    wait_until(lambda: gated.attempted == ["one"], "the first send never started")
    clock.advance(20)
    gated.release("one")
    wait_until(lambda: gated.attempted == ["one", "two"], "the second send never started")
    wait_until(lambda: delivered(lmdb_store) == [first], "the first was not recorded")
    rt_b = start_queue(lmdb_store, clock, scheduler, portal, channels, actors, "rt-b")
    rt_b.ask(QueueState(), timeout=GUARD)

    clock.advance(HOLD_S - 20 + 1)  # past the hold from the second's recorded retry
    rt_b.ask(QueueState(), timeout=GUARD)

    assert [r.runtime for r in of(Retried, dead_letters(lmdb_store))] == ["rt-a", "rt-a"]
    assert gated.attempted == ["one", "two"]
    gated.release("two")
    queues_settled(rt_a, rt_b)
    assert delivered(lmdb_store) == [first, second]
    assert gated.delivered == ["one", "two"]
    assert_dead_letters_verify(lmdb_store)
