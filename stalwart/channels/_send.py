"""One send with a deadline, whose outcome is a content-free word, never an exception;
and a channel that notes the receiver's Retry-After of its send's failure."""

from __future__ import annotations

import math

import anyio

from stalwart.errors import FINAL_FAILURE, ChannelError

from ._types import Channel, Delivery, OutboundMessage

__all__ = ["LONGEST_HINT_MS", "RetryAfterNoted", "send_within"]


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

    async def send(self, message: OutboundMessage) -> Delivery:
        self.retry_after_ms = None
        try:
            return await self._channel.send(message)
        except ChannelError as exc:
            self.retry_after_ms = _hint_ms(exc)
            raise

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
