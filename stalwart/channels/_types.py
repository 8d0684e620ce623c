"""What a channel is: the message it takes, the delivery it reports, the protocol."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Literal, Protocol, cast, get_args, runtime_checkable

import msgspec

from stalwart.errors import ChannelError

__all__ = ["Channel", "Delivery", "MessageKind", "OutboundMessage", "message_kind"]

MessageKind = Literal["reply", "completion", "failure_notice", "static_reply"]
_KINDS: frozenset[str] = frozenset(get_args(MessageKind))


def message_kind(recorded: str) -> MessageKind:
    """A kind recorded in the log as a MessageKind ("reply" for one this version does
    not know)."""
    return cast(MessageKind, recorded) if recorded in _KINDS else "reply"


class OutboundMessage(msgspec.Struct, frozen=True, kw_only=True):
    """User-facing text for one conversation (and optionally one thread in it).

    ``idempotency_key`` is the same on every attempt and every re-send of this message
    (a dead-letter retry included), so that a receiver can drop duplicates.
    """

    conversation: str
    text: str
    thread: str | None = None
    idempotency_key: str
    kind: MessageKind = "reply"


class Delivery(msgspec.Struct, frozen=True, kw_only=True):
    """A message that was delivered: by which channel, after how many attempts, and the
    receiver's HTTP status when there is one."""

    channel: str
    attempts: int = 1
    status: int | None = None


@runtime_checkable
class Channel(Protocol):
    """Where user-facing text is delivered.

    ``send`` returns a :class:`Delivery` or raises :class:`~stalwart.errors.ChannelError`;
    it does not bound its own total time: the caller owns that deadline (a cancel scope)
    and a cancelled send raises nothing of ours.
    """

    name: str

    async def send(self, message: OutboundMessage) -> Delivery:
        """Deliver ``message`` or raise ChannelError."""
        ...

    async def aclose(self) -> None:
        """Release what the channel holds; a later send raises ChannelError (``closed``)."""
        ...


def channel_named(channels: Mapping[str, Channel], name: str | None) -> Channel | None:
    """The channel a log names: by its key in the runtime's channels (what sessions,
    announcements and dead-letter entries record), else the one channel whose own
    ``name`` it is (logs written before the key was recorded); None when neither."""
    if name is None:
        return None
    found = channels.get(name)
    if found is not None:
        return found
    named = [channel for channel in channels.values() if channel.name == name]
    return named[0] if len(named) == 1 else None


def closed_error(name: str) -> ChannelError:
    """What a send on a closed channel raises."""
    return ChannelError(f"channel {name!r} is closed", kind="closed", retryable=False, channel=name)
