"""Session 35 review of the PostgreSQL store: a lost append sent again beside its own
still-running session when the login role switches roles, the tail's listener logging
every failed reconnect of an outage, and a password with a ``/`` or ``?`` in it shown in
the store's errors.

Each test of a defect failed on the code before its fix, for the defect its name states.
A real PostgreSQL (``pg_server``), real connections through a real relay, no mocks.
"""

from __future__ import annotations

import itertools
import os
import threading
import time
from collections.abc import Iterator, MutableMapping
from typing import Any

import psycopg
import pytest
from click.testing import CliRunner

from stalwart import store as store_module
from stalwart.cli import cli
from stalwart.clock import FakeClock
from stalwart.errors import StoreError
from stalwart.events import MessageAppended, RecordedEvent
from stalwart.store import PostgresEventStore
from stalwart.testing import PostgresServer
from tests._relay import CuttingRelay, schema_of

_names = itertools.count(1)
PASSWORD = "agent-pw-35"
DEADLINE_S = 20.0


def _msg(n: int) -> MessageAppended:
    return MessageAppended(message_id=str(n), role="user", content="x")


def _admin(server: PostgresServer, statement: str) -> list[Any]:
    with psycopg.connect(server.url("stalwart_test"), autocommit=True) as admin:
        cursor = admin.execute(statement.encode())
        return cursor.fetchall() if cursor.description else []


def _until(condition: Any, what: str) -> None:
    deadline = time.monotonic() + DEADLINE_S
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)  # real-time: waits on a server session or a thread of the store


# -- 1. a lost append sent again beside its own session ------------------------------------

# Where: stalwart/store/_postgres.py `_recover`. When an append's connection is lost, the
# store ends the append's server session (``pg_terminate_backend``) so that it cannot
# commit later, then sends again what is not in the log. It looked the session up with
# ``usename = current_user``; a login role that switches to a group role (the usual
# ``ALTER ROLE agent SET role = owners``, or ``options=-c role=...``) has ``current_user``
# the group role, and pg_stat_activity names the login role: the session was never found
# nor ended. An append still running there (waiting on a lock, a slow trigger) committed
# after the resend had been sent: the resend then failed with a ConcurrencyError though
# the append was written (or, with no expected version, wrote it twice). Fix: the session
# is looked up and ended as the login role (``SET LOCAL ROLE NONE``, ``session_user``).


@pytest.fixture
def switching_role(pg_server: PostgresServer) -> Iterator[str]:
    """A login role whose sessions switch to a group role that owns its store: its name."""
    n = f"{os.getpid()}_{next(_names)}"
    agent, owners = f"agent_s35_{n}", f"owners_s35_{n}"
    _admin(pg_server, f"CREATE ROLE {owners} NOLOGIN")
    _admin(pg_server, f"CREATE ROLE {agent} LOGIN PASSWORD '{PASSWORD}' IN ROLE {owners}")
    _admin(pg_server, f"ALTER ROLE {agent} SET role = '{owners}'")
    _admin(pg_server, f"GRANT CREATE ON DATABASE stalwart_test TO {owners}")
    try:
        yield agent
    finally:
        _admin(
            pg_server,
            f"SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE usename = '{agent}'",
        )
        _admin(pg_server, f"DROP OWNED BY {owners}, {agent} CASCADE")
        _admin(pg_server, f"DROP ROLE {agent}")
        _admin(pg_server, f"DROP ROLE {owners}")


# Was: DEFECT: a lost append running under a switched role was resent: ConcurrencyError yet written.
@pytest.mark.timeout(60)
def test_a_lost_append_of_a_role_that_switches_roles_is_ended_not_resent_beside_itself(
    pg_server: PostgresServer, relay: CuttingRelay, switching_role: str, clock: FakeClock
) -> None:
    schema = f"s35_role_{next(_names)}"
    url = (
        f"postgresql://{switching_role}:{PASSWORD}@{pg_server.host}:{relay.port}"
        f"/stalwart_test?schema={schema}"
    )
    with PostgresEventStore(url, clock=clock, connect_timeout=2.0) as store:
        store.append("s:1", [_msg(1)])
        _admin(  # the next insert into the log takes 1.5 s inside the server's session
            pg_server,
            f"CREATE FUNCTION {schema}.slow() RETURNS trigger LANGUAGE plpgsql AS "
            "$$ BEGIN PERFORM pg_sleep(1.5); RETURN NULL; END $$; "
            f"CREATE TRIGGER slow AFTER INSERT ON {schema}.events "
            f"FOR EACH STATEMENT EXECUTE FUNCTION {schema}.slow()",
        )
        outcome: list[object] = []

        def append() -> None:
            try:
                outcome.append(store.append("s:1", [_msg(2)], expected_version=1))
            except Exception as exc:
                outcome.append(exc)

        appender = threading.Thread(target=append)
        appender.start()
        _until(
            lambda: _admin(
                pg_server,
                "SELECT 1 FROM pg_stat_activity WHERE query LIKE '%append_batch%' "
                f"AND state = 'active' AND usename = '{switching_role}'",
            ),
            "the append to run in the server",
        )
        relay.cut_now()  # the client's connection is lost while the server runs the append
        relay.restore()
        appender.join(DEADLINE_S)
        assert not appender.is_alive()
        _admin(pg_server, f"DROP TRIGGER slow ON {schema}.events")
        [result] = outcome
        assert isinstance(result, list), result  # it was written once, and said so
        [record] = result
        assert isinstance(record, RecordedEvent)
        assert (record.position, record.version) == (2, 2)
        assert [(r.version, r.event) for r in store.read_stream("s:1")] == [
            (1, _msg(1)),
            (2, _msg(2)),
        ]


# -- 2. the listener's every failed reconnect logged ------------------------------------------

# Where: stalwart/store/_postgres_tail.py `Doorbell._run` logged ``store.listener_lost``
# as a warning at every failed reconnect: every 2 s for as long as the database was away,
# in every process where something had waited for new events (each worker's health
# actor does), where a subscription says its outage once. Fix: the loss is a warning
# once per outage, each failed reconnect after it a debug line, and its end
# ``store.listener_back`` once it listens again.


def _said(logs: list[MutableMapping[str, Any]], event: str, level: str) -> int:
    return sum(1 for line in logs if line["event"] == event and line["log_level"] == level)


def _listeners(pg_server: PostgresServer) -> int:
    rows = _admin(
        pg_server,
        "SELECT count(*) FROM pg_stat_activity WHERE application_name = 'stalwart-listener'",
    )
    return int(rows[0][0])


# Was: DEFECT: the tail's listener logged a warning at every failed reconnect during an outage.
@pytest.mark.timeout(60)
def test_the_listener_says_an_outage_once_and_its_end_once_not_every_retry(
    pg_server: PostgresServer,
    relay: CuttingRelay,
    relayed_store: PostgresEventStore,
    logs: list[MutableMapping[str, Any]],
) -> None:
    assert relayed_store.wait_for(1, 0.2) == 0  # something waited: the listener starts
    _until(lambda: _listeners(pg_server) == 1, "the listener to listen")
    relay.cut_now()
    _until(  # the listener tries again and again while the database is away
        lambda: (
            _said(logs, "store.listener_lost", "warning")
            + _said(logs, "store.listener_lost", "debug")
            >= 4
        ),
        "the listener to try again",
    )
    assert _said(logs, "store.listener_lost", "warning") == 1  # the outage, said once
    relay.restore()
    _until(lambda: _said(logs, "store.listener_back", "info") == 1, "the listener to be back")
    assert _said(logs, "store.listener_lost", "warning") == 1
    relayed_store.append("s:1", [_msg(1)])
    assert relayed_store.wait_for(1, DEADLINE_S) == 1


# -- 3. a password with a / or ? shown in errors ----------------------------------------------

# Where: stalwart/store/_postgres_connect.py `PostgresUrl`. A password with an unencoded
# ``/``, ``?`` or ``#`` ends a URL's host part there (``agent:/Kq8z@db/x`` reads as host
# ``agent``, database ``Kq8z@db/x``), so the rest of the password was shown as the
# database or a query parameter: ``cannot connect to the PostgreSQL store at
# postgresql://agent/Kq8zT1x@...``, in the error, the CLI's output and log lines (a
# base64 password starts with ``/`` one time in 64). No libpq URL has an ``@`` after its
# host (in the database name, a parameter's name or a fragment), so such a URL is now
# refused before connecting, without showing it, saying what to percent-encode.


# Was: DEFECT: a password with an unencoded / or ? was shown as the database or a parameter.
@pytest.mark.parametrize("password", ["/Kq8zT1x", "2024/Kq8zT1x", "?Kq8zT1x", "5432?Kq8zT1x"])
def test_a_password_with_a_slash_or_a_question_mark_is_never_shown(
    pg_server: PostgresServer, password: str
) -> None:
    url = f"postgresql://agent:{password}@{pg_server.host}:{pg_server.port}/stalwart_test"
    with pytest.raises(StoreError) as caught:
        store_module.open(url)
    assert "Kq8zT1x" not in str(caught.value)
    assert "write / as %2F, ? as %3F" in str(caught.value)  # before connecting, and why
    result = CliRunner().invoke(cli, ["--store", url, "streams"])
    assert result.exit_code == 1
    assert "Kq8zT1x" not in result.output
    assert "Traceback" not in result.output


def test_a_percent_encoded_slash_in_a_password_and_an_at_in_a_parameter_still_connect(
    pg_server: PostgresServer, pg_url: str
) -> None:
    """The refusal above is only of an ``@`` where no URL has one: a password written
    percent-encoded connects, and a parameter's value may hold an ``@``."""
    n = f"{os.getpid()}_{next(_names)}"
    role = f"slash_s35_{n}"
    _admin(pg_server, f"CREATE ROLE {role} LOGIN SUPERUSER PASSWORD '/Kq8z?T1#x'")
    try:
        url = (
            f"postgresql://{role}:%2FKq8z%3FT1%23x@{pg_server.host}:{pg_server.port}"
            f"/stalwart_test?application_name=w%40h&schema={schema_of(pg_url)}"
        )
        with PostgresEventStore(url) as store:
            store.append("s:1", [_msg(1)])
            assert store.head() == 1
            assert "Kq8z" not in store.location
        with PostgresEventStore(url.replace("w%40h", "w@h")) as store:
            assert store.head() == 1
    finally:
        _admin(
            pg_server,
            f"SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE usename = '{role}'",
        )
        _admin(pg_server, f"DROP OWNED BY {role} CASCADE")
        _admin(pg_server, f"DROP ROLE {role}")
