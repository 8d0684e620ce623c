"""A channel send bounded by the runtime's Clock, not by the event loop's own clock.

``send_within`` on the portal would measure its timeout with ``anyio.move_on_after``,
which reads the loop's monotonic clock: under a ``FakeClock`` an announce timeout would
then take real seconds, and the outcome would be recorded at the same fake time as the
send it timed out, so replay could not show the wait. Here the deadline is a scheduler
timer on the Clock: when it fires first it cancels the send, and the outcome is
``"timeout"`` as before. The timer cuts a cancel scope inside the send, not the
portal's future, so the outcome is what the send did: a channel that delivers although
the deadline passed (a write with no checkpoint) is recorded as delivered.

A send that does not end when cut (a channel that waits on a thread a cancel does not
end, or swallows the cancellation) would leave its sender waiting for ever. It is given
:data:`RESEND_GRACE_S` more, on the Clock; then the loop looks, behind the send's own
start, and a send still running is given up: its outcome is ``"timeout"`` all the same
(logged as ``channel.send_unended``), though it may still deliver later (logged as
``channel.send_ended_late``): a reply shown twice is better than one no one is told of.
The look is on the loop so that a send the loop has not yet run (a clock that jumped) is
never taken for one that does not end. A channel that blocks the loop itself holds the
look up too: the runtime's :class:`~stalwart.actors.LoopWatch` says so, and where.

A sender that queues a failed send in the dead-letter queue sends through
:func:`noting`: what the receiver asked with the failure (its Retry-After,
:func:`retry_after_of`) goes with the failure's record and the queue's entry, whose
first retry waits for it. The receiver's wait holds back every sender's next send to
it too (:func:`~stalwart.channels.busy_gated`, on the Clock): such a send does not go
out, it fails at once as ``receiver_busy`` with what is left of the wait as its hint.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable
from concurrent.futures import Future, InvalidStateError

import anyio
import anyio.lowlevel

from stalwart._logs import get_logger
from stalwart.channels import (
    Channel,
    OutboundMessage,
    RetryAfterNoted,
    busy_gated,
    send_within,
)
from stalwart.clock import Clock

from ._portal import IoPortal
from ._scheduler import Scheduler

__all__ = ["RESEND_GRACE_S", "clock_timer", "noting", "retry_after_of", "send_by_clock"]

log = get_logger(__name__)

#: The outcome of a send the deadline cut short (what ``send_within`` says for it).
TIMEOUT = "timeout"
#: Beyond a send's timeout, how long an announcement with no outcome is left to its
#: sender (which records the outcome once its send ends) before another sender, in this
#: process or another on the same log, sends it again.
RESEND_GRACE_S = 5.0


class _Deadline:
    """A send's deadline, between the scheduler's thread (which passes it) and the loop
    (which runs the send): the cancel scope to cut, once the send has one."""

    __slots__ = ("expired", "lock", "scope")

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.expired = False
        self.scope: anyio.CancelScope | None = None

    def arm(self, scope: anyio.CancelScope) -> None:
        """On the loop: the send's scope, cut at once when the deadline already passed."""
        with self.lock:
            self.scope = scope
            if self.expired:
                scope.cancel()

    def expire(self) -> anyio.CancelScope | None:
        """On the scheduler's thread: the scope to cut (None when the send has none yet:
        it cuts itself when it starts)."""
        with self.lock:
            self.expired = True
            return self.scope


async def _send_until(
    deadline: _Deadline, channel: Channel | None, message: OutboundMessage
) -> str | None:
    """The send, cut when its deadline's scope is cancelled: its outcome is what the send
    did (a send that ends without reaching a checkpoint after the cut has still ended)."""
    with anyio.CancelScope() as scope:
        deadline.arm(scope)
        return await send_within(channel, message, None)
    return TIMEOUT  # the deadline cut it


def send_by_clock(
    portal: IoPortal,
    scheduler: Scheduler,
    clock: Clock,
    channel: Channel | None,
    message: OutboundMessage,
    timeout_s: float,
) -> Future[str | None]:
    """Send ``message`` on the portal; when ``timeout_s`` pass on ``clock`` first, the
    send is cut and the returned future holds ``"timeout"``.

    Otherwise it holds what ``send_within`` gives (None when delivered, else the failure's
    word): a send the channel completes as the deadline passes is delivered, not timed
    out. A send that has not ended :data:`RESEND_GRACE_S` after it was cut is given up:
    the future holds ``"timeout"`` then. It ends cancelled when the portal stops;
    cancelling it cancels the send.
    """
    deadline = _Deadline()
    outcome: Future[str | None] = Future()
    name = getattr(channel, "name", None)
    # the deadline counts from before the send begins: read after it, a clock moved
    # while the send was already with the channel would push the deadline later
    now = clock.now()
    # not sent while the receiver asked every sender to wait (``receiver_busy``)
    gated = busy_gated(channel, clock)
    send = portal.submit(_send_until, deadline, gated, message)  # raises when stopped

    def expire(_at: float) -> None:
        scope = deadline.expire()
        if scope is not None:  # never waits for the loop (a send may be blocking it)
            portal.call_soon(scope.cancel)

    def abandon(_at: float) -> None:
        # a call of its own on the loop, so after the send's start: never waits for it
        with contextlib.suppress(RuntimeError):  # stopped: the send ends cancelled
            portal.submit(_give_up, send, outcome, name, timeout_s + RESEND_GRACE_S)

    # a send that starts after its deadline cuts itself (``_Deadline.arm``)
    timers = (
        scheduler.schedule(now + timeout_s, expire),
        scheduler.schedule(now + timeout_s + RESEND_GRACE_S, abandon),
    )

    def ended(done: Future[str | None]) -> None:
        for timer in timers:
            timer.cancel()
        if done.cancelled():
            outcome.cancel()
            return
        error = done.exception()
        settled = _settle(outcome, done.result() if error is None else None, error)
        if not settled and not outcome.cancelled():
            word = "error" if error is not None else done.result() or "delivered"
            log.warning("channel.send_ended_late", channel=name, outcome=word)

    def dropped(done: Future[str | None]) -> None:
        if done.cancelled():
            send.cancel()

    send.add_done_callback(ended)  # after the timers: it disarms them
    outcome.add_done_callback(dropped)
    return outcome


async def _give_up(
    send: Future[str | None], outcome: Future[str | None], name: str | None, waited_s: float
) -> None:
    """On the loop, once the send had its turn after its cut: still running, it does not
    end when cut, and its outcome is taken as ``timeout``."""
    await anyio.lowlevel.checkpoint()  # one more turn for a send the cut is ending
    if not send.done() and _settle(outcome, TIMEOUT):
        log.warning("channel.send_unended", channel=name, waited_s=waited_s)


def _settle(
    outcome: Future[str | None], result: str | None, error: BaseException | None = None
) -> bool:
    """Complete ``outcome`` unless something already did; True when this call did."""
    try:
        if error is not None:
            outcome.set_exception(error)
        else:
            outcome.set_result(result)
    except InvalidStateError:
        return False
    return True


def noting(channel: Channel | None) -> RetryAfterNoted | None:
    """``channel`` for one send, noting the receiver's Retry-After with its failure
    (None: no such channel, whose send fails ``unknown_channel``)."""
    return None if channel is None else RetryAfterNoted(channel)


def retry_after_of(noted: RetryAfterNoted | None, error_class: str | None) -> int | None:
    """What the receiver asked with the failure of the send through ``noted`` (ms; None
    when it delivered, asked nothing, or the send had no channel)."""
    if error_class is None or noted is None:
        return None
    return noted.retry_after_ms


def clock_timer(
    portal: IoPortal,
    scheduler: Scheduler,
    clock: Clock,
    seconds: float,
    expire: Callable[[], object],
) -> Callable[[], object]:
    """A :data:`stalwart.tools.Timer` on the runtime's Clock: ``expire`` runs on the
    portal's loop once ``seconds`` pass on ``clock`` (the scheduler's thread hands it over
    and never waits for the loop); the returned callable disarms it."""

    def fire(_at: float) -> None:
        portal.call_soon(expire)

    return scheduler.schedule(clock.now() + seconds, fire).cancel
