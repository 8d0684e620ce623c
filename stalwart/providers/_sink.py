"""Where the provider layer's events go: whoever owns the streams appends them."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from stalwart.events import Event, RecordedEvent


class EventSink(Protocol):
    """Appends events that happened at ``ts`` to a stream and returns them as recorded.

    The provider layer never touches the store itself: the runtime gives it a sink that
    appends to the log (``stalwart.runtime.StoreSink``), so every effect is an event first.
    """

    async def emit(self, stream: str, events: Sequence[Event], ts: float) -> list[RecordedEvent]:
        """Append ``events`` to ``stream``."""
        ...
