"""A child process for tests/test_store_processes.py: ``python _store_child.py MODE ARGS``.

Every line it prints is written with one ``os.write`` (atomic on a pipe for short lines),
so a SIGKILL never leaves half a line. An acknowledgement is printed only after
``append`` returned: it is the promise the parent checks after a crash.

Event ids name their batch: ``<writer>b<index>.<k>/<n>`` is event k of the n events
appended in one call, the index-th call of that writer.

Modes:

``crash DIR ROUND``          4 threads append to their own streams until killed
``concurrent DIR PROC T N MAP_KB CONTENT``
                             T threads x N appends, shared and private streams, then exit
``race DIR PROC N``          N appends to one stream with expected_version, retrying
``follow DIR COUNT``         subscribe from position 1, print each record and its time
``read DIR``                 iterate read_all() over and over until killed
``open DIR``                 keep the store open until stdin closes
``hold DIR``                 hold a raw LMDB read transaction until killed
``readers DIR``              print LMDB's reader table
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
from collections.abc import Callable

import structlog

from stalwart import store as store_module
from stalwart.errors import ConcurrencyError
from stalwart.events import MessageAppended, RecordedEvent
from stalwart.store import EventStore, LmdbEventStore

CRASH_THREADS = 4
BATCH_SIZES = (1, 1, 3, 1, 2)


def say(line: str) -> None:
    os.write(1, (line + "\n").encode())


def ack(records: list[RecordedEvent]) -> None:
    """One line for one append: [stream, version, position, event id] per event."""
    entries = [[r.stream, r.version, r.position, message_id(r)] for r in records]
    say(json.dumps({"ack": entries}))


def message_id(record: RecordedEvent) -> str:
    return record.event.message_id  # type: ignore[attr-defined, no-any-return]


def batch(writer: str, index: int, size: int, content: str = "x") -> list[MessageAppended]:
    return [
        MessageAppended(message_id=f"{writer}b{index}.{k}/{size}", role="user", content=content)
        for k in range(size)
    ]


def guarded(fn: Callable[[], None]) -> Callable[[], None]:
    """Run ``fn``; a failure is printed as an ``error`` line the parent fails on."""

    def run() -> None:
        try:
            fn()
        except BaseException as exc:
            say(json.dumps({"error": f"{type(exc).__name__}: {exc}"}))

    return run


def run_threads(targets: list[Callable[[], None]]) -> None:
    threads = [threading.Thread(target=guarded(t)) for t in targets]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()


def wait_for_go() -> None:
    say("ready")
    sys.stdin.readline()


def crash(store: EventStore, round_: str) -> None:
    def appender(t: int) -> Callable[[], None]:
        def work() -> None:
            writer = f"r{round_}t{t}"
            index = 0
            while True:
                size = BATCH_SIZES[index % len(BATCH_SIZES)]
                ack(store.append(f"crash:{writer}", batch(writer, index, size)))
                index += 1

        return work

    for t in range(CRASH_THREADS):
        threading.Thread(target=guarded(appender(t)), daemon=True).start()
    threading.Event().wait()  # until SIGKILL


def concurrent(store: EventStore, proc: str, threads: int, count: int, content: str) -> None:
    def appender(t: int) -> Callable[[], None]:
        def work() -> None:
            writer = f"p{proc}t{t}"
            for index in range(count):
                size = BATCH_SIZES[index % len(BATCH_SIZES)]
                stream = f"private:{writer}" if index % 2 else f"shared:{(t + index) % 2}"
                events = batch(writer, index, size, content)
                ack(store.append(stream, events, expected_version=None))

        return work

    wait_for_go()
    run_threads([appender(t) for t in range(threads)])


def race(store: EventStore, proc: str, count: int) -> None:
    def work() -> None:
        writer = f"q{proc}"
        version = store.stream_version("race:1")
        conflicts = 0
        index = 0
        while index < count:
            try:
                records = store.append("race:1", batch(writer, index, 1), expected_version=version)
            except ConcurrencyError as exc:
                conflicts += 1
                version = exc.actual
                continue
            ack(records)
            version = records[-1].version
            index += 1
        say(json.dumps({"conflicts": conflicts}))

    wait_for_go()
    run_threads([work])


def follow(store: EventStore, count: int) -> None:
    with store.subscribe(1) as subscription:
        say("ready")
        for seen, record in enumerate(subscription, 1):
            say(f"{record.position} {record.stream} {record.version} {time.time()!r}")
            if seen >= count:
                return


def read(store: EventStore) -> None:
    passes = 0
    while True:
        count = sum(1 for _ in store.read_all())
        passes += 1
        say(f"pass {passes} {count}")


def keep_open(store: EventStore) -> None:
    say(f"open {store.head()}")
    sys.stdin.read()


def hold(path: str) -> None:
    import lmdb

    env = lmdb.open(path, max_dbs=8, readonly=True)
    txn = env.begin()
    cursor = txn.cursor(db=env.open_db(b"log", txn=txn, create=False))
    cursor.first()
    say(f"holding {os.getpid()}")
    threading.Event().wait()  # until SIGKILL


def readers(path: str) -> None:
    import lmdb

    env = lmdb.open(path, max_dbs=8, readonly=True)
    say(env.readers())
    env.close()


def main(argv: list[str]) -> None:
    # the library's log lines (a map growing) go to stderr, not into the acknowledgements
    structlog.configure(logger_factory=structlog.PrintLoggerFactory(sys.stderr))
    mode, path, *rest = argv
    if mode == "hold":
        hold(path)
        return
    if mode == "readers":
        readers(path)
        return
    if mode == "concurrent":
        # a small map grows while the other processes have it mapped too
        store: EventStore = LmdbEventStore(path, map_size=int(rest[3]) * 1024)
    else:
        store = store_module.open(path, create=mode in ("crash", "race"))
    try:
        if mode == "crash":
            crash(store, rest[0])
        elif mode == "concurrent":
            concurrent(store, rest[0], int(rest[1]), int(rest[2]), "y" * int(rest[4]))
        elif mode == "race":
            race(store, rest[0], int(rest[1]))
        elif mode == "follow":
            follow(store, int(rest[0]))
        elif mode == "read":
            read(store)
        elif mode == "open":
            keep_open(store)
        else:
            raise SystemExit(f"unknown mode {mode!r}")
    finally:
        store.close()
    say("done")


if __name__ == "__main__":
    main(sys.argv[1:])
