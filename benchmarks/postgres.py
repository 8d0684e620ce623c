"""The PostgreSQL store on a loopback server this benchmark starts (PostgreSQL's defaults,
fsync on, data on the scratch disk), against peers measured on the same server in the
same run.

``postgres``  durable appends of 1 and 8 threads, and of 8 processes, vs eventsourcing's
              PostgreSQL recorder (8 threads) and the server's raw commit rate (8
              connections, one INSERT per transaction, no ordering), with LMDB's 8 threads
              beside them; and tail latency, commit -> a follower in another process.
"""

from __future__ import annotations

import functools
import itertools
import multiprocessing
import os
import time
from collections.abc import Callable
from multiprocessing.connection import Connection
from typing import Any

from stalwart.events import SessionCreated
from stalwart.store import LmdbEventStore, PostgresEventStore
from stalwart.testing import PostgresServer, postgres_bindir

from ._machine import scratch, scratch_root
from ._registry import Result, benchmark, ratio
from ._workload import concurrent_rate, message, record_bytes
from .store import TAIL_STREAM, _append_paced, _latency_figures

APPENDERS = 8


def _rounds(quick: bool) -> tuple[int, float]:
    return (1, 0.3) if quick else (3, 1.5)


# -- appends ------------------------------------------------------------------------------


def _ours_threads(url: str, threads: int, seconds: float) -> float:
    event = message()
    with PostgresEventStore(url) as store:
        workers = [
            functools.partial(store.append, f"session:pg-{threads}-{i:02d}", [event])
            for i in range(threads)
        ]
        return concurrent_rate(workers, seconds)


def _append_process(url: str, index: int, start: Any, seconds: float, conn: Connection) -> None:
    """In a child: one store, one stream, append from ``start`` for ``seconds``."""
    event = message()
    with PostgresEventStore(url) as store:
        store.append(f"session:proc-{index:02d}", [event])
        conn.send("ready")
        start.wait(60)
        done, started = 0, time.perf_counter()
        while time.perf_counter() - started < seconds:
            store.append(f"session:proc-{index:02d}", [event])
            done += 1
        conn.send(done / (time.perf_counter() - started))


def _ours_processes(url: str, processes: int, seconds: float) -> float:
    spawn = multiprocessing.get_context("spawn")
    start = spawn.Event()
    pipes, children = [], []
    for index in range(processes):
        ours, theirs = spawn.Pipe()
        child = spawn.Process(
            target=_append_process, args=(url, index, start, seconds, theirs), daemon=True
        )
        child.start()
        pipes.append(ours)
        children.append(child)
    for pipe in pipes:
        if not pipe.poll(60) or pipe.recv() != "ready":
            raise RuntimeError("an appending process did not start")
    start.set()
    total = sum(pipe.recv() for pipe in pipes if pipe.poll(seconds + 60))
    for child in children:
        child.join(30)
    return float(total)


def _eventsourcing_rate(
    server: PostgresServer, database: str, threads: int, seconds: float
) -> float:
    """Events/s of eventsourcing's PostgreSQL recorder, one stored event per insert."""
    try:
        from eventsourcing.persistence import StoredEvent
        from eventsourcing.postgres import PostgresApplicationRecorder, PostgresDatastore
    except ImportError as exc:
        raise RuntimeError(
            "the postgres benchmark needs the bench extra: pip install -e '.[bench]'"
        ) from exc
    datastore = PostgresDatastore(
        database,
        server.host,
        server.port,
        server.user,
        server.password,
        pool_size=threads + 1,
        originator_id_type="text",
    )
    value = record_bytes(message())
    try:
        recorder = PostgresApplicationRecorder(datastore)
        recorder.create_table()

        def worker(index: int) -> Any:
            versions = itertools.count(1)
            originator = f"es-{threads}-{index}-{time.perf_counter_ns()}"

            def insert() -> object:
                stored = StoredEvent(
                    originator_id=originator,
                    originator_version=next(versions),
                    topic="stalwart.events:MessageAppended",
                    state=value,
                )
                return recorder.insert_events([stored])

            return insert

        return concurrent_rate([worker(i) for i in range(threads)], seconds)
    finally:
        datastore.close()


def _raw_commit_rate(url: str, connections: int, seconds: float) -> float:
    """INSERT + commit per call from ``connections`` connections: the server's durable
    commit rate with its own group commit, and no ordering between writers."""
    import psycopg

    value = record_bytes(message())
    with psycopg.connect(url, autocommit=True) as admin:
        admin.execute(
            "CREATE TABLE IF NOT EXISTS raw_commits (id bigserial PRIMARY KEY, data bytea)"
        )
    conns = [psycopg.connect(url, autocommit=True) for _ in range(connections)]
    try:
        workers = [
            functools.partial(conn.execute, "INSERT INTO raw_commits (data) VALUES (%s)", (value,))
            for conn in conns
        ]
        return concurrent_rate(workers, seconds)
    finally:
        for conn in conns:
            conn.close()


def _lmdb_rate(threads: int, seconds: float) -> float:
    event = message()
    with scratch() as root, LmdbEventStore(os.path.join(root, "lmdb")) as store:
        workers = [
            functools.partial(store.append, f"session:lmdb-{i:02d}", [event])
            for i in range(threads)
        ]
        return concurrent_rate(workers, seconds)


# -- tail latency -------------------------------------------------------------------------


def _follow(url: str, start: int, count: int, conn: Connection) -> None:
    """In the child: subscribe, say ready, note the wall time each event arrives."""
    received: list[tuple[int, float]] = []
    store = PostgresEventStore(url, create=False)
    try:
        with store.subscribe(start) as feed:
            feed.poll(0.05)  # starts the listener before we say ready
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


def _tail(result: Result, url: str, count: int, interval: float) -> None:
    spawn = multiprocessing.get_context("spawn")
    with PostgresEventStore(url) as store:
        store.append(TAIL_STREAM, [SessionCreated(agent="bench")])
        start = store.head() + 1
        ours, theirs = spawn.Pipe()
        child = spawn.Process(target=_follow, args=(url, start, count, theirs), daemon=True)
        child.start()
        if not ours.poll(60) or ours.recv() != "ready":
            raise RuntimeError("the follower process did not start")
        sent = _append_paced(store, count, interval)  # type: ignore[arg-type]
        there = ours.recv() if ours.poll(60) else []
        child.join(15)
    _latency_figures(result, "tail_cross_process", sent, there, wall=True)


@benchmark("postgres")
def run(quick: bool) -> Result:
    result = Result("postgres")
    if postgres_bindir() is None:
        raise RuntimeError("the postgres benchmark needs PostgreSQL (initdb, pg_ctl) installed")
    rounds, seconds = _rounds(quick)
    figures = result.figures
    with PostgresServer(directory=scratch_root()) as server:
        ours_url = server.create_database("bench_stalwart")
        theirs_db = "bench_eventsourcing"
        server.create_database(theirs_db)
        raw_url = server.create_database("bench_raw")
        cases: dict[str, Callable[[str], float]] = {
            "pg_n1": lambda url: _ours_threads(url, 1, seconds),
            "pg_n8": lambda url: _ours_threads(url, APPENDERS, seconds),
            "es_n8": lambda url: _eventsourcing_rate(server, theirs_db, APPENDERS, seconds),
            "raw_n8": lambda url: _raw_commit_rate(raw_url, APPENDERS, seconds),
            "lmdb_n8": lambda url: _lmdb_rate(APPENDERS, seconds),
            "pg_8_processes": lambda url: _ours_processes(url, APPENDERS, seconds),
        }
        best = dict.fromkeys(cases, 0.0)
        for attempt in range(rounds):  # interleaved, so a noisy moment hits every side
            for key, case in cases.items():
                best[key] = max(best[key], case(f"{ours_url}?schema=round{attempt}"))
        count = 100 if quick else 500
        _tail(result, ours_url + "?schema=tail", count, 0.005)
    names = {
        "pg_n1": "stalwart_pg_n1_events_per_s",
        "pg_n8": "stalwart_pg_n8_events_per_s",
        "pg_8_processes": "stalwart_pg_8_processes_events_per_s",
        "es_n8": "eventsourcing_pg_n8_events_per_s",
        "raw_n8": "raw_pg_commits_n8_per_s",
        "lmdb_n8": "stalwart_lmdb_n8_events_per_s",
    }
    for key, name in names.items():
        figures[name] = best[key]
    ratios = result.ratios
    ratios["vs_eventsourcing_n8"] = ratio(
        figures["stalwart_pg_n8_events_per_s"], figures["eventsourcing_pg_n8_events_per_s"]
    )
    ratios["processes_vs_eventsourcing_n8"] = ratio(
        figures["stalwart_pg_8_processes_events_per_s"],
        figures["eventsourcing_pg_n8_events_per_s"],
    )
    ratios["vs_raw_commits_n8"] = ratio(
        figures["stalwart_pg_n8_events_per_s"], figures["raw_pg_commits_n8_per_s"]
    )
    ratios["processes_vs_raw_commits_n8"] = ratio(
        figures["stalwart_pg_8_processes_events_per_s"], figures["raw_pg_commits_n8_per_s"]
    )
    ratios["pg_vs_lmdb_n8"] = ratio(
        figures["stalwart_pg_n8_events_per_s"], figures["stalwart_lmdb_n8_events_per_s"]
    )
    result.goal("vs_eventsourcing_n8", ">=", 2.0)
    result.goal("tail_cross_process_p99_ms", "<=", 100.0)
    result.machine["postgres_bindir"] = str(postgres_bindir())
    return result
