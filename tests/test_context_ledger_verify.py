"""Replay verification of the summarizer's admissions (``context:summarizer_reserved``):
each is re-derived from its tenant's ledger as it stood before it, at its time, with the
config in force."""

from __future__ import annotations

from typing import Any

import msgspec

from stalwart.actors import Assemble, ContextStoreActor, ask_context, ledger_stream
from stalwart.clock import FakeClock
from stalwart.config import (
    Config,
    ContextEngineSettings,
    SummarizerBreakerSettings,
    SummarizerSpendSettings,
)
from stalwart.context import ContextMessage, SummaryRequest
from stalwart.events import ContextLedgerOpened, ContextSummarizerReserved, RecordedEvent
from stalwart.state import SUMMARIZER_LEDGER, VERIFIERS, aggregate_for, fold, verify
from stalwart.store import EventStore, NewEvent

ASK = 30.0
CAP = 60_000


def history(count: int) -> tuple[ContextMessage, ...]:
    return tuple(
        ContextMessage(
            message_id=f"m{n}",
            role="user" if n % 2 == 0 else "assistant",
            content=f"M{n} " + "word " * 300,
            seq=n,
            ts=1_800_000_000.0 + n,
        )
        for n in range(count)
    )


def summarizer(request: SummaryRequest) -> tuple[str, int, int]:
    return "what was said", 900, 60


class Failing:
    def __init__(self) -> None:
        self.calls = 0

    def __call__(self, request: SummaryRequest) -> tuple[str, int, int]:
        self.calls += 1
        raise ConnectionError("down")


def settings(**spend: int) -> ContextEngineSettings:
    return ContextEngineSettings(
        fresh_tail_turns=1,
        summarizer_spend=SummarizerSpendSettings(
            max_tokens_per_tenant_per_hour=spend.get("hour", CAP),
            max_tokens_per_tenant_per_day=spend.get("day", 0),
        ),
        summarizer_breaker=SummarizerBreakerSettings(failure_threshold=2),
    )


def defaults(engine: ContextEngineSettings) -> dict[str, Any]:
    return Config(context_engine=engine).to_record()


def run(
    store: EventStore,
    clock: FakeClock,
    engine: ContextEngineSettings,
    *,
    sessions: int,
    summarize: Any = summarizer,
) -> None:
    ref = ContextStoreActor.start(store=store, clock=clock, summarizer=summarize, settings=engine)
    try:
        for n in range(sessions):
            ask_context(
                ref,
                Assemble(session_id=f"s{n}", messages=history(30), budget=3_000, tenant="acme"),
                ASK,
            )
            clock.advance(5)
    finally:
        ref.stop()


def reservations(store: EventStore) -> list[RecordedEvent]:
    return [
        record
        for record in store.read_stream(ledger_stream("acme"))
        if isinstance(record.event, ContextSummarizerReserved)
    ]


def test_every_admission_a_runtime_recorded_verifies(store: EventStore, clock: FakeClock) -> None:
    engine = settings()
    run(store, clock, engine, sessions=4)
    admitted = reservations(store)
    assert len(admitted) >= 2
    report = verify(store.read_all(), VERIFIERS, defaults=defaults(engine))
    assert report.findings == ()
    assert report.checked["context:summarizer_reserved"] == len(admitted)


def test_a_trial_after_the_breaker_opened_verifies(store: EventStore, clock: FakeClock) -> None:
    engine = settings()
    run(store, clock, engine, sessions=2, summarize=Failing())  # the breaker opens at 2
    clock.advance(61)  # past reset_timeout_ms: the next call is the half-open trial
    run(store, clock, engine, sessions=1)
    trials = [r for r in reservations(store) if r.event.trial]  # type: ignore[attr-defined]
    assert len(trials) == 1
    report = verify(store.read_all(), VERIFIERS, defaults=defaults(engine))
    assert report.findings == ()


def test_an_admission_past_the_cap_in_force_is_a_finding(
    store: EventStore, clock: FakeClock
) -> None:
    """The same log judged under a smaller cap: the first admission whose estimate no
    longer fits is reported, with the numbers the governor compared."""
    run(store, clock, settings(), sessions=4)
    first = reservations(store)[0].event
    assert isinstance(first, ContextSummarizerReserved)
    report = verify(store.read_all(), VERIFIERS, defaults=defaults(settings(hour=first.tokens - 1)))
    found = [f for f in report.findings if f.tag == "context:summarizer_reserved"]
    assert found, report
    assert found[0].kind == "mismatch"
    assert "tokens in the hour" in found[0].message


def test_a_worker_that_admitted_without_reading_the_ledger_is_caught(
    store: EventStore, clock: FakeClock
) -> None:
    """What two workers with governors in memory did before the ledger: each admitted a
    call the other's running call left no room for. Recorded in one ledger, the second
    admission does not verify."""
    engine = settings(hour=30_000)
    stream = ledger_stream("acme")
    store.append(stream, [NewEvent(event=ContextLedgerOpened(tenant="acme"), ts=clock.now())])
    for worker in ("a", "b"):  # both while the other's call is still running
        call = ContextSummarizerReserved(
            call_id=f"call-{worker}",
            tenant="acme",
            session=f"s-{worker}",
            tokens=20_000,
            lease_ms=300_000,
        )
        store.append(stream, [NewEvent(event=call, ts=clock.now())])
        clock.advance(1)
    report = verify(store.read_all(), VERIFIERS, defaults=defaults(engine))
    assert [f.version for f in report.findings] == [3]
    state = fold(SUMMARIZER_LEDGER, stream, store.read_stream(stream))
    assert sum(call.tokens for call in state.calls) == 40_000  # what the log shows was let run


def test_replay_folds_a_ledger_with_its_governor(store: EventStore, clock: FakeClock) -> None:
    run(store, clock, settings(), sessions=2)
    stream = ledger_stream("acme")
    assert aggregate_for(stream) is SUMMARIZER_LEDGER
    state = fold(SUMMARIZER_LEDGER, stream, store.read_stream(stream))
    assert state.tenant == "acme"
    assert state.calls == ()  # every call was released
    assert sum(tokens for _, tokens in state.spend) == 2 * 960
    assert msgspec.json.decode(msgspec.json.encode(state), type=type(state)) == state
