"""A child process for tests/test_deadletter_actor.py: ``python _deadletter_child.py DIR T0``.

Starts a DeadLetterActor on the store in DIR (a FakeClock at T0, a channel that always
fails), queues one announcement and prints ``{"enqueued": id}`` once the ask returned
(the entry is in the log: the promise the parent checks), moves the clock to the first
retry, prints ``{"failed": id}`` once the failed send is in the log, then waits for
SIGKILL. Every line is one ``os.write``, so a kill never leaves half a line.
"""

from __future__ import annotations

import json
import os
import sys
import threading

import structlog

from stalwart import store as store_module
from stalwart.actors import DeadLetterActor, Enqueue, IoPortal, Scheduler
from stalwart.channels import MemoryChannel
from stalwart.clock import FakeClock

WAIT = 30.0


def say(what: dict[str, str]) -> None:
    os.write(1, (json.dumps(what) + "\n").encode())


def main(directory: str, start: float) -> None:
    # the library's log lines go to stderr, not into the acknowledgements
    structlog.configure(logger_factory=structlog.PrintLoggerFactory(sys.stderr))
    clock = FakeClock(start=start)
    store = store_module.open(directory, clock=clock)
    scheduler = Scheduler(clock).start()
    portal = IoPortal().start()
    down = MemoryChannel("chat")
    down.fail_next(1000)
    ref = DeadLetterActor.start(
        store=store, clock=clock, scheduler=scheduler, portal=portal, channels={"chat": down}
    )
    entry_id = ref.ask(Enqueue("a-1", "chat", "conv-1", "text 1", "timeout"), timeout=WAIT)
    say({"enqueued": entry_id})
    clock.set(start + 30)  # the first retry: it fails
    if store.wait_for(3, WAIT) < 3:  # the retry's decision, then its failed send
        say({"error": "the failed retry was never recorded"})
        return
    say({"failed": entry_id})
    threading.Event().wait()  # until SIGKILL


if __name__ == "__main__":
    try:
        main(sys.argv[1], float(sys.argv[2]))
    except BaseException as exc:
        say({"error": f"{type(exc).__name__}: {exc}"})
        raise
