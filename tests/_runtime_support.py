"""What the runtime tests share: waiting on a channel and on the log, picking events."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import anyio

from stalwart.channels import MemoryChannel, OutboundMessage
from stalwart.events import RecordedEvent
from stalwart.runtime import Runtime
from stalwart.store import EventStore

#: The longest any wait in these tests takes before it fails.
GUARD = 10.0

Kind = type | tuple[type, ...]


def delivered(
    rt: Runtime, channel: MemoryChannel, count: int, *, attempted: bool = False
) -> list[OutboundMessage]:
    """The channel's messages once ``count`` arrived (waited for on the runtime's loop)."""

    async def wait() -> list[OutboundMessage]:
        with anyio.fail_after(GUARD):
            return await channel.wait_for(count, attempted=attempted)

    return rt.portal.submit(wait).result(GUARD + 1)


def log_until(
    store: EventStore, stream: str, until: Callable[[list[RecordedEvent]], bool]
) -> list[RecordedEvent]:
    """The stream once ``until`` holds (woken by appends)."""
    give_up = time.monotonic() + GUARD
    while True:
        head = store.head()
        records = list(store.read_stream(stream))
        if until(records):
            return records
        left = give_up - time.monotonic()
        if left <= 0:
            raise AssertionError(f"the log never got there: {[r.type for r in records]}")
        store.wait_for(head + 1, left)


def has(kind: Kind, count: int = 1) -> Callable[[list[RecordedEvent]], bool]:
    return lambda records: sum(isinstance(r.event, kind) for r in records) >= count


def of(kind: Kind, records: list[RecordedEvent]) -> list[Any]:
    return [r.event for r in records if isinstance(r.event, kind)]
