"""Two defects a review of the tenant ledger found (both fixed):

1. An admission the store refused (a store error inside ``DagEngine.assemble``) left the
   session in the ContextStore's memory, bound to its tenant, with nothing recorded: the
   next assembly wrote ``context:<session>`` without its ``context:bound``, and a rebuild
   accepted another tenant's write.
2. A release the store refused is appended later, with the time its call ended: the
   fold took that older time as the breaker's latest failure (and a late success reset
   failures recorded after it), so the breaker reopened early.

And a lease no longer than a summary call may run is refused by the config.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import pytest

from stalwart import store as store_module
from stalwart.actors import LEDGER_STREAM, Assemble, ContextStoreActor, StoreLedger, ask_context
from stalwart.clock import FakeClock
from stalwart.config import (
    ContextEngineSettings,
    SummarizerBreakerSettings,
    SummarizerSpendSettings,
)
from stalwart.context import ContextScopeError, ExtractiveSummarizer, ended
from stalwart.errors import ConfigError, StoreError
from stalwart.events import (
    ContextBound,
    ContextSummarizerReleased,
    ContextSummarizerReserved,
    Event,
)
from stalwart.state import GovernorState, SummarizerVerdict, apply_governor_event, decide_summarizer
from stalwart.store import EventStore, NewEvent
from tests._ledger_child import BUDGET, history, ledger_settings

T0 = 1_800_000_000.0
KNOBS: dict[str, Any] = {
    "per_hour": 0,
    "per_day": 0,
    "failure_threshold": 2,
    "reset_timeout_ms": 60_000,
}


class Refusing:
    """A real store whose ``append`` raises StoreError for the events ``refuse`` picks,
    while ``down`` (a blip of the database); everything else goes to the store."""

    def __init__(self, store: EventStore, refuse: Callable[[str, Sequence[Event]], bool]) -> None:
        self._store = store
        self._refuse = refuse
        self.down = True
        self.refused = 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self._store, name)

    def append(
        self, stream: str, events: Sequence[Event | NewEvent], *args: Any, **kwargs: Any
    ) -> Any:
        plain = [e.event if isinstance(e, NewEvent) else e for e in events]
        if self.down and self._refuse(stream, plain):
            self.refused += 1
            raise StoreError("the database went away")
        return self._store.append(stream, events, *args, **kwargs)


def one_admission(store: EventStore) -> Refusing:
    """Refuses the first reservation, then is back."""
    proxy: Refusing

    def refuse(stream: str, events: Sequence[Event]) -> bool:
        reserving = any(isinstance(e, ContextSummarizerReserved) for e in events)
        if reserving and stream.startswith(LEDGER_STREAM):
            proxy.down = False
            return True
        return False

    proxy = Refusing(store, refuse)
    return proxy


def releases(store: EventStore) -> Refusing:
    """Refuses every release while ``down``."""
    return Refusing(
        store, lambda _, events: any(isinstance(e, ContextSummarizerReleased) for e in events)
    )


def test_a_session_whose_admission_failed_still_opens_with_context_bound(tmp_path: Path) -> None:
    clock = FakeClock(start=1_800_000_000.0)
    store = store_module.open(tmp_path / "store", clock=clock)
    proxy = one_admission(store)
    ref = ContextStoreActor.start(
        store=proxy, clock=clock, summarizer=ExtractiveSummarizer(), settings=ledger_settings(cap=0)
    )
    message = Assemble(session_id="s", messages=history(8, 250), budget=BUDGET, tenant="t")
    try:
        with pytest.raises(StoreError):
            ask_context(ref, message, 10)
        ask_context(ref, message, 10)  # the store is back
    finally:
        ref.stop()
        first = next(iter(store.read_stream("context:s")))
        store.close()
    assert proxy.refused == 1
    assert isinstance(first.event, ContextBound), f"context:s opens with {first.event!r}"


def test_after_a_failed_admission_a_restarted_store_still_refuses_another_tenant(
    tmp_path: Path,
) -> None:
    clock = FakeClock(start=1_800_000_000.0)
    store = store_module.open(tmp_path / "store", clock=clock)
    proxy = one_admission(store)
    settings = ledger_settings(cap=0)
    ref = ContextStoreActor.start(
        store=proxy, clock=clock, summarizer=ExtractiveSummarizer(), settings=settings
    )
    message = Assemble(session_id="s", messages=history(8, 250), budget=BUDGET, tenant="t")
    try:
        with pytest.raises(StoreError):
            ask_context(ref, message, 10)
        ask_context(ref, message, 10)
    finally:
        ref.stop()
    restarted = ContextStoreActor.start(
        store=store, clock=clock, summarizer=ExtractiveSummarizer(), settings=settings
    )
    intruder = Assemble(session_id="s", messages=history(9, 250), budget=BUDGET, tenant="other")
    try:
        with pytest.raises(ContextScopeError):  # the session was bound before
            ask_context(restarted, intruder, 10)
    finally:
        restarted.stop()
        store.close()


def failed(call_id: str) -> ContextSummarizerReleased:
    return ContextSummarizerReleased(call_id=call_id, tenant="t", error_class="ConnectionError")


def test_the_fold_keeps_the_latest_failure_time() -> None:
    state = GovernorState(tenant="t")
    state = apply_governor_event(state, failed("b1"), T0 + 30)
    state = apply_governor_event(state, failed("b2"), T0 + 30)
    # a release written late (the store refused it at T0) is folded after them
    state = apply_governor_event(state, failed("a1"), T0)
    assert state.last_failure_at == T0 + 30
    assert decide_summarizer(state, T0 + 70, projected=1, **KNOBS).reason == "breaker_open"


def test_a_late_failed_release_reopens_the_breaker_early(tmp_path: Path) -> None:
    clock = FakeClock(start=T0)
    store = store_module.open(tmp_path / "store", clock=clock)
    try:
        proxy = releases(store)
        one = StoreLedger(proxy, clock, lease_ms=300_000)  # type: ignore[arg-type]  # a proxy
        two = StoreLedger(store, clock, lease_ms=300_000)

        def decide(state: GovernorState, now: float) -> SummarizerVerdict:
            return decide_summarizer(state, now, projected=1, **KNOBS)

        _, call = one.admit("t", "s1", 1, decide)  # worker one's call fails at T0 ...
        assert call is not None
        one.release(ended(call, input_tokens=0, output_tokens=0, error_class="X", duration_ms=1))
        proxy.down = False  # ... and its release is refused, kept for later
        clock.advance(30)
        for session in ("s2", "s3"):  # worker two's calls fail at T0 + 30: open until T0 + 90
            _, other = two.admit("t", session, 1, decide)
            assert other is not None
            two.release(
                ended(other, input_tokens=0, output_tokens=0, error_class="X", duration_ms=1)
            )
        clock.advance(40)  # T0 + 70: the breaker opened at T0 + 30 is still open
        assert two.admit("t", "s4", 1, decide)[0].reason == "breaker_open"
        verdict, trial = one.admit("t", "s5", 1, decide)  # flushes the late release first
        assert trial is None, "a trial was admitted 20 s before the breaker reopens"
        assert verdict.reason == "breaker_open"
    finally:
        store.close()


def test_a_success_recorded_late_ends_no_failure_that_came_after_it() -> None:
    state = GovernorState(tenant="t")
    state = apply_governor_event(state, failed("b1"), T0 + 30)
    state = apply_governor_event(state, failed("b2"), T0 + 31)
    late = ContextSummarizerReleased(call_id="a1", tenant="t", input_tokens=10)
    state = apply_governor_event(state, late, T0)  # it answered at T0; recorded after them
    assert state.consecutive_failures == 2
    assert sum(tokens for _, tokens in state.spend) == 10  # what it spent still counts
    on_time = ContextSummarizerReleased(call_id="a2", tenant="t", input_tokens=10)
    assert apply_governor_event(state, on_time, T0 + 32).consecutive_failures == 0


def test_a_lease_no_longer_than_a_summary_call_is_refused() -> None:
    """A summary's requests may run for ``half_open_timeout_ms``: a shorter lease would
    let a call still running stop counting against the caps."""
    with pytest.raises(ConfigError) as raised:
        ContextEngineSettings(
            summarizer_spend=SummarizerSpendSettings(reservation_lease_ms=30_000),
            summarizer_breaker=SummarizerBreakerSettings(half_open_timeout_ms=30_000),
        )
    assert raised.value.key == "context_engine.summarizer_spend.reservation_lease_ms"
