"""Records built in memory, as a log would hold them: for folds tested or measured
without a store."""

from __future__ import annotations

from stalwart.events import Event, RecordedEvent

__all__ = ["recorded"]


def recorded(
    event: Event, *, stream: str, version: int, ts: float, position: int | None = None
) -> RecordedEvent:
    """``event`` as version ``version`` of ``stream`` at global ``position`` (the version
    when not given: a log holding that one stream), appended at ``ts``."""
    at = version if position is None else position
    return RecordedEvent(
        position=at,
        stream=stream,
        version=version,
        ts=ts,
        id=f"{at:032x}",
        causation_id=None,
        correlation_id=None,
        schema=1,
        event=event,
    )
