"""A child process for tests/test_operator_crash_review.py:
``python -m tests._operator_crash_child STORE BASE_URL SCENARIO T0``.

Runs a Runtime (a FakeClock at T0, a MemoryChannel ``chat``, an API key from the
environment) on the store at STORE, drives session ``s1`` to the crash point the
SCENARIO names, prints ``{"ready": ...}`` on one line (one ``os.write``) and waits for
SIGKILL. The parent reads the log, not this process's memory.

Scenarios:

- ``stream``: a message whose model stream trickles for ever (crash point: the call is
  in the log; the parent waits for deltas on the fake provider, then kills);
- ``backoff``: a model call failed and its retry waits out a long backoff;
- ``tool``: the model called ``charge``, whose effect is made (a line in MARKER) and
  which then blocks;
- ``approval``: the model called ``refund`` (needs confirmation): the session is paused;
- ``subagent``: a sub-agent run reported progress and hangs;
- ``deadletter``: the answer could not be delivered and is queued in the dead letters.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
from typing import Any

import anyio
import structlog

from stalwart import store as store_module
from stalwart.actors import RunReport
from stalwart.channels import MemoryChannel
from stalwart.clock import FakeClock
from stalwart.config import Config, parse_config
from stalwart.runtime import Runtime

WAIT = 30.0
KEY_ENV = "OPERATOR_CRASH_KEY"


def say(what: dict[str, Any]) -> None:
    os.write(1, (json.dumps(what) + "\n").encode())


def config(
    base_url: str, *, retrying: bool = False, activations: dict[str, Any] | None = None
) -> Config:
    agent: dict[str, Any] = {
        "provider": "main",
        "model": "m1",
        "max_retries": 0,
        "prompt_timeout_ms": 60_000,
        "retry_prompt_timeout_ms": 60_000,
    }
    if retrying:
        agent |= {"max_retries": 2, "retry_base_ms": 20_000, "retry_cap_ms": 20_000}
    return parse_config(
        {
            "providers": {"main": {"kind": "openai", "base_url": base_url, "api_key_env": KEY_ENV}},
            "agents": {"default": agent},
            "activations": activations or {},
        }
    )


def wait_log(location: str, stream: str, types: set[str]) -> None:
    """Until every type in ``types`` is in ``stream`` (read through a second handle)."""
    give_up = time.monotonic() + WAIT
    with store_module.open(location, read_only=True) as reader:
        while True:
            head = reader.head()
            seen = {r.type for r in reader.read_stream(stream)} if head else set()
            if types <= seen:
                return
            if time.monotonic() > give_up:
                say({"error": f"never reached {sorted(types - seen)}"})
                sys.exit(3)
            reader.wait_for(head + 1, 0.2)


def main(location: str, base_url: str, scenario: str, t0: float) -> None:
    structlog.configure(logger_factory=structlog.PrintLoggerFactory(sys.stderr))
    clock = FakeClock(start=t0)
    chat = MemoryChannel("chat")
    marker = os.environ.get("MARKER", "")
    rt = Runtime(
        config(base_url, retrying=scenario == "backoff"),
        store=location,
        clock=clock,
        channels={"chat": chat},
    )
    rt.start()

    @rt.tool
    def charge(order: int) -> str:
        """Charge an order."""
        with open(marker, "a") as f:  # the side effect, made once
            f.write(f"charged {order}\n")
        threading.Event().wait()  # then hangs: the process dies mid-call
        return "never"

    @rt.tool(needs_confirmation=True)
    def refund(order: int) -> str:
        """Refund an order."""
        return f"refunded {order}"

    if scenario == "deadletter":
        chat.fail_next(5, kind="server_error")
    if scenario in ("subagent", "subagent_model"):
        rt.session("s1", channel="chat")

        async def work(report: RunReport) -> str:
            report.progress(500, 1)
            await anyio.sleep_forever()
            return "never"

        if scenario == "subagent":
            run = rt.spawn("s1", "format the report", task_class="formatting", work=work)
            wait_log(location, f"session:{run.run_id}", {"subagent:progress"})
        else:  # model-driven: its own Agent's model call hangs
            run = rt.spawn("s1", "format the report", task_class="formatting")
            wait_log(location, f"session:{run.run_id}", {"prompt:started"})
        say({"ready": run.run_id})
    else:
        rt.session("s1", channel="chat").send("please help with order 7")
        wanted = {
            "stream": {"prompt:started"},
            "backoff": {"prompt:retry_scheduled"},
            "tool": {"tool:started"},
            "approval": {"activation:blocked", "announcement:delivered"},
            "deadletter": {"announcement:send_failed", "activation:acked"},
        }[scenario]
        wait_log(location, "session:s1", wanted)
        if scenario == "tool":
            give_up = time.monotonic() + WAIT
            while not (os.path.exists(marker) and os.path.getsize(marker)):
                assert time.monotonic() < give_up
                time.sleep(0.01)  # real-time: the tool runs on the runtime's loop
        if scenario == "deadletter":
            wait_log(location, "deadletter", {"announcement:dead_lettered"})
        say({"ready": scenario})
    threading.Event().wait()  # until SIGKILL


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3], float(sys.argv[4]))
