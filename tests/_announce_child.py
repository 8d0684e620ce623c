"""A child process for tests/test_runtime_restarts.py: ``python _announce_child.py DIR T0``.

Runs a Runtime (a FakeClock at T0) on the store in DIR whose sub-agent run succeeds at
once; its completion waits in the announcer's batch (the clock never moves, so the batch
is never due). Prints ``{"ended": run id}`` once the run's handle resolved, then waits
for SIGKILL: the result is in the log and was announced to nobody. Every line is one
``os.write``, so a kill never leaves half a line.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import threading

import structlog

from stalwart.actors import RunReport
from stalwart.channels import MemoryChannel
from stalwart.clock import FakeClock
from stalwart.config import parse_config
from stalwart.runtime import Runtime

WAIT = 30.0


def say(what: dict[str, str]) -> None:
    os.write(1, (json.dumps(what) + "\n").encode())


async def quick(report: RunReport) -> str:
    return "the answer"


def main(directory: str, start: float) -> None:
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.CRITICAL))
    config = parse_config(
        {
            # no call is made: the run's work is ``quick``
            "providers": {"main": {"kind": "openai", "base_url": "http://127.0.0.1:9"}},
            "agents": {"default": {"provider": "main", "model": "m1"}},
        }
    )
    clock, chat = FakeClock(start=start), MemoryChannel("chat")
    with Runtime(config, store=directory, clock=clock, channels={"chat": chat}) as rt:
        handle = rt.spawn("p1", "write code", task_class="code", channel="chat", work=quick)
        if handle.result(WAIT).outcome != "succeeded":
            say({"error": "the run did not succeed"})
            return
        if list(rt.announcements()) != ["p1"]:
            say({"error": "the completion is not waiting in a batch"})
            return
        say({"ended": handle.run_id})
        threading.Event().wait()  # until SIGKILL


if __name__ == "__main__":
    try:
        main(sys.argv[1], float(sys.argv[2]))
    except BaseException as exc:
        say({"error": f"{type(exc).__name__}: {exc}"})
        raise
