"""A real store on which another writer wins the race for a stream's next append."""

from __future__ import annotations

from typing import Any

from stalwart.events import Event
from stalwart.store import EventStore


class RacedOnce:
    """Delegates to a real store, except that once ``armed``, the next append to
    ``stream`` is preceded by ``event`` appended there by "another writer": after the
    caller read the stream's version, so its expected version is stale and it conflicts."""

    def __init__(self, store: EventStore, stream: str, event: Event) -> None:
        self._store = store
        self._stream = stream
        self._event = event
        self.armed = False

    def __getattr__(self, name: str) -> Any:
        return getattr(self._store, name)

    def append(self, stream: str, events: Any, expected_version: Any = None, **kw: Any) -> Any:
        if self.armed and stream == self._stream:
            self.armed = False
            self._store.append(stream, [self._event])
        return self._store.append(stream, events, expected_version, **kw)
