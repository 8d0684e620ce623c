"""A channel from its config entry."""

from __future__ import annotations

import httpx

from stalwart.clock import Clock, Timer
from stalwart.config import ChannelSettings
from stalwart.errors import ConfigError

from ._console import ConsoleChannel
from ._memory import MemoryChannel
from ._types import Channel
from ._webhook import WebhookChannel

__all__ = ["channel_from_settings"]


def channel_from_settings(
    name: str,
    settings: ChannelSettings,
    *,
    clock: Clock | None = None,
    timer: Timer | None = None,
    transport: httpx.AsyncBaseTransport | None = None,
) -> Channel:
    """The channel ``[channels.NAME]`` describes; ConfigError if it cannot be built (a
    kind this version does not know, a webhook with no url, or whose secret env var is
    not set). A webhook's attempt limits and backoffs run on ``timer`` (on its Clock)
    when one is given."""
    match settings.kind:
        case "console":
            return ConsoleChannel(name)
        case "memory":
            return MemoryChannel(name)
        case "webhook":
            return WebhookChannel(name, settings, clock=clock, timer=timer, transport=transport)
        case _:  # settings made in code, not read from a config (which refuses it)
            key = f"channels.{name}.kind"
            raise ConfigError(
                f"key '{key}': must be one of 'console', 'webhook', 'memory'", key=key
            )
