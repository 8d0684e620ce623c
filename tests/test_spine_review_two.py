"""Second adversarial review of the event-log spine (LMDB store, group commit, work-queue
rows, the CLI's read commands), as a user of an event store would use it.

Each test shows one defect with real LMDB directories, real processes and the CLI as a
subprocess, and FAILS on the code it was written against. The ``# DEFECT:`` line above
each says what is wrong, where, and what the fix should be.
"""

from __future__ import annotations

import threading
from pathlib import Path

import lmdb

from stalwart import store as store_module
from stalwart.errors import StalwartError
from stalwart.events import ActivationReady, RecordedEvent
from stalwart.store import LmdbEventStore
from tests.test_spine_review import (
    _msg,
    _stalwart,
    _wait_until,
    _write_lock_held_by_another_process,
)

WAIT = 20.0  # seconds a step may take before the test fails rather than hangs
NOW = 1_800_000_000.0


def _ready(n: int | str) -> ActivationReady:
    return ActivationReady(activation_id=f"a{n}", kind="message", message_id=str(n), text="hi")


def _damage(store_dir: Path, db_name: bytes, key: bytes, value: bytes = b"\xc1") -> None:
    """Overwrite one row of a sub-database from outside the store (damage on disk)."""
    env = lmdb.open(str(store_dir), max_dbs=8)
    try:
        db = env.open_db(db_name)
        with env.begin(write=True) as txn:
            assert txn.get(key, db=db) is not None, f"no row {key!r} in {db_name!r} to damage"
            txn.put(key, value, db=db)
    finally:
        env.close()


# -- 1. one damaged work-queue row stops every worker from claiming any session -------------

# Was: DEFECT: stalwart/store/_lmdb_due.py:115 (ClaimDue.run) decodes every `due` row with
# `_DECODE(value)` unguarded, inside the writer's transaction: one damaged row of this
# derived data makes claim_due raise "write ... failed: DecodeError" for every caller, for
# ever, so ActivationWorker._poll_queue (actors/_worker.py:349) never claims any session
# again; the whole runtime silently stops working (only a worker.claim_failed warning).
# The same unguarded decode in _get (_lmdb_due.py:148), reached by DueAppend.run, fails
# every append group-committed beside an activation for that session. Fix: treat a row
# that does not decode as "due now, unheld" (log store.due_row_damaged once and rewrite it
# on claim), so the other sessions are claimed and the damaged one is re-derived by a fold.


def test_a_damaged_due_row_does_not_stop_claims_of_every_other_session(store_dir: Path) -> None:
    with LmdbEventStore(store_dir) as store:
        store.append("session:a", [_ready(1)])
        store.append("session:b", [_ready(2)])
    _damage(store_dir, b"due", b"session:a")
    with LmdbEventStore(store_dir) as store:
        try:
            work = store.claim_due("worker-1", NOW, 10, 5.0)
        except StalwartError as exc:
            raise AssertionError(f"one damaged due row stopped every claim: {exc}") from None
        assert "session:b" in [claim.stream for claim in work.claimed]


# -- 2. one damaged stream row fails unrelated appends committed beside it ------------------

# Was: DEFECT: stalwart/store/_environment.py:591 (append_in) calls stream_row(), which raises
# StoreError for a damaged `streams` row; append_in does not catch it, so it escapes
# _write_batch (_environment.py:474) and _commit fails *every* request of the group-commit
# batch: a healthy append to another stream that happened to be queued beside it is refused
# ("the index row of stream 'bad' cannot be read"), although architecture.md promises that
# a failing request "fails alone; the rest of its batch is written". Fix: in append_in,
# catch StoreError from the row read and set it as that request's own error (as the
# ConcurrencyError/EventError cases do) and return.


def test_a_damaged_stream_row_fails_only_appends_to_that_stream(store_dir: Path) -> None:
    with LmdbEventStore(store_dir) as store:
        store.append("bad", [_msg(0)])
        store.append("warm", [_msg(0)])
    _damage(store_dir, b"streams", b"bad")
    store = LmdbEventStore(store_dir)
    results: dict[str, list[RecordedEvent] | BaseException] = {}
    threads: list[threading.Thread] = []

    def append(name: str, stream: str) -> None:
        try:
            results[name] = store.append(stream, [_msg(name)])
        except BaseException as exc:  # recorded for the assertions
            results[name] = exc

    def start(name: str, stream: str) -> None:
        thread = threading.Thread(target=append, args=(name, stream))
        thread.start()
        threads.append(thread)

    # only read, to know when the writer is stuck and both requests are queued
    inbox, rw = store._env._inbox, store._env.rw
    try:
        with _write_lock_held_by_another_process(store_dir):
            start("first", "warm")
            _wait_until(lambda: rw._shared > 0 and len(inbox) == 0)
            start("bad", "bad")
            start("innocent", "innocent")
            _wait_until(lambda: len(inbox) == 2)  # one batch, behind the held lock
        for thread in threads:
            thread.join(WAIT)
        assert isinstance(results["bad"], StalwartError)
        innocent = results["innocent"]
        assert isinstance(innocent, list), f"an unrelated append was refused: {innocent!r}"
        assert store.stream_version("innocent") == 1
    finally:
        for thread in threads:
            thread.join(WAIT)
        store.close()


# -- 3. `stalwart streams` prints a stream id's control characters raw -----------------------

# Was: DEFECT: stalwart/cli/_app.py:262-266 (`streams`) prints `info.stream` as it is (and sizes
# the column by its raw length), while `tail` (cli/_render.py event_line) escapes every
# stream id because it is "some writer's text": a stream id holding a newline (any string
# without NUL is a valid id) splits its row in two, so the listing shows a row that is not
# a stream and one whose numbers belong to another; on a terminal an escape sequence is
# sent as it is. Fix: print and measure `escaped(info.stream)` (stalwart._text.escaped).


def test_streams_prints_one_line_per_stream_whatever_its_id_holds(store_dir: Path) -> None:
    odd = "session:a\n       9  2026-01-01T00:00:00.000Z  forged"
    with LmdbEventStore(store_dir) as store:
        store.append(odd, [_msg(1)])
        store.append("session:b", [_msg(2)])
    result = _stalwart("--store", str(store_dir), "streams")
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert len(lines) == 3, lines  # the header and one row per stream
    assert lines[1].startswith("session:a\\n"), lines


# -- 4. the same store reached by another path cannot be opened beside the first handle ----

# Was: DEFECT: stalwart/store/_lmdb.py:321/335 keys the per-process environment registry
# (_ENVS) by os.path.abspath(path), which does not resolve symlinks: a second handle on
# the same directory reached through a symlink (a deploy's `current -> releases/42`, a
# host opening the runtime's store by its real path) misses the shared environment, opens
# a second LMDB environment on the same file, and py-lmdb refuses it ("StoreError: ...
# is already open in this process"); architecture.md promises that store.open "shares
# one environment (and one writer) per directory per process". Fix: key _ENVS by
# os.path.realpath(path) (or by the (st_dev, st_ino) of data.mdb).


def test_a_second_handle_through_a_symlink_shares_the_environment(tmp_path: Path) -> None:
    real = tmp_path / "real"
    real.mkdir()
    (tmp_path / "link").symlink_to(real, target_is_directory=True)
    first = store_module.open(real / "store")
    try:
        first.append("s:1", [_msg(1)])
        try:
            second = store_module.open(tmp_path / "link" / "store")
        except StalwartError as exc:
            raise AssertionError(f"the same store by another path: {exc}") from None
        try:
            second.append("s:1", [_msg(2)], expected_version=1)
            assert [r.version for r in first.read_stream("s:1")] == [1, 2]
        finally:
            second.close()
    finally:
        first.close()


# -- 5. reopening a store while its last handle is still closing fails ------------------------

# Was: DEFECT: stalwart/store/_lmdb.py:612-614 (LmdbEventStore.close) takes the environment out
# of _ENVS under _ENVS_LOCK and only then, outside the lock, closes it (_Environment.close
# drains the writer's inbox, which waits for LMDB's write lock, e.g. behind another
# process's commit). A store.open() of the same directory in that window finds no shared
# environment, opens a second LMDB environment on the same file and py-lmdb refuses it
# ("StoreError: ... is already open in this process"): a host that stops its runtime and
# starts it again (or a read command run in-process) fails at random under load. Fix: have
# open() wait for an environment of that path that is still closing (keep it registered
# as closing until env.close() returns, and wait on it in __init__) instead of racing it.


def test_reopening_while_the_last_handle_is_still_closing_waits_for_it(store_dir: Path) -> None:
    store = LmdbEventStore(store_dir)
    store.append("s:1", [_msg(0)])
    env = store._env  # only read, to know when the writer is stuck in its transaction
    threads: list[threading.Thread] = []
    results: dict[str, object] = {}

    def run(name: str, fn: object) -> None:
        try:
            results[name] = fn()  # type: ignore[operator]
        except BaseException as exc:  # recorded for the assertions
            results[name] = exc

    def start(name: str, fn: object) -> None:
        thread = threading.Thread(target=run, args=(name, fn))
        thread.start()
        threads.append(thread)

    reopened: LmdbEventStore | None = None
    try:
        with _write_lock_held_by_another_process(store_dir):
            start("append", lambda: store.append("s:1", [_msg(1)]))
            _wait_until(lambda: env.rw._shared > 0 and len(env._inbox) == 0)
            start("close", store.close)
            _wait_until(lambda: env._inbox.closed)  # closing: waits for the writer
            start("reopen", lambda: LmdbEventStore(store_dir))
            # a fixed open waits for the close, which waits for the lock: give the open
            # time to fail (it fails at once) before letting the other process go
            threads[-1].join(2.0)
        for thread in threads:
            thread.join(WAIT)
        found = results["reopen"]
        if isinstance(found, LmdbEventStore):
            reopened = found
        assert reopened is not None, f"reopening failed: {found!r}"
        assert isinstance(results["append"], list)
        assert reopened.stream_version("s:1") == 2
    finally:
        for thread in threads:
            thread.join(WAIT)
        if reopened is not None:
            reopened.close()
