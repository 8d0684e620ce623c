"""The EventStore on PostgreSQL: one log shared by workers on any number of hosts.

Appends go through the handle's writer thread (``_postgres_writer``), which sends the
appends queued in this process as one call of the schema's ``append_batch`` function
on an autocommit pooled connection: one round trip, one transaction. How that keeps
positions gap-free and skip-free is told in ``_postgres_schema``; how readers tail in
``_postgres_tail``.

A row holds the event's own msgpack bytes beside its envelope columns; a read joins
them back into the codec's record form (one small encode per row) so upcasting and
unknown events work exactly as on LMDB.
"""

from __future__ import annotations

import zlib
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import msgspec
import psycopg
from psycopg import sql

from stalwart import ids
from stalwart._logs import get_logger, hide_secret, unhide_secret
from stalwart.clock import Clock, SystemClock
from stalwart.errors import (
    AppendInDoubtError,
    ConcurrencyError,
    CorruptRecordError,
    EventError,
    FencedError,
    InvalidStreamError,
    StoreClosedError,
    StoreError,
    StoreReadOnlyError,
)
from stalwart.events import DEFAULT_CODEC, Codec, Event, RecordedEvent, event_tag
from stalwart.state import due_hint

from ._postgres_connect import Connections, PostgresUrl, connect, lost
from ._postgres_due import DueStatements, claim_due, set_due
from ._postgres_schema import SCHEMA_VERSION, Statements, channel_name, ensure_schema
from ._postgres_tail import Doorbell
from ._postgres_writer import (
    AppendJob,
    NotSentError,
    Outcome,
    RefusedError,
    Result,
    Writer,
    batch_params,
)
from ._protocol import (
    DEFAULT_SNAPSHOT_EVERY,
    Due,
    DueWork,
    Fence,
    NewEvent,
    Snapshot,
    StreamInfo,
    check_claim,
    check_due_time,
    check_snapshot,
    check_snapshot_every,
    check_snapshot_key,
    check_stream,
    checked_events,
    fold_prefix,
    superseded_by,
    unencodable,
    unix_ts,
)
from ._records import Batches, Records
from ._subscription import Subscription, deadline_after, remaining

log = get_logger(__name__)

READ_BATCH = 1024
SNAPSHOTS_KEPT = 3
#: The ``application_name`` of the listener connections (to find them in pg_stat_activity).
LISTENER_NAME = "stalwart-listener"
_LAST = (1 << 63) - 1
#: the shortest wait for a pooled connection within a bounded wait
_MIN_WAIT_S = 0.05
SESSION_PREFIX = "session:"


def _newest_missing(stream: str, first: int, version: int) -> str:
    """Why a read of ``stream`` stops at ``first``: its versions from there to its last
    one (``version``) are missing from the log."""
    if first == version:
        return f"version {first} of {stream!r} is missing from the log"
    return f"versions {first}..{version} of {stream!r} are missing from the log"


class PostgresEventStore:
    """The EventStore on one PostgreSQL database (and schema). Safe to share between threads.

    ``url`` is ``postgresql://user:password@host:port/database`` with any libpq query
    parameters, plus ``schema=`` to keep several stores in one database. The schema is
    created or upgraded on first use (``create=False`` refuses a database without one;
    ``read_only=True`` also refuses an older schema instead of migrating it, and every
    write through the handle raises StoreReadOnlyError, as read commands want).
    ``pool_size`` bounds this handle's connections; tailing readers share one more, the
    listener. ``poll_interval`` is how often the head is
    read while something waits and no notification comes: the most a lost
    notification can delay a reader.
    """

    def __init__(
        self,
        url: str,
        *,
        create: bool = True,
        codec: Codec = DEFAULT_CODEC,
        clock: Clock | None = None,
        pool_size: int = 16,
        poll_interval: float = 0.05,
        connect_timeout: float = 10.0,
        read_only: bool = False,
        snapshot_every: int = DEFAULT_SNAPSHOT_EVERY,
    ) -> None:
        self._url = PostgresUrl(url)
        self._snapshot_every = check_snapshot_every(snapshot_every)
        self._read_only = read_only
        self._codec = codec
        self._clock = clock or SystemClock()
        self._timeout = connect_timeout
        self._closed = False
        names = sql.Identifier(self._url.schema)
        self._sql = Statements(names)
        self._due_sql = DueStatements(names)
        with connect(self._url, timeout=connect_timeout) as conn:
            try:
                migrated = ensure_schema(
                    conn, self._url.schema, self.location, create=create, read_only=read_only
                )
            except psycopg.Error as exc:
                raise StoreError(
                    f"cannot prepare the store's schema at {self.location}: "
                    f"{type(exc).__name__} ({exc.sqlstate})"
                ) from exc
        #: The schema version this handle found before migrating it (0: it created the
        #: schema), or None when the schema was already current.
        self.migrated_from = migrated
        self._db = Connections(self._url, pool_size=pool_size, timeout=connect_timeout)
        self._seen_head = 0  # the newest head this handle has read
        self._bell = Doorbell(
            self._listener_connection,
            channel_name(self._url.schema),
            self._sql.head,
            poll_interval,
        )
        self._header = msgspec.msgpack.Encoder()
        self._writer = Writer(self._append_batch)
        # while the handle is open no log line shows the URL's password (nor a secret of
        # its query), whatever library writes it (psycopg's pool logs connection errors)
        self._hidden = tuple(self._url.secrets)
        for secret in self._hidden:
            hide_secret(secret)

    @property
    def location(self) -> str:
        return self._url.location

    @property
    def snapshot_every(self) -> int:
        return self._snapshot_every

    @property
    def schema_version(self) -> int:
        """The version of the store's tables (the database is at it once opened)."""
        return SCHEMA_VERSION

    def __repr__(self) -> str:
        return f"PostgresEventStore({self.location!r})"

    def _live(self) -> None:
        if self._closed:
            raise StoreClosedError(f"the store at {self.location} is closed")

    def _writable(self) -> None:
        self._live()
        if self._read_only:
            raise StoreReadOnlyError(f"the store at {self.location} was opened read-only")

    def _listener_connection(self) -> psycopg.Connection[Any]:
        return connect(self._url, timeout=self._timeout, application_name=LISTENER_NAME)

    def _append_batch(self, jobs: list[AppendJob], *, again: bool = True) -> list[Outcome]:
        """Send a batch of appends (the writer thread's call); one outcome per append.

        When the connection breaks (a server restart, a failover, a killed session), the
        batch may or may not have committed. Its old session is ended first (waiting for
        it to go), so it cannot commit later; then each append whose first event is in
        the log was written, and the others are sent once more on a new connection.
        """
        doing = f"append to {jobs[0].stream!r}" if len(jobs) == 1 else "append a batch"
        pid: list[int] = []
        try:
            with self._db.connection(doing) as conn, conn.cursor(binary=True) as cursor:
                pid.append(conn.info.backend_pid)
                cursor.execute(self._sql.append_batch, batch_params(jobs))
                return cursor.fetchall()
        except StoreError as exc:
            if not lost(exc):
                raise
            unsure = AppendInDoubtError(
                f"lost the connection to the store at {self.location} during an append; "
                "it may or may not have been written"
            )
            if not again:
                raise unsure from exc.__cause__
            try:
                return self._recover(jobs, pid[0] if pid else None)
            except StoreError as again_exc:
                raise unsure from again_exc

    def _recover(self, jobs: list[AppendJob], pid: int | None) -> list[Outcome]:
        self._db.check()  # drop every pooled connection the server closed
        # safe to run twice: a pooled connection that passed the check may be cut next
        # (a restart ends sessions one after another); once more on a new one, then
        found = self._db.again("check a lost append", lambda conn: self._found(conn, jobs, pid))
        log.warning(
            "store.append_recovered",
            location=self.location,
            written=len(found) - found.count(None),
            resent=found.count(None),
        )
        resend = [job for job, result in zip(jobs, found, strict=True) if result is None]
        sent = iter(self._resend(resend))
        return [result if result is not None else next(sent) for result in found]

    def _found(
        self, conn: psycopg.Connection[Any], jobs: list[AppendJob], pid: int | None
    ) -> list[Result | None]:
        """Each append of a lost batch as the log has it: its result when it was written,
        None when it was not, once the batch's old session ``pid`` is gone."""
        # never our own session; one still there may commit yet: nothing is resent
        if pid is not None and pid != conn.info.backend_pid and self._session_lingers(conn, pid):
            log.warning("store.append_session_lingers", location=self.location)
            raise AppendInDoubtError(
                f"the session of a lost append to the store at {self.location} "
                "did not end; it may or may not have been written"
            )
        found: list[Result | None] = []
        for job in jobs:
            row = conn.execute(self._sql.find_event, (job.stream, job.ids[0])).fetchone()
            found.append(None if row is None else ("ok", row[0], row[1] - 1, 0))
        return found

    def _session_lingers(self, conn: psycopg.Connection[Any], pid: int) -> bool:
        """End the server session ``pid`` of a lost append, waiting up to 5 s for it to go;
        True when it is still there (a stalled server process, which may commit yet).

        As the login role (``SET LOCAL ROLE NONE``): a role the session switched to (the
        login role's ``ALTER ROLE ... SET role``, or ``options=-c role=...``) matched no
        session's user, so a lost append still running (waiting on a lock) was not ended
        and was sent again beside it: written twice, or a ConcurrencyError though it was
        written."""
        with conn.transaction():
            conn.execute(self._sql.as_login_role)
            ended = conn.execute(self._sql.end_session, (pid,)).fetchone()
        if ended is None or ended[0]:  # gone already, or ended now
            return False
        # not gone in 5 s, or gone just before the call: only a session still there counts
        return conn.execute(self._sql.session_alive, (pid,)).fetchone() is not None

    def _resend(self, jobs: list[AppendJob]) -> list[Outcome]:
        """Send once more the appends of a lost batch that are not in the log: each one's
        own outcome, as a first send gives it (one the server refuses fails alone, not the
        appends beside it, which it used to fail as "may or may not have been written").
        What stops the resend as a whole (the connection lost again, none to be had, the
        store closed) fails these appends, and not those the log showed written."""
        if not jobs:
            return []
        try:
            return self._append_batch(jobs, again=False)
        except StoreError as exc:
            whole = (AppendInDoubtError, NotSentError, RefusedError, StoreClosedError)
            if len(jobs) == 1 or isinstance(exc, whole):
                return [exc] * len(jobs)
        return [outcome for job in jobs for outcome in self._resend([job])]

    # -- writing -------------------------------------------------------------------------------

    def append(
        self,
        stream: str,
        events: Sequence[Event | NewEvent],
        expected_version: int | None = None,
        *,
        fence: Fence | None = None,
        due: Due | None = None,
    ) -> list[RecordedEvent]:
        self._writable()
        check_stream(stream)
        news = checked_events(self, self._codec, stream, events, expected_version, fence, due)
        if not news:
            return []
        job = self._job(stream, news, expected_version, fence)
        if due is not None:
            job.due_kind, job.due = 1, due.at
        elif stream.startswith(SESSION_PREFIX):
            job.due = due_hint(zip((n.event for n in job.news), job.stamps, strict=True))
            job.due_kind = 0 if job.due is None else 2
        outcome, first, old_version, epoch = self._writer.submit(job)
        news = job.news
        if outcome == "conflict":
            assert expected_version is not None
            raise ConcurrencyError(stream, expected_version, old_version)
        if outcome == "fenced":
            assert fence is not None
            raise FencedError(stream, fence.epoch, epoch, claim=fence.claim)
        self._bell.ring()
        return [
            RecordedEvent(
                position=first + i,
                stream=stream,
                version=old_version + 1 + i,
                ts=job.stamps[i],
                id=job.ids[i],
                causation_id=new.causation_id,
                correlation_id=new.correlation_id,
                schema=job.schemas[i],
                event=new.event,
            )
            for i, new in enumerate(news)
        ]

    def _job(
        self, stream: str, news: list[NewEvent], expected: int | None, fence: Fence | None
    ) -> AppendJob:
        """The append as the writer sends it: stamped, given ids, encoded and checked."""
        now = self._clock.now()
        try:
            data = [self._header.encode(new.event) for new in news]
            stamps = [now if new.ts is None else unix_ts(new.ts) for new in news]
        except (TypeError, ValueError, OverflowError) as exc:
            raise EventError(f"cannot encode an event for {stream!r}: {unencodable(exc)}") from exc
        for new, encoded in zip(news, data, strict=True):
            self._codec.check(new.event, encoded)  # unreadable, it would stop every read
        columns = (
            stamps,
            [new.id or ids.new_id() for new in news],
            [new.causation_id for new in news],
            [new.correlation_id for new in news],
            [self._codec.schema_of(new.event) for new in news],
            [event_tag(new.event) for new in news],
        )
        return AppendJob(stream, expected, fence, columns, data, news)

    # -- the work queue (WorkQueue) -------------------------------------------------------------

    def claim_due(self, owner: str, now: float, limit: int, hold_s: float) -> DueWork:
        self._writable()
        check_claim(now, limit, hold_s)
        return claim_due(self._db, self._due_sql, owner, now, limit, hold_s)

    def set_due(self, stream: str, version: int, at: float | None, owner: str) -> bool:
        self._writable()
        check_stream(stream)
        at = check_due_time(at)
        return set_due(self._db, self._due_sql, stream, version, at, owner)

    # -- reading -------------------------------------------------------------------------------

    def _decode(self, rows: list[Any]) -> tuple[list[RecordedEvent], CorruptRecordError | None]:
        encode = self._header.encode
        raw = msgspec.Raw
        values = [  # each row ends with the key its read must reach (``_ranged``)
            encode((p, s, v, ts, i, c, k, sc, raw(d))) for p, s, v, ts, i, c, k, sc, d, _ in rows
        ]
        out: list[RecordedEvent] = []
        error = self._codec.decode_batch(values, out)
        if error is not None:
            error = CorruptRecordError(rows[len(out)][0], error.reason)
        return out, error

    def read_all(self, from_position: int = 1, to_position: int | None = None) -> Records:
        return Records(self._log_batches(from_position, to_position))

    def _log_batches(self, from_position: int, to_position: int | None) -> Batches:
        self._live()
        last = _LAST if to_position is None else min(to_position, _LAST)

        def fetch(first: int, end: int) -> list[Any]:
            return self._db.fetch("read the log", self._sql.read_all, (first, end))

        def gap(missing: int, row: list[Any] | None) -> CorruptRecordError:
            if row is not None:  # the record after the hole
                through = int(row[0]) - 1
            else:  # the hole runs past the batch: to the next record, or to the head
                [(after, head)] = self._db.fetch("read the log", self._sql.log_hole, (missing,))
                through = int(head) if after is None else min(int(after) - 1, int(head))
            return CorruptRecordError(missing, "it is missing from the log", through=through)

        yield from self._ranged(fetch, 0, max(1, from_position), last, gap)

    def read_stream(
        self, stream: str, from_version: int = 1, to_version: int | None = None
    ) -> Records:
        return Records(self._stream_batches(stream, from_version, to_version))

    def _stream_batches(self, stream: str, from_version: int, to_version: int | None) -> Batches:
        self._live()
        check_stream(stream)
        last = _LAST if to_version is None else min(to_version, _LAST)
        doing = f"read stream {stream!r}"

        def fetch(first: int, end: int) -> list[Any]:
            return self._db.fetch(doing, self._sql.read_stream, (stream, stream, first, end))

        def gap(missing: int, row: list[Any] | None) -> CorruptRecordError:
            reason = f"version {missing} of {stream!r} is missing before it"
            if row is not None:  # the record after the hole
                return CorruptRecordError(int(row[0]), reason)
            # none after it in this batch: the stream's next record, or else its last
            for after, last_position, version in self._db.fetch(
                doing, self._sql.stream_hole, (stream, missing, stream)
            ):
                if after is not None:
                    return CorruptRecordError(int(after), reason)
                return CorruptRecordError(
                    int(last_position), _newest_missing(stream, missing, version)
                )
            return CorruptRecordError(0, reason)  # its row went too (by hand)

        yield from self._ranged(fetch, 2, max(1, from_version), last, gap)

    def _ranged(
        self,
        fetch: Callable[[int, int], list[Any]],
        key: int,
        first: int,
        last: int,
        gap: Callable[[int, list[Any] | None], CorruptRecordError],
    ) -> Batches:
        """Rows by consecutive keys (positions, or a stream's versions) in batches.

        Each row ends with the key the read must reach (the head, or the stream's
        version), read in the same snapshot as the rows; when none is found there is one
        row of NULLs and that key. A key at or below it that is missing (a row deleted by
        hand, within a batch, at its end, or at the end of the log or of the stream) is a
        CorruptRecordError after every record before it, never a silent end.
        """
        at = first
        while at <= last:
            end = min(last, at + READ_BATCH - 1)
            rows = fetch(at, end)
            reach = min(end, int(rows[0][-1])) if rows else end
            if rows and rows[0][key] is None:
                rows = []  # nothing in the range, only the key to reach
            missing = next((k for k, row in enumerate(rows, at) if row[key] != k), None)
            if missing is None and len(rows) < reach - at + 1:
                missing = at + len(rows)  # the hole runs to the end of the batch or past it
            if missing is not None:
                yield from self._records(rows[: missing - at])
                raise gap(missing, rows[missing - at] if missing - at < len(rows) else None)
            yield from self._records(rows)
            if reach < end:
                return  # the end of the log (or of the stream)
            at = end + 1

    def _records(self, rows: list[Any]) -> Batches:
        records, error = self._decode(rows)
        yield records
        if error is not None:
            raise error  # after every good record before it

    def head(self) -> int:
        return self._head()

    def _head(self, wait: float | None = None) -> int:
        """The head, waiting at most ``wait`` seconds for a pooled connection."""
        [(position,)] = self._db.fetch("read the head", self._sql.head, wait=wait)
        head = int(position)
        self._seen_head = max(self._seen_head, head)
        return head

    def _head_within(self, deadline: float | None) -> int:
        """The head, with the wait for a connection bounded by ``deadline``: when every
        pooled connection is busy past it, the last head this handle read (a wait that
        found nothing new); when the pool's last attempt to connect failed, the store is
        unavailable."""
        wait = remaining(deadline, self._db.timeout)
        try:
            return self._head(None if deadline is None else max(wait or 0.0, _MIN_WAIT_S))
        except NotSentError:
            if deadline is None or self._db.connect_failure is not None:
                raise
            return self._seen_head

    def wait_for(self, position: int, timeout: float | None) -> int:
        self._live()
        deadline = deadline_after(timeout)
        seen = self._bell.count
        head = self._head_within(deadline)
        if head >= position or timeout == 0:
            return head
        self._bell.start(ready_within=min(1.0, timeout) if timeout is not None else 1.0)
        while head < position:
            wait = remaining(deadline, self._bell.next_wait())
            if wait is None:
                break
            self._bell.wait(seen, wait)
            self._live()
            seen = self._bell.count
            head = self._head_within(deadline)
        return head

    def subscribe(self, from_position: int = 1) -> Subscription:
        self._live()
        return Subscription(self, from_position)

    def stream_version(self, stream: str) -> int:
        check_stream(stream)
        rows = self._db.fetch("read a stream's version", self._sql.stream_row, (stream,))
        return int(rows[0][0]) if rows else 0

    def lease_epoch(self, stream: str) -> int:
        check_stream(stream)
        rows = self._db.fetch("read a stream's lease epoch", self._sql.stream_row, (stream,))
        return int(rows[0][1]) if rows else 0

    def streams(self) -> list[StreamInfo]:
        rows = self._db.fetch("list the streams", self._sql.streams)
        return [
            StreamInfo(
                stream=stream,
                version=version,
                last_position=last_position,
                last_ts=last_ts,
                lease_epoch=epoch,
            )
            for stream, version, last_position, last_ts, epoch in rows
        ]

    # -- snapshots -----------------------------------------------------------------------------

    def put_snapshot(self, snapshot: Snapshot) -> None:
        self._writable()
        check_snapshot(snapshot)
        key = (snapshot.stream, snapshot.name)
        row = (*key, snapshot.version, snapshot.position, zlib.crc32(snapshot.data), snapshot.data)

        fold = fold_prefix(snapshot.name)

        def save(conn: psycopg.Connection[Any]) -> None:  # an upsert and a prune: safe twice
            with conn.transaction():
                conn.execute(self._sql.put_snapshot, row)
                conn.execute(self._sql.prune_snapshots, (*key, *key, SNAPSHOTS_KEPT))
                if fold is None:
                    return
                # the same fold's older versions: nothing that saves this one reads them
                found = conn.execute(
                    self._sql.fold_versions, (snapshot.stream, len(fold), fold)
                ).fetchall()
                older = [name for (name,) in found if superseded_by(snapshot.name, name)]
                if older:
                    conn.execute(self._sql.drop_snapshots, (snapshot.stream, older))

        self._db.again("save a snapshot", save)

    def snapshots(self, stream: str, name: str) -> Iterator[Snapshot]:
        check_stream(stream)
        try:
            check_snapshot_key(stream, name)
        except InvalidStreamError:  # a name no snapshot can be saved under: it has none
            return
        rows = self._db.fetch("read snapshots", self._sql.snapshots, (stream, name))
        for version, position, crc, data in rows:
            if zlib.crc32(data) != crc:
                log.warning(
                    "store.snapshot_corrupt",
                    stream=stream,
                    fold=name,
                    version=version,
                    reason="checksum mismatch",
                )
                continue
            yield Snapshot(stream=stream, name=name, version=version, position=position, data=data)

    # -- lifecycle -----------------------------------------------------------------------------

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            self._writer.close()
            self._bell.close()
            self._db.close()
        finally:
            self._unhide()

    def _unhide(self) -> None:
        hidden, self._hidden = self._hidden, ()
        for secret in hidden:  # once nothing of this handle can log any more
            unhide_secret(secret)

    def __enter__(self) -> PostgresEventStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
