"""A send that does not end when cut, and an event loop a channel blocks.

A channel that waits on a thread a cancel does not end (``anyio.to_thread.run_sync``)
does not end when its deadline cuts it. Before, the sender waited for its outcome for
ever: the answer was neither delivered nor dead-lettered, and nobody was told. Now a send
still running ``RESEND_GRACE_S`` after its cut, when the loop looks, is given up as
``timeout``. A channel with a synchronous call inside ``async def send`` blocks the whole
loop: no actor's thread waits for it any more (``IoPortal.submit`` used to), the runtime's
``LoopWatch`` says where it is blocked, and the send is recorded as what it did once the
loop is free.

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
from stalwart.channels import Delivery, MemoryChannel, OutboundMessage
from stalwart.clock import FakeClock
from stalwart.events import AnnouncementDelivered, AnnouncementQueued
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


def test_a_send_that_ignores_its_cut_is_given_up_after_the_grace(
    clock: FakeClock, logs: list[Any]
) -> None:
    channel = BlockingChannel(on_loop=False)
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


def test_a_send_that_blocks_the_loop_is_recorded_as_it_ends(
    clock: FakeClock, logs: list[Any]
) -> None:
    """The loop looks at a send past its grace only once it is free again: a send that
    blocked it and delivered meanwhile is recorded as delivered, not given up."""
    channel = BlockingChannel(on_loop=True)
    with Scheduler(clock) as scheduler, IoPortal() as portal:
        try:
            sent = send_by_clock(portal, scheduler, clock, channel, _message("one"), TIMEOUT_S)
            assert channel.entered.wait(GUARD)
            clock.advance(TIMEOUT_S + RESEND_GRACE_S)
            assert _pending(sent)
        finally:
            channel.gate.set()
        assert sent.result(GUARD) is None
    assert [m.text for m in channel.messages] == ["one"]
    assert not [e for e in logs if e["event"].startswith("channel.send_")]


def test_a_send_the_loop_has_not_run_yet_is_not_given_up_when_the_clock_jumps(
    clock: FakeClock, logs: list[Any]
) -> None:
    """A FakeClock moved past a send's deadline and its grace before the loop ran the
    send (here the loop is busy with another call): the send cuts itself when it starts,
    a channel with no checkpoint delivers all the same, and that is its outcome. (Once,
    the give-up settled ``timeout`` from the clock's thread at once: a test moving the
    clock right after a reply saw it dead-lettered though it was delivered.)"""
    busy = BlockingChannel(on_loop=True, name="busy")
    chat = MemoryChannel("chat")
    with Scheduler(clock) as scheduler, IoPortal() as portal:
        try:
            send_by_clock(portal, scheduler, clock, busy, _message("busy"), 60.0)
            assert busy.entered.wait(GUARD)
            sent = send_by_clock(portal, scheduler, clock, chat, _message("one"), TIMEOUT_S)
            for _ in range(3):
                clock.advance(TIMEOUT_S + RESEND_GRACE_S)
        finally:
            busy.gate.set()
        assert sent.result(GUARD) is None
    assert [m.text for m in chat.messages] == ["one"]
    assert not [e for e in logs if e["event"] == "channel.send_unended"]


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


def test_an_answer_whose_channel_blocks_the_loop(
    store: EventStore, clock: FakeClock, fake: FakeProvider, logs: list[Any]
) -> None:
    """An Agent's reply on a channel that blocks the loop: the runtime's actors go on
    (the session's status answers: no actor waits for the loop), the loop watch says
    the loop is blocked and where, and once the loop is free the reply is recorded as
    delivered."""
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
            for _ in range(8):
                clock.advance(1.0)
            assert session.status(GUARD).idle  # the turn ended; only its reply waits
            [blocked] = until(lambda: _said(logs, "io.loop_blocked"))
            assert any("in _call" in frame for frame in blocked["where"])
            assert not chat.gate.is_set()  # all of it while the loop was still blocked
        finally:
            chat.gate.set()
        delivered_ = of(
            AnnouncementDelivered, log_until(store, "session:s1", has(AnnouncementDelivered))
        )
        assert [e.announcement_id for e in delivered_] == [queued.announcement_id]
    assert [m.text for m in chat.messages] == ["the answer"]
    assert not _said(logs, "channel.send_unended")


def _said(logs: list[Any], event: str) -> list[Any]:
    return [entry for entry in logs if entry["event"] == event]


class _ReadLate(FakeClock):
    """A FakeClock whose reads on one thread (the sender's) wait until the channel has
    the send (at most ``wait_s``): the sender reading its clock after the send began,
    as a loaded machine may schedule it."""

    def __init__(self, start: float, entered: threading.Event, wait_s: float) -> None:
        super().__init__(start=start)
        self.reader: threading.Thread | None = None
        self._entered = entered
        self._wait_s = wait_s

    def now(self) -> float:
        if threading.current_thread() is self.reader:
            self._entered.wait(self._wait_s)
        return super().now()


class _TimeMovesAsItSends:
    """A channel whose send moves the clock when it begins (time passing while the send
    is under way), then never ends by itself."""

    name = "chat"

    def __init__(self, step_s: float) -> None:
        self.clock: FakeClock | None = None
        self.entered = threading.Event()
        self._step_s = step_s

    async def send(self, message: OutboundMessage) -> Delivery:
        assert self.clock is not None
        self.clock.advance(self._step_s)
        self.entered.set()
        await anyio.sleep_forever()
        raise AssertionError("unreachable")

    async def aclose(self) -> None:
        return None


def test_a_sends_deadline_counts_from_before_the_send_began() -> None:
    """Defect (actors/_send.py: send_by_clock read ``clock.now()`` after it had handed
    the send to the loop): when the clock moved while the channel already had the send,
    the deadline was counted from the later reading, so the send was cut that much
    late. tests/test_failed_answers.py's passivation test failed that way in CI."""
    channel = _TimeMovesAsItSends(step_s=TIMEOUT_S / 2)
    clock = _ReadLate(1_800_000_000.0, channel.entered, wait_s=0.3)
    channel.clock = clock
    clock.reader = threading.current_thread()
    with Scheduler(clock) as scheduler, IoPortal() as portal:
        sent = send_by_clock(portal, scheduler, clock, channel, _message("one"), TIMEOUT_S)
        clock.reader = None
        assert channel.entered.wait(GUARD)
        clock.advance(TIMEOUT_S / 2)  # TIMEOUT_S after the send was handed over
        assert sent.result(GUARD) == TIMEOUT
