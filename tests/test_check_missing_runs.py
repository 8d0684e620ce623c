"""A long run of records missing from the middle of the log (deleted by hand): a read
says where the run ends (``CorruptRecordError.through``), and ``db check`` names its
first positions and then the rest as one range, instead of one problem (and, on
PostgreSQL, one query) per missing position."""

from __future__ import annotations

from pathlib import Path

from stalwart.errors import CorruptRecordError
from stalwart.events import MessageAppended
from stalwart.store import EventStore, LmdbEventStore, PostgresEventStore, check_store
from tests.test_postgres_review_s32 import _delete
from tests.test_store_index_lag import damage

TOTAL, FIRST, LAST = 1_500, 201, 1_400  # 1,200 records missing, 100 after them


def _fill(store: EventStore) -> None:
    for start in range(0, TOTAL, 50):
        store.append(
            f"session:s{start // 50 % 3}",
            [MessageAppended(message_id=str(n), role="user", content="x") for n in range(50)],
        )


def _first_error(store: EventStore) -> CorruptRecordError:
    try:
        for _ in store.read_all():
            pass
    except CorruptRecordError as exc:
        return exc
    raise AssertionError("the read ran past the hole in silence")


def _assert_checked(store: EventStore) -> None:
    error = _first_error(store)
    assert (error.position, error.through) == (FIRST, LAST)
    assert f"positions {FIRST}..{LAST}" in str(error)
    report = check_store(store)
    missing = [p for p in report.problems if p.position is not None and p.position >= FIRST]
    named = [p for p in missing if p.position is not None and p.position < FIRST + 100]
    assert len(named) == 100  # the run's first positions, one by one
    rest = [p for p in missing if p.position == FIRST + 100]
    assert len(rest) == 1
    assert rest[0].what.startswith(f"positions {FIRST + 100}..{LAST} are missing")
    assert len(report.problems) <= 110, len(report.problems)  # streams' gaps are named in these
    assert report.records == TOTAL - (LAST - FIRST + 1)  # every record after the run was walked


# Was: DEFECT: db check on LMDB reported each of a long run of missing records as a problem
# of its own (1,200 lines here; a million for a million deleted).
def test_lmdb_a_long_run_of_missing_records_is_one_range(tmp_path: Path) -> None:
    location = tmp_path / "store"
    with LmdbEventStore(location) as store:
        _fill(store)
    for position in range(FIRST, LAST + 1):
        damage(location, position, None)
    with LmdbEventStore(location) as store:
        _assert_checked(store)


# Was: DEFECT: db check on PostgreSQL read a long run of missing records one query and one
# problem per position.
def test_postgres_a_long_run_of_missing_records_is_one_range(pg_url: str) -> None:
    with PostgresEventStore(pg_url) as store:
        _fill(store)
        _delete(pg_url, FIRST, LAST)
        _assert_checked(store)


def test_a_single_missing_record_is_still_one_position(pg_url: str, tmp_path: Path) -> None:
    location = tmp_path / "store"
    with PostgresEventStore(pg_url) as pg, LmdbEventStore(location) as lmdb:
        for store in (pg, lmdb):
            _fill(store)
    _delete(pg_url, 300, 300)
    damage(location, 300, None)
    with PostgresEventStore(pg_url) as pg, LmdbEventStore(location) as lmdb:
        for store in (pg, lmdb):
            error = _first_error(store)
            assert (error.position, error.through) == (300, 300), store
            assert str(error).startswith("record at position 300 is corrupt")


# Was: DEFECT: read_all_readable (status, watch, incidents) read past a run of missing
# records one position at a time: a query each on PostgreSQL, a callback each.
def test_views_read_past_a_run_of_missing_records_in_one_step(pg_url: str) -> None:
    from stalwart.store import read_all_readable

    with PostgresEventStore(pg_url) as store:
        _fill(store)
        _delete(pg_url, FIRST, LAST)
        heard: list[tuple[int, int]] = []
        records = list(
            read_all_readable(store, unreadable=lambda at, exc: heard.append((at, exc.through)))
        )
        assert heard == [(FIRST, LAST)]
        assert len(records) == TOTAL - (LAST - FIRST + 1)
        assert records[FIRST - 1].position == LAST + 1
