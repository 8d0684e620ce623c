"""The summarizer governor's fold at scale: the accumulator equals the pure fold, is linear
in the ledger, and a worker's first admission starts from the ledger's snapshot.

The pure :func:`~stalwart.state.apply_governor_event` copies the day's spend and
releases at every event, so folding a tenant's ledger was quadratic in its calls per day
(8,000 calls a day: 0.6 ms an event, half a minute for three days, at a worker's first
summarizer call for the tenant). Real parts: an LMDB store in ``tmp_path``.
"""

from __future__ import annotations

import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from benchmarks.ledger import T0, TENANT, busy_days
from stalwart.actors import TENANT_LEDGER, StoreLedger, ledger_stream
from stalwart.clock import FakeClock
from stalwart.events import (
    ContextLedgerOpened,
    ContextSummarizerFailed,
    ContextSummarizerReleased,
    ContextSummarizerReserved,
    ContextSummaryCreated,
    Event,
    RecordedEvent,
)
from stalwart.state import (
    DAY_S,
    SUMMARIZER_LEDGER,
    GovernorFolder,
    GovernorState,
    SummarizerVerdict,
    apply_governor_event,
    decide_summarizer,
)
from stalwart.store import EventStore, NewEvent, load_state
from tests._log import recorded
from tests._runtime_support import CountingStore

KNOBS = {"per_hour": 0, "per_day": 10**12, "failure_threshold": 3, "reset_timeout_ms": 60_000}


def _record(event: Event, ts: float, version: int) -> RecordedEvent:
    return recorded(event, ts, version, ledger_stream(TENANT))


# -- the accumulator equals the pure fold ------------------------------------------------------

_CALLS = st.sampled_from([f"c{n}" for n in range(6)])
_TENANTS = st.sampled_from([TENANT, TENANT, TENANT, "other", None])
_TOKENS = st.integers(min_value=0, max_value=50)


def _summary(tenant: str | None, tokens: int, fallback: bool) -> ContextSummaryCreated:
    return ContextSummaryCreated(
        summary_id="s",
        depth=0,
        covers=(),
        descendant_count=0,
        input_tokens=tokens,
        output_tokens=1,
        tenant=tenant,
        fallback="emergency-truncation" if fallback else None,
    )


_EVENTS = st.one_of(
    st.builds(
        ContextSummarizerReserved,
        call_id=_CALLS,
        tenant=_TENANTS,
        tokens=_TOKENS,
        trial=st.booleans(),
        lease_ms=st.sampled_from([0, 1_000, 300_000]),
    ),
    st.builds(
        ContextSummarizerReleased,
        call_id=_CALLS,
        tenant=_TENANTS,
        input_tokens=_TOKENS,
        output_tokens=_TOKENS,
        error_class=st.sampled_from([None, None, "Timeout"]),
    ),
    st.builds(
        ContextLedgerOpened,
        tenant=_TENANTS,
        spend=st.lists(st.tuples(st.floats(T0 - DAY_S, T0 + DAY_S), _TOKENS), max_size=3).map(
            tuple
        ),
        consecutive_failures=st.integers(0, 4),
        last_failure_at=st.none() | st.floats(T0 - DAY_S, T0 + DAY_S),
    ),
    st.builds(_summary, _TENANTS, _TOKENS, st.booleans()),
    st.builds(ContextSummarizerFailed, tenant=_TENANTS, input_tokens=_TOKENS),
)
#: steps between events: mostly forward (hours, so that the day's window moves), sometimes
#: back (workers' clocks disagree)
_STEPS = st.sampled_from([0.0, 1.0, 3_600.0, 30_000.0, DAY_S, -1.0, -5_000.0])


@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(_EVENTS, _STEPS), max_size=60))
def test_the_folder_equals_the_pure_fold_event_by_event(steps: list[tuple[Event, float]]) -> None:
    pure = GovernorState(tenant=TENANT)
    folder = GovernorFolder(pure)
    ts = T0
    for event, step in steps:
        ts += step
        pure = apply_governor_event(pure, event, ts)
        folder.add_event(event, ts)
        assert folder.state() == pure


@settings(max_examples=100, deadline=None)
@given(st.lists(st.tuples(_EVENTS, _STEPS), max_size=40), st.integers(0, 40))
def test_the_ledger_fold_from_a_snapshot_equals_the_whole_fold(
    steps: list[tuple[Event, float]], cut: int
) -> None:
    """The ledger aggregate (tenant from its first event) folded in two parts, the first
    one's state round-tripped as its snapshot would be, equals the fold of the whole."""
    records = []
    ts = T0
    for version, (event, step) in enumerate(steps, 1):
        ts += step
        records.append(_record(event, ts, version))
    whole = SUMMARIZER_LEDGER.folder(SUMMARIZER_LEDGER.initial("x"))
    first = SUMMARIZER_LEDGER.folder(SUMMARIZER_LEDGER.initial("x"))
    for record in records:
        whole.add(record)
    for record in records[:cut]:
        first.add(record)
    rest = SUMMARIZER_LEDGER.folder(first.state())
    for record in records[cut:]:
        rest.add(record)
    pure = SUMMARIZER_LEDGER.initial("x")
    for record in records:
        pure = SUMMARIZER_LEDGER.apply(pure, record)
    assert whole.state() == rest.state() == pure


# -- linear in the ledger ---------------------------------------------------------------------


def test_folding_three_busy_days_takes_a_fraction_of_a_second() -> None:
    """48,000 events at 8,000 calls a day: about 0.1 s here, and 28 s for the pure fold.
    The bound is 25x above the one and 9x below the other."""
    folder = SUMMARIZER_LEDGER.folder(SUMMARIZER_LEDGER.initial(ledger_stream(TENANT)))
    started = time.perf_counter()
    for version, new in enumerate(busy_days(8_000, 3), 1):
        folder.add(_record(new.event, new.ts or T0, version))
    elapsed = time.perf_counter() - started
    state = folder.state()
    assert (len(state.spend), len(state.released)) == (8_000, 8_000)  # one day's
    assert elapsed < 3.0, f"{elapsed:.1f} s"


# -- a worker's first admission starts from the snapshot ----------------------------------------


def _decide(state: GovernorState, now: float) -> SummarizerVerdict:
    return decide_summarizer(state, now, projected=100, **KNOBS)


@pytest.fixture
def busy_ledger(store: EventStore, clock: FakeClock) -> EventStore:
    """A tenant ledger of 1,201 events (opened, then 600 calls over a day)."""
    stream = ledger_stream(TENANT)
    store.append(stream, [NewEvent(event=ContextLedgerOpened(tenant=TENANT), ts=T0)])
    store.append(stream, list(busy_days(600, 1)), expected_version=1)
    clock.set(T0 + DAY_S)
    return store


def test_a_workers_first_admission_reads_the_ledger_once_then_from_its_snapshot(
    busy_ledger: EventStore, clock: FakeClock
) -> None:
    stream = ledger_stream(TENANT)
    first = CountingStore(busy_ledger)
    verdict, reserved = StoreLedger(first, clock, lease_ms=60_000).admit(TENANT, "s", 100, _decide)
    assert verdict.allowed
    assert reserved is not None
    assert first.records[stream] == 1_201  # the whole ledger, once: a snapshot is saved
    assert load_state(busy_ledger, stream, TENANT_LEDGER).version == 1_202

    second = CountingStore(busy_ledger)
    ledger = StoreLedger(second, clock, lease_ms=60_000)
    governor = ledger.governor(TENANT)
    assert second.records[stream] <= 1  # the snapshot, then what came after it
    assert governor == StoreLedger(busy_ledger, clock, lease_ms=60_000).governor(TENANT)
    assert [call.call_id for call in governor.calls] == [reserved.call_id]
    # the version it expects is the fold's own: its admission lands right after
    verdict, again = ledger.admit(TENANT, "s", 100, _decide)
    assert verdict.allowed
    assert again is not None
    assert busy_ledger.stream_version(stream) == 1_203


def test_the_snapshot_holds_what_the_whole_fold_holds(busy_ledger: EventStore) -> None:
    stream = ledger_stream(TENANT)
    from_snapshot = load_state(busy_ledger, stream, TENANT_LEDGER, snapshot_every=1)
    assert load_state(busy_ledger, stream, TENANT_LEDGER) == from_snapshot  # read back
    whole = load_state(busy_ledger, stream, SUMMARIZER_LEDGER, use_snapshots=False)
    assert (from_snapshot.governor, from_snapshot.version) == (whole, 1_201)
