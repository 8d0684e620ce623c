"""The store's benchmarks, each against the limit or a peer measured in the same run.

``append``                   durable appends from 1, 8, 64 threads vs raw LMDB committing
                             as many events per durable transaction, the fsync rate, the
                             same threads handing calls to one thread with no store, and
                             raw LMDB behind that hand-off
``append_batched``           the same with 8 events per call, vs raw LMDB at 8N per txn
``append_vs_eventsourcing``  the same workload on eventsourcing's SQLite recorder
``replay``                   read + decode + session fold vs a bare msgspec decode loop
``tail_latency``             commit to a follower in another process (and in a thread)
"""

from __future__ import annotations

import functools
import itertools
import multiprocessing
import os
import random
import threading
import time
import uuid
from collections.abc import Callable, Iterable
from multiprocessing.connection import Connection
from typing import Any

import lmdb
import msgspec

from stalwart.events import Event, RecordedEvent, SessionCreated
from stalwart.state import SESSION
from stalwart.store import LmdbEventStore, load_state

from ._machine import scratch
from ._registry import Result, benchmark, ratio
from ._workload import (
    concurrent_rate,
    fsync_rate,
    handoff_rate,
    message,
    percentile,
    record_bytes,
    session_turn,
)

THREADS = (1, 8, 64)


def _rounds(quick: bool) -> tuple[int, float]:
    """How many times each case is measured (the best counts) and for how long."""
    return (1, 0.3) if quick else (4, 1.0)


# -- append -------------------------------------------------------------------------------


def _stalwart_rate(path: str, threads: int, seconds: float, per_call: int = 1) -> float:
    """Events/s of ``threads`` threads, each appending ``per_call`` events at a time to its
    stream."""
    events = [message()] * per_call
    with LmdbEventStore(path) as store:
        workers = [
            functools.partial(store.append, f"session:append-{i:02d}", events)
            for i in range(threads)
        ]
        return concurrent_rate(workers, seconds) * per_call


def _raw_lmdb_rate(path: str, per_txn: int, value: bytes, seconds: float) -> float:
    """Events/s of one thread committing durable transactions of ``per_txn`` puts."""
    env = lmdb.open(path, map_size=1 << 30)  # the defaults: sync=True, metasync=True
    try:
        position = 0
        started = time.perf_counter()
        while (elapsed := time.perf_counter() - started) < seconds:
            with env.begin(write=True) as txn:
                for _ in range(per_txn):
                    position += 1
                    txn.put(position.to_bytes(8, "big"), value, append=True)
        return position / elapsed
    finally:
        env.close()


def _handoff_lmdb_rate(path: str, threads: int, value: bytes, seconds: float) -> float:
    """Events/s of ``threads`` threads handing one put each to a thread that commits every
    waiting put in one durable raw-LMDB transaction and then answers them: the peer of the
    ``append`` benchmark behind the same thread hand-off, with no code of ours."""
    env = lmdb.open(path, map_size=1 << 30)
    position = 0

    def commit(count: int) -> None:
        nonlocal position
        with env.begin(write=True) as txn:
            for _ in range(count):
                position += 1
                txn.put(position.to_bytes(8, "big"), value, append=True)

    try:
        return handoff_rate(threads, seconds, commit)
    finally:
        env.close()


@benchmark("append")
def append(quick: bool) -> Result:
    rounds, seconds = _rounds(quick)
    result = Result("append")
    figures = result.figures
    value = record_bytes(message())
    figures["record_bytes"] = len(value)
    with scratch() as root:
        figures["fsync_per_s"] = fsync_rate(root, seconds)
        for n in THREADS:
            ours = theirs = 0.0
            for attempt in range(rounds):  # interleaved, so a noisy moment hits both sides
                path = os.path.join(root, f"stalwart-{n}-{attempt}")
                ours = max(ours, _stalwart_rate(path, n, seconds))
                path = os.path.join(root, f"raw-{n}-{attempt}")
                theirs = max(theirs, _raw_lmdb_rate(path, n, value, seconds))
            figures[f"stalwart_n{n}_events_per_s"] = ours
            figures[f"raw_lmdb_{n}_per_txn_events_per_s"] = theirs
            result.ratios[f"vs_raw_lmdb_n{n}"] = ratio(ours, theirs)
            # what N threads that each wait for another thread can do at all, store or not
            handoff = handoff_rate(n, seconds)
            figures[f"thread_handoff_n{n}_per_s"] = handoff
            result.ratios[f"thread_handoff_vs_raw_lmdb_n{n}"] = ratio(handoff, theirs)
            # and with the peer's own transactions behind that hand-off: the best any
            # store can do whose appenders wait on one committing thread of this process
            behind = 0.0
            for attempt in range(rounds):
                path = os.path.join(root, f"handoff-{n}-{attempt}")
                behind = max(behind, _handoff_lmdb_rate(path, n, value, seconds))
            figures[f"raw_lmdb_behind_handoff_n{n}_events_per_s"] = behind
            result.ratios[f"raw_lmdb_behind_handoff_vs_raw_lmdb_n{n}"] = ratio(behind, theirs)
            result.ratios[f"vs_raw_lmdb_behind_handoff_n{n}"] = ratio(ours, behind)
    result.ratios["stalwart_n1_vs_fsync"] = ratio(
        figures["stalwart_n1_events_per_s"], figures["fsync_per_s"]
    )
    result.goal("vs_raw_lmdb_n8", ">=", 0.6)
    result.goal("vs_raw_lmdb_n64", ">=", 0.6)
    return result


# -- append_batched -------------------------------------------------------------------------

PER_CALL = 8


@benchmark("append_batched")
def append_batched(quick: bool) -> Result:
    """The ``append`` workload with each call carrying PER_CALL events (a turn's messages,
    say): what the same threads reach when an event does not cost a thread hand-off."""
    rounds, seconds = _rounds(quick)
    result = Result("append_batched")
    figures = result.figures
    value = record_bytes(message())
    figures["events_per_call"] = PER_CALL
    with scratch() as root:
        for n in (8, 64):
            ours = theirs = 0.0
            for attempt in range(rounds):
                path = os.path.join(root, f"stalwart-{n}-{attempt}")
                ours = max(ours, _stalwart_rate(path, n, seconds, PER_CALL))
                path = os.path.join(root, f"raw-{n}-{attempt}")
                theirs = max(theirs, _raw_lmdb_rate(path, n * PER_CALL, value, seconds))
            figures[f"stalwart_n{n}_events_per_s"] = ours
            figures[f"raw_lmdb_{n * PER_CALL}_per_txn_events_per_s"] = theirs
            result.ratios[f"vs_raw_lmdb_n{n}"] = ratio(ours, theirs)
    return result


# -- append_vs_eventsourcing --------------------------------------------------------------


def _sqlite_rate(path: str, threads: int, value: bytes, seconds: float) -> tuple[float, int]:
    """Events/s of eventsourcing's SQLite recorder, one stored event per insert, and the
    database's ``PRAGMA synchronous`` (2 = FULL: every commit is fsynced)."""
    try:
        from eventsourcing.persistence import StoredEvent
        from eventsourcing.sqlite import SQLiteApplicationRecorder, SQLiteDatastore
    except ImportError as exc:
        raise RuntimeError(
            "append_vs_eventsourcing needs the bench extra: pip install -e '.[bench]'"
        ) from exc

    datastore = SQLiteDatastore(path, pool_size=threads + 1, pool_timeout=120.0)
    try:
        recorder = SQLiteApplicationRecorder(datastore)
        recorder.create_table()

        def worker() -> Callable[[], object]:
            originator = uuid.uuid4()
            versions = itertools.count(1)

            def insert() -> object:
                stored = StoredEvent(
                    originator_id=originator,
                    originator_version=next(versions),
                    topic="stalwart.events:MessageAppended",
                    state=value,
                )
                return recorder.insert_events([stored])

            return insert

        rate = concurrent_rate([worker() for _ in range(threads)], seconds)
        with datastore.transaction(commit=False) as cursor:
            cursor.execute("PRAGMA synchronous")
            synchronous = int(cursor.fetchone()[0])
        return rate, synchronous
    finally:
        datastore.close()


@benchmark("append_vs_eventsourcing")
def append_vs_eventsourcing(quick: bool) -> Result:
    rounds, seconds = _rounds(quick)
    rounds = min(rounds, 3)
    result = Result("append_vs_eventsourcing")
    figures = result.figures
    value = record_bytes(message())
    with scratch() as root:
        for n in THREADS:
            ours = theirs = 0.0
            for attempt in range(rounds):
                path = os.path.join(root, f"stalwart-{n}-{attempt}")
                ours = max(ours, _stalwart_rate(path, n, seconds))
                path = os.path.join(root, f"es-{n}-{attempt}.sqlite")
                rate, synchronous = _sqlite_rate(path, n, value, seconds)
                theirs = max(theirs, rate)
            figures[f"stalwart_n{n}_events_per_s"] = ours
            figures[f"eventsourcing_sqlite_n{n}_events_per_s"] = theirs
            result.ratios[f"vs_eventsourcing_n{n}"] = ratio(ours, theirs)
    figures["sqlite_synchronous"] = synchronous
    result.goal("vs_eventsourcing_n64", ">=", 10.0)
    return result


# -- replay -------------------------------------------------------------------------------

REPLAY_STREAMS = 4
BUILD_BATCH = 6000


def _build_log(store: LmdbEventStore, streams: list[str], per_stream: int) -> None:
    """``per_stream`` events in each stream: a SessionCreated, then turns, batch-appended."""
    rng = random.Random(7)
    pool: list[Event] = [e for turn in range(200) for e in session_turn(rng, turn)]
    feeds = {stream: itertools.cycle(pool) for stream in streams}
    for stream in streams:
        store.append(stream, [SessionCreated(agent="bench", title=stream)])
    left = dict.fromkeys(streams, per_stream - 1)
    while any(left.values()):
        for stream in streams:
            take = min(BUILD_BATCH, left[stream])
            if take:
                store.append(stream, list(itertools.islice(feeds[stream], take)))
                left[stream] -= take


def _stored_values(path: str) -> list[bytes]:
    """Every record's bytes as the log holds them, read with LMDB directly."""
    env = lmdb.open(path, readonly=True, max_dbs=8)
    try:
        log = env.open_db(b"log", create=False)
        with env.begin(db=log) as txn:
            return list(txn.cursor().iternext(keys=False))
    finally:
        env.close()


def _rate(count: int, run: Callable[[], object], repeats: int) -> float:
    """``count`` / the best time of ``repeats`` calls of ``run``."""
    best = float("inf")
    for _ in range(repeats):
        started = time.perf_counter()
        run()
        best = min(best, time.perf_counter() - started)
    return count / best


def _decode_all(values: Iterable[bytes]) -> None:
    decode = msgspec.msgpack.Decoder(RecordedEvent).decode
    for value in values:
        decode(value)


def _replay_all(store: LmdbEventStore, streams: list[str], expected: int) -> None:
    folded = 0
    for stream in streams:
        state = load_state(store, stream, SESSION, snapshot_every=0, use_snapshots=False)
        folded += state.version
    if folded != expected:
        raise RuntimeError(f"replay folded {folded} events, the log holds {expected}")


def _read_all(store: LmdbEventStore, expected: int) -> None:
    count = sum(1 for _ in store.read_all())
    if count != expected:
        raise RuntimeError(f"read_all returned {count} events, the log holds {expected}")


@benchmark("replay")
def replay(quick: bool) -> Result:
    total = 200_000 if quick else 1_000_000
    repeats = 2 if quick else 3
    streams = [f"session:replay-{i}" for i in range(REPLAY_STREAMS)]
    result = Result("replay")
    figures = result.figures
    figures["events"] = total
    figures["streams"] = len(streams)
    with scratch() as root:
        path = os.path.join(root, "store")
        with LmdbEventStore(path, map_size=1 << 31) as store:
            started = time.perf_counter()
            _build_log(store, streams, total // len(streams))
            figures["build_batched_append_events_per_s"] = total / (time.perf_counter() - started)
        values = _stored_values(path)
        figures["mean_record_bytes"] = sum(map(len, values)) / len(values)
        decode_all = functools.partial(_decode_all, values)
        figures["bare_decode_events_per_s"] = _rate(total, decode_all, repeats)
        values.clear()
        with LmdbEventStore(path, create=False) as store:
            figures["read_all_events_per_s"] = _rate(
                total, lambda: _read_all(store, total), repeats
            )
            figures["replay_events_per_s"] = _rate(
                total, lambda: _replay_all(store, streams, total), repeats
            )
    result.ratios["replay_vs_bare_decode"] = ratio(
        figures["replay_events_per_s"], figures["bare_decode_events_per_s"]
    )
    result.ratios["read_all_vs_bare_decode"] = ratio(
        figures["read_all_events_per_s"], figures["bare_decode_events_per_s"]
    )
    result.goal("replay_vs_bare_decode", ">=", 0.35)
    return result


# -- tail latency -------------------------------------------------------------------------

TAIL_STREAM = "session:tail"


def _follow(path: str, start: int, count: int, conn: Connection) -> None:
    """In the child: subscribe, say ready, note the wall time each event arrives."""
    received: list[tuple[int, float]] = []
    store = LmdbEventStore(path, create=False)
    try:
        with store.subscribe(start) as feed:
            conn.send("ready")
            while len(received) < count:
                events = feed.poll(timeout=10.0)
                now = time.time()
                if not events:
                    break
                received.extend((event.position, now) for event in events)
    finally:
        store.close()
        conn.send(received)
        conn.close()


def _follow_here(
    store: LmdbEventStore,
    start: int,
    count: int,
    ready: threading.Event,
    received: list[tuple[int, float]],
) -> None:
    """In a thread of the appending process: the same, timed with perf_counter."""
    with store.subscribe(start) as feed:
        ready.set()
        while len(received) < count:
            events = feed.poll(timeout=10.0)
            now = time.perf_counter()
            if not events:
                return
            received.extend((event.position, now) for event in events)


def _append_paced(store: LmdbEventStore, count: int, interval: float) -> dict[int, Any]:
    """Append ``count`` events one every ``interval`` s; when each call began and returned."""
    sent: dict[int, tuple[float, float, float, float]] = {}
    event = message()
    next_at = time.perf_counter()
    for _ in range(count):
        wall_before, before = time.time(), time.perf_counter()
        [record] = store.append(TAIL_STREAM, [event])
        after, wall_after = time.perf_counter(), time.time()
        sent[record.position] = (wall_before, wall_after, before, after)
        next_at = max(next_at + interval, after)
        time.sleep(max(0.0, next_at - time.perf_counter()))
    return sent


def _latency_figures(
    result: Result, prefix: str, sent: dict[int, Any], received: list[tuple[int, float]], wall: bool
) -> None:
    """p50/p99/max (ms) from append returned, and p50/p99 from append called."""
    before, after = (0, 1) if wall else (2, 3)
    returned = [(t - sent[p][after]) * 1000 for p, t in received if p in sent]
    called = [(t - sent[p][before]) * 1000 for p, t in received if p in sent]
    figures = result.figures
    figures[f"{prefix}_p50_ms"] = percentile(returned, 50)
    figures[f"{prefix}_p99_ms"] = percentile(returned, 99)
    figures[f"{prefix}_max_ms"] = max(returned, default=float("nan"))
    figures[f"{prefix}_from_call_p50_ms"] = percentile(called, 50)
    figures[f"{prefix}_from_call_p99_ms"] = percentile(called, 99)
    figures[f"{prefix}_missing"] = len(sent) - len({p for p, _ in received if p in sent})


@benchmark("tail_latency")
def tail_latency(quick: bool) -> Result:
    count, interval = (100, 0.005) if quick else (500, 0.005)
    result = Result("tail_latency")
    result.figures["appends"] = count
    result.figures["interval_ms"] = interval * 1000
    spawn = multiprocessing.get_context("spawn")
    with scratch() as root:
        path = os.path.join(root, "store")
        with LmdbEventStore(path) as store:
            store.append(TAIL_STREAM, [SessionCreated(agent="bench")])
            start = store.head() + 1
            ours, theirs = spawn.Pipe()
            child = spawn.Process(target=_follow, args=(path, start, count, theirs), daemon=True)
            child.start()
            if not ours.poll(60) or ours.recv() != "ready":
                raise RuntimeError("the follower process did not start")
            ready = threading.Event()
            here: list[tuple[int, float]] = []
            thread = threading.Thread(
                target=_follow_here, args=(store, start, count, ready, here), daemon=True
            )
            thread.start()
            ready.wait(10)
            sent = _append_paced(store, count, interval)
            there = ours.recv() if ours.poll(60) else []
            thread.join(15)
            child.join(15)
    appends = sorted((a - b) * 1000 for _, _, b, a in sent.values())
    result.figures["append_p50_ms"] = percentile(appends, 50)
    result.figures["append_p99_ms"] = percentile(appends, 99)
    _latency_figures(result, "cross_process", sent, there, wall=True)
    _latency_figures(result, "in_process", sent, here, wall=False)
    result.ratios["cross_process_p99_vs_budget"] = result.figures["cross_process_p99_ms"] / 100
    result.goal("cross_process_p99_ms", "<=", 100.0)
    return result
