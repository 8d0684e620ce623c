"""A second worker process for tests/test_failed_answers.py:
``python _dead_letter_peer_child.py DIR BASE_URL T0``.

Runs a Runtime (its own worker, its own dead-letter queue) on the store in DIR, as a
second ``stalwart worker`` would (on a FakeClock at T0, the parent's time), answers one
message of session ``other`` on a channel that refuses it, prints ``{"dead_lettered":
announcement id}`` once its dead-letter queue has recorded the entry, and exits.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import time

import structlog

from stalwart import store as store_module
from stalwart.channels import MemoryChannel
from stalwart.clock import FakeClock
from stalwart.config import parse_config
from stalwart.events import AnnouncementDeadLettered
from stalwart.runtime import Runtime

WAIT = 20.0


def main(directory: str, base_url: str, start: float) -> None:
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.CRITICAL))
    config = parse_config(
        {
            "providers": {"main": {"kind": "openai", "base_url": base_url}},
            "agents": {"default": {"provider": "main", "model": "m1", "max_retries": 0}},
        }
    )
    chat = MemoryChannel("chat")
    chat.fail_next(1)
    clock = FakeClock(start=start)
    store = store_module.open(directory, clock=clock)
    try:
        with Runtime(config, store=store, clock=clock, channels={"chat": chat}) as rt:
            rt.session("other", channel="chat").send("hello")
            give_up = time.monotonic() + WAIT
            while time.monotonic() < give_up:
                head = store.head()
                entries = [
                    r.event
                    for r in store.read_stream("deadletter")
                    if isinstance(r.event, AnnouncementDeadLettered)
                ]
                if entries:
                    line = json.dumps({"dead_lettered": entries[0].announcement_id})
                    os.write(1, (line + "\n").encode())
                    return
                store.wait_for(head + 1, 0.5)
            sys.exit("the child's dead-letter queue never recorded its entry")
    finally:
        store.close()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], float(sys.argv[3]))
