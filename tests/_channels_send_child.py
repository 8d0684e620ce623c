"""A child process for tests/test_channels_review_two.py:
``python tests/_channels_send_child.py DIR BASE_URL T0``.

Runs a Runtime (a FakeClock at T0, the clock never moves) on the store in DIR whose
session ``s1`` answers one message from the fake provider at BASE_URL on a MemoryChannel
``chat`` that hangs: the answer is recorded as queued and its send is under way, with
no outcome. Prints ``{"sending": idempotency key, "text": ...}`` once the send reached
the channel, then waits for SIGKILL. Every line is one ``os.write``, so a kill never
leaves half a line.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import threading

import anyio
import structlog

from stalwart.channels import MemoryChannel
from stalwart.clock import FakeClock
from stalwart.config import parse_config
from stalwart.runtime import Runtime

WAIT = 30.0


def say(what: dict[str, str]) -> None:
    os.write(1, (json.dumps(what) + "\n").encode())


def main(directory: str, base_url: str, start: float) -> None:
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.CRITICAL))
    config = parse_config(
        {
            "providers": {"main": {"kind": "openai", "base_url": base_url}},
            "agents": {"default": {"provider": "main", "model": "m1", "max_retries": 0}},
        }
    )
    clock, chat = FakeClock(start=start), MemoryChannel("chat")
    chat.hang_next(1)
    with Runtime(config, store=directory, clock=clock, channels={"chat": chat}) as rt:
        rt.session("s1", channel="chat").send("hello")

        async def attempted() -> None:
            with anyio.fail_after(WAIT):
                await chat.wait_for(1, attempted=True)

        rt.portal.submit(attempted).result(WAIT + 1)
        [sending] = chat.attempted
        say({"sending": sending.idempotency_key, "text": sending.text})
        threading.Event().wait()  # until SIGKILL


if __name__ == "__main__":
    try:
        main(sys.argv[1], sys.argv[2], float(sys.argv[3]))
    except BaseException as exc:
        say({"error": f"{type(exc).__name__}: {exc}"})
        raise
