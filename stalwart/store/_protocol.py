"""The EventStore protocol: small enough to implement on LMDB and PostgreSQL alike."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Protocol, runtime_checkable

import msgspec

from stalwart.errors import InvalidStreamError
from stalwart.events import Event, RecordedEvent

if TYPE_CHECKING:
    from ._subscription import Subscription

#: ``expected_version`` for an append that creates a stream (it must not exist yet).
NO_STREAM = 0

MAX_STREAM_BYTES = 400


class NewEvent(msgspec.Struct, frozen=True, kw_only=True):
    """An event to append, with what the appender knows about it.

    ``ts`` is the time the event happened (a decision's ``now``); when omitted the store
    stamps it from its clock. ``id`` is made by :mod:`stalwart.ids` when omitted.
    """

    event: Event
    ts: float | None = None
    id: str | None = None
    causation_id: str | None = None
    correlation_id: str | None = None


class Fence(msgspec.Struct, frozen=True):
    """A lease's fencing token for an append.

    Every stream has a lease epoch (0 until first claimed). An append with
    ``Fence(epoch, claim=True)`` goes through only when ``epoch`` is greater than the
    stream's, and raises it to ``epoch`` in the same transaction; with ``claim=False`` it
    goes through only while ``epoch`` is still the stream's. Otherwise the append writes
    nothing and raises FencedError. The epoch is derived data: it equals the highest
    epoch any fenced claim wrote, so it can be rebuilt from the log.
    """

    epoch: int
    claim: bool = False


class StreamInfo(msgspec.Struct, frozen=True, kw_only=True):
    """A stream's current version, and where and when its last event was appended."""

    stream: str
    version: int
    last_position: int
    last_ts: float
    lease_epoch: int = 0


class Snapshot(msgspec.Struct, frozen=True, kw_only=True):
    """A fold's state saved at a stream version; derived data, never the truth."""

    stream: str
    name: str
    version: int
    position: int
    data: bytes


@runtime_checkable
class EventStore(Protocol):
    """A durable, totally ordered, append-only log of events in named streams.

    Positions are global, start at 1 and have no gaps; stream versions start at 1.
    ``read_*`` ranges are inclusive.
    """

    @property
    def location(self) -> str:
        """Where the store lives (a directory, or a URL without its password)."""
        ...

    def append(
        self,
        stream: str,
        events: Sequence[Event | NewEvent],
        expected_version: int | None = None,
        *,
        fence: Fence | None = None,
    ) -> list[RecordedEvent]:
        """Append atomically and durably; ``expected_version`` None means any version.

        Raises ConcurrencyError when ``expected_version`` is not the stream's version
        (``NO_STREAM`` to require a new stream), FencedError when ``fence`` does not hold
        (see :class:`Fence`). Returns the recorded events.
        """
        ...

    def read_stream(
        self, stream: str, from_version: int = 1, to_version: int | None = None
    ) -> Iterator[RecordedEvent]:
        """A stream's events in version order."""
        ...

    def read_all(
        self, from_position: int = 1, to_position: int | None = None
    ) -> Iterator[RecordedEvent]:
        """Every stream's events in global order."""
        ...

    def head(self) -> int:
        """The position of the newest committed event (0 when empty)."""
        ...

    def wait_for(self, position: int, timeout: float | None) -> int:
        """Block until ``head() >= position`` or ``timeout`` seconds pass; return the head.

        Wakes at once for appends in this process and within a short poll interval for
        appends by other processes.
        """
        ...

    def subscribe(self, from_position: int = 1) -> Subscription:
        """A live, gap-free and duplicate-free feed of events from ``from_position`` on."""
        ...

    def stream_version(self, stream: str) -> int:
        """A stream's version (0 when it has no events)."""
        ...

    def lease_epoch(self, stream: str) -> int:
        """A stream's lease epoch: the highest epoch a fenced claim wrote (0 if none)."""
        ...

    def streams(self) -> list[StreamInfo]:
        """Every stream, sorted by id."""
        ...

    def put_snapshot(self, snapshot: Snapshot) -> None:
        """Save a fold's state (keeping the newest few per stream and fold)."""
        ...

    def snapshots(self, stream: str, name: str) -> Iterator[Snapshot]:
        """Saved snapshots of a stream's fold, newest first; corrupt ones are skipped."""
        ...

    def close(self) -> None:
        """Release the store; later calls raise StoreClosedError."""
        ...


def check_stream(stream: str) -> bytes:
    """The stream id as stored, or InvalidStreamError naming what is wrong."""
    if not isinstance(stream, str) or not stream:
        raise InvalidStreamError(f"a stream id must be a non-empty string, found {stream!r}")
    encoded = stream.encode("utf-8")
    if b"\x00" in encoded:
        raise InvalidStreamError(f"stream id {stream!r} contains a NUL character")
    if len(encoded) > MAX_STREAM_BYTES:
        raise InvalidStreamError(
            f"stream id is {len(encoded)} bytes, at most {MAX_STREAM_BYTES} are allowed"
        )
    return encoded
