"""``check_store``: does every way of reading a store tell the same story?

The log is the truth; a stream's reads (through the LMDB index, or PostgreSQL's), its
row in ``streams()`` and its version are derived from it. The check walks the whole log
once and then reads every stream, reporting each disagreement (and each record that
cannot be read) with its position. It writes nothing, so it is safe beside running
workers; on a store that is being appended to, the rows and streams it reads last may be
ahead of its walk, which it does not count as a problem.
"""

from __future__ import annotations

from collections.abc import Callable

import msgspec

from stalwart.errors import CorruptRecordError, InvalidStreamError, StoreError
from stalwart.events import RecordedEvent

from ._protocol import EventStore, StreamInfo, check_stream

__all__ = ["Problem", "StoreCheck", "check_store"]


class Problem(msgspec.Struct, frozen=True, kw_only=True):
    """One disagreement: where (a position, a stream, or both) and what."""

    what: str
    position: int | None = None
    stream: str | None = None


class StoreCheck(msgspec.Struct, kw_only=True):
    """What the check found: how much it read, and every problem."""

    location: str
    records: int = 0
    streams: int = 0
    head: int = 0
    problems: list[Problem] = msgspec.field(default_factory=list)
    #: what the store says of itself (the LMDB store: its format and index mark)
    details: dict[str, int | str] = msgspec.field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return not self.problems


#: at most this many records missing at the log's end are reported one by one
_NAMED_MAX = 100
_MISSING = "cannot be read: it is missing from the log"  # as a store says of a hole


class _Walked(msgspec.Struct, kw_only=True):
    """A stream as the log's walk saw it: its records' positions, in order."""

    positions: list[int] = msgspec.field(default_factory=list)
    last_version: int = 0


def check_store(
    store: EventStore, *, progress: Callable[[int], object] | None = None
) -> StoreCheck:
    """Walk the log, then read every stream, and report where they disagree."""
    report = StoreCheck(location=store.location)
    report.head = head = store.head()
    describe = getattr(store, "describe", None)
    if callable(describe):
        report.details = describe()
    details = report.details
    indexed, lag = details.get("indexed"), details.get("index_lag")
    if isinstance(indexed, int) and isinstance(lag, int) and head - indexed >= lag:
        report.problems.append(
            Problem(
                what=f"the index stops at {indexed}, {head - indexed} records behind the head: "
                "the record after it could not be read when the store indexed",
                position=indexed + 1,
            )
        )
    walked, unread = _walk(store, head, report, progress)
    report.records = sum(len(stream.positions) for stream in walked.values())
    rows, damaged = _rows(store)
    # the head again: an append racing the check moves it; records lost at the log's end
    # do not (LMDB's head is its last record: their rows are then past it)
    settled = store.head() == head
    report.streams = len(rows) + len(damaged)
    for name, error in damaged.items():
        report.problems.append(Problem(what=str(error), stream=name))
    for name, stream in walked.items():
        row = rows.get(name)
        if name in damaged:
            continue  # said above; its reads need the row
        if row is None:
            report.problems.append(Problem(what="the log has it, streams() does not", stream=name))
        elif row.version < stream.last_version:
            report.problems.append(
                Problem(
                    what=f"its row says version {row.version}, the log has {stream.last_version}",
                    stream=name,
                )
            )
        elif row.version > stream.last_version and (row.last_position <= head or settled):
            # not an append the walk raced: the log should have held its last record
            what = f"its row says version {row.version}, the log has {stream.last_version}"
            _row_ahead(report, unread, name, row, _past(what, row, head))
        _read_back(store, name, stream, report)
    for name, row in rows.items():
        if name not in walked and (row.last_position <= head or settled):
            what = f"streams() has it at version {row.version}, the log does not"
            _row_ahead(report, unread, name, row, _past(what, row, head))
    return report


def _past(what: str, row: StreamInfo, head: int) -> str:
    if row.last_position <= head:
        return what
    return f"{what}: its last record, at {row.last_position}, is past the log's end ({head})"


def _row_ahead(
    report: StoreCheck, unread: dict[int, int], name: str, row: StreamInfo, what: str
) -> None:
    """A stream's row names a last record (``row.last_position``) the log did not give
    it: the record there that cannot be read is that one (that problem then names the
    stream), or else ``what`` is a problem of its own, at that position."""
    held = f"by the stream's row it held version {row.version}"
    if not _name(report, unread, row.last_position, name, held):
        report.problems.append(Problem(what=what, position=row.last_position, stream=name))


def _name(report: StoreCheck, unread: dict[int, int], at: int, stream: str, held: str) -> bool:
    """Name ``stream`` in the problem of the record at ``at`` that cannot be read (one
    that names no stream yet), saying what it ``held``; False when there is none."""
    index = unread.get(at)
    if index is None or report.problems[index].stream is not None:
        return False
    problem = report.problems[index]
    report.problems[index] = Problem(
        what=f"{problem.what}; {held}", position=problem.position, stream=stream
    )
    return True


def _rows(store: EventStore) -> tuple[dict[str, StreamInfo], dict[str, StoreError]]:
    """``streams()`` by name, and (a store that can say so: LMDB's ``stream_rows``) the
    rows that cannot be read, instead of an error at the first."""
    stream_rows = getattr(store, "stream_rows", None)
    if callable(stream_rows):
        readable, damaged = stream_rows()
    else:
        readable, damaged = store.streams(), {}
    return {info.stream: info for info in readable}, damaged


def _walk(
    store: EventStore,
    head: int,
    report: StoreCheck,
    progress: Callable[[int], object] | None,
) -> tuple[dict[str, _Walked], dict[int, int]]:
    """Every record up to ``head``, by stream; gaps, unreadable records, records stored
    out of their place and versions out of order are problems (the walk goes on past
    each). With it, the positions it could not read (the first of a gap), each with the
    index of its problem."""
    streams: dict[str, _Walked] = {}
    unread: dict[int, int] = {}  # position of a record that cannot be read -> its problem
    refused: dict[str, str] = {}  # stream ids no append writes -> why
    expected = 1
    while expected <= head:
        try:
            for record in store.read_all(expected, head):
                stream = streams.get(record.stream)
                if stream is None or record.position != expected:
                    if _unplaced(report, unread, record, expected, refused):
                        expected += 1  # it is stored at ``expected``: a hole raises
                        continue
                    stream = streams[record.stream] = _Walked()
                if record.version != stream.last_version + 1:
                    _version_gap(report, unread, stream, record)
                stream.positions.append(record.position)
                stream.last_version = record.version
                expected = record.position + 1
                if progress is not None and expected % 100_000 == 0:
                    progress(expected)
            break
        except CorruptRecordError as exc:
            at = exc.position if exc.position > 0 else expected
            if exc.through > at:  # a run of missing records: the walk goes on after it
                _missing(report, unread, at, min(exc.through, head), "missing")
                expected = max(min(exc.through, head), expected) + 1
                continue
            unread[at] = len(report.problems)
            report.problems.append(Problem(what=f"cannot be read: {exc.reason}", position=at))
            expected = max(at, expected) + 1
    if expected <= head:  # the log ends before its head (PostgreSQL keeps the head apart)
        _missing(report, unread, expected, head, "missing: the log ends before its head")
    return streams, unread


def _missing(report: StoreCheck, unread: dict[int, int], first: int, last: int, what: str) -> None:
    """The records ``first..last`` are missing: a problem each for the first
    ``_NAMED_MAX`` of them (a stream whose last record is one names it), then one for the
    rest, so a long run costs neither a query nor a line per position."""
    for at in range(first, min(last, first + _NAMED_MAX - 1) + 1):
        unread[at] = len(report.problems)
        report.problems.append(Problem(what=_MISSING, position=at))
    if last >= first + _NAMED_MAX:
        at = first + _NAMED_MAX
        unread[at] = len(report.problems)
        report.problems.append(Problem(what=f"positions {at}..{last} are {what}", position=at))


def _unplaced(
    report: StoreCheck,
    unread: dict[int, int],
    record: RecordedEvent,
    stored: int,
    refused: dict[str, str],
) -> bool:
    """Whether the record read as the one stored at ``stored`` is not where its stream
    can take it: it says it is at another position (swapped, or a copy of another), or
    it names a stream id no append writes (a damaged byte made it a NUL). It is then a
    problem at ``stored``, like a record that cannot be read (a stream missing it names
    it, unless it names one already)."""
    if record.position != stored:
        what = (
            f"the record stored at {stored} says it is at position {record.position}"
            f" (version {record.version} of {record.stream!r})"
        )
        stream: str | None = record.stream
    else:
        if record.stream not in refused:
            try:
                check_stream(record.stream)
            except InvalidStreamError as exc:
                refused[record.stream] = str(exc)
            else:
                return False
        what = f"cannot be read: it names a stream no append writes: {refused[record.stream]}"
        stream = None
    unread[stored] = len(report.problems)
    report.problems.append(Problem(what=what, position=stored, stream=stream))
    return True


def _version_gap(
    report: StoreCheck, unread: dict[int, int], walked: _Walked, record: RecordedEvent
) -> None:
    """A stream's version out of order: the record it is missing is one that cannot be
    read (that problem then names the stream), or else a problem of its own."""
    stream, position, version = record.stream, record.position, record.version
    due = walked.last_version + 1
    after = walked.positions[-1] if walked.positions else 0
    between = sorted(at for at in unread if after < at < position)
    if version > due and between:
        exact = len(between) == version - due  # one place per missing version, in order
        for offset, at in enumerate(between):
            held = f"version {due + offset}" if exact else f"one of versions {due}..{version - 1}"
            _name(report, unread, at, stream, f"by the stream's versions it held {held}")
        return
    report.problems.append(
        Problem(
            what=f"holds version {version} where {due} was due",
            position=position,
            stream=stream,
        )
    )


def _read_back(store: EventStore, name: str, walked: _Walked, report: StoreCheck) -> None:
    """The stream read on its own must be the records the walk gave it, in order."""
    read: list[int] = []
    try:
        for record in store.read_stream(name, 1, walked.last_version):
            read.append(record.position)
    except CorruptRecordError as exc:
        # said already: that place, or a place of this stream's the read ran into before
        # it (PostgreSQL names the record after a hole in a stream, LMDB the hole)
        after = read[-1] if read else 0
        if not any(
            p.position == exc.position
            or (p.stream == name and p.position is not None and after < p.position < exc.position)
            for p in report.problems
        ):
            report.problems.append(
                Problem(what=f"cannot be read: {exc.reason}", position=exc.position, stream=name)
            )
        return
    if read != walked.positions:
        first = next(
            (i for i, (a, b) in enumerate(zip(read, walked.positions, strict=False)) if a != b),
            min(len(read), len(walked.positions)),
        )
        report.problems.append(
            Problem(
                what=f"reading it gives {len(read)} records, the log {len(walked.positions)}; "
                f"they differ from version {first + 1} on",
                stream=name,
            )
        )
