"""A child process for tests/test_store_postgres_processes.py: ``python _pg_child.py MODE ...``.

``paced URL COUNT INTERVAL``  append COUNT events to ``s:paced``, one every INTERVAL s
``hammer URL PROC COUNT``     COUNT appends of 1 to 3 events across three shared streams
                              and one of its own, as fast as it can
``race URL PROC ROUNDS``      4 threads; each round every thread tries to create the
                              round's stream (expected_version=NO_STREAM) and to claim
                              lease epoch round+1 of ``s:claim``; prints its wins
"""

from __future__ import annotations

import json
import sys
import threading
import time

from stalwart import store as store_module
from stalwart.errors import ConcurrencyError, FencedError
from stalwart.events import MessageAppended
from stalwart.store import NO_STREAM, Fence


def _msg(text: str) -> MessageAppended:
    return MessageAppended(message_id=text, role="user", content=text)


def paced(url: str, count: int, interval: float) -> None:
    store = store_module.open(url)
    try:
        for i in range(count):
            store.append("s:paced", [_msg(f"paced-{i}")])
            time.sleep(interval)  # real-time: appends spread over time, as a live writer's are
    finally:
        store.close()


def hammer(url: str, proc: str, count: int) -> None:
    store = store_module.open(url)
    try:
        for i in range(count):
            size = 1 + i % 3
            stream = f"s:shared-{i % 3}" if i % 2 else f"s:own-{proc}"
            store.append(stream, [_msg(f"{proc}-{i}-{k}") for k in range(size)])
    finally:
        store.close()


def race(url: str, proc: str, rounds: int) -> None:
    store = store_module.open(url)
    wins = {"created": 0, "claimed": 0}
    lock = threading.Lock()

    def run(thread: int) -> None:
        for r in range(rounds):
            me = f"{proc}-{thread}-{r}"
            try:
                store.append(f"s:new-{r}", [_msg(me)], expected_version=NO_STREAM)
                with lock:
                    wins["created"] += 1
            except ConcurrencyError:
                pass
            try:
                store.append("s:claim", [_msg(f"{r + 1}/{me}")], fence=Fence(r + 1, claim=True))
                with lock:
                    wins["claimed"] += 1
            except FencedError:
                pass

    try:
        threads = [threading.Thread(target=run, args=(t,)) for t in range(4)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    finally:
        store.close()
    print(json.dumps(wins), flush=True)


if __name__ == "__main__":
    mode, *args = sys.argv[1:]
    if mode == "paced":
        paced(args[0], int(args[1]), float(args[2]))
    elif mode == "hammer":
        hammer(args[0], args[1], int(args[2]))
    elif mode == "race":
        race(args[0], args[1], int(args[2]))
    else:
        raise SystemExit(f"unknown mode {mode!r}")
