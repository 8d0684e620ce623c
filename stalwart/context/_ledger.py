"""Where a tenant's summarizer calls are admitted and released: the governor's ledger.

The DAG engine asks its ledger before every summarizer call. The ledger folds the
tenant's governor, lets the pure decision (:func:`~stalwart.state.decide_summarizer`)
judge the call, and records an admitted call as ``context:summarizer_reserved`` before it
runs; when the call ends, ``context:summarizer_released`` records what it spent and
whether it failed. A call still running counts against the caps (and a half-open trial
bars others) until it is released or its lease ends.

:class:`MemoryLedger` keeps those events in memory for an engine that runs alone (the
CLI's ``context simulate``, a benchmark, a test). The ContextStore actor's ledger
(:class:`stalwart.actors.StoreLedger`) appends them to the tenant's stream in the event
store, so every worker on that store shares one spend and one breaker, and each decision
can be replayed from the log.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Protocol

from stalwart.clock import Clock
from stalwart.events import ContextSummarizerReleased, ContextSummarizerReserved, Event
from stalwart.ids import new_id
from stalwart.state import GovernorFolder, GovernorState, SummarizerVerdict

__all__ = ["Decide", "MemoryLedger", "SummarizerLedger", "ended"]

#: the governor's decision on one call: the tenant's governor and the clock's reading
Decide = Callable[[GovernorState, float], SummarizerVerdict]


class SummarizerLedger(Protocol):
    """Admits and releases a tenant's summarizer calls (see the module). The engine
    calls it inside ``outside()``, where its owner lets other sessions work: it must be
    safe to call from several threads at once."""

    def admit(
        self, tenant: str | None, session: str | None, tokens: int, decide: Decide
    ) -> tuple[SummarizerVerdict, ContextSummarizerReserved | None]:
        """The verdict on a call that may spend about ``tokens``, and its reservation
        (the ``context:summarizer_reserved`` event) when it was let run, recorded before
        this returns."""
        ...

    def release(self, end: ContextSummarizerReleased) -> None:
        """Record the end of an admitted call (:func:`ended`): what it spent, and the
        class of its failure (None when it answered)."""
        ...

    def governor(self, tenant: str | None) -> GovernorState:
        """The tenant's governor as the ledger holds it now."""
        ...


def ended(
    reservation: ContextSummarizerReserved,
    *,
    input_tokens: int,
    output_tokens: int,
    error_class: str | None,
    duration_ms: int,
) -> ContextSummarizerReleased:
    """The event that records the end of ``reservation``'s call, for ``release``."""
    return ContextSummarizerReleased(
        call_id=reservation.call_id,
        tenant=reservation.tenant,
        input_tokens=max(0, input_tokens),
        output_tokens=max(0, output_tokens),
        error_class=error_class,
        duration_ms=max(0, duration_ms),
    )


class MemoryLedger:
    """A ledger kept in memory: one process, one engine, gone when it stops. Its lock
    makes each admission one step: fold, decide, reserve."""

    def __init__(self, clock: Clock, *, lease_ms: int, make_id: Callable[[], str] = new_id) -> None:
        self.clock = clock
        self.lease_ms = lease_ms
        self.make_id = make_id
        #: per tenant: its governor's fold (linear in the events, see GovernorFolder)
        self.governors: dict[str | None, GovernorFolder] = {}
        self._lock = threading.Lock()

    def governor(self, tenant: str | None) -> GovernorState:
        folder = self.governors.get(tenant)
        return GovernorState(tenant=tenant) if folder is None else folder.state()

    def _apply(self, tenant: str | None, event: Event) -> None:
        folder = self.governors.get(tenant)
        if folder is None:
            folder = self.governors[tenant] = GovernorFolder(GovernorState(tenant=tenant))
        folder.add_event(event, self.clock.now())

    def admit(
        self, tenant: str | None, session: str | None, tokens: int, decide: Decide
    ) -> tuple[SummarizerVerdict, ContextSummarizerReserved | None]:
        with self._lock:
            verdict = decide(self.governor(tenant), self.clock.now())
            if not verdict.allowed:
                return verdict, None
            reservation = ContextSummarizerReserved(
                call_id=self.make_id(),
                tenant=tenant,
                session=session,
                tokens=tokens,
                trial=verdict.trial,
                lease_ms=self.lease_ms,
            )
            self._apply(tenant, reservation)
            return verdict, reservation

    def release(self, end: ContextSummarizerReleased) -> None:
        with self._lock:
            self._apply(end.tenant, end)
