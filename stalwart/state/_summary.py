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
        counts = dict(state.counts)
        counts[record.type] = counts.get(record.type, 0) + 1
        return msgspec.structs.replace(
            state,
            version=record.version,
            first_ts=record.ts if state.first_ts is None else state.first_ts,
            last_ts=record.ts,
            last_position=record.position,
            counts=counts,
        )


SUMMARY = StreamSummaryAggregate()
