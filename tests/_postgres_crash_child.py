"""A worker process for tests/test_postgres_crash_review.py:
``python -m tests._postgres_crash_child URL BASE_URL DIR ACTIVATIONS_JSON``.

Runs a Runtime on the real clock and the store at URL (a ``postgresql://`` URL with its
password), its provider at BASE_URL with an API key from the environment, until SIGTERM
(a clean stop), SIGKILL or SIGSTOP. Prints ``{"owner": ...}`` on one line once its
worker is up. Its structured logs (info and up) go to stderr, which the parent keeps to
look for secrets.

What the user is told is appended to ``DIR/said.log`` (one line per delivery:
``pid<TAB>conversation<TAB>idempotency key<TAB>text``), so the parent sees every answer of
every worker process. Tools, all with effects recorded in ``DIR/effects.log`` (``tool<TAB>key``):

- ``charge(order)``: makes its effect, then holds the call ``DIR/charge_hold`` seconds
  (a number in that file, 0 when absent);
- ``charge_checked(order)``: the same, with a ``reconcile`` that looks for its key in
  ``effects.log``;
- ``refund(order)``: needs confirmation; makes its effect at once.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Any

import structlog

from stalwart.channels import Delivery, OutboundMessage
from stalwart.config import parse_config
from stalwart.runtime import Runtime
from stalwart.tools import current_call

KEY_ENV = "PG_CRASH_KEY"


class SaidChannel:
    """Every delivery, appended to a file the parent reads (one line, one ``write``)."""

    def __init__(self, name: str, path: Path) -> None:
        self.name = name
        self._path = path

    async def send(self, message: OutboundMessage) -> Delivery:
        line = f"{os.getpid()}\t{message.conversation}\t{message.idempotency_key}\t{message.text}\n"
        with open(self._path, "a") as out:
            out.write(line)
        return Delivery(channel=self.name)

    async def aclose(self) -> None:
        return None


def _effect(directory: Path, tool: str) -> str:
    key = current_call().idempotency_key
    with open(directory / "effects.log", "a") as out:
        out.write(f"{tool}\t{key}\n")
    return key


def _hold(directory: Path) -> None:
    try:
        seconds = float((directory / "charge_hold").read_text())
    except OSError:
        seconds = 0.0
    time.sleep(seconds)  # real-time: the call is under way while the parent acts


def main(url: str, base_url: str, directory: Path, activations: dict[str, Any]) -> None:
    structlog.configure(
        wrapper_class=structlog.make_filtering_bound_logger(logging.INFO),
        logger_factory=structlog.PrintLoggerFactory(sys.stderr),
    )
    config = parse_config(
        {
            "providers": {"main": {"kind": "openai", "base_url": base_url, "api_key_env": KEY_ENV}},
            # one retry: a call the loopback fake cuts (seen once in a few full-suite runs
            # on a loaded 2-core machine: `stream_cut`, the fake recording no request) is
            # not what these tests are about, and production retries it the same way
            "agents": {
                "default": {
                    "provider": "main",
                    "model": "m1",
                    "max_retries": 1,
                    "retry_base_ms": 10,
                    "retry_cap_ms": 50,
                }
            },
            "activations": activations,
        }
    )
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    chat = SaidChannel("chat", directory / "said.log")
    with Runtime(config, store=url, channels={"chat": chat}) as rt:  # type: ignore[dict-item]

        @rt.tool
        def charge(order: int) -> str:
            """Charge an order."""
            key = _effect(directory, "charge")
            _hold(directory)
            return f"charged {order} ({key})"

        def check(key: str, arguments: dict[str, Any]) -> str | None:
            with open(directory / "effects.log") as seen:
                done = f"charge_checked\t{key}\n" in seen.read()
            return "already charged" if done else None

        @rt.tool(reconcile=check)
        def charge_checked(order: int) -> str:
            """Charge an order, checked after a crash."""
            key = _effect(directory, "charge_checked")
            _hold(directory)
            return f"charged {order} ({key})"

        @rt.tool(needs_confirmation=True)
        def refund(order: int) -> str:
            """Refund an order."""
            key = _effect(directory, "refund")
            return f"refunded {order} ({key})"

        os.write(1, (json.dumps({"owner": rt.worker().owner}) + "\n").encode())
        stop.wait()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], Path(sys.argv[3]), json.loads(sys.argv[4]))
