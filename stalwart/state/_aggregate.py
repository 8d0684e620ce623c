"""What a fold is: an initial state and a pure ``apply(state, record) -> state``."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Protocol, TypeVar

from stalwart.events import RecordedEvent

S = TypeVar("S")


class Aggregate(Protocol[S]):
    """A pure fold over one stream's events.

    ``name`` and ``version`` identify the fold and the shape of its state: a snapshot is
    only used by the fold (name and version) that wrote it. ``state_type`` is a msgspec
    Struct, so states encode for snapshots and print as JSON.
    """

    name: str
    version: int
    state_type: type[S]

    def initial(self, stream: str) -> S:
        """The state of a stream with no events."""
        ...

    def apply(self, state: S, record: RecordedEvent) -> S:
        """The state after one more event. Pure: no I/O, no clock, no randomness."""
        ...


def fold(
    aggregate: Aggregate[S], stream: str, records: Iterable[RecordedEvent], state: S | None = None
) -> S:
    """Fold ``records`` into ``state`` (or the aggregate's initial state)."""
    current = aggregate.initial(stream) if state is None else state
    apply = aggregate.apply
    for record in records:
        current = apply(current, record)
    return current
