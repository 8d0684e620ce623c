"""The EventStore protocol: small enough to implement on LMDB and PostgreSQL alike."""

from __future__ import annotations

import math
import re
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Protocol, runtime_checkable

import msgspec

from stalwart.errors import (
    ConcurrencyError,
    EventError,
    InvalidStreamError,
    StoreError,
    UnknownEventTypeError,
)
from stalwart.events import Codec, Event, RecordedEvent

if TYPE_CHECKING:
    from ._subscription import Subscription

#: ``expected_version`` for an append that creates a stream (it must not exist yet).
NO_STREAM = 0

MAX_STREAM_BYTES = 400
#: A fold's snapshot name (``name@vN``): with the stream id and the version it is one LMDB
#: key, at most 511 bytes.
MAX_SNAPSHOT_NAME_BYTES = 100


class NewEvent(msgspec.Struct, frozen=True, kw_only=True):
    """An event to append, with what the appender knows about it.

    ``ts`` is the time the event happened (a decision's ``now``), finite unix seconds;
    when omitted the store stamps it from its clock. ``id`` is made by
    :mod:`stalwart.ids` when omitted.
    """

    event: Event
    ts: float | None = None
    id: str | None = None
    causation_id: str | None = None
    correlation_id: str | None = None


def unix_ts(ts: object) -> float:
    """A ``NewEvent.ts`` as unix seconds: TypeError for anything but a number, ValueError
    for a time that is not finite (``inf`` or ``nan`` would be no time at all, and not
    JSON either: ``tail --json`` could not print it)."""
    if isinstance(ts, bool) or not isinstance(ts, int | float):
        raise TypeError(f"ts must be unix seconds (a number), got {type(ts).__name__}")
    seconds = float(ts)
    if not math.isfinite(seconds):
        raise ValueError(f"ts must be a finite number of unix seconds, got {seconds!r}")
    return seconds


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


#: Save a snapshot once this many events were folded past the newest one.
DEFAULT_SNAPSHOT_EVERY = 500


def check_snapshot_every(value: object) -> int:
    """``value`` when it is a whole number >= 0 (a store's ``snapshot_every``)."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"snapshot_every must be a whole number >= 0, got {value!r}")
    return value


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
        """Save a fold's state (keeping the newest few per stream and fold). A name of the
        form ``fold@vN`` (:func:`~stalwart.store.snapshot_name`) also removes the
        stream's snapshots of the same fold at older versions (``fold@vM``, M < N), which
        no code that saves ``fold@vN`` reads (:func:`superseded_by`)."""
        ...

    def snapshots(self, stream: str, name: str) -> Iterator[Snapshot]:
        """Saved snapshots of a stream's fold, newest first; corrupt ones are skipped."""
        ...

    def close(self) -> None:
        """Release the store; later calls raise StoreClosedError."""
        ...


class Due(msgspec.Struct, frozen=True):
    """A session's next due time as the pure fold computes it after an append's events
    (:func:`~stalwart.state.due_at`: the lease's expiry while leased, None when it has
    no work), for :meth:`WorkQueue.append`. It is exact only for an append with
    ``expected_version`` (the appender folded exactly that version), so it is refused
    without one."""

    at: float | None


class DueClaim(msgspec.Struct, frozen=True, kw_only=True):
    """A session stream whose work is due, now held by the claiming worker; ``version``
    is that of the append or fold that wrote its due row (a write-back from a fold of at
    least that version is not refused, see :meth:`WorkQueue.set_due`)."""

    stream: str
    due_at: float
    version: int = 0


class DueWork(msgspec.Struct, frozen=True, kw_only=True):
    """What :meth:`WorkQueue.claim_due` handed to a worker, and ``next_at``: the earliest
    due time after ``now`` of any session (None: nothing is scheduled), when to look
    again."""

    claimed: list[DueClaim]
    next_at: float | None


@runtime_checkable
class WorkQueue(Protocol):
    """An optional store capability: which sessions have work due, so N workers split them.

    The store keeps one row per session stream with activations: a due time, the stream
    version that last wrote it, and a short hold (owner, until). The row changes only in
    the transaction of the append that changes it:

    - an append with ``due=Due(at)`` (and ``expected_version``) sets it to ``at`` exactly
      and releases the hold (None removes the row);
    - any other append to a ``session:`` stream lowers it to
      :func:`~stalwart.state.due_hint` of its events (a new activation, a settlement, an
      answer, an interrupt: the time it may have made work runnable), so an appender that
      did not fold the stream (a user message, an Agent's settlement) never delays work;
      an early time only costs a worker a fold.

    :meth:`claim_due` hands out rows that are due and not held by another worker, each to
    one caller (PostgreSQL: ``SELECT ... FOR UPDATE SKIP LOCKED``; LMDB: a scan in one
    write transaction); :meth:`set_due` writes back what a worker's fold found. A claim
    is a hint for distribution, never a right: the lease itself is the pure
    ``decide_lease`` decision appended with ``expected_version`` and a fence claim, so a
    stale claim, a hold that ran out, or two workers at one stream cannot both lease.
    """

    def append(
        self,
        stream: str,
        events: Sequence[Event | NewEvent],
        expected_version: int | None = None,
        *,
        fence: Fence | None = None,
        due: Due | None = None,
    ) -> list[RecordedEvent]:
        """:meth:`EventStore.append`, and with ``due`` the stream's due time in the same
        transaction (ValueError without ``expected_version``)."""
        ...

    def claim_due(self, owner: str, now: float, limit: int, hold_s: float) -> DueWork:
        """Up to ``limit`` streams due at ``now`` (earliest first) that no other worker
        holds, each now held by ``owner`` until ``now + hold_s``."""
        ...

    def set_due(self, stream: str, version: int, at: float | None, owner: str) -> bool:
        """Set the stream's due time to ``at`` (from a fold of ``version``; None: no
        work) unless an append after ``version`` has written it since, and release
        ``owner``'s hold either way; whether the time was written."""
        ...


def _encoded(what: str, text: str, limit: int) -> bytes:
    """``text`` as stored (UTF-8, no NUL, at most ``limit`` bytes), or InvalidStreamError
    naming ``what`` is wrong with it."""
    if not isinstance(text, str) or not text:
        raise InvalidStreamError(f"a {what} must be a non-empty string, found {text!r}")
    try:
        encoded = text.encode("utf-8")
    except UnicodeEncodeError:  # a lone surrogate: bytes a command line could not decode
        raise InvalidStreamError(f"{what} {text!r} is not valid UTF-8") from None
    if b"\x00" in encoded:
        raise InvalidStreamError(f"{what} {text!r} contains a NUL character")
    if len(encoded) > limit:
        raise InvalidStreamError(f"{what} is {len(encoded)} bytes, at most {limit} are allowed")
    return encoded


def check_stream(stream: str) -> bytes:
    """The stream id as stored, or InvalidStreamError naming what is wrong."""
    return _encoded("stream id", stream, MAX_STREAM_BYTES)


def check_snapshot_key(stream: str, name: str) -> bytes:
    """A snapshot's key prefix as stored (stream, NUL, name, NUL), or InvalidStreamError
    naming what is wrong."""
    encoded = check_stream(stream)
    named = _encoded("snapshot name", name, MAX_SNAPSHOT_NAME_BYTES)
    return encoded + b"\x00" + named + b"\x00"


#: The largest version, position or epoch a store keeps (PostgreSQL's ``bigint``).
MAX_COUNT = 2**63 - 1


def _count(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value <= MAX_COUNT


def _id_text(value: object) -> bool:
    """An event id, causation id or correlation id both backends can store (any string,
    empty included, but no NUL and valid UTF-8), or None."""
    if value is None:
        return True
    if not isinstance(value, str) or "\x00" in value:
        return False
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:  # a lone surrogate
        return False
    return True


_FOLD_VERSION = re.compile(r"(.+@v)([0-9]{1,18})")


def superseded_by(name: str, other: str) -> bool:
    """Whether a snapshot named ``other`` is of the same fold as ``name`` at an older
    version (``f@v1`` by ``f@v2``): a store saving ``name`` deletes those. A name not of
    the form ``fold@vN`` supersedes nothing."""
    mine, theirs = _FOLD_VERSION.fullmatch(name), _FOLD_VERSION.fullmatch(other)
    return (
        mine is not None
        and theirs is not None
        and mine[1] == theirs[1]
        and int(theirs[2]) < int(mine[2])
    )


def fold_prefix(name: str) -> str | None:
    """What the names of every version of ``name``'s fold begin with (``f@v`` for
    ``f@v2``), or None for a name not of the form ``fold@vN``."""
    found = _FOLD_VERSION.fullmatch(name)
    return None if found is None else found[1]


def check_due_time(at: object) -> float | None:
    """A work-queue due time as both stores keep it: None (no work) or a finite number of
    unix seconds; else ValueError, before anything is written. ``nan`` sorted above every
    time on PostgreSQL (the session was never claimed again) and below every time on
    LMDB, and ``inf`` is "never", which None already says."""
    if at is None:
        return None
    if isinstance(at, bool) or not isinstance(at, int | float) or not math.isfinite(at):
        raise ValueError(f"a due time must be finite unix seconds or None, got {at!r}")
    return float(at)


def check_claim(now: object, limit: object, hold_s: object) -> None:
    """A claim both stores read the same way: ``now`` finite unix seconds, ``limit`` a
    count and ``hold_s`` finite seconds, not negative; else ValueError (``hold_s`` of
    ``inf`` held a session for ever, and a negative ``limit`` was an error on PostgreSQL
    and no claim on LMDB)."""
    if isinstance(now, bool) or not isinstance(now, int | float) or not math.isfinite(now):
        raise ValueError(f"a claim's now must be finite unix seconds, got {now!r}")
    if not _count(limit):
        raise ValueError(f"a claim's limit must be a whole number >= 0, got {limit!r}")
    if (
        isinstance(hold_s, bool)
        or not isinstance(hold_s, int | float)
        or not math.isfinite(hold_s)
        or hold_s < 0
    ):
        raise ValueError(f"a claim's hold must be finite seconds >= 0, got {hold_s!r}")


def check_snapshot(snapshot: Snapshot) -> bytes:
    """A snapshot's key prefix as stored, once its version and position are counts a
    store keeps (0..2**63-1); else StoreError, before anything is written (an LMDB
    writer would otherwise fail the appends committed in the same batch with it)."""
    for what, value in (("version", snapshot.version), ("position", snapshot.position)):
        if not _count(value):
            raise StoreError(
                f"cannot save a snapshot of {snapshot.stream!r}: its {what} must be a whole "
                f"number in 0..2**63-1, found {value!r}"
            )
    return check_snapshot_key(snapshot.stream, snapshot.name)


def checked_events(
    store: EventStore,
    codec: Codec,
    stream: str,
    events: Sequence[Event | NewEvent],
    expected_version: int | None,
    fence: Fence | None,
    due: object | None,
) -> list[NewEvent]:
    """What every store checks before an append, and the events as :class:`NewEvent`.

    UnknownEventTypeError for an event this version does not write; ValueError for a due
    time without ``expected_version`` or a fence on no events. An empty list means there
    is nothing to write: the empty append's ``expected_version`` held (else
    ConcurrencyError)."""
    if due is not None and expected_version is None:
        raise ValueError("an append with a due time needs expected_version")
    if isinstance(due, Due):
        check_due_time(due.at)
    if fence is not None and not _count(fence.epoch):
        raise ValueError(f"a fence's epoch must be a whole number in 0..2**63-1: {fence.epoch!r}")
    news = [e if isinstance(e, NewEvent) else NewEvent(event=e) for e in events]
    for new in news:
        if not codec.knows(new.event):
            raise UnknownEventTypeError(
                f"cannot append {type(new.event).__qualname__}: not an event this version writes"
            )
        if not (_id_text(new.id) and _id_text(new.causation_id) and _id_text(new.correlation_id)):
            raise EventError(
                f"cannot append to {stream!r}: an event id, causation id or correlation id "
                "is not storable text (not a string, a NUL character or invalid UTF-8)"
            )
    if expected_version is not None and not _count(expected_version):
        # no stream is ever at that version (a number PostgreSQL could not even compare)
        raise ConcurrencyError(stream, expected_version, store.stream_version(stream))
    if not news:
        if fence is not None:
            raise ValueError("a fenced append needs at least one event")
        version = store.stream_version(stream)
        if expected_version is not None and expected_version != version:
            raise ConcurrencyError(stream, expected_version, version)
    return news


def unencodable(exc: Exception) -> str:
    """Why an event cannot be encoded: the error's own words (msgspec and the store's
    checks name a field, a type or a rule, never a value), except for a text that is not
    UTF-8 (a lone surrogate), named by its position: ``UnicodeEncodeError``'s repr holds
    the whole string, and its message the character."""
    if isinstance(exc, UnicodeError):
        start = getattr(exc, "start", None)
        where = f" at character {start}" if isinstance(start, int) else ""
        return f"a text is not valid UTF-8{where} ({type(exc).__name__})"
    return f"{type(exc).__name__}: {exc}"
