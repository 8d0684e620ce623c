"""A store's reads in batches: ``Records`` and the folds that take a batch at a time.

``load_state`` folds the built-in stores' reads a batch at a time (``Records.batches``,
``add_all``); a store of another make, or one a caller wraps, is read record by record.
Both must give the same state for every cut (``until_position``) and every damaged
record (``skip_unreadable``), on LMDB and on PostgreSQL (real stores, the session's
PostgreSQL cluster).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from stalwart.errors import CorruptRecordError, StoreClosedError
from stalwart.events import MessageAppended, PromptActivity, SessionCreated, TurnStarted
from stalwart.state import SESSION, SessionState, fold
from stalwart.store import EventStore, load_state
from stalwart.store import open as open_store
from stalwart.store._environment import READ_BATCH
from stalwart.testing import PostgresServer
from tests.test_postgres_workers_review import _corrupt as pg_corrupt
from tests.test_store_index_lag import damage

STREAM = "session:batches"
OTHER = "session:other"
TOTAL = 2 * READ_BATCH + 300  # three batches, the last a short one
GARBAGE = b"\xc1not a record"


class Wrapped:
    """A store a caller wrapped: every read passes through a plain generator."""

    def __init__(self, inner: EventStore) -> None:
        self._inner = inner

    def read_stream(self, *args: Any, **kwargs: Any) -> Iterator[Any]:
        yield from self._inner.read_stream(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


@pytest.fixture(params=["lmdb", "postgres"])
def kind(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture
def any_store(kind: str, request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[EventStore]:
    where = request.getfixturevalue("pg_url") if kind == "postgres" else tmp_path / "store"
    opened = open_store(where)
    try:
        yield opened
    finally:
        opened.close()


def _fill(store: EventStore) -> None:
    """``TOTAL`` events in ``STREAM``, with another stream's events between its runs (so
    a stream's batch is not always one run of the log)."""
    store.append(STREAM, [SessionCreated(agent="a", title="t")])
    n = 1
    while n < TOTAL:
        take = min(97, TOTAL - n)
        events = [
            MessageAppended(message_id=f"m{n + i}", role="user", content=f"hello {n + i}")
            if (n + i) % 3
            else PromptActivity(call_id="c", tokens=n + i)
            for i in range(take)
        ]
        store.append(STREAM, events)
        store.append(OTHER, [TurnStarted(turn_id=f"t{n}")])
        n += take


def _reference(store: EventStore, until: int | None = None, skip: frozenset[int] = frozenset()):
    """The session folded record by record from ``read_all`` (no batches at all)."""
    wanted = [
        record
        for record in store.read_all()
        if record.stream == STREAM
        and record.version not in skip
        and (until is None or record.position <= until)
    ]
    return fold(SESSION, STREAM, wanted)


def test_batches_hold_the_same_records_as_reading_one_by_one(any_store: EventStore) -> None:
    _fill(any_store)
    one_by_one = list(any_store.read_stream(STREAM))
    batches = list(any_store.read_stream(STREAM).batches())
    assert [r for batch in batches for r in batch] == one_by_one
    assert len(one_by_one) == TOTAL
    assert len(batches) >= 3
    assert all(len(batch) <= READ_BATCH for batch in batches)
    every = list(any_store.read_all())
    assert [r for b in any_store.read_all().batches() for r in b] == every
    assert list(any_store.read_stream(STREAM, 700, 1500)) == one_by_one[699:1500]


def test_a_read_gives_records_or_batches_not_both(lmdb_store: EventStore) -> None:
    _fill(lmdb_store)
    records = lmdb_store.read_stream(STREAM)
    first = next(records)
    assert first.version == 1
    with pytest.raises(RuntimeError, match="one by one"):
        records.batches()
    assert next(iter(records)).version == 2  # iter() and next() share one position
    assert [r.version for r in records][:2] == [3, 4]


def test_a_read_is_lazy_as_a_generator_was(tmp_path: Path) -> None:
    """Nothing is read (and nothing fails) until the first record is asked for."""
    store = open_store(tmp_path / "store")
    store.append(STREAM, [SessionCreated()])
    records, batches = store.read_stream(STREAM), store.read_all().batches()
    store.close()
    with pytest.raises(StoreClosedError):
        next(records)
    with pytest.raises(StoreClosedError):
        next(batches)


def test_load_state_equals_the_record_by_record_fold_at_every_cut(any_store: EventStore) -> None:
    _fill(any_store)
    positions = [r.position for r in any_store.read_stream(STREAM)]
    cuts = {
        positions[0] - 1,  # before the stream
        positions[0],
        positions[READ_BATCH - 1],  # a batch's last record
        positions[READ_BATCH],  # the next batch's first
        positions[READ_BATCH] - 1,  # between two records of the stream
        positions[1500],
        positions[-1],
        positions[-1] + 10,
    }
    for until in sorted(cuts):
        expected = _reference(any_store, until)
        for store in (any_store, Wrapped(any_store)):
            state: SessionState = load_state(
                store, STREAM, SESSION, until_position=until, use_snapshots=False
            )
            assert state == expected, (until, type(store).__name__)
    whole = load_state(any_store, STREAM, SESSION, snapshot_every=0, use_snapshots=False)
    assert whole == _reference(any_store)
    assert whole.version == TOTAL


def test_skipping_unreadable_records_folds_every_other_one(
    kind: str, any_store: EventStore, request: pytest.FixtureRequest, tmp_path: Path
) -> None:
    """Damaged records inside a batch, at a batch's start and at the stream's end: the
    batched fold passes over exactly those, as the record-by-record one does."""
    _fill(any_store)
    records = list(any_store.read_stream(STREAM))
    bad = frozenset({600, READ_BATCH + 1, TOTAL})
    for version in bad:
        if kind == "postgres":
            server: PostgresServer = request.getfixturevalue("pg_server")
            pg_corrupt(server, request.getfixturevalue("pg_url"), STREAM, version)
        else:
            any_store.close()
            damage(tmp_path / "store", records[version - 1].position, GARBAGE)
    store = any_store if kind == "postgres" else open_store(tmp_path / "store")
    try:
        with pytest.raises(CorruptRecordError):
            load_state(store, STREAM, SESSION, use_snapshots=False)
        good = [r for r in records if r.version not in bad]
        expected = fold(SESSION, STREAM, good)
        for reader in (store, Wrapped(store)):
            state = load_state(
                reader,
                STREAM,
                SESSION,
                snapshot_every=0,
                use_snapshots=False,
                skip_unreadable=True,
            )
            assert state == expected, type(reader).__name__
        assert expected.version == TOTAL - 1
    finally:
        if store is not any_store:
            store.close()
