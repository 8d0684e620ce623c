"""The LMDB append path's shortcuts: a batch's writes staged and put together, and stream
rows remembered by the writer between batches."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import lmdb
import pytest

from stalwart.errors import ConcurrencyError, FencedError
from stalwart.events import DEFAULT_CODEC, MessageAppended
from stalwart.store import Fence, LmdbEventStore, NewEvent
from stalwart.store._environment import _Append
from stalwart.store._protocol import check_stream


def msg(i: int) -> MessageAppended:
    return MessageAppended(message_id=f"m{i}", role="user", content=f"hello {i}")


def log_values(path: Path) -> list[bytes]:
    env = lmdb.open(str(path), readonly=True, max_dbs=8)
    try:
        log = env.open_db(b"log", create=False)
        with env.begin() as txn:
            return list(txn.cursor(db=log).iternext(keys=False))
    finally:
        env.close()


def test_stored_bytes_are_the_codecs_encoding_of_the_returned_records(tmp_path: Path) -> None:
    with LmdbEventStore(tmp_path) as store:
        records = store.append("s:1", [msg(1), NewEvent(event=msg(2), ts=5.5, id="x" * 32)])
        records += store.append(
            "s:2", [NewEvent(event=msg(3), causation_id="c", correlation_id="r")]
        )
        records += store.append("s:1", [msg(4)], expected_version=2)
        assert [(r.position, r.version) for r in records] == [(1, 1), (2, 2), (3, 1), (4, 3)]
        assert records[1].ts == 5.5
        assert records[1].id == "x" * 32
        assert list(store.read_all()) == records
    assert log_values(tmp_path) == [DEFAULT_CODEC.encode(r) for r in records]


def test_requests_for_one_stream_in_one_batch_see_each_other(tmp_path: Path) -> None:
    with LmdbEventStore(tmp_path) as store:
        env = store._env  # one batch made by hand, as the writer takes it from its queue
        key = check_stream("s:1")

        def request(i: int, expected: int | None, fence: Fence | None = None) -> _Append:
            return _Append("s:1", key, [NewEvent(event=msg(i))], expected, fence)

        jobs = [
            request(1, 0),
            request(2, 1, Fence(3, claim=True)),
            request(3, 1),  # stale: fails alone
            request(4, 2, Fence(3)),
            request(5, None, Fence(2)),  # fenced: fails alone
        ]
        env._commit(jobs)  # type: ignore[arg-type]
        done = [(r.position, r.version) for j in jobs if j.error is None for r in j.result]
        assert done == [(1, 1), (2, 2), (3, 3)]
        assert isinstance(jobs[2].error, ConcurrencyError)
        assert isinstance(jobs[4].error, FencedError)
        assert store.stream_version("s:1") == 3
        assert store.lease_epoch("s:1") == 3


CHILD = """
import sys
from stalwart.events import MessageAppended
from stalwart.store import Fence, LmdbEventStore
with LmdbEventStore(sys.argv[1]) as store:
    store.append("s:1", [MessageAppended(message_id="child", role="user", content="x")],
                 expected_version=1, fence=Fence(2, claim=True))
"""


def test_the_writer_never_trusts_rows_another_process_has_changed(tmp_path: Path) -> None:
    with LmdbEventStore(tmp_path) as store:
        store.append("s:1", [msg(1)], fence=Fence(1, claim=True))
        subprocess.run([sys.executable, "-c", CHILD, str(tmp_path)], check=True, timeout=60)
        with pytest.raises(ConcurrencyError):
            store.append("s:1", [msg(2)], expected_version=1)
        with pytest.raises(FencedError):
            store.append("s:1", [msg(2)], fence=Fence(1))
        [record] = store.append("s:1", [msg(2)], expected_version=2, fence=Fence(2))
        assert (record.position, record.version) == (3, 3)
        assert store.lease_epoch("s:1") == 2
