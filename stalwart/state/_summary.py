"""The fold for any stream: how many events of which type, and when."""

from __future__ import annotations

import msgspec

from stalwart.events import RecordedEvent


class StreamSummary(msgspec.Struct, frozen=True, kw_only=True):
    stream: str
    version: int = 0
    first_ts: float | None = None
    last_ts: float | None = None
    last_position: int = 0
    counts: dict[str, int] = msgspec.field(default_factory=dict)


class StreamSummaryAggregate:
    """Counts events by type; what ``replay`` shows for a stream without a domain fold."""

    name = "summary"
    version = 1
    state_type = StreamSummary

    def initial(self, stream: str) -> StreamSummary:
        return StreamSummary(stream=stream)

    def apply(self, state: StreamSummary, record: RecordedEvent) -> StreamSummary:
        folder = self.folder(state)
        folder.add(record)
        return folder.state()

    def folder(self, state: StreamSummary) -> SummaryFolder:
        return SummaryFolder(state)


class SummaryFolder:
    """The summary fold over a mutable draft."""

    __slots__ = ("_counts", "_draft")

    def __init__(self, state: StreamSummary) -> None:
        self._draft = msgspec.structs.asdict(state)
        self._counts = dict(state.counts)

    def add(self, record: RecordedEvent) -> None:
        draft = self._draft
        if draft["first_ts"] is None:
            draft["first_ts"] = record.ts
        draft["version"] = record.version
        draft["last_ts"] = record.ts
        draft["last_position"] = record.position
        counts = self._counts
        counts[record.type] = counts.get(record.type, 0) + 1

    def state(self) -> StreamSummary:
        return StreamSummary(**{**self._draft, "counts": dict(self._counts)})


SUMMARY = StreamSummaryAggregate()
