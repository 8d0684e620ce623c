"""The embedded event log: one LMDB environment directory, durable group commit.

Layout (sub-databases, integer keys big-endian so byte order is numeric order):

``log``        position -> encoded RecordedEvent (the record repeats its position)
``index``      stream + NUL + version -> position, for every record up to ``indexed``
``streams``    stream -> [version, last position, last ts, lease epoch]
``snapshots``  stream + NUL + fold name + NUL + version -> [position, crc32, data]
``meta``       b"format" -> format marker; b"indexed" -> how far the index reaches
``due``        session stream -> its due time and hold: the work queue (``_lmdb_due``)
``due-times``  due time + session stream -> b"": the work queue's rows in due-time order

The environment and its single group-committing writer live in ``_environment``; this
module is the store's face: appends handed to the writer, and the read paths.
"""

from __future__ import annotations

import os
import zlib
from collections.abc import Callable, Iterator, Sequence
from itertools import islice
from typing import Any

import lmdb
import msgspec

from stalwart._logs import get_logger
from stalwart.clock import Clock, SystemClock
from stalwart.errors import (
    CorruptRecordError,
    InvalidStreamError,
    StoreClosedError,
    StoreError,
    StoreNotFoundError,
    StoreReadOnlyError,
)
from stalwart.events import DEFAULT_CODEC, Codec, Event, RecordedEvent

from ._environment import (
    _ENVS,
    _ENVS_LOCK,
    _REAL_TIME,
    _VALUE,
    DEFAULT_MAP_SIZE,
    INDEX_LAG,
    READ_BATCH,
    _Append,
    _at_key,
    _Chunk,
    _Environment,
    _key,
    _PutSnapshot,
    decode_stream_row,
    stream_row,
)
from ._lmdb_due import SESSION_PREFIX, ClaimDue, DueAppend, SetDue, due_db
from ._lmdb_tail import log_head, scan_heads
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
)
from ._records import Batches, Records
from ._subscription import Subscription

log = get_logger(__name__)


_LAST_VERSION = (1 << 64) - 2  # so that the key of the version after it still fits
_LAST_POSITION = (1 << 64) - 1  # the largest a log key holds
#: How long opening a store waits for this process's last handle of it to finish closing
#: (its writer ends the batch it is in, which may wait on another process's write lock).
CLOSING_WAIT_S = 60.0


def _stream_chunk(
    env: _Environment, codec: Codec, txn: Any, stream: str, prefix: bytes, first: int, last: int
) -> _Chunk:
    """Up to READ_BATCH records of one stream, versions ``first``..``last``, in order:
    those the index reaches, then those in the log after its mark (fewer than INDEX_LAG
    records, unless indexing stalled at a damaged one)."""
    out, error = _indexed_chunk(env, codec, txn, (stream, prefix), first, last)
    if error is not None or len(out) >= READ_BATCH:
        return out, error
    if out:
        first = out[-1].version + 1
    if first > last:
        return out, None
    raw = txn.get(prefix[:-1], db=env.stream_db)
    if raw is None:
        return out, None
    version, end = decode_stream_row(prefix[:-1], raw)[:2]
    indexed = env.indexed(txn)
    if version < first or end <= indexed:
        return out, None
    last = min(last, version, first + READ_BATCH - len(out) - 1)  # a chunk at a time
    tail = env.tail
    if tail is None or tail.indexed != indexed or tail.head < end:
        tail = env.tail_for(txn, indexed, end)
    if tail is not None:
        positions = tail.positions(prefix[:-1], first, last)
        return out, _known_chunk(env, codec, txn, (stream, first, last, end), positions, out)
    return out, _tail_chunk(env, codec, txn, stream, (indexed, end), first, last, out)


def _before_hole(out: list[RecordedEvent], first: int) -> _Chunk:
    """The records of a run read from position ``first`` that come before the first
    position missing among them (a record deleted by hand), and that hole as the error:
    a hole is damage, not an end, and never moves the end of a range."""
    missing = next(n for n, record in enumerate(out, first) if record.position != n)
    after = out[missing - first].position  # the record after the hole
    error = CorruptRecordError(missing, "it is missing from the log", through=after - 1)
    return out[: missing - first], error


def _known_chunk(
    env: _Environment,
    codec: Codec,
    txn: Any,
    span: tuple[str, int, int, int],
    positions: list[int],
    out: list[RecordedEvent],
) -> CorruptRecordError | None:
    """Add to ``out`` the records at ``positions``, which the tail of this process says
    are the stream's versions ``first``..``last`` after the index mark (``span``: the
    stream, those two, and the stream's last position)."""
    stream, first, last, end = span
    keys = [_key(position) for position in positions]
    values = _log_values(env, txn, keys)
    before = len(out)
    error = codec.decode_batch(values, out)
    if (misplaced := _misplaced(out, before, stream, first, positions.__getitem__)) is not None:
        return misplaced
    if error is not None:
        return _at_key(error, keys[len(out) - before])
    if len(values) < len(keys):
        return CorruptRecordError(positions[len(values)], "missing from the log")
    if len(positions) < last - first + 1:
        due = first + len(positions)
        return CorruptRecordError(end, f"version {due} of {stream!r} is missing from the log")
    return None


def _misplaced(
    out: list[RecordedEvent], start: int, stream: str, first: int, stored: Callable[[int], int]
) -> CorruptRecordError | None:
    """Where the records ``out[start:]``, read as ``stream``'s versions from ``first`` on,
    are not those versions (a damaged head, or an index or tail that lost track of one):
    that record and its successors are taken off ``out``, and it is the error, named by
    the position it is stored at (``stored(i)``, of the i-th record read). Only the two
    ends are checked, unless they do not match: a lost or shifted entry moves the end, but
    a record damaged in place between two good ends is not caught here (the log's walk,
    ``stalwart db check``, does)."""
    count = len(out) - start
    if count == 0:
        return None
    head, tail = out[start], out[-1]
    if head.stream == stream == tail.stream and (head.version, tail.version) == (
        first,
        first + count - 1,
    ):
        return None
    for index in range(start, len(out)):
        record, due = out[index], first + index - start
        if record.stream != stream or record.version != due:
            del out[index:]
            return CorruptRecordError(
                stored(index - start),
                f"found as version {due} of {stream!r}, it holds version {record.version}"
                f" of {record.stream!r}",
            )
    return None  # pragma: no cover - the ends differ, so one record does


def _tail_chunk(
    env: _Environment,
    codec: Codec,
    txn: Any,
    stream: str,
    span: tuple[int, int],
    first: int,
    last: int,
    out: list[RecordedEvent],
) -> CorruptRecordError | None:
    """Add to ``out`` the stream's records ``first``..``last`` from the unindexed log
    positions in ``span`` (after its first, up to its last), reading only each record's
    head to pick them. A record that cannot be read, or a missing position, is the error
    only when one of the stream's versions is missing after it."""
    indexed, end = span
    keys: list[bytes] = []
    values: list[bytes] = []
    want = first
    trouble: tuple[int, str] | None = None  # since the last of the stream's records
    for position, value, head in scan_heads(txn.cursor(db=env.log), indexed, end):
        if isinstance(head, str):
            trouble = trouble or (position, head)
            continue
        if head.stream != stream or head.version < want:
            continue
        if head.version > want:
            trouble = trouble or (position, f"holds version {head.version}, {want} was due")
            break
        assert value is not None  # a head was read from it
        keys.append(_key(position))
        values.append(value)
        trouble = None
        want += 1
        if want > last:
            break
    if want <= last and trouble is None:
        trouble = (end, f"version {want} of {stream!r} is missing from the log")
    before = len(out)
    error = codec.decode_batch(values, out)
    if error is not None:
        return _at_key(error, keys[len(out) - before])
    return None if want > last else CorruptRecordError(*trouble)  # type: ignore[misc]


def _indexed_chunk(
    env: _Environment, codec: Codec, txn: Any, key: tuple[str, bytes], first: int, last: int
) -> _Chunk:
    """Up to READ_BATCH records of one stream, versions ``first``..``last``, that the
    index reaches.

    A stream's versions have no gaps, so two index lookups give a batch's first and last
    entries. When the batch's records lie side by side in the log (a stream appended in
    runs), one log cursor walks them; otherwise one ``getmulti`` fetches them by position.
    Either way the values are decoded as one batch.
    """
    stream, prefix = key
    index = txn.cursor(db=env.index)
    out: list[RecordedEvent] = []
    if not index.set_range(prefix + _key(first)):
        return out, None
    low_key, low_pos = index.item()
    cut = len(prefix)
    if low_key[:cut] != prefix or (low := int.from_bytes(low_key[cut:], "big")) > last:
        return out, None
    # the stream's last entry at or below the batch's end
    if index.set_range(prefix + _key(min(last, low + READ_BATCH - 1) + 1)):
        index.prev()
    else:
        index.last()
    count = int.from_bytes(index.key()[cut:], "big") - low + 1
    start = int.from_bytes(low_pos, "big")
    keys: list[bytes] | None = None
    values = None
    if int.from_bytes(index.value(), "big") - start == count - 1:
        values = _log_run(env, txn, start, count)
    if values is None:
        index.set_key(low_key)
        keys = list(islice(index.iternext(keys=False), count))
        values = _log_values(env, txn, keys)
    error = codec.decode_batch(values, out)
    read_at = keys

    def stored(i: int) -> int:
        return start + i if read_at is None else int.from_bytes(read_at[i], "big")

    if (misplaced := _misplaced(out, 0, stream, first, stored)) is not None:
        return out, misplaced
    if error is None and len(values) < count:
        error = CorruptRecordError(-1, "indexed but missing from the log")
    if error is not None:  # the record at len(out) is corrupt or missing
        return out, _at_key(error, _key(start + len(out)) if keys is None else keys[len(out)])
    return out, None


def _log_run(env: _Environment, txn: Any, start: int, count: int) -> list[bytes] | None:
    """The ``count`` records from position ``start`` on, or None if the log has a gap."""
    cursor = txn.cursor(db=env.log)
    if not cursor.set_key(_key(start)):
        return None
    values = list(islice(cursor.iternext(keys=False), count))
    end = start + len(values) - 1
    return values if int.from_bytes(cursor.key(), "big") == end else None


def _log_values(env: _Environment, txn: Any, keys: list[bytes]) -> list[bytes]:
    """The records at ``keys``, up to (not including) the first one the log lacks."""
    pairs = txn.cursor(db=env.log).getmulti(keys)
    values: list[bytes] = list(map(_VALUE, pairs))
    if len(pairs) < len(keys):
        found = (i for i, (key, _) in enumerate(pairs) if key != keys[i])
        del values[next(found, len(pairs)) :]
    return values


def _make_directory(path: str) -> None:
    try:
        os.makedirs(path, exist_ok=True)
    except OSError as exc:  # a file in the way, no permission, a read-only disk
        reason = exc.strerror or type(exc).__name__
        raise StoreError(f"cannot create the store at {path}: {reason}") from exc


class LmdbEventStore:
    """The embedded EventStore on one LMDB directory. Safe to share between threads.

    Opening the same directory twice in one process shares one environment and one
    writer (LMDB forbids two environments on one file in a process). ``read_only=True``
    (with ``create=False``; what the CLI's read commands use) opens it without writing
    anything: a store on a read-only mount can be read, an older store format is read
    as it is instead of being upgraded, and every write raises StoreReadOnlyError.
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        create: bool = True,
        map_size: int = DEFAULT_MAP_SIZE,
        codec: Codec = DEFAULT_CODEC,
        clock: Clock | None = None,
        poll_interval: float = 0.01,
        read_only: bool = False,
        snapshot_every: int = DEFAULT_SNAPSHOT_EVERY,
    ) -> None:
        path = os.fspath(path)
        if "\x00" in path:  # no file system names one (and os calls raise ValueError)
            raise StoreError("a store path cannot hold a NUL character")
        path = os.path.abspath(path)
        create = create and not read_only
        if not create and not os.path.exists(os.path.join(path, "data.mdb")):
            raise StoreNotFoundError(f"no stalwart store at {path}")
        if os.path.exists(path) and not os.path.isdir(path):
            raise StoreError(f"{path} is a file; a store is a directory")
        self._path = path
        self._snapshot_every = check_snapshot_every(snapshot_every)
        self._poll_interval = poll_interval
        # this handle's, even when the environment is shared with an earlier handle
        self._codec = codec
        self._clock = clock or SystemClock()
        self._read_only = read_only
        # one environment per directory however it is spelled (a symlink, a relative path):
        # LMDB refuses a second one of the same file in a process
        self._key = key = os.path.realpath(path)
        while True:
            with _ENVS_LOCK:
                shared = _ENVS.get(key)
                if shared is None or not shared.closing:
                    try:
                        if shared is None or shared.closed:
                            if not read_only:
                                _make_directory(path)
                            shared = _Environment(
                                path,
                                map_size=map_size,
                                codec=codec,
                                clock=self._clock,
                                read_only=read_only,
                            )
                            _ENVS[key] = shared
                        elif shared.read_only and not read_only:
                            shared.make_writable()
                    except lmdb.Error as exc:
                        raise StoreError(f"cannot open the store at {path}: {exc}") from exc
                    shared.refs += 1
                    break
            # its last handle is closing it (its writer may wait on another process's
            # write lock): a second environment of the file could not open meanwhile
            if not shared.gone.wait(CLOSING_WAIT_S):
                raise StoreError(f"cannot open the store at {path}: it is still closing")
        self._env = shared
        self._closed = False

    @property
    def location(self) -> str:
        return self._path

    @property
    def snapshot_every(self) -> int:
        return self._snapshot_every

    def __repr__(self) -> str:
        return f"LmdbEventStore({self._path!r})"

    def _live(self) -> _Environment:
        if self._closed:
            raise StoreClosedError(f"the store at {self._path} is closed")
        return self._env

    def _writable(self) -> _Environment:
        env = self._live()
        if self._read_only:
            raise StoreReadOnlyError(f"the store at {self._path} was opened read-only")
        return env

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
        env = self._writable()
        stream_key = check_stream(stream)
        news = checked_events(self, self._codec, stream, events, expected_version, fence, due)
        if not news:
            return []
        args = (stream, stream_key, news, expected_version, fence, self._codec, self._clock)
        if due is not None or stream_key.startswith(SESSION_PREFIX):
            job: _Append = DueAppend(*args, due=due, db=due_db(env))
        else:
            job = _Append(*args)
        recorded: list[RecordedEvent] = env.submit(job)
        return recorded

    # -- the work queue (WorkQueue) -------------------------------------------------------------

    def claim_due(self, owner: str, now: float, limit: int, hold_s: float) -> DueWork:
        env = self._writable()
        check_claim(now, limit, hold_s)
        work: DueWork = env.submit(ClaimDue(due_db(env), owner, now, limit, hold_s))
        return work

    def set_due(self, stream: str, version: int, at: float | None, owner: str) -> bool:
        env = self._writable()
        at = check_due_time(at)
        done: bool = env.submit(SetDue(due_db(env), check_stream(stream), version, at, owner))
        return done

    # -- reading -------------------------------------------------------------------------------

    def read_all(self, from_position: int = 1, to_position: int | None = None) -> Records:
        return Records(self._log_batches(from_position, to_position))

    def _log_batches(self, from_position: int, to_position: int | None) -> Batches:
        env = self._live()
        position = max(1, from_position)
        decode_many = self._codec.decode_many
        last = _LAST_POSITION if to_position is None else min(to_position, _LAST_POSITION)

        def chunk(txn: Any) -> _Chunk:
            cursor = txn.cursor(db=env.log)
            out: list[RecordedEvent] = []
            if not cursor.set_range(_key(position)):
                return out, None
            want = min(READ_BATCH, last - position + 1)
            error = decode_many(cursor.iternext(keys=False), out, want)
            if out and out[-1].position != position + len(out) - 1:  # a hole in the log
                return _before_hole(out, position)
            return out, None if error is None else _at_key(error, cursor.key())

        while position <= last:
            records, error = env.read(chunk)
            yield records
            if error is not None:
                raise error  # after every good record before it
            if len(records) < READ_BATCH:
                return
            position = records[-1].position + 1

    def read_stream(
        self, stream: str, from_version: int = 1, to_version: int | None = None
    ) -> Records:
        return Records(self._stream_batches(stream, from_version, to_version))

    def _stream_batches(self, stream: str, from_version: int, to_version: int | None) -> Batches:
        env = self._live()
        codec = self._codec
        prefix = check_stream(stream) + b"\x00"
        version = max(1, from_version)
        last = _LAST_VERSION if to_version is None else min(to_version, _LAST_VERSION)

        def chunk(txn: Any) -> _Chunk:
            return _stream_chunk(env, codec, txn, stream, prefix, version, last)

        while version <= last:
            records, error = env.read(chunk)
            yield records
            if error is not None:
                raise error  # after every good record before it
            if len(records) < READ_BATCH:
                return
            version = records[-1].version + 1

    def head(self) -> int:
        env = self._live()

        return env.read(lambda txn: log_head(txn.cursor(db=env.log)))

    def wait_for(self, position: int, timeout: float | None) -> int:
        env = self._live()
        seen = env.commits  # read before the head: a commit after it is not waited past
        head = self.head()
        if head >= position or timeout == 0:
            return head
        # waiting on I/O is measured in real time: a fake clock does not move while we wait
        clock = _REAL_TIME
        deadline = None if timeout is None else clock.monotonic() + timeout
        while head < position:
            wait = self._poll_interval
            if deadline is not None:
                remaining = deadline - clock.monotonic()
                if remaining <= 0:
                    break
                wait = min(wait, remaining)
            with env.appended:
                if env.commits == seen:  # else this process committed since the head read
                    env.appended.wait(wait)
                seen = env.commits
            if env.closed:
                raise env.closed_error()
            head = self.head()
        return head

    def subscribe(self, from_position: int = 1) -> Subscription:
        self._live()
        return Subscription(self, from_position)

    def describe(self) -> dict[str, int | str]:
        """The store's format, its head, and how far its index reaches (``indexed``;
        ``index_lag``: an append indexes once ``head - indexed`` would reach it)."""
        env = self._live()

        def read(txn: Any) -> dict[str, int | str]:
            head = log_head(txn.cursor(db=env.log))
            marker = txn.get(b"format", db=env.meta)
            return {
                "format": bytes(marker).decode() if marker is not None else "",
                "head": head,
                "indexed": env.indexed(txn),
                "index_lag": INDEX_LAG,
            }

        return env.read(read)

    def stream_version(self, stream: str) -> int:
        env = self._live()
        key = check_stream(stream)

        def get(txn: Any) -> int:
            return stream_row(txn.get(key, db=env.stream_db), key)[0]

        return env.read(get)

    def lease_epoch(self, stream: str) -> int:
        env = self._live()
        key = check_stream(stream)
        return env.read(lambda txn: stream_row(txn.get(key, db=env.stream_db), key)[1])

    def streams(self) -> list[StreamInfo]:
        rows, damaged = self.stream_rows()
        for error in damaged.values():
            raise error
        return rows

    def stream_rows(self) -> tuple[list[StreamInfo], dict[str, StoreError]]:
        """Every stream's row that can be read, and the error of each that cannot (by
        stream name): what ``stalwart db check`` reports instead of stopping at one."""
        env = self._live()

        def scan(txn: Any) -> tuple[list[StreamInfo], dict[str, StoreError]]:
            out, damaged = [], {}
            for key, raw in txn.cursor(db=env.stream_db):
                name = bytes(key).decode("utf-8", "backslashreplace")
                try:
                    version, last_position, last_ts, *rest = decode_stream_row(bytes(key), raw)
                except StoreError as exc:
                    damaged[name] = exc
                    continue
                out.append(
                    StreamInfo(
                        stream=name,
                        version=version,
                        last_position=last_position,
                        last_ts=last_ts,
                        lease_epoch=rest[0] if rest else 0,
                    )
                )
            return out, damaged

        return env.read(scan)

    # -- snapshots -----------------------------------------------------------------------------

    def put_snapshot(self, snapshot: Snapshot) -> None:
        env = self._writable()
        prefix = check_snapshot(snapshot)
        value = msgspec.msgpack.encode(
            (snapshot.position, zlib.crc32(snapshot.data), snapshot.data)
        )
        env.submit(_PutSnapshot(prefix, snapshot.version, value))

    def snapshots(self, stream: str, name: str) -> Iterator[Snapshot]:
        env = self._live()
        check_stream(stream)
        try:
            prefix = check_snapshot_key(stream, name)
        except InvalidStreamError:  # a name no snapshot can be saved under: it has none
            return

        def scan(txn: Any) -> list[tuple[bytes, bytes]]:
            cursor = txn.cursor(db=env.snapshot_db)
            found = []
            if cursor.set_range(prefix):
                for key, value in cursor.iternext():
                    if not bytes(key).startswith(prefix):
                        break
                    found.append((bytes(key), bytes(value)))
            return found

        entries = env.read(scan)
        for key, value in reversed(entries):
            version = int.from_bytes(key[len(prefix) :], "big")
            try:
                position, crc, data = msgspec.msgpack.decode(value)
                if not isinstance(data, bytes) or zlib.crc32(data) != crc:
                    raise ValueError("checksum mismatch")
            except (msgspec.DecodeError, ValueError, TypeError) as exc:
                log.warning(
                    "store.snapshot_corrupt",
                    stream=stream,
                    fold=name,
                    version=version,
                    reason=str(exc),
                )
                continue
            yield Snapshot(stream=stream, name=name, version=version, position=position, data=data)

    # -- lifecycle -----------------------------------------------------------------------------

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        env = self._env
        with _ENVS_LOCK:
            env.refs -= 1
            last = env.refs <= 0
            env.closing = last
        if not last:
            return
        try:
            env.close()
        finally:
            with _ENVS_LOCK:
                if _ENVS.get(self._key) is env:
                    del _ENVS[self._key]
            env.gone.set()

    def __enter__(self) -> LmdbEventStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
