"""A child process for tests/test_supervisor.py: ``python _subagent_child.py DIR T0``.

Starts a SubAgentActor on the store in DIR (a FakeClock at T0) whose work reports
progress twice and then hangs, prints ``{"running": run id}`` once the spawn and both
progress reports are in the log, then waits for SIGKILL: the run is left ``running`` with
nobody to fire its watchdog. Every line is one ``os.write``, so a kill never leaves half
a line.
"""

from __future__ import annotations

import json
import os
import sys
import threading

import anyio
import structlog

from stalwart import store as store_module
from stalwart.actors import IoPortal, RunReport, Scheduler, Spawn, SubAgentActor
from stalwart.clock import FakeClock

WAIT = 30.0


def say(what: dict[str, str]) -> None:
    os.write(1, (json.dumps(what) + "\n").encode())


async def work(report: RunReport) -> str:
    report.progress(1_000, 1)
    report.progress(21_634, 2)
    await anyio.sleep_forever()  # the hung call
    return "never"


def main(directory: str, start: float) -> None:
    # the library's log lines go to stderr, not into the acknowledgements
    structlog.configure(logger_factory=structlog.PrintLoggerFactory(sys.stderr))
    clock = FakeClock(start=start)
    store = store_module.open(directory, clock=clock)
    scheduler = Scheduler(clock).start()
    portal = IoPortal().start()
    spawn = Spawn(
        run_id="ghost",
        parent="p1",
        task="research the migration",
        task_class="research",
        channel="chat",
        conversation="conv-1",
    )
    SubAgentActor.start(
        store=store, clock=clock, scheduler=scheduler, portal=portal, spawn=spawn, work=work
    )
    if store.wait_for(3, WAIT) < 3:
        say({"error": "the run's progress was never recorded"})
        return
    say({"running": "ghost"})
    threading.Event().wait()  # until SIGKILL


if __name__ == "__main__":
    try:
        main(sys.argv[1], float(sys.argv[2]))
    except BaseException as exc:
        say({"error": f"{type(exc).__name__}: {exc}"})
        raise
