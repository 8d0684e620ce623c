"""The LMDB environment of one store directory: its sub-databases and its single writer.

All appends of a process go through one writer thread that takes every request waiting
in its queue and commits them in one durable transaction, so N concurrent appenders pay
about one fsync per batch. LMDB's own writer lock serializes writers across processes.
One environment per directory per process is shared by every handle (LMDB forbids two
on one file in a process); a forked child starts without the parent's.
"""

from __future__ import annotations

import abc
import os
import queue
import threading
from collections.abc import Callable
from operator import itemgetter
from typing import Any, TypeVar

import lmdb
import msgspec
import structlog

from stalwart import ids
from stalwart.clock import Clock, SystemClock
from stalwart.errors import (
    ConcurrencyError,
    CorruptRecordError,
    EventError,
    FencedError,
    StoreClosedError,
    StoreError,
)
from stalwart.events import Codec, RecordedEvent

from ._protocol import Fence, NewEvent
from ._rwlock import SharedExclusiveLock

log = structlog.get_logger(__name__)

FORMAT = b"stalwart-lmdb-1"
DEFAULT_MAP_SIZE = 64 << 20
MAX_BATCH = 4096
READ_BATCH = 1024
SNAPSHOTS_KEPT = 3
#: LMDB's reader table (shared by every process on the store), and this process's share.
MAX_READERS = 1024
READERS_PER_PROCESS = 128
_POS = 8


def _key(position: int) -> bytes:
    return position.to_bytes(_POS, "big")


def _at_key(exc: CorruptRecordError, key: bytes | memoryview) -> CorruptRecordError:
    """The same error, naming the position the record is stored at."""
    return CorruptRecordError(int.from_bytes(key, "big"), exc.reason)


class _Job(abc.ABC):
    """A unit of work for the writer thread; the caller waits on ``lock``."""

    __slots__ = ("error", "lock", "result")

    def __init__(self) -> None:
        self.result: Any = None
        self.error: BaseException | None = None
        self.lock = threading.Lock()
        self.lock.acquire()

    @abc.abstractmethod
    def run(self, env: _Environment, txn: Any, head: list[int]) -> None:
        """Do the job inside the batch's write transaction; ``head`` is the last position."""


class _Append(_Job):
    __slots__ = ("events", "expected", "fence", "stream", "stream_key")

    def __init__(
        self,
        stream: str,
        stream_key: bytes,
        events: list[NewEvent],
        expected: int | None,
        fence: Fence | None = None,
    ) -> None:
        super().__init__()
        self.stream = stream
        self.stream_key = stream_key
        self.events = events
        self.expected = expected
        self.fence = fence

    def run(self, env: _Environment, txn: Any, head: list[int]) -> None:
        env.append_in(txn, self, head)


class _PutSnapshot(_Job):
    __slots__ = ("prefix", "value", "version")

    def __init__(self, prefix: bytes, version: int, value: bytes) -> None:
        super().__init__()
        self.prefix = prefix
        self.version = version
        self.value = value

    def run(self, env: _Environment, txn: Any, head: list[int]) -> None:
        prefix = self.prefix
        txn.put(prefix + _key(self.version), self.value, db=env.snapshot_db)
        cursor = txn.cursor(db=env.snapshot_db)
        keys = []
        if cursor.set_range(prefix):
            for key in cursor.iternext(values=False):
                if not bytes(key).startswith(prefix):
                    break
                keys.append(bytes(key))
        for key in keys[:-SNAPSHOTS_KEPT]:
            txn.delete(key, db=env.snapshot_db)


_T = TypeVar("_T")
_Chunk = tuple[list[RecordedEvent], CorruptRecordError | None]
_STOP = object()
_VALUE = itemgetter(1)
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
            path,
            map_size=map_size,
            max_dbs=8,
            max_readers=MAX_READERS,
            subdir=True,
            sync=True,
            metasync=True,
        )
        # at most this many read transactions of this process at once; more wait their
        # turn instead of failing with "reader table full" (a thousand actors may read)
        self._read_slots = threading.BoundedSemaphore(READERS_PER_PROCESS)
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
        self._queue: queue.SimpleQueue[_Job | object] = queue.SimpleQueue()
        self._writer = threading.Thread(target=self._write_loop, name="stalwart-lmdb-writer")
        self._writer.daemon = True
        self._writer.start()
        self.closed = False

    # -- transactions under the resize lock --------------------------------------------------

    def read(self, fn: Callable[[Any], _T]) -> _T:
        """Run ``fn(txn)`` in a read transaction (values are bytes: msgspec decodes bytes
        faster than memoryviews, and they stay valid after the transaction)."""
        while True:
            try:
                with self._read_slots, self.rw.shared():
                    if self.closed:
                        raise StoreClosedError(f"the store at {self.path} is closed")
                    with self.env.begin() as txn:
                        return fn(txn)
            except lmdb.MapResizedError:
                self._resize(grow=False, failed=None)
            except lmdb.ReadersFullError as exc:
                self._reap_dead_readers(exc)

    def _reap_dead_readers(self, exc: lmdb.Error) -> None:
        """Free the reader slots of processes that died inside a read transaction.

        LMDB frees them only when asked (or when a process opens the store while nobody
        else has it open), so processes killed mid-read would fill the reader table and
        refuse every new reader, here and in every process that opens the store.
        """
        with self.rw.shared():
            if self.closed:
                raise StoreClosedError(f"the store at {self.path} is closed")
            reaped = self.env.reader_check()
            slots = self.env.max_readers()
        if not reaped:
            raise StoreError(
                f"cannot read the store at {self.path}: all {slots} reader slots "
                "are held by live processes"
            ) from exc
        log.warning("store.dead_readers_reaped", path=self.path, count=reaped)

    def _write(self, fn: Callable[[Any], None]) -> None:
        """Run ``fn(txn)`` in a durable write transaction. Only the writer thread writes.

        A transaction that fails is aborted while no reader is active: py-lmdb >= 2.1
        drains in-flight operations on abort, which never ends under steady readers.
        """
        while True:
            failed: Any = None
            error: BaseException | None = None
            with self.rw.shared():
                if self.closed:
                    raise StoreClosedError(f"the store at {self.path} is closed")
                try:
                    txn = self.env.begin(write=True)
                except lmdb.MapResizedError:
                    txn = None
                if txn is not None:
                    try:
                        fn(txn)
                        txn.commit()
                        return
                    except BaseException as exc:
                        failed, error = txn, exc
            if isinstance(error, lmdb.MapFullError):
                self._resize(grow=True, failed=failed)
            elif error is None:
                self._resize(grow=False, failed=None)
            else:
                with self.rw.exclusive():
                    failed.abort()
                raise error

    def _resize(self, *, grow: bool, failed: Any) -> None:
        with self.rw.exclusive():
            if failed is not None:
                failed.abort()
            if grow:
                size = self.env.info()["map_size"] * 2
                log.info("store.map_grown", path=self.path, map_size=size)
                self.env.set_mapsize(size)
            else:
                self.env.set_mapsize(0)

    # -- the writer ----------------------------------------------------------------------------

    def submit(self, job: _Job) -> Any:
        if self.closed:
            raise StoreClosedError(f"the store at {self.path} is closed")
        self._queue.put(job)
        while not job.lock.acquire(timeout=1.0):
            if not self._writer.is_alive():
                raise StoreClosedError(f"the store at {self.path} closed during the write")
        if job.error is not None:
            raise job.error
        return job.result

    def _write_loop(self) -> None:
        get = self._queue.get
        get_nowait = self._queue.get_nowait
        while True:
            item = get()
            if item is _STOP:
                return
            batch: list[_Job] = [item]  # type: ignore[list-item]
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

    def _commit(self, batch: list[_Job]) -> None:
        try:
            self._write(lambda txn: self._write_batch(txn, batch))
        except BaseException as exc:
            error = exc
            if not isinstance(exc, StoreError):
                error = StoreError(f"write to {self.path} failed: {type(exc).__name__}: {exc}")
                error.__cause__ = exc
            for job in batch:
                job.error = error
                job.result = None
        for job in batch:
            job.lock.release()
        with self.appended:
            self.appended.notify_all()

    def _write_batch(self, txn: Any, batch: list[_Job]) -> None:
        cursor = txn.cursor(db=self.log)
        head = [int.from_bytes(cursor.key(), "big") if cursor.last() else 0]
        for job in batch:
            job.error = None
            job.result = None
            job.run(self, txn, head)

    def append_in(self, txn: Any, request: _Append, head: list[int]) -> None:
        """Write one append request inside the batch transaction."""
        raw = txn.get(request.stream_key, db=self.stream_db)
        version, epoch = stream_row(raw)
        if request.expected is not None and request.expected != version:
            request.error = ConcurrencyError(request.stream, request.expected, version)
            return
        fence = request.fence
        if fence is not None:
            holds = fence.epoch > epoch if fence.claim else fence.epoch == epoch
            if not holds:
                request.error = FencedError(request.stream, fence.epoch, epoch, claim=fence.claim)
                return
            epoch = fence.epoch
        position = head[0]
        now = self.clock.now()
        records: list[RecordedEvent] = []
        for new in request.events:
            position += 1
            version += 1
            records.append(
                RecordedEvent(
                    position=position,
                    stream=request.stream,
                    version=version,
                    ts=now if new.ts is None else new.ts,
                    id=new.id or ids.new_id(),
                    causation_id=new.causation_id,
                    correlation_id=new.correlation_id,
                    schema=self.codec.schema_of(new.event),
                    event=new.event,
                )
            )
        try:
            encoded = [self.codec.encode(record) for record in records]
        except (TypeError, ValueError, OverflowError) as exc:
            # this request alone fails; the rest of the batch is written
            request.error = EventError(f"cannot encode an event for {request.stream!r}: {exc}")
            return
        prefix = request.stream_key + b"\x00"
        log_db, index_db = self.log, self.index
        for record, value in zip(records, encoded, strict=True):
            key = _key(record.position)
            txn.put(key, value, db=log_db, append=True)
            txn.put(prefix + _key(record.version), key, db=index_db)
        txn.put(
            request.stream_key,
            msgspec.msgpack.encode((version, position, records[-1].ts, epoch)),
            db=self.stream_db,
        )
        head[0] = position
        request.result = records

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


def stream_row(raw: bytes | None) -> tuple[int, int]:
    """A stream row's version and lease epoch (rows written before fencing have none)."""
    if raw is None:
        return 0, 0
    row = msgspec.msgpack.decode(raw)
    return int(row[0]), int(row[3]) if len(row) > 3 else 0


_ENVS: dict[str, _Environment] = {}
_ENVS_LOCK = threading.Lock()


def _forget_after_fork() -> None:
    # LMDB forbids using a parent's environment in a forked child: start clean there.
    _ENVS.clear()
    if _ENVS_LOCK.locked():
        _ENVS_LOCK.release()


os.register_at_fork(after_in_child=_forget_after_fork)
