"""Event shapes as older versions of stalwart wrote them, for tests that read old logs."""

from __future__ import annotations

from stalwart.events import Event


class CompactedV1(Event, frozen=True, tag="context:compacted"):
    """``context:compacted`` as schema 1 wrote it: ``covers`` named every id covered so
    far (schema 2 lists only the newly covered ones, as ``added``)."""

    summary_id: str
    turn: int
    covers: tuple[str, ...]
    through_seq: int
    tokens: int
    budget: int
    threshold: float
    body: str = ""
