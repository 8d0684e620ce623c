"""A channel send bounded by the runtime's Clock, not by the event loop's own clock.

``send_within`` on the portal would measure its timeout with ``anyio.move_on_after``,
which reads the loop's monotonic clock: under a ``FakeClock`` an announce timeout would
then take real seconds, and the outcome would be recorded at the same fake time as the
send it timed out, so replay could not show the wait. Here the deadline is a scheduler
timer on the Clock: when it fires first it cancels the send, and the outcome is
``"timeout"`` as before.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import Future, InvalidStateError

from stalwart.channels import Channel, OutboundMessage, send_within
from stalwart.clock import Clock

from ._portal import IoPortal
from ._scheduler import Scheduler

__all__ = ["RESEND_GRACE_S", "clock_timer", "send_by_clock"]

#: The outcome of a send the deadline cut short (what ``send_within`` says for it).
TIMEOUT = "timeout"
#: Beyond a send's timeout, how long an announcement with no outcome is left to its
#: sender (which records the outcome once its send ends) before another sender, in this
#: process or another on the same log, sends it again.
RESEND_GRACE_S = 5.0


def send_by_clock(
    portal: IoPortal,
    scheduler: Scheduler,
    clock: Clock,
    channel: Channel | None,
    message: OutboundMessage,
    timeout_s: float,
) -> Future[str | None]:
    """Send ``message`` on the portal; when ``timeout_s`` pass on ``clock`` first, the
    send is cancelled and the returned future holds ``"timeout"``.

    Otherwise it holds what ``send_within`` gives (None when delivered, else the failure's
    word), or ends cancelled when the portal stops. Cancelling it cancels the send.
    """
    outcome: Future[str | None] = Future()
    expired = threading.Event()
    started: list[Future[str | None]] = []

    def expire(_at: float) -> None:
        expired.set()  # before cancel(): the done-callback runs inside it
        for send in started:
            send.cancel()

    # armed before the send starts, so a send seen by its channel has its deadline
    timer = scheduler.schedule(clock.now() + timeout_s, expire)
    send = portal.submit(send_within, channel, message, None)
    started.append(send)
    if expired.is_set():  # the deadline came before the send was known to it
        send.cancel()

    def settle(finished: Future[str | None]) -> None:
        timer.cancel()
        try:
            if finished.cancelled():
                if expired.is_set():
                    outcome.set_result(TIMEOUT)
                else:
                    outcome.cancel()
            elif (error := finished.exception()) is not None:
                outcome.set_exception(error)
            else:
                outcome.set_result(finished.result())
        except InvalidStateError:  # the caller cancelled it first
            pass

    send.add_done_callback(settle)
    outcome.add_done_callback(lambda done: send.cancel() if done.cancelled() else None)
    return outcome


async def _on_loop(fn: Callable[[], object]) -> None:
    fn()


def clock_timer(
    portal: IoPortal,
    scheduler: Scheduler,
    clock: Clock,
    seconds: float,
    expire: Callable[[], object],
) -> Callable[[], object]:
    """A :data:`stalwart.tools.Timer` on the runtime's Clock: ``expire`` runs on the
    portal's loop once ``seconds`` pass on ``clock`` (the scheduler's thread only submits
    it, never waits for it); the returned callable disarms it."""

    def fire(_at: float) -> None:
        if portal.running:
            portal.submit(_on_loop, expire)

    return scheduler.schedule(clock.now() + seconds, fire).cancel
