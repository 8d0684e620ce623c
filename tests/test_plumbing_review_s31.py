"""Review of the concurrency plumbing under the actors: the I/O portal, the scheduler,
the lanes and the loop watch. Real parts only (the real IoPortal, Scheduler and Lanes,
the FakeClock, the MemoryChannel and small channels written here)."""

from __future__ import annotations

import sys
import threading
from functools import partial
from typing import Any

import pykka
import pytest

from stalwart.actors import IoPortal, Scheduler
from stalwart.actors._lanes import Lanes
from stalwart.actors._portal import STOP_TIMEOUT_S
from stalwart.actors._send import send_by_clock
from stalwart.channels import Delivery, MemoryChannel, OutboundMessage
from stalwart.clock import FakeClock, SystemClock
from tests._runtime_support import GUARD, until
from tests.test_review_portal_probe_incidents import _answer, _forever, _message


async def _exits() -> None:
    sys.exit(3)


class ExitingChannel:
    """A channel whose send calls ``sys.exit()`` (a library that exits on a fatal error)."""

    name = "exiting"

    async def send(self, message: OutboundMessage) -> Delivery:
        sys.exit(1)

    async def aclose(self) -> None:
        return None


# -- the portal ------------------------------------------------------------------------------


# Was: DEFECT: a call raising SystemExit (a channel or a run's work calling sys.exit) ended
# the portal's event loop: every call in flight cancelled, every later submit refused.
def test_a_call_raising_system_exit_ends_only_its_own_future(portal: IoPortal) -> None:
    bystander = portal.submit(_forever)
    exited = portal.submit(_exits)
    with pytest.raises(SystemExit):
        exited.result(GUARD)
    assert portal.submit(_answer, 7).result(GUARD) == 7
    assert portal.running
    assert not bystander.done()  # the other call is still in flight
    bystander.cancel()


# Was: DEFECT: a channel whose send called sys.exit() stopped every later send and model
# call of the runtime.
def test_a_channel_calling_sys_exit_is_an_outcome_and_the_next_send_delivers(
    clock: FakeClock, scheduler: Scheduler, portal: IoPortal
) -> None:
    exited = send_by_clock(portal, scheduler, clock, ExitingChannel(), _message("a"), 60.0)
    until(exited.done)
    assert isinstance(exited.exception(), SystemExit)  # what the actors record by its name
    chat = MemoryChannel("chat")
    assert send_by_clock(portal, scheduler, clock, chat, _message("b"), 60.0).result(GUARD) is None
    assert [m.text for m in chat.messages] == ["b"]


# Was: DEFECT: IoPortal.stop() (Runtime.close's step before runtime:stopped) waited without
# bound for a call blocking the loop: close hung, the log was never closed.
def test_stop_is_bounded_while_a_call_blocks_the_loop(logs: list[Any]) -> None:
    gate = threading.Event()
    entered = threading.Event()

    async def blocks() -> None:
        entered.set()
        gate.wait(6 * GUARD)  # synchronous on purpose: a blocking SDK call inside async def

    portal = IoPortal().start()
    ident = portal.thread_ident
    stopper = threading.Thread(target=portal.stop)  # the runtime's bound: 5 s
    try:
        stuck = portal.submit(blocks)
        queued = portal.submit(_answer, 1)
        assert entered.wait(GUARD)
        stopper.start()
        stopper.join(STOP_TIMEOUT_S + GUARD)
        assert not stopper.is_alive()  # the loop is still blocked, and stop has returned
        assert not portal.running
        assert stuck.cancelled()  # nobody waits for the held-up calls
        assert queued.cancelled()
        [warned] = [e for e in logs if e["event"] == "io.portal_stop_timed_out"]
        assert warned["timeout_s"] == STOP_TIMEOUT_S
    finally:
        gate.set()
        if stopper.is_alive():
            stopper.join(GUARD)
    # once the loop is free its thread ends on its own: nothing is left behind
    until(lambda: ident not in {t.ident for t in threading.enumerate()})
    with portal:  # and the portal starts again
        assert portal.submit(_answer, 2).result(GUARD) == 2


def test_a_prompt_stop_says_nothing(logs: list[Any]) -> None:
    portal = IoPortal().start()
    running = portal.submit(_forever)
    portal.stop()
    assert running.cancelled()
    assert not [e for e in logs if e["event"] == "io.portal_stop_timed_out"]


# -- the scheduler ---------------------------------------------------------------------------


def _exit(_at: float) -> None:
    sys.exit(2)


# Was: DEFECT: a timer callback raising SystemExit ended the scheduler's thread without a
# word: every later deadline (watchdogs, retries, the loop watch) never fired.
def test_a_callback_raising_system_exit_leaves_the_real_scheduler_firing(
    logs: list[Any],
) -> None:
    clock = SystemClock()
    fired = threading.Event()
    with Scheduler(clock) as scheduler:
        scheduler.schedule(clock.now() + 0.01, _exit)
        until(lambda: scheduler.stats().fired == 1)
        scheduler.schedule(clock.now() + 0.01, lambda _at: fired.set())
        assert fired.wait(GUARD)
        assert scheduler.stats().failed == 1
    assert [e for e in logs if e["event"] == "scheduler.callback_failed"]


# Was: DEFECT: the same with a FakeClock: a due timer's callback raising SystemExit ended the
# helper thread, and later due timers waited for an advance that may never come.
def test_a_due_callback_raising_system_exit_leaves_the_fake_clocks_helper_firing(
    clock: FakeClock, scheduler: Scheduler
) -> None:
    fired = threading.Event()
    scheduler.schedule(clock.now(), _exit)  # due: fired on the scheduler's helper thread
    until(lambda: scheduler.stats().fired == 1)
    scheduler.schedule(clock.now(), lambda _at: fired.set())
    assert fired.wait(GUARD)


# -- the lanes -------------------------------------------------------------------------------


# Was: DEFECT: a lane ran all of its key's queued jobs on its thread before letting go: with
# every thread taken, another session waited for the whole of one session's burst.
def test_a_key_with_many_jobs_queued_does_not_hold_up_another_key() -> None:
    lanes = Lanes(1, name="review-lanes")
    order: list[tuple[str, int]] = []
    gate = threading.Event()

    def job(key: str, index: int) -> None:
        if index == 0:
            gate.wait(GUARD)
        order.append((key, index))

    try:
        burst = [lanes.submit("a", partial(job, "a", i)) for i in range(20)]
        other = lanes.submit("b", partial(job, "b", 0))
        gate.set()
        other.get(timeout=GUARD)
        for future in burst:
            future.get(timeout=GUARD)
    finally:
        gate.set()
        lanes.close()
    assert order.index(("b", 0)) <= 2  # after a job or two of ``a``, not after all 20
    assert [i for key, i in order if key == "a"] == list(range(20))  # each key in order
    assert not lanes.busy("a")
    assert not lanes.busy("b")


def test_closing_fails_the_queued_jobs_and_lets_the_running_one_finish() -> None:
    lanes = Lanes(1, name="review-lanes")
    gate = threading.Event()
    entered = threading.Event()

    def first() -> str:
        entered.set()
        gate.wait(GUARD)
        return "first"

    running = lanes.submit("a", first)
    queued = lanes.submit("a", lambda: "second")
    waiting = lanes.submit("b", lambda: "third")
    assert entered.wait(GUARD)
    lanes.close()
    gate.set()
    assert running.get(timeout=GUARD) == "first"
    for future in (queued, waiting):
        with pytest.raises(pykka.ActorDeadError):
            future.get(timeout=GUARD)
    with pytest.raises(pykka.ActorDeadError):
        lanes.submit("c", lambda: None).get(timeout=GUARD)
