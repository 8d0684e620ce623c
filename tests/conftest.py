from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from stalwart import store as store_module
from stalwart.clock import FakeClock
from stalwart.store import EventStore


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock(start=1_800_000_000.0)


@pytest.fixture
def store_dir(tmp_path: Path) -> Path:
    return tmp_path / "store"


@pytest.fixture
def lmdb_store(store_dir: Path, clock: FakeClock) -> Iterator[EventStore]:
    store = store_module.open(store_dir, clock=clock)
    try:
        yield store
    finally:
        store.close()
