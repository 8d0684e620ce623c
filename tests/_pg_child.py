"""A child process for tests/test_store_postgres_processes.py: ``python _pg_child.py MODE ...``.

``paced URL COUNT INTERVAL``  append COUNT events to ``s:paced``, one every INTERVAL s
``hammer URL PROC COUNT``     COUNT appends of 1 to 3 events across three shared streams
                              and one of its own, as fast as it can
"""

from __future__ import annotations

import sys
import time

from stalwart import store as store_module
from stalwart.events import MessageAppended


def _msg(text: str) -> MessageAppended:
    return MessageAppended(message_id=text, role="user", content=text)


def paced(url: str, count: int, interval: float) -> None:
    store = store_module.open(url)
    try:
        for i in range(count):
            store.append("s:paced", [_msg(f"paced-{i}")])
            time.sleep(interval)
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


if __name__ == "__main__":
    mode, *args = sys.argv[1:]
    if mode == "paced":
        paced(args[0], int(args[1]), float(args[2]))
    elif mode == "hammer":
        hammer(args[0], args[1], int(args[2]))
    else:
        raise SystemExit(f"unknown mode {mode!r}")
