"""A worker process for tests/test_durable_crash.py: a Runtime on a shared store that runs
activations until it is killed (SIGKILL), frozen (SIGSTOP) or told to stop (SIGTERM).

Started through a ``forkserver`` multiprocessing context that has imported stalwart once,
so each start costs milliseconds, not an interpreter's start-up. Structured logs are
silenced: the parent reads the log, not the child's output.
"""

from __future__ import annotations

import logging
import signal
import threading
from typing import Any

import structlog

import stalwart.store._postgres  # noqa: F401  (imported once in the forkserver, not per child)
from stalwart.channels import MemoryChannel
from stalwart.config import parse_config
from stalwart.runtime import Runtime


def run(location: str, base_url: str, activations: dict[str, Any], ready: Any) -> None:
    """Run a worker on the store at ``location`` (a directory or a PostgreSQL URL)."""
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.CRITICAL))
    config = parse_config(
        {
            "providers": {"main": {"kind": "openai", "base_url": base_url}},
            "agents": {"default": {"provider": "main", "model": "m1", "max_retries": 0}},
            "activations": activations,
        }
    )
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    with Runtime(config, store=location, channels={"chat": MemoryChannel("chat")}) as rt:
        ready.put(rt.worker().owner)
        stop.wait()
