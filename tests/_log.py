"""A stream built by hand in memory: events at chosen times, folded as it grows."""

from __future__ import annotations

from typing import Any, Generic, TypeVar

from stalwart import testing
from stalwart.events import Event, RecordedEvent
from stalwart.state import Aggregate

S = TypeVar("S")


def recorded(event: Event, ts: float, version: int, stream: str) -> RecordedEvent:
    """``event`` as the log would hold it at ``version`` (position = version)."""
    return testing.recorded(event, stream=stream, version=version, ts=ts)


class FoldedLog(Generic[S]):
    """One stream's records and their fold, for pure policy tests (no store needed)."""

    def __init__(self, aggregate: Aggregate[S] | Any, stream: str) -> None:
        self.aggregate = aggregate
        self.stream = stream
        self.records: list[RecordedEvent] = []
        self.state: S = aggregate.initial(stream)

    def add(self, event: Event, ts: float) -> S:
        self.records.append(recorded(event, ts, len(self.records) + 1, self.stream))
        self.state = self.aggregate.apply(self.state, self.records[-1])
        return self.state
