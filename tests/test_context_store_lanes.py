"""The ContextStore runs sessions side by side: a session waiting on its summarizer holds
up neither the other sessions nor the mailbox; one session's messages keep their order;
calls still running count against their tenant's spend cap and a half-open breaker lets
one trial run (real LMDB store; the summarizer is a deterministic stand-in that a test
holds at a gate, as a slow model would)."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any

import pykka
import pytest

from stalwart.actors import (
    Assemble,
    Assembled,
    Calibrate,
    ContextStoreActor,
    SearchContext,
    ask_context,
)
from stalwart.clock import FakeClock, SystemClock
from stalwart.config import (
    ContextEngineSettings,
    SummarizerBreakerSettings,
    SummarizerSpendSettings,
)
from stalwart.context import (
    ContextMessage,
    DagEngine,
    ExtractiveSummarizer,
    ModelProfile,
    SummaryRequest,
    estimate_message_tokens,
)
from stalwart.errors import ConcurrencyError
from stalwart.events import ContextAssembled, ContextDagDegraded, ContextSummaryCreated
from stalwart.store import EventStore
from stalwart.testing import conversation
from tests._raced import RacedOnce

ASK = 20.0
WAIT = 10.0


def history(session: str, turns: int) -> tuple[ContextMessage, ...]:
    """The same conversation for every session; only the ids name the session."""
    return conversation(session, turns, planted="Remember code ZEBRA002.")


def assemble(session: str, turns: int = 30, tenant: str | None = None) -> Assemble:
    return Assemble(
        session_id=session, messages=history(session, turns), budget=2_500, tenant=tenant
    )


class Gated:
    """The extractive stand-in, held at a gate for the sessions a test names (a slow
    model), or failing for others (a model that is down)."""

    def __init__(self) -> None:
        self.inner = ExtractiveSummarizer()
        self.gates: dict[str, threading.Event] = {}
        self.entered: dict[str, threading.Event] = {}
        self.failing: set[str] = set()

    def hold(self, session: str) -> None:
        self.gates[session] = threading.Event()
        self.entered[session] = threading.Event()

    def release(self, session: str) -> None:
        self.gates[session].set()

    def wait_entered(self, session: str) -> None:
        assert self.entered[session].wait(WAIT), f"{session}'s summarizer call never started"

    def __call__(self, request: SummaryRequest) -> tuple[str, int, int]:
        session = request.messages[0].message_id.split("-")[0]
        if session in self.failing:
            raise ConnectionError("the model is down")
        gate = self.gates.get(session)
        if gate is not None:
            self.entered[session].set()
            assert gate.wait(WAIT), "the test never released the summarizer"
        return self.inner(request)


@pytest.fixture
def summarizer() -> Iterator[Gated]:
    gated = Gated()
    yield gated
    for gate in gated.gates.values():
        gate.set()  # never leave a lane thread parked after a failed test


@pytest.fixture
def start(store: EventStore, clock: FakeClock, summarizer: Gated) -> Iterator[Any]:
    refs: list[pykka.ActorRef[Any]] = []

    def started(**settings: Any) -> pykka.ActorRef[Any]:
        max_sessions = settings.pop("max_sessions", 256)
        ref = ContextStoreActor.start(
            store=settings.pop("store", store),
            clock=clock,
            summarizer=summarizer,
            settings=ContextEngineSettings(fresh_tail_turns=2, **settings),
            max_sessions=max_sessions,
        )
        refs.append(ref)
        return ref

    yield started
    for ref in refs:
        if ref.is_alive():
            ref.stop()


def pending(future: Any) -> bool:
    try:
        future.get(timeout=0)
    except pykka.Timeout:
        return True
    return False


def context_events(store: EventStore, session: str) -> list[Any]:
    return [record.event for record in store.read_stream(f"context:{session}")]


def test_a_session_waiting_on_its_summarizer_holds_up_no_other(
    start: Any, store: EventStore, summarizer: Gated
) -> None:
    ref = start()
    summarizer.hold("a")
    slow = ref.ask(assemble("a"), timeout=ASK)
    summarizer.wait_entered("a")

    fast = ask_context(ref, assemble("b"), ASK)  # the same work, while a's model is slow

    assert isinstance(fast, Assembled)
    assert fast.summaries_made
    assert pending(slow)
    assert context_events(store, "a") == []  # nothing of a's is recorded before it is done
    summarizer.release("a")
    done = slow.get(timeout=ASK)
    assert isinstance(done, Assembled)
    assert done.summaries_made
    for session in ("a", "b"):
        events = context_events(store, session)
        assert isinstance(events[-1], ContextAssembled)
        assert any(isinstance(event, ContextSummaryCreated) for event in events)


def test_one_sessions_messages_wait_for_each_other_and_keep_their_order(
    start: Any, store: EventStore, summarizer: Gated
) -> None:
    ref = start()
    summarizer.hold("a")
    first = ref.ask(assemble("a", 30), timeout=ASK)
    summarizer.wait_entered("a")
    second = ref.ask(assemble("a", 31), timeout=ASK)
    search = ref.ask(SearchContext(session_id="a", tenant=None, query="ZEBRA002"), timeout=ASK)

    assert pending(first)
    assert pending(second)
    assert pending(search)
    summarizer.release("a")

    assert first.get(timeout=ASK).summaries_made
    assert isinstance(second.get(timeout=ASK), Assembled)
    hits = search.get(timeout=ASK)
    assert hits
    assert any("ZEBRA002" in str(hit) for hit in hits)
    records = list(store.read_stream("context:a"))
    assert [record.version for record in records] == list(range(1, len(records) + 1))
    assembled = [r.event for r in records if isinstance(r.event, ContextAssembled)]
    assert len(assembled) == 2


def first_call_spend(clock: FakeClock) -> int:
    """What the first leaf call of ``history(_, 30)`` is projected to spend: its chunk's
    estimate plus its output limit (the engine alone, with a recording summarizer)."""
    seen: list[SummaryRequest] = []

    def record(request: SummaryRequest) -> tuple[str, int, int]:
        seen.append(request)
        return "summary", 1, 1

    engine = DagEngine(ContextEngineSettings(fresh_tail_turns=2), summarizer=record, clock=clock)
    engine.assemble("p", history("p", 30), 2_500)
    request = seen[0]
    return sum(estimate_message_tokens(m) for m in request.messages) + request.max_tokens


def test_a_call_still_running_counts_against_its_tenants_spend_cap(
    start: Any, store: EventStore, clock: FakeClock, summarizer: Gated
) -> None:
    projected = first_call_spend(clock)
    cap = projected + projected // 2  # one call fits, two at once do not
    ref = start(summarizer_spend=SummarizerSpendSettings(max_tokens_per_tenant_per_hour=cap))
    summarizer.hold("a")
    slow = ref.ask(assemble("a", tenant="acme"), timeout=ASK)
    summarizer.wait_entered("a")

    refused = ask_context(ref, assemble("b", tenant="acme"), ASK)
    other_tenant = ask_context(ref, assemble("c", tenant="globex"), ASK)

    assert "spend_cap" in refused.degraded
    degrade = next(e for e in context_events(store, "b") if isinstance(e, ContextDagDegraded))
    assert (degrade.reason, degrade.used, degrade.limit) == ("spend_cap", projected, cap)
    assert "spend_cap" not in other_tenant.degraded  # another tenant's cap is its own
    summarizer.release("a")
    assert slow.get(timeout=ASK).summaries_made


def test_a_half_open_breaker_lets_one_trial_run_at_a_time(
    start: Any, store: EventStore, clock: FakeClock, summarizer: Gated
) -> None:
    ref = start(
        summarizer_breaker=SummarizerBreakerSettings(failure_threshold=1, reset_timeout_ms=1_000)
    )
    summarizer.failing.add("f")
    failed = ask_context(ref, assemble("f", tenant="acme"), ASK)
    assert "summarizer_failed" in failed.layers_fired
    clock.advance(2.0)  # the breaker half-opens: one trial may run
    summarizer.hold("a")
    trial = ref.ask(assemble("a", tenant="acme"), timeout=ASK)
    summarizer.wait_entered("a")

    refused = ask_context(ref, assemble("b", tenant="acme"), ASK)

    assert "breaker_open" in refused.degraded
    degrade = next(e for e in context_events(store, "b") if isinstance(e, ContextDagDegraded))
    assert degrade.reason == "breaker_open"
    assert degrade.until is None
    summarizer.release("a")
    assert trial.get(timeout=ASK).summaries_made  # the trial succeeded: the breaker closed
    again = ask_context(ref, assemble("b", 31, tenant="acme"), ASK)
    assert "breaker_open" not in again.degraded


def test_parallel_sessions_bounds_the_sessions_at_work(start: Any, summarizer: Gated) -> None:
    ref = start(parallel_sessions=1)
    summarizer.hold("a")
    slow = ref.ask(assemble("a"), timeout=ASK)
    summarizer.wait_entered("a")
    behind = ref.ask(assemble("b"), timeout=ASK)

    with pytest.raises(pykka.Timeout):
        behind.get(timeout=0.3)  # no lane is free while a's call runs
    summarizer.release("a")
    assert isinstance(slow.get(timeout=ASK), Assembled)
    assert isinstance(behind.get(timeout=ASK), Assembled)


def test_a_session_at_work_finishes_and_goes_on_while_others_crowd_memory(
    start: Any, store: EventStore, summarizer: Gated
) -> None:
    ref = start(max_sessions=1)
    summarizer.hold("a")
    slow = ref.ask(assemble("a"), timeout=ASK)
    summarizer.wait_entered("a")
    for session in ("b", "c"):  # each would push a, the least recently used, out
        ask_context(ref, assemble(session), ASK)

    summarizer.release("a")
    assert slow.get(timeout=ASK).summaries_made
    again = ask_context(ref, assemble("a", 31), ASK)  # the session went on where it was
    assert isinstance(again, Assembled)
    records = list(store.read_stream("context:a"))
    assert [record.version for record in records] == list(range(1, len(records) + 1))


def test_stopping_fails_what_waits_and_does_not_wait_for_a_summarizer(
    start: Any, summarizer: Gated
) -> None:
    ref = start()
    summarizer.hold("a")
    slow = ref.ask(assemble("a"), timeout=ASK)
    summarizer.wait_entered("a")
    queued = ref.ask(assemble("a", 31), timeout=ASK)

    ref.stop(timeout=WAIT)  # returns while a's summarizer call is still running

    with pytest.raises(pykka.ActorDeadError):
        queued.get(timeout=WAIT)
    summarizer.release("a")
    assert isinstance(slow.get(timeout=ASK), Assembled)  # what ran finishes and is recorded
    with pytest.raises(pykka.ActorDeadError):
        ask_context(ref, assemble("b"), ASK)


class SlowReads:
    """The real store, with the reads of one stream held until the test lets them go
    (a slow disk or a far database, while the reader holds the ContextStore's lock)."""

    def __init__(self, store: EventStore, stream: str) -> None:
        self._store = store
        self._stream = stream
        self.reading = threading.Event()
        self.go = threading.Event()

    def read_stream(self, stream: str, *args: Any, **kwargs: Any) -> Any:
        if stream == self._stream and not self.go.is_set():
            self.reading.set()
            assert self.go.wait(WAIT), "the test never let the read go"
        return self._store.read_stream(stream, *args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._store, name)


def test_a_trial_is_timed_while_it_runs_not_while_its_lane_waits_for_the_lock(
    store: EventStore, summarizer: Gated
) -> None:
    slow = SlowReads(store, "context:b")
    ref = ContextStoreActor.start(
        store=slow,
        clock=SystemClock(),  # the wait for the lock is real time
        summarizer=summarizer,
        settings=ContextEngineSettings(
            fresh_tail_turns=2,
            summarizer_breaker=SummarizerBreakerSettings(
                failure_threshold=1, reset_timeout_ms=1, half_open_timeout_ms=1_000
            ),
        ),
    )
    try:
        summarizer.failing.add("f")
        ask_context(ref, assemble("f"), ASK)  # the breaker opens, and half-opens at once
        threading.Event().wait(0.01)
        summarizer.hold("a")
        trial = ref.ask(assemble("a"), timeout=ASK)
        summarizer.wait_entered("a")
        reading = ref.ask(assemble("b"), timeout=ASK)  # b's lane takes the lock to read
        assert slow.reading.wait(WAIT)
        summarizer.release("a")  # the trial answers at once, then waits for the lock
        threading.Event().wait(1.5)  # longer than the trial may take
        slow.go.set()

        done = trial.get(timeout=ASK)
        assert "summarizer_failed" not in done.layers_fired
        assert done.summaries_made
        assert isinstance(reading.get(timeout=ASK), Assembled)
    finally:
        slow.go.set()
        ref.stop()


def test_a_calibration_does_not_hold_up_the_mailbox(store: EventStore, clock: FakeClock) -> None:
    slow = SlowReads(store, "context:b")
    ref = ContextStoreActor.start(
        store=slow,
        clock=clock,
        summarizer=ExtractiveSummarizer(),
        settings=ContextEngineSettings(fresh_tail_turns=2),
    )
    try:
        held = ref.ask(assemble("b"), timeout=ASK)  # b's lane holds the lock, reading
        assert slow.reading.wait(WAIT)
        ref.tell(Calibrate(profile=ModelProfile(), estimated=1_000, reported=1_200))

        handed = ref.ask(assemble("c"), timeout=5.0)  # the mailbox hands c to its lane

        assert isinstance(handed, pykka.Future)
        slow.go.set()
        assert isinstance(handed.get(timeout=ASK), Assembled)
        assert isinstance(held.get(timeout=ASK), Assembled)
    finally:
        slow.go.set()
        ref.stop()


def test_a_pipeline_session_whose_write_conflicted_is_rebuilt_from_the_log(
    start: Any, store: EventStore
) -> None:
    raced = RacedOnce(
        store, "context:p", ContextDagDegraded(reason="tail_over_budget", session="p")
    )
    ref = start(version="pipeline", store=raced)
    ask_context(ref, assemble("p", 3), ASK)
    raced.armed = True  # another writer wins the race for the actor's next append
    with pytest.raises(ConcurrencyError):
        ask_context(ref, assemble("p", 4), ASK)

    again = ask_context(ref, assemble("p", 4), ASK)

    assert again.engine == "pipeline"
    records = list(store.read_stream("context:p"))
    assert isinstance(records[-1].event, ContextAssembled)
