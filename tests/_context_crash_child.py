"""A worker process for tests/test_context_crash_review.py:
``python tests/_context_crash_child.py DIR BASE_URL``.

A Runtime (system clock) on the LMDB store at DIR whose models are the fake provider at
BASE_URL: it runs the sessions' activations until the parent SIGKILLs it, wherever the
parent's script of the fake provider holds it (inside a summarizer call, inside the main
model's call after the summary was recorded). It prints ``started`` once it runs; every
line is one ``os.write``. The config is shared with the parent (it imports this module),
so the runtime the parent restarts on the same directory runs under the same knobs, and
``replay --verify`` reads one config.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
from typing import Any

import structlog

from stalwart.channels import MemoryChannel
from stalwart.config import Config, parse_config
from stalwart.runtime import Runtime

#: the tenant's hourly summarizer cap (the daily one off): one call over the crash
#: tests' first chunk (about 800 tokens projected) fits, two do not
PER_HOUR = 1_200
LEASE_MS = 300_000


def crash_config(base_url: str, **context: Any) -> Config:
    """Agent ``worker`` (model ``m1``) runs the sessions in a window small enough that a
    few long turns need a leaf summary; the ``default`` agent's model ``summ`` is the
    summarizer (so the fake provider can script it apart from the main model)."""
    agent = {"provider": "main", "max_retries": 0, "max_tokens": 128, "context_window": 2_048}
    spend = {
        "max_tokens_per_tenant_per_hour": PER_HOUR,
        "max_tokens_per_tenant_per_day": 0,
        "reservation_lease_ms": LEASE_MS,
    }
    return parse_config(
        {
            "providers": {"main": {"kind": "openai", "base_url": base_url}},
            "agents": {
                "default": {**agent, "model": "summ"},
                "worker": {**agent, "model": "m1"},
            },
            "activations": {"lease_ttl_ms": 3_000, "renew_every_ms": 1_000, "poll_ms": 50},
            "context_engine": {"fresh_tail_turns": 1, "summarizer_spend": spend, **context},
        }
    )


def say(line: str) -> None:
    os.write(1, (line + "\n").encode())


def main(argv: list[str]) -> None:
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.CRITICAL))
    path, base_url = argv
    channels = {"chat": MemoryChannel("chat")}
    with Runtime(crash_config(base_url), store=path, channels=channels):
        say("started")
        threading.Event().wait()  # until SIGKILL


if __name__ == "__main__":
    main(sys.argv[1:])
