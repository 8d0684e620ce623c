"""Review of two changes: a subscription waits out a PostgreSQL store it cannot reach
(``StoreUnavailableError``, ``NotSentError``, ``Subscription``, ``tail --follow``), and the
tenant summarizer ledger folds linearly and starts from a snapshot (``GovernorFolder``,
``TENANT_LEDGER``, ``StoreLedger``).

Real parts: the test session's PostgreSQL behind the relay that cuts its connections
(``tests._relay``), LMDB directories in ``tmp_path``, ``stalwart`` as a subprocess. Time
is a FakeClock where the code takes one. A test marked ``# Was: DEFECT:`` failed on the
code it was written against and passes since the fix."""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import socket
import sys
import threading
import time
from collections.abc import Callable, Iterator, MutableMapping
from pathlib import Path
from typing import Any

import msgspec
import psycopg
import pytest

from stalwart import store as store_module
from stalwart.actors import TENANT_LEDGER, StoreLedger, ledger_stream
from stalwart.clock import FakeClock
from stalwart.context import MemoryLedger
from stalwart.errors import (
    AppendInDoubtError,
    ConcurrencyError,
    CorruptRecordError,
    StoreError,
    StoreUnavailableError,
)
from stalwart.events import (
    ContextSummarizerReleased,
    ContextSummarizerReserved,
    MessageAppended,
    RecordedEvent,
)
from stalwart.state import (
    DAY_S,
    HOUR_S,
    SUMMARIZER_LEDGER,
    GovernorState,
    SummarizerVerdict,
    decide_summarizer,
    window_spend,
)
from stalwart.store import (
    EventStore,
    NewEvent,
    PostgresEventStore,
    Snapshot,
    Subscription,
    load_state,
    snapshot_name,
)
from stalwart.store._postgres_writer import NotSentError
from stalwart.testing import PostgresServer
from tests._relay import CuttingRelay, reachable, schema_of
from tests._runtime_support import CollectedProcess, CountingStore, until

Logs = list[MutableMapping[str, Any]]

#: the most a wait for the store to come back (its pool reconnects with backoff) takes
BACK = 30.0
_roles = itertools.count(1)


def _msg(tag: str) -> MessageAppended:
    return MessageAppended(message_id=tag, role="user")


def _append(log: EventStore, stream: str, n: int, tag: str) -> None:
    log.append(stream, [_msg(f"{tag}{i}") for i in range(n)])


def _named(logs: Logs, name: str) -> list[MutableMapping[str, Any]]:
    return [entry for entry in list(logs) if entry["event"] == name]


def _outage_logs(logs: Logs) -> list[str]:
    return [e["event"] for e in list(logs) if str(e["event"]).startswith("subscription.store_")]


def _relayed(pg_server: PostgresServer, pg_url: str, relay: CuttingRelay, **options: Any) -> Any:
    """Another handle on the test's schema whose connections go through ``relay``."""
    url = pg_server.url("stalwart_test").replace(f":{pg_server.port}/", f":{relay.port}/")
    return PostgresEventStore(f"{url}?schema={schema_of(pg_url)}", **options)


def _gather(feed: Subscription, into: list[int], count: int, *, wait: float = 0.5) -> bool:
    """Poll ``feed`` once into ``into``; whether it holds ``count`` positions now."""
    into.extend(r.position for r in feed.poll(wait))
    return len(into) >= count


def _error_of(work: Callable[[], object], times: int = 3) -> BaseException | None:
    """The StoreError ``work`` raises within ``times`` calls, or None."""
    for _ in range(times):
        try:
            work()
        except StoreError as exc:
            return exc
    return None


def _cut(relay: CuttingRelay) -> None:
    """Cut every relayed connection and refuse new ones, including a connection the
    relay was accepting as it cut (it joins the relay's pairs after the cut, and would
    live on). The relay accepts one connection at a time: once it has refused a probe
    made after the cut, any it was accepting then is among its pairs, and a second cut
    reaches it."""
    relay.cut_now()
    with socket.create_connection(("127.0.0.1", relay.port), timeout=BACK) as probe:
        assert probe.recv(1) == b""  # refused: closed by the relay
    relay.cut_now()


def _back(store: EventStore) -> None:
    until(lambda: reachable(store), BACK, what="the store's pool reconnected")


class Feed:
    """A subscription iterated on a thread (as ``tail --follow`` iterates it)."""

    def __init__(self, subscription: Subscription) -> None:
        self.subscription = subscription
        self.positions: list[int] = []
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        try:
            for record in self.subscription:
                self.positions.append(record.position)
        except BaseException as exc:
            self.error = exc

    def stop(self, within: float = BACK) -> None:
        self.subscription.close()
        self.thread.join(within)


class CountingWaits:
    """Passes every call to the store it wraps; counts the subscription's looks at the
    head (``wait_for``) begun, those that reached the store and those that could not. A
    test double of what the store's caller saw, not of stalwart."""

    def __init__(self, inner: EventStore) -> None:
        self._inner = inner
        self.started = 0
        self.reached = 0
        self.unreachable = 0

    def wait_for(self, position: int, timeout: float | None) -> int:
        self.started += 1
        try:
            head = self._inner.wait_for(position, timeout)
        except StoreUnavailableError:
            self.unreachable += 1
            raise
        self.reached += 1
        return head

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


class CutWhileReading:
    """Passes every call to a relayed store; once armed, the next read cuts the relay
    right after its first record. The rest of that read's batch is fetched already, so
    the database goes away between two batches of one read (the first is 1,024 rows)."""

    def __init__(self, inner: EventStore, relay: CuttingRelay) -> None:
        self._inner = inner
        self._relay = relay
        self.armed = False

    def _cutting(self, records: Iterator[RecordedEvent]) -> Iterator[RecordedEvent]:
        for n, record in enumerate(records):
            if n == 1 and self.armed:
                self.armed = False
                _cut(self._relay)
            yield record

    def read_all(self, *args: Any, **kwargs: Any) -> Iterator[RecordedEvent]:
        return self._cutting(self._inner.read_all(*args, **kwargs))

    def read_stream(self, *args: Any, **kwargs: Any) -> Iterator[RecordedEvent]:
        return self._cutting(self._inner.read_stream(*args, **kwargs))

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


# == Change 1: a subscription waits out a store it cannot reach ==============================


def test_nothing_is_skipped_or_repeated_across_an_outage_with_appends_during_and_after(
    pg_store: EventStore, relay: CuttingRelay, relayed_store: PostgresEventStore, logs: Logs
) -> None:
    """docs/scaling.md: a subscription waits out a database it cannot reach and "carries on
    from the next event it had not returned". Another connection appends before, during
    and after the outage; the feed (polled, as a host would) returns each event once, in
    order, and logs the outage once and its end once."""
    _append(pg_store, "session:a", 3, "before")
    feed = relayed_store.subscribe(1)
    got = [r.position for r in feed.poll(BACK)]
    _cut(relay)
    _append(pg_store, "session:a", 4, "during")
    assert feed.poll(0.2) == []  # unreachable: nothing, and no error
    until(lambda: _named(logs, "subscription.store_unreachable"), BACK, what="the outage log")
    _append(pg_store, "session:b", 2, "still-during")
    relay.restore()
    _append(pg_store, "session:b", 5, "after")

    until(lambda: _gather(feed, got, 14), BACK, what="all 14 events after the outage")
    _append(pg_store, "session:c", 1, "later")
    until(lambda: _gather(feed, got, 15), BACK, what="the 15th event")
    assert got == list(range(1, 16))
    assert _outage_logs(logs) == [
        "subscription.store_unreachable",
        "subscription.store_reachable",
    ]
    [lost] = _named(logs, "subscription.store_unreachable")
    [found] = _named(logs, "subscription.store_reachable")
    assert lost["position"] == found["position"] == 4


def test_an_outage_that_begins_mid_batch_returns_the_part_read_then_the_rest(
    pg_store: EventStore, relay: CuttingRelay, relayed_store: PostgresEventStore, logs: Logs
) -> None:
    """A subscription batch larger than the store's read batch (1,024): the database goes
    away between the store's two fetches of one read. The part read is returned, the
    position follows it, and the rest comes once the store is back: no gap, no repeat."""
    pg_store.append("session:big", [_msg(f"m{i}") for i in range(1500)])
    cutting = CutWhileReading(relayed_store, relay)
    feed = Subscription(cutting, 1, batch=4096)
    cutting.armed = True
    first = [r.position for r in feed.poll(BACK)]
    assert first == list(range(1, 1025))  # the first fetch, then the cut
    assert feed.position == 1025
    assert len(_named(logs, "subscription.store_unreachable")) == 1
    relay.restore()
    pg_store.append("session:big", [_msg("after")])
    rest: list[int] = []
    until(lambda: _gather(feed, rest, 477), BACK, what="the rest after the outage")
    assert first + rest == list(range(1, 1502))


# Was: DEFECT: a store back with no new event goes unnoticed, so a second outage is not logged
def test_a_feed_logs_each_of_two_outages_and_each_return(
    pg_store: EventStore, relay: CuttingRelay, relayed_store: PostgresEventStore, logs: Logs
) -> None:
    """docs/scaling.md: while the database cannot be reached a subscription "logs
    ``subscription.store_unreachable`` once" and ``subscription.store_reachable`` once it
    is back (the code: "once per outage"). A quiet log (``tail --follow`` at night), two
    failovers a little apart: the feed looks at the store between them (its looks reach
    it), yet only the first outage is logged, and its end only when the next event comes,
    after the second outage. The state is cleared only by a read that returned, and an
    iterating feed reads only when ``wait_for`` says something arrived."""
    _append(pg_store, "session:a", 2, "before")
    counting = CountingWaits(relayed_store)
    feed = Feed(Subscription(counting, 3))
    try:
        for outage in (1, 2):
            _cut(relay)
            failed = counting.unreachable
            until(
                lambda failed=failed: counting.unreachable > failed,  # type: ignore[misc]
                BACK,
                what=f"outage {outage} seen",
            )
            relay.restore()
            _back(relayed_store)
            looked = counting.reached
            until(
                lambda looked=looked: counting.reached >= looked + 2,  # type: ignore[misc]
                BACK,
                what="the feed reaching it",
            )
        _append(pg_store, "session:a", 1, "after")
        until(lambda: feed.positions == [3], BACK, what="the event after both outages")
    finally:
        feed.stop()
    assert feed.error is None
    assert _outage_logs(logs) == [
        "subscription.store_unreachable",
        "subscription.store_reachable",
        "subscription.store_unreachable",
        "subscription.store_reachable",
    ], "one log line when each outage began and one when it ended"


# Was: DEFECT: poll(timeout) during an outage blocks for several connect timeouts, not `timeout`
def test_a_poll_during_an_outage_returns_within_its_timeout(
    pg_store: EventStore, relay: CuttingRelay, relayed_store: PostgresEventStore
) -> None:
    """``Subscription.poll``: "The next events, waiting up to ``timeout`` seconds". During
    an outage each look at the store waits for a pooled connection for the store's whole
    ``connect_timeout`` (1 s here, 10 s by default and in the CLI), and poll counts only its
    own 0.25 s slices, not the time spent in the store: ``poll(0.3)`` takes three connect
    timeouts (3 s here, 30 s with the default)."""
    _append(pg_store, "session:a", 1, "x")
    feed = relayed_store.subscribe(1)
    assert len(feed.poll(BACK)) == 1
    _cut(relay)
    started = time.monotonic()
    assert feed.poll(0.3) == []
    took = time.monotonic() - started
    assert took < 1.5, f"poll(0.3) took {took:.1f} s while the store was unreachable"


# Was: DEFECT: close() leaves an iteration blocked in the store for up to its connect_timeout
def test_close_ends_an_iteration_waiting_out_an_outage_within_a_fraction_of_a_second(
    pg_server: PostgresServer, pg_url: str, pg_store: EventStore, relay: CuttingRelay, logs: Logs
) -> None:
    """``Subscription.close``: "an iteration in another thread ends within a fraction of a
    second". While the feed waits out an outage, nearly all its time is spent inside the
    store waiting for a pooled connection (``connect_timeout``, 10 s by default; 2 s
    here), where close() cannot reach it: a host's shutdown waits that long."""
    _append(pg_store, "session:a", 1, "x")
    with _relayed(pg_server, pg_url, relay, connect_timeout=2.0) as relayed:
        counting = CountingWaits(relayed)
        feed = Feed(Subscription(counting, 1))
        try:
            until(lambda: feed.positions == [1], BACK, what="the first event")
            _cut(relay)
            until(lambda: counting.unreachable, BACK, what="the outage seen")
            looks = counting.started
            # after a slice's wait (0.25 s) the feed looks at the store again: close then
            until(lambda: counting.started > looks, BACK, what="the feed's next look")
            feed.subscription.close()
            started = time.monotonic()
            feed.thread.join(1.0)
            ended_in = time.monotonic() - started
            assert not feed.thread.is_alive(), f"still iterating {ended_in:.1f} s after close()"
        finally:
            feed.stop()
            relay.restore()
    assert feed.error is None


@pytest.mark.parametrize("breakage", ["drop_schema", "revoke_select", "corrupt_record"])
def test_a_store_that_answers_with_an_error_is_not_waited_out(
    pg_server: PostgresServer, pg_url: str, breakage: str, logs: Logs
) -> None:
    """Errors that are no outage reach the subscriber at once, whether the feed is reading
    or waiting: a dropped schema, a revoked privilege (the server answers: it is there), a
    corrupt record (after the good ones). None of them is a StoreUnavailableError."""
    schema = schema_of(pg_url)
    role = f"reader_{os.getpid()}_{next(_roles)}"
    with psycopg.connect(pg_server.url("stalwart_test"), autocommit=True) as admin:
        with store_module.open(pg_url) as writer:  # type: ignore[attr-defined]
            _append(writer, "session:a", 3, "x")
        admin.execute(f"CREATE ROLE {role} LOGIN PASSWORD 'pw'".encode())
        admin.execute(f"GRANT USAGE ON SCHEMA {schema} TO {role}".encode())
        admin.execute(f"GRANT SELECT ON ALL TABLES IN SCHEMA {schema} TO {role}".encode())
        url = f"postgresql://{role}:pw@{pg_server.host}:{pg_server.port}/stalwart_test"
        try:
            with PostgresEventStore(
                f"{url}?schema={schema}", read_only=True, connect_timeout=2.0
            ) as reader:
                feed = reader.subscribe(1)
                if breakage == "corrupt_record":
                    admin.execute(
                        f"UPDATE {schema}.events SET data = %s WHERE position = 2".encode(),
                        (b"\xc1",),
                    )
                else:
                    assert [r.position for r in feed.poll(BACK)] == [1, 2, 3]
                    if breakage == "drop_schema":
                        admin.execute(f"DROP SCHEMA {schema} CASCADE".encode())
                    else:
                        admin.execute(
                            f"REVOKE SELECT ON ALL TABLES IN SCHEMA {schema} FROM {role}".encode()
                        )
                started = time.monotonic()
                got: list[int] = []
                caught = _error_of(lambda: _gather(feed, got, 3, wait=5.0))
                took = time.monotonic() - started
        finally:
            admin.execute(f"DROP OWNED BY {role}".encode())
            admin.execute(f"DROP ROLE {role}".encode())
    assert isinstance(caught, StoreError), repr(caught)
    assert not isinstance(caught, StoreUnavailableError), repr(caught)
    assert took < 5.0
    assert _named(logs, "subscription.store_unreachable") == []
    if breakage == "corrupt_record":
        assert isinstance(caught, CorruptRecordError)
        assert got == [1]


# Was: DEFECT: a role the server no longer lets log in is "unreachable" and waited out for ever
def test_a_role_refused_at_login_is_not_waited_out(
    pg_server: PostgresServer, pg_url: str, logs: Logs
) -> None:
    """A permission error surfaces (a revoked SELECT does, above). A role that may no
    longer log in (``ALTER ROLE ... NOLOGIN``; a changed password is the same) is
    another: the server is up and answers every connection with
    ``invalid_authorization_specification``. The pool's wait for a connection ends in
    PoolTimeout, which the store maps to NotSentError, a StoreUnavailableError, so the
    subscription waits it out: it logs once ("is the server up?") and then returns
    nothing, raising nothing, for ever (``tail --follow`` prints nothing and never
    ends)."""
    schema = schema_of(pg_url)
    role = f"reader_{os.getpid()}_{next(_roles)}"
    with psycopg.connect(pg_server.url("stalwart_test"), autocommit=True) as admin:
        with store_module.open(pg_url) as writer:  # type: ignore[attr-defined]
            _append(writer, "session:a", 2, "x")
        admin.execute(f"CREATE ROLE {role} LOGIN PASSWORD 'pw'".encode())
        admin.execute(f"GRANT USAGE ON SCHEMA {schema} TO {role}".encode())
        admin.execute(f"GRANT SELECT ON ALL TABLES IN SCHEMA {schema} TO {role}".encode())
        url = f"postgresql://{role}:pw@{pg_server.host}:{pg_server.port}/stalwart_test"
        try:
            with PostgresEventStore(
                f"{url}?schema={schema}", read_only=True, connect_timeout=1.0
            ) as reader:
                feed = reader.subscribe(1)
                assert [r.position for r in feed.poll(BACK)] == [1, 2]
                admin.execute(f"ALTER ROLE {role} NOLOGIN".encode())
                admin.execute(
                    "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE usename = %s",
                    (role,),
                )

                started = time.monotonic()
                # real-time: ten polls, so that a loaded machine's slow connection attempts
                # still meet the refusal (one is enough on a quiet one)
                error = _error_of(lambda: feed.poll(0.5), times=10)
                took = time.monotonic() - started
        finally:
            with contextlib.suppress(psycopg.Error):
                admin.execute(f"DROP OWNED BY {role}".encode())
                admin.execute(f"DROP ROLE {role}".encode())
    assert error is not None, (
        f"ten polls ({took:.1f} s) raised nothing for a role the server refuses at login; "
        f"logged: {[e.get('error') for e in _named(logs, 'subscription.store_unreachable')]}"
    )
    assert not isinstance(error, StoreUnavailableError), repr(error)


def test_an_append_whose_fate_is_unknown_is_not_reported_as_not_sent(
    pg_server: PostgresServer, pg_url: str, pg_store: EventStore, relay: CuttingRelay
) -> None:
    """``NotSentError`` (a StoreUnavailableError: safe to send again) only when nothing
    was sent. The relay cuts every connection right after the server committed an
    append and refuses new ones: the append cannot tell, and says so with
    AppendInDoubtError, which is no StoreUnavailableError (sending it again could write
    it twice); it is in the log once. Then, with no connection to be had at all, an
    append is NotSentError and nothing of it is written; sent again once the store is
    back, it is written once. (One pooled connection: no other one, opening as the relay
    cuts, lets the store find out what its append did.)"""
    stream = "session:committed-marker"  # a text parameter of the append: on the wire
    with _relayed(pg_server, pg_url, relay, pool_size=1, connect_timeout=1.0) as relayed:
        _append(relayed, stream, 1, "warm")
        relay.arm(stream.encode())
        with pytest.raises(StoreError) as unsure:
            relayed.append(stream, [_msg("unsure")], expected_version=1)
        assert relay.cut.is_set()
        assert isinstance(unsure.value, AppendInDoubtError), repr(unsure.value)
        assert not isinstance(unsure.value, StoreUnavailableError)
        assert [r.version for r in pg_store.read_stream(stream)] == [1, 2]  # it was written
        with pytest.raises(NotSentError):
            relayed.append(stream, [_msg("not-sent")], expected_version=2)
        assert pg_store.stream_version(stream) == 2
        relay.restore()
        _back(relayed)
        relayed.append(stream, [_msg("not-sent")], expected_version=2)
    assert [r.version for r in pg_store.read_stream(stream)] == [1, 2, 3]


def test_an_lmdb_subscription_is_unaffected(lmdb_store: EventStore, logs: Logs) -> None:
    """LMDB never raises StoreUnavailableError: its feed returns every event once, a
    poll with nothing new returns after about its timeout, close() ends an iteration at
    once, and nothing about reachability is logged."""
    _append(lmdb_store, "session:a", 3, "x")
    polled = lmdb_store.subscribe(2)
    assert [r.position for r in polled.poll(5.0)] == [2, 3]
    started = time.monotonic()
    assert polled.poll(0.3) == []
    assert 0.25 <= time.monotonic() - started < 3.0
    feed = Feed(lmdb_store.subscribe(1))
    try:
        _append(lmdb_store, "session:b", 4, "y")
        until(lambda: feed.positions == list(range(1, 8)), 10.0, what="7 events")
    finally:
        feed.subscription.close()
        feed.thread.join(2.0)
    assert not feed.thread.is_alive()
    assert feed.error is None
    assert _outage_logs(logs) == []


# -- tail --follow --json: a real subprocess through the relay --------------------------------


class Follower(CollectedProcess):
    """A ``stalwart`` subprocess whose stdout and stderr lines are collected by threads."""

    def __init__(self, *args: str) -> None:
        super().__init__([sys.executable, "-m", "stalwart", *args], wait=45.0)

    def logged(self, name: str) -> bool:
        return any(name in line for line in list(self.err))

    def stop(self, within: float | None = 30) -> int:
        return super().stop(within)


def test_tail_follow_json_waits_out_an_outage_longer_than_its_connect_timeout(
    pg_server: PostgresServer, pg_url: str, pg_store: EventStore, relay: CuttingRelay
) -> None:
    """``tail --follow --json`` (a subprocess, the CLI's own 10 s connect timeout) through a
    relay that stays down until the follower has logged ``subscription.store_unreachable``
    (it met the error that used to end it with exit 1): it keeps following, prints every
    event once in order, logs ``subscription.store_reachable``, exits 0 on Ctrl-C, and no
    traceback anywhere."""
    _append(pg_store, "session:a", 3, "before")
    url = pg_server.url("stalwart_test").replace(f":{pg_server.port}/", f":{relay.port}/")
    follower = Follower(
        "--store",
        f"{url}?schema={schema_of(pg_url)}",
        "--log-level",
        "info",
        "tail",
        "-f",
        "--json",
    )
    try:
        follower.wait(lambda: len(follower.out) >= 3, "the first 3 events")
        _cut(relay)
        _append(pg_store, "session:a", 4, "during")
        follower.wait(lambda: follower.logged("subscription.store_unreachable"), "the outage log")
        relay.restore()
        _append(pg_store, "session:b", 5, "after")
        follower.wait(lambda: len(follower.out) >= 12, "all 12 events")
        follower.wait(lambda: follower.logged("subscription.store_reachable"), "the return log")
        code = follower.stop()
    finally:
        relay.restore()
        follower.stop()
    assert [json.loads(line)["position"] for line in follower.out] == list(range(1, 13))
    err = "".join(follower.err)
    assert code == 0, err
    assert "Traceback" not in err, err
    unreachable = [
        json.loads(line) for line in follower.err if "subscription.store_unreachable" in line
    ]
    assert len(unreachable) == 1
    assert unreachable[0]["position"] == 4


# == Change 2: the tenant ledger folds linearly and starts from a snapshot ====================

T0 = 1_800_000_000.0
TENANT = "acme"


def _decider(per_hour: int, projected: int = 100) -> Callable[[GovernorState, float], Any]:
    def decide(state: GovernorState, now: float) -> SummarizerVerdict:
        return decide_summarizer(
            state,
            now,
            projected=projected,
            per_hour=per_hour,
            per_day=0,
            failure_threshold=3,
            reset_timeout_ms=60_000,
        )

    return decide


def _pure(store: EventStore, stream: str) -> GovernorState:
    """The ledger's governor by the pure fold, event by event from the first."""
    state = SUMMARIZER_LEDGER.initial(stream)
    for record in store.read_stream(stream):
        state = SUMMARIZER_LEDGER.apply(state, record)
    return state


def _call(ledger: StoreLedger, clock: FakeClock, tokens: int, *, failed: bool = False) -> None:
    """One summarizer call through ``ledger``: admitted, then released."""
    verdict, reserved = ledger.admit(TENANT, "s", 100, _decider(10**9))
    assert verdict.allowed
    assert reserved is not None
    clock.advance(1.0)
    ledger.release(
        ContextSummarizerReleased(
            call_id=reserved.call_id,
            tenant=TENANT,
            input_tokens=tokens,
            output_tokens=1,
            error_class="Timeout" if failed else None,
        )
    )


def test_a_fold_from_the_snapshot_equals_the_whole_fold_across_writers_days_and_clocks(
    tmp_path: Path, clock: FakeClock
) -> None:
    """A worker's first fold saves the ledger's snapshot; then another worker calls on,
    one whose clock lags 5,000 s calls too (its events go back in time), a third writer
    appends reservations of its own, and the day rolls over. A new worker folds from the
    snapshot (it reads only what came after) to exactly what the pure fold of the whole
    ledger gives, as do the workers that folded all along, and all decide the same."""
    clock.set(T0)
    with store_module.open(tmp_path / "store", clock=clock, snapshot_every=40) as log:  # type: ignore[attr-defined]
        stream = ledger_stream(TENANT)
        name = snapshot_name(TENANT_LEDGER)
        first = StoreLedger(log, clock, lease_ms=600_000)
        for n in range(30):
            _call(first, clock, 10 + n, failed=n % 7 == 3)
            clock.advance(60.0)
        second = StoreLedger(log, clock, lease_ms=600_000)
        second.governor(TENANT)  # its first fold: 61 events, a snapshot
        [saved] = list(log.snapshots(stream, name))
        assert saved.version == log.stream_version(stream) == 61
        for _ in range(10):  # the first worker calls on
            _call(first, clock, 5)
            clock.advance(600.0)
        behind = FakeClock(start=clock.now() - 5_000.0)  # a worker whose clock lags
        _call(StoreLedger(log, behind, lease_ms=600_000), behind, 7)
        other = [  # a third writer (another process), one of them never released
            NewEvent(
                event=ContextSummarizerReserved(
                    call_id=f"x{n}", tenant=TENANT, tokens=50, lease_ms=3_600_000
                ),
                ts=clock.now() + n,
            )
            for n in range(3)
        ]
        log.append(stream, other)
        log.append(
            stream,
            [
                NewEvent(
                    event=ContextSummarizerReleased(call_id=f"x{n}", tenant=TENANT, input_tokens=9),
                    ts=clock.now() + 10 + n,
                )
                for n in range(2)
            ],
        )
        clock.advance(DAY_S - 1_000.0)  # the day rolls over past the snapshot's entries
        _call(second, clock, 3)
        clock.advance(2_000.0)
        _call(first, clock, 4)
        counting = CountingStore(log)
        third = StoreLedger(counting, clock, lease_ms=600_000)
        governor = third.governor(TENANT)
        after = log.stream_version(stream) - saved.version
        assert counting.records[stream] <= after  # from the snapshot on, not the whole ledger
        whole = _pure(log, stream)
        assert governor == whole
        assert first.governor(TENANT) == second.governor(TENANT) == whole
        now = clock.now()
        for cap in (0, 200, 10**6):
            decide = _decider(cap)
            assert decide(governor, now) == decide(whole, now)
        released = sum(
            isinstance(r.event, ContextSummarizerReleased) for r in log.read_stream(stream)
        )
        assert 0 < len(whole.spend) < released  # the rollover dropped the older day's entries


@pytest.mark.parametrize("damage", ["garbage", "wrong_shape"])
def test_an_unreadable_ledger_snapshot_falls_back_to_an_older_one_or_the_whole_fold(
    tmp_path: Path, clock: FakeClock, damage: str, logs: Logs
) -> None:
    """A ledger snapshot that does not decode (its checksum matches: it was saved so) is
    passed over with ``state.snapshot_unusable``: the worker folds from an older snapshot,
    or from the first event, to the pure fold's governor and version, and its admission
    lands right after the ledger's last event."""
    clock.set(T0)
    with store_module.open(tmp_path / "store", clock=clock, snapshot_every=0) as log:  # type: ignore[attr-defined]
        stream = ledger_stream(TENANT)
        writer = StoreLedger(log, clock, lease_ms=600_000)
        for n in range(12):
            _call(writer, clock, 20 + n, failed=n == 5)
            if n == 4 and damage == "garbage":  # an older snapshot that reads
                load_state(log, stream, TENANT_LEDGER, snapshot_every=1)
        version = log.stream_version(stream)
        data = b"\xc1\x00garbage" if damage == "garbage" else msgspec.msgpack.encode({"x": 1})
        log.put_snapshot(
            Snapshot(
                stream=stream,
                name=snapshot_name(TENANT_LEDGER),
                version=version,
                position=log.head(),
                data=data,
            )
        )
        counting = CountingStore(log)
        fresh = StoreLedger(counting, clock, lease_ms=600_000)
        assert fresh.governor(TENANT) == _pure(log, stream)
        # from the older snapshot (version 11) on, or the whole ledger when there is none
        assert counting.records[stream] == (version - 11 if damage == "garbage" else version)
        assert _named(logs, "state.snapshot_unusable")
        verdict, reserved = fresh.admit(TENANT, "s", 100, _decider(10**9))
        assert verdict.allowed
        assert reserved is not None
        assert log.stream_version(stream) == version + 1


@pytest.fixture(params=["lmdb", "postgres"])
def two_handles(
    request: pytest.FixtureRequest, tmp_path: Path, clock: FakeClock
) -> Iterator[tuple[EventStore, EventStore]]:
    """Two handles on one store, as two workers have (LMDB: one handle per process, so
    here the same one twice; PostgreSQL: two pools)."""
    if request.param == "lmdb":
        with store_module.open(tmp_path / "store", clock=clock) as log:  # type: ignore[attr-defined]
            yield log, log
        return
    pg_url = request.getfixturevalue("pg_url")
    with (
        store_module.open(pg_url, clock=clock) as one,  # type: ignore[attr-defined]
        store_module.open(pg_url, clock=clock) as two,  # type: ignore[attr-defined]
    ):
        yield one, two


def test_workers_racing_for_a_tenant_never_admit_past_its_budget(
    two_handles: tuple[EventStore, EventStore], clock: FakeClock
) -> None:
    """Two StoreLedgers (two workers) on one store, three lanes each, admit for one tenant
    until refused, while two lanes admit for another tenant. Each admission expects the
    version its own fold reached; a conflict is folded and decided again, never raised.
    Exactly the budget is reserved per tenant (hour cap 20 calls' worth, no release),
    every lane ends, and the ledgers fold to what the pure fold gives."""
    clock.set(T0)
    handles = two_handles
    ledgers = [StoreLedger(handle, clock, lease_ms=600_000) for handle in handles]
    decide = _decider(per_hour=2_000, projected=100)
    errors: list[BaseException] = []
    admitted: dict[str, int] = {"a": 0, "b": 0}
    count = threading.Lock()

    def lane(ledger: StoreLedger, tenant: str) -> None:
        try:
            for _ in range(200):
                verdict, reserved = ledger.admit(tenant, "s", 100, decide)
                if not verdict.allowed:
                    return
                assert reserved is not None
                with count:
                    admitted[tenant] += 1
        except BaseException as exc:  # collected: a lane must not die of a conflict
            errors.append(exc)

    lanes = [threading.Thread(target=lane, args=(ledger, "a")) for ledger in ledgers for _ in "xyz"]
    lanes += [threading.Thread(target=lane, args=(ledgers[n], "b")) for n in (0, 1)]
    for thread in lanes:
        thread.start()
    for thread in lanes:
        thread.join(60)
    assert not any(thread.is_alive() for thread in lanes), "a lane never ended"
    assert errors == [], [repr(e) for e in errors[:3]]
    assert not any(isinstance(e, ConcurrencyError) for e in errors)
    for tenant in ("a", "b"):
        records = list(handles[0].read_stream(ledger_stream(tenant)))
        reserved = [r for r in records if isinstance(r.event, ContextSummarizerReserved)]
        assert len(reserved) == admitted[tenant] == 20
        assert [r.version for r in records] == list(range(1, len(records) + 1))
        whole = _pure(handles[0], ledger_stream(tenant))
        for ledger in ledgers:
            assert ledger.governor(tenant) == whole


def test_a_memory_ledger_admits_exactly_the_budget_across_lanes(clock: FakeClock) -> None:
    """MemoryLedger keeps a GovernorFolder per tenant: lanes of three tenants admitting at
    once each get exactly their budget (hour cap 20 calls' worth), and each tenant's
    governor holds exactly its own calls."""
    ledger = MemoryLedger(clock, lease_ms=600_000)
    decide = _decider(per_hour=2_000, projected=100)
    admitted: dict[str, list[str]] = {"a": [], "b": [], "c": []}

    def lane(tenant: str) -> None:
        for _ in range(100):
            verdict, reserved = ledger.admit(tenant, "s", 100, decide)
            if reserved is None:
                assert verdict.reason == "spend_cap"
                return
            admitted[tenant].append(reserved.call_id)

    lanes = [threading.Thread(target=lane, args=(t,)) for t in "abc" for _ in range(4)]
    for thread in lanes:
        thread.start()
    for thread in lanes:
        thread.join(30)
    assert not any(thread.is_alive() for thread in lanes)
    for tenant, calls in admitted.items():
        assert len(calls) == 20
        assert sorted(c.call_id for c in ledger.governor(tenant).calls) == sorted(calls)


def test_a_slow_first_fold_of_one_tenant_does_not_hold_up_another(
    tmp_path: Path, clock: FakeClock
) -> None:
    """Per-tenant folding locks: while one lane's first fold of tenant A is held up in
    the store (a long ledger), a lane of the same worker admits for tenant B, and then A's
    admission completes too: no cross-tenant wait, no deadlock."""
    clock.set(T0)
    gate = threading.Event()
    entered = threading.Event()
    held = ledger_stream("slow")

    class Slow(CountingStore):
        def read_stream(self, stream: str, *args: Any, **kwargs: Any) -> Iterator[Any]:
            if stream == held and not gate.is_set():
                entered.set()
                gate.wait(30)
            return super().read_stream(stream, *args, **kwargs)

    with store_module.open(tmp_path / "store", clock=clock) as log:  # type: ignore[attr-defined]
        ledger = StoreLedger(Slow(log), clock, lease_ms=600_000)
        done: list[SummarizerVerdict] = []
        slow = threading.Thread(
            target=lambda: done.append(ledger.admit("slow", "s", 100, _decider(10**9))[0])
        )
        slow.start()
        try:
            until(entered.is_set, 10.0, what="the slow tenant's fold under way")
            other: list[SummarizerVerdict] = []
            quick = threading.Thread(
                target=lambda: other.append(ledger.admit("quick", "s", 100, _decider(10**9))[0])
            )
            quick.start()
            quick.join(10.0)
            assert other, "tenant B waited on tenant A's fold"
            assert other[0].allowed
            assert not done
        finally:
            gate.set()
            slow.join(10.0)
        assert done
        assert done[0].allowed
        assert log.stream_version(held) == 2


# Was: DEFECT: an outage in the middle of a ledger fold makes the next fold count part of it twice
def test_a_ledger_fold_cut_off_by_an_outage_counts_every_call_once(
    pg_store: EventStore, relay: CuttingRelay, relayed_store: PostgresEventStore, clock: FakeClock
) -> None:
    """``StoreLedger._fold`` adds the records it reads to the tenant's cached folder as
    they come, and records the version folded only after the read ended. When the read
    fails between two batches (the database went away: StoreUnavailableError), the
    folder holds a thousand records its version does not: the next fold reads them again.
    The ledger's opening resets the day's spend, releases already counted are skipped as
    written twice, so the spend before the cut is lost: the tenant is admitted far past
    its hour cap. (Reservations with a long lease would instead stay in flight for ever
    after their release was skipped, refusing the tenant.)"""
    clock.set(T0)
    stream = ledger_stream(TENANT)
    cutting = CutWhileReading(relayed_store, relay)
    ledger = StoreLedger(cutting, clock, lease_ms=1_000)
    decide = _decider(per_hour=10_000, projected=1_000)
    verdict, reserved = ledger.admit(TENANT, "s", 1_000, decide)  # opens the ledger
    assert reserved is not None
    ledger.release(ContextSummarizerReleased(call_id=reserved.call_id, tenant=TENANT))
    calls = []  # another worker: 550 calls of 15 tokens within the hour
    for n in range(550):
        ts = T0 + 10 + 2 * n
        calls.append(
            NewEvent(
                event=ContextSummarizerReserved(
                    call_id=f"w{n}", tenant=TENANT, tokens=1_000, lease_ms=1_000
                ),
                ts=ts,
            )
        )
        calls.append(
            NewEvent(
                event=ContextSummarizerReleased(
                    call_id=f"w{n}", tenant=TENANT, input_tokens=14, output_tokens=1
                ),
                ts=ts + 1,
            )
        )
    pg_store.append(stream, calls)
    clock.set(T0 + 1_200)
    cutting.armed = True  # the database goes away in the middle of the next fold
    with pytest.raises(StoreUnavailableError):
        ledger.admit(TENANT, "s", 1_000, decide)
    relay.restore()
    _back(relayed_store)
    whole = _pure(pg_store, stream)
    assert window_spend(whole, clock.now(), HOUR_S) == 550 * 15
    admitted = 0
    for _ in range(20):
        verdict, _reserved = ledger.admit(TENANT, "s", 1_000, decide)
        if not verdict.allowed:
            break
        admitted += 1
    folded = window_spend(ledger.governor(TENANT), clock.now(), HOUR_S)
    assert admitted == 1, (
        f"{admitted} calls of 1,000 tokens admitted with 8,250 of the hour's 10,000 spent "
        f"(the worker's fold counts {folded} spent)"
    )
