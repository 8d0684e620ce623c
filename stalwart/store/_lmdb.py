"""The embedded event log: one LMDB environment directory, durable group commit.

Layout (sub-databases, integer keys big-endian so byte order is numeric order):

``log``        position -> encoded RecordedEvent (the record repeats its position)
``index``      stream + NUL + version -> position
``streams``    stream -> [version, last position, last ts]
``snapshots``  stream + NUL + fold name + NUL + version -> [position, crc32, data]
``meta``       b"format" -> format marker

All appends of a process go through one writer thread that takes every request waiting
in its queue and commits them in one durable transaction, so N concurrent appenders pay
about one fsync per batch. LMDB's own writer lock serializes writers across processes.
"""

from __future__ import annotations

import os
import queue
import threading
import zlib
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import lmdb
import msgspec
import structlog

from stalwart import ids
from stalwart.clock import Clock, SystemClock
from stalwart.errors import (
    ConcurrencyError,
    StoreClosedError,
    StoreError,
    StoreNotFoundError,
    UnknownEventTypeError,
)
from stalwart.events import DEFAULT_CODEC, Codec, Event, RecordedEvent

from ._protocol import NewEvent, Snapshot, StreamInfo, check_stream
from ._rwlock import SharedExclusiveLock
from ._subscription import Subscription

log = structlog.get_logger(__name__)

FORMAT = b"stalwart-lmdb-1"
DEFAULT_MAP_SIZE = 64 << 20
MAX_BATCH = 4096
READ_BATCH = 1024
SNAPSHOTS_KEPT = 3
_POS = 8


def _key(position: int) -> bytes:
    return position.to_bytes(_POS, "big")


class _Request:
    __slots__ = ("error", "events", "expected", "lock", "result", "stream", "stream_key")

    def __init__(
        self, stream: str, stream_key: bytes, events: list[NewEvent], expected: int | None
    ) -> None:
        self.stream = stream
        self.stream_key = stream_key
        self.events = events
        self.expected = expected
        self.result: list[RecordedEvent] = []
        self.error: BaseException | None = None
        self.lock = threading.Lock()
        self.lock.acquire()


_STOP = object()
_REAL_TIME = SystemClock()


class _Environment:
    """One open LMDB environment per directory per process, shared by every handle."""

    def __init__(self, path: str, *, map_size: int, codec: Codec, clock: Clock) -> None:
        self.path = path
        self.codec = codec
        self.clock = clock
        self.rw = SharedExclusiveLock()
        self.appended = threading.Condition()
        self.refs = 0
        self._resize_lock = threading.Lock()
        self.env = lmdb.open(
            path, map_size=map_size, max_dbs=8, subdir=True, sync=True, metasync=True
        )
        self.env.reader_check()
        with self.env.begin(write=True) as txn:
            self.log = self.env.open_db(b"log", txn=txn)
            self.index = self.env.open_db(b"index", txn=txn)
            self.stream_db = self.env.open_db(b"streams", txn=txn)
            self.snapshot_db = self.env.open_db(b"snapshots", txn=txn)
            self.meta = self.env.open_db(b"meta", txn=txn)
            marker = txn.get(b"format", db=self.meta)
            if marker is None:
                txn.put(b"format", FORMAT, db=self.meta)
            elif bytes(marker) != FORMAT:
                raise StoreError(
                    f"{path} holds store format {bytes(marker)!r}, this version reads {FORMAT!r}"
                )
        self._queue: queue.SimpleQueue[_Request | object] = queue.SimpleQueue()
        self._writer = threading.Thread(target=self._write_loop, name="stalwart-lmdb-writer")
        self._writer.daemon = True
        self._writer.start()
        self.closed = False

    # -- transactions under the resize lock --------------------------------------------------

    def run(self, fn: Callable[[Any], Any], *, write: bool = False) -> Any:
        """Run ``fn(txn)`` in a transaction, growing or re-adopting the map as needed."""
        while True:
            try:
                with self.rw.shared():
                    if self.closed:
                        raise StoreClosedError(f"the store at {self.path} is closed")
                    if write:
                        with self.env.begin(write=True) as txn:
                            return fn(txn)
                    with self.env.begin(buffers=True) as txn:
                        return fn(txn)
            except lmdb.MapFullError:
                self._resize(grow=True)
            except lmdb.MapResizedError:
                self._resize(grow=False)

    def _resize(self, *, grow: bool) -> None:
        with self.rw.exclusive():
            if grow:
                size = self.env.info()["map_size"] * 2
                log.info("store.map_grown", path=self.path, map_size=size)
                self.env.set_mapsize(size)
            else:
                self.env.set_mapsize(0)

    # -- the writer ----------------------------------------------------------------------------

    def submit(self, request: _Request) -> list[RecordedEvent]:
        if self.closed:
            raise StoreClosedError(f"the store at {self.path} is closed")
        self._queue.put(request)
        while not request.lock.acquire(timeout=1.0):
            if not self._writer.is_alive():
                raise StoreClosedError(f"the store at {self.path} closed during the append")
        if request.error is not None:
            raise request.error
        return request.result

    def _write_loop(self) -> None:
        get = self._queue.get
        get_nowait = self._queue.get_nowait
        while True:
            item = get()
            if item is _STOP:
                return
            batch: list[_Request] = [item]  # type: ignore[list-item]
            stop = False
            while len(batch) < MAX_BATCH:
                try:
                    more = get_nowait()
                except queue.Empty:
                    break
                if more is _STOP:
                    stop = True
                    break
                batch.append(more)  # type: ignore[arg-type]
            self._commit(batch)
            if stop:
                return

    def _commit(self, batch: list[_Request]) -> None:
        try:
            self.run(lambda txn: self._write_batch(txn, batch), write=True)
        except BaseException as exc:
            error = exc
            if not isinstance(exc, StoreError):
                error = StoreError(f"append to {self.path} failed: {type(exc).__name__}: {exc}")
                error.__cause__ = exc
            for request in batch:
                request.error = error
                request.result = []
        for request in batch:
            request.lock.release()
        with self.appended:
            self.appended.notify_all()

    def _write_batch(self, txn: Any, batch: list[_Request]) -> None:
        cursor = txn.cursor(db=self.log)
        position = int.from_bytes(cursor.key(), "big") if cursor.last() else 0
        encode = self.codec.encode
        schema_of = self.codec.schema_of
        for request in batch:
            request.error = None
            request.result = []
            raw = txn.get(request.stream_key, db=self.stream_db)
            version = msgspec.msgpack.decode(raw)[0] if raw is not None else 0
            if request.expected is not None and request.expected != version:
                request.error = ConcurrencyError(request.stream, request.expected, version)
                continue
            recorded = request.result
            now = self.clock.now()
            prefix = request.stream_key + b"\x00"
            for new in request.events:
                position += 1
                version += 1
                record = RecordedEvent(
                    position=position,
                    stream=request.stream,
                    version=version,
                    ts=now if new.ts is None else new.ts,
                    id=new.id or ids.new_id(),
                    causation_id=new.causation_id,
                    correlation_id=new.correlation_id,
                    schema=schema_of(new.event),
                    event=new.event,
                )
                key = _key(position)
                txn.put(key, encode(record), db=self.log, append=True)
                txn.put(prefix + _key(version), key, db=self.index)
                recorded.append(record)
            last = recorded[-1]
            txn.put(
                request.stream_key,
                msgspec.msgpack.encode((version, position, last.ts)),
                db=self.stream_db,
            )

    def close(self) -> None:
        if self.closed:
            return
        self._queue.put(_STOP)
        self._writer.join()
        with self.rw.exclusive():
            self.closed = True
            self.env.close()
        with self.appended:
            self.appended.notify_all()


_ENVS: dict[str, _Environment] = {}
_ENVS_LOCK = threading.Lock()


def _forget_after_fork() -> None:
    # LMDB forbids using a parent's environment in a forked child: start clean there.
    _ENVS.clear()
    if _ENVS_LOCK.locked():
        _ENVS_LOCK.release()


os.register_at_fork(after_in_child=_forget_after_fork)


class LmdbEventStore:
    """The embedded EventStore on one LMDB directory. Safe to share between threads.

    Opening the same directory twice in one process shares one environment and one
    writer (LMDB forbids two environments on one file in a process).
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
    ) -> None:
        path = os.path.abspath(os.fspath(path))
        if not create and not os.path.exists(os.path.join(path, "data.mdb")):
            raise StoreNotFoundError(f"no stalwart store at {path}")
        if os.path.exists(path) and not os.path.isdir(path):
            raise StoreError(f"{path} is a file; a store is a directory")
        self._path = path
        self._poll_interval = poll_interval
        with _ENVS_LOCK:
            shared = _ENVS.get(path)
            if shared is None or shared.closed:
                os.makedirs(path, exist_ok=True)
                try:
                    shared = _Environment(
                        path, map_size=map_size, codec=codec, clock=clock or SystemClock()
                    )
                except lmdb.Error as exc:
                    raise StoreError(f"cannot open the store at {path}: {exc}") from exc
                _ENVS[path] = shared
            shared.refs += 1
        self._env = shared
        self._closed = False

    @property
    def location(self) -> str:
        return self._path

    def __repr__(self) -> str:
        return f"LmdbEventStore({self._path!r})"

    def _live(self) -> _Environment:
        if self._closed:
            raise StoreClosedError(f"the store at {self._path} is closed")
        return self._env

    # -- writing -------------------------------------------------------------------------------

    def append(
        self,
        stream: str,
        events: Sequence[Event | NewEvent],
        expected_version: int | None = None,
    ) -> list[RecordedEvent]:
        env = self._live()
        stream_key = check_stream(stream)
        news = [e if isinstance(e, NewEvent) else NewEvent(event=e) for e in events]
        codec = env.codec
        for new in news:
            if not codec.knows(new.event):
                raise UnknownEventTypeError(
                    f"cannot append {type(new.event).__qualname__}: "
                    "not an event this version writes"
                )
        if not news:
            version = self.stream_version(stream)
            if expected_version is not None and expected_version != version:
                raise ConcurrencyError(stream, expected_version, version)
            return []
        return env.submit(_Request(stream, stream_key, news, expected_version))

    # -- reading -------------------------------------------------------------------------------

    def read_all(
        self, from_position: int = 1, to_position: int | None = None
    ) -> Iterator[RecordedEvent]:
        env = self._live()
        position = max(1, from_position)
        decode = env.codec.decode
        last = to_position if to_position is not None else (1 << 64) - 1

        def chunk(txn: Any) -> list[RecordedEvent]:
            cursor = txn.cursor(db=env.log)
            out: list[RecordedEvent] = []
            if not cursor.set_range(_key(position)):
                return out
            for key, value in cursor.iternext():
                record = decode(value, int.from_bytes(key, "big"))
                if record.position > last:
                    break
                out.append(record)
                if len(out) >= READ_BATCH:
                    break
            return out

        while position <= last:
            records: list[RecordedEvent] = env.run(chunk)
            yield from records
            if len(records) < READ_BATCH:
                return
            position = records[-1].position + 1

    def read_stream(
        self, stream: str, from_version: int = 1, to_version: int | None = None
    ) -> Iterator[RecordedEvent]:
        env = self._live()
        prefix = check_stream(stream) + b"\x00"
        version = max(1, from_version)
        last = to_version if to_version is not None else (1 << 64) - 1
        decode = env.codec.decode

        def chunk(txn: Any) -> list[RecordedEvent]:
            cursor = txn.cursor(db=env.index)
            out: list[RecordedEvent] = []
            if not cursor.set_range(prefix + _key(version)):
                return out
            for key, pos in cursor.iternext():
                if bytes(key[: len(prefix)]) != prefix:
                    break
                if int.from_bytes(key[len(prefix) :], "big") > last:
                    break
                position_key = bytes(pos)
                value = txn.get(position_key, db=env.log)
                out.append(decode(value, int.from_bytes(position_key, "big")))
                if len(out) >= READ_BATCH:
                    break
            return out

        while version <= last:
            records: list[RecordedEvent] = env.run(chunk)
            yield from records
            if len(records) < READ_BATCH:
                return
            version = records[-1].version + 1

    def head(self) -> int:
        env = self._live()

        def last(txn: Any) -> int:
            cursor = txn.cursor(db=env.log)
            return int.from_bytes(cursor.key(), "big") if cursor.last() else 0

        result: int = env.run(last)
        return result

    def wait_for(self, position: int, timeout: float | None) -> int:
        env = self._live()
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
                env.appended.wait(wait)
            if env.closed:
                raise StoreClosedError(f"the store at {self._path} is closed")
            head = self.head()
        return head

    def subscribe(self, from_position: int = 1) -> Subscription:
        self._live()
        return Subscription(self, from_position)

    def stream_version(self, stream: str) -> int:
        env = self._live()
        key = check_stream(stream)

        def get(txn: Any) -> int:
            raw = txn.get(key, db=env.stream_db)
            return int(msgspec.msgpack.decode(raw)[0]) if raw is not None else 0

        result: int = env.run(get)
        return result

    def streams(self) -> list[StreamInfo]:
        env = self._live()

        def scan(txn: Any) -> list[StreamInfo]:
            out = []
            for key, raw in txn.cursor(db=env.stream_db):
                version, last_position, last_ts = msgspec.msgpack.decode(raw)
                out.append(
                    StreamInfo(
                        stream=bytes(key).decode("utf-8"),
                        version=version,
                        last_position=last_position,
                        last_ts=last_ts,
                    )
                )
            return out

        result: list[StreamInfo] = env.run(scan)
        return result

    # -- snapshots -----------------------------------------------------------------------------

    def put_snapshot(self, snapshot: Snapshot) -> None:
        env = self._live()
        prefix = check_stream(snapshot.stream) + b"\x00" + snapshot.name.encode() + b"\x00"
        value = msgspec.msgpack.encode(
            (snapshot.position, zlib.crc32(snapshot.data), snapshot.data)
        )

        def put(txn: Any) -> None:
            txn.put(prefix + _key(snapshot.version), value, db=env.snapshot_db)
            cursor = txn.cursor(db=env.snapshot_db)
            keys = []
            if cursor.set_range(prefix):
                for key in cursor.iternext(values=False):
                    if not bytes(key).startswith(prefix):
                        break
                    keys.append(bytes(key))
            for key in keys[:-SNAPSHOTS_KEPT]:
                txn.delete(key, db=env.snapshot_db)

        env.run(put, write=True)

    def snapshots(self, stream: str, name: str) -> Iterator[Snapshot]:
        env = self._live()
        prefix = check_stream(stream) + b"\x00" + name.encode() + b"\x00"

        def scan(txn: Any) -> list[tuple[bytes, bytes]]:
            cursor = txn.cursor(db=env.snapshot_db)
            found = []
            if cursor.set_range(prefix):
                for key, value in cursor.iternext():
                    if not bytes(key).startswith(prefix):
                        break
                    found.append((bytes(key), bytes(value)))
            return found

        entries: list[tuple[bytes, bytes]] = env.run(scan)
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
        with _ENVS_LOCK:
            self._env.refs -= 1
            last = self._env.refs <= 0
            if last and _ENVS.get(self._path) is self._env:
                del _ENVS[self._path]
        if last:
            self._env.close()

    def __enter__(self) -> LmdbEventStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
