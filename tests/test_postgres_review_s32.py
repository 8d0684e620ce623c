"""Session 32 review of the PostgreSQL store: holes in the log that a read ran past in
silence (at the end of a read batch, at the end of the log or of a stream), a store
whose schema a database administrator made for its role, and the throwaway server's
port.

Each test of a defect failed on the code before its fix, for the defect its name states.
A real PostgreSQL (``pg_server``), real connections, no mocks.
"""

from __future__ import annotations

import itertools
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest
from psycopg import sql

from stalwart.errors import CorruptRecordError
from stalwart.events import MessageAppended, SessionCreated
from stalwart.store import LmdbEventStore, PostgresEventStore
from stalwart.store._postgres_connect import PostgresUrl
from stalwart.testing import PostgresServer
from tests.test_store_index_lag import damage  # LMDB's: a record deleted by hand

_roles = itertools.count(1)
PASSWORD = "r0le-pw"


def _msg(n: int) -> MessageAppended:
    return MessageAppended(message_id=str(n), role="user", content="x")


def _sql(pg_url: str, statement: str, params: tuple[object, ...] = ()) -> list[Any]:
    """Run one statement on ``pg_url``'s database, with ``{s}`` its store's schema."""
    url = PostgresUrl(pg_url)
    query = sql.SQL(statement).format(s=sql.Identifier(url.schema))
    with psycopg.connect(url.conninfo, autocommit=True) as conn:
        cursor = conn.execute(query, params)
        return cursor.fetchall() if cursor.description else []


def _delete(pg_url: str, first: int, last: int) -> None:
    """Delete the records at positions ``first..last`` by hand (damage)."""
    _sql(pg_url, "DELETE FROM {s}.events WHERE position BETWEEN %s AND %s", (first, last))


def _read(records: Iterator[Any]) -> tuple[list[int], CorruptRecordError | None]:
    """The positions a read yields, and the CorruptRecordError it ends with (or None)."""
    seen: list[int] = []
    try:
        seen.extend(record.position for record in records)
    except CorruptRecordError as exc:
        return seen, exc
    return seen, None


# -- 1. a hole a read runs past in silence --------------------------------------------------

# Where: stalwart/store/_postgres.py `_ranged` read rows in batches of 1024 keys and took a
# short batch whose keys ran on without a break for the end of what is committed. A hole
# that reached the end of a batch (positions 1020..1024 deleted by hand) or the end of the
# log or of a stream (its newest records deleted) left such a batch: the read ended there
# in silence, every record after the hole unread, though scaling.md says a hole "never
# stops early in silence" and LMDB raises CorruptRecordError for the same damage. A
# subscription whose head was past the log's end spun: wait_for said there was more,
# read_all found none, thousands of queries a second, for ever. Fix: each read statement
# also returns, in the same snapshot, the key the read must reach (the head, or the
# stream's version), and a key missing before it is a CorruptRecordError.


# Was: DEFECT: a hole reaching the end of a read batch ended read_all and read_stream silently.
def test_a_hole_at_the_end_of_a_read_batch_is_an_error_not_the_end_of_the_log(
    pg_url: str,
) -> None:
    with PostgresEventStore(pg_url) as store:
        store.append("session:a", [_msg(n) for n in range(1, 1101)])  # positions = versions
        _delete(pg_url, 1020, 1024)
        seen, error = _read(store.read_all())
        assert seen == list(range(1, 1020)), seen[-3:]
        assert error is not None, "read_all ended in silence at position 1019 of 1100"
        assert error.position == 1020, error
        seen, error = _read(store.read_stream("session:a"))
        assert seen == list(range(1, 1020)), seen[-3:]
        assert error is not None, "read_stream ended in silence at version 1019 of 1100"
        assert error.position == 1025, error  # the record after the hole, as for any hole
        assert "version 1020" in error.reason, error
        # what comes after the hole reads, from past it
        assert [r.position for r in store.read_all(1025, 1026)] == [1025, 1026]
        assert [r.version for r in store.read_stream("session:a", 1099)] == [1099, 1100]


# Was: DEFECT: a stream whose newest record was deleted read short in silence (LMDB raises).
def test_a_streams_newest_record_missing_is_an_error_on_postgres_as_on_lmdb(
    pg_url: str, tmp_path: Path
) -> None:
    lmdb_dir = tmp_path / "store"
    with PostgresEventStore(pg_url) as pg, LmdbEventStore(lmdb_dir) as lmdb:
        for log in (pg, lmdb):
            for n in range(6):
                log.append(f"session:s{n % 2}", [_msg(n)])
    _delete(pg_url, 5, 5)  # session:s0's version 3, not the log's last record
    damage(lmdb_dir, 5, None)
    with PostgresEventStore(pg_url) as pg, LmdbEventStore(lmdb_dir) as lmdb:
        for log in (lmdb, pg):
            seen, error = _read(log.read_stream("session:s0"))
            assert seen == [1, 3], (log, seen)
            assert error is not None, f"{log!r}: read_stream ended in silence at version 2 of 3"
            assert error.position == 5, (log, error)


# Was: DEFECT: a subscription spun on the database when the log's newest record was missing.
def test_the_logs_newest_record_missing_ends_a_subscription_instead_of_spinning(
    pg_url: str,
) -> None:
    with PostgresEventStore(pg_url) as store:
        store.append("session:a", [SessionCreated(), _msg(1)])
        _delete(pg_url, 2, 2)
        feed = store.subscribe(1)
        assert [r.position for r in feed.poll(10.0)] == [1]
        with pytest.raises(CorruptRecordError) as raised:
            feed.poll(10.0)  # before: [] after ten seconds of queries in a tight loop
        assert raised.value.position == 2
        seen, error = _read(store.read_all())
        assert seen == [1]
        assert error is not None
        assert error.position == 2


# -- 2. a schema made for the store's role by an administrator --------------------------------

# Where: stalwart/store/_postgres_schema.py `migrate` ran `CREATE SCHEMA IF NOT EXISTS`
# every time, and PostgreSQL checks the CREATE privilege on the database before it looks
# whether the schema exists. A locked-down role (no CREATE on the database) whose schema
# an administrator made for it (`CREATE SCHEMA stalwart AUTHORIZATION agent`), the usual
# way to give an application one schema, could not create the store's tables in it:
# "cannot prepare the store's schema: InsufficientPrivilege (42501)" from `db init` and
# every opener. Fix: the schema is created only when it is not there (under the same
# advisory lock), and so is the migrations table.


@pytest.fixture
def role_url(pg_server: PostgresServer, pg_url: str) -> Iterator[str]:
    """A role that may log in but not create schemas, owning the store's schema, which
    an administrator made; its URL. Dropped after."""
    role = f"s32_{os.getpid()}_{next(_roles)}"
    schema = PostgresUrl(pg_url).schema
    with psycopg.connect(pg_server.url("stalwart_test"), autocommit=True) as admin:
        admin.execute(f"CREATE ROLE {role} LOGIN PASSWORD '{PASSWORD}'".encode())
        admin.execute(
            sql.SQL("CREATE SCHEMA {} AUTHORIZATION {}").format(
                sql.Identifier(schema), sql.Identifier(role)
            )
        )
        try:
            host = f"{pg_server.host}:{pg_server.port}"
            yield f"postgresql://{role}:{PASSWORD}@{host}/stalwart_test?schema={schema}"
        finally:
            admin.execute(
                "SELECT pg_terminate_backend(pid, 5000) FROM pg_stat_activity WHERE usename = %s",
                (role,),
            )
            admin.execute(f"DROP OWNED BY {role} CASCADE".encode())
            admin.execute(f"DROP ROLE {role}".encode())


# Was: DEFECT: a role owning its schema but without CREATE on the database could not make the store.
def test_a_role_owning_its_schema_creates_the_store_without_create_on_the_database(
    role_url: str,
) -> None:
    with PostgresEventStore(role_url) as store:
        assert store.migrated_from == 0  # it made the tables
        store.append("session:a", [SessionCreated()])
        assert [r.position for r in store.read_all()] == [1]
    with PostgresEventStore(role_url, read_only=True) as again:
        assert again.migrated_from is None
        assert again.head() == 1


# -- 3. a throwaway server's port taken before it bound it ----------------------------------

# Where: stalwart/testing/_postgres.py `_free_port` let the kernel pick the port
# (``bind(("127.0.0.1", 0))``) and closed the probe; the kernel picks such a port from
# the range it also gives outgoing connections as their source port, so any connection
# this machine opened before the server bound it (a client of another test worker's
# server, under xdist) could take it, and PostgresServer failed: "could not bind IPv4
# address: Address already in use" (seen during this review, with other suites
# running). Fix: the port is picked outside that range, and a start whose port was
# taken anyway (two servers picked the same) tries another.


# Was: DEFECT: PostgresServer picked its port where outgoing connections take theirs: starts failed.
def test_a_throwaway_servers_port_is_never_one_an_outgoing_connection_may_take(
    pg_server: PostgresServer,
) -> None:
    range_file = Path("/proc/sys/net/ipv4/ip_local_port_range")
    if not range_file.exists():
        pytest.skip("no Linux source port range to check against")
    low, high = (int(n) for n in range_file.read_text().split())
    assert not low <= pg_server.port <= high, (pg_server.port, low, high)
    with psycopg.connect(pg_server.url(), autocommit=True) as conn:
        assert conn.execute("SELECT 1").fetchone() == (1,)
