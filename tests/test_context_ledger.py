"""The summarizer's tenant ledger: every summarizer call is admitted in its tenant's
stream (``context-ledger:<tenant>``) before it runs and released there when it ends, so
the spend caps and the breaker hold across every worker on one store, a restart, a
worker killed mid-call, and a log older than the ledger.

The numbers: ``history(8, 250)`` assembled within ``BUDGET`` needs one leaf summary,
whose projected spend (its messages plus the summary's limit, about 5,700 tokens) fits
the hourly ``CAP`` of 6,000 once but not twice. Time is the fake clock's; threads are
waited for with events bounded by ``WAIT``; the SIGKILL test runs a real child process
(``tests/_ledger_child.py``).
"""

from __future__ import annotations

import hashlib
import queue
import subprocess
import sys
import threading
import time
from collections.abc import Iterator, MutableMapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import msgspec
import pytest

from stalwart import store as store_module
from stalwart.actors import (
    LEDGER_STREAM,
    Assemble,
    Assembled,
    ContextStoreActor,
    StoreLedger,
    ask_context,
    ledger_stream,
)
from stalwart.clock import FakeClock
from stalwart.config import ContextEngineSettings
from stalwart.context import (
    ContextMessage,
    DagEngine,
    ExtractiveSummarizer,
    MemoryLedger,
    SummaryRequest,
    ended,
)
from stalwart.errors import ConcurrencyError, StoreError
from stalwart.events import (
    ContextBound,
    ContextDagDegraded,
    ContextLedgerOpened,
    ContextSummarizerFailed,
    ContextSummarizerRefused,
    ContextSummarizerReleased,
    ContextSummarizerReserved,
    ContextSummaryCreated,
    Event,
    RecordedEvent,
)
from stalwart.state import (
    DAY_S,
    HOUR_S,
    GovernorState,
    ReservedCall,
    SummarizerVerdict,
    apply_governor_event,
    decide_summarizer,
    in_flight,
    window_spend,
)
from stalwart.store import EventStore, NewEvent, PostgresEventStore
from tests._ledger_child import BUDGET, CAP, LEASE_MS, TENANT, history, ledger_settings
from tests._runtime_support import reap, sigkill

CHILD = Path(__file__).with_name("_ledger_child.py")
ROOT = Path(__file__).resolve().parent.parent
ASK = 10.0  # seconds an assembly may take before the test fails rather than hangs
WAIT = 10.0  # seconds a thread or a child may take to reach the point the test waits for
PER_HOUR = "context_engine.summarizer_spend.max_tokens_per_tenant_per_hour"
KNOBS = {"per_hour": 1_000, "per_day": 0, "failure_threshold": 3, "reset_timeout_ms": 60_000}
T0 = 1_800_000_000.0


# -- helpers ------------------------------------------------------------------------------


class Gate:
    """A summarizer that answers like the stand-in but reports ``spent`` (input, output)
    tokens; with ``block``, its first call waits for ``go`` (``entered`` says it is in)."""

    def __init__(self, spent: tuple[int, int] = (10, 5), *, block: bool = False) -> None:
        self.spent = spent
        self.block = block
        self.calls = 0
        self.entered = threading.Event()
        self.go = threading.Event()
        self._standin = ExtractiveSummarizer()

    def __call__(self, request: SummaryRequest) -> tuple[str, int, int]:
        self.calls += 1
        if self.block and self.calls == 1:
            self.entered.set()
            if not self.go.wait(WAIT):
                raise TimeoutError("the test never let the summarizer go")
        text, _, _ = self._standin(request)
        return text, self.spent[0], self.spent[1]


class Down:
    """A summarizer whose model is down: every call raises (counted)."""

    def __init__(self) -> None:
        self.calls = 0

    def __call__(self, request: SummaryRequest) -> tuple[str, int, int]:
        self.calls += 1
        raise ConnectionError("the summarizer model is down")


@contextmanager
def worker(
    store: EventStore, clock: FakeClock, summarizer: Any, settings: ContextEngineSettings
) -> Iterator[Any]:
    """A ContextStore actor on ``store``: one worker of the deployment."""
    ref = ContextStoreActor.start(
        store=store, clock=clock, summarizer=summarizer, settings=settings
    )
    try:
        yield ref
    finally:
        ref.stop()


def assemble(ref: Any, session: str, messages: Sequence[ContextMessage] | None = None) -> Assembled:
    messages = tuple(messages) if messages is not None else history(8, 250)
    message = Assemble(session_id=session, messages=messages, budget=BUDGET, tenant=TENANT)
    return ask_context(ref, message, ASK)  # type: ignore[no-any-return]


def degraded(store: EventStore, session: str) -> list[ContextDagDegraded]:
    return [
        r.event
        for r in store.read_stream(f"context:{session}")
        if isinstance(r.event, ContextDagDegraded)
    ]


def summarized(store: EventStore, *sessions: str) -> list[ContextSummaryCreated]:
    """The summaries the summarizer made (not emergency truncations) in ``sessions``."""
    return [
        r.event
        for session in sessions
        for r in store.read_stream(f"context:{session}")
        if isinstance(r.event, ContextSummaryCreated) and r.event.fallback is None
    ]


def ledger(store: EventStore, tenant: str | None = TENANT) -> list[RecordedEvent]:
    return list(store.read_stream(ledger_stream(tenant)))


def kinds(records: Sequence[RecordedEvent]) -> list[str]:
    return [type(r.event).__name__ for r in records]


def ledger_never_over(store: EventStore, cap: int, tenant: str | None = TENANT) -> None:
    """Fold the ledger as it was written: no reservation was admitted whose tokens, with
    what the hour had spent and the calls still live at its time, passed ``cap``, and
    the hour's recorded spend never passed it either."""
    state = GovernorState(tenant=tenant)
    for record in ledger(store, tenant):
        event = record.event
        if isinstance(event, ContextSummarizerReserved):
            held = window_spend(state, record.ts, HOUR_S) + in_flight(state, record.ts)
            assert held + event.tokens <= cap, f"v{record.version} admitted over the cap"
        state = apply_governor_event(state, event, record.ts)
        assert window_spend(state, record.ts, HOUR_S) <= cap


def contiguous(records: Sequence[RecordedEvent]) -> bool:
    return [r.version for r in records] == list(range(1, len(records) + 1))


def reserve(
    call_id: str, tokens: int, *, trial: bool = False, lease_ms: int = 60_000
) -> ContextSummarizerReserved:
    return ContextSummarizerReserved(
        call_id=call_id, tenant="t", session="s", tokens=tokens, trial=trial, lease_ms=lease_ms
    )


def release(
    call_id: str, spent: int = 0, error_class: str | None = None
) -> ContextSummarizerReleased:
    return ContextSummarizerReleased(
        call_id=call_id, tenant="t", input_tokens=spent, output_tokens=0, error_class=error_class
    )


def fold(*steps: tuple[Event, float]) -> GovernorState:
    state = GovernorState(tenant="t")
    for event, ts in steps:
        state = apply_governor_event(state, event, ts)
    return state


# -- the fold and the pure decision ---------------------------------------------------------


def test_a_reservation_counts_in_flight_until_it_is_released() -> None:
    held = fold((reserve("c1", 700), T0))
    assert held.calls == (ReservedCall(call_id="c1", tokens=700, expires=T0 + 60),)
    assert in_flight(held, T0 + 1) == 700
    assert window_spend(held, T0 + 1, HOUR_S) == 0  # held, not spent
    refused = decide_summarizer(held, T0 + 1, projected=400, **KNOBS)
    assert (refused.reason, refused.knob, refused.used) == ("spend_cap", PER_HOUR, 700)
    assert decide_summarizer(held, T0 + 1, projected=300, **KNOBS).allowed
    done = apply_governor_event(held, release("c1", spent=120), T0 + 2)
    assert done.calls == ()
    assert in_flight(done, T0 + 2) == 0
    assert window_spend(done, T0 + 2, HOUR_S) == 120  # what it spent, not what it held
    assert decide_summarizer(done, T0 + 2, projected=880, **KNOBS).allowed
    assert decide_summarizer(done, T0 + 2, projected=881, **KNOBS).reason == "spend_cap"


def test_a_reservation_never_released_counts_no_more_after_its_lease() -> None:
    held = fold((reserve("dead", 900, lease_ms=60_000), T0))
    assert in_flight(held, T0 + 59.999) == 900
    assert decide_summarizer(held, T0 + 59.999, projected=200, **KNOBS).reason == "spend_cap"
    assert in_flight(held, T0 + 60) == 0  # the lease ends at ts + lease_ms / 1000
    assert decide_summarizer(held, T0 + 60, projected=1_000, **KNOBS).allowed
    # the next reservation's fold drops the dead one from the state
    later = apply_governor_event(held, reserve("c2", 10), T0 + 61)
    assert [call.call_id for call in later.calls] == ["c2"]


def test_a_release_of_an_unknown_or_expired_call_still_counts_its_spend_and_outcome() -> None:
    unknown = fold((release("ghost", spent=250, error_class="TimeoutError"), T0))
    assert window_spend(unknown, T0, HOUR_S) == 250
    assert (unknown.consecutive_failures, unknown.last_failure_at) == (1, T0)
    expired = fold(
        (reserve("late", 900, lease_ms=1_000), T0),
        (release("late", spent=400, error_class="ReadTimeout"), T0 + 5),  # after its lease
    )
    assert expired.calls == ()
    assert window_spend(expired, T0 + 5, HOUR_S) == 400
    assert (expired.consecutive_failures, expired.last_failure_at) == (1, T0 + 5)
    answered = apply_governor_event(expired, release("other", spent=1), T0 + 6)
    assert answered.consecutive_failures == 0  # a success closes the breaker


def test_a_release_written_twice_counts_once() -> None:
    """A release whose append failed ambiguously (written, then reported lost) is
    appended again: the fold counts its spend and its outcome once."""
    once = fold((reserve("c1", 900), T0), (release("c1", spent=400, error_class="E"), T0 + 1))
    twice = apply_governor_event(once, release("c1", spent=400, error_class="E"), T0 + 2)
    assert window_spend(twice, T0 + 2, HOUR_S) == 400
    assert (twice.consecutive_failures, twice.last_failure_at) == (1, T0 + 1)
    # a day later the call's spend has left every window, and its id is forgotten
    later = apply_governor_event(twice, release("c2", spent=5), T0 + DAY_S + 2)
    assert later.released == ((T0 + DAY_S + 2, "c2"),)
    assert window_spend(later, T0 + DAY_S + 2, DAY_S) == 5


def test_a_live_trial_reservation_bars_every_other_call() -> None:
    failing = [(release(f"f{n}", error_class="TimeoutError"), T0) for n in range(3)]
    opened = fold(*failing)
    early = decide_summarizer(opened, T0 + 59, projected=1, **KNOBS)
    assert (early.reason, early.until) == ("breaker_open", T0 + 60)
    trial = decide_summarizer(opened, T0 + 61, projected=1, **KNOBS)
    assert trial.allowed
    assert trial.trial
    running = apply_governor_event(opened, reserve("trial", 1, trial=True), T0 + 61)
    other = decide_summarizer(running, T0 + 62, projected=1, **KNOBS)
    assert not other.allowed
    assert other.reason == "breaker_open"
    assert other.until is None  # past the reset timeout: barred by the trial, not the clock
    # the trial's worker died: after its lease another trial may run
    assert decide_summarizer(running, T0 + 61 + 60, projected=1, **KNOBS).trial
    closed = apply_governor_event(running, release("trial", spent=1), T0 + 63)
    after = decide_summarizer(closed, T0 + 63, projected=1, **KNOBS)
    assert after.allowed
    assert not after.trial


def test_a_trial_reservation_of_another_tenant_does_not_count() -> None:
    opened = fold(*[(release(f"f{n}", error_class="X"), T0) for n in range(3)])
    theirs = msgspec.structs.replace(reserve("trial", 999, trial=True), tenant="other")
    state = apply_governor_event(opened, theirs, T0 + 61)
    assert state == opened
    assert decide_summarizer(state, T0 + 62, projected=1, **KNOBS).trial


def test_the_ledger_opened_event_seeds_spend_and_failures() -> None:
    opened = ContextLedgerOpened(
        tenant="t", spend=((T0 - 100, 600),), consecutive_failures=3, last_failure_at=T0 - 10
    )
    state = fold((opened, T0))
    assert window_spend(state, T0, HOUR_S) == 600
    refused = decide_summarizer(state, T0, projected=1, **KNOBS)
    assert (refused.reason, refused.used, refused.until) == ("breaker_open", 3, T0 + 50)
    closed = decide_summarizer(state, T0 + 50, projected=400, **KNOBS)
    assert closed.trial  # the seeded breaker reopens after its timeout
    assert decide_summarizer(state, T0 + 50, projected=401, **KNOBS).reason == "spend_cap"


def test_a_memory_ledger_holds_a_running_call_against_the_next() -> None:
    clock = FakeClock(start=T0)
    memory = MemoryLedger(clock, lease_ms=60_000)

    def decide(state: GovernorState, now: float) -> SummarizerVerdict:
        return decide_summarizer(state, now, projected=600, **KNOBS)

    verdict, held = memory.admit("t", "s1", 600, decide)
    assert verdict.allowed
    assert held is not None
    refused, none = memory.admit("t", "s2", 600, decide)
    assert (refused.reason, refused.used, none) == ("spend_cap", 600, None)
    memory.release(ended(held, input_tokens=50, output_tokens=50, error_class=None, duration_ms=3))
    assert memory.admit("t", "s2", 600, decide)[1] is not None
    assert window_spend(memory.governor("t"), clock.now(), HOUR_S) == 100
    alone = DagEngine(ContextEngineSettings(), summarizer=Gate(), clock=clock)
    assert isinstance(alone.ledger, MemoryLedger)  # a bare engine's default


# -- the ledger's stream --------------------------------------------------------------------


def test_the_ledger_stream_of_a_tenant(store: EventStore) -> None:
    assert ledger_stream("acme") == "context-ledger:acme"
    assert ledger_stream(None) == LEDGER_STREAM == "context-ledger"
    assert ledger_stream("") != ledger_stream(None)
    long = "x" * 1_000
    hashed = ledger_stream(long)
    assert hashed == "context-ledger#sha256:" + hashlib.sha256(long.encode()).hexdigest()
    assert ledger_stream("x" * 1_001) != hashed
    assert ledger_stream("nul\x00name").startswith("context-ledger#sha256:")
    ok = ContextSummarizerReleased(call_id="c", tenant=long)
    assert store.append(hashed, [ok])[0].stream == hashed
    assert store.append(ledger_stream("nul\x00name"), [ok])[0].version == 1


def test_a_tenant_whose_name_cannot_be_a_stream_is_governed_in_its_hashed_ledger(
    store: EventStore, clock: FakeClock
) -> None:
    tenant = "t" * 1_000
    ledger_ = StoreLedger(store, clock, lease_ms=60_000)

    def decide(state: GovernorState, now: float) -> SummarizerVerdict:
        return decide_summarizer(state, now, projected=600, **KNOBS)

    assert ledger_.admit(tenant, "s1", 600, decide)[1] is not None
    assert ledger_.admit(tenant, "s2", 600, decide)[0].reason == "spend_cap"
    recorded = ledger(store, tenant)
    assert kinds(recorded) == [
        "ContextLedgerOpened",
        "ContextSummarizerReserved",
        "ContextSummarizerRefused",
    ]
    assert recorded[0].stream.startswith("context-ledger#sha256:")


# -- two workers, one store: the core promise ---------------------------------------------


def share_one_cap(
    store_a: EventStore, store_b: EventStore, clock: FakeClock, spent: tuple[int, int]
) -> None:
    """Worker A's summarizer call blocks; worker B (same tenant, another session) must
    find the tenant's cap held by it. Then A answers having spent ``spent``, and B asks
    for a third session: admitted only if A's actual spend leaves room."""
    settings = ledger_settings()
    a_summarizer, b_summarizer = Gate(spent, block=True), Gate(spent)
    with (
        worker(store_a, clock, a_summarizer, settings) as a,
        worker(store_b, clock, b_summarizer, settings) as b,
    ):
        answered: dict[str, Assembled] = {}
        thread = threading.Thread(
            target=lambda: answered.update(a=assemble(a, "a")), name="worker-a", daemon=True
        )
        thread.start()
        try:
            assert a_summarizer.entered.wait(WAIT), "worker A never called its summarizer"
            while_a_runs = assemble(b, "b")
        finally:
            a_summarizer.go.set()
            thread.join(WAIT)
        assert "a" in answered, "worker A's assembly did not finish"
        assert b_summarizer.calls == 0, "B called its summarizer while A's call held the cap"
        assert while_a_runs.degraded == ("spend_cap",)
        assert "emergency_truncation" in while_a_runs.layers_fired
        (refusal,) = degraded(store_a, "b")
        assert (refusal.reason, refusal.knob, refusal.limit) == ("spend_cap", PER_HOUR, CAP)
        assert CAP // 2 < refusal.used <= CAP  # A's projected spend, held while it ran
        assert answered["a"].summaries_made
        assert not answered["a"].degraded

        after_a = assemble(b, "c")
    a_spent = sum(spent)
    if a_spent + refusal.used <= CAP:  # A spent little: its reservation gave the room back
        assert b_summarizer.calls == 1
        assert after_a.summaries_made
        assert not degraded(store_b, "c")
    else:  # A spent most of the cap: it stays taken, by what A recorded
        assert b_summarizer.calls == 0
        (held,) = degraded(store_b, "c")
        assert (held.reason, held.used) == ("spend_cap", a_spent)
    spend = [s.input_tokens + s.output_tokens for s in summarized(store_b, "a", "b", "c")]
    assert 0 < sum(spend) <= CAP
    ledger_never_over(store_b, CAP)


SPENDS = pytest.mark.parametrize(
    "spent", [(10, 5), (4_000, 1_000)], ids=["A-spends-little", "A-spends-most"]
)


@SPENDS
def test_two_workers_on_one_store_object_share_the_tenants_cap(
    store: EventStore, clock: FakeClock, spent: tuple[int, int]
) -> None:
    share_one_cap(store, store, clock, spent)


@SPENDS
def test_two_workers_on_two_handles_of_one_lmdb_store_share_the_tenants_cap(
    lmdb_store: EventStore, store_dir: Path, clock: FakeClock, spent: tuple[int, int]
) -> None:
    other = store_module.open(store_dir, clock=clock)
    try:
        share_one_cap(lmdb_store, other, clock, spent)
    finally:
        other.close()


@SPENDS
def test_two_workers_on_postgresql_share_the_tenants_cap(
    pg_url: str, clock: FakeClock, spent: tuple[int, int]
) -> None:
    with (
        PostgresEventStore(pg_url, clock=clock) as one,
        PostgresEventStore(pg_url, clock=clock) as two,
    ):
        share_one_cap(one, two, clock, spent)


class FailsThenGate(Gate):
    """Raises in its first ``failures`` calls; then answers like :class:`Gate` (the
    first call after the failures waits for ``go``)."""

    def __init__(self, failures: int) -> None:
        super().__init__(block=False)
        self.failures = failures

    def __call__(self, request: SummaryRequest) -> tuple[str, int, int]:
        if self.calls < self.failures:
            self.calls += 1
            raise ConnectionError("the summarizer model is down")
        if self.calls == self.failures:
            self.calls += 1
            self.entered.set()
            if not self.go.wait(WAIT):
                raise TimeoutError("the test never let the summarizer go")
            text, _, _ = self._standin(request)
            return text, self.spent[0], self.spent[1]
        return super().__call__(request)


def test_the_half_open_trial_of_one_worker_bars_the_other_workers(
    store: EventStore, clock: FakeClock
) -> None:
    """Worker A's failures open the tenant's breaker; after the reset timeout A runs the
    one trial, which blocks; worker B, asked meanwhile, must not run a second trial."""
    settings = ledger_settings(cap=0, failure_threshold=2)
    a_summarizer, b_summarizer = FailsThenGate(2), Gate()
    with (
        worker(store, clock, a_summarizer, settings) as a,
        worker(store, clock, b_summarizer, settings) as b,
    ):
        assemble(a, "a1")
        assemble(a, "a2")
        clock.advance(60)  # the reset timeout: half-open
        answered: dict[str, Assembled] = {}
        thread = threading.Thread(
            target=lambda: answered.update(a=assemble(a, "a3")), name="trial", daemon=True
        )
        thread.start()
        try:
            assert a_summarizer.entered.wait(WAIT), "worker A never ran its trial"
            during = assemble(b, "b1")
        finally:
            a_summarizer.go.set()
            thread.join(WAIT)
        assert b_summarizer.calls == 0, "worker B ran a second trial"
        assert during.degraded == ("breaker_open",)
        (refusal,) = degraded(store, "b1")
        assert (refusal.reason, refusal.used, refusal.limit) == ("breaker_open", 2, 2)
        assert answered["a"].summaries_made  # the trial answered: the breaker closed
        assemble(b, "b2")
        assert b_summarizer.calls == 1
    assert a_summarizer.calls == 3


def test_two_sessions_of_one_worker_share_the_tenants_cap(
    store: EventStore, clock: FakeClock
) -> None:
    """One ContextStore, two sessions of one tenant side by side (the admission runs
    outside the store's lock): the second is refused while the first's call runs."""
    summarizer = Gate((10, 5), block=True)
    with worker(store, clock, summarizer, ledger_settings()) as ref:
        answered: dict[str, Assembled] = {}
        thread = threading.Thread(
            target=lambda: answered.update(a=assemble(ref, "a")), name="lane-a", daemon=True
        )
        thread.start()
        try:
            assert summarizer.entered.wait(WAIT), "session a never called the summarizer"
            during = assemble(ref, "b")
        finally:
            summarizer.go.set()
            thread.join(WAIT)
        assert summarizer.calls == 1
        assert during.degraded == ("spend_cap",)
        assert answered["a"].summaries_made
        assemble(ref, "c")
        assert summarizer.calls == 2
    ledger_never_over(store, CAP)


# -- a restart, and a log older than the ledger --------------------------------------------


def test_spend_survives_a_restart(store: EventStore, clock: FakeClock) -> None:
    settings = ledger_settings()
    with worker(store, clock, Gate((4_000, 1_000)), settings) as first:
        assert assemble(first, "r1").summaries_made
    again = Gate()
    with worker(store, clock, again, settings) as second:
        assemble(second, "r2")
        assert again.calls == 0
        (refusal,) = degraded(store, "r2")
        assert (refusal.reason, refusal.used) == ("spend_cap", 5_000)
        clock.advance(3_600)  # the hour of r1's spend has passed
        assemble(second, "r3")
        assert again.calls == 1
    assert not degraded(store, "r3")


def test_an_open_breaker_survives_a_restart(store: EventStore, clock: FakeClock) -> None:
    settings = ledger_settings(cap=0, failure_threshold=2)
    down = Down()
    with worker(store, clock, down, settings) as first:
        assemble(first, "r1")
        assemble(first, "r2")
    assert down.calls == 2
    again = Gate()
    with worker(store, clock, again, settings) as second:
        assemble(second, "r3")
        assert again.calls == 0
        (refusal,) = degraded(store, "r3")
        assert (refusal.reason, refusal.used, refusal.limit) == ("breaker_open", 2, 2)
        clock.advance(60)  # the breaker's reset timeout: one trial
        assemble(second, "r4")
        assert again.calls == 1
    assert summarized(store, "r4")


def legacy_failures(store: EventStore, tenant: str, count: int) -> None:
    store.append(
        "context:old",
        [
            ContextBound(session="old", tenant=tenant),
            *[
                ContextSummarizerFailed(tenant=tenant, error_class="TimeoutError")
                for _ in range(count)
            ],
        ],
    )


def test_a_log_older_than_the_ledger_keeps_its_open_breaker(
    store: EventStore, clock: FakeClock
) -> None:
    legacy_failures(store, TENANT, 5)
    legacy_failures(store, "other", 5)  # another tenant's breaker is not ours
    failed_at = clock.now()
    clock.advance(1)
    summarizer = Gate()
    with worker(store, clock, summarizer, ledger_settings(cap=0)) as ref:
        assemble(ref, "new")
        assert summarizer.calls == 0
        (refusal,) = degraded(store, "new")
        assert (refusal.reason, refusal.used, refusal.limit) == ("breaker_open", 5, 5)
        assert refusal.until == failed_at + 60
        (opened, refused) = ledger(store)  # the ledger records the refusal too
        assert isinstance(refused.event, ContextSummarizerRefused)
        assert (refused.event.reason, refused.event.used, refused.event.until) == (
            "breaker_open",
            5,
            failed_at + 60,
        )
        clock.advance(60)
        assemble(ref, "trial")
        assert summarizer.calls == 1
    recorded = ledger(store)
    assert kinds(recorded) == [
        "ContextLedgerOpened",
        "ContextSummarizerRefused",
        "ContextSummarizerReserved",
        "ContextSummarizerReleased",
    ]
    opened = recorded[0].event
    assert (opened.tenant, opened.consecutive_failures, opened.last_failure_at) == (
        TENANT,
        5,
        failed_at,
    )
    assert recorded[2].event.trial  # the half-open breaker's one trial
    assert contiguous(recorded)


def test_a_log_older_than_the_ledger_keeps_its_spend(store: EventStore, clock: FakeClock) -> None:
    spent_at = clock.now()
    made = ContextSummaryCreated(
        summary_id="old-summary",
        depth=0,
        covers=("m1",),
        descendant_count=1,
        body="a summary made before the ledger",
        input_tokens=4_000,
        output_tokens=1_000,
        tenant=TENANT,
    )
    a_day_before = msgspec.structs.replace(made, summary_id="older", input_tokens=90_000)
    theirs = msgspec.structs.replace(made, summary_id="theirs", tenant="other")
    store.append(
        "context:old",
        [
            ContextBound(session="old", tenant=TENANT),
            NewEvent(event=a_day_before, ts=spent_at - DAY_S),  # out of every window
            made,
        ],
    )
    store.append("context:theirs", [ContextBound(session="theirs", tenant="other"), theirs])
    clock.advance(10)
    summarizer = Gate()
    with worker(store, clock, summarizer, ledger_settings()) as ref:
        assemble(ref, "new")
        assert summarizer.calls == 0
        (refusal,) = degraded(store, "new")
        assert (refusal.reason, refusal.used) == ("spend_cap", 5_000)
        clock.advance(HOUR_S)
        assemble(ref, "later")
        assert summarizer.calls == 1
    opened = ledger(store)[0].event
    assert isinstance(opened, ContextLedgerOpened)
    assert opened.spend == ((spent_at, 5_000),)  # within the day: carried on
    assert opened.consecutive_failures == 0


# -- a worker killed in the middle of a call ------------------------------------------------


def kill_mid_call(path: Path) -> None:
    """Run ``tests/_ledger_child.py`` on the store at ``path`` and SIGKILL it once its
    summarizer call has begun (it printed ``calling``)."""
    child = subprocess.Popen(
        [sys.executable, str(CHILD), str(path)],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=ROOT,
    )
    lines: queue.SimpleQueue[str | None] = queue.SimpleQueue()

    def pump() -> None:
        assert child.stdout is not None
        for line in child.stdout:
            lines.put(line.rstrip("\n"))
        lines.put(None)

    threading.Thread(target=pump, daemon=True).start()
    try:
        deadline = time.monotonic() + WAIT
        while True:
            try:
                line = lines.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                pytest.fail("the child never called its summarizer")
            if line == "calling":
                break
            assert line is not None, f"the child ended early: {child.communicate()[1]}"
        sigkill(child, WAIT)
    finally:
        reap(child, WAIT)


def test_a_worker_killed_mid_call_holds_the_cap_until_its_lease_ends(tmp_path: Path) -> None:
    """A child worker (system clock) reserves a call and is SIGKILLed inside it: its
    reservation is never released. A worker on the same LMDB directory, on a fake clock
    set from the reservation's time, finds the cap held by the dead call until its lease
    ends, then calls its summarizer."""
    path = tmp_path / "store"
    store_module.open(path).close()  # made before the child opens it
    kill_mid_call(path)
    inspect = store_module.open(path)
    try:
        records = ledger(inspect)
    finally:
        inspect.close()
    assert kinds(records) == ["ContextLedgerOpened", "ContextSummarizerReserved"]
    dead = records[-1]
    assert dead.event.session == "child"
    assert dead.event.lease_ms == LEASE_MS
    clock = FakeClock(start=dead.ts + 5)  # after the call began, before its lease ends
    store = store_module.open(path, clock=clock)
    summarizer = Gate()
    try:
        with worker(store, clock, summarizer, ledger_settings()) as ref:
            assemble(ref, "p")
            assert summarizer.calls == 0, "the dead worker's call no longer held the cap"
            (refusal,) = degraded(store, "p")
            assert (refusal.reason, refusal.used) == ("spend_cap", dead.event.tokens)
            clock.set(dead.ts + LEASE_MS / 1000)  # the lease has ended
            assemble(ref, "q")
            assert summarizer.calls == 1
            assert not degraded(store, "q")
        records = ledger(store)
    finally:
        store.close()
    assert kinds(records)[2:] == [
        "ContextSummarizerRefused",  # while the dead worker's call held the cap
        "ContextSummarizerReserved",
        "ContextSummarizerReleased",
    ]
    assert contiguous(records)


# -- a release the store refused ------------------------------------------------------------


class RefusesOneRelease:
    """A real store whose ``append`` refuses the first release written to a ledger."""

    #: write that release before reporting it lost
    writes_first = False

    def __init__(self, store: EventStore) -> None:
        self._store = store
        self.refused: list[str] = []

    def __getattr__(self, name: str) -> Any:
        return getattr(self._store, name)

    def append(
        self,
        stream: str,
        events: Sequence[Event | NewEvent],
        expected_version: int | None = None,
        **kwargs: Any,
    ) -> list[RecordedEvent]:
        released = any(
            isinstance(e.event if isinstance(e, NewEvent) else e, ContextSummarizerReleased)
            for e in events
        )
        if released and stream.startswith(LEDGER_STREAM) and not self.refused:
            self.refused.append(stream)
            if self.writes_first:
                self._store.append(stream, events, expected_version, **kwargs)
                raise StoreError("the commit may or may not have been written")
            raise StoreError("the database went away")
        return self._store.append(stream, events, expected_version, **kwargs)


def test_a_release_the_store_refused_is_appended_before_the_next_admission(
    store: EventStore, clock: FakeClock, logs: list[MutableMapping[str, Any]]
) -> None:
    proxy = RefusesOneRelease(store)
    summarizer = Gate((200, 100))  # 300 + one call's projection fit the cap; 2 calls do not
    with worker(proxy, clock, summarizer, ledger_settings()) as ref:  # type: ignore[arg-type]
        first = assemble(ref, "a")
        released_at = clock.now()
        assert first.summaries_made  # the assembly does not fail on the lost release
        assert proxy.refused == [ledger_stream(TENANT)]
        assert kinds(ledger(store)) == ["ContextLedgerOpened", "ContextSummarizerReserved"]
        clock.advance(5)
        second = assemble(ref, "b")
    assert summarizer.calls == 2, "the unreleased reservation still held the cap"
    assert second.summaries_made
    recorded = ledger(store)
    assert kinds(recorded) == [
        "ContextLedgerOpened",
        "ContextSummarizerReserved",
        "ContextSummarizerReleased",
        "ContextSummarizerReserved",
        "ContextSummarizerReleased",
    ]
    late = recorded[2]
    assert late.event.call_id == recorded[1].event.call_id
    assert (late.event.input_tokens, late.event.output_tokens) == (200, 100)
    assert late.ts == released_at  # when the call ended, not when it was written
    state = GovernorState(tenant=TENANT)
    for record in recorded:
        state = apply_governor_event(state, record.event, record.ts)
    assert window_spend(state, clock.now(), HOUR_S) == 600
    assert in_flight(state, clock.now()) == 0
    warned = [e for e in logs if e["event"] == "context_ledger.release_not_recorded"]
    assert len(warned) == 1
    assert warned[0]["log_level"] == "warning"
    ledger_never_over(store, CAP)


class LosesOneReleaseAmbiguously(RefusesOneRelease):
    """A real store that writes the first release to a ledger, then reports it lost as
    PostgreSQL does when the connection drops during the commit."""

    writes_first = True


def test_a_release_retried_after_an_ambiguous_failure_spends_the_cap_once(
    store: EventStore, clock: FakeClock
) -> None:
    proxy = LosesOneReleaseAmbiguously(store)
    summarizer = Gate((200, 100))  # 300 + one call's projection fit the cap; 600 + it do not
    with worker(proxy, clock, summarizer, ledger_settings()) as ref:  # type: ignore[arg-type]
        assert assemble(ref, "a").summaries_made
        clock.advance(5)
        second = assemble(ref, "b")
    recorded = ledger(store)
    releases = [r.event for r in recorded if isinstance(r.event, ContextSummarizerReleased)]
    assert [e.call_id for e in releases].count(releases[0].call_id) == 2  # written twice
    assert summarizer.calls == 2, "the first call's spend counted twice against the cap"
    assert second.summaries_made
    state = GovernorState(tenant=TENANT)
    for record in recorded:
        state = apply_governor_event(state, record.event, record.ts)
    assert window_spend(state, clock.now(), HOUR_S) == 600
    ledger_never_over(store, CAP)


# -- admissions that race ---------------------------------------------------------------


def capped(projected: int, per_hour: int = 6_000) -> Any:
    def decide(state: GovernorState, now: float) -> SummarizerVerdict:
        return decide_summarizer(
            state,
            now,
            projected=projected,
            per_hour=per_hour,
            per_day=0,
            failure_threshold=5,
            reset_timeout_ms=60_000,
        )

    return decide


def test_an_admission_that_loses_the_race_folds_and_decides_again(
    store: EventStore, clock: FakeClock
) -> None:
    one = StoreLedger(store, clock, lease_ms=60_000)
    two = StoreLedger(store, clock, lease_ms=60_000)
    seen: list[int] = []

    def decide_one(state: GovernorState, now: float) -> SummarizerVerdict:
        seen.append(in_flight(state, now))
        if len(seen) == 1:  # between one's fold and its append, two admits a call
            verdict, held = two.admit(TENANT, "s2", 4_000, capped(4_000))
            assert verdict.allowed
            assert held is not None
        return capped(4_000)(state, now)

    verdict, reservation = one.admit(TENANT, "s1", 4_000, decide_one)
    assert seen == [0, 4_000]  # decided again on the fold that holds two's call
    assert (verdict.reason, verdict.used, reservation) == ("spend_cap", 4_000, None)
    recorded = ledger(store)
    assert kinds(recorded) == [
        "ContextLedgerOpened",
        "ContextSummarizerReserved",
        "ContextSummarizerRefused",
    ]
    assert recorded[1].event.session == "s2"
    assert (recorded[2].event.session, recorded[2].event.used) == ("s1", 4_000)
    assert contiguous(recorded)


def test_a_refusal_is_recorded_once_while_the_ledger_and_the_verdict_stay(
    store: EventStore, clock: FakeClock
) -> None:
    """Every summary of an assembly the cap refuses asks again: the ledger records the
    refusal once, with the numbers compared, until the ledger or the verdict changes."""
    one = StoreLedger(store, clock, lease_ms=60_000)
    two = StoreLedger(store, clock, lease_ms=60_000)
    held = one.admit(TENANT, "s1", 4_000, capped(4_000))[1]
    assert held is not None
    for session, tokens in (("s2", 4_000), ("s2", 2_500), ("s3", 3_000)):
        verdict, reservation = two.admit(TENANT, session, tokens, capped(tokens))
        assert (verdict.reason, reservation) == ("spend_cap", None)
    recorded = ledger(store)
    assert kinds(recorded) == [
        "ContextLedgerOpened",
        "ContextSummarizerReserved",
        "ContextSummarizerRefused",
    ]
    refused = recorded[2].event
    assert isinstance(refused, ContextSummarizerRefused)
    assert (refused.session, refused.tokens, refused.reason) == ("s2", 4_000, "spend_cap")
    assert (refused.knob, refused.used, refused.limit, refused.until) == (
        PER_HOUR,
        4_000,
        6_000,
        None,
    )
    # the other worker's call ends: the ledger changed, and so does the verdict
    clock.advance(1)
    one.release(ended(held, input_tokens=3_000, output_tokens=0, error_class=None, duration_ms=5))
    verdict, _ = two.admit(TENANT, "s4", 4_000, capped(4_000))
    frees = clock.now() + HOUR_S  # when the spend released just now leaves the hour
    assert (verdict.reason, verdict.used, verdict.until) == ("spend_cap", 3_000, frees)
    assert kinds(ledger(store))[3:] == ["ContextSummarizerReleased", "ContextSummarizerRefused"]
    assert contiguous(ledger(store))


def test_a_refusal_that_loses_the_race_folds_and_decides_again(
    store: EventStore, clock: FakeClock
) -> None:
    """Between a worker's fold and its refusal, the call that held the cap is released by
    another worker: the refusal's append conflicts, and the worker admits its call."""
    one = StoreLedger(store, clock, lease_ms=60_000)
    two = StoreLedger(store, clock, lease_ms=60_000)
    held = one.admit(TENANT, "s1", 4_000, capped(4_000))[1]
    assert held is not None
    verdicts: list[SummarizerVerdict] = []

    def decide(state: GovernorState, now: float) -> SummarizerVerdict:
        verdict = capped(4_000)(state, now)
        verdicts.append(verdict)
        if len(verdicts) == 1:  # refused; before it is recorded, the call ends
            one.release(
                ended(held, input_tokens=10, output_tokens=0, error_class=None, duration_ms=5)
            )
        return verdict

    verdict, reservation = two.admit(TENANT, "s2", 4_000, decide)
    assert [v.allowed for v in verdicts] == [False, True]
    assert verdict.allowed
    assert reservation is not None
    assert kinds(ledger(store)) == [
        "ContextLedgerOpened",
        "ContextSummarizerReserved",
        "ContextSummarizerReleased",
        "ContextSummarizerReserved",
    ]


def test_alternating_admissions_of_two_ledgers_append_without_conflict_reaching_callers(
    store: EventStore, clock: FakeClock
) -> None:
    ledgers = [StoreLedger(store, clock, lease_ms=60_000) for _ in range(2)]
    held = []
    for n in range(8):
        mine, theirs = ledgers[n % 2], ledgers[(n + 1) % 2]
        interleaved: list[bool] = []

        def decide(
            state: GovernorState,
            now: float,
            theirs: StoreLedger = theirs,
            interleaved: list[bool] = interleaved,
        ) -> SummarizerVerdict:
            if not interleaved:  # the other worker appends between this fold and append
                interleaved.append(True)
                theirs.admit(TENANT, "other", 1, capped(1, per_hour=0))
            return capped(1, per_hour=0)(state, now)

        verdict, reservation = mine.admit(TENANT, f"s{n}", 1, decide)
        assert verdict.allowed
        assert reservation is not None
        held.append(reservation)
        clock.advance(1)
    for n, reservation in enumerate(held):
        ledgers[n % 2].release(
            ended(reservation, input_tokens=1, output_tokens=0, error_class=None, duration_ms=1)
        )
    recorded = ledger(store)
    assert contiguous(recorded)
    assert kinds(recorded).count("ContextLedgerOpened") == 1
    assert kinds(recorded)[0] == "ContextLedgerOpened"
    reserved = [r.event for r in recorded if isinstance(r.event, ContextSummarizerReserved)]
    assert len(reserved) == 16  # 8 admissions and the 8 made in between
    assert len({e.call_id for e in reserved}) == 16
    assert ledgers[0].governor(TENANT) == ledgers[1].governor(TENANT)
    assert len(ledgers[0].governor(TENANT).calls) == 8  # the 8 in-between calls still run


ROUNDS = 30


def test_two_workers_racing_on_threads_admit_exactly_one_call_per_round(
    lmdb_store: EventStore, store_dir: Path, clock: FakeClock
) -> None:
    """Two ledgers on two handles of one LMDB store, each on its own thread. In each
    round both ask at once for a call the cap admits only once, and release what they
    got only after both have asked: exactly one of them is admitted, every round."""
    other = store_module.open(store_dir, clock=clock)
    errors: list[BaseException] = []
    admitted = [[False, False] for _ in range(ROUNDS)]
    step = threading.Barrier(2)

    def work(index: int, store: EventStore) -> None:
        mine = StoreLedger(store, clock, lease_ms=60_000)
        try:
            for round_ in range(ROUNDS):
                step.wait(WAIT)  # both ask at once
                _, reservation = mine.admit(TENANT, f"w{index}", 4_000, capped(4_000))
                admitted[round_][index] = reservation is not None
                step.wait(WAIT)  # both have asked: now the call ends
                if reservation is not None:
                    mine.release(
                        ended(
                            reservation,
                            input_tokens=0,
                            output_tokens=0,
                            error_class=None,
                            duration_ms=0,
                        )
                    )
        except BaseException as exc:  # reported by the test
            errors.append(exc)
            step.abort()

    threads = [
        threading.Thread(target=work, args=(0, lmdb_store), daemon=True),
        threading.Thread(target=work, args=(1, other), daemon=True),
    ]
    try:
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(WAIT * 2)
    finally:
        other.close()
    assert not errors, errors
    assert all(not thread.is_alive() for thread in threads)
    assert [sum(pair) for pair in admitted] == [1] * ROUNDS
    recorded = ledger(lmdb_store)
    assert contiguous(recorded)
    reserved = [r for r in recorded if isinstance(r.event, ContextSummarizerReserved)]
    assert len(reserved) == ROUNDS
    state = GovernorState(tenant=TENANT)
    for record in recorded:
        if isinstance(record.event, ContextSummarizerReserved):
            assert in_flight(state, record.ts) == 0, f"two calls at once at v{record.version}"
        state = apply_governor_event(state, record.event, record.ts)
    assert in_flight(state, clock.now()) == 0


def test_an_admission_that_always_loses_gives_up_with_a_concurrency_error(
    store: EventStore, clock: FakeClock
) -> None:
    one = StoreLedger(store, clock, lease_ms=60_000)
    two = StoreLedger(store, clock, lease_ms=60_000)
    attempts = 0

    def always_overtaken(state: GovernorState, now: float) -> SummarizerVerdict:
        nonlocal attempts
        attempts += 1
        two.admit(TENANT, "other", 0, capped(0, per_hour=0))
        return capped(0, per_hour=0)(state, now)

    with pytest.raises(ConcurrencyError):
        one.admit(TENANT, "s", 0, always_overtaken)
    assert attempts > 1  # it did fold and decide again before it gave up
