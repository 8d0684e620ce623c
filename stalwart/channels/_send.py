"""One send with a deadline, whose outcome is a content-free word, never an exception."""

from __future__ import annotations

import anyio

from stalwart.errors import FINAL_FAILURE, ChannelError

from ._types import Channel, OutboundMessage

__all__ = ["send_within"]


async def send_within(
    channel: Channel | None, message: OutboundMessage, timeout_s: float | None
) -> str | None:
    """Send ``message`` within ``timeout_s`` (None: no limit of its own, as when the
    caller's Clock bounds it): None when delivered, else the failure's class
    (the ChannelError's ``kind``, with ``FINAL_FAILURE`` after it when it is final,
    ``timeout``, ``unknown_channel``, or the type name of an exception a channel raised
    against its protocol). Actors record the outcome as an event; the text of an error
    never reaches it."""
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
    runtime's is not): the dead-letter queue expires such an entry instead of retrying."""
    final = not error.retryable and error.kind != "closed"
    return f"{error.kind}{FINAL_FAILURE}" if final else error.kind
