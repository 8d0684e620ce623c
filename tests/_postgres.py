"""The PostgreSQL fixtures: one throwaway cluster per test session, a fresh schema per store.

Tests that need PostgreSQL are skipped only when its binaries are absent *and*
``STALWART_REQUIRE_POSTGRES`` is unset; CI sets it, so there they fail instead.
``tests/conftest.py`` imports the fixtures, so every test module shares the one cluster.
"""

from __future__ import annotations

import itertools
import os
from collections.abc import Iterator

import pytest

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
