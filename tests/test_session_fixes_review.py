"""Review of two commits: LMDB heads read back from the log must continue each stream's
run of versions, and reads check each batch's two ends (``ac24311``); a PostgreSQL
store's pool records why its last connect failed, refusals are StoreErrors, waits are
bounded, and a subscription logs the store's return at once (``d64366d``).

Real parts: LMDB directories in ``tmp_path`` appended to by real subprocesses, the test
session's PostgreSQL (a relay, a unix-socket path, roles the test creates), ``stalwart``
run as a subprocess. Tests marked ``# Was: DEFECT:`` failed on the code reviewed and pass
since the fix.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import random
import shutil
import socket
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
from collections.abc import Callable, Iterator, MutableMapping
from pathlib import Path
from typing import Any

import lmdb
import psycopg
import pytest

from stalwart.errors import ConcurrencyError, CorruptRecordError, StoreError, StoreUnavailableError
from stalwart.events import DEFAULT_CODEC, MessageAppended, RecordedEvent
from stalwart.store import LmdbEventStore, PostgresEventStore, Subscription, _environment
from stalwart.store._environment import INDEX_LAG, READ_BATCH
from stalwart.store._lmdb_tail import Entry, read_heads
from stalwart.store._postgres_connect import refused
from stalwart.testing import PostgresServer
from tests._relay import CuttingRelay, schema_of
from tests._runtime_support import CollectedProcess, LineProcess, until

Logs = list[MutableMapping[str, Any]]

ROOT = Path(__file__).resolve().parents[1]
WAIT = 60.0  # the most a child process, a thread or a reconnecting pool may take
_roles = itertools.count(1)


def msg(stream: str, version: int, size: int = 1) -> MessageAppended:
    return MessageAppended(message_id=f"{stream}|{version}", role="user", content="x" * size)


def append(store: LmdbEventStore, stream: str, count: int) -> list[RecordedEvent]:
    """``count`` events at the stream's next versions (again on a conflict with another
    process)."""
    while True:
        version = store.stream_version(stream)
        news = [msg(stream, version + n) for n in range(1, count + 1)]
        try:
            return store.append(stream, news, expected_version=version)
        except ConcurrencyError:
            continue


def check_run(records: list[RecordedEvent], stream: str, first: int) -> None:
    """``records`` are ``stream``'s versions from ``first`` on, each the event appended at
    that version, in log order."""
    assert [r.version for r in records] == list(range(first, first + len(records))), stream
    for record in records:
        assert record.stream == stream, record
        assert isinstance(record.event, MessageAppended), record
        assert record.event.message_id == f"{stream}|{record.version}", record
    positions = [r.position for r in records]
    assert positions == sorted(set(positions)), stream


def named(logs: Logs, name: str) -> list[MutableMapping[str, Any]]:
    return [entry for entry in list(logs) if entry["event"] == name]


# == ac24311: LMDB, the continuity rule on a healthy store ===================================

CHILD = textwrap.dedent(
    """
    import json, random, sys, threading, time
    import structlog.testing
    from stalwart.errors import ConcurrencyError
    from stalwart.events import MessageAppended
    from stalwart.store import LmdbEventStore, Snapshot, _environment

    path, mode, map_size, seed = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
    troubles = []  # every head read back that the continuity rule (or anything) refused
    seeded = [0]  # reads of heads checked against versions known before them
    _read_heads = _environment.read_heads

    def spied(*args, **kwargs):
        if len(args) > 3 and args[3]:
            seeded[0] += 1
        entries, trouble = _read_heads(*args, **kwargs)
        if trouble is not None:
            troubles.append([trouble[0], trouble[1]])
        return entries, trouble

    _environment.read_heads = spied
    rng = random.Random(seed)

    def event(stream, version):
        return MessageAppended(message_id=f"{stream}|{version}", role="user", content="y" * 150)

    def append_plan(store, plan):
        for stream, count in plan:
            while True:
                version = store.stream_version(stream)
                news = [event(stream, version + n) for n in range(1, count + 1)]
                try:
                    store.append(stream, news, expected_version=version)
                    break
                except ConcurrencyError:
                    continue
            if rng.random() < 0.05:  # a batch of the writer with no log record in it
                store.put_snapshot(
                    Snapshot(stream=stream, name="fold", version=1, position=1, data=b"s")
                )

    def read_all_streams(store, bad):
        for info in store.streams():
            name = info.stream
            for first in (1, max(1, info.version - 3), max(1, info.version // 2)):
                records = list(store.read_stream(name, first))
                versions = [r.version for r in records]
                if versions[: info.version - first + 1] != list(range(first, info.version + 1)):
                    bad.append([name, first, versions[:5], info.version])
                elif versions != list(range(first, first + len(versions))):
                    bad.append([name, first, "not contiguous"])
                elif any(r.stream != name or r.event.message_id != f"{name}|{r.version}"
                         for r in records):
                    bad.append([name, first, "a foreign record"])

    with structlog.testing.capture_logs() as logs:
        if mode == "read":
            store = LmdbEventStore(path, create=False, read_only=True, map_size=map_size)
        else:
            store = LmdbEventStore(path, map_size=map_size)
        print("ready", flush=True)
        for line in sys.stdin:
            command = json.loads(line)
            bad = []
            if mode == "read":
                ends = time.monotonic() + command["for"]
                reads = 0
                while time.monotonic() < ends or reads < 2:
                    read_all_streams(store, bad)
                    reads += 1
            else:
                plans = command["plans"]
                threads = [
                    threading.Thread(target=append_plan, args=(store, plan)) for plan in plans
                ]
                for thread in threads:
                    thread.start()
                for thread in threads:
                    thread.join()
                read_all_streams(store, bad)
            info = store.describe()
            stalled = [dict(e) for e in logs if e["event"] == "store.index_stalled"]
            print(json.dumps({
                "head": info["head"], "indexed": info["indexed"], "format": info["format"],
                "troubles": troubles, "stalled": stalled, "bad": bad, "seeded": seeded[0],
                "grown": len([e for e in logs if e["event"] == "store.map_grown"]),
            }, default=str), flush=True)
        store.close()
    """
)


class Child(LineProcess):
    """A Python process with the store open (``mode``: "append" or "read"), doing what it
    is told one JSON line at a time and answering with one."""

    def __init__(self, store_dir: Path, mode: str, seed: int, map_size: int) -> None:
        argv = [sys.executable, "-c", CHILD, str(store_dir), mode, str(map_size), str(seed)]
        super().__init__(argv, ROOT, "the child process", WAIT)


@pytest.fixture
def children(store_dir: Path) -> Iterator[Callable[..., Child]]:
    started: list[Child] = []

    def start(mode: str, seed: int = 0, map_size: int = 1 << 20) -> Child:
        started.append(Child(store_dir, mode, seed, map_size))
        return started[-1]

    yield start
    for child in started:
        child.close()


def spy_read_heads(monkeypatch: pytest.MonkeyPatch) -> tuple[list[tuple[int, str]], list[int]]:
    """Every head this process read back that was refused (the rule fired), and how many
    reads of heads were checked against versions known before them."""
    troubles: list[tuple[int, str]] = []
    seeded = [0]
    real = read_heads  # what _environment calls

    def spied(*args: Any, **kwargs: Any) -> tuple[list[Entry], tuple[int, str] | None]:
        if len(args) > 3 and args[3]:
            seeded[0] += 1
        entries, trouble = real(*args, **kwargs)
        if trouble is not None:
            troubles.append(trouble)
        return entries, trouble

    monkeypatch.setattr(_environment, "read_heads", spied)
    return troubles, seeded


def make_format_1(store_dir: Path) -> int:
    """Turn a closed store into one as format 1 wrote it (every record indexed, no mark);
    its head."""
    env = lmdb.open(str(store_dir), max_dbs=8)
    try:
        with env.begin(write=True) as txn:
            log = env.open_db(b"log", txn=txn)
            index = env.open_db(b"index", txn=txn)
            meta = env.open_db(b"meta", txn=txn)
            head = 0
            for key, value in txn.cursor(db=log):
                record = DEFAULT_CODEC.decode(bytes(value))
                entry = record.stream.encode() + b"\x00" + record.version.to_bytes(8, "big")
                txn.put(entry, bytes(key), db=index)
                head = record.position
            txn.put(b"format", b"stalwart-lmdb-1", db=meta)
            assert txn.delete(b"indexed", db=meta)
    finally:
        env.close()
    return head


def plans(round_: int, seed: int, threads: int = 2) -> list[list[tuple[str, int]]]:
    """Each thread's appends for one round: streams shared by every process (each round
    adds new ones, whose first records come after the mark), of 1..6 events each, and one
    long stream appended in runs."""
    rng = random.Random(seed * 1000 + round_)
    shared = [f"session:s{n}" for n in range(16)] + [f"session:r{round_}-{n}" for n in range(4)]
    out = []
    for _ in range(threads):
        plan = [(rng.choice(shared), rng.randint(1, 6)) for _ in range(60)]
        plan.insert(rng.randrange(len(plan)), ("session:long", 150))
        out.append(plan)
    return out


def test_the_continuity_rule_never_fires_on_a_healthy_store_appended_by_several_processes(
    store_dir: Path,
    children: Callable[..., Child],
    monkeypatch: pytest.MonkeyPatch,
    logs: Logs,
) -> None:
    """A format-1 store, opened read-only by one process (which reads it as format 1) and
    then for writing by three others (the first upgrades it; each appends from two
    threads, with retries on conflicts, snapshots between, a 1 MiB map that must grow),
    and by this process too (a writer whose ``_learn`` is seeded from what it knew, and
    reads that extend a kept tail), for four rounds of > 2 * 512 records each, with the
    reader reading every stream from several versions all the while. No process ever
    refuses a head it reads back (``read_heads`` returns no trouble: the rule never
    fires), nobody logs ``store.index_stalled``, the mark keeps up with the head, and
    every stream reads whole."""
    troubles, seeded = spy_read_heads(monkeypatch)
    with LmdbEventStore(store_dir) as seed:
        for n in range(40):
            append(seed, f"session:s{n % 16}", 1 + n % 3)
    format_1_head = make_format_1(store_dir)
    reader = children("read", 0)
    writers = [children("append", n + 1) for n in range(3)]
    here = LmdbEventStore(store_dir, map_size=1 << 20)
    try:
        last_head = format_1_head
        checked, grown, extended = 0, 0, 0
        for round_ in range(4):
            reader.send({"for": 1.0})
            for n, child in enumerate(writers):
                child.send({"plans": plans(round_, n)})
            for n in range(40):  # this process appends beside them, and reads
                append(here, f"session:s{(n * 7) % 16}", 1 + n % 4)
                if n % 10 == 0:
                    for stream in ("session:long", "session:s3", f"session:r{round_}-1"):
                        check_run(list(here.read_stream(stream)), stream, 1)
            answers = [child.answer() for child in [*writers, reader]]
            for answer in answers:
                assert answer["troubles"] == [], answer["troubles"]
                assert answer["stalled"] == [], answer["stalled"]
                assert answer["bad"] == [], answer["bad"]
                assert answer["format"] == "stalwart-lmdb-3"
            checked = sum(answer["seeded"] for answer in answers)
            extended = answers[-1]["seeded"]  # the reader's: kept tails it extended
            grown = sum(answer["grown"] for answer in answers)
            info = here.describe()
            head, indexed = int(info["head"]), int(info["indexed"])
            assert head - last_head > 2 * INDEX_LAG, "each round appends > 2 * 512 records"
            assert head - indexed < INDEX_LAG, (round_, head, indexed)
            last_head = head
        assert troubles == []
        assert named(logs, "store.index_stalled") == []
        # the paths under review ran: heads checked against a seed, here and there
        assert seeded[0] > 0, seeded
        assert checked > 0, checked
        assert extended > 0, extended
        assert grown > 0 or named(logs, "store.map_grown"), "no map grew"
        records = list(here.read_all())
        assert [r.position for r in records] == list(range(1, head + 1))
        by_stream: dict[str, list[RecordedEvent]] = {}
        for record in records:
            by_stream.setdefault(record.stream, []).append(record)
        for stream, written in by_stream.items():
            check_run(written, stream, 1)
            assert list(here.read_stream(stream)) == written
        long = by_stream["session:long"]
        assert len(long) > 2 * READ_BATCH
        for first in (READ_BATCH - 1, READ_BATCH, READ_BATCH + 1, 2 * READ_BATCH + 1):
            assert list(here.read_stream("session:long", first)) == long[first - 1 :]
        assert troubles == []
    finally:
        here.close()


# -- reads: the two ends of each batch --------------------------------------------------------


def raw_edit(store_dir: Path, edit: Callable[[Any, Any, Any], None]) -> None:
    """``edit(txn, log, index)`` on a closed store, as damage by hand would be."""
    env = lmdb.open(str(store_dir), max_dbs=8)
    try:
        with env.begin(write=True) as txn:
            edit(txn, env.open_db(b"log", txn=txn), env.open_db(b"index", txn=txn))
    finally:
        env.close()


def _key(n: int) -> bytes:
    return n.to_bytes(8, "big")


def outcome(store: LmdbEventStore, stream: str, first: int = 1) -> tuple[list[int], str]:
    """The versions a read yields, and how it ended ("end" or the error's position)."""
    versions: list[int] = []
    try:
        versions.extend(r.version for r in store.read_stream(stream, first))
    except CorruptRecordError as exc:
        return versions, f"error at {exc.position}"
    return versions, "end"


def test_reads_from_the_middle_of_a_batch_agree_with_the_log_on_every_path(
    store_dir: Path,
) -> None:
    """A stream whose versions lie in the index (two streams interleaved, then runs) and
    after the mark: reads from and to versions inside a batch, across the batch size and
    across the mark, through the writer's tail and through a read-only handle's own tail
    (in another process's view: a fresh process), equal the log's slice."""
    with LmdbEventStore(store_dir) as store:
        for _ in range(20):
            append(store, "session:b", 1)
            append(store, "session:c", 1)
        append(store, "session:b", READ_BATCH + 300)  # indexed: more than the lag
        for _ in range(50):
            append(store, "session:b", 3)  # after the mark
            append(store, "session:c", 1)
        info = store.describe()
        assert int(info["head"]) - int(info["indexed"]) > 0
        written = [r for r in store.read_all() if r.stream == "session:b"]
        total = len(written)
        points = sorted(
            {1, 2, 19, 20, 21, READ_BATCH - 1, READ_BATCH, READ_BATCH + 1, total - 150}
            | {total - 1, total, total + 1, READ_BATCH + 320, 2 * READ_BATCH}
        )
        for first in points:
            assert list(store.read_stream("session:b", first)) == written[first - 1 :], first
            for last in (first, first + 1, first + 500, total - 1):
                expected = written[first - 1 : last] if last >= first else []
                got = list(store.read_stream("session:b", first, last))
                assert got == expected, (first, last)
    reader = LmdbEventStore(store_dir, create=False, read_only=True)
    try:
        for first in points:
            assert list(reader.read_stream("session:b", first)) == written[first - 1 :], first
            got = list(reader.read_stream("session:b", first, first + 2))
            assert got == written[first - 1 : first + 2]
    finally:
        reader.close()


def interleaved_then_indexed(store_dir: Path, long: int = 0) -> None:
    """session:b and session:c, versions 1..8 each, alternating (b at odd positions 1..15,
    c at even 2..16), then ``long`` more of session:b in one run, then enough of session:d
    that every record is indexed."""
    with LmdbEventStore(store_dir) as store:
        for _ in range(8):
            append(store, "session:b", 1)
            append(store, "session:c", 1)
        if long:
            append(store, "session:b", long)
        append(store, "session:d", INDEX_LAG)
        info = store.describe()
        assert info["head"] == info["indexed"]


# Was: DEFECT: an index entry lost at the first version of a read's batch is skipped in silence
def test_an_index_entry_lost_at_the_first_version_of_a_batch_is_not_skipped_in_silence(
    store_dir: Path,
) -> None:
    """The docs: "A read also checks that the first and last records of each batch it
    takes from the index ... are the stream's versions it asked for, and names the first
    one that is not (an index entry deleted by hand would otherwise make a batch run into
    the next stream's entries)". ``_indexed_chunk`` checks the batch against the first
    version the index *has* at or after the one asked for (``low``), not against the one
    asked for: with the entry of session:b's version 1025 (the first of the read's
    second batch) deleted, a read of the whole stream yields 1..1024 and 1026.. with no
    error, and so does a read from version 1025; the same for version 1 or any
    ``from_version`` whose entry is gone. A deleted entry in the middle of a batch is
    named (the commit's own test)."""
    interleaved_then_indexed(store_dir, long=READ_BATCH + 20)
    lost = READ_BATCH + 1
    raw_edit(store_dir, lambda txn, log, index: txn.delete(b"session:b\x00" + _key(lost), db=index))
    reader = LmdbEventStore(store_dir, create=False, read_only=True)
    try:
        whole, ended = outcome(reader, "session:b")
        assert lost not in whole
        skipped = [v for v in whole if v > lost]
        said = f"it yielded {whole[lost - 3 : lost + 1]}... and ended with {ended!r}"
        assert skipped == [], f"the read skipped version {lost} with no error: {said}"
        assert ended != "end", said
        assert outcome(reader, "session:b", lost)[0] == []
    finally:
        reader.close()


# Was: DEFECT: a misplaced record is named by the position it claims, not the one it is stored at
def test_a_misplaced_record_is_named_by_the_position_it_is_stored_at(store_dir: Path) -> None:
    """A record of session:b (position 15, its version 8, the last of its batch) overwritten
    by a copy of the record at position 16 (session:c's version 8), both indexed. The read
    of session:b stops there, as it should, but its CorruptRecordError names position 16,
    the position the copy *says* it is at (``_misplaced`` names ``record.position``):
    the record at 16 is session:c's own and whole (session:c's read gives it), and the
    damage is at 15, which the log scan names ("the record says it is at 16")."""
    interleaved_then_indexed(store_dir)

    def copy(txn: Any, log: Any, index: Any) -> None:
        txn.put(_key(15), bytes(txn.get(_key(16), db=log)), db=log)

    raw_edit(store_dir, copy)
    reader = LmdbEventStore(store_dir, create=False, read_only=True)
    try:
        c = [(r.position, r.version) for r in reader.read_stream("session:c")]
        assert c[-1] == (16, 8)  # the record at 16 is whole
        with pytest.raises(CorruptRecordError) as info:
            list(reader.read_stream("session:b"))
        assert "found as version 8 of 'session:b'" in str(info.value)
        assert info.value.position == 15, str(info.value)
    finally:
        reader.close()


def test_a_misplaced_record_error_says_what_was_due_and_what_was_found(store_dir: Path) -> None:
    """An index entry deleted by hand in the middle of a batch (session:c's version 5):
    the read yields versions 1..4, then names the record found in 5's place (version 6,
    at position 12) with both versions, and a read from version 6 is whole."""
    interleaved_then_indexed(store_dir)
    raw_edit(store_dir, lambda txn, log, index: txn.delete(b"session:c\x00" + _key(5), db=index))
    reader = LmdbEventStore(store_dir, create=False, read_only=True)
    try:
        got: list[int] = []
        with pytest.raises(CorruptRecordError) as info:
            got.extend(r.version for r in reader.read_stream("session:c"))
        assert got == [1, 2, 3, 4]
        assert info.value.position == 12
        assert "found as version 5 of 'session:c', it holds version 6 of 'session:c'" in str(
            info.value
        )
        assert outcome(reader, "session:c", 6) == ([6, 7, 8], "end")
        assert outcome(reader, "session:b") == (list(range(1, 9)), "end")
    finally:
        reader.close()


# == d64366d: PostgreSQL, refusals, bounded waits, the subscription ==========================

PASSWORD = "pw-Zq7-not-in-any-message"


@contextlib.contextmanager
def own_role(pg_server: PostgresServer) -> Iterator[tuple[str, psycopg.Connection[Any]]]:
    """A role of the test's own that may create the store's schema, and an admin
    connection; both dropped after."""
    role = f"rv_{os.getpid()}_{next(_roles)}"
    with psycopg.connect(pg_server.url("stalwart_test"), autocommit=True) as admin:
        admin.execute(f"CREATE ROLE {role} LOGIN PASSWORD '{PASSWORD}'".encode())
        admin.execute(f"GRANT CREATE ON DATABASE stalwart_test TO {role}".encode())
        try:
            yield role, admin
        finally:
            admin.execute(f"ALTER ROLE {role} LOGIN CONNECTION LIMIT -1".encode())
            terminate(admin, "usename = %s", role)
            admin.execute(f"DROP OWNED BY {role} CASCADE".encode())
            admin.execute(f"DROP ROLE {role}".encode())


def terminate(admin: psycopg.Connection[Any], where: str, *params: Any) -> None:
    """End the server sessions ``where`` says (never the admin's own), and wait until
    they are gone."""
    query = (
        "SELECT pg_terminate_backend(pid, 5000) FROM pg_stat_activity "
        f"WHERE backend_type = 'client backend' AND pid <> pg_backend_pid() AND {where}"
    )
    admin.execute(query.encode(), params)


def role_url(pg_server: PostgresServer, role: str, pg_url: str) -> str:
    host = f"{pg_server.host}:{pg_server.port}"
    return f"postgresql://{role}:{PASSWORD}@{host}/stalwart_test?schema={schema_of(pg_url)}"


def chain(exc: BaseException) -> str:
    """Every message of an error and of what caused it."""
    texts = []
    seen: BaseException | None = exc
    while seen is not None:
        texts.append(f"{seen!s} {seen!r}")
        seen = seen.__cause__ or seen.__context__
    return "\n".join(texts)


def polls(feed: Subscription, got: list[int], times: int, wait: float) -> BaseException | None:
    """Poll ``feed`` up to ``times`` times into ``got``; the StoreError one raised."""
    for _ in range(times):
        try:
            got.extend(r.position for r in feed.poll(wait))
        except StoreError as exc:
            return exc
    return None


# Was: DEFECT: while the login is refused, the writer sends a batch one append at a time, each waits
def test_appends_batched_while_the_login_is_refused_all_fail_within_about_one_wait(
    pg_server: PostgresServer, pg_url: str
) -> None:
    """A role the server no longer lets log in (``NOLOGIN``, its sessions ended): every
    append now fails with a StoreError naming the refusal (not NotSentError). Before this
    change that was NotSentError, which ``Writer._send`` fails as a whole batch ("sending
    its appends one by one would only wait out the same timeout again"); the refusal is
    a plain StoreError, so the writer splits the batch and sends each append alone, each
    waiting the pool's whole timeout: six appenders wait 1 + 1 + 5 connect timeouts
    (about 7 s here, 70 s with the default ``connect_timeout`` of 10 s) where one or two
    did."""
    appenders = 6
    with (
        own_role(pg_server) as (role, admin),
        PostgresEventStore(
            role_url(pg_server, role, pg_url), pool_size=1, connect_timeout=1.0
        ) as store,
    ):
        store.append("session:a", [msg("session:a", 1)])
        admin.execute(f"ALTER ROLE {role} NOLOGIN".encode())
        terminate(admin, "usename = %s", role)
        with contextlib.suppress(StoreError):  # finds its pooled connection gone
            store.append("session:a", [msg("session:a", 2)])
        until(lambda: store._db.connect_failure is not None, WAIT, what="a refused connect")
        errors: list[BaseException | None] = [None] * appenders

        def run(n: int) -> None:
            try:
                store.append(f"session:b{n}", [msg(f"session:b{n}", 1)])
            except BaseException as exc:  # each is checked below
                errors[n] = exc

        threads = [threading.Thread(target=run, args=(n,)) for n in range(appenders)]
        started = time.monotonic()
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(WAIT)
        took = time.monotonic() - started
    for error in errors:
        assert isinstance(error, StoreError), repr(error)
        assert not isinstance(error, StoreUnavailableError), repr(error)
        assert "may not log in" in str(error)
        assert PASSWORD not in chain(error)
    assert took < 4.0, (
        f"{appenders} appends refused at login took {took:.1f} s (the pool's timeout is 1 s)"
    )


def test_a_refusal_names_its_reason_and_never_the_password(
    pg_server: PostgresServer, pg_url: str, logs: Logs, caplog: pytest.LogCaptureFixture
) -> None:
    """A changed password: reads, ``wait_for`` and a subscription's poll
    raise a StoreError (not StoreUnavailableError) naming the reason, within a few pool
    waits; no message of the error, of what caused it, or of any log holds the password
    (the URL's), and nothing is logged as an outage."""
    with own_role(pg_server) as (role, admin):
        url = role_url(pg_server, role, pg_url)
        with PostgresEventStore(url, pool_size=1, connect_timeout=1.0) as store:
            store.append("session:a", [msg("session:a", 1)])
            feed = store.subscribe(1)
            assert [r.position for r in feed.poll(WAIT)] == [1]
            admin.execute(f"ALTER ROLE {role} PASSWORD 'another-one'".encode())
            terminate(admin, "usename = %s", role)
            started = time.monotonic()
            error = polls(feed, [], 4, 0.5)
            took = time.monotonic() - started
            assert isinstance(error, StoreError)
            assert not isinstance(error, StoreUnavailableError)
            assert "authentication failed" in str(error), str(error)
            assert took < 5.0
            with pytest.raises(StoreError) as read:
                list(store.read_stream("session:a"))
            assert not isinstance(read.value, StoreUnavailableError)
            with pytest.raises(StoreError) as waited:
                store.wait_for(5, 0.3)
            assert not isinstance(waited.value, StoreUnavailableError)
            errors = [error, read.value, waited.value, _error_of(store.head)]
    for one in errors:
        assert one is not None
        assert PASSWORD not in chain(one), chain(one)
    everything = json.dumps([dict(e) for e in logs], default=str) + caplog.text
    assert PASSWORD not in everything
    assert named(logs, "subscription.store_unreachable") == []


def _error_of(work: Callable[[], object]) -> StoreError | None:
    try:
        work()
    except StoreError as exc:
        return exc
    return None


# Was: DEFECT: a server that refuses the client in pg_hba.conf is waited out for ever as an outage
def test_a_connection_pg_hba_rejects_is_a_refusal_not_an_outage(
    pg_server: PostgresServer, pg_url: str, logs: Logs
) -> None:
    """``pg_hba.conf`` rejecting the role (a ``reject`` line, as an operator locking a
    client out writes it; "no pg_hba.conf entry" is the same class): the server answers
    every connection with ``FATAL: pg_hba.conf rejects connection for host ...``, an
    ``invalid_authorization_specification`` like NOLOGIN, which waiting does not mend.
    The change makes NOLOGIN, a bad password and a missing role or database a StoreError
    ("A server that answers and refuses the connection ... is not an outage"), but
    ``_reason`` has no case for pg_hba.conf, so ``refused()`` is None: the subscription
    logs ``subscription.store_unreachable`` and returns nothing, raising nothing, for
    ever (``tail --follow`` never ends)."""
    with own_role(pg_server) as (role, admin):
        row = admin.execute("SHOW hba_file").fetchone()
        assert row is not None
        hba = Path(row[0])
        kept = hba.read_text()
        with PostgresEventStore(
            role_url(pg_server, role, pg_url), pool_size=1, connect_timeout=1.0
        ) as store:
            store.append("session:a", [msg("session:a", 1)])
            feed = store.subscribe(1)
            assert [r.position for r in feed.poll(WAIT)] == [1]
            try:
                hba.write_text(f"host all {role} all reject\n{kept}")
                admin.execute("SELECT pg_reload_conf()")
                probe = f"postgresql://{role}:{PASSWORD}@{pg_server.host}:{pg_server.port}/x"
                until(lambda: "pg_hba.conf" in _connect_error(probe), WAIT, what="hba reloaded")
                terminate(admin, "usename = %s", role)
                error = polls(feed, [], 6, 0.5)
                seen = str(store._db.connect_failure)
            finally:
                hba.write_text(kept)
                admin.execute("SELECT pg_reload_conf()")
    assert "pg_hba.conf rejects connection" in seen, seen  # the pool met the rejection
    assert error is not None, (
        "six polls raised nothing for a role pg_hba.conf rejects; logged: "
        f"{[e.get('error') for e in named(logs, 'subscription.store_unreachable')]}"
    )
    assert not isinstance(error, StoreUnavailableError), repr(error)


def _connect_error(url: str) -> str:
    try:
        psycopg.connect(url, connect_timeout=5).close()
    except psycopg.Error as exc:
        return str(exc)
    return ""


def socket_outage(
    pg_server: PostgresServer, pg_url: str, directory: str
) -> tuple[BaseException | None, str, list[int]]:
    """The store reached through the server's unix socket in a directory called
    ``directory`` (a symlink to the test server's socket directory); a subscription gets
    the first event; then the socket goes away and the store's sessions end, as in a
    restart; four polls; the socket comes back and the feed is polled for one more
    event (unless it ended). The StoreError a poll raised, the pool's recorded connect
    failure, and the positions the feed returned."""
    short = Path(tempfile.mkdtemp(prefix="rv-", dir="/tmp"))
    link = short / directory
    link.symlink_to(pg_server.root, target_is_directory=True)
    url = (
        f"postgresql://{pg_server.user}@/stalwart_test?host={link}&port={pg_server.port}"
        f"&schema={schema_of(pg_url)}"
    )
    got: list[int] = []
    try:
        with (
            psycopg.connect(pg_server.url("stalwart_test"), autocommit=True) as admin,
            PostgresEventStore(url, pool_size=1, connect_timeout=1.0) as store,
        ):
            store.append("session:a", [msg("session:a", 1)])
            feed = store.subscribe(1)
            got.extend(r.position for r in feed.poll(WAIT))
            assert got == [1]
            link.unlink()  # the socket is gone, as while the server restarts
            terminate(admin, "client_addr IS NULL AND datname = 'stalwart_test'")
            error = polls(feed, got, 4, 0.5)
            seen = str(store._db.connect_failure)
            link.symlink_to(pg_server.root, target_is_directory=True)
            if error is None:  # waited out: it carries on once the socket is back
                with PostgresEventStore(pg_url) as direct:
                    direct.append("session:a", [msg("session:a", 2)])
                until(lambda: polls(feed, got, 1, 0.5) is None and got == [1, 2], WAIT)
    finally:
        with contextlib.suppress(FileNotFoundError):
            link.unlink()
        shutil.rmtree(short, ignore_errors=True)
    return error, seen, got


def test_an_outage_of_the_servers_socket_is_waited_out(
    pg_server: PostgresServer, pg_url: str, logs: Logs
) -> None:
    """The control for the test below: the server's socket in a directory called
    ``pg-socket`` goes away (No such file or directory) and its sessions end: the feed
    logs the outage, raises nothing, and carries on with the next event once the socket
    is back, logging the return."""
    error, seen, got = socket_outage(pg_server, pg_url, "pg-socket")
    assert "No such file or directory" in seen, seen
    assert error is None, repr(error)
    assert got == [1, 2]
    assert [e["event"] for e in logs if str(e["event"]).startswith("subscription.store_")] == [
        "subscription.store_unreachable",
        "subscription.store_reachable",
    ]


# Was: DEFECT: an outage was a refusal when a name in libpq's message said authentication
def test_an_outage_is_waited_out_whatever_the_servers_socket_directory_is_called(
    pg_server: PostgresServer, pg_url: str, logs: Logs
) -> None:
    """The same outage with the socket directory called ``authentication-db``.
    ``refused()`` classifies by ``_reason()``, which looks for words anywhere in libpq's
    message, and that message names the socket ('connection to server on socket
    ".../authentication-db/.s.PGSQL.5432" failed: No such file or directory'):
    "authentication" is in it, so the outage is "authentication failed: check the user
    name and password", a StoreError that ends the subscription (and ``tail --follow``,
    exit 1; and the writer's batches are split, above). The same holds for a host name
    (``authentication-pg.internal``) in 'connection to server at "..." failed: Connection
    refused', and for a role or a database so named in a transient refusal ('too many
    connections for role "authentication"')."""
    error, seen, got = socket_outage(pg_server, pg_url, "authentication-db")
    assert "No such file or directory" in seen, seen  # the pool met an outage, no refusal
    assert error is None, f"an outage ended the subscription: {error!r}"
    assert got == [1, 2]
    assert [e["event"] for e in logs if str(e["event"]).startswith("subscription.store_")] == [
        "subscription.store_unreachable",
        "subscription.store_reachable",
    ]


def test_a_transient_refusal_too_many_connections_is_waited_out(
    pg_server: PostgresServer, pg_url: str, logs: Logs
) -> None:
    """What waiting may mend stays an outage: the role's connection limit reached ('too
    many connections for role ...', as when other sessions hold them) is not ``refused()``:
    the subscription logs the outage once, returns nothing meanwhile, and carries on,
    logging the return, once the limit is lifted."""
    got: list[int] = []
    with (
        own_role(pg_server) as (role, admin),
        PostgresEventStore(
            role_url(pg_server, role, pg_url), pool_size=1, connect_timeout=1.0
        ) as store,
    ):
        store.append("session:a", [msg("session:a", 1)])
        feed = store.subscribe(1)
        got.extend(r.position for r in feed.poll(WAIT))
        admin.execute(f"ALTER ROLE {role} CONNECTION LIMIT 0".encode())
        terminate(admin, "usename = %s", role)
        error = polls(feed, got, 4, 0.5)
        seen = str(store._db.connect_failure)
        admin.execute(f"ALTER ROLE {role} CONNECTION LIMIT -1".encode())
        with PostgresEventStore(pg_url) as direct:
            direct.append("session:a", [msg("session:a", 2)])
        until(lambda: polls(feed, got, 1, 0.5) is None and got == [1, 2], WAIT)
    assert "too many connections for role" in seen, seen
    assert error is None, repr(error)
    assert [e["event"] for e in logs if str(e["event"]).startswith("subscription.store_")] == [
        "subscription.store_unreachable",
        "subscription.store_reachable",
    ]


def cut(relay: CuttingRelay) -> None:
    """Cut every relayed connection and refuse new ones, a connection the relay was
    accepting at the cut included (the relay's known race: it refuses a probe made after
    the cut only once that one is among its pairs, which a second cut reaches)."""
    relay.cut_now()
    with socket.create_connection(("127.0.0.1", relay.port), timeout=WAIT) as probe:
        assert probe.recv(1) == b""
    relay.cut_now()


def _fed(feed: Subscription, got: list[int], count: int) -> Callable[[], bool]:
    """Whether a poll of ``feed`` into ``got`` brings it to ``count`` positions."""
    return lambda: polls(feed, got, 1, 0.5) is None and len(got) == count


class Held:
    """Every connection of a store's pool held by threads (long transactions, as busy
    appenders would hold them) until :meth:`release`."""

    def __init__(self, store: PostgresEventStore, count: int) -> None:
        self._release = threading.Event()
        self._held = threading.Semaphore(0)
        self._threads = [
            threading.Thread(target=self._hold, args=(store,), daemon=True) for _ in range(count)
        ]
        for thread in self._threads:
            thread.start()
        for _ in range(count):
            assert self._held.acquire(timeout=WAIT), "a pooled connection was not had"

    def _hold(self, store: PostgresEventStore) -> None:
        with store._db.connection("hold a connection", wait=WAIT) as conn:
            conn.execute("SELECT 1")
            self._held.release()
            self._release.wait(WAIT)

    def release(self) -> None:
        self._release.set()
        for thread in self._threads:
            thread.join(WAIT)


def test_a_busy_healthy_pool_is_neither_unreachable_nor_an_error_even_after_an_outage(
    pg_server: PostgresServer, pg_url: str, relay: CuttingRelay, logs: Logs
) -> None:
    """Two pooled connections, both held by other threads: ``wait_for`` returns within
    its own timeout with the last head it read, ``wait_for(.., 0)`` too, a subscription's
    polls return nothing within theirs, and nothing is raised or logged as an outage.
    The same after an outage the pool has recovered from (through the relay): its
    recorded failure is cleared by the reconnect, so a busy pool is not taken for a
    store still away. Released, the feed returns what was appended meanwhile."""
    url = pg_server.url("stalwart_test").replace(f":{pg_server.port}/", f":{relay.port}/")
    with (
        PostgresEventStore(pg_url) as direct,
        PostgresEventStore(
            f"{url}?schema={schema_of(pg_url)}", pool_size=2, connect_timeout=2.0
        ) as store,
    ):
        direct.append("session:a", [msg("session:a", 1)])
        feed = store.subscribe(1)
        got = [r.position for r in feed.poll(WAIT)]
        assert got == [1]
        for round_ in range(2):
            if round_ == 1:  # an outage, over before the pool is busy
                cut(relay)
                assert polls(feed, got, 2, 0.3) is None
                relay.restore()
                until(lambda: _error_of(store.head) is None, WAIT, what="the pool reconnected")
                assert polls(feed, got, 1, 0.3) is None
                assert store._db.connect_failure is None
            held = Held(store, 2)
            try:
                head = len(got)
                direct.append("session:a", [msg("session:a", head + 1)])
                started = time.monotonic()
                assert store.wait_for(head + 5, 0.5) == head
                assert store.wait_for(head + 5, 0) == head
                assert polls(feed, got, 2, 0.4) is None
                took = time.monotonic() - started
                assert got == list(range(1, head + 1))
                assert took < 3.0, f"busy waits took {took:.1f} s"
            finally:
                held.release()
            until(_fed(feed, got, head + 1), WAIT, what="the event appended while busy")
    events = [e["event"] for e in logs if str(e["event"]).startswith("subscription.store_")]
    assert events == ["subscription.store_unreachable", "subscription.store_reachable"]


# -- tail --follow: a real subprocess ---------------------------------------------------------


STALWART = (sys.executable, "-m", "stalwart")


class Follower(CollectedProcess):
    """``stalwart --store URL tail --follow --json``, its output lines collected."""

    def __init__(self, url: str) -> None:
        argv = [*STALWART, "--store", url, "--log-level", "info", "tail", "--follow", "--json"]
        super().__init__(argv, ROOT, WAIT)

    def positions(self) -> list[int]:
        return [json.loads(line)["position"] for line in list(self.out)]


def test_tail_follow_follows_then_ends_with_the_reason_when_the_login_is_refused(
    pg_server: PostgresServer, pg_url: str
) -> None:
    """``tail --follow --json`` (a subprocess, the CLI's 10 s connect timeout) prints what
    is there and what comes, in order, while the store is healthy and logs nothing about
    reachability; once the server refuses its role (NOLOGIN, sessions ended) it ends with
    exit 1 within a few seconds, naming the reason on stderr, with no traceback and no
    password anywhere."""
    with own_role(pg_server) as (role, admin):
        url = role_url(pg_server, role, pg_url)
        with PostgresEventStore(url) as writer:
            writer.append("session:a", [msg("session:a", n) for n in (1, 2)])
            follower = Follower(url)
            try:
                follower.wait(lambda: follower.positions() == [1, 2], "the first 2 events")
                for n in range(3, 8):
                    writer.append("session:a", [msg("session:a", n)])
                follower.wait(lambda: len(follower.out) >= 7, "7 events")
                assert follower.positions() == list(range(1, 8))
                assert not any("subscription.store_" in line for line in follower.err)
                admin.execute(f"ALTER ROLE {role} NOLOGIN".encode())
                started = time.monotonic()

                def ended() -> bool:  # any session of the role, a late one too, is ended
                    terminate(admin, "usename = %s", role)
                    return follower.proc.poll() is not None

                until(ended, WAIT, what="the follower ended")
                took = time.monotonic() - started
            finally:
                code = follower.stop()
    err = "".join(follower.err)
    assert code == 1, err
    assert took < 15.0, f"the follower took {took:.1f} s to end"
    assert "may not log in" in err, err
    assert "Traceback" not in err, err
    assert PASSWORD not in err + "".join(follower.out)
    assert "subscription.store_unreachable" not in err


# -- Subscription.poll on both stores ---------------------------------------------------------


@pytest.fixture(params=["lmdb", "postgres"])
def any_store(request: pytest.FixtureRequest, store_dir: Path) -> Iterator[Any]:
    if request.param == "lmdb":
        with LmdbEventStore(store_dir) as lmdb_store:
            yield lmdb_store
    else:
        with PostgresEventStore(request.getfixturevalue("pg_url")) as pg_store:
            yield pg_store


def test_poll_returns_what_is_there_at_once_and_waits_no_longer_than_asked(
    any_store: Any, logs: Logs
) -> None:
    """Events already there come back at once whatever the timeout; ``poll(0)`` looks
    once; ``poll(0.3)`` with nothing new returns after about 0.3 s; a poll that is
    waiting returns what another thread appends as it comes; a closed subscription's
    poll returns at once with nothing (before this change it still read what was
    there); nothing is logged about reachability."""
    store = any_store
    for n in range(1, 4):
        store.append("session:a", [msg("session:a", n)])
    feed = store.subscribe(2)
    started = time.monotonic()
    assert [r.position for r in feed.poll(30.0)] == [2, 3]
    assert time.monotonic() - started < 1.5
    assert feed.poll(0) == []
    started = time.monotonic()
    assert feed.poll(0.3) == []
    assert 0.25 <= time.monotonic() - started < 2.5
    store.append("session:a", [msg("session:a", 4)])
    assert [r.position for r in feed.poll(0)] == [4]
    later = threading.Timer(0.3, lambda: store.append("session:a", [msg("session:a", 5)]))
    later.start()
    started = time.monotonic()
    try:
        assert [r.position for r in feed.poll(30.0)] == [5]
    finally:
        later.join(WAIT)
    assert time.monotonic() - started < 5.0
    store.append("session:a", [msg("session:a", 6)])
    feed.close()
    started = time.monotonic()
    assert feed.poll(30.0) == []
    assert time.monotonic() - started < 1.0
    assert [e["event"] for e in logs if str(e["event"]).startswith("subscription.")] == []


def test_poll_returns_the_good_records_then_raises_the_damaged_one_next(
    store_dir: Path, pg_url: str
) -> None:
    """A damaged record at position 3: a poll returns 1 and 2, the next poll raises
    CorruptRecordError naming 3, and the one after raises it again (nothing is skipped);
    on LMDB and on PostgreSQL alike."""
    with LmdbEventStore(store_dir) as lmdb_store:
        for n in range(1, 5):
            lmdb_store.append("session:a", [msg("session:a", n)])
    raw_edit(store_dir, lambda txn, log, index: txn.put(_key(3), b"\xc1garbage", db=log))
    with PostgresEventStore(pg_url) as pg_store:
        for n in range(1, 5):
            pg_store.append("session:a", [msg("session:a", n)])
        schema = schema_of(pg_url)
        with psycopg.connect(pg_url.rsplit("?", 1)[0], autocommit=True) as admin:
            admin.execute(
                f"UPDATE {schema}.events SET data = %s WHERE position = 3".encode(), (b"\xc1",)
            )
        with LmdbEventStore(store_dir, create=False, read_only=True) as damaged:
            for store in (damaged, pg_store):
                feed = store.subscribe(1)
                assert [r.position for r in feed.poll(WAIT)] == [1, 2], store
                for _ in range(2):
                    with pytest.raises(CorruptRecordError) as info:
                        feed.poll(WAIT)
                    assert info.value.position == 3, store
                assert feed.position == 3


# -- a kept tail's batch with a record that cannot be read --------------------------------------

DAMAGE = textwrap.dedent(
    """
    import sys
    import lmdb

    path = sys.argv[1]
    env = lmdb.open(path, max_dbs=8)
    with env.begin(write=True) as txn:
        log = env.open_db(b"log", txn=txn)
        for arg in sys.argv[2:]:
            position, how = arg.split("=")
            key = int(position).to_bytes(8, "big")
            if how == "renamed":  # the record's stream, session:b, says session:c
                value = bytes(txn.get(key, db=log))
                assert b"\\xa9session:b" in value
                txn.put(key, value.replace(b"\\xa9session:b", b"\\xa9session:c", 1), db=log)
            else:
                txn.put(key, b"\\xc1garbage", db=log)
    env.close()
    """
)


# Was: DEFECT: a kept tail's batch with an undecodable record skipped the ends check
def test_a_kept_tails_batch_with_an_unreadable_record_yields_no_foreign_record(
    store_dir: Path,
) -> None:
    """session:b and session:c alternating (all after the mark); a read-only handle reads
    them, keeping the log's tail. Then another process damages two of session:b's
    records: version 3 (position 5) now names session:c, version 5 (position 9) cannot be
    decoded. A read of session:b from version 3 takes positions 5, 7, 9, ... from the
    kept tail; the batch's first record is session:c's, which ``_misplaced`` would name,
    but ``_known_chunk`` returns at the decode error before it checks the batch, so the
    read yields session:c's "version 3" as session:b's (and version 4), then the error
    at 9. ``_indexed_chunk`` checks before it returns an error; a fresh process's scan
    yields nothing of session:c's. (Read from version 1, the foreign record sits inside
    the batch, between two good ends: the two-ends check does not look there, as
    documented.)"""
    with LmdbEventStore(store_dir) as writer:
        for _ in range(8):
            append(writer, "session:b", 1)
            append(writer, "session:c", 1)
    reader = LmdbEventStore(store_dir, create=False, read_only=True)
    try:
        check_run(list(reader.read_stream("session:b")), "session:b", 1)
        check_run(list(reader.read_stream("session:c")), "session:c", 1)
        assert reader._env.tail is not None  # kept
        subprocess.run(
            [sys.executable, "-c", DAMAGE, str(store_dir), "5=renamed", "9=garbage"],
            check=True,
            timeout=WAIT,
            cwd=ROOT,
        )
        fresh, scanned = _scan_read(store_dir, "session:b")
        read: list[tuple[str, int]] = []
        with pytest.raises(CorruptRecordError) as kept:
            read.extend((r.stream, r.version) for r in reader.read_stream("session:b", 3))
    finally:
        reader.close()
    assert fresh == [("session:b", 1), ("session:b", 2)]
    assert scanned is not None
    assert scanned[0] == 7  # "holds version 4, 3 was due"
    assert all(stream == "session:b" for stream, _ in read), (read, str(kept.value))
    assert read == []
    assert kept.value.position == 5, str(kept.value)


def _scan_read(store_dir: Path, stream: str) -> tuple[list[tuple[str, int]], Any]:
    """``stream`` read whole by another process (whose reader keeps no tail yet): the
    (stream, version) of each record, and the error's (position, reason) or None."""
    code = textwrap.dedent(
        """
        import json, sys
        from stalwart.errors import CorruptRecordError
        from stalwart.store import LmdbEventStore
        out, error = [], None
        with LmdbEventStore(sys.argv[1], create=False, read_only=True) as store:
            try:
                for r in store.read_stream(sys.argv[2]):
                    out.append([r.stream, r.version])
            except CorruptRecordError as exc:
                error = [exc.position, exc.reason]
        print(json.dumps([out, error]))
        """
    )
    done = subprocess.run(
        [sys.executable, "-c", code, str(store_dir), stream],
        capture_output=True,
        text=True,
        check=True,
        timeout=WAIT,
        cwd=ROOT,
    )
    out, error = json.loads(done.stdout)
    return [(name, version) for name, version in out], error


# -- refused(): libpq's messages, as the server words them ------------------------------------

_AT = 'connection failed: connection to server at "127.0.0.1", port 5432 failed: FATAL:  '


@pytest.mark.parametrize(
    "message",
    [
        "the database system is starting up",
        "the database system is shutting down",
        "the database system is in recovery mode",
        "the database system is not yet accepting connections",
        "sorry, too many clients already",
        'too many connections for role "app"',
        'too many connections for database "events"',
        "remaining connection slots are reserved for roles with the SUPERUSER attribute",
        'database "events" is not currently accepting connections',
        "terminating connection due to administrator command",
    ],
)
def test_what_waiting_may_mend_is_not_refused(message: str) -> None:
    """The server's transient refusals (starting, stopping, full) stay outages:
    ``refused()`` is None for each, so a PoolTimeout after them is NotSentError."""
    assert refused(psycopg.OperationalError(_AT + message)) is None


@pytest.mark.parametrize(
    ("message", "reason"),
    [
        ('password authentication failed for user "app"', "authentication failed"),
        ('role "app" is not permitted to log in', "the user may not log in"),
        ('role "app" does not exist', "the user does not exist"),
        ('database "events" does not exist', "the database does not exist"),
    ],
)
def test_what_waiting_does_not_mend_is_refused(message: str, reason: str) -> None:
    found = refused(psycopg.OperationalError(_AT + message))
    assert found is not None
    assert found.startswith(reason), found
