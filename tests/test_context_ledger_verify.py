"""Replay verification of the summarizer's admissions (``context:summarizer_reserved``)
and refusals (``context:summarizer_refused``): each is re-derived from its tenant's
ledger as it stood before it, at its time, with the config in force."""

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
from stalwart.events import (
    ContextDagDegraded,
    ContextLedgerOpened,
    ContextSummarizerRefused,
    ContextSummarizerReserved,
    RecordedEvent,
)
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


def refusals(store: EventStore) -> list[RecordedEvent]:
    return [
        record
        for record in store.read_stream(ledger_stream("acme"))
        if isinstance(record.event, ContextSummarizerRefused)
    ]


def test_every_refusal_a_runtime_recorded_verifies(store: EventStore, clock: FakeClock) -> None:
    """A cap no summary fits: every call of three sessions' assemblies is refused. The
    ledger records the refusal once (nothing changed between them), each session its
    degradation, and the refusal re-derives."""
    engine = settings(hour=1_000)
    run(store, clock, engine, sessions=3)
    (refused,) = refusals(store)
    event = refused.event
    assert isinstance(event, ContextSummarizerRefused)
    assert (event.reason, event.used, event.limit) == ("spend_cap", 0, 1_000)
    assert event.tokens > 1_000
    degraded = [
        r
        for n in range(3)
        for r in store.read_stream(f"context:s{n}")
        if isinstance(r.event, ContextDagDegraded)
    ]
    assert len(degraded) == 3
    report = verify(store.read_all(), VERIFIERS, defaults=defaults(engine))
    assert report.findings == ()
    assert report.checked["context:summarizer_refused"] == 1


def test_a_refusal_the_policy_in_force_would_not_make_is_a_finding(
    store: EventStore, clock: FakeClock
) -> None:
    """The same log judged under a cap the estimate fits: the refusal does not follow."""
    run(store, clock, settings(hour=1_000), sessions=1)
    (refused,) = refusals(store)
    report = verify(store.read_all(), VERIFIERS, defaults=defaults(settings()))
    found = [f for f in report.findings if f.tag == "context:summarizer_refused"]
    assert [(f.kind, f.version) for f in found] == [("mismatch", refused.version)]
    assert "tokens in the hour" in found[0].message


def test_a_refusal_with_other_numbers_than_the_ledger_held_is_a_finding(
    store: EventStore, clock: FakeClock
) -> None:
    """A refusal that says the tenant had spent more than its ledger shows."""
    engine = settings(hour=30_000)
    stream = ledger_stream("acme")
    store.append(stream, [NewEvent(event=ContextLedgerOpened(tenant="acme"), ts=clock.now())])
    forged = ContextSummarizerRefused(
        tenant="acme",
        session="s",
        tokens=40_000,
        reason="spend_cap",
        knob="context_engine.summarizer_spend.max_tokens_per_tenant_per_hour",
        used=29_000,
        limit=30_000,
    )
    store.append(stream, [NewEvent(event=forged, ts=clock.now())])
    report = verify(store.read_all(), VERIFIERS, defaults=defaults(engine))
    assert [(f.kind, f.version) for f in report.findings] == [("mismatch", 2)]
    honest = msgspec.structs.replace(forged, used=0)
    store.append(stream, [NewEvent(event=honest, ts=clock.now())])
    report = verify(store.read_all(), VERIFIERS, defaults=defaults(engine))
    assert [(f.kind, f.version) for f in report.findings] == [("mismatch", 2)]
