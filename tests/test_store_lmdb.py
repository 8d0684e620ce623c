"""The LMDB event store: the shared contract, plus what only LMDB does."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path

import lmdb
import pytest

from stalwart import store as store_module
from stalwart.clock import FakeClock
from stalwart.errors import CorruptRecordError, StoreError, StoreNotFoundError
from stalwart.events import MessageAppended
from stalwart.store import EventStore, LmdbEventStore

from .store_contract import EventStoreContract, msg


class TestLmdbContract(EventStoreContract):
    @pytest.fixture
    def store(self, store_dir: Path, clock: FakeClock) -> Iterator[EventStore]:
        self.reopen = lambda: store_module.open(store_dir, clock=clock)
        opened = store_module.open(store_dir, clock=clock)
        try:
            yield opened
        finally:
            opened.close()


def test_timestamps_come_from_the_injected_clock(lmdb_store: EventStore, clock: FakeClock) -> None:
    [first] = lmdb_store.append("s:1", [msg(1)])
    clock.advance(2.5)
    [second] = lmdb_store.append("s:1", [msg(2)])
    assert first.ts == 1_800_000_000.0
    assert second.ts == 1_800_000_002.5


def test_open_without_create_refuses_missing_directory(tmp_path: Path) -> None:
    with pytest.raises(StoreNotFoundError, match="no stalwart store"):
        store_module.open(tmp_path / "missing", create=False)
    assert not (tmp_path / "missing").exists()


def test_open_refuses_a_file(tmp_path: Path) -> None:
    path = tmp_path / "file"
    path.write_text("not a store")
    with pytest.raises(StoreError, match="is a file"):
        store_module.open(path)


def test_open_refuses_a_non_lmdb_directory(tmp_path: Path) -> None:
    path = tmp_path / "bad"
    path.mkdir()
    (path / "data.mdb").write_bytes(b"this is not an lmdb file" * 100)
    with pytest.raises(StoreError, match="cannot open the store"):
        store_module.open(path, create=False)


def test_url_schemes_are_refused_clearly(tmp_path: Path) -> None:
    with pytest.raises(StoreError, match="not supported"):
        store_module.open("redis://localhost/0")


def test_two_handles_in_one_process_share_one_environment(store_dir: Path) -> None:
    one = store_module.open(store_dir)
    two = store_module.open(store_dir)
    try:
        one.append("s:1", [msg(1)])
        assert [r.position for r in two.read_all()] == [1]
        one.close()
        two.append("s:1", [msg(2)])  # still open: the environment is reference counted
        assert two.head() == 2
    finally:
        one.close()
        two.close()


def test_the_map_grows_when_full(store_dir: Path) -> None:
    store = LmdbEventStore(store_dir, map_size=256 * 1024)
    try:
        big = "y" * 4000
        for i in range(300):  # ~1.2 MB of records in a 256 KiB map
            store.append(f"s:{i % 5}", [msg(i, big)])
        assert store.head() == 300
        assert all(r.event.content == big for r in store.read_all())  # type: ignore[attr-defined]
    finally:
        store.close()


def test_map_grows_while_readers_read(store_dir: Path) -> None:
    store = LmdbEventStore(store_dir, map_size=256 * 1024)
    errors: list[BaseException] = []
    stop = threading.Event()

    def read() -> None:
        try:
            while not stop.is_set():
                positions = [r.position for r in store.read_all()]
                assert positions == list(range(1, len(positions) + 1))
        except BaseException as exc:
            errors.append(exc)

    readers = [threading.Thread(target=read) for _ in range(2)]
    for reader in readers:
        reader.start()
    try:
        for i in range(200):
            store.append("s:1", [msg(i, "z" * 3000)])
    finally:
        stop.set()
        for reader in readers:
            reader.join(timeout=30)
        store.close()
    assert errors == []


def _overwrite_record(store_dir: Path, position: int, value: bytes) -> None:
    env = lmdb.open(str(store_dir), max_dbs=8)
    try:
        log = env.open_db(b"log")
        with env.begin(write=True) as txn:
            txn.put(position.to_bytes(8, "big"), value, db=log)
    finally:
        env.close()


def test_corrupt_record_is_a_typed_error_naming_its_position(store_dir: Path) -> None:
    with store_module.open(store_dir) as store:  # type: ignore[attr-defined]
        store.append("s:1", [msg(1), msg(2), msg(3)])
    _overwrite_record(store_dir, 2, b"\xc1garbage")
    with store_module.open(store_dir) as store:  # type: ignore[attr-defined]
        with pytest.raises(CorruptRecordError) as info:
            list(store.read_all())
        assert info.value.position == 2
        # the other records are still there and readable around it
        assert [r.position for r in store.read_all(3)] == [3]
        assert [r.position for r in store.read_all(1, 1)] == [1]


def test_record_with_wrong_payload_shape_is_corrupt_not_a_crash(store_dir: Path) -> None:
    import msgspec

    with store_module.open(store_dir) as store:  # type: ignore[attr-defined]
        store.append("s:1", [msg(1)])
    bad = msgspec.msgpack.encode(
        [1, "s:1", 1, 1.0, "id", None, None, 1, {"type": "message:appended", "role": 42}]
    )
    _overwrite_record(store_dir, 1, bad)
    with (
        store_module.open(store_dir) as store,  # type: ignore[attr-defined]
        pytest.raises(CorruptRecordError, match="message:appended"),
    ):
        list(store.read_all())


def test_message_content_is_stored_verbatim(lmdb_store: EventStore) -> None:
    text = "line1\r\nline2\x00\u2603 " + "\ud7ff" * 3
    lmdb_store.append("s:1", [MessageAppended(message_id="m", role="user", content=text)])
    [record] = lmdb_store.read_all()
    assert record.event.content == text  # type: ignore[attr-defined]
