"""The PostgreSQL event store: the shared contract, plus what only PostgreSQL does."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from stalwart import store as store_module
from stalwart.clock import FakeClock
from stalwart.store import EventStore

from ._postgres import pg_server, pg_url  # noqa: F401  (fixtures)
from .store_contract import EventStoreContract


class TestPostgresContract(EventStoreContract):
    @pytest.fixture
    def store(self, pg_url: str, clock: FakeClock) -> Iterator[EventStore]:  # noqa: F811
        self.reopen = lambda: store_module.open(pg_url, clock=clock)
        opened = store_module.open(pg_url, clock=clock)
        try:
            yield opened
        finally:
            opened.close()
