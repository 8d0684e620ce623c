"""A send that does not end when cut, and an event loop a channel blocks.

A channel written with a synchronous HTTP call inside ``async def send`` (or one that
waits on a thread that ignores cancellation) neither ends when its deadline cuts it nor
lets the loop run anything else. Before, the sender waited for its outcome for ever (the
answer was neither delivered nor dead-lettered, and nobody was told), and every actor
that handed the loop a call stalled with it, because ``IoPortal.submit`` waited for the
loop to take the call. Now no thread waits for the loop, and a send that has not ended
``RESEND_GRACE_S`` after its cut is given up as ``timeout``.

Real parts only: the real IoPortal and Scheduler on a FakeClock, a real LMDB store, the
fake provider over loopback HTTP, the runtime's own actors.
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import Future
from typing import Any

import anyio
import anyio.to_thread
import pytest

from stalwart.actors import RESEND_GRACE_S, IoPortal
from stalwart.actors._scheduler import Scheduler
from stalwart.actors._send import TIMEOUT, send_by_clock
from stalwart.channels import Delivery, OutboundMessage
from stalwart.clock import FakeClock
from stalwart.events import AnnouncementDeadLettered, AnnouncementQueued, AnnouncementSendFailed
from stalwart.runtime import Runtime
from stalwart.store import EventStore
from stalwart.testing import Answer, FakeProvider
from tests._runtime_support import GUARD, has, log_until, of, runtime_config, until

TIMEOUT_S = 1.0


class BlockingChannel:
    """A channel whose send makes a synchronous call: on the loop itself (``on_loop``,
    a blocking SDK called from ``async def send``), or on a worker thread it waits for
    whatever happens (``anyio.to_thread.run_sync``, which a cancel does not end). The
    call returns when the test opens the gate."""

    def __init__(self, *, on_loop: bool, name: str = "chat") -> None:
        self.name = name
        self.on_loop = on_loop
        self.gate = threading.Event()
        self.entered = threading.Event()
        self.messages: list[OutboundMessage] = []

    def _call(self, message: OutboundMessage) -> None:
        self.entered.set()
        assert self.gate.wait(GUARD), "the test never opened the gate"
        self.messages.append(message)

    async def send(self, message: OutboundMessage) -> Delivery:
        if self.on_loop:
            self._call(message)  # blocks the event loop: the defect this file is about
        else:
            await anyio.to_thread.run_sync(self._call, message)
        return Delivery(channel=self.name, attempts=1)

    async def aclose(self) -> None:
        self.gate.set()


def _message(text: str) -> OutboundMessage:
    return OutboundMessage(conversation="c", text=text, idempotency_key=text)


def _pending(future: Future[Any]) -> bool:
    time.sleep(0.05)  # real-time: room for an outcome that must not come
    return not future.done()


@pytest.mark.parametrize("on_loop", [False, True], ids=["thread", "loop"])
def test_a_send_that_ignores_its_cut_is_given_up_after_the_grace(
    clock: FakeClock, logs: list[Any], on_loop: bool
) -> None:
    channel = BlockingChannel(on_loop=on_loop)
    with Scheduler(clock) as scheduler, IoPortal() as portal:
        try:
            sent = send_by_clock(portal, scheduler, clock, channel, _message("one"), TIMEOUT_S)
            assert channel.entered.wait(GUARD)
            clock.advance(TIMEOUT_S)  # the cut: the send does not end
            assert _pending(sent)
            clock.advance(RESEND_GRACE_S - 0.01)
            assert _pending(sent)
            clock.advance(0.01)
            assert sent.result(GUARD) == TIMEOUT
            assert [e["event"] for e in logs if e["log_level"] == "warning"] == [
                "channel.send_unended"
            ]
        finally:
            channel.gate.set()
        # the send ends after all: it is said, and the outcome stays what was recorded
        until(lambda: any(e["event"] == "channel.send_ended_late" for e in logs))
    [late] = [e for e in logs if e["event"] == "channel.send_ended_late"]
    assert late["channel"] == "chat"
    assert late["outcome"] == "delivered"  # no checkpoint after the call: it delivered
    assert sent.result() == TIMEOUT
    assert "one" not in str(logs)  # the message's text never reaches a log


def test_a_send_that_ends_within_the_grace_is_recorded_as_it_ended(clock: FakeClock) -> None:
    channel = BlockingChannel(on_loop=True)
    with Scheduler(clock) as scheduler, IoPortal() as portal:
        sent = send_by_clock(portal, scheduler, clock, channel, _message("one"), TIMEOUT_S)
        assert channel.entered.wait(GUARD)
        clock.advance(TIMEOUT_S + RESEND_GRACE_S / 2)
        channel.gate.set()  # it delivers after the cut, with no checkpoint left
        assert sent.result(GUARD) is None
        clock.advance(RESEND_GRACE_S)  # the give-up timer was disarmed
        assert sent.result() is None
    assert [m.text for m in channel.messages] == ["one"]


def test_cancelling_the_outcome_cancels_the_send(clock: FakeClock) -> None:
    channel = BlockingChannel(on_loop=False)
    with Scheduler(clock) as scheduler, IoPortal() as portal:
        try:
            sent = send_by_clock(portal, scheduler, clock, channel, _message("one"), TIMEOUT_S)
            assert channel.entered.wait(GUARD)
            assert sent.cancel()
            clock.advance(TIMEOUT_S + RESEND_GRACE_S)  # nothing left to give up
            assert sent.cancelled()
        finally:
            channel.gate.set()


def test_no_thread_waits_for_a_blocked_loop(clock: FakeClock) -> None:
    """While a channel blocks the loop, ``submit`` and ``call_soon`` return at once; the
    calls run when the loop is free again, and stopping the portal cancels what was
    handed over and never started."""
    channel = BlockingChannel(on_loop=True)
    ran: list[str] = []

    async def note(word: str) -> str:
        ran.append(word)
        return word

    portal = IoPortal()
    with Scheduler(clock) as scheduler, portal:
        send_by_clock(portal, scheduler, clock, channel, _message("one"), TIMEOUT_S)
        assert channel.entered.wait(GUARD)
        started = time.monotonic()
        later = portal.submit(note, "later")
        dropped = portal.submit(note, "dropped")
        assert portal.call_soon(lambda: ran.append("soon"))
        assert time.monotonic() - started < 1.0  # none of them waited for the loop
        assert dropped.cancel()  # not started yet: it never runs
        channel.gate.set()
        assert later.result(GUARD) == "later"
        until(lambda: "soon" in ran)
        channel.gate.clear()
        channel.entered.clear()
        send_by_clock(portal, scheduler, clock, channel, _message("two"), TIMEOUT_S)
        assert channel.entered.wait(GUARD)
        queued = portal.submit(note, "queued")
        stopper = threading.Thread(target=portal.stop)
        stopper.start()
        time.sleep(0.05)  # real-time: the stop waits for the blocked loop
        channel.gate.set()
        stopper.join(GUARD)
        assert not stopper.is_alive()
    assert queued.cancelled() or queued.result() == "queued"
    assert "dropped" not in ran
    assert ran[:2] == ["later", "soon"] or ran[:2] == ["soon", "later"]


def test_submit_on_a_stopped_portal_is_refused() -> None:
    portal = IoPortal()

    async def nothing() -> None:
        return None

    with pytest.raises(RuntimeError, match="not running"):
        portal.submit(nothing)
    with portal:
        assert portal.submit(nothing).result(GUARD) is None
    with pytest.raises(RuntimeError, match="not running"):
        portal.submit(nothing)
    assert not portal.call_soon(lambda: None)


def test_an_answer_whose_channel_blocks_the_loop_is_dead_lettered(
    store: EventStore, clock: FakeClock, fake: FakeProvider
) -> None:
    """An Agent's reply on a channel that blocks the loop: the send is given up
    ``RESEND_GRACE_S`` after its deadline, recorded as failed and dead-lettered, while
    the loop is still blocked (nothing the Agent or the queue does waits for it)."""
    fake.add(Answer(text="the answer"))
    chat = BlockingChannel(on_loop=True)
    config = runtime_config(
        fake.base_url, prompt_timeout_ms=120_000, dead_letters={"announce_timeout_ms": 1_500}
    )
    with Runtime(config, store=store, clock=clock, channels={"chat": chat}) as rt:
        try:
            session = rt.session("s1", channel="chat")
            session.send("hello")
            [queued] = of(
                AnnouncementQueued, log_until(store, "session:s1", has(AnnouncementQueued))
            )
            assert chat.entered.wait(GUARD)  # the loop is blocked from here on
            clock.advance(1.5 + RESEND_GRACE_S)
            failed = of(
                AnnouncementSendFailed,
                log_until(store, "session:s1", has(AnnouncementSendFailed)),
            )
            assert [(e.announcement_id, e.error_class) for e in failed] == [
                (queued.announcement_id, TIMEOUT)
            ]
            entries = of(
                AnnouncementDeadLettered,
                log_until(store, "deadletter", has(AnnouncementDeadLettered)),
            )
            assert [e.announcement_id for e in entries] == [queued.announcement_id]
            assert not chat.gate.is_set()  # all of it while the loop was still blocked
        finally:
            chat.gate.set()
