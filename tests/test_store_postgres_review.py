"""Defects a review found in the PostgreSQL store (URL handling, reconnection, timeouts,
the work queue, timestamps, holes in the log, statements the server refused). Each test
failed on the code before its fix, for the defect its name states. A real PostgreSQL
(``pg_server``), real sockets, no mocks."""

from __future__ import annotations

import itertools
import os
import signal
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import psycopg
import pytest

from stalwart import store as store_module
from stalwart.clock import FakeClock
from stalwart.errors import AppendInDoubtError, CorruptRecordError, StoreError
from stalwart.events import MessageAppended
from stalwart.store import NewEvent, PostgresEventStore, Snapshot
from stalwart.testing import PostgresServer
from tests._relay import CuttingRelay, schema_of

_dbs = itertools.count(1)


def _msg(n: int) -> MessageAppended:
    return MessageAppended(message_id=str(n), role="user", content="x")


def _admin(server: PostgresServer, statement: str, params: tuple[object, ...] = ()) -> list[object]:
    with psycopg.connect(server.url(), autocommit=True) as admin:
        cursor = admin.execute(statement.encode(), params)
        return cursor.fetchall() if cursor.description else []


def _kill_sessions(server: PostgresServer, database: str) -> int:
    rows = _admin(
        server,
        "SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
        "WHERE datname = %s AND pid <> pg_backend_pid()",
        (database,),
    )
    return len(rows)


@pytest.fixture
def own_db(pg_server: PostgresServer) -> Iterator[str]:
    """A database of this test's own (so it can refuse new connections), and its name."""
    name = f"review_{next(_dbs)}_{int(time.time() * 1000) % 100000}"
    pg_server.create_database(name)
    try:
        yield name
    finally:
        _admin(pg_server, f'ALTER DATABASE "{name}" ALLOW_CONNECTIONS true')
        _kill_sessions(pg_server, name)
        _admin(pg_server, f'DROP DATABASE IF EXISTS "{name}"')


# -- store URLs ---------------------------------------------------------------------------------


def test_a_percent_encoded_space_in_a_url_parameter_reaches_libpq_as_a_space(
    pg_server: PostgresServer, pg_url: str
) -> None:
    # libpq's own way to pass server settings: options=-c%20name%3Dvalue
    url = pg_url + "&options=-c%20statement_timeout%3D54321"
    with PostgresEventStore(url) as store:
        store.append("s:1", [_msg(1)])
        assert store.head() == 1


def test_a_multi_host_url_is_accepted(pg_server: PostgresServer, pg_url: str) -> None:
    # libpq's failover form: host1:port1,host2:port2 (both the same server here)
    port = pg_server.port
    url = pg_url.replace(f"127.0.0.1:{port}", f"127.0.0.1:{port},127.0.0.1:{port}")
    with PostgresEventStore(url) as store:
        store.append("s:1", [_msg(1)])
        assert pg_server.password not in store.location
        assert store.head() == 1


def test_a_wrong_scheme_error_does_not_show_the_password() -> None:
    with pytest.raises(StoreError) as caught:
        PostgresEventStore("pg://a:hunter2@db.internal/x")
    assert "hunter2" not in str(caught.value)


def test_connect_timeout_in_the_url_is_honoured() -> None:
    # a server that accepts the TCP connection and never answers (a hung host)
    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen(8)
    port = silent.getsockname()[1]
    url = f"postgresql://u:pw@127.0.0.1:{port}/db?connect_timeout=1"
    outcome: list[BaseException] = []

    def open_it() -> None:
        try:
            PostgresEventStore(url).close()
        except BaseException as exc:
            outcome.append(exc)

    started = time.monotonic()
    opener = threading.Thread(target=open_it, daemon=True)
    opener.start()
    opener.join(5)  # the URL asks for 1 s; 5 s is a generous margin
    elapsed = time.monotonic() - started
    try:
        assert not opener.is_alive(), f"still connecting after {elapsed:.1f} s"
        assert outcome
        assert isinstance(outcome[0], StoreError)
    finally:
        silent.close()


# -- reconnection ---------------------------------------------------------------------------------


def test_saving_a_snapshot_survives_connections_the_server_closed(
    pg_server: PostgresServer, pg_url: str
) -> None:
    with PostgresEventStore(pg_url) as store:
        store.append("s:1", [_msg(1)])
        assert _kill_sessions(pg_server, "stalwart_test") >= 1  # as a restart or failover would
        # reads and appends run again on a new connection; so must load_state's snapshot save
        store.put_snapshot(Snapshot(stream="s:1", name="f", version=1, position=1, data=b"ok"))
        assert [s.version for s in store.snapshots("s:1", "f")] == [1]


# -- tailing while the listener is down -----------------------------------------------------------


def test_wait_for_keeps_its_timeout_while_the_listener_cannot_connect(
    pg_server: PostgresServer, own_db: str
) -> None:
    url = pg_server.url(own_db) + "?schema=w"
    with PostgresEventStore(url, poll_interval=0.05) as store:
        store.append("s:1", [_msg(1)])  # the pool holds its connection from here on
        # new connections are refused (a failover in progress, max_connections reached);
        # the pooled one still works
        _admin(pg_server, f'ALTER DATABASE "{own_db}" ALLOW_CONNECTIONS false')
        for _ in range(3):
            started = time.monotonic()
            assert store.wait_for(2, 0.1) == 1
            elapsed = time.monotonic() - started
            # the docs: readers then poll the head themselves every poll interval
            assert elapsed < 0.6, f"wait_for(timeout=0.1) took {elapsed:.2f} s"


# -- appends while the server is unreachable --------------------------------------------------


def test_appends_fail_within_the_timeout_when_no_connection_can_be_had(
    pg_server: PostgresServer, own_db: str
) -> None:
    url = pg_server.url(own_db) + "?schema=u"
    with PostgresEventStore(url, connect_timeout=0.3) as store:
        store.append("s:0", [_msg(0)])
        _admin(pg_server, f'ALTER DATABASE "{own_db}" ALLOW_CONNECTIONS false')
        _kill_sessions(pg_server, own_db)  # the server went away; it is not back yet
        with pytest.raises(StoreError):
            store.head()
        barrier = threading.Barrier(16)
        took: list[float] = []
        errors: list[BaseException] = []

        def append(n: int) -> None:
            barrier.wait()
            started = time.monotonic()
            try:
                store.append(f"s:{n}", [_msg(n)])
            except StoreError as exc:
                errors.append(exc)
            took.append(time.monotonic() - started)

        threads = [threading.Thread(target=append, args=(n,)) for n in range(16)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(30)
        assert len(errors) == 16  # nothing could be sent, so each append failed...
        # ...but an append that could not even get a connection was retried once per
        # append of its batch, each waiting out the 0.3 s pool timeout again
        assert max(took) < 2.0, f"the last append failed after {max(took):.1f} s"


# -- the work queue ---------------------------------------------------------------------------


def test_set_due_to_no_work_on_a_session_without_a_row_says_written_as_on_lmdb(
    pg_url: str, store_dir: Path, clock: FakeClock
) -> None:
    lmdb = store_module.open(store_dir, clock=clock)
    try:
        on_lmdb = lmdb.set_due("session:none", 0, None, "w1")  # type: ignore[attr-defined]
    finally:
        lmdb.close()
    with PostgresEventStore(pg_url, clock=clock) as store:
        on_postgres = store.set_due("session:none", 0, None, "w1")
    assert on_lmdb is True
    assert on_postgres is on_lmdb


# -- appends LMDB takes -------------------------------------------------------------------------


def test_an_append_with_an_int_timestamp_beside_a_stamped_event_is_written(
    pg_url: str, clock: FakeClock
) -> None:
    # ``ts: float`` takes an int (PEP 484's numeric tower); LMDB writes this append
    news = [NewEvent(event=_msg(1), ts=5), NewEvent(event=_msg(2))]
    with PostgresEventStore(pg_url, clock=clock) as store:
        written = store.append("s:1", news)
        assert [r.ts for r in written] == [5.0, clock.now()]
        assert [r.ts for r in store.read_all()] == [5.0, clock.now()]


# -- a hole in the log --------------------------------------------------------------------------


def test_read_all_does_not_end_silently_at_a_missing_position(
    pg_server: PostgresServer, pg_url: str
) -> None:
    schema = pg_url.rsplit("schema=", 1)[1]
    with PostgresEventStore(pg_url) as store:
        store.append("s:1", [_msg(i) for i in range(1500)])
        with psycopg.connect(pg_server.url("stalwart_test"), autocommit=True) as admin:
            admin.execute(f"DELETE FROM {schema}.events WHERE position = 100".encode())
        got: list[int] = []
        error: CorruptRecordError | None = None
        try:
            got.extend(r.position for r in store.read_all())
        except CorruptRecordError as exc:  # a typed error naming the hole is fine too
            error = exc
        if error is not None:
            assert error.position == 100
        else:  # LMDB's read_all goes on past a missing position; here 476 records vanish
            assert got[-1] == 1500, f"read_all stopped at {got[-1]} of 1500"


# -- an append the server refused is not a lost connection -------------------------------------


def test_an_append_cancelled_by_statement_timeout_is_a_clear_failure(
    pg_server: PostgresServer, own_db: str
) -> None:
    _admin(pg_server, f"ALTER DATABASE \"{own_db}\" SET statement_timeout = '300ms'")
    url = pg_server.url(own_db) + "?schema=c"
    with PostgresEventStore(url) as store:
        store.append("s:1", [_msg(1)])
        with psycopg.connect(pg_server.url(own_db), autocommit=True) as admin:
            admin.execute(  # every insert into the log now takes 1 s: over the timeout
                "CREATE FUNCTION c.slow() RETURNS trigger LANGUAGE plpgsql AS "
                "$$ BEGIN PERFORM pg_sleep(1); RETURN NULL; END $$; "
                "CREATE TRIGGER slow AFTER INSERT ON c.events "
                "FOR EACH STATEMENT EXECUTE FUNCTION c.slow()"
            )
        with pytest.raises(StoreError) as caught:
            store.append("s:1", [_msg(2)], expected_version=1)
        # the server was there all along and rolled the append back: it was not written,
        # and the error must not say the connection was lost or that it may have been
        assert "may or may not" not in str(caught.value)
        assert [r.version for r in store.read_stream("s:1")] == [1]


# -- a lost append whose server session will not end ---------------------------------------------


@pytest.mark.timeout(60)
def test_a_lost_append_whose_session_will_not_end_is_not_sent_again(
    pg_server: PostgresServer,
    pg_url: str,
    relay: CuttingRelay,
    relayed_store: PostgresEventStore,
) -> None:
    """Defect: when an append's connection is lost, the store ends the append's server
    session (``pg_terminate_backend(pid, 5000)``) so that it cannot commit later, then
    sends again what is not in the log. It ignored the answer: a session that is still
    there after the 5 s (a stalled server process) may commit yet, and the append was
    sent again beside it (written twice, or blocked behind its locks). Expected: the
    append fails with the "may or may not have been written" error, and nothing is sent
    again. The stall is a real one: the server process is stopped with SIGSTOP."""
    schema = schema_of(pg_url)
    relayed_store.append("s:1", [_msg(1)])
    test_db = pg_server.url("stalwart_test")
    with psycopg.connect(test_db, autocommit=True) as admin:
        admin.execute(  # the next insert into the log takes 3 s inside the server's session
            f"CREATE FUNCTION {schema}.slow() RETURNS trigger LANGUAGE plpgsql AS "
            "$$ BEGIN PERFORM pg_sleep(3); RETURN NULL; END $$; "
            f"CREATE TRIGGER slow AFTER INSERT ON {schema}.events "
            f"FOR EACH STATEMENT EXECUTE FUNCTION {schema}.slow()"
        )
    failures: list[BaseException] = []

    def append() -> None:
        try:
            relayed_store.append("s:1", [_msg(2)])  # no expected version: a resend
        except BaseException as exc:
            failures.append(exc)

    appender = threading.Thread(target=append)
    appender.start()
    stalled: list[int] = []
    try:
        for _ in range(250):
            rows = _admin(
                pg_server,
                "SELECT pid FROM pg_stat_activity WHERE query LIKE '%%append_batch%%' "
                "AND state = 'active' AND pid <> pg_backend_pid()",
            )
            if rows:
                stalled.append(int(rows[0][0]))  # type: ignore[index]
                break
            time.sleep(0.02)  # real-time: polls pg_stat_activity for the append
        assert stalled, "the append never reached the server"
        os.kill(stalled[0], signal.SIGSTOP)  # the server process stalls mid-append
        relay.cut_now()  # and the client's connection is lost
        relay.restore()
        appender.join(30)
    finally:
        for pid in stalled:
            os.kill(pid, signal.SIGCONT)  # it ends now: the 5 s wait is over
    assert not appender.is_alive()
    [failure] = failures
    assert isinstance(failure, AppendInDoubtError)
    assert "may or may not have been written" in str(failure)
    with psycopg.connect(test_db, autocommit=True) as admin:
        admin.execute(f"DROP TRIGGER slow ON {schema}.events")
    # the stalled session may have been at its commit when it stopped (then it is
    # written, once), or it is rolled back; never written twice (sent again beside it)
    written = [r.event for r in relayed_store.read_stream("s:1")]
    assert written in ([_msg(1)], [_msg(1), _msg(2)])
