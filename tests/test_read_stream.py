"""Reading one stream: equal to filtering the whole log, however the streams interleave."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import lmdb
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from stalwart import store as store_module
from stalwart.errors import CorruptRecordError
from stalwart.events import (
    Codec,
    Event,
    RecordedEvent,
    SessionCreated,
    UnknownEvent,
)
from stalwart.store import EventStore
from stalwart.store._lmdb import READ_BATCH

from .store_contract import msg

STREAMS = ["session:a", "session:b", "session:c"]


def _expected(store: EventStore, stream: str, first: int, last: int | None) -> list[RecordedEvent]:
    return [
        r
        for r in store.read_all()
        if r.stream == stream and r.version >= first and (last is None or r.version <= last)
    ]


@settings(
    max_examples=60,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)
@given(
    batches=st.lists(
        st.tuples(st.sampled_from(STREAMS), st.integers(min_value=1, max_value=5)),
        max_size=25,
    ),
    first=st.integers(min_value=-1, max_value=40),
    span=st.none() | st.integers(min_value=-2, max_value=40),
)
def test_read_stream_equals_filtering_read_all(
    tmp_path_factory: pytest.TempPathFactory,
    batches: list[tuple[str, int]],
    first: int,
    span: int | None,
) -> None:
    last = None if span is None else first + span
    with store_module.open(tmp_path_factory.mktemp("store")) as store:  # type: ignore[attr-defined]
        for n, (stream, size) in enumerate(batches):
            store.append(stream, [msg(f"{n}.{i}") for i in range(size)])
        for stream in [*STREAMS, "session:none"]:
            read = list(store.read_stream(stream, first, last))
            assert read == _expected(store, stream, first, last)


@pytest.fixture
def long_log(store_dir: Path) -> Iterator[EventStore]:
    """Two streams of more than two read batches each: runs, then event by event."""
    store = store_module.open(store_dir)
    try:
        for n in range(5):
            store.append("session:a", [msg(f"a{n}.{i}") for i in range(300)])
            store.append("session:b", [msg(f"b{n}.{i}") for i in range(7)])
        for n in range(READ_BATCH + 200):
            store.append("session:a" if n % 3 else "session:b", [msg(n)])
        yield store
    finally:
        store.close()


@pytest.mark.parametrize(
    ("first", "last"),
    [
        (1, None),
        (0, None),
        (5, 5),
        (299, 302),
        (READ_BATCH - 1, READ_BATCH + 1),
        (1000, 2300),
        (2000, None),
        (10, 9),
        (10**6, None),
        (1, 2**70),
    ],
)
def test_long_streams_across_batches(long_log: EventStore, first: int, last: int | None) -> None:
    for stream in ("session:a", "session:b"):
        read = list(long_log.read_stream(stream, first, last))
        assert read == _expected(long_log, stream, first, last)


def _log_db(store_dir: Path) -> tuple[lmdb.Environment, object]:
    env = lmdb.open(str(store_dir), max_dbs=8)
    return env, env.open_db(b"log")


def _overwrite(store_dir: Path, position: int, value: bytes | None) -> None:
    env, log = _log_db(store_dir)
    try:
        with env.begin(write=True) as txn:
            key = position.to_bytes(8, "big")
            if value is None:
                txn.delete(key, db=log)
            else:
                txn.put(key, value, db=log)
    finally:
        env.close()


@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("damage", [b"\xc1garbage", None])
def test_a_corrupt_or_missing_record_is_named_after_the_good_ones(
    store_dir: Path, interleaved: bool, damage: bytes | None
) -> None:
    with store_module.open(store_dir) as store:  # type: ignore[attr-defined]
        if interleaved:
            for n in range(10):
                store.append("session:a", [msg(n)])
                store.append("session:b", [msg(n)])
        else:
            store.append("session:a", [msg(n) for n in range(10)])
        positions = [r.position for r in store.read_stream("session:a")]
    broken = positions[4]
    _overwrite(store_dir, broken, damage)
    with store_module.open(store_dir) as store:  # type: ignore[attr-defined]
        read: list[int] = []
        with pytest.raises(CorruptRecordError) as info:
            read.extend(r.version for r in store.read_stream("session:a"))
        assert info.value.position == broken
        assert read == [1, 2, 3, 4]
        assert [r.version for r in store.read_stream("session:a", 6)] == [6, 7, 8, 9, 10]


def test_the_last_record_missing_is_named(store_dir: Path) -> None:
    with store_module.open(store_dir) as store:  # type: ignore[attr-defined]
        store.append("session:a", [msg(n) for n in range(3)])
    _overwrite(store_dir, 3, None)
    with store_module.open(store_dir) as store:  # type: ignore[attr-defined]
        with pytest.raises(CorruptRecordError, match="missing") as info:
            list(store.read_stream("session:a"))
        assert info.value.position == 3


class Mystery(Event, frozen=True, tag="future:mystery-read"):
    clue: str = ""


def test_unknown_events_come_back_in_a_stream(store_dir: Path) -> None:
    with store_module.open(store_dir, codec=Codec(extra_types=[Mystery])) as store:  # type: ignore[attr-defined]
        store.append("session:z", [SessionCreated(), Mystery(clue="butler"), msg(1)])
    with store_module.open(store_dir) as store:  # type: ignore[attr-defined]
        events = [r.event for r in store.read_stream("session:z")]
    assert isinstance(events[1], UnknownEvent)
    assert events[1].tag == "future:mystery-read"
    assert [type(e) for e in events[::2]] == [SessionCreated, type(msg(1))]
