"""Review: the LMDB reader's log-tail cache (``_Environment.tail_for``, ``LogTail``).

A process whose writer did not make the last commit (a read-only handle, or a process
another one appended to) keeps the heads of the records after the index mark that it read,
extends them when the log grows under the same mark, and publishes them for its next
reads. These tests read through such a process while another one (a real subprocess)
appends, across the mark moving, from transactions older than the published tail, from
threads racing the publish, through a damaged record, a grown map, a second handle and a
fork, and check that a read never misses, repeats or misorders a record, never returns
one its transaction cannot see, and that a published tail always matches the log.

Every event's ``message_id`` is ``"<stream>|<version>"``, whoever appended it, so any read
can be checked on its own.

Tests marked ``# Was: DEFECT`` failed on the code reviewed and pass since the fix: a damaged
record whose head still decodes but names another stream was taken as read into a
reader-built tail (and, before the tail cache already, into the index), and the reads that
trust it skipped, repeated or borrowed versions where the per-read scan raised
CorruptRecordError.
"""

from __future__ import annotations

import multiprocessing
import random
import subprocess
import sys
import textwrap
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from stalwart.errors import CorruptRecordError
from stalwart.events import DEFAULT_CODEC, MessageAppended, RecordedEvent
from stalwart.store import LmdbEventStore, _environment, _lmdb_tail
from stalwart.store._environment import INDEX_LAG, READ_BATCH, _Environment
from stalwart.store._lmdb import _LAST_VERSION, _stream_chunk
from stalwart.store._lmdb_tail import LogTail, log_head, read_heads
from tests._runtime_support import LineProcess, until

ROOT = Path(__file__).resolve().parents[1]
WAIT = 60.0  # seconds a child process or a thread may take before the test fails


# -- events that check themselves --------------------------------------------------------------


def event(stream: str, version: int) -> MessageAppended:
    return MessageAppended(message_id=f"{stream}|{version}", role="user", content="x")


def append(store: LmdbEventStore, stream: str, count: int) -> list[RecordedEvent]:
    version = store.stream_version(stream)
    news = [event(stream, version + n) for n in range(1, count + 1)]
    return store.append(stream, news, expected_version=version)


def check_run(records: list[RecordedEvent], stream: str, first: int) -> None:
    """``records`` are ``stream``'s versions ``first``, ``first + 1``, ... in log order,
    each the event appended at that version."""
    versions = [r.version for r in records]
    assert versions == list(range(first, first + len(records))), (stream, first, versions[:8])
    for record in records:
        assert record.stream == stream, record
        assert isinstance(record.event, MessageAppended), record
        assert record.event.message_id == f"{stream}|{record.version}", record
    positions = [r.position for r in records]
    assert positions == sorted(set(positions)), (stream, positions[:8])


def check_store(store: LmdbEventStore, versions: dict[str, int] | None = None) -> int:
    """Every stream of ``store`` reads whole, from its start and from the middle and the
    end, in agreement with ``read_all``, ``streams()`` and ``stream_version``; the head."""
    records = list(store.read_all())
    head = len(records)
    assert [r.position for r in records] == list(range(1, head + 1))
    by_stream: dict[str, list[RecordedEvent]] = {}
    for record in records:
        by_stream.setdefault(record.stream, []).append(record)
    infos = {info.stream: info for info in store.streams()}
    assert set(infos) == set(by_stream)
    for stream, written in by_stream.items():
        check_run(written, stream, 1)
        assert infos[stream].version == len(written) == store.stream_version(stream)
        assert infos[stream].last_position == written[-1].position
        assert list(store.read_stream(stream)) == written
        end = len(written)
        for first in {1, max(1, end - 3), end, end + 1, max(1, end - INDEX_LAG)}:
            assert list(store.read_stream(stream, first)) == written[first - 1 :], (stream, first)
        middle = max(1, end // 2)
        assert list(store.read_stream(stream, middle, end - 1)) == written[middle - 1 : end - 1]
    if versions is not None:
        assert {s: len(r) for s, r in by_stream.items()} == versions
    return head


def check_tail(env: _Environment) -> LogTail | None:
    """The published tail, checked against the log: every record after its mark up to its
    head, and nothing else, each under its stream with its version, in order."""
    with env._tail_lock:
        tail = env.tail
        if tail is None:
            return None
        copied = tail.copy()

    def read(txn: Any) -> tuple[list[_lmdb_tail.Entry], Any, int]:
        entries, trouble = read_heads(txn.cursor(db=env.log), copied.indexed, copied.head)
        return entries, trouble, log_head(txn.cursor(db=env.log))

    entries, trouble, head = env.read(read)
    assert trouble is None, trouble
    assert copied.indexed <= copied.head <= head
    expected: dict[bytes, list[tuple[int, int]]] = {}
    for key, version, position in entries:
        expected.setdefault(key, []).append((version, position))
    assert copied.streams == expected
    return tail


def described(store: LmdbEventStore) -> tuple[int, int]:
    info = store.describe()
    return int(info["head"]), int(info["indexed"])


# -- another process that appends on request ---------------------------------------------------

APPENDER = textwrap.dedent(
    """
    import json, sys
    from stalwart.store import LmdbEventStore
    from stalwart.events import MessageAppended

    path, map_size, size = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    with LmdbEventStore(path, map_size=map_size) as store:
        print("ready", flush=True)
        for line in sys.stdin:
            for stream, count in json.loads(line):
                version = store.stream_version(stream)
                events = [
                    MessageAppended(
                        message_id=f"{stream}|{version + n}", role="user", content="x" * size
                    )
                    for n in range(1, count + 1)
                ]
                store.append(stream, events, expected_version=version)
            info = store.describe()
            print(json.dumps([info["head"], info["indexed"]]), flush=True)
    """
)


class Appender(LineProcess):
    """A Python process with the store open for writing, appending what it is told."""

    def __init__(self, store_dir: Path, map_size: int = 64 << 20, size: int = 1) -> None:
        argv = [sys.executable, "-c", APPENDER, str(store_dir), str(map_size), str(size)]
        super().__init__(argv, ROOT, "the appender process", WAIT)

    def append(self, *batches: tuple[str, int]) -> tuple[int, int]:
        """Append ``count`` events to each ``stream`` in turn (one append each); the
        store's head and index mark after them."""
        self.send(batches)
        head, indexed = self.answer()
        return int(head), int(indexed)


@pytest.fixture
def appender(store_dir: Path) -> Iterator[Callable[..., Appender]]:
    started: list[Appender] = []

    def start(map_size: int = 64 << 20, size: int = 1) -> Appender:
        started.append(Appender(store_dir, map_size, size))
        return started[-1]

    yield start
    for one in started:
        one.close()


DAMAGE = textwrap.dedent(
    """
    import sys
    import lmdb

    path, position, how = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    env = lmdb.open(path, max_dbs=8)
    with env.begin(write=True) as txn:
        log = env.open_db(b"log", txn=txn)
        key = position.to_bytes(8, "big")
        if how == "deleted":
            assert txn.delete(key, db=log)
        elif how == "renamed":  # the record's own stream name, session:b, says session:c
            value = bytes(txn.get(key, db=log))
            assert b"\\xa9session:b" in value
            txn.put(key, value.replace(b"\\xa9session:b", b"\\xa9session:c", 1), db=log)
        else:
            txn.put(key, b"\\xc1garbage", db=log)
    env.close()
    """
)


def damage(store_dir: Path, position: int, how: str) -> None:
    """Damage the log's record at ``position`` from another process (LMDB refuses a second
    environment on the file in this one while a store has it open)."""
    subprocess.run(
        [sys.executable, "-c", DAMAGE, str(store_dir), str(position), how],
        check=True,
        timeout=WAIT,
        cwd=ROOT,
    )


def heads_decoded(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Count the stored records whose head a read or the writer decodes."""
    calls = [0]
    head = _lmdb_tail.HEAD

    def counted(value: bytes) -> Any:
        calls[0] += 1
        return head(value)

    monkeypatch.setattr(_lmdb_tail, "HEAD", counted)
    return calls


def open_reader(store_dir: Path, **options: Any) -> LmdbEventStore:
    return LmdbEventStore(store_dir, create=False, read_only=True, **options)


# -- a read-only handle while another process appends ------------------------------------------

STREAMS = tuple(f"session:s{n}" for n in range(5))


def test_a_read_only_handle_reads_every_stream_whole_as_another_process_moves_the_mark(
    store_dir: Path, appender: Callable[..., Appender], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Step by step: the reader's tail is built, extended under the same mark (reading only
    the new heads), left behind when another process's append moves the mark (by a few
    appends, by one append longer than the lag), and rebuilt under the new mark."""
    child = appender()
    versions = dict.fromkeys(STREAMS, 0)
    head, indexed = child.append(("session:s0", 1))
    versions["session:s0"] = 1
    reader = open_reader(store_dir)
    env = reader._env
    heads = heads_decoded(monkeypatch)
    marks = set()
    try:
        plan = [
            [(s, 20) for s in STREAMS] * 3,  # 300 after the mark
            [(s, 4) for s in STREAMS] * 5,  # 100 more: the same mark
            [(s, 30) for s in STREAMS],  # 150 more: past the lag, the mark moves
            [("session:s1", 7), ("session:s3", 33)],  # 40 after the new mark
            [("session:new", 3)],  # a stream made after the tail was kept
            [("session:s2", INDEX_LAG + 88)],  # one append longer than the lag
            [("session:s4", 1), ("session:new", 2)],
        ]
        check_store(reader)  # a tail of the one record is kept
        for step in plan:
            before_head, before_mark = head, indexed
            head, indexed = child.append(*step)
            for stream, count in step:
                versions[stream] = versions.get(stream, 0) + count
            marks.add(indexed)
            heads[0] = 0
            # the newest record of every stream first: the reads a fold makes
            for stream, version in versions.items():
                assert [r.version for r in reader.read_stream(stream, version)] == [version]
            if indexed == before_mark and head > indexed:
                # the tail was extended: only the heads of the new records were read
                assert heads[0] == head - before_head, (heads[0], before_head, head)
            assert heads[0] <= head - indexed
            tail = check_tail(env)
            if head > indexed:
                assert tail is not None
                assert (tail.indexed, tail.head) == (indexed, head)
            assert check_store(reader, versions) == head
            assert described(reader) == (head, indexed)
        assert len(marks) >= 3  # the mark moved twice while the reader kept a tail
    finally:
        reader.close()


class Loops:
    """Threads that read (or append) in a loop until stopped, keeping what went wrong."""

    def __init__(self) -> None:
        self.stop = threading.Event()
        self.errors: list[BaseException] = []
        self.reads = 0
        self.threads: list[threading.Thread] = []

    def start(self, body: Callable[[random.Random], object], seed: int) -> None:
        def loop() -> None:
            rng = random.Random(seed)
            try:
                while not self.stop.is_set():
                    body(rng)
            except BaseException as exc:
                self.errors.append(exc)

        self.threads.append(threading.Thread(target=loop))
        self.threads[-1].start()

    def end(self) -> None:
        self.stop.set()
        for thread in self.threads:
            thread.join(WAIT)


def test_reader_threads_a_writer_and_another_process_agree_on_every_read(
    store_dir: Path, appender: Callable[..., Appender]
) -> None:
    """Two reader threads read every stream (newest records, whole, from the middle) while
    this process's writer and another process append to the same store, across several
    moves of the mark; every published tail matches the log."""
    store = LmdbEventStore(store_dir)
    env = store._env
    append(store, "session:p0", 1)
    child = appender()
    mine = tuple(f"session:p{n}" for n in range(4))
    theirs = tuple(f"session:c{n}" for n in range(4))
    loops = Loops()

    def read(rng: random.Random) -> None:
        stream = rng.choice(mine + theirs)
        version = store.stream_version(stream)
        first = rng.choice([1, max(1, version - 2), max(1, version), version + 1])
        records = list(store.read_stream(stream, first))
        check_run(records, stream, first)
        # never less than the transaction before it saw
        assert first + len(records) - 1 >= version, (stream, first, version)
        loops.reads += 1

    loops.start(read, 1)
    loops.start(read, 2)
    loops.start(lambda rng: append(store, rng.choice(mine), rng.choice([1, 1, 2, 5])), 3)
    marks = set()
    try:
        rng = random.Random(4)
        for _ in range(40):
            batches = [(rng.choice(theirs), rng.choice([1, 3, 9, 40])) for _ in range(3)]
            marks.add(child.append(*batches)[1])
            check_tail(env)
        until(lambda: loops.reads >= 200, WAIT, what="200 reads")
    finally:
        loops.end()
    try:
        assert loops.errors == []
        assert len(marks) >= 3
        check_tail(env)
        check_store(store)
    finally:
        store.close()


def test_streams_versions_and_read_all_of_a_read_only_handle_agree_with_its_reads(
    store_dir: Path, appender: Callable[..., Appender]
) -> None:
    """While another process appends: every stream that ``streams()`` lists reads up to
    at least the version it listed, its record at that version at the position listed;
    ``read_all`` from any point has no gap; ``stream_version`` never goes back."""
    child = appender()
    child.append(("session:a", 1))
    reader = open_reader(store_dir)
    stop = threading.Event()
    errors: list[BaseException] = []

    def feed() -> None:
        rng = random.Random(11)
        try:
            for _ in range(60):
                child.append((rng.choice(["session:a", "session:b", "session:c"]), 17))
        except BaseException as exc:
            errors.append(exc)
        finally:
            stop.set()

    feeder = threading.Thread(target=feed)
    feeder.start()
    try:
        seen: dict[str, int] = {}
        checks = 0
        while not stop.is_set() or checks == 0:
            for info in reader.streams():
                records = list(reader.read_stream(info.stream, info.version))
                assert records, info
                assert records[0].version == info.version
                assert records[0].position == info.last_position
                check_run(records, info.stream, info.version)
                assert info.version >= seen.get(info.stream, 0)
                seen[info.stream] = reader.stream_version(info.stream)
                assert seen[info.stream] >= info.version
            head = reader.head()
            tail_all = list(reader.read_all(max(1, head - 40)))
            assert [r.position for r in tail_all] == list(
                range(max(1, head - 40), max(1, head - 40) + len(tail_all))
            )
            checks += 1
    finally:
        feeder.join(WAIT)
    try:
        assert errors == []
        check_store(reader)
        check_tail(reader._env)
    finally:
        reader.close()


# -- a transaction older than the published tail -----------------------------------------------


class HeldRead:
    """A read transaction opened on a thread and held there, to read from later."""

    def __init__(self, env: _Environment) -> None:
        self.env = env
        self.opened = threading.Event()
        self.asks: list[Callable[[Any], Any]] = []
        self.ask = threading.Event()
        self.answered = threading.Event()
        self.answer: Any = None
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run)
        self.thread.start()
        assert self.opened.wait(WAIT)

    def _run(self) -> None:
        def hold(txn: Any) -> None:
            self.opened.set()
            assert self.ask.wait(WAIT)
            try:
                self.answer = self.asks[0](txn)
            except BaseException as exc:
                self.error = exc
            self.answered.set()

        self.env.read(hold)

    def close(self) -> None:
        """Let the transaction go unused (when a test failed before it read)."""
        if not self.ask.is_set():
            self.asks.append(lambda txn: None)
            self.ask.set()
        self.thread.join(WAIT)

    def run(self, fn: Callable[[Any], Any]) -> Any:
        self.asks.append(fn)
        self.ask.set()
        assert self.answered.wait(WAIT)
        self.thread.join(WAIT)
        if self.error is not None:
            raise self.error
        return self.answer


def chunk_in(
    env: _Environment, stream: str, first: int = 1
) -> Callable[[Any], tuple[list[RecordedEvent], Any, int, int]]:
    """A read of ``stream`` in a given transaction: records, error, its head and mark."""

    def read(txn: Any) -> tuple[list[RecordedEvent], Any, int, int]:
        prefix = stream.encode() + b"\x00"
        records, error = _stream_chunk(
            env, DEFAULT_CODEC, txn, stream, prefix, first, _LAST_VERSION
        )
        return records, error, log_head(txn.cursor(db=env.log)), env.indexed(txn)

    return read


@pytest.mark.parametrize("more", [10, INDEX_LAG + 40], ids=["same-mark", "mark-moved"])
@pytest.mark.parametrize("who", ["this-writer", "another-process"])
def test_a_transaction_older_than_the_published_tail_reads_only_what_it_sees(
    store_dir: Path,
    appender: Callable[..., Appender],
    request: pytest.FixtureRequest,
    who: str,
    more: int,
) -> None:
    """A transaction opened before appends that a newer tail already holds (the stream it
    reads grew, a stream it does not see was made) reads exactly its own snapshot: the
    newer tail's entries past its head are never returned, nothing is reported missing,
    and the older transaction does not replace the newer tail."""
    if who == "this-writer":
        store = LmdbEventStore(store_dir)
        other: Any = None

        def grow(*batches: tuple[str, int]) -> None:
            for stream, count in batches:
                append(store, stream, count)
    else:
        other = appender()
        other.append(("session:a", 1))
        store = open_reader(store_dir)

        def grow(*batches: tuple[str, int]) -> None:
            other.append(*batches)

    env = store._env
    try:
        grow(("session:a", 30), ("session:b", 20))
        old_a = list(store.read_stream("session:a"))  # a tail is published
        old_b = list(store.read_stream("session:b"))
        old_head, old_mark = described(store)
        held = HeldRead(env)  # sees exactly this
        request.addfinalizer(held.close)
        grow(("session:a", more), ("session:b", 3), ("session:late", 5))
        new_head, new_mark = described(store)
        assert (new_mark == old_mark) == (more == 10)
        newer = list(store.read_stream("session:a"))
        assert len(newer) == len(old_a) + more
        assert len(list(store.read_stream("session:late"))) == 5  # the newer tail is published
        published = check_tail(env)
        assert published is not None
        assert (published.indexed, published.head) == (new_mark, new_head)

        reads_from = (
            ("session:a", 1),
            ("session:a", len(old_a)),
            ("session:a", len(old_a) + 1),  # past what it sees
            ("session:b", 2),
            ("session:late", 1),  # made after it
        )
        reads = held.run(
            lambda txn: {
                (name, first): chunk_in(env, name, first)(txn) for name, first in reads_from
            }
        )
        for (name, first), (records, error, head, mark) in reads.items():
            assert (head, mark) == (old_head, old_mark), name
            assert error is None, (name, first, error)
            assert all(r.position <= old_head for r in records), (name, first)
            expected = {"session:a": old_a, "session:b": old_b}.get(name, [])
            assert records == expected[first - 1 :], (name, first)
        assert env.tail is published  # the older reader did not take its place
        check_tail(env)
        check_store(store)
    finally:
        store.close()


# -- threads racing the publish ----------------------------------------------------------------


def block_read_heads(
    monkeypatch: pytest.MonkeyPatch, thread_name: str
) -> tuple[threading.Event, threading.Event]:
    """Make ``tail_for``'s head reads on the thread named ``thread_name`` stop (once) until
    released: the events (it is there, let it go)."""
    there, go = threading.Event(), threading.Event()
    real = read_heads

    def blocked(cursor: Any, after: int, upto: int, last: Any = None) -> Any:
        if threading.current_thread().name == thread_name and not there.is_set():
            there.set()
            assert go.wait(WAIT)
        return real(cursor, after, upto, last)

    monkeypatch.setattr(_environment, "read_heads", blocked)
    return there, go


def test_an_older_reader_finishing_after_a_newer_one_leaves_the_newer_tail(
    store_dir: Path, appender: Callable[..., Appender], monkeypatch: pytest.MonkeyPatch
) -> None:
    child = appender()
    child.append(("session:a", 50))
    reader = open_reader(store_dir)
    env = reader._env
    there, go = block_read_heads(monkeypatch, "older")
    try:
        assert len(list(reader.read_stream("session:a"))) == 50  # tail (0, 50)
        child.append(("session:a", 20))  # 70
        result: list[Any] = []
        older = threading.Thread(
            target=lambda: result.append(env.read(chunk_in(env, "session:a"))), name="older"
        )
        older.start()
        assert there.wait(WAIT)  # it copied the (0, 50) tail and is reading 51..70
        child.append(("session:a", 30), ("session:b", 4))  # 104
        newest = list(reader.read_stream("session:a"))  # extends to 104, publishes
        check_run(newest, "session:a", 1)
        assert len(newest) == 100
        published = env.tail
        assert published is not None
        assert published.head == 104
        go.set()
        older.join(WAIT)
        records, error, head, _ = result[0]
        assert error is None
        assert head == 70
        check_run(records, "session:a", 1)
        assert len(records) == 70
        assert env.tail is published  # not replaced by the older one
        check_tail(env)
        check_store(reader)
    finally:
        go.set()  # (a failed test leaves no thread holding the store open)
        reader.close()


def test_a_newer_reader_finishing_after_an_older_one_still_reads_right(
    store_dir: Path, appender: Callable[..., Appender], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The reverse: the newer reader finds an older tail published meanwhile and keeps
    its own to itself; the next read extends the published one."""
    child = appender()
    child.append(("session:a", 50))
    reader = open_reader(store_dir)
    env = reader._env
    there, go = block_read_heads(monkeypatch, "newer")
    older_txn = None
    try:
        assert len(list(reader.read_stream("session:a"))) == 50  # tail (0, 50)
        child.append(("session:a", 20))
        # a thread whose transaction sees 70 records; a newer one (100) blocked in its read
        older_txn = HeldRead(env)
        child.append(("session:a", 30))  # 100
        result: list[Any] = []
        newer = threading.Thread(
            target=lambda: result.append(env.read(chunk_in(env, "session:a"))), name="newer"
        )
        newer.start()
        assert there.wait(WAIT)
        records, error, head, _ = older_txn.run(chunk_in(env, "session:a"))
        assert error is None
        check_run(records, "session:a", 1)
        assert head == len(records)
        go.set()
        newer.join(WAIT)
        records, error, head, _ = result[0]
        assert (error, head, len(records)) == (None, 100, 100)
        check_run(records, "session:a", 1)
        check_tail(env)
        child.append(("session:a", 1))
        check_store(reader, {"session:a": 101})
        tail = check_tail(env)
        assert tail is not None
        assert tail.head == 101
    finally:
        go.set()
        if older_txn is not None:
            older_txn.close()
        reader.close()


def test_the_writer_adding_to_the_tail_a_reader_is_extending_loses_nothing(
    store_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """This process's writer commits 11..15 and, before it publishes them, a reader whose
    transaction sees them copies the (0, 10) tail to extend it; the writer then adds its
    records to that tail in place. Both tails are right; the reader publishes nothing."""
    store = LmdbEventStore(store_dir)
    env = store._env
    committed, release = threading.Event(), threading.Event()
    there, go = block_read_heads(monkeypatch, "reader")
    try:
        append(store, "session:a", 10)
        base = env.tail
        assert base is not None
        assert (base.indexed, base.head) == (0, 10)
        publish = env._publish_tail

        def held_publish(done: Any) -> None:
            committed.set()
            assert release.wait(WAIT)
            publish(done)

        monkeypatch.setattr(env, "_publish_tail", held_publish)
        appended: list[Any] = []
        writer = threading.Thread(target=lambda: appended.append(append(store, "session:a", 5)))
        writer.start()
        assert committed.wait(WAIT)  # 11..15 are committed, not yet published
        result: list[Any] = []
        reader = threading.Thread(
            target=lambda: result.append(env.read(chunk_in(env, "session:a"))), name="reader"
        )
        reader.start()
        assert there.wait(WAIT)  # the reader copied (0, 10) and reads 11..15
        release.set()
        writer.join(WAIT)
        assert [r.version for r in appended[0]] == [11, 12, 13, 14, 15]
        assert env.tail is base  # the writer added its records in place
        assert base.head == 15
        go.set()
        reader.join(WAIT)
        records, error, head, _ = result[0]
        assert (error, head) == (None, 15)
        check_run(records, "session:a", 1)
        assert len(records) == 15
        assert env.tail is base
        check_tail(env)
        check_store(store)
    finally:
        release.set()
        go.set()
        store.close()


# -- damage ------------------------------------------------------------------------------------


@pytest.mark.parametrize("how", ["garbage", "deleted"])
def test_a_record_damaged_after_the_reader_kept_its_tail_fails_only_its_stream(
    store_dir: Path, appender: Callable[..., Appender], how: str
) -> None:
    """The reader's kept tail still names the damaged record's position (from its bytes,
    or its absence) after the tail is extended past it, and after another process that
    never read it stalls the index before it."""
    child = appender()
    for _ in range(10):
        child.append(("session:a", 1), ("session:b", 1))
    reader = open_reader(store_dir)
    try:
        a = list(reader.read_stream("session:a"))
        b = list(reader.read_stream("session:b"))
        assert reader._env.tail is not None
        broken = a[2].position  # version 3
        damage(store_dir, broken, how)

        def check_a(count: int) -> None:
            read: list[RecordedEvent] = []
            with pytest.raises(CorruptRecordError) as info:
                read.extend(reader.read_stream("session:a"))
            assert info.value.position == broken
            assert read == a[:2]
            after = list(reader.read_stream("session:a", 4))
            check_run(after, "session:a", 4)
            assert len(after) == count - 3

        check_a(10)
        assert list(reader.read_stream("session:b")) == b
        child.append(("session:a", 5), ("session:b", 5))  # the tail is extended past it
        check_a(15)
        tail = reader._env.tail
        assert tail is not None
        assert tail.head == 30
        b = list(reader.read_stream("session:b"))
        check_run(b, "session:b", 1)
        assert len(b) == 15
        child.close()
        # a process that never read the damaged record appends past the lag: it stalls
        # the index just before it; the reader scans and names it
        fresh = Appender(store_dir)
        try:
            head, indexed = fresh.append(("session:b", INDEX_LAG + 10))
        finally:
            fresh.close()
        assert indexed == broken - 1
        check_a(15)
        b = list(reader.read_stream("session:b"))
        check_run(b, "session:b", 1)
        assert len(b) == 15 + INDEX_LAG + 10
        assert reader._env.tail is None or reader._env.tail.indexed != indexed
        assert reader.head() == head
    finally:
        reader.close()


def test_a_damaged_record_after_the_mark_is_never_kept_in_a_readers_tail(
    store_dir: Path, appender: Callable[..., Appender]
) -> None:
    child = appender()
    for _ in range(6):
        child.append(("session:a", 1), ("session:b", 1))
    child.close()
    damage(store_dir, 5, "garbage")  # session:a version 3
    reader = open_reader(store_dir)
    try:
        assert [r.version for r in reader.read_stream("session:b")] == list(range(1, 7))
        with pytest.raises(CorruptRecordError) as info:
            list(reader.read_stream("session:a"))
        assert info.value.position == 5
        assert [r.version for r in reader.read_stream("session:a", 4)] == [4, 5, 6]
        assert reader._env.tail is None  # nothing kept: the scan names the record
    finally:
        reader.close()


def test_a_stalled_index_longer_than_the_kept_limit_reads_whole_through_a_reader(
    store_dir: Path, appender: Callable[..., Appender]
) -> None:
    """Over 4 * INDEX_LAG records after a stalled mark: the reader keeps no tail and
    scans, a long stream a batch at a time."""
    child = appender()
    for _ in range(5):
        child.append(("session:a", 1), ("session:b", 1))
    child.close()
    damage(store_dir, 5, "garbage")
    fresh = appender()
    head, indexed = fresh.append(("session:b", 4 * INDEX_LAG + 30))
    assert indexed == 4
    reader = open_reader(store_dir)
    try:
        b = list(reader.read_stream("session:b"))
        check_run(b, "session:b", 1)
        assert len(b) == 5 + 4 * INDEX_LAG + 30
        later = list(reader.read_stream("session:b", READ_BATCH + 7))
        assert later == b[READ_BATCH + 6 :]
        with pytest.raises(CorruptRecordError) as info:
            list(reader.read_stream("session:a"))
        assert info.value.position == 5
        assert reader._env.tail is None
        assert reader.head() == head
    finally:
        reader.close()


def read_outcome(store: LmdbEventStore, stream: str, first: int) -> tuple[list[Any], str]:
    """What a read of ``stream`` from ``first`` gives: (stream, version) of each record, and
    how it ended ("end", or the CorruptRecordError's position: "named" if it is one)."""
    read: list[Any] = []
    try:
        read.extend((r.stream, r.version) for r in store.read_stream(stream, first))
    except CorruptRecordError as exc:
        return read, "named" if exc.position > 0 else f"unnamed ({exc})"
    return read, "end"


def renamed_record_store(store_dir: Path, appender: Callable[..., Appender]) -> None:
    """session:b and session:c, versions 1..8 each, alternating (b at odd positions); then
    the record of session:b version 3 (position 5) says, in its head, session:c: one
    damaged record that still decodes."""
    child = appender()
    for _ in range(8):
        child.append(("session:b", 1), ("session:c", 1))
    child.close()
    damage(store_dir, 5, "renamed")


def b(*versions: int) -> list[tuple[str, int]]:
    return [("session:b", v) for v in versions]


def c(*versions: int) -> list[tuple[str, int]]:
    return [("session:c", v) for v in versions]


# Was: DEFECT (a reader-built tail took the damaged head as read and shifted these reads)
def test_a_record_naming_another_stream_does_not_shift_a_readers_reads(
    store_dir: Path, appender: Callable[..., Appender]
) -> None:
    """What the per-read scan gave (checked against the code before the tail cache): the
    read of session:b stops at the version it lacks with an error naming a position, and
    every read that starts past the damage, of either stream, is whole and in order (the
    damaged record reads as session:c version 3, as nothing can tell it is not).

    Now ``tail_for`` keeps the heads as read: session:b's list lacks version 3 and
    session:c's holds version 3 twice, and ``LogTail.positions`` finds a version by its
    offset from the list's first, so session:b from version 4 starts at 5, session:c from
    5 starts at 4, session:c repeats version 3, and session:b's read yields versions 4..8
    after the gap and then an error naming position -1."""
    renamed_record_store(store_dir, appender)
    reader = open_reader(store_dir)
    try:
        found = {
            (name, first): read_outcome(reader, name, first)
            for name, first in (
                ("session:b", 1),
                ("session:b", 4),
                ("session:c", 1),
                ("session:c", 5),
            )
        }
    finally:
        reader.close()
    assert found == {
        ("session:b", 1): (b(1, 2), "named"),
        ("session:b", 4): (b(4, 5, 6, 7, 8), "end"),
        ("session:c", 1): (c(1, 2, 3, 4, 5, 6, 7, 8), "end"),
        ("session:c", 5): (c(5, 6, 7, 8), "end"),
    }


# Was: DEFECT (the indexer took the damaged head as read; session:b's read returned c's)
def test_a_record_naming_another_stream_is_not_indexed_into_a_foreign_read(
    store_dir: Path, appender: Callable[..., Appender]
) -> None:
    """Another process, which learns the records after the mark from their heads, appends
    past the lag. It used to index the damaged record as session:c version 3, which left
    session:b's index without version 3; ``_indexed_chunk`` counts a batch from its first
    and last versions, so it read one entry past session:b's into session:c's and
    returned session:c version 1 as session:b's last record, with no error. Now the
    heads must follow each other stream by stream: the index stops before the record
    that repeats session:c's version 3, says so once, and every read is whole or names
    a position."""
    renamed_record_store(store_dir, appender)
    other = appender()
    head, indexed = other.append(("session:d", INDEX_LAG + 10))
    assert indexed == 5  # up to the damaged record, which cannot be told from c's own
    assert head == 16 + INDEX_LAG + 10
    reader = open_reader(store_dir)
    try:
        found = {name: read_outcome(reader, name, 1) for name in ("session:b", "session:c")}
        d = [r.version for r in reader.read_stream("session:d")]
    finally:
        reader.close()
    assert found == {"session:b": (b(1, 2), "named"), "session:c": (c(*range(1, 9)), "end")}
    assert d == list(range(1, INDEX_LAG + 11))


UNINDEX = textwrap.dedent(
    """
    import sys
    import lmdb

    path, stream, version = sys.argv[1], sys.argv[2].encode(), int(sys.argv[3])
    env = lmdb.open(path, max_dbs=8)
    with env.begin(write=True) as txn:
        index = env.open_db(b"index", txn=txn)
        assert txn.delete(stream + b"\\x00" + version.to_bytes(8, "big"), db=index)
    env.close()
    """
)


def test_an_index_that_lost_an_entry_never_reads_another_streams_record(
    store_dir: Path, appender: Callable[..., Appender]
) -> None:
    """An index entry deleted by hand (session:b's version 3, its streams interleaved with
    session:c's): a batch counted from its first and last versions would run one entry
    into session:c's. The read yields session:b's versions before the gap and then an
    error naming the record found in its place."""
    child = appender()
    for _ in range(8):
        child.append(("session:b", 1), ("session:c", 1))
    child.append(("session:d", INDEX_LAG))
    child.close()
    subprocess.run(
        [sys.executable, "-c", UNINDEX, str(store_dir), "session:b", "3"],
        check=True,
        timeout=WAIT,
        cwd=ROOT,
    )
    reader = open_reader(store_dir)
    try:
        assert described(reader) == (16 + INDEX_LAG, 16 + INDEX_LAG)
        with pytest.raises(CorruptRecordError) as info:
            list(reader.read_stream("session:b"))
        assert info.value.position == 7  # session:b version 4, where 3 was due
        assert "version 3 of 'session:b'" in str(info.value)
        got: list[int] = []
        with pytest.raises(CorruptRecordError):
            got.extend(r.version for r in reader.read_stream("session:b"))
        assert got == [1, 2]
        assert [r.version for r in reader.read_stream("session:b", 4)] == [4, 5, 6, 7, 8]
        assert [r.version for r in reader.read_stream("session:c")] == list(range(1, 9))
    finally:
        reader.close()


# -- handles, forks, map growth ----------------------------------------------------------------


def test_a_read_only_handle_beside_a_writer_shares_its_tail(
    store_dir: Path, appender: Callable[..., Appender], monkeypatch: pytest.MonkeyPatch
) -> None:
    """One environment per directory per process: the read-only handle reads from the
    writer's tail (no head read), from the tail it extended after another process
    appended, and the writer then adds its next records to that same tail."""
    writer = LmdbEventStore(store_dir)
    reader = open_reader(store_dir)
    env = writer._env
    try:
        assert reader._env is env
        append(writer, "session:a", 40)
        heads = heads_decoded(monkeypatch)
        assert [r.version for r in reader.read_stream("session:a", 40)] == [40]
        assert heads[0] == 0
        child = appender()
        child.append(("session:a", 0), ("session:b", 25))
        assert [r.version for r in reader.read_stream("session:b", 25)] == [25]
        assert heads[0] == 25  # only the other process's records
        extended = env.tail
        assert extended is not None
        assert extended.head == 65
        append(writer, "session:a", 3)  # the writer learns 41..65 itself, then adds
        assert env.tail is not None
        assert env.tail.head == 68
        check_tail(env)
        check_store(reader, {"session:a": 43, "session:b": 25})
        check_store(writer, {"session:a": 43, "session:b": 25})
    finally:
        reader.close()
        writer.close()


def test_a_writer_joining_a_reader_goes_on_from_the_tail_the_reader_kept(
    store_dir: Path, appender: Callable[..., Appender]
) -> None:
    child = appender()
    child.append(("session:a", 30), ("session:b", 30))
    reader = open_reader(store_dir)
    try:
        check_store(reader)
        kept = check_tail(reader._env)
        assert kept is not None
        assert kept.head == 60
        child.close()
        with LmdbEventStore(store_dir) as writer:  # reopens the environment for writing
            assert writer._env is reader._env
            append(writer, "session:a", 5)
            append(writer, "session:new", 2)
            tail = check_tail(reader._env)
            assert tail is kept  # the writer added to the reader's tail in place
            assert tail is not None
            assert tail.head == 67
            check_store(reader, {"session:a": 35, "session:b": 30, "session:new": 2})
            append(writer, "session:b", INDEX_LAG)  # the mark moves to the head
            assert described(writer) == (67 + INDEX_LAG, 67 + INDEX_LAG)
            check_store(reader, {"session:a": 35, "session:b": 30 + INDEX_LAG, "session:new": 2})
            check_tail(reader._env)
        check_store(reader)
    finally:
        reader.close()


def _forked_child(store_dir: str, conn: Any) -> None:
    """In the forked child: open the store again, read it all, append."""
    try:
        with LmdbEventStore(store_dir) as store:
            check_store(store)
            append(store, "session:a", 7)
            append(store, "session:forked", 3)
            check_store(store)
        conn.send("ok")
    except BaseException as exc:  # reported to the parent
        conn.send(f"{type(exc).__name__}: {exc}")


def test_a_forked_child_reads_and_appends_beside_a_reader_with_a_kept_tail(
    store_dir: Path, appender: Callable[..., Appender]
) -> None:
    child = appender()
    child.append(("session:a", 20), ("session:b", 20))
    child.close()
    reader = open_reader(store_dir)
    forked = None
    try:
        check_store(reader)
        assert reader._env.tail is not None
        context = multiprocessing.get_context("fork")
        mine, theirs = context.Pipe()
        forked = context.Process(target=_forked_child, args=(str(store_dir), theirs))
        forked.start()
        assert mine.poll(WAIT), "the forked child said nothing"
        assert mine.recv() == "ok"
        check_store(reader, {"session:a": 27, "session:b": 20, "session:forked": 3})
        tail = check_tail(reader._env)
        assert tail is not None
        assert tail.head == 50
    finally:
        if forked is not None:
            if forked.is_alive():
                forked.kill()
            forked.join(WAIT)
        reader.close()


def test_a_reader_with_a_kept_tail_follows_another_process_growing_the_map(
    store_dir: Path, appender: Callable[..., Appender]
) -> None:
    """A small map: another process grows it (several times) while the reader keeps a tail;
    the reader adopts the new size and reads on."""
    small = 256 * 1024
    child = appender(map_size=small, size=3000)
    child.append(("session:a", 10), ("session:b", 10))
    reader = open_reader(store_dir, map_size=small)
    try:
        check_store(reader)
        assert reader._env.tail is not None
        for _ in range(4):
            child.append(("session:a", 60), ("session:b", 60))
        assert reader._env.env.info()["map_size"] == small
        check_store(reader, {"session:a": 250, "session:b": 250})
        assert reader._env.env.info()["map_size"] > small
        check_tail(reader._env)
    finally:
        reader.close()


def test_check_tail_catches_a_tail_that_does_not_match_the_log(store_dir: Path) -> None:
    """The control for ``check_tail``: a tail that does not match the log is caught."""
    with LmdbEventStore(store_dir) as store:
        append(store, "session:a", 3)
        env = store._env
        assert check_tail(env) is not None
        tail = env.tail
        assert tail is not None
        tail.streams[b"session:a"].append((4, 99))
        with pytest.raises(AssertionError):
            check_tail(env)
