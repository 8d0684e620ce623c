"""The LMDB environment of one store directory: its sub-databases and its single writer.

All appends of a process go through one writer thread that takes every request waiting
in its inbox and commits them in one durable transaction, so N concurrent appenders pay
about one fsync per batch. After a commit that answered several appenders it waits a
little (at most LINGER of a commit's time) for them to come back, woken once when they
all have, so that a steady set of appenders makes one batch per commit rather than two
alternating halves. The writer stages a batch's writes and puts them with one call per
sub-database, and remembers the stream rows it wrote for as long as no other process has
appended. The per-stream index trails the log by fewer than INDEX_LAG records: the writer
knows the records after the index's mark and publishes them to this process's readers
(``_lmdb_tail``). LMDB's own writer lock serializes writers across processes.
One environment per directory per process is shared by every handle (LMDB forbids two
on one file in a process); a forked child starts without the parent's.
"""

from __future__ import annotations

import abc
import contextlib
import os
import threading
from collections.abc import Callable
from operator import itemgetter
from typing import Any, TypeVar

import lmdb
import msgspec

from stalwart import ids
from stalwart._logs import get_logger
from stalwart.clock import Clock, SystemClock
from stalwart.errors import (
    ConcurrencyError,
    CorruptRecordError,
    EventError,
    FencedError,
    StoreClosedError,
    StoreError,
    StoreReadOnlyError,
)
from stalwart.events import Codec, RecordedEvent

from ._inbox import Inbox
from ._lmdb_tail import Entry, LogTail, log_head, read_heads
from ._protocol import Fence, NewEvent, fold_prefix, superseded_by, unencodable, unix_ts
from ._rwlock import SharedExclusiveLock

log = get_logger(__name__)

FORMAT = b"stalwart-lmdb-3"
#: the format before the work queue kept its rows in due-time order (``due-times``):
#: read as it is, and marked 3 by the first writer (its first claim orders the rows)
FORMAT_2 = b"stalwart-lmdb-2"
#: the format before the index lagged the log: every record indexed as it was appended
FORMAT_1 = b"stalwart-lmdb-1"
#: the markers this version reads
READABLE = (FORMAT, FORMAT_2, FORMAT_1)
#: the log's records after the ``indexed`` mark that an append may leave unindexed: the
#: append that would leave this many indexes them all, in its own transaction
INDEX_LAG = 512
DEFAULT_MAP_SIZE = 64 << 20
MAX_BATCH = 4096
#: how long, as a share of the last commit's time, a batch may wait for appenders that
#: the last commit answered (only after a commit that answered more than one)
LINGER = 1.0
READ_BATCH = 1024
#: at most this many stream rows are kept by the writer between batches
ROWS_KEPT = 65536
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
    def run(self, env: _Environment, txn: Any, batch: _Batch) -> None:
        """Do the job inside the batch's write transaction."""


class _Batch:
    """What the appends of one write transaction have written so far: the log's last
    position, the log records and stream rows to put when every request has run, and how
    far the index reaches."""

    __slots__ = ("entries", "indexed", "known", "log", "position", "rows", "start")

    def __init__(self, position: int, indexed: int, known: list[Entry] | None) -> None:
        self.start = position
        self.position = position
        self.indexed = indexed
        #: the records after the mark before this batch (None: some cannot be read)
        self.known = known
        self.log: list[tuple[bytes, bytes]] = []
        #: this batch's records, as the tail knows them
        self.entries: list[Entry] = []
        #: stream key -> (version, last position, last ts, lease epoch)
        self.rows: dict[bytes, tuple[int, int, float, int]] = {}


class _Append(_Job):
    __slots__ = ("clock", "codec", "events", "expected", "fence", "stream", "stream_key")

    def __init__(
        self,
        stream: str,
        stream_key: bytes,
        events: list[NewEvent],
        expected: int | None,
        fence: Fence | None = None,
        codec: Codec | None = None,
        clock: Clock | None = None,
    ) -> None:
        super().__init__()
        self.stream = stream
        self.stream_key = stream_key
        self.events = events
        self.expected = expected
        self.fence = fence
        self.codec = codec  # the appending handle's (None: the environment's)
        self.clock = clock

    def run(self, env: _Environment, txn: Any, batch: _Batch) -> None:
        env.append_in(txn, self, batch)


class _PutSnapshot(_Job):
    __slots__ = ("prefix", "value", "version")

    def __init__(self, prefix: bytes, version: int, value: bytes) -> None:
        super().__init__()
        self.prefix = prefix
        self.version = version
        self.value = value

    def run(self, env: _Environment, txn: Any, batch: _Batch) -> None:
        prefix = self.prefix
        txn.put(prefix + _key(self.version), self.value, db=env.snapshot_db)
        keys = _keys_from(txn.cursor(db=env.snapshot_db), prefix)
        for key in keys[:-SNAPSHOTS_KEPT]:
            txn.delete(key, db=env.snapshot_db)
        # the same fold's older versions: nothing that saves this one reads them
        stream, name = prefix[:-1].split(b"\x00", 1)
        fold = fold_prefix(name.decode())
        if fold is None:
            return
        for key in _keys_from(txn.cursor(db=env.snapshot_db), stream + b"\x00" + fold.encode()):
            other = key[len(stream) + 1 :].split(b"\x00", 1)[0].decode()
            if superseded_by(name.decode(), other):
                txn.delete(key, db=env.snapshot_db)


def _keys_from(cursor: Any, prefix: bytes) -> list[bytes]:
    """The keys that begin with ``prefix``, in order."""
    keys = []
    if cursor.set_range(prefix):
        for key in cursor.iternext(values=False):
            if not bytes(key).startswith(prefix):
                break
            keys.append(bytes(key))
    return keys


_T = TypeVar("_T")
_Chunk = tuple[list[RecordedEvent], CorruptRecordError | None]
_VALUE = itemgetter(1)
_REAL_TIME = SystemClock()
_ENCODE = msgspec.msgpack.Encoder().encode
INDEXED = b"indexed"


class _Environment:
    """One open LMDB environment per directory per process, shared by every handle."""

    def __init__(
        self, path: str, *, map_size: int, codec: Codec, clock: Clock, read_only: bool = False
    ) -> None:
        self.path = path
        self.codec = codec
        self.clock = clock
        self.rw = SharedExclusiveLock()
        self.appended = threading.Condition()
        #: batches this process committed (and closes), counted under ``appended`` as it
        #: is notified: a waiter that read the head after reading this waits only while it
        #: is unchanged, so a commit between its read and its wait is not missed
        self.commits = 0
        self.refs = 0
        self._resize_lock = threading.Lock()
        self._map_size = map_size
        # at most this many read transactions of this process at once; more wait their
        # turn instead of failing with "reader table full" (a thousand actors may read)
        self._read_slots = threading.BoundedSemaphore(READERS_PER_PROCESS)
        #: opened read-only: no writer, nothing written (not even a format upgrade), so a
        #: read command works on a read-only mount and leaves an older store as it was
        self.read_only = read_only
        #: a format-1 store read as it is: every record is indexed (see ``indexed``)
        self._format_1 = False
        # the writer's copy of the stream rows its last batches wrote, good while the log's
        # head is still where its last commit left it: every write of a row comes with an
        # append, so no other process has written one since (the transaction re-checks)
        self._rows: dict[bytes, tuple[int, int]] = {}
        self._rows_head = -1
        self._indexed = 0  # the index's reach as of _rows_head
        #: the records after the mark as of _rows_head (None: learn them from the log)
        self._known: list[Entry] | None = None
        self._stalled_at = 0  # the record indexing last stopped at, warned about once
        #: what this process's readers may take for the records after the mark
        self.tail: LogTail | None = None
        #: held while the tail is published or copied (the writer adds to it in place)
        self._tail_lock = threading.Lock()
        self._batch: _Batch | None = None
        self._inbox: Inbox[_Job] = Inbox()
        self._writer: threading.Thread | None = None
        self.closed = False
        #: this is a forked child's copy of its parent's environment (closed: see
        #: ``_forget_after_fork``)
        self.forked = False
        #: the last handle let go and the close is under way (set under ``_ENVS_LOCK``):
        #: a handle opened meanwhile waits for ``gone`` instead of sharing it
        self.closing = False
        #: closed and out of the registry: a new environment of the path may open
        self.gone = threading.Event()
        self._open()

    def _open(self) -> None:
        """Open the LMDB environment and its sub-databases; start the writer unless
        read-only."""
        self.env = lmdb.open(
            self.path,
            map_size=self._map_size,
            max_dbs=8,
            max_readers=MAX_READERS,
            subdir=True,
            sync=True,
            metasync=True,
            readonly=self.read_only,
        )
        try:
            self._check_size()
            if self.read_only:
                self._open_dbs_read_only()
            else:
                self.env.reader_check()
                self._open_dbs()
        except BaseException:
            self.env.close()
            raise
        if not self.read_only:
            self._writer = threading.Thread(target=self._write_loop, name="stalwart-lmdb-writer")
            self._writer.daemon = True
            self._writer.start()

    def _open_dbs(self) -> None:
        with self.env.begin(write=True) as txn:
            # a new store's environment is empty and any other holds its format marker:
            # both are checked before a sub-database is made, so that another program's
            # LMDB file (or a newer format) is refused as it is, not made a store
            fresh = not txn.cursor().first()
            try:
                self.meta = self.env.open_db(b"meta", txn=txn, create=fresh)
            except lmdb.NotFoundError:
                raise _not_a_store(self.path) from None
            marker = txn.get(b"format", db=self.meta)
            if marker is None and not fresh:
                raise _not_a_store(self.path)
            if marker is not None and bytes(marker) not in READABLE:
                raise _unreadable_format(self.path, bytes(marker))
            self.log = self.env.open_db(b"log", txn=txn)
            self.index = self.env.open_db(b"index", txn=txn)
            self.stream_db = self.env.open_db(b"streams", txn=txn)
            self.snapshot_db = self.env.open_db(b"snapshots", txn=txn)
            if marker is None:
                txn.put(b"format", FORMAT, db=self.meta)
                txn.put(INDEXED, _key(0), db=self.meta)
            elif bytes(marker) == FORMAT_1:
                # every record of a format-1 store is indexed: the mark starts at its head
                # (a format-1 reader refuses the store from now on, as it must: it would
                # not look past the index)
                txn.put(INDEXED, _key(log_head(txn.cursor(db=self.log))), db=self.meta)
                txn.put(b"format", FORMAT, db=self.meta)
                log.info("store.format_upgraded", path=self.path, format=FORMAT.decode())
            elif bytes(marker) == FORMAT_2:
                # a format-2 writer does not keep ``due-times``: it must refuse the store
                # from now on (the first claim orders the rows it left)
                txn.put(b"format", FORMAT, db=self.meta)
                log.info("store.format_upgraded", path=self.path, format=FORMAT.decode())

    def _check_size(self) -> None:
        """Refuse a data file shorter than the pages its last commit names (a copy cut
        short, a disk that filled mid-copy): LMDB maps the file, and reading a page past
        its end kills the process with SIGBUS instead of raising."""
        needed = (self.env.info()["last_pgno"] + 1) * self.env.stat()["psize"]
        size = os.stat(os.path.join(self.path, "data.mdb")).st_size
        if size < needed:
            raise StoreError(
                f"{self.path} holds a data.mdb of {size} bytes where its last commit needs "
                f"{needed}: the file was cut short; restore the store from a copy"
            )

    def _open_dbs_read_only(self) -> None:
        # each in a transaction of its own that py-lmdb commits: a handle opened in a
        # read transaction of ours would close with it
        try:
            self.log = self.env.open_db(b"log", create=False)
            self.index = self.env.open_db(b"index", create=False)
            self.stream_db = self.env.open_db(b"streams", create=False)
            self.snapshot_db = self.env.open_db(b"snapshots", create=False)
            self.meta = self.env.open_db(b"meta", create=False)
        except lmdb.NotFoundError:
            raise _not_a_store(self.path) from None
        with self.env.begin() as txn:
            marker = txn.get(b"format", db=self.meta)
        if marker is None or bytes(marker) not in READABLE:
            raise _unreadable_format(self.path, b"" if marker is None else bytes(marker))
        self._format_1 = bytes(marker) == FORMAT_1

    def make_writable(self) -> None:
        """Reopen a read-only environment for writing: a writing handle joined it (LMDB
        allows one environment per file per process, so the two must share one)."""
        with self.rw.exclusive():
            if not self.read_only or self.closed:
                return
            self.env.close()
            self.read_only = False
            try:
                self._open()
            except BaseException:
                self.read_only = True
                self._open()  # the readers go on as before
                raise
            self._format_1 = False

    def closed_error(self) -> StoreClosedError:
        """What a call on this closed environment raises."""
        if self.forked:
            return StoreClosedError(
                f"the store at {self.path} was opened before this process forked: "
                "open it again in this process"
            )
        return StoreClosedError(f"the store at {self.path} is closed")

    def indexed(self, txn: Any) -> int:
        """How far the index reaches, as a reader sees it in ``txn``."""
        if self._format_1 and txn.get(b"format", db=self.meta) == FORMAT_1:
            # read as it is, not upgraded: a format-1 store indexes every record
            return log_head(txn.cursor(db=self.log))
        return indexed_at(txn, self.meta)

    # -- transactions under the resize lock --------------------------------------------------

    def read(self, fn: Callable[[Any], _T]) -> _T:
        """Run ``fn(txn)`` in a read transaction (values are bytes: msgspec decodes bytes
        faster than memoryviews, and they stay valid after the transaction)."""
        if self.closed:  # before the locks: a forked child's copies may be held for ever
            raise self.closed_error()
        while True:
            try:
                with self._read_slots, self.rw.shared():
                    if self.closed:
                        raise self.closed_error()
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
                raise self.closed_error()
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
                    raise self.closed_error()
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
        if self._writer is None and not self.closed:
            raise StoreReadOnlyError(f"the store at {self.path} was opened read-only")
        if self.closed or not self._inbox.put(job):
            raise self.closed_error()
        writer = self._writer
        while not job.lock.acquire(timeout=1.0):
            if writer is None or not writer.is_alive():
                raise StoreClosedError(f"the store at {self.path} closed during the write")
        if job.error is not None:
            raise job.error
        return job.result

    def _write_loop(self) -> None:
        inbox = self._inbox
        clock = _REAL_TIME.monotonic
        expect = 0  # requests expected soon: the last batch's appenders and those behind it
        took = 0.0  # how long the last commit took
        while True:
            jobs: list[_Job] = []
            if expect > 1:
                # Threads that append and wait in a loop split into two cohorts that
                # alternate, each half as big as it could be: the appenders of one batch
                # come back while the next is committing. Waiting a little for them
                # (at most LINGER of a commit) makes one batch of all of them, and the
                # writer wakes once for it.
                jobs = inbox.take(expect, took * LINGER)
            if not jobs and not (jobs := inbox.take()):
                return  # closed, and every job taken
            started = clock()
            for at in range(0, len(jobs), MAX_BATCH):
                self._commit(jobs[at : at + MAX_BATCH])
            took = clock() - started
            expect = min(len(jobs) + len(inbox), MAX_BATCH) if len(jobs) > 1 else 0

    def _commit(self, batch: list[_Job]) -> None:
        try:
            self._write(lambda txn: self._write_batch(txn, batch))
            done = self._batch
            if done is not None:
                if len(self._rows) > ROWS_KEPT:
                    self._rows.clear()
                for key, row in done.rows.items():
                    self._rows[key] = (row[0], row[3])
                self._rows_head = done.position
                self._indexed = done.indexed
                self._publish_tail(done)
        except BaseException as exc:
            self._rows_head = -1
            self._known = None
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
            self.commits += 1
            self.appended.notify_all()

    def _write_batch(self, txn: Any, jobs: list[_Job]) -> None:
        self._batch = None
        cursor = txn.cursor(db=self.log)
        head = log_head(cursor)
        if head == self._rows_head:
            indexed, known = self._indexed, self._known
        else:
            self._rows.clear()  # another process appended: its rows are in the txn only
            indexed = indexed_at(txn, self.meta)
            known = self._learn(txn, indexed, head)
        batch = _Batch(head, indexed, known)
        for job in jobs:
            job.error = None
            job.result = None
            job.run(self, txn, batch)
        if batch.log:
            _, added = cursor.putmulti(batch.log, append=True)
            if added != len(batch.log):
                raise StoreError(f"the log of {self.path} already holds a position written now")
            encode = _ENCODE
            rows = [(key, encode(row)) for key, row in batch.rows.items()]
            txn.cursor(db=self.stream_db).putmulti(rows)
            if batch.position - indexed >= INDEX_LAG:
                batch.indexed = self._index_log(txn, batch)
        self._batch = batch

    def _learn(self, txn: Any, indexed: int, head: int) -> list[Entry] | None:
        """The records after the mark when another process appended since this writer's
        last commit (or it has not written yet): what it knew, less what the mark has
        passed, plus the heads of the records it has not seen. None when one of them
        cannot be read (or the mark trails too far, as when indexing stalled)."""
        known, seen = self._known, self._rows_head
        if known is None or seen < indexed:
            known, seen = [], indexed
        else:
            known = [entry for entry in known if entry[2] > indexed]
        if head - indexed >= INDEX_LAG:
            return None
        last = {key: version for key, version, _ in known}
        more, trouble = read_heads(txn.cursor(db=self.log), seen, head, last)
        return None if trouble is not None else known + more

    def _index_log(self, txn: Any, batch: _Batch) -> int:
        """Index the log's records after the batch's mark, in its transaction; the new mark.

        Each stream's index entries sit together, so indexing every append would dirty a
        page per stream per commit; a lagging index dirties them once per INDEX_LAG
        records. The records come from what the writer knows of them, else from their
        heads in the log. A record that cannot be read stops the index before it, so that
        every record up to the mark stays indexed (reads then scan a longer tail; the
        store says so once).
        """
        indexed = batch.indexed
        if batch.known is not None:
            known = batch.known + batch.entries
        else:
            known, trouble = read_heads(txn.cursor(db=self.log), indexed, batch.position)
            if trouble is not None and self._stalled_at != trouble[0]:
                self._stalled_at = trouble[0]
                log.warning(
                    "store.index_stalled", path=self.path, position=trouble[0], reason=trouble[1]
                )
        if not known:
            return indexed
        entries = [(key + b"\x00" + _key(version), _key(at)) for key, version, at in known]
        entries.sort()
        txn.cursor(db=self.index).putmulti(entries)
        reached = known[-1][2]
        txn.put(INDEXED, _key(reached), db=self.meta)
        return reached

    def _publish_tail(self, done: _Batch) -> None:
        """What the committed batch leaves after the mark, for the next batch and for
        this process's readers."""
        if done.indexed == done.position:
            self._known = []  # indexed to the head (a pass from what it knew always is)
        elif done.known is None:
            self._known = None  # some cannot be read: readers scan the log
        else:
            done.known.extend(done.entries)
            self._known = done.known
        known = self._known
        with self._tail_lock:
            tail = self.tail
            if known is None:
                self.tail = None
            elif tail is not None and tail.indexed == done.indexed and tail.head == done.start:
                tail.add(done.entries, done.position)
            else:
                self.tail = LogTail(done.indexed, done.position, known)

    def tail_for(self, txn: Any, indexed: int, end: int) -> LogTail | None:
        """A tail of the log after the mark ``indexed`` that reaches ``end``, as ``txn``
        sees the log: the published one, else one read from the log's heads (only those
        past the published one's end when it has the same mark) and published for this
        process's next reads. Without it, a process whose writer did not make the last
        commit (a read-only handle, or after another process appended) scanned the whole
        tail at every read. None when a record there cannot be read (the read scans, and
        says where)."""
        with self._tail_lock:
            base = self.tail
            if base is not None and base.indexed == indexed and base.head >= end:
                return base
            head = log_head(txn.cursor(db=self.log))
            extend = base is not None and base.indexed == indexed and base.head <= head
            start = base.head if extend and base is not None else indexed
            tail = base.copy() if extend and base is not None else LogTail(indexed, indexed, ())
        if head < end or head - indexed >= 4 * INDEX_LAG:
            return None  # records missing at the end (the scan names them), or indexing
            # stalled at a damaged record (a tail too long to keep)
        last = tail.last_versions() if extend else None
        more, trouble = read_heads(txn.cursor(db=self.log), start, head, last)
        if trouble is not None:
            return None
        tail.add(more, head)
        with self._tail_lock:
            current = self.tail
            newer = current is None or (current.indexed, current.head) < (indexed, head)
            if current is base and newer:
                self.tail = tail
        return tail

    def append_in(self, txn: Any, request: _Append, batch: _Batch) -> None:
        """Check one append request, and stage its writes in the batch."""
        key = request.stream_key
        row = batch.rows.get(key)
        if row is not None:
            version, epoch = row[0], row[3]
        else:
            cached = self._rows.get(key)
            if cached is None:
                try:
                    cached = stream_row(txn.get(key, db=self.stream_db), key)
                except StoreError as exc:  # a damaged row fails this stream alone
                    request.error = exc
                    return
            version, epoch = cached
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
        stream = request.stream
        position = batch.position
        now = (request.clock or self.clock).now()
        codec = request.codec or self.codec
        records: list[RecordedEvent] = []
        events = request.events
        fresh = iter(ids.new_ids(len(events)))
        try:
            values = []
            for new in events:
                position += 1
                version += 1
                record = RecordedEvent(
                    position,
                    stream,
                    version,
                    now if new.ts is None else unix_ts(new.ts),
                    new.id or next(fresh),
                    new.causation_id,
                    new.correlation_id,
                    codec.schema_of(new.event),
                    new.event,
                )
                records.append(record)
                value = codec.encode(record)
                codec.readable(value)  # a field its type forbids would stop every read
                values.append(value)
        except Exception as exc:  # whatever it is, it is this request's alone
            # this request alone fails; the rest of the batch is written
            request.error = EventError(f"cannot encode an event for {stream!r}: {unencodable(exc)}")
            return
        log, entries = batch.log, batch.entries
        for record, value in zip(records, values, strict=True):
            at = record.position
            log.append((at.to_bytes(_POS, "big"), value))
            entries.append((key, record.version, at))
        batch.rows[key] = (version, position, records[-1].ts, epoch)
        batch.position = position
        request.result = records

    def close(self) -> None:
        if self.closed:
            return
        self._inbox.close()
        if self._writer is not None:
            self._writer.join()
        with self.rw.exclusive():
            self.closed = True
            self.env.close()
        with self.appended:
            self.commits += 1
            self.appended.notify_all()


def _not_a_store(path: str) -> StoreError:
    return StoreError(f"{path} holds an LMDB file but no stalwart store")


def _unreadable_format(path: str, marker: bytes) -> StoreError:
    return StoreError(f"{path} holds store format {marker!r}, this version reads {FORMAT!r}")


def indexed_at(txn: Any, meta: Any) -> int:
    """How far the index reaches: every record up to this position is indexed."""
    raw = txn.get(INDEXED, db=meta)
    return 0 if raw is None else int.from_bytes(raw, "big")


def decode_stream_row(stream: bytes, raw: bytes) -> list[Any]:
    """A stream row's fields (version, last position, last ts[, epoch]); a damaged row
    is a StoreError naming its stream (``stalwart db check`` walks the log itself)."""
    try:
        row = msgspec.msgpack.decode(raw)
        if not isinstance(row, list) or len(row) < 3:
            raise ValueError("not a stream row")
        for field, kind in zip(row[:3], (int, int, float), strict=True):
            kind(field)  # each a number: a TypeError or ValueError otherwise
    except (msgspec.DecodeError, ValueError, TypeError) as exc:
        name = stream.decode("utf-8", "backslashreplace")
        raise StoreError(f"the index row of stream {name!r} cannot be read: {exc}") from None
    return row


def stream_row(raw: bytes | None, stream: bytes) -> tuple[int, int]:
    """``stream``'s row's version and lease epoch (0, 0 for no row; rows written before
    fencing have no epoch)."""
    if raw is None:
        return 0, 0
    row = decode_stream_row(stream, raw)
    return int(row[0]), int(row[3]) if len(row) > 3 else 0


_ENVS: dict[str, _Environment] = {}
_ENVS_LOCK = threading.Lock()


def _forget_after_fork() -> None:
    # LMDB forbids using a parent's environment in a forked child: start clean there. The
    # inherited handles are closed too: py-lmdb remembers every open environment of the
    # process by file, so the child could not open the store again (closing in the child
    # leaves the parent's reader slots and locks alone: they are the parent's pid's)
    for shared in _ENVS.values():
        with contextlib.suppress(Exception):
            shared.env.close()
        # a handle the child kept raises StoreClosedError saying so, not a raw lmdb.Error;
        # its close() then does nothing (the writer thread is the parent's)
        shared.forked = shared.closed = True
    _ENVS.clear()
    if _ENVS_LOCK.locked():
        _ENVS_LOCK.release()


os.register_at_fork(after_in_child=_forget_after_fork)
