"""Review of three changes: the half-open breaker answered by its probe only (3e8e90e),
incidents counting calls rather than attempts (d1a0b22), and the portal that never waits
for its loop with ``send_by_clock`` giving up an unended send (fe55bb4).

Real parts only: the real IoPortal and Scheduler on the FakeClock, real LMDB stores, the
MemoryChannel and small channels written here. The review found three defects, all
fixed: their tests say what each was ("Once") and check the fix; the others are corners
that held.
"""

from __future__ import annotations

import asyncio
import logging
import threading
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
from stalwart.config import ProviderSettings
from stalwart.events import (
    BreakerHalfOpened,
    Event,
    ProviderCallFailed,
    ProviderCallSucceeded,
)
from stalwart.providers import Breaker
from stalwart.state import BREAKER, incidents
from stalwart.store import EventStore, NewEvent, load_state
from tests._runtime_support import GUARD, until

TIMEOUT_S = 1.0


def _message(text: str) -> OutboundMessage:
    return OutboundMessage(conversation="c", text=text, idempotency_key=text)


async def _answer(value: int) -> int:
    return value


async def _forever() -> None:
    await anyio.sleep_forever()


# -- the portal ------------------------------------------------------------------------------


class StrayCancelChannel:
    """A channel whose send awaits an asyncio future that someone else cancelled (a
    shared connection attempt another caller gave up on, say): the send raises
    ``CancelledError`` though nobody cancelled the send itself."""

    name = "stray"

    async def send(self, message: OutboundMessage) -> Delivery:
        shared = asyncio.get_running_loop().create_future()
        shared.cancel()  # the other caller gave up on it
        await shared
        return Delivery(channel=self.name, attempts=1)

    async def aclose(self) -> None:
        return None


def test_a_send_raising_a_stray_cancelled_error_leaves_the_portal_serving(
    clock: FakeClock,
) -> None:
    """Once: ``_run`` (stalwart/actors/_portal.py) caught the cancelled exception class
    and re-raises it whatever its origin. One raised by the job itself (not by the
    portal stopping) reaches the spawner's task group, which then cancels itself: every
    call in flight ends cancelled (another channel's send, a model call), the spawner's
    stream is closed, and every later ``submit`` ends cancelled at once while
    ``running`` is still True, until the portal is stopped. anyio's own portal (used
    before) swallowed it: the job's future ended cancelled and nothing else moved.

    Correct: only the job's own future ends (cancelled); re-raise only when the task
    itself is being cancelled (the portal stopping), e.g. check
    ``anyio.get_current_task`` / ``asyncio.current_task().cancelling()`` or the
    enclosing scope, and otherwise return."""
    other = MemoryChannel("other")
    other.hang_next()
    with Scheduler(clock) as scheduler, IoPortal() as portal:
        bystander = send_by_clock(portal, scheduler, clock, other, _message("b"), 60.0)
        until(lambda: other.attempted)
        stray = send_by_clock(portal, scheduler, clock, StrayCancelChannel(), _message("s"), 60.0)
        until(stray.done)
        later = portal.submit(_answer, 7)
        until(later.done)
        assert portal.running
        assert not bystander.done()  # the other channel's send is still in flight
        assert not later.cancelled()
        assert later.result() == 7
        bystander.cancel()


def test_a_stop_overlapping_a_restart_leaves_the_new_loops_calls_alone() -> None:
    """Once: ``IoPortal.stop`` detached the loop under the lock, then waits (outside it)
    for the loop to end, and only then swaps ``self._pending`` out and cancels what it
    holds. A ``start()`` in between (``running`` is already False, and a stopped portal
    may be started again) runs a new loop whose ``submit`` adds to the same set, so the
    old stop cancels calls of the new loop that had nothing to do with it.

    Trigger: a call that takes a moment to end when cancelled (a non-abandoning
    ``to_thread.run_sync``, or a channel blocking the loop) keeps ``stop`` waiting while
    another thread restarts the portal.

    Correct: take ``self._pending`` (swap in a fresh set) in the same locked section that
    detaches the loop, and sweep that set after the join."""
    release = threading.Event()
    entered = threading.Event()

    def wait_in_thread() -> None:
        entered.set()
        release.wait(GUARD)

    async def slow_to_end() -> None:
        await anyio.to_thread.run_sync(wait_in_thread)  # a cancel waits for the thread

    portal = IoPortal().start()
    stopper = threading.Thread(target=portal.stop)
    try:
        portal.submit(slow_to_end)
        assert entered.wait(GUARD)
        stopper.start()
        until(lambda: not portal.running)  # the stop detached the loop and waits for it
        portal.start()
        fresh = portal.submit(_forever)
        release.set()
        stopper.join(GUARD)
        assert not stopper.is_alive()
        assert not fresh.done()  # the new loop's call is none of the old stop's business
        assert portal.submit(_answer, 1).result(GUARD) == 1
    finally:
        release.set()
        if stopper.is_alive():
            stopper.join(GUARD)
        portal.stop()


def test_a_send_the_stopped_portal_refuses_leaves_no_timer_behind(
    clock: FakeClock, logs: list[Any]
) -> None:
    """Once: ``send_by_clock`` (stalwart/actors/_send.py) scheduled the cut and the
    give-up timer, then calls ``portal.submit``; when the portal is not running (the
    runtime closing) submit raises RuntimeError to the caller, but both timers stay
    armed. ``RESEND_GRACE_S`` after the deadline the give-up timer settles a future no
    one holds and logs ``channel.send_unended`` for a send that never existed (an
    operator chases a blocked channel that is fine); the timers also stay in the heap.

    Correct: arm the timers after a successful ``submit`` (the deadline already cuts a
    send that starts after it: ``_Deadline.arm``), or cancel them when submit raises."""
    channel = MemoryChannel("chat")
    with Scheduler(clock) as scheduler:
        before = scheduler.stats().pending
        with pytest.raises(RuntimeError, match="not running"):
            send_by_clock(IoPortal(), scheduler, clock, channel, _message("x"), TIMEOUT_S)
        clock.advance(TIMEOUT_S + RESEND_GRACE_S)
        assert not [e for e in logs if e["event"] == "channel.send_unended"]
        assert scheduler.stats().pending == before


def test_a_stop_start_cycle_leaves_no_future_pending_and_the_loop_serves_again() -> None:
    """Calls handed over while a channel blocks the loop, some cancelled before they
    start, then a stop: every future ends (cancelled or with its result) and none of the
    cancelled ones ran; the portal started again serves as before."""
    gate = threading.Event()
    blocked = threading.Event()
    ran: list[int] = []

    async def block_the_loop() -> None:
        blocked.set()
        gate.wait(GUARD)  # synchronous on purpose: the loop runs nothing else meanwhile

    async def note(value: int) -> int:
        ran.append(value)
        return value

    portal = IoPortal().start()
    portal.submit(block_the_loop)
    assert blocked.wait(GUARD)
    queued: list[Future[int]] = [portal.submit(note, i) for i in range(20)]
    for future in queued[::2]:
        assert future.cancel()
    stopper = threading.Thread(target=portal.stop)
    stopper.start()
    until(lambda: not portal.running)
    gate.set()
    stopper.join(GUARD)
    assert not stopper.is_alive()
    assert all(f.done() for f in queued)
    assert not set(ran) & set(range(0, 20, 2))  # cancelled before they started: never ran
    for value, future in enumerate(queued):
        assert future.cancelled() or future.result() == value
    with portal:
        assert portal.submit(note, 99).result(GUARD) == 99


class ThreadGateChannel:
    """A send that waits on a worker thread a cancel does not end (until the gate)."""

    name = "gated"

    def __init__(self) -> None:
        self.gate = threading.Event()
        self.entered = threading.Event()

    def _wait(self) -> None:
        self.entered.set()
        self.gate.wait(GUARD)

    async def send(self, message: OutboundMessage) -> Delivery:
        await anyio.to_thread.run_sync(self._wait)
        return Delivery(channel=self.name, attempts=1)

    async def aclose(self) -> None:
        self.gate.set()


def test_the_give_up_racing_the_sends_own_end_completes_the_outcome_once(
    clock: FakeClock, logs: list[Any], caplog: pytest.LogCaptureFixture
) -> None:
    """The give-up timer (fired by ``advance`` in this thread) and the send's own end (on
    the loop's thread) race: the outcome is completed exactly once, with one of the two
    answers, and no callback raises (``concurrent.futures`` would log it)."""
    caplog.set_level(logging.ERROR, logger="concurrent.futures")
    with Scheduler(clock) as scheduler, IoPortal() as portal:
        for i in range(15):
            channel = ThreadGateChannel()
            sent = send_by_clock(portal, scheduler, clock, channel, _message(f"m{i}"), TIMEOUT_S)
            assert channel.entered.wait(GUARD)
            clock.advance(TIMEOUT_S)  # cut: the thread does not notice
            opener = threading.Thread(target=channel.gate.set)
            opener.start()
            clock.advance(RESEND_GRACE_S)
            opener.join(GUARD)
            assert sent.result(GUARD) in (TIMEOUT, None)
            # every give-up is followed by the send's late end, and only those are
            until(
                lambda: (
                    _count(logs, "channel.send_unended") == _count(logs, "channel.send_ended_late")
                )
            )
    assert not caplog.records


def _count(logs: list[Any], event: str) -> int:
    return sum(e["event"] == event for e in list(logs))


# -- the breaker: only the probe answers, across a restart -----------------------------------

SETTINGS = ProviderSettings(
    kind="openai", base_url="http://x", breaker_failure_threshold=2, breaker_reset_timeout_ms=60_000
)


def _record(store: EventStore, breaker: Breaker, clock: FakeClock, events: list[Event]) -> None:
    if events:
        recorded = store.append("provider:p", [NewEvent(event=e, ts=clock.now()) for e in events])
        breaker.fold(recorded)


def _failure(probe: bool | None) -> ProviderCallFailed:
    return ProviderCallFailed(
        provider="p", model="m", agent="a", error_class="server_error", probe=probe
    )


def _success(probe: bool | None) -> ProviderCallSucceeded:
    return ProviderCallSucceeded(provider="p", model="m", agent="a", probe=probe)


def test_a_restart_while_half_open_keeps_waiting_for_a_probe(
    lmdb_store: EventStore, clock: FakeClock
) -> None:
    """A non-probe success recorded while half-open, then a restart (the breaker folded
    again from the log, snapshots of fold v2 not reused): still half-open, and the first
    call of the new process is the probe that answers it."""
    breaker = Breaker(SETTINGS, load_state(lmdb_store, "provider:p", BREAKER))
    for _ in range(2):
        _record(lmdb_store, breaker, clock, [_failure(False)])
        _record(lmdb_store, breaker, clock, breaker.settled(False, clock.now()))
    assert breaker.state.status == "open"
    clock.advance(60)
    _record(lmdb_store, breaker, clock, breaker.due(clock.now()))
    assert breaker.admit() is True  # a probe, in flight as the process dies
    _record(lmdb_store, breaker, clock, [_success(False)])  # a long call from before
    _record(lmdb_store, breaker, clock, breaker.settled(False, clock.now()))
    assert breaker.state.status == "half_open"

    again = Breaker(SETTINGS, load_state(lmdb_store, "provider:p", BREAKER))
    assert (again.state.status, again.state.probe_outcome) == ("half_open", None)
    assert again.due(clock.now()) == []
    assert again.admit() is True  # the dead process's probe does not hold the slot
    _record(lmdb_store, again, clock, [_failure(True)])
    _record(lmdb_store, again, clock, again.settled(True, clock.now()))
    assert again.state.status == "open"
    tags = [type(r.event).__name__ for r in lmdb_store.read_stream("provider:p")]
    assert tags.count(BreakerHalfOpened.__name__) == 1


# -- incidents: calls, not attempts, under since and the bound --------------------------------


def _attempt_failed(call_id: str, retry_of: str = "") -> ProviderCallFailed:
    return ProviderCallFailed(
        provider="p",
        model="m",
        agent="a",
        error_class="server_error",
        call_id=call_id,
        retry_of=retry_of,
    )


def test_incidents_since_and_the_bound_leave_a_retry_counted_alone(
    lmdb_store: EventStore,
) -> None:
    """A retry whose failed attempt is before ``since``, or was forgotten by the bound,
    is a call of its own; one whose attempt is remembered takes its place. The counts
    stay consistent (failures by class add up to ``failed``, none negative)."""
    t0 = 1_800_000_000.0

    def put(ts: float, event: Event) -> None:
        lmdb_store.append("provider:p", [NewEvent(event=event, ts=ts)])

    put(t0, _attempt_failed("a1"))
    put(t0 + 10, ProviderCallSucceeded(provider="p", model="m", agent="a", retry_of="a1"))
    put(t0 + 20, _attempt_failed("b1"))
    put(t0 + 21, _attempt_failed("b2", retry_of="b1"))
    put(t0 + 22, _attempt_failed("c1"))
    put(t0 + 23, _attempt_failed("d1"))
    put(t0 + 24, _attempt_failed("e1", retry_of="b2"))  # b2 forgotten with a bound of 2

    whole = incidents(lmdb_store.read_all())
    [row] = whole.models
    assert (row.calls, row.succeeded, row.failed, row.retried) == (4, 1, 3, 3)

    since = incidents(lmdb_store.read_all(), since=t0 + 5)
    [row] = since.models
    # the success's attempt a1 is before since: the retry is a call of its own
    assert (row.calls, row.succeeded, row.failed, row.retried) == (4, 1, 3, 2)

    bounded = incidents(lmdb_store.read_all(), max_open_calls=2)
    [row] = bounded.models
    assert (row.calls, row.succeeded, row.failed, row.retried) == (5, 1, 4, 2)
    assert bounded.forgotten_calls >= 1
    for state in (whole, since, bounded):
        for model in state.models:
            assert sum(model.failures.values()) == model.failed
            assert min([model.failed, model.retried, *model.failures.values()]) >= 0
