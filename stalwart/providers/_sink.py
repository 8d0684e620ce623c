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

    async def emit_expecting(
        self, stream: str, events: Sequence[Event], ts: float, expected_version: int
    ) -> list[RecordedEvent]:
        """Append ``events`` to ``stream`` only if it is at ``expected_version`` (else
        ConcurrencyError, nothing appended): a decision taken on the stream as it was."""
        ...

    async def read(self, stream: str, from_version: int) -> list[RecordedEvent]:
        """``stream``'s records from ``from_version`` on, in order (what other writers,
        other processes included, appended since a fold)."""
        ...
