"""Review of the LMDB store and its low-level CLI (session 32): each test shows a defect
found in the store or in ``stalwart db check``, on real LMDB directories, real forked
processes and the real CLI (no mocks). Tests marked ``# Was: DEFECT`` failed on the code
they were written against."""

from __future__ import annotations

import multiprocessing
from pathlib import Path
from typing import Any

import lmdb
import pytest
from click.testing import CliRunner

from stalwart import store as store_module
from stalwart.cli import cli
from stalwart.errors import StoreClosedError, StoreError
from stalwart.store import LmdbEventStore, check_store

from .store_contract import msg

WAIT = 20.0  # seconds any one step may take before the test fails rather than hangs


def run(*args: str) -> tuple[int, str, str]:
    result = CliRunner().invoke(cli, list(args), catch_exceptions=False)
    return result.exit_code, result.stdout, result.stderr


def _foreign_lmdb(path: Path) -> dict[bytes, bytes]:
    """Another program's LMDB environment (no sub-databases), and what it holds."""
    held = {b"user:1": b"alice", b"user:2": b"bob"}
    env = lmdb.open(str(path), map_size=1 << 20)
    try:
        with env.begin(write=True) as txn:
            for key, value in held.items():
                txn.put(key, value)
    finally:
        env.close()
    return held


def _main_db(path: Path) -> dict[bytes, bytes]:
    env = lmdb.open(str(path), map_size=1 << 20, readonly=True)
    try:
        with env.begin() as txn:
            return {bytes(key): bytes(value) for key, value in txn.cursor()}
    finally:
        env.close()


def _edit_log(store_dir: Path, edit: Any) -> None:
    """Change the log's records by hand (damage), with ``edit(txn, log_db)``."""
    env = lmdb.open(str(store_dir), max_dbs=8)
    try:
        log = env.open_db(b"log")
        with env.begin(write=True) as txn:
            edit(txn, log)
    finally:
        env.close()


def _at(position: int) -> bytes:
    return position.to_bytes(8, "big")


# Was: DEFECT: opening another program's LMDB directory for writing (`db init`, any
# command that records, a Runtime given the wrong path) made it a stalwart store: it
# wrote six sub-databases and a format marker into that program's main database
@pytest.mark.parametrize("create", [True, False], ids=["create", "existing-only"])
def test_another_programs_lmdb_file_is_refused_for_writing_and_left_as_it_was(
    tmp_path: Path, create: bool
) -> None:
    other = tmp_path / "other"
    held = _foreign_lmdb(other)
    with pytest.raises(StoreError, match="holds an LMDB file but no stalwart store"):
        store_module.open(other, create=create)
    assert _main_db(other) == held
    code, out, err = run("--store", str(other), "db", "init")
    assert (code, out) == (1, "")
    assert err.startswith("stalwart: error: ")
    assert "no stalwart store" in err
    assert len(err.splitlines()) == 1
    assert _main_db(other) == held
    # an empty directory and a store of our own still open as before
    with store_module.open(tmp_path / "new") as fresh:  # type: ignore[attr-defined]
        fresh.append("s:1", [msg(1)])
    with store_module.open(tmp_path / "new", create=False) as again:  # type: ignore[attr-defined]
        assert again.head() == 1


def _use_the_parents_handle(store: LmdbEventStore, conn: Any) -> None:
    """In the forked child: use the handle opened before the fork, then open it again."""
    said = []
    for call in (store.head, lambda: store.append("session:child", [msg("c")])):
        try:
            said.append(("ok", repr(call())))
        except BaseException as exc:  # reported to the parent
            said.append((type(exc).__name__, str(exc)))
    try:
        store.close()
        with store_module.open(store.location) as again:  # type: ignore[attr-defined]
            [record] = again.append("session:child", [msg("d")])
        said.append(("reopened", str(record.position)))
    except BaseException as exc:  # reported to the parent
        said.append((type(exc).__name__, str(exc)))
    conn.send(said)


# Was: DEFECT: a store handle opened before a fork and used in the child (a multiprocessing
# worker given the parent's store) raised a raw lmdb.Error ("Attempt to operate on
# closed/deleted/dropped object") on every read: `internal error` in the CLI, untyped
def test_a_handle_used_in_a_forked_child_is_store_closed_and_says_to_open_it_again(
    store_dir: Path,
) -> None:
    store = LmdbEventStore(store_dir)
    child = None
    try:
        store.append("warm", [msg(0)])
        context = multiprocessing.get_context("fork")
        mine, theirs = context.Pipe()
        child = context.Process(target=_use_the_parents_handle, args=(store, theirs))
        child.start()
        assert mine.poll(WAIT), "the child said nothing"
        read, append, reopened = mine.recv()
        for kind, text in (read, append):
            assert kind == StoreClosedError.__name__, (kind, text)
            assert "before this process forked" in text
            assert "open it again" in text
        assert reopened == ("reopened", "2")
        # the parent's handle is untouched by the child's
        assert [r.stream for r in store.read_all()] == ["warm", "session:child"]
        store.append("warm", [msg(1)])
    finally:
        if child is not None:
            if child.is_alive():
                child.kill()
            child.join(WAIT)
        store.close()


# Was: DEFECT: `db check` stopped at a record whose stream id no append can write (a byte
# of "session:a" damaged to NUL) with "error: stream id ... contains a NUL character" and
# no report, where every other damaged record is a problem line naming its position
def test_db_check_reports_a_record_whose_stream_id_no_append_writes(store_dir: Path) -> None:
    with store_module.open(store_dir) as store:  # type: ignore[attr-defined]
        for n in range(3):
            store.append("session:a", [msg(n)])
        store.append("session:b", [msg(9)])

    def nul_in_the_stream_id(txn: Any, log: Any) -> None:
        value = bytearray(txn.get(_at(2), db=log))
        value[value.find(b"session:a") + 4] = 0
        txn.put(_at(2), bytes(value), db=log)

    _edit_log(store_dir, nul_in_the_stream_id)
    code, out, err = run("--store", str(store_dir), "db", "check")
    assert (code, err) == (1, "")
    problems = [line for line in out.splitlines() if line.startswith("  problem")]
    assert problems[0].startswith("  problem  position 2 session:a: ")
    assert "NUL" in problems[0]
    assert out.splitlines()[-1] == f"{len(problems)} problem{'s' * (len(problems) != 1)}"
    assert not any("session:b" in line for line in problems)  # its stream reads whole


# Was: DEFECT: `db check` described records stored out of their place (two swapped, or a
# copy of one over another) as missing positions, some that it had just read and some
# nonsense ("positions 7..4 are missing"), instead of naming where each is stored
@pytest.mark.parametrize("damage", ["swapped", "copied"])
def test_db_check_names_records_stored_out_of_their_place(store_dir: Path, damage: str) -> None:
    with store_module.open(store_dir) as store:  # type: ignore[attr-defined]
        for n in range(10):
            store.append(f"session:{n % 2}", [msg(n)])

    def swap(txn: Any, log: Any) -> None:
        five, six = txn.get(_at(5), db=log), txn.get(_at(6), db=log)
        txn.put(_at(5), six, db=log)
        txn.put(_at(6), five, db=log)

    def copy(txn: Any, log: Any) -> None:
        txn.put(_at(7), txn.get(_at(5), db=log), db=log)

    _edit_log(store_dir, swap if damage == "swapped" else copy)
    with store_module.open(store_dir, create=False, read_only=True) as store:  # type: ignore[attr-defined]
        report = check_store(store)
    assert not report.ok
    assert all("missing" not in problem.what for problem in report.problems), report.problems
    wrong = {5: 6, 6: 5} if damage == "swapped" else {7: 5}
    placed = {p.position: p.what for p in report.problems if "says it is at" in p.what}
    assert set(placed) == set(wrong), report.problems
    for stored, says in wrong.items():
        assert f"the record stored at {stored} says it is at position {says}" in placed[stored]


# Was: DEFECT: read_all with a start past the largest position (2**64) raised a raw
# OverflowError ("int too big to convert") instead of reading nothing, as every other
# range past the log's end does
def test_read_all_from_past_64_bit_positions_reads_nothing(store_dir: Path) -> None:
    with store_module.open(store_dir) as store:  # type: ignore[attr-defined]
        store.append("s:1", [msg(1)])
        assert list(store.read_all(2**64, 2**65)) == []
        assert list(store.read_all(2**64 + 5)) == []
        assert [r.position for r in store.read_all(1, 2**70)] == [1]
