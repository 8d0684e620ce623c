"""One send with a deadline, whose outcome is a content-free word, never an exception;
a channel that notes the receiver's Retry-After of its send's failure; and what a
receiver that asked to be sent nothing for a while (its Retry-After) holds back."""

from __future__ import annotations

import math
import threading
import weakref
from collections.abc import Callable

import anyio

from stalwart._logs import get_logger
from stalwart.clock import Clock, SystemClock
from stalwart.errors import FINAL_FAILURE, ChannelError

from ._types import Channel, Delivery, OutboundMessage
from ._webhook import WebhookChannel

__all__ = [
    "LONGEST_BUSY_S",
    "LONGEST_HINT_MS",
    "RECEIVER_BUSY",
    "SHORTEST_BUSY_MS",
    "RetryAfterNoted",
    "busy_gated",
    "send_within",
]

log = get_logger(__name__)


async def send_within(
    channel: Channel | None, message: OutboundMessage, timeout_s: float | None
) -> str | None:
    """Send ``message`` within ``timeout_s`` (None: no limit of its own, as when the
    caller's Clock bounds it): None when delivered, else the failure's class
    (the ChannelError's ``kind``, with ``FINAL_FAILURE`` after it when it is final,
    ``timeout``, ``unknown_channel``, or the type name of an exception a channel raised
    against its protocol). Actors record the outcome as an event; the text of an error
    never reaches it (a caller that wants the receiver's Retry-After sends through a
    :class:`RetryAfterNoted`)."""
    if channel is None:
        return "unknown_channel"
    with anyio.move_on_after(timeout_s):
        try:
            await channel.send(message)
        except ChannelError as exc:
            return _error_class(exc)
        except Exception as exc:  # a channel that breaks its protocol: still an outcome
            return type(exc).__name__
        return None
    return "timeout"


def _error_class(error: ChannelError) -> str:
    """The failure's class, marked ``FINAL_FAILURE`` when the channel says it is final
    (not ``retryable``), but for ``closed`` (this channel object is closed; the next
    runtime's is not): the dead-letter queue expires such an entry instead of retrying it."""
    final = not error.retryable and error.kind != "closed"
    return f"{error.kind}{FINAL_FAILURE}" if final else error.kind


class RetryAfterNoted:
    """``channel`` for one send, noting what the receiver asked with its failure: after a
    send that raised a retryable ChannelError with a ``retry_after``, :attr:`retry_after_ms`
    is that hint in whole milliseconds (rounded up: never sooner than asked); None after
    any other outcome. A webhook that stops at once on a Retry-After above its own cap
    leaves the wait to the caller: the dead-letter queue records the hint with the
    failure (``retry_after_ms``) and waits at least that long before the next retry.
    """

    __slots__ = ("_channel", "name", "retry_after_ms")

    def __init__(self, channel: Channel) -> None:
        self._channel = channel
        self.name = channel.name
        self.retry_after_ms: int | None = None

    @property
    def channel(self) -> Channel:
        """The channel it sends on."""
        return self._channel

    async def send(self, message: OutboundMessage) -> Delivery:
        self.retry_after_ms = None
        try:
            return await self._channel.send(message)
        except ChannelError as exc:
            self.note(exc)
            raise

    def note(self, error: ChannelError) -> None:
        """What the receiver asked with ``error``: the failure of this send."""
        self.retry_after_ms = _hint_ms(error)

    async def aclose(self) -> None:
        await self._channel.aclose()


#: the longest hint kept, in ms (about 285,000 years): what any channel says fits the
#: log's integers, and waiting longer is waiting past every entry's max age anyway
LONGEST_HINT_MS = 2**53


def _hint_ms(error: ChannelError) -> int | None:
    """The receiver's Retry-After of a retryable failure, in ms (None: none, or final)."""
    seconds = error.retry_after
    if seconds is None or not error.retryable or not math.isfinite(seconds) or seconds < 0:
        return None
    return min(math.ceil(seconds * 1000), LONGEST_HINT_MS)


# -- a receiver that asked to be sent nothing for a while ------------------------------------

#: The class of a send that did not go out: its receiver asked (with the Retry-After of
#: another send's failure) to be sent nothing until later. Retryable: the error's
#: ``retry_after`` is what is left of that wait.
RECEIVER_BUSY = "receiver_busy"
#: The longest a receiver's Retry-After holds this process's sends back (s): a receiver
#: that asks for a day is asked again after an hour (one request), and its answer then
#: holds them back again.
LONGEST_BUSY_S = 3600.0
#: The shortest Retry-After that holds a receiver's next sends back (ms): a held-back send
#: goes to the dead-letter queue, whose first retry is about 30 s away, so a shorter wait
#: costs a send less than holding it back would (it goes out, and the channel's own
#: retries wait as asked).
SHORTEST_BUSY_MS = 30_000

#: A receiver: the channel's name and its webhook url, or for any other channel the
#: channel itself (its identity: two channels of a host's own kind under one name, one
#: per runtime say, may reach two unrelated receivers).
_Receiver = tuple[str, str | int | None]


class _BusyReceivers:
    """Until when each receiver asked to be sent nothing, on one Clock's time."""

    __slots__ = ("_lock", "_until")

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._until: dict[_Receiver, float] = {}

    def left(self, receiver: _Receiver, now: float) -> float | None:
        """Seconds the receiver asked to be left alone from ``now`` on (None: none)."""
        with self._lock:
            until = self._until.get(receiver)
            if until is not None and until <= now:
                del self._until[receiver]
                return None
        return None if until is None else until - now

    def note(self, receiver: _Receiver, now: float, error: ChannelError) -> None:
        """The receiver's Retry-After with a send's failure, bounded by :data:`LONGEST_BUSY_S`
        (a later, shorter one does not shorten the wait another send was asked for)."""
        hint = _hint_ms(error)
        if hint is None or hint < SHORTEST_BUSY_MS:
            return
        until = now + min(hint / 1000, LONGEST_BUSY_S)
        with self._lock:
            self._until = {r: t for r, t in self._until.items() if t > now}  # the bound
            self._until[receiver] = max(until, self._until.get(receiver, until))


#: The busy receivers known in this process, by the Clock their times are on (every
#: SystemClock reads the same time: they share one).
_BY_CLOCK: weakref.WeakKeyDictionary[object, _BusyReceivers] = weakref.WeakKeyDictionary()
_BY_CLOCK_LOCK = threading.Lock()
_SHARED = _BusyReceivers()  # a Clock that cannot be weakly referenced, and SystemClocks


def _busy_on(clock: Clock) -> _BusyReceivers:
    if isinstance(clock, SystemClock):
        return _SHARED
    with _BY_CLOCK_LOCK:
        try:
            return _BY_CLOCK.setdefault(clock, _BusyReceivers())
        except TypeError:  # a host's Clock that cannot be a weak key
            return _SHARED


def busy_gated(channel: Channel | None, clock: Clock) -> Channel | None:
    """``channel`` for one send that does not go out while its receiver asked to be sent
    nothing: it fails at once with ChannelError ``receiver_busy`` (retryable, its
    ``retry_after`` what is left of the wait); and whose failure with a Retry-After holds
    back the sends to that receiver (from every sender of the process on ``clock``) for
    as long, at most :data:`LONGEST_BUSY_S`. A receiver is a webhook channel's name and
    its url, or any other channel itself.
    A :class:`RetryAfterNoted` notes the refusal's hint as the receiver's own."""
    if channel is None:
        return None
    return _BusyGate(channel, _busy_on(clock), clock.now)


class _BusyGate:
    """A channel for one send, held back while its receiver is busy."""

    __slots__ = ("_busy", "_channel", "_now", "name")

    def __init__(self, channel: Channel, busy: _BusyReceivers, now: Callable[[], float]) -> None:
        self._channel = channel
        self._busy = busy
        self._now = now
        self.name = channel.name

    async def send(self, message: OutboundMessage) -> Delivery:
        receiver = _receiver_of(self._channel)
        left = self._busy.left(receiver, self._now())
        if left is not None:
            refusal = _busy_error(self.name, left)
            if isinstance(self._channel, RetryAfterNoted):
                self._channel.note(refusal)
            log.info("channel.receiver_busy", channel=self.name, wait_s=round(left, 3))
            raise refusal
        try:
            return await self._channel.send(message)
        except ChannelError as exc:
            self._busy.note(receiver, self._now(), exc)
            raise

    async def aclose(self) -> None:
        await self._channel.aclose()


def _receiver_of(channel: Channel) -> _Receiver:
    """Who receives what ``channel`` sends: its name and, for a webhook, its url (every
    webhook channel to that url reaches the same receiver); for any other channel, that
    channel (a name alone does not say where its sends go)."""
    if isinstance(channel, RetryAfterNoted):
        channel = channel.channel
    if isinstance(channel, WebhookChannel):
        return (channel.name, channel.settings.url)
    return (channel.name, id(channel))


def _busy_error(name: str, left_s: float) -> ChannelError:
    return ChannelError(
        f"channel {name!r}: not sent, its receiver asked to be sent nothing for "
        f"{left_s:.3f} s more (Retry-After)",
        kind=RECEIVER_BUSY,
        retryable=True,
        channel=name,
        attempts=0,
        retry_after=left_s,
    )
