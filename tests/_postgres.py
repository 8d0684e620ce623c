"""The PostgreSQL fixtures: one throwaway cluster per test session, a fresh schema per store.

Tests that need PostgreSQL are skipped only when its binaries are absent *and*
``STALWART_REQUIRE_POSTGRES`` is unset; CI sets it, so there they fail instead.
``tests/conftest.py`` imports the fixtures, so every test module shares the one cluster.
"""

from __future__ import annotations

import itertools
import os
from collections.abc import Iterator

import psycopg
import pytest
from psycopg import sql

from stalwart.store._postgres_connect import PostgresUrl
from stalwart.store._postgres_schema import MIGRATIONS, channel_name
from stalwart.testing import PostgresServer, postgres_bindir

_names = itertools.count(1)


def require_postgres() -> None:
    """Skip (or, when PostgreSQL is required, fail) if PostgreSQL cannot be started."""
    if postgres_bindir() is not None:
        return
    if os.environ.get("STALWART_REQUIRE_POSTGRES"):
        pytest.fail("STALWART_REQUIRE_POSTGRES is set but initdb and pg_ctl were not found")
    pytest.skip("PostgreSQL is not installed (set STALWART_REQUIRE_POSTGRES to make this fail)")


@pytest.fixture(scope="session")
def pg_server() -> Iterator[PostgresServer]:
    require_postgres()
    with PostgresServer(fsync=False) as server:
        server.create_database("stalwart_test")
        yield server


@pytest.fixture
def pg_url(pg_server: PostgresServer) -> str:
    """The URL of a store no other test uses: its own schema in the shared database."""
    return pg_server.url("stalwart_test") + f"?schema=t{next(_names)}"


def install_old_schema(pg_url: str, version: int, streams: tuple[str, ...] = ()) -> None:
    """Give ``pg_url``'s schema the tables as schema ``version`` made them, with a row in
    ``streams`` at version 1 for each of ``streams``: a store an older stalwart wrote."""
    url = PostgresUrl(pg_url)
    with psycopg.connect(url.conninfo, autocommit=True) as conn:
        ident = sql.Identifier(url.schema)
        conn.execute(sql.SQL("CREATE SCHEMA {}").format(ident))
        conn.execute(
            sql.SQL(
                "CREATE TABLE {}.schema_version (version integer PRIMARY KEY, "
                "applied_at timestamptz NOT NULL DEFAULT now())"
            ).format(ident)
        )
        channel = sql.Literal(channel_name(url.schema)).as_string(conn)
        for step in range(version):
            script = MIGRATIONS[step].replace("{s}", ident.as_string(conn))
            conn.execute(script.replace("{channel}", channel).encode())
            conn.execute(
                sql.SQL("INSERT INTO {}.schema_version VALUES (%s)").format(ident), (step + 1,)
            )
        for stream in streams:
            conn.execute(
                sql.SQL("INSERT INTO {}.streams (stream, version) VALUES (%s, 1)").format(ident),
                (stream,),
            )


def installed_schema(pg_url: str) -> int:
    """The highest schema version recorded in ``pg_url``'s schema."""
    url = PostgresUrl(pg_url)
    with psycopg.connect(url.conninfo, autocommit=True) as conn:
        query = sql.SQL("SELECT max(version) FROM {}.schema_version").format(
            sql.Identifier(url.schema)
        )
        row = conn.execute(query).fetchone()
    assert row is not None
    return int(row[0])
