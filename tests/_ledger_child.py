"""A child process for tests/test_context_ledger.py: ``python tests/_ledger_child.py DIR``.

A worker that dies in the middle of a summarizer call: it opens the LMDB store at DIR,
starts a ContextStoreActor (on the system clock) whose summarizer prints ``calling`` and
then waits until the process is killed, and asks for an assembly of session ``child``
(tenant ``t``) that needs a summary. The parent SIGKILLs it after ``calling``: the call's
reservation is in the tenant's ledger, and its release never will be.

Every line is written with one ``os.write``, so a SIGKILL never leaves half a line. The
settings and the history are shared with the parent (it imports this module), so both
sides agree on what one call may spend.
"""

from __future__ import annotations

import os
import sys
import threading

import structlog

from stalwart import store as store_module
from stalwart.actors import Assemble, ContextStoreActor, ask_context
from stalwart.clock import SystemClock
from stalwart.config import (
    ContextEngineSettings,
    SummarizerBreakerSettings,
    SummarizerSpendSettings,
)
from stalwart.context import ContextMessage, SummaryRequest

#: the tenant's hourly cap: one call over ``history(8, 250)`` (about 5,700 tokens
#: projected) fits, two do not
CAP = 6_000
#: how long a reservation whose worker died keeps counting
LEASE_MS = 300_000
BUDGET = 3_000
TENANT = "t"


def ledger_settings(cap: int = CAP, **breaker: int) -> ContextEngineSettings:
    """One summary per assembly of ``history(8, 250)`` within ``BUDGET``; an hourly cap
    of ``cap`` (the daily one off)."""
    return ContextEngineSettings(
        fresh_tail_turns=1,
        summarizer_spend=SummarizerSpendSettings(
            max_tokens_per_tenant_per_hour=cap,
            max_tokens_per_tenant_per_day=0,
            reservation_lease_ms=LEASE_MS,
        ),
        summarizer_breaker=SummarizerBreakerSettings(**breaker),
    )


def history(pairs: int, words: int) -> tuple[ContextMessage, ...]:
    """A system message and ``pairs`` user/assistant turns of ``words`` words each."""
    out = [ContextMessage(message_id="sys", seq=0, role="system", content="Be brief.")]
    for n in range(pairs):
        for role in ("user", "assistant"):
            out.append(
                ContextMessage(
                    message_id=f"{role[0]}{n}",
                    seq=len(out),
                    role=role,  # type: ignore[arg-type]
                    content=f"{role} {n}: " + "word " * words,
                )
            )
    return tuple(out)


def say(line: str) -> None:
    os.write(1, (line + "\n").encode())


class Hangs:
    """A summarizer that says ``calling`` and never answers (until SIGKILL)."""

    def __call__(self, request: SummaryRequest) -> tuple[str, int, int]:
        say("calling")
        threading.Event().wait()
        raise AssertionError("unreachable")


def main(argv: list[str]) -> None:
    # the library's log lines go to stderr, not into what the parent reads
    structlog.configure(logger_factory=structlog.PrintLoggerFactory(sys.stderr))
    (path,) = argv
    clock = SystemClock()
    store = store_module.open(path, clock=clock)
    ref = ContextStoreActor.start(
        store=store, clock=clock, summarizer=Hangs(), settings=ledger_settings()
    )
    say("started")
    message = Assemble(session_id="child", messages=history(8, 250), budget=BUDGET, tenant=TENANT)
    ask_context(ref, message, timeout=3_600)
    say("answered")  # never: the summarizer hangs until the parent kills this process


if __name__ == "__main__":
    main(sys.argv[1:])
