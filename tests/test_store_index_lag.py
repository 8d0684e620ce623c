"""The LMDB store's lagging index: reads on both sides of the ``indexed`` mark, the mark on
disk, the format-1 upgrade, damaged records before and after the mark, other processes.

A real store directory in tmp_path; the raw sub-databases are read and damaged with the
``lmdb`` module only while no store of this process has the directory open (or from
another process). Reads are checked both by a process whose writer knows the records past
the mark (it appended them) and by one that has to scan the log for them.
"""

from __future__ import annotations

import json
import subprocess
import sys
import threading
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import lmdb
import pytest
import structlog

from stalwart import store as store_module
from stalwart.errors import CorruptRecordError, StoreError
from stalwart.events import RecordedEvent
from stalwart.store import EventStore
from stalwart.store._environment import INDEX_LAG, READ_BATCH

from .store_contract import msg

ROOT = Path(__file__).resolve().parents[1]
STREAMS = ("session:a", "session:b", "session:c")
SIZES = (1, 1, 2, 1, 5, 1, 3)  # events per append, cycled against the three streams
GARBAGE = b"\xc1garbage"  # 0xc1 is never valid msgpack
WAIT = 60.0  # seconds a child process may take before the test fails rather than hangs

Pairs = list[tuple[int, int | None]]


# -- the raw store ---------------------------------------------------------------------------


@contextmanager
def raw(store_dir: Path) -> Iterator[tuple[Any, dict[bytes, Any]]]:
    """The store's LMDB environment and its sub-databases, opened with ``lmdb`` alone."""
    env = lmdb.open(str(store_dir), max_dbs=8)
    try:
        yield env, {name: env.open_db(name) for name in (b"log", b"index", b"meta")}
    finally:
        env.close()


def meta(store_dir: Path, key: bytes) -> bytes | None:
    with raw(store_dir) as (env, dbs), env.begin() as txn:
        value = txn.get(key, db=dbs[b"meta"])
        return None if value is None else bytes(value)


def mark(store_dir: Path) -> int:
    value = meta(store_dir, b"indexed")
    assert value is not None
    assert len(value) == 8
    return int.from_bytes(value, "big")


def index(store_dir: Path) -> dict[tuple[str, int], int]:
    """The raw index: (stream, version) -> position."""
    entries: dict[tuple[str, int], int] = {}
    with raw(store_dir) as (env, dbs), env.begin() as txn:
        for raw_key, value in txn.cursor(db=dbs[b"index"]):
            key = bytes(raw_key)
            assert key[-9:-8] == b"\x00"
            stream = key[:-9].decode()
            version = int.from_bytes(key[-8:], "big")
            assert (stream, version) not in entries
            entries[stream, version] = int.from_bytes(value, "big")
    return entries


def damage(store_dir: Path, position: int, value: bytes | None) -> None:
    """Overwrite the log's record at ``position`` with ``value``, or delete it (None)."""
    with raw(store_dir) as (env, dbs), env.begin(write=True) as txn:
        key = position.to_bytes(8, "big")
        if value is None:
            assert txn.delete(key, db=dbs[b"log"])
        else:
            txn.put(key, value, db=dbs[b"log"])


def index_of(records: Iterable[RecordedEvent], up_to: int) -> dict[tuple[str, int], int]:
    return {(r.stream, r.version): r.position for r in records if r.position <= up_to}


# -- appends and reads -----------------------------------------------------------------------


def interleave(store: EventStore, total: int, streams: tuple[str, ...] = STREAMS) -> None:
    """``total`` events over ``streams`` in turn, single and multi-event appends mixed."""
    written = turn = 0
    while written < total:
        size = min(SIZES[turn % len(SIZES)], total - written)
        store.append(streams[turn % len(streams)], [msg(f"{turn}.{k}") for k in range(size)])
        written += size
        turn += 1


def expected(
    records: list[RecordedEvent], stream: str, first: int, last: int | None
) -> list[RecordedEvent]:
    return [
        r
        for r in records
        if r.stream == stream and r.version >= first and (last is None or r.version <= last)
    ]


def pairs_around(records: list[RecordedEvent], stream: str, at: int) -> Pairs:
    """(from_version, to_version) pairs of ``stream``: whole, straddling the position ``at``
    (the mark), past its end, and empty ones."""
    versions = [r.version for r in records if r.stream == stream]
    end = versions[-1]
    v = max((r.version for r in records if r.stream == stream and r.position <= at), default=0)
    return [
        (1, None),
        (0, None),
        (-5, 3),
        (v - 1, v + 1),
        (v, v),
        (v, None),
        (v + 1, None),
        (v + 1, v + 1),
        (max(1, v - 40), v + 40),
        (3, end - 3),
        (end, None),
        (end, end),
        (end + 1, None),
        (10**6, None),
        (10, 9),
        (v + 1, v),
        (1, 2**70),
    ]


def check_reads(store: EventStore, streams: Iterable[str], at: int) -> None:
    records = list(store.read_all())
    assert [r.position for r in records] == list(range(1, len(records) + 1))
    for stream in streams:
        for first, last in pairs_around(records, stream, at):
            read = list(store.read_stream(stream, first, last))
            assert read == expected(records, stream, first, last), (stream, first, last)
    assert list(store.read_stream("session:none")) == []


# -- reads across the mark -------------------------------------------------------------------


def test_a_stream_reads_the_same_on_both_sides_of_the_index_mark(store_dir: Path) -> None:
    total = 2 * INDEX_LAG + 276
    with store_module.open(store_dir) as store:  # type: ignore[attr-defined]
        interleave(store, total)
        assert store.head() == total
        all_records = list(store.read_all())
        # read by the process that wrote them (its writer knows the records past the mark);
        # the mark is where the second index pass left it, at or just past 2 * INDEX_LAG
        check_reads(store, STREAMS, 2 * INDEX_LAG)
    indexed = mark(store_dir)
    # crossed twice: the first index reached at least INDEX_LAG, the second as far again
    assert 2 * INDEX_LAG <= indexed < total
    with store_module.open(store_dir) as store:  # type: ignore[attr-defined]
        # read by a process that has not written: it scans the log past the mark
        check_reads(store, STREAMS, indexed)
        assert list(store.read_all()) == all_records
        # and once it has written, from what its writer learned of the records past the mark
        store.append("session:z", [msg("z")])
        check_reads(store, (*STREAMS, "session:z"), indexed)
    # reopening and an append too few to index move nothing
    assert mark(store_dir) == indexed


def test_reads_agree_while_the_mark_moves_between_them(store_dir: Path) -> None:
    with store_module.open(store_dir) as store:  # type: ignore[attr-defined]
        for _ in range(6):
            interleave(store, INDEX_LAG // 2 + 7)
            records = list(store.read_all())
            for stream in STREAMS:
                assert list(store.read_stream(stream)) == expected(records, stream, 1, None)
                versions = [r.version for r in store.read_stream(stream, 2)]
                assert versions == list(range(2, len(versions) + 2))


def test_a_stream_longer_than_a_read_batch_reads_on_into_its_unindexed_tail(
    store_dir: Path,
) -> None:
    with store_module.open(store_dir) as store:  # type: ignore[attr-defined]
        store.append("session:a", [msg(n) for n in range(READ_BATCH + 100)])
        for n in range(300):
            store.append("session:a" if n % 3 else "session:b", [msg(f"t{n}")])
        head = store.head()
    indexed = mark(store_dir)
    assert indexed == READ_BATCH + 100  # the long append indexed itself, the rest lag
    with store_module.open(store_dir) as store:  # type: ignore[attr-defined]
        check_reads(store, ("session:a", "session:b"), indexed)
        records = list(store.read_all())
        for first, last in [
            (READ_BATCH - 1, READ_BATCH + 2),
            (READ_BATCH + 50, READ_BATCH + 150),
            (2, None),
            (READ_BATCH + 1, None),
        ]:
            read = list(store.read_stream("session:a", first, last))
            assert read == expected(records, "session:a", first, last)
        assert len(records) == head


def test_readers_racing_the_index_passes_read_every_stream_whole(store_dir: Path) -> None:
    readers, appends, rounds = 2, INDEX_LAG + 50, 12
    failures: list[str] = []
    done = threading.Event()
    passes = [0] * readers

    def read(n: int) -> None:
        with store_module.open(store_dir) as store:  # type: ignore[attr-defined]
            while not done.is_set() or passes[n] == 0:
                for stream in STREAMS:
                    # the stream's last versions: the ones about to be indexed, or just were
                    seen = store.stream_version(stream)
                    first = max(1, seen - 60 + passes[n] % 7)
                    try:
                        versions = [r.version for r in store.read_stream(stream, first)]
                    except Exception as exc:
                        failures.append(f"{stream}: {type(exc).__name__}: {exc}")
                        return
                    if versions[: seen - first + 1] != list(range(first, seen + 1)):
                        failures.append(f"{stream} {first}..{seen}: versions {versions}")
                        return
                passes[n] += 1

    with store_module.open(store_dir) as store:  # type: ignore[attr-defined]
        threads = [threading.Thread(target=read, args=(n,)) for n in range(readers)]
        for thread in threads:
            thread.start()
        try:
            for n in range(appends):
                store.append(STREAMS[n % 3], [msg(n)])
            # and an index pass every few appends: a long append indexes itself
            for n in range(rounds):
                for stream in STREAMS:
                    store.append(stream, [msg(f"{n}.{stream}")])
                store.append("session:bulk", [msg(f"bulk{n}.{k}") for k in range(INDEX_LAG)])
        finally:
            done.set()
            for thread in threads:
                thread.join(WAIT)
        assert failures == []
        assert all(passes)
        check_reads(store, STREAMS, store.head())
        head = store.head()
    assert mark(store_dir) == head


# -- the mark on disk --------------------------------------------------------------------------


def test_the_index_holds_one_entry_per_record_up_to_the_mark_and_none_beyond(
    store_dir: Path,
) -> None:
    with store_module.open(store_dir) as store:  # type: ignore[attr-defined]
        assert store.head() == 0
    assert mark(store_dir) == 0  # a new store starts with its mark at 0
    assert meta(store_dir, b"format") == b"stalwart-lmdb-3"
    assert index(store_dir) == {}
    with store_module.open(store_dir) as store:  # type: ignore[attr-defined]
        interleave(store, 2 * INDEX_LAG + 276)
        head = store.head()
        records = list(store.read_all())
    indexed = mark(store_dir)
    assert 0 < indexed <= head
    assert head - indexed < INDEX_LAG
    entries = index(store_dir)
    assert entries == index_of(records, indexed)
    assert len(entries) == indexed  # one per record up to the mark
    assert not any(position > indexed for position in entries.values())


def test_fewer_records_than_the_lag_leave_the_index_empty(store_dir: Path) -> None:
    with store_module.open(store_dir) as store:  # type: ignore[attr-defined]
        for n in range(INDEX_LAG - 1):
            store.append(STREAMS[n % 3], [msg(n)])
    assert mark(store_dir) == 0
    assert index(store_dir) == {}
    with store_module.open(store_dir) as store:  # type: ignore[attr-defined]
        check_reads(store, STREAMS, 0)
        store.append("session:a", [msg("the lag-th")])  # the one that reaches INDEX_LAG
        records = list(store.read_all())
    assert mark(store_dir) == INDEX_LAG
    assert index(store_dir) == index_of(records, INDEX_LAG)


def test_one_append_longer_than_the_lag_leaves_the_index_at_the_head(store_dir: Path) -> None:
    with store_module.open(store_dir) as store:  # type: ignore[attr-defined]
        store.append("session:b", [msg("b1"), msg("b2")])
        store.append("session:a", [msg(n) for n in range(1500)])
        head = store.head()
        records = list(store.read_all())
    assert head == 1502
    assert mark(store_dir) == head
    assert index(store_dir) == index_of(records, head)
    with store_module.open(store_dir) as store:  # type: ignore[attr-defined]
        check_reads(store, ("session:a", "session:b"), head)


# -- the store format ----------------------------------------------------------------------------


def make_format_1(store_dir: Path, records: list[RecordedEvent]) -> None:
    """Turn a closed store into one as format 1 wrote it: every record indexed, no mark."""
    with raw(store_dir) as (env, dbs), env.begin(write=True) as txn:
        for r in records:
            key = r.stream.encode() + b"\x00" + r.version.to_bytes(8, "big")
            txn.put(key, r.position.to_bytes(8, "big"), db=dbs[b"index"])
        txn.put(b"format", b"stalwart-lmdb-1", db=dbs[b"meta"])
        assert txn.delete(b"indexed", db=dbs[b"meta"])


def test_a_format_1_store_is_upgraded_with_its_mark_at_its_head(store_dir: Path) -> None:
    with store_module.open(store_dir) as store:  # type: ignore[attr-defined]
        interleave(store, INDEX_LAG + 300)
        records = list(store.read_all())
    make_format_1(store_dir, records)
    assert meta(store_dir, b"indexed") is None
    assert index(store_dir) == index_of(records, len(records))
    with (
        structlog.testing.capture_logs() as logs,
        store_module.open(store_dir) as store,  # type: ignore[attr-defined]
    ):
        assert list(store.read_all()) == records
        check_reads(store, STREAMS, len(records))
    assert [e["event"] for e in logs if e["event"] == "store.format_upgraded"] == [
        "store.format_upgraded"
    ]
    assert meta(store_dir, b"format") == b"stalwart-lmdb-3"
    assert mark(store_dir) == len(records)
    # and it goes on as a format-2 store: the next appends lag, then index, as usual
    with store_module.open(store_dir) as store:  # type: ignore[attr-defined]
        interleave(store, INDEX_LAG + 10)
        head = store.head()
        records = list(store.read_all())
        check_reads(store, STREAMS, len(records))
    indexed = mark(store_dir)
    assert head - indexed < INDEX_LAG
    assert index(store_dir) == index_of(records, indexed)


def test_an_empty_format_1_store_is_upgraded_with_its_mark_at_0(store_dir: Path) -> None:
    with store_module.open(store_dir) as store:  # type: ignore[attr-defined]
        assert store.head() == 0
    make_format_1(store_dir, [])
    with store_module.open(store_dir) as store:  # type: ignore[attr-defined]
        assert list(store.read_stream("session:a")) == []
        store.append("session:a", [msg(1)])
        assert [r.version for r in store.read_stream("session:a")] == [1]
    assert meta(store_dir, b"format") == b"stalwart-lmdb-3"
    assert mark(store_dir) == 0


def test_a_store_of_an_unknown_format_is_refused(store_dir: Path) -> None:
    with store_module.open(store_dir) as store:  # type: ignore[attr-defined]
        store.append("session:a", [msg(1)])
    with raw(store_dir) as (env, dbs), env.begin(write=True) as txn:
        txn.put(b"format", b"stalwart-lmdb-9", db=dbs[b"meta"])
    with pytest.raises(StoreError, match="stalwart-lmdb-9"):
        store_module.open(store_dir)


# -- damaged records -----------------------------------------------------------------------------


def two_streams(store: EventStore, count: int) -> dict[str, list[RecordedEvent]]:
    """``count`` single-event appends to each of session:a and session:b, alternating."""
    written: dict[str, list[RecordedEvent]] = {"session:a": [], "session:b": []}
    for n in range(count):
        for stream in written:
            written[stream] += store.append(stream, [msg(f"{stream}{n}")])
    return written


@pytest.mark.parametrize("broken_version", [5, 10])
@pytest.mark.parametrize("damaged", [GARBAGE, None], ids=["garbage", "deleted"])
def test_a_damaged_record_in_the_unindexed_tail_fails_only_its_own_stream(
    store_dir: Path, broken_version: int, damaged: bytes | None
) -> None:
    with store_module.open(store_dir) as store:  # type: ignore[attr-defined]
        written = two_streams(store, 10)
    assert mark(store_dir) == 0  # every record is in the tail
    broken = written["session:a"][broken_version - 1].position
    damage(store_dir, broken, damaged)
    with store_module.open(store_dir) as store:  # type: ignore[attr-defined]
        assert list(store.read_stream("session:b")) == written["session:b"]
        assert list(store.read_stream("session:b", 3, 8)) == written["session:b"][2:8]
        read: list[RecordedEvent] = []
        with pytest.raises(CorruptRecordError) as info:
            read.extend(store.read_stream("session:a"))
        assert info.value.position == broken
        if damaged is None:
            assert "missing" in str(info.value)
        assert read == written["session:a"][: broken_version - 1]
        before = list(store.read_stream("session:a", 1, broken_version - 1))
        assert before == written["session:a"][: broken_version - 1]
        after = list(store.read_stream("session:a", broken_version + 1))
        assert after == written["session:a"][broken_version:]
        with pytest.raises(CorruptRecordError) as info:
            list(store.read_stream("session:a", broken_version, broken_version))
        assert info.value.position == broken


@pytest.mark.parametrize("damaged", [GARBAGE, None], ids=["garbage", "deleted"])
def test_two_damaged_records_in_the_tail_each_fail_their_own_stream(
    store_dir: Path, damaged: bytes | None
) -> None:
    with store_module.open(store_dir) as store:  # type: ignore[attr-defined]
        written = two_streams(store, 10)
    broken_b = written["session:b"][1].position  # version 2, before a's
    broken_a = written["session:a"][6].position  # version 7
    damage(store_dir, broken_b, damaged)
    damage(store_dir, broken_a, damaged)
    with store_module.open(store_dir) as store:  # type: ignore[attr-defined]
        for stream, broken, version in (("session:a", broken_a, 7), ("session:b", broken_b, 2)):
            read: list[RecordedEvent] = []
            with pytest.raises(CorruptRecordError) as info:
                read.extend(store.read_stream(stream))
            assert info.value.position == broken, stream
            assert read == written[stream][: version - 1]
            assert list(store.read_stream(stream, version + 1)) == written[stream][version:]


@pytest.mark.parametrize("damaged", [GARBAGE, None], ids=["garbage", "deleted"])
def test_a_damaged_record_before_the_mark_fails_only_its_own_stream(
    store_dir: Path, damaged: bytes | None
) -> None:
    with store_module.open(store_dir) as store:  # type: ignore[attr-defined]
        written = two_streams(store, INDEX_LAG // 2 + 100)
    indexed = mark(store_dir)
    broken = written["session:a"][40].position
    assert broken < indexed < written["session:a"][-1].position
    damage(store_dir, broken, damaged)
    with store_module.open(store_dir) as store:  # type: ignore[attr-defined]
        assert list(store.read_stream("session:b")) == written["session:b"]
        read: list[RecordedEvent] = []
        with pytest.raises(CorruptRecordError) as info:
            read.extend(store.read_stream("session:a"))
        assert info.value.position == broken
        assert read == written["session:a"][:40]
        assert list(store.read_stream("session:a", 42)) == written["session:a"][41:]


@pytest.mark.parametrize("damaged", [GARBAGE, None], ids=["garbage", "deleted"])
def test_indexing_stops_before_a_damaged_record_and_loses_nothing(
    store_dir: Path, damaged: bytes | None
) -> None:
    with store_module.open(store_dir) as store:  # type: ignore[attr-defined]
        written = two_streams(store, 5)
    broken = written["session:a"][2].position  # session:a version 3, position 5
    damage(store_dir, broken, damaged)
    with (
        structlog.testing.capture_logs() as logs,
        store_module.open(store_dir) as store,  # type: ignore[attr-defined]
    ):
        b = written["session:b"]
        b += store.append("session:b", [msg(f"big{n}") for n in range(INDEX_LAG + 100)])
        for n in range(50):  # each of these finds the index still too far behind
            b += store.append("session:b", [msg(f"more{n}")])
        a = written["session:a"] + store.append("session:a", [msg("a6")])
        head = store.head()
        assert list(store.read_stream("session:b")) == b
        assert [r.version for r in b] == list(range(1, len(b) + 1))
        assert list(store.read_all(broken + 1)) == sorted(
            [r for r in [*a, *b] if r.position > broken], key=lambda r: r.position
        )
        read: list[RecordedEvent] = []
        with pytest.raises(CorruptRecordError) as info:
            read.extend(store.read_stream("session:a"))
        assert info.value.position == broken
        assert read == a[:2]
        assert list(store.read_stream("session:a", 4)) == a[3:]
    assert head == 10 + INDEX_LAG + 100 + 50 + 1
    assert mark(store_dir) == broken - 1  # every record before the damaged one is indexed
    assert index(store_dir) == index_of([*a, *b], broken - 1)
    stalls = [e for e in logs if e["event"] == "store.index_stalled"]
    assert len(stalls) == 1  # once per stall position, not once per append
    assert stalls[0]["position"] == broken
    assert stalls[0]["log_level"] == "warning"
    # a later process reads the same
    with store_module.open(store_dir) as store:  # type: ignore[attr-defined]
        assert list(store.read_stream("session:b")) == b
        assert list(store.read_stream("session:a", 4)) == a[3:]


def test_a_stalled_index_still_reads_a_long_stream_a_batch_at_a_time(store_dir: Path) -> None:
    with store_module.open(store_dir) as store:  # type: ignore[attr-defined]
        written = two_streams(store, 5)
    broken = written["session:a"][2].position
    damage(store_dir, broken, GARBAGE)
    with store_module.open(store_dir) as store:  # type: ignore[attr-defined]
        b = written["session:b"]
        b += store.append("session:b", [msg(f"long{n}") for n in range(2 * READ_BATCH + 10)])
        assert list(store.read_stream("session:b")) == b
        assert list(store.read_stream("session:b", READ_BATCH)) == b[READ_BATCH - 1 :]
        assert list(store.read_stream("session:b", 3, 3 + READ_BATCH)) == b[2 : 3 + READ_BATCH]
    assert mark(store_dir) == broken - 1


# -- other processes -----------------------------------------------------------------------------

CHILD = """
import json, sys
from pathlib import Path

import lmdb
import structlog

from stalwart import store as store_module
from stalwart.events import MessageAppended

def mark(path):
    if not Path(path, "data.mdb").exists():
        return 0
    env = lmdb.open(path, max_dbs=8)
    try:
        with env.begin() as txn:
            value = txn.get(b"indexed", db=env.open_db(b"meta", txn=txn))
            return int.from_bytes(value, "big")
    finally:
        env.close()

structlog.configure(logger_factory=structlog.PrintLoggerFactory(sys.stderr))
path, tag, count, *streams = sys.argv[1:]
before = mark(path)
with store_module.open(path) as store:
    for n in range(int(count)):
        event = MessageAppended(message_id=f"{tag}{n}", role="user", content="x")
        store.append(streams[n % len(streams)], [event])
    records = list(store.read_all())
    names = sorted({r.stream for r in records})
    wrong = [
        name for name in names
        if list(store.read_stream(name)) != [r for r in records if r.stream == name]
    ]
    head = store.head()
print(json.dumps({"before": before, "after": mark(path), "head": head, "wrong": wrong}))
"""


DAMAGE = """
import sys

import lmdb

path, position, how = sys.argv[1], int(sys.argv[2]), sys.argv[3]
env = lmdb.open(path, max_dbs=8)
with env.begin(write=True) as txn:
    log = env.open_db(b"log", txn=txn)
    key = position.to_bytes(8, "big")
    if how == "deleted":
        assert txn.delete(key, db=log)
    else:
        txn.put(key, b"\\xc1garbage", db=log)
env.close()
print("damaged")
"""


def run_child(code: str, *args: object) -> str:
    """Run ``code`` in a new Python process with ``args``; its last line of output."""
    done = subprocess.run(
        [sys.executable, "-c", code, *map(str, args)],
        check=False,
        capture_output=True,
        text=True,
        timeout=WAIT,
        cwd=ROOT,
    )
    assert done.returncode == 0, done.stderr
    return done.stdout.strip().splitlines()[-1]


def child_appends(store_dir: Path, tag: str, count: int, *streams: str) -> dict[str, Any]:
    """Run a process that appends ``count`` single events to ``streams`` in turn, then
    checks every stream it sees; its report: marks before and after, head, wrong streams."""
    report: dict[str, Any] = json.loads(run_child(CHILD, store_dir, tag, count, *streams))
    assert report["wrong"] == [], report
    return report


def parent_appends(store: EventStore, tag: str, count: int, *streams: str) -> None:
    for n in range(count):
        store.append(streams[n % len(streams)], [msg(f"{tag}{n}")])


def check_whole(store: EventStore) -> list[RecordedEvent]:
    records = list(store.read_all())
    assert [r.position for r in records] == list(range(1, len(records) + 1))
    for name in {r.stream for r in records}:
        read = list(store.read_stream(name))
        assert read == [r for r in records if r.stream == name]
        assert [r.version for r in read] == list(range(1, len(read) + 1))
    return records


def test_records_another_process_appended_past_the_lag_read_whole(store_dir: Path) -> None:
    count = INDEX_LAG + 100
    report = child_appends(store_dir, "x", count, "session:x")
    assert report["head"] == count
    assert report["after"] >= INDEX_LAG
    assert count - report["after"] < INDEX_LAG
    assert mark(store_dir) == report["after"]
    with store_module.open(store_dir) as store:  # type: ignore[attr-defined]
        records = check_whole(store)
        read = list(store.read_stream("session:x"))
        assert [r.event.message_id for r in read] == [f"x{n}" for n in range(count)]
        assert len(records) == count


@pytest.mark.parametrize("keep_open", [False, True], ids=["closed", "kept-open"])
def test_processes_taking_turns_index_each_others_records(store_dir: Path, keep_open: bool) -> None:
    shared = "session:shared"
    first = child_appends(store_dir, "c1.", 300, "session:x", shared)
    assert first["head"] == 300
    assert first["after"] == 0  # nothing indexed yet

    store = store_module.open(store_dir)
    try:
        parent_appends(store, "p.", 300, "session:y", shared)
        check_whole(store)
        if not keep_open:
            store.close()
            # the parent indexed the child's records: the mark is past all 300 of them
            assert 300 <= mark(store_dir) < 600
        second = child_appends(store_dir, "c2.", 500, "session:x", shared)
        assert 300 <= second["before"] < 600  # the parent indexed the child's records
        assert second["after"] >= 600  # and the child the parent's
        assert second["head"] == 1100
        if not keep_open:
            store = store_module.open(store_dir)
        records = check_whole(store)
        assert len(records) == 1100
        counts = {name: store.stream_version(name) for name in ("session:x", "session:y", shared)}
        assert counts == {"session:x": 400, "session:y": 150, shared: 550}
        # the parent's writer goes on from what the child wrote, not from what it last saw
        appended = store.append(shared, [msg("last")], expected_version=550)
        assert [(r.position, r.version) for r in appended] == [(1101, 551)]
        check_whole(store)
    finally:
        store.close()
    assert 1101 - second["after"] < INDEX_LAG
    assert mark(store_dir) == second["after"]  # the last append did not index again
    with store_module.open(store_dir) as store:  # type: ignore[attr-defined]
        records = check_whole(store)
    assert index(store_dir) == index_of(records, second["after"])


def test_records_another_process_appended_are_read_past_what_this_writer_knows(
    store_dir: Path,
) -> None:
    store = store_module.open(store_dir)
    try:
        parent_appends(store, "p.", 100, "session:a", "session:b")
        check_whole(store)  # from what the parent's writer knows of the records past the mark
        report = child_appends(store_dir, "c.", 60, "session:a", "session:c")
        assert report["head"] == 160
        assert report["after"] == 0  # nothing indexed: every record is past the mark
        # session:a and session:c go on past what the parent's writer knows; session:b not
        records = check_whole(store)
        assert len(records) == 160
        versions = {name: store.stream_version(name) for name in ("session:a", "session:b")}
        assert versions == {"session:a": 80, "session:b": 50}
        assert [r.version for r in store.read_stream("session:c")] == list(range(1, 31))
        # the parent's writer learns the child's records, and its readers with it
        parent_appends(store, "q.", 20, "session:b", "session:c")
        records = check_whole(store)
        assert len(records) == 180
        assert store.stream_version("session:c") == 40
    finally:
        store.close()
    assert mark(store_dir) == 0


@pytest.mark.parametrize("damaged", ["garbage", "deleted"])
def test_a_record_damaged_by_another_process_fails_only_its_own_stream(
    store_dir: Path, damaged: str
) -> None:
    store = store_module.open(store_dir)
    try:
        written = two_streams(store, 5)
        a, b = written["session:a"], written["session:b"]
        broken = a[2].position  # session:a version 3, known to the parent's writer
        assert run_child(DAMAGE, store_dir, broken, damaged) == "damaged"
        for _ in range(2):  # before and after appends past the lag
            assert list(store.read_stream("session:b")) == b
            read: list[RecordedEvent] = []
            with pytest.raises(CorruptRecordError) as info:
                read.extend(store.read_stream("session:a"))
            assert info.value.position == broken
            assert read == a[:2]
            assert list(store.read_stream("session:a", 4)) == a[3:]
            b += store.append("session:b", [msg(f"big{n}") for n in range(INDEX_LAG + 100)])
            for n in range(20):
                b += store.append("session:b", [msg(f"more{n}")])
            a += store.append("session:a", [msg("a")])
    finally:
        store.close()
    # the parent's writer indexes from what it knows of the records it appended, not from
    # their bytes: its mark may pass the damaged record (it does today); nothing is lost
    indexed = mark(store_dir)
    assert indexed >= broken - 1
    assert index(store_dir) == index_of([*a, *b], indexed)
    with store_module.open(store_dir) as store:  # type: ignore[attr-defined]
        assert list(store.read_stream("session:b")) == b
        with pytest.raises(CorruptRecordError) as info:
            list(store.read_stream("session:a"))
        assert info.value.position == broken
        assert list(store.read_stream("session:a", 4)) == a[3:]
