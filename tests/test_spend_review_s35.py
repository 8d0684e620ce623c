"""Spend governance of the DAG context engine, reviewed (session 35): the tenant ledger
across workers whose clocks disagree, the ledger's snapshots while a worker runs, and the
``spend_cap`` episode while a cap refuses every leaf.

Real parts only: LMDB in ``tmp_path`` (and PostgreSQL where workers on several hosts
share one database), ContextStore actors, the store ledger, the fake clock. A test marked
``# Was: DEFECT:`` failed on the code before its fix.

The numbers of the two-worker tests (``tests/_ledger_child.py``): an assembly of
``history(8, 250)`` within ``BUDGET`` needs one summary, projected at about 5,700 tokens
against the hourly ``CAP`` of 6,000; the summarizer here reports 4,000 spent, so after
one call the hour has no room for another.
"""

from __future__ import annotations

from collections.abc import Iterator, MutableMapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import msgspec

from stalwart import store as store_module
from stalwart.actors import (
    TENANT_LEDGER,
    Assemble,
    Assembled,
    ContextStoreActor,
    StoreLedger,
    ask_context,
    ledger_stream,
)
from stalwart.clock import FakeClock
from stalwart.config import Config, ContextEngineSettings
from stalwart.context import ContextMessage, ExtractiveSummarizer, SummaryRequest, ended
from stalwart.events import (
    ContextDagDegraded,
    ContextSummarizerRefused,
    ContextSummarizerReserved,
    ContextSummaryCreated,
)
from stalwart.state import (
    HOUR_S,
    SUMMARIZER_LEDGER,
    VERIFIERS,
    SummarizerVerdict,
    decide_summarizer,
    fold,
    verify,
    window_spend,
)
from stalwart.store import EventStore, PostgresEventStore, snapshot_name
from tests._ledger_child import BUDGET, CAP, TENANT, history, ledger_settings

ASK = 30.0  # seconds an assembly may take before the test fails rather than hangs
T0 = 1_800_000_000.0
SKEW_S = 60.0  # how far one worker's clock is ahead of the other's


class Spends:
    """A summarizer that answers like the stand-in and reports 4,000 tokens spent."""

    def __init__(self) -> None:
        self.calls = 0
        self._standin = ExtractiveSummarizer()

    def __call__(self, request: SummaryRequest) -> tuple[str, int, int]:
        self.calls += 1
        text, _, _ = self._standin(request)
        return text, 3_500, 500


@contextmanager
def worker(store: EventStore, clock: FakeClock, summarizer: Any) -> Iterator[Any]:
    ref = ContextStoreActor.start(
        store=store, clock=clock, summarizer=summarizer, settings=ledger_settings()
    )
    try:
        yield ref
    finally:
        ref.stop()


def assemble(ref: Any, session: str) -> Assembled:
    message = Assemble(session_id=session, messages=history(8, 250), budget=BUDGET, tenant=TENANT)
    return ask_context(ref, message, ASK)  # type: ignore[no-any-return]


def hour_spend_after(store: EventStore, seconds: float) -> int:
    """What the tenant's ledger says was spent in the hour, ``seconds`` after ``T0``."""
    stream = ledger_stream(TENANT)
    state = fold(SUMMARIZER_LEDGER, stream, store.read_stream(stream))
    return window_spend(state, T0 + seconds, HOUR_S)


def workers_with_skewed_clocks(one: EventStore, two: EventStore) -> None:
    """Worker A's clock is ``SKEW_S`` ahead of worker B's; A summarizes first, then B."""
    ahead, behind = FakeClock(start=T0 + SKEW_S), FakeClock(start=T0)
    spends_a, spends_b = Spends(), Spends()
    with worker(one, ahead, spends_a) as a, worker(two, behind, spends_b) as b:
        assert assemble(a, "a").summaries_made
        answered = assemble(b, "b")
    assert spends_a.calls == 1
    assert spends_b.calls == 0  # the hour has 2,000 tokens left, the call needs 5,700
    assert "spend_cap" in answered.degraded
    assert hour_spend_after(two, SKEW_S + 10) <= CAP
    refused = list(two.read_stream(ledger_stream(TENANT)))[-1]
    assert isinstance(refused.event, ContextSummarizerRefused)
    assert refused.ts >= T0 + SKEW_S  # decided at the ledger's time, not behind it
    defaults = Config(context_engine=ledger_settings()).to_record()
    report = verify(two.read_all(), VERIFIERS, defaults=defaults)
    assert report.findings == ()
    assert report.checked["context:summarizer_refused"] == 1


# Was: DEFECT: a worker whose clock lagged another's left that one's spend out and passed the cap
def test_a_worker_whose_clock_is_behind_counts_what_another_worker_spent(
    lmdb_store: EventStore, store_dir: Path
) -> None:
    other = store_module.open(store_dir, clock=FakeClock(start=T0))
    try:
        workers_with_skewed_clocks(lmdb_store, other)
    finally:
        other.close()


# Was: DEFECT: on PostgreSQL, workers on hosts whose clocks disagree admitted past the cap
def test_workers_on_postgresql_with_skewed_clocks_share_the_cap(pg_url: str) -> None:
    with (
        PostgresEventStore(pg_url, clock=FakeClock(start=T0 + SKEW_S)) as one,
        PostgresEventStore(pg_url, clock=FakeClock(start=T0)) as two,
    ):
        workers_with_skewed_clocks(one, two)


def test_a_call_admitted_at_the_ledgers_time_is_released_no_earlier(
    lmdb_store: EventStore,
) -> None:
    """The worker behind decides at the ledger's time; its release is recorded at that
    time or later too, never before its own reservation (a success recorded before the
    breaker's last failure would not close it)."""
    ahead, behind = FakeClock(start=T0 + SKEW_S), FakeClock(start=T0)
    for clock in (ahead, behind):
        ledger = StoreLedger(lmdb_store, clock, lease_ms=300_000)
        _, reservation = ledger.admit(TENANT, "s", 100, admit_free)
        assert reservation is not None
        ledger.release(
            ended(reservation, input_tokens=50, output_tokens=10, error_class=None, duration_ms=5)
        )
    times = [r.ts for r in lmdb_store.read_stream(ledger_stream(TENANT))]
    assert times == sorted(times)
    assert times[-1] >= T0 + SKEW_S


# -- the ledger's snapshots while a worker runs ---------------------------------------------

EVERY = 20  # the store's snapshot cadence in this test


def admit_free(governor: Any, now: float) -> SummarizerVerdict:
    return decide_summarizer(
        governor,
        now,
        projected=100,
        per_hour=0,
        per_day=0,
        failure_threshold=5,
        reset_timeout_ms=60_000,
    )


# Was: DEFECT: only a worker's first fold saved a ledger snapshot: a restart refolded its uptime
def test_a_long_running_worker_keeps_its_tenant_ledgers_snapshot_current(
    tmp_path: Path, clock: FakeClock
) -> None:
    store = store_module.open(tmp_path / "store", clock=clock, snapshot_every=EVERY)
    try:
        ledger = StoreLedger(store, clock, lease_ms=300_000)
        for _ in range(5 * EVERY):  # one worker's calls: 201 records
            verdict, reservation = ledger.admit(TENANT, "s", 100, admit_free)
            assert verdict.allowed
            assert reservation is not None
            ledger.release(
                ended(
                    reservation, input_tokens=50, output_tokens=10, error_class=None, duration_ms=5
                )
            )
            clock.advance(1)
        live = ledger.governor(TENANT)
        stream = ledger_stream(TENANT)
        head = store.stream_version(stream)
        saved = [s.version for s in store.snapshots(stream, snapshot_name(TENANT_LEDGER))]
        assert saved, "no snapshot of the tenant's ledger"
        assert head - max(saved) < 2 * EVERY  # the next worker folds fewer than twice EVERY
        restarted = StoreLedger(store, clock, lease_ms=300_000)
        assert restarted.governor(TENANT) == live
        assert live == fold(SUMMARIZER_LEDGER, stream, store.read_stream(stream))
    finally:
        store.close()


# -- one spend_cap episode while the cap refuses every leaf ---------------------------------


def long_history(count: int) -> tuple[ContextMessage, ...]:
    return tuple(
        ContextMessage(
            message_id=f"m{n}",
            seq=n,
            role="user" if n % 2 == 0 else "assistant",
            content=f"message {n} " + "word " * 40,
            ts=T0 + n,
        )
        for n in range(count)
    )


def capped(per_hour: int) -> ContextEngineSettings:
    settings = ContextEngineSettings()
    spend = msgspec.structs.replace(
        settings.summarizer_spend,
        max_tokens_per_tenant_per_hour=per_hour,
        max_tokens_per_tenant_per_day=0,
    )
    return msgspec.structs.replace(settings, summarizer_spend=spend)


def degrades(store: EventStore, session: str) -> list[ContextDagDegraded]:
    return [
        r.event
        for r in store.read_stream(f"context:{session}")
        if isinstance(r.event, ContextDagDegraded)
    ]


def warned(logs: list[MutableMapping[str, Any]]) -> int:
    return sum(1 for line in logs if line.get("event") == "context_dag_degraded")


def assemble_long(
    store: EventStore, clock: FakeClock, messages: tuple[ContextMessage, ...]
) -> None:
    ref = ContextStoreActor.start(
        store=store, clock=clock, summarizer=ExtractiveSummarizer(), settings=capped(30_000)
    )
    try:
        message = Assemble(session_id="long", messages=messages, budget=200_000, tenant=TENANT)
        ask_context(ref, message, ASK)
    finally:
        ref.stop()


# Was: DEFECT: a condensation under a spend cap ended the episode: WARN + event every few leaves
def test_a_spend_cap_episode_is_recorded_once_while_condensations_still_fit(
    store: EventStore, clock: FakeClock, logs: list[MutableMapping[str, Any]]
) -> None:
    """20,000 messages in one assembly under an hourly cap of 30,000: the first leaves
    are summarized, then every leaf (about 5,000 tokens projected) is refused while the
    condensations of four truncations (about 1,000) still fit. One episode, one record,
    one WARN; a restarted ContextStore, folding the session from the log, knows the
    episode goes on."""
    assemble_long(store, clock, long_history(20_000))
    summaries = [
        r.event
        for r in store.read_stream("context:long")
        if isinstance(r.event, ContextSummaryCreated)
    ]
    truncated = [s for s in summaries if s.fallback]
    condensed = [s for s in summaries if not s.fallback and s.depth > 0]
    last_truncated = max(i for i, s in enumerate(summaries) if s.fallback)
    assert truncated
    assert any(summaries.index(s) < last_truncated for s in condensed)
    (episode,) = degrades(store, "long")
    assert (episode.reason, episode.limit) == ("spend_cap", 30_000)
    assert warned(logs) == 1

    clock.advance(60)  # the hour has not freed: the leaves are still refused
    assemble_long(store, clock, long_history(21_000))
    assert len(degrades(store, "long")) == 1
    assert warned(logs) == 1
    reserved = [
        r
        for r in store.read_stream(ledger_stream(TENANT))
        if isinstance(r.event, ContextSummarizerReserved)
    ]
    assert reserved  # the condensations ran: the episode is the leaves'


def test_a_leaf_summarized_again_ends_the_episode_and_the_next_one_is_recorded(
    store: EventStore, clock: FakeClock, logs: list[MutableMapping[str, Any]]
) -> None:
    """Once the hour frees, a leaf is summarized (the episode ends); when the cap is hit
    again, that is a new episode, recorded and logged (what the fix above must keep)."""
    assemble_long(store, clock, long_history(20_000))
    assert len(degrades(store, "long")) == 1
    clock.advance(HOUR_S + 1)
    assemble_long(store, clock, long_history(40_000))
    episodes = degrades(store, "long")
    assert [e.reason for e in episodes] == ["spend_cap", "spend_cap"]
    assert warned(logs) == 2
