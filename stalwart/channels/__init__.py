"""Where user-facing text is delivered: replies, failure notices, static messages.

A :class:`Channel` takes an :class:`OutboundMessage` and returns a :class:`Delivery` or
raises :class:`~stalwart.errors.ChannelError` (``retryable``, content-free ``kind``).
Built-ins: :class:`ConsoleChannel`, :class:`WebhookChannel` and, for tests,
:class:`MemoryChannel`; :func:`channel_from_settings` builds one from ``[channels.NAME]``.
"""

from ._console import ConsoleChannel
from ._factory import channel_from_settings
from ._memory import MemoryChannel
from ._send import (
    LONGEST_BUSY_S,
    RECEIVER_BUSY,
    RetryAfterNoted,
    busy_gated,
    send_within,
)
from ._types import (
    Channel,
    Delivery,
    MessageKind,
    OutboundMessage,
    channel_named,
    message_kind,
)
from ._webhook import WebhookChannel

__all__ = [
    "LONGEST_BUSY_S",
    "RECEIVER_BUSY",
    "Channel",
    "ConsoleChannel",
    "Delivery",
    "MemoryChannel",
    "MessageKind",
    "OutboundMessage",
    "RetryAfterNoted",
    "WebhookChannel",
    "busy_gated",
    "channel_from_settings",
    "channel_named",
    "message_kind",
    "send_within",
]
