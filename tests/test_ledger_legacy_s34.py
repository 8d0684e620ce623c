"""The legacy count of the summarizer ledger: a tenant's ledger opens with the spend and
breaker counts its ``context:<session>`` streams recorded before the ledger existed, and
that fold is recorded (``context:legacy_counted`` in ``context-legacy``, with the log
position it covers), so a worker started later reads the count and the records after
it, not every session's stream again.

Each worker is its own store handle (as a process would be) on one real LMDB directory
(or one PostgreSQL schema); the store counts its reads of ``context:`` streams. The
expected governor is the pure fold (``apply_governor_event``) of every ``context:``
record in log order, what the ledger carried before the count was recorded.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from functools import partial
from pathlib import Path
from typing import Any

import pytest

from stalwart.actors import StoreLedger, ledger_stream
from stalwart.actors._ledger import LEGACY_STREAM, READ_RUN
from stalwart.clock import FakeClock
from stalwart.events import (
    ContextAssembled,
    ContextBound,
    ContextLedgerOpened,
    ContextLegacyCounted,
    ContextSummarizerFailed,
    ContextSummaryCreated,
    Event,
)
from stalwart.state import (
    DAY_S,
    GovernorState,
    SummarizerVerdict,
    apply_governor_event,
)
from stalwart.store import EventStore, LmdbEventStore, NewEvent, PostgresEventStore

WAIT = 10.0  # seconds a thread may take to reach the point the test waits for
TENANTS = ("acme", "globex", None)


class Counting:
    """Counts a store's reads of ``context:`` streams; ``gate`` (when set) is called
    before each one."""

    def __init__(self) -> None:
        self.reads: list[str] = []
        self.gate: Callable[[], None] | None = None

    def saw(self, stream: str) -> None:
        if stream.startswith("context:"):
            self.reads.append(stream)
            if self.gate is not None:
                self.gate()


class CountsReads:
    """A store whose reads of ``context:`` streams are counted: put before the store's
    class, whose ``read_stream`` it passes each read on to."""

    counting: Counting

    def read_stream(self, stream: str, *args: Any, **kwargs: Any) -> Any:
        self.counting.saw(stream)
        return super().read_stream(stream, *args, **kwargs)  # type: ignore[misc]


class CountingLmdb(CountsReads, LmdbEventStore):
    def __init__(self, path: Path, clock: FakeClock) -> None:
        super().__init__(path, clock=clock)
        self.counting = Counting()


class CountingPostgres(CountsReads, PostgresEventStore):
    def __init__(self, url: str, clock: FakeClock) -> None:
        super().__init__(url, clock=clock)
        self.counting = Counting()


Opener = Callable[[], Any]


@contextmanager
def handles_on(open_one: Opener) -> Iterator[Opener]:
    """Opens another handle on one store (``open_one``) each call, as another process
    would; closes them all."""
    opened: list[Any] = []

    def one() -> Any:
        opened.append(open_one())
        return opened[-1]

    try:
        yield one
    finally:
        for store in opened:
            store.close()


@pytest.fixture(params=["lmdb", "postgres"])
def handles(request: pytest.FixtureRequest, tmp_path: Path, clock: FakeClock) -> Iterator[Opener]:
    """Handles on one LMDB directory, or on one PostgreSQL schema."""
    open_one: Opener
    if request.param == "lmdb":
        open_one = partial(CountingLmdb, tmp_path / "store", clock)
    else:
        open_one = partial(CountingPostgres, request.getfixturevalue("pg_url"), clock)
    with handles_on(open_one) as one:
        yield one


@pytest.fixture
def lmdb(tmp_path: Path, clock: FakeClock) -> Iterator[Opener]:
    with handles_on(partial(CountingLmdb, tmp_path / "store", clock)) as one:
        yield one


def allow(state: GovernorState, now: float) -> SummarizerVerdict:
    return SummarizerVerdict(allowed=True)


def summary(n: int, tenant: str | None, tokens: int) -> ContextSummaryCreated:
    return ContextSummaryCreated(
        summary_id=f"s{n}",
        depth=0,
        covers=(f"m{n}",),
        descendant_count=1,
        body="what was said, before the ledger",
        input_tokens=tokens,
        output_tokens=tokens // 10,
        tenant=tenant,
    )


def failure(tenant: str | None) -> ContextSummarizerFailed:
    return ContextSummarizerFailed(tenant=tenant, error_class="TimeoutError")


def legacy_log(store: EventStore, clock: FakeClock, sessions: int = 12) -> None:
    """Sessions of every tenant that summarized (and failed) before the ledger existed,
    interleaved in the log; one summary a day and more ago, out of every window."""
    for n in range(sessions):
        tenant = TENANTS[n % len(TENANTS)]
        events: list[Event | NewEvent] = [ContextBound(session=f"s{n}", tenant=tenant)]
        if n == 0:
            events.append(NewEvent(event=summary(999, tenant, 50_000), ts=clock.now() - DAY_S))
        events.append(summary(n, tenant, 100 * (n + 1)))
        if n % 4 == 1 or n >= sessions - len(TENANTS):  # each tenant ends in a failure
            events.append(failure(tenant))
        events.append(ContextAssembled(tokens_in=900, tokens_out=300, budget=1_000))
        store.append(f"context:s{n}", events)
        clock.advance(7)


def expected(store: EventStore, tenant: str | None, now: float) -> ContextLedgerOpened:
    """The opening the ledger carried before its count was recorded: the pure fold of
    every ``context:`` record, spend within the day before ``now``."""
    state = GovernorState(tenant=tenant)
    for record in store.read_all():
        if record.stream.startswith("context:"):
            state = apply_governor_event(state, record.event, record.ts)
    return ContextLedgerOpened(
        tenant=tenant,
        spend=tuple(entry for entry in state.spend if entry[0] > now - DAY_S),
        consecutive_failures=state.consecutive_failures,
        last_failure_at=state.last_failure_at,
    )


def opening(store: EventStore, tenant: str | None) -> ContextLedgerOpened:
    first = next(iter(store.read_stream(ledger_stream(tenant), 1, 1))).event
    assert isinstance(first, ContextLedgerOpened)
    return first


def counts(store: EventStore) -> list[ContextLegacyCounted]:
    found = [record.event for record in store.read_stream(LEGACY_STREAM)]
    assert all(isinstance(event, ContextLegacyCounted) for event in found)
    return found  # type: ignore[return-value]


def admit(store: EventStore, clock: FakeClock, tenant: str | None) -> None:
    ledger = StoreLedger(store, clock, lease_ms=300_000)
    verdict, reservation = ledger.admit(tenant, "new", 100, allow)
    assert verdict.allowed
    assert reservation is not None


# Was: DEFECT: each process's first new tenant read every context: stream again (seconds)
def test_a_second_worker_opens_a_ledger_from_the_recorded_count_without_reading_the_sessions(
    handles: Opener, clock: FakeClock
) -> None:
    first = handles()
    legacy_log(first, clock)
    clock.advance(60)
    admit(first, clock, "acme")
    assert first.counting.reads  # the first count reads the sessions' streams
    assert opening(first, "acme") == expected(first, "acme", clock.now())
    covered = first.head() - 3  # what the count covers: before it, and the ledger's two events
    clock.advance(60)
    for tenant in ("globex", None):
        second = handles()  # another process on the same store
        admit(second, clock, tenant)
        assert second.counting.reads == []
        assert opening(second, tenant) == expected(second, tenant, clock.now())
        assert opening(second, tenant).consecutive_failures > 0
    (count,) = counts(first)
    assert count.covers == covered


def test_a_summary_an_older_version_wrote_after_the_count_still_counts(
    handles: Opener, clock: FakeClock
) -> None:
    first = handles()
    legacy_log(first, clock)
    # a long session of globex's: the records after the count are found by halving
    long_session = [
        ContextAssembled(tokens_in=9, tokens_out=3, budget=10) for _ in range(5 * READ_RUN)
    ]
    first.append("context:long", [ContextBound(session="long", tenant="globex"), *long_session])
    first.append("context:long", [summary(500, "globex", 3_000)])
    clock.advance(60)
    admit(first, clock, "acme")
    (count,) = counts(first)
    # an older stalwart (no ledger) keeps summarizing globex's sessions after the count
    clock.advance(60)
    first.append("context:long", [*long_session, summary(501, "globex", 7_000), failure("globex")])
    first.append("context:long", long_session)
    first.append("context:late", [ContextBound(session="late", tenant="globex"), failure("globex")])
    clock.advance(60)
    second = handles()
    admit(second, clock, "globex")
    opened = opening(second, "globex")
    assert opened == expected(second, "globex", clock.now())
    assert (clock.now() - 60, 7_700) in opened.spend
    assert sorted(set(second.counting.reads)) == ["context:late", "context:long"]
    assert len(second.counting.reads) < 2 * READ_RUN  # not the long session record by record
    newer = counts(second)[-1]
    assert newer.covers > count.covers
    # acme's ledger was open when it counted; globex's opened with this very count
    assert {governor.tenant for governor in newer.governors} == {"globex", None}
    third = handles()
    admit(third, clock, None)
    assert third.counting.reads == []
    assert opening(third, None) == expected(third, None, clock.now())


def test_two_workers_counting_at_once_record_one_count(handles: Opener, clock: FakeClock) -> None:
    setup = handles()
    legacy_log(setup, clock)
    clock.advance(60)
    both = threading.Barrier(2, timeout=WAIT)
    workers = [handles(), handles()]
    for store in workers:
        gate_once(store, both.wait)
    errors: list[BaseException] = []

    def run(store: EventStore, tenant: str | None) -> None:
        try:
            admit(store, clock, tenant)
        except BaseException as exc:  # reported by the test thread
            errors.append(exc)

    threads = [
        threading.Thread(target=run, args=(store, tenant))
        for store, tenant in zip(workers, ("acme", "globex"), strict=True)
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(WAIT)
    assert not any(thread.is_alive() for thread in threads)
    assert errors == []
    assert len(counts(setup)) == 1
    for tenant in ("acme", "globex"):
        assert opening(setup, tenant) == expected(setup, tenant, clock.now())


def gate_once(store: Any, gate: Callable[[], object]) -> None:
    """Call ``gate`` before ``store``'s first read of a ``context:`` stream only."""
    counting: Counting = store.counting

    def once() -> None:
        counting.gate = None
        gate()

    counting.gate = once


# Was: DEFECT: a tenant with a ledger waited on the ledger lock for another's legacy count
def test_a_tenant_with_a_ledger_admits_while_another_tenant_is_counted(
    lmdb: Opener, clock: FakeClock
) -> None:
    store = lmdb()
    legacy_log(store, clock)
    store.append(ledger_stream("globex"), [ContextLedgerOpened(tenant="globex")])
    ledger = StoreLedger(store, clock, lease_ms=300_000)
    entered, go = threading.Event(), threading.Event()

    def hold() -> None:
        entered.set()
        go.wait(WAIT)

    gate_once(store, hold)
    done = {tenant: threading.Event() for tenant in ("acme", "globex")}

    def run(tenant: str) -> None:
        ledger.admit(tenant, "s", 100, allow)
        done[tenant].set()

    counting = threading.Thread(target=run, args=("acme",))
    counting.start()
    try:
        assert entered.wait(WAIT)  # real-time: acme's count is under way, and waits
        other = threading.Thread(target=run, args=("globex",))
        other.start()
        assert done["globex"].wait(WAIT)  # real-time: the other thread admits on its own
        assert not done["acme"].is_set()
    finally:
        go.set()
        counting.join(WAIT)
    assert done["acme"].is_set()
    other.join(WAIT)
    assert opening(store, "acme") == expected(store, "acme", clock.now())
