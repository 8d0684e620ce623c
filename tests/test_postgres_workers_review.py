"""Review of durable activations on PostgreSQL with several workers (the store's work
queue and leases, the activation worker). Each test failed on the code before its fix
for the reason its docstring gives ("Defect"); "Expected" is what it checks now.

A real PostgreSQL (``pg_server``), real sockets (a TCP relay in front of the server
where a connection must break), the loopback fake provider, the fake clock; several
workers are several runtimes on the one database, each with its own store handle, as
separate processes would have. No mocks of stalwart's parts."""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, MutableMapping
from typing import Any

import psycopg
import pykka
import pytest
import structlog.testing

from stalwart import store as store_module
from stalwart.actors import ABANDONED_TEXT
from stalwart.channels import MemoryChannel
from stalwart.clock import FakeClock
from stalwart.events import (
    ActivationAbandoned,
    ActivationAcked,
    ActivationLeased,
    ActivationReleased,
    ActivationRequeued,
    AnnouncementQueued,
    LeaseExpired,
    LeaseRenewed,
    RecordedEvent,
    SupervisorRestarted,
)
from stalwart.runtime import Runtime, send_message
from stalwart.state import ACTIVATIONS, fold
from stalwart.store import EventStore, PostgresEventStore
from stalwart.testing import FakeProvider, Hang, PostgresServer
from tests._relay import CuttingRelay, reachable, schema_of
from tests._runtime_support import GUARD, has, log_until, of, runtime_config


def _sql(server: PostgresServer, statement: str, params: tuple[object, ...] = ()) -> None:
    with psycopg.connect(server.url("stalwart_test"), autocommit=True) as admin:
        admin.execute(statement.encode(), params)


def _corrupt(server: PostgresServer, pg_url: str, stream: str, version: int) -> None:
    """Make one stored record undecodable (bit rot, a bad manual edit)."""
    _sql(
        server,
        f"UPDATE {schema_of(pg_url)}.events SET data = %s WHERE stream = %s AND version = %s",
        (b"\xc1", stream, version),
    )


def _wait(check: Callable[[], Any], what: str, guard: float = GUARD) -> Any:
    """``check()`` once it gives something true (polled every 20 ms, real time, until
    ``guard`` seconds)."""
    give_up = time.monotonic() + guard
    while not (found := check()):
        assert time.monotonic() < give_up, what
        time.sleep(0.02)  # real-time: the outcome is handled on other threads
    return found


def _stream_until(
    store: EventStore,
    stream: str,
    until: Callable[[list[RecordedEvent]], bool],
    *,
    first: int = 1,
    guard: float = GUARD,
) -> list[RecordedEvent]:
    """The stream's records from version ``first`` once ``until`` holds (woken by
    appends), or AssertionError after ``guard`` seconds."""
    give_up = time.monotonic() + guard
    while True:
        head = store.head()
        records = list(store.read_stream(stream, first))
        if until(records):
            return records
        left = give_up - time.monotonic()
        if left <= 0:
            raise AssertionError(f"{stream} never got there: {[r.type for r in records]}")
        store.wait_for(head + 1, left)


def _logged(captured: list[MutableMapping[str, Any]], event: str, **fields: Any) -> int:
    return sum(
        1
        for entry in list(captured)
        if entry.get("event") == event and all(entry.get(k) == v for k, v in fields.items())
    )


# -- a session that cannot be folded ------------------------------------------------------------


@pytest.mark.timeout(90)
def test_a_session_the_worker_cannot_fold_does_not_starve_every_other_session(
    pg_server: PostgresServer,
    pg_url: str,
    pg_store: EventStore,
    clock: FakeClock,
    fake: FakeProvider,
    chat: MemoryChannel,
) -> None:
    """Defect (store/_postgres_due.py:claim_due with actors/_worker.py:_poll_queue): a
    claimed session whose fold fails (here one corrupt record: CorruptRecordError) is
    only logged (``worker.claim_unsettled``); its due row keeps its early due time and
    the claim statement hands a worker the rows it holds itself (``held_by = owner``), so
    the same worker claims the same broken row first again at every poll. Once that
    fills a claim ("a full claim polls again at once", here ``claim_batch`` = 1; with the
    default 8, eight such sessions) the worker spins on it without pause, hammering the
    database, and never claims another session: every other session of the store waits
    for ever. Expected: a session that cannot be settled is put off (its row pushed back
    with a backoff, or passed over by its worker's next claims) and every other due
    session is still served ("each poll hands a worker its own sessions",
    docs/scaling.md)."""
    send_message(pg_store, "broken", "hello", channel="chat", ts=clock.now() - 60)
    send_message(pg_store, "fine", "hello", channel="chat", ts=clock.now())
    _corrupt(pg_server, pg_url, "session:broken", 2)  # its activation:ready
    settings = runtime_config(fake.base_url, activations={"claim_batch": 1})
    with (
        structlog.testing.capture_logs() as captured,
        Runtime(settings, store=pg_store, clock=clock, channels={"chat": chat}),
    ):
        try:
            _stream_until(pg_store, "session:fine", has(ActivationAcked), guard=4.0)
        except AssertionError:
            spins = _logged(captured, "worker.claim_unsettled", stream="session:broken")
            raise AssertionError(
                f"session:fine was never run; in 4 s (no clock advance: one poll) the worker "
                f"claimed the broken session {spins} times"
            ) from None


@pytest.mark.timeout(90)
def test_a_put_off_sessions_backoff_starts_over_once_it_has_new_work(
    pg_server: PostgresServer,
    pg_url: str,
    pg_store: EventStore,
    clock: FakeClock,
    fake: FakeProvider,
    chat: MemoryChannel,
) -> None:
    """The put-off backoff doubles while the same claim keeps failing; a claim at a newer
    version (new work was appended: the session changed) starts it over, instead of
    carrying a count the worker kept from the old failures (up to 5 min)."""
    send_message(pg_store, "broken", "hello", channel="chat", ts=clock.now())
    _corrupt(pg_server, pg_url, "session:broken", 2)  # its activation:ready
    settings = runtime_config(fake.base_url, activations={"poll_ms": 1_000})

    def delays(captured: list[MutableMapping[str, Any]]) -> list[float]:
        return [
            entry["seconds"]
            for entry in list(captured)
            if entry.get("event") == "worker.claim_put_off"
        ]

    with (
        structlog.testing.capture_logs() as captured,
        Runtime(settings, store=pg_store, clock=clock, channels={"chat": chat}),
    ):
        _wait(lambda: delays(captured), "the broken session was never put off")
        clock.advance(1.0)
        _wait(lambda: len(delays(captured)) >= 2, "it was not put off again")
        send_message(pg_store, "broken", "are you there?", channel="chat", ts=clock.now())
        clock.advance(2.0)  # new work: due at once, and still unreadable
        _wait(lambda: len(delays(captured)) >= 3, "the new work was never claimed")
    assert delays(captured)[:3] == [1.0, 2.0, 1.0]


# -- a wake no Agent could be started for ------------------------------------------------------


@pytest.mark.timeout(90)
def test_a_store_error_while_handing_a_wake_over_does_not_hold_its_lease_for_ever(
    pg_server: PostgresServer, pg_url: str, clock: FakeClock, fake: FakeProvider
) -> None:
    """Defect (actors/_worker.py:_start, the error caught by _poll_queue): the worker
    appends the lease, marks the stream running and arms its renewal *before* it hands
    the wake to an Agent (``wake(...)``). Starting the session's Agent reads and appends
    to the store (``agent_for_wake``: ``load_session``, ``_address``,
    ``_record_created``); a StoreError there (here a corrupt old record the worker's
    incremental fold no longer reads; a read or append that failed on a database blip
    does the same) escapes ``_start`` and is taken by ``_poll_queue`` for a claim "not
    settled". Nothing undoes the lease: the worker renews, for ever, a lease no Agent
    runs. No failure is counted, the activation is never retried nor abandoned, the user
    never hears back, and ``status`` shows a healthy renewed lease: the session is
    quietly stuck, what stalwart exists to prevent. Expected: a wake that could not be
    handed over is a failed wake ("A wake no Agent can take ... is a failed wake too:
    retried, then abandoned, never leased for ever", docs/sessions.md): requeued with
    backoff (or abandoned), its lease not renewed."""
    first = store_module.open(pg_url, clock=clock)
    second = store_module.open(pg_url, clock=clock)
    settings = runtime_config(fake.base_url)
    fake.add(Hang())
    try:
        worker_a = Runtime(
            settings, store=first, clock=clock, channels={"chat": MemoryChannel("chat")}
        ).start()
        try:
            # its first poll has ended and armed the next (an ask waits behind it): a
            # poll still running as the clock moves would arm the next after the move
            worker_a.worker(GUARD)
            send_message(first, "s1", "a long job", channel="chat", ts=clock.now())
            clock.advance(1.0)  # worker A's next poll (poll_ms) leases it; the call hangs
            fake.wait_for(lambda requests: len(requests) == 1, GUARD)
            # a second message, from outside any worker (a CLI): due now
            send_message(first, "s1", "and another", channel="chat", ts=clock.now())
            worker_b = Runtime(
                settings, store=second, clock=clock, channels={"chat": MemoryChannel("chat")}
            )
            with worker_b:
                # worker B claims s1 (due now), folds it and finds it leased by A
                _wait(lambda: worker_b.worker().sessions == 1, "worker B never folded s1")
                worker_a.close()  # a clean stop: A hands its lease back
                log_until(second, "session:s1", has(ActivationReleased))
                _corrupt(pg_server, pg_url, "session:s1", 1)  # an old record goes bad
                clock.advance(1.0)  # B's next poll leases the wake again
                _stream_until(second, "session:s1", has(ActivationLeased, 2), first=2)
                for _ in range(8):  # 120 s: four lease TTLs, renewals every 10 s
                    clock.advance(15.0)
                    time.sleep(0.05)  # real-time: let B's renewal land between steps
                records = list(second.read_stream("session:s1", 2))
                running = worker_b.worker().running
        finally:
            worker_a.close()
    finally:
        first.close()
        second.close()
    state = fold(ACTIVATIONS, "session:s1", records)
    renewed = [r.epoch for r in of(LeaseRenewed, records)]
    failed = of((ActivationRequeued, ActivationAbandoned), records)
    assert failed, (
        f"120 s after worker B leased it, the wake it could not hand over was never "
        f"counted as failed; its lease (epoch {state.epoch}) is renewed "
        f"(LeaseRenewed epochs {renewed}; B runs {running}) with no Agent running it: "
        f"live lease {state.lease}, last outcome {state.last_outcome}"
    )


# -- a lease append whose connection broke after its commit --------------------------------------


@pytest.mark.timeout(90)
def test_a_lease_whose_append_lost_its_connection_after_the_commit_is_not_left_to_expire(
    pg_store: EventStore,
    relay: CuttingRelay,
    relayed_store: PostgresEventStore,
    clock: FakeClock,
    fake: FakeProvider,
    chat: MemoryChannel,
) -> None:
    """Defect (actors/_worker.py:_try_lease, with _poll_queue): when the connection of the
    lease append breaks after the server committed it and the store cannot reach the
    server again at once, the append fails with the store's ``StoreError`` "it may or may
    not have been written" (docs/scaling.md). The worker treats it as not written: it
    logs ``worker.claim_unsettled`` and moves on, while the log holds its own live lease
    and the due row says "nothing to do before the lease's expiry". Once the database is
    back, no worker looks at the session until ``lease_ttl_ms`` has passed; then the
    wake that never ran is recorded as ``lease:expired``, a *failure* of the user's
    message (with ``max_attempts`` = 1, here, the message is abandoned and the user told
    it failed, though nothing ran). Expected: "a worker that loses its database
    connection mid-lease recovers": after an append that may or may not have been
    written the worker folds the session again and, finding its own lease, runs the
    wake (or hands the lease back), with no expiry counted."""
    settings = runtime_config(fake.base_url, activations={"max_attempts": 1})
    with Runtime(settings, store=relayed_store, clock=clock, channels={"chat": chat}) as rt:
        owner = _lease_cut_after_commit(rt, relay, pg_store, relayed_store, clock)
        leased = of(ActivationLeased, list(pg_store.read_stream("session:s1")))
        assert [lease.owner for lease in leased] == [owner]  # it was written
        answered = False
        for _ in range(20):  # 20 polls, 20 s: well inside the 30 s lease
            clock.advance(1.0)
            with contextlib.suppress(TimeoutError):
                fake.wait_for(lambda requests: len(requests) >= 1, 0.5)
                answered = True
                break
        if not answered:  # what the user gets instead: the lease's expiry
            clock.advance(11.0)
            log_until(pg_store, "session:s1", has(LeaseExpired))
        records = list(pg_store.read_stream("session:s1"))
    assert answered, (
        f"20 s after the database came back the worker had not run the wake it leased; "
        f"at the lease's expiry: {[r.type for r in records if r.type[:5] in ('activ', 'lease')]}"
    )
    assert of(LeaseExpired, records) == []


def _lease_cut_after_commit(
    rt: Runtime,
    relay: CuttingRelay,
    pg_store: EventStore,
    relayed_store: EventStore,
    clock: FakeClock,
) -> str:
    """Send ``s1`` a message; the worker's lease append commits, its answer is cut and the
    store cannot reconnect at once ("may or may not have been written"); then the
    database comes back. The worker's owner name."""
    rt.worker()  # started, and polled once
    relay.arm(b"activation:leased")
    send_message(pg_store, "s1", "hello", channel="chat", ts=clock.now())
    clock.advance(1.0)  # the worker's next poll leases it; the answer is cut
    assert relay.cut.wait(GUARD), "the lease append never went through the relay"
    # the worker handles one message at a time: its answer comes once the poll that sent
    # the lease append is over (the append failed: "may or may not")
    owner: str = rt.worker(timeout=GUARD).owner
    relay.restore()  # the database is reachable again
    _wait(lambda: reachable(relayed_store), "the worker's store never reconnected")
    return owner


def _worker_gone(rt: Runtime, owner: str) -> bool:
    """Whether the runtime's worker named ``owner`` is no more (dead, or replaced)."""
    try:
        return rt.worker().owner != owner
    except pykka.ActorDeadError:
        return True


# -- an Agent that crashed while the database was away -------------------------------------------


@pytest.mark.timeout(90)
def test_an_agent_crash_while_the_database_is_away_does_not_kill_the_worker_for_good(
    pg_store: EventStore,
    relay: CuttingRelay,
    relayed_store: PostgresEventStore,
    clock: FakeClock,
    fake: FakeProvider,
    chat: MemoryChannel,
) -> None:
    """Defect (actors/_worker.py:_failed): the WakeFailed of an Agent that died mid-wake
    is handled by folding the session first (``self._sync``) outside any ``try``: a
    StoreError there escapes ``on_receive`` and kills the worker actor. Every other path
    of the worker catches StoreError; this one is hit exactly when the database is away,
    since that is when Agents die (an Agent's append that fails with a StoreError crashes
    it; here one dies while the database is unreachable). The dead worker's renewal
    timers are cancelled, and its restart cannot even be decided: the restart decision
    reads and appends the ``runtime`` stream (``Restarts.crashed``), which fails in the
    same outage, so no worker is started again. After a 2 s outage (well within the
    30 s ``lease_ttl_ms``) the process looks alive but leases nothing ever again: the
    healthy session's lease is never renewed (its Agent's appends go on under a lease
    the log says expired), and a message sent after the outage is never run by this
    process. Expected: a store error while settling a failed wake is caught (and the
    settlement tried again later) like every other store error of the worker, so the
    other sessions' leases keep being renewed ("A lost connection loses nothing and
    doubles nothing", docs/scaling.md; a worker that loses its database connection
    mid-lease recovers)."""
    fake.add(Hang(), Hang())
    with Runtime(
        runtime_config(fake.base_url, prompt_timeout_ms=600_000),
        store=relayed_store,
        clock=clock,
        channels={"chat": chat},
    ) as rt:
        owner = rt.worker().owner
        send_message(pg_store, "healthy", "a long job", channel="chat", ts=clock.now())
        send_message(pg_store, "doomed", "another", channel="chat", ts=clock.now())
        clock.advance(1.0)  # the worker's next poll leases both; both calls hang
        fake.wait_for(lambda requests: len(requests) == 2, GUARD)
        assert set(rt.worker().running) == {"session:healthy", "session:doomed"}
        doomed = rt.session("doomed", channel="chat")
        agents = [t for t in threading.enumerate() if t.name.startswith("AgentActor-")]
        relay.cut_now()  # the database goes away
        doomed.ref.tell(object())  # ... and an Agent dies meanwhile
        # its thread ends once its on_failure has told the worker (WakeFailed); the
        # worker handles one message at a time, so an ask returns after that one
        _wait(lambda: any(not t.is_alive() for t in agents), "the Agent did not die")
        with contextlib.suppress(pykka.ActorDeadError, pykka.Timeout):
            rt.worker(timeout=GUARD)
        relay.restore()  # two seconds later it is back
        _wait(lambda: reachable(relayed_store), "the worker's store never reconnected")
        send_message(pg_store, "later", "a new message", channel="chat", ts=clock.now())
        for _ in range(8):  # 40 s: the healthy lease (30 s) must still be renewed
            clock.advance(5.0)
            time.sleep(0.05)  # real-time: let renewals and polls land between steps
        with contextlib.suppress(AssertionError):  # (the fixed worker renews it)
            _stream_until(pg_store, "session:healthy", has(LeaseRenewed), guard=3.0)
        records = list(pg_store.read_stream("session:healthy"))
        later = [r.type for r in pg_store.read_stream("session:later")]
        alive = not _worker_gone(rt, owner)
    seen = [r.type for r in records if r.type[:5] in ("activ", "lease")]
    why = (
        f"40 s after a 2 s outage the healthy session's lease was neither renewed nor "
        f"taken over ({seen}); the runtime's worker alive: {alive}; a message sent after "
        f"the outage: {later}"
    )
    assert of(LeaseRenewed, records), why
    assert of(LeaseExpired, records) == [], why


# -- after the fixes: the paths around them ----------------------------------------------------


@pytest.mark.timeout(90)
def test_a_lease_whose_append_seemed_to_fail_is_handed_back_when_the_process_stops(
    pg_store: EventStore,
    relay: CuttingRelay,
    relayed_store: PostgresEventStore,
    clock: FakeClock,
    fake: FakeProvider,
    chat: MemoryChannel,
) -> None:
    """Expected (actors/_worker.py:_release): a lease whose append lost its connection
    after the commit, not yet looked at again when the process stops cleanly, is handed
    back like a running wake's (``activation:released``), not left to expire and count
    as a failure."""
    settings = runtime_config(fake.base_url, activations={"max_attempts": 1})
    with Runtime(settings, store=relayed_store, clock=clock, channels={"chat": chat}) as rt:
        owner = _lease_cut_after_commit(rt, relay, pg_store, relayed_store, clock)
        # no clock step: no poll looks at the session again before the close
    records = list(pg_store.read_stream("session:s1"))
    assert [lease.owner for lease in of(ActivationLeased, records)] == [owner]
    assert [released.owner for released in of(ActivationReleased, records)] == [owner]
    assert of((LeaseExpired, ActivationAbandoned), records) == []
    assert fake.requests == []  # the wake never ran here: the next worker runs it


@pytest.mark.timeout(90)
def test_an_agent_crash_while_the_database_is_away_is_decided_once_it_is_back(
    pg_store: EventStore,
    relay: CuttingRelay,
    relayed_store: PostgresEventStore,
    clock: FakeClock,
    fake: FakeProvider,
    chat: MemoryChannel,
) -> None:
    """Expected (actors/_restarts.py:Restarts.crashed): the restart decision of an Agent
    that died while the database was away reads and appends the ``runtime`` stream; it
    failed with a StoreError that killed the supervisor. The crash is now decided again
    every second until the store answers: the Agent is restarted, and the supervisor
    lives on."""
    fake.add(Hang())
    with (
        structlog.testing.capture_logs() as captured,
        Runtime(
            runtime_config(fake.base_url, prompt_timeout_ms=600_000),
            store=relayed_store,
            clock=clock,
            channels={"chat": chat},
        ) as rt,
    ):
        rt.worker()  # started, and polled once
        send_message(pg_store, "doomed", "a long job", channel="chat", ts=clock.now())
        clock.advance(1.0)  # the worker's next poll leases it; the call hangs
        fake.wait_for(lambda requests: len(requests) == 1, GUARD)
        doomed = rt.session("doomed", channel="chat")
        crashed_ref = doomed.ref
        supervisor = [t for t in threading.enumerate() if t.name.startswith("Supervisor")]
        relay.cut_now()  # the database goes away
        crashed_ref.tell(object())  # ... and the Agent dies meanwhile
        _wait(lambda: not crashed_ref.is_alive(), "the Agent did not die")
        _wait(  # the decision failed on the store (deferred, or the supervisor died)
            lambda: (
                _logged(captured, "supervision.decision_deferred")
                or _logged(captured, "supervision.on_crash_failed")
            ),
            "the crash's decision never met the outage",
        )
        relay.restore()
        _wait(lambda: reachable(relayed_store), "the worker's store never reconnected")
        for _ in range(10):  # the decision comes again each second (fake clock)
            clock.advance(1.0)
            with contextlib.suppress(AssertionError):
                _stream_until(pg_store, "runtime", _restarted("session:doomed"), guard=0.5)
                break
        restarted = of(SupervisorRestarted, list(pg_store.read_stream("runtime")))
        alive = [t.name for t in supervisor if t.is_alive()]
    # (a provider's health actor may die of the outage too, and is restarted as well)
    assert [r.actor for r in restarted].count("session:doomed") == 1, restarted
    assert supervisor, "no supervisor thread found"
    assert alive == [t.name for t in supervisor], "the supervisor died of the outage"


@pytest.mark.timeout(90)
def test_an_abandonment_whose_append_seemed_to_fail_still_tells_the_user(
    pg_store: EventStore,
    relay: CuttingRelay,
    relayed_store: PostgresEventStore,
    clock: FakeClock,
    fake: FakeProvider,
    chat: MemoryChannel,
) -> None:
    """Expected (actors/_worker.py:_failed): the settlement of a dead Agent's wake is
    tried again at the next poll when its append failed; when that append was written
    after all and abandoned the message, the user is still told, once (the restarted
    Agent says what its crash left unsaid)."""
    fake.add(Hang())
    settings = runtime_config(
        fake.base_url, prompt_timeout_ms=600_000, activations={"max_attempts": 1}
    )
    with Runtime(settings, store=relayed_store, clock=clock, channels={"chat": chat}) as rt:
        rt.worker()  # started, and polled once
        send_message(pg_store, "s1", "a long job", channel="chat", ts=clock.now())
        clock.advance(1.0)  # the worker's next poll leases it; the call hangs
        fake.wait_for(lambda requests: len(requests) == 1, GUARD)
        relay.arm(b"activation:abandoned")
        rt.session("s1", channel="chat").ref.tell(object())  # the Agent dies
        assert relay.cut.wait(GUARD), "the abandonment never went through the relay"
        rt.worker(timeout=GUARD)  # it has handled the failed append
        relay.restore()
        _wait(lambda: reachable(relayed_store), "the worker's store never reconnected")
        told = False
        for _ in range(10):  # its next polls (and the Agent's restart) on the fake clock
            clock.advance(1.0)
            with contextlib.suppress(AssertionError):
                _stream_until(pg_store, "session:s1", has(AnnouncementQueued), guard=0.5)
                told = True
                break
        records = list(pg_store.read_stream("session:s1"))
    assert len(of(ActivationAbandoned, records)) == 1
    assert told, f"the user was never told: {[r.type for r in records]}"
    assert [a.text for a in of(AnnouncementQueued, records)] == [ABANDONED_TEXT]


def _restarted(actor: str) -> Callable[[list[RecordedEvent]], bool]:
    return lambda records: any(r.actor == actor for r in of(SupervisorRestarted, records))
