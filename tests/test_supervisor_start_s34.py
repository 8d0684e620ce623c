"""Supervisor review, session 34: its start on a large log.

Real parts: an LMDB store in tmp_path (read through :class:`Counting`, which only counts
what the supervisor asks of the real store), PostgreSQL through the shared fixtures, a
FakeClock-driven Scheduler, a real IoPortal, and real child processes that append to, or
damage, the log while no supervisor runs. Sweeps are asked for (``Sweep``), never waited
for.
"""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from stalwart.actors import GetRuns, Spawn
from stalwart.actors._restarts import Crashed
from stalwart.actors._supervisor import LOOK_CHUNK
from stalwart.actors._supervisor_fold import INDEX_NAME
from stalwart.clock import FakeClock
from stalwart.events import (
    AnnouncementDelivered,
    AnnouncementQueued,
    SubagentCompleted,
    SubagentGivenUp,
    SubagentRecoveryDecided,
    SupervisorRestarted,
)
from stalwart.store import EventStore, Snapshot
from tests._support_s35 import supervising
from tests.test_supervisor import WAIT
from tests.test_supervisor_review_s32 import _spawned, _write
from tests.test_supervisor_scale_s34 import (
    _APPEND_RUN,
    PAST_GHOST_S,
    Counting,
    _ghosts,
    _more,
    _sessions,
    _sessions_read,
    _swept,
)

#: enough agent sessions that their records pass the store's snapshot cadence (500)
SESSIONS = 400


def _finished(store: EventStore, clock: FakeClock, run_id: str) -> None:
    """A run that succeeded and whose completion was announced: nothing left to decide."""
    done = [
        _spawned(announce=True),
        SubagentCompleted(result="done"),
        AnnouncementQueued(announcement_id=f"c-{run_id}", channel="chat", kind="completion",
                           text="done"),
        AnnouncementDelivered(announcement_id=f"c-{run_id}", path="announce"),
    ]  # fmt: skip
    _write(store, clock, run_id, done)


def _index_positions(store: EventStore) -> list[int]:
    return [s.position for s in store.snapshots("runtime", INDEX_NAME)]


def _a_log_with_runs(store: EventStore, clock: FakeClock) -> None:
    _sessions(store, SESSIONS)
    for index in range(20):
        _finished(store, clock, f"done-{index}")
    _write(store, clock, "open", [_spawned()])


# -- a restart reads the log from its index ------------------------------------------------


# Was: DEFECT: a restarted supervisor listed every stream and read every session stream again
@pytest.mark.parametrize("backend", ["lmdb", "postgres"])
def test_a_restarted_supervisor_reads_the_log_since_its_index_not_every_session(
    backend: str, request: pytest.FixtureRequest, tmp_path: Path, clock: FakeClock
) -> None:
    """A supervisor that started listed every stream and read the first records of each
    session stream to tell runs from user sessions, whatever an earlier supervisor had
    learned: 2.2 to 4.7 s at 100,000 sessions on LMDB on this machine (16 s on a busier
    one), its mailbox blocked meanwhile. Now the sweeps save their index of the runs as
    a snapshot with the log position it covers, and a restart reads the log from there:
    5 ms at 100,000 sessions. Every open run is still found, one appended by another
    process while no supervisor ran too."""
    if backend == "lmdb":
        store_dir = tmp_path / "store"
        store: EventStore = request.getfixturevalue("lmdb_store")
    else:
        store = request.getfixturevalue("pg_store")
    _a_log_with_runs(store, clock)
    with supervising(store, clock) as supervisor:
        assert _swept(supervisor) == ()

    if backend == "lmdb":  # a run appended while no supervisor runs, by another process
        args = (str(store_dir), "session:elsewhere", str(clock.now()))
        subprocess.run([sys.executable, "-c", _APPEND_RUN, *args], check=True, timeout=60)
    else:
        _write(store, clock, "elsewhere", [_spawned()])
    _more(store, range(0, SESSIONS, 7))
    clock.advance(PAST_GHOST_S)
    counting = Counting(store)
    with supervising(counting, clock) as supervisor:
        assert _swept(supervisor) == ()  # its start swept them
        assert _ghosts(store) == {"session:open", "session:elsewhere"}
        assert counting.listings == 0
        assert _sessions_read(counting) == {"session:open", "session:elsewhere"}
        runs = supervisor.ask(GetRuns(), timeout=WAIT)
        assert set(runs) == {"session:open", "session:elsewhere"} | {
            f"session:done-{index}" for index in range(20)
        }


def test_a_run_set_aside_that_moved_while_no_supervisor_ran_is_folded_again(
    lmdb_store: EventStore, clock: FakeClock
) -> None:
    """A run the index holds as set aside, whose stream moved after the index was saved
    (here the run's own actor was given up on), is read again and decided on."""
    _sessions(lmdb_store, SESSIONS)
    _write(lmdb_store, clock, "later", [_spawned()])
    with supervising(lmdb_store, clock) as supervisor:
        assert _swept(supervisor) == ()
    assert _index_positions(lmdb_store)
    _write(lmdb_store, clock, "later", [SubagentGivenUp(restarts=3, reason="Boom")])
    counting = Counting(lmdb_store)
    with supervising(counting, clock) as supervisor:
        _swept(supervisor)
        watch = supervisor.ask(GetRuns(), timeout=WAIT)["session:later"]
        assert watch.run.status == "failed"
        assert watch.run.recovery is not None  # decided by the restarted supervisor
        assert counting.listings == 0


def test_a_next_run_this_process_could_not_start_is_started_by_a_later_one_that_can(
    lmdb_store: EventStore, clock: FakeClock
) -> None:
    """A failed run whose recorded respawn runs the host's code, set aside by a process
    that does not hold that code, is not settled for good in the index: a later
    supervisor that holds it reads the run again and starts the next run."""
    _sessions(lmdb_store, SESSIONS)
    failed = [
        _spawned(host_work=True, next_run_id="r2"),
        SubagentGivenUp(restarts=3, reason="Boom"),
        AnnouncementQueued(announcement_id="n1", channel="chat", kind="failure_notice",
                           text="failed"),
        AnnouncementDelivered(announcement_id="n1", path="announce"),
        SubagentRecoveryDecided(action="respawn", reason="retry"),
    ]  # fmt: skip
    _write(lmdb_store, clock, "r1", failed)
    clock.advance(PAST_GHOST_S)
    elsewhere: list[Spawn] = []
    with supervising(
        lmdb_store, clock, spawner=elsewhere.append, works=lambda run_id: False
    ) as supervisor:
        _swept(supervisor)
    assert elsewhere == []
    assert _index_positions(lmdb_store)

    here: list[Spawn] = []
    with supervising(
        lmdb_store, clock, spawner=here.append, works=lambda run_id: True
    ) as supervisor:
        _swept(supervisor)
        assert [spawn.run_id for spawn in here] == ["r2"]


# -- without an index: the listing is read in chunks ------------------------------------------


class Ordered(Counting):
    """:class:`Counting`, and the order of the session reads and the appends it was asked
    for; its first read of a session stream waits until the test lets it go."""

    def __init__(self, inner: EventStore) -> None:
        super().__init__(inner)
        self.done: list[str] = []
        self.reading = threading.Event()
        self.go_on = threading.Event()

    def read_stream(self, stream: str, from_version: int = 1, to_version: int | None = None) -> Any:
        if stream.startswith("session:chat-") and not self.reading.is_set():
            self.reading.set()
            assert self.go_on.wait(WAIT)  # real-time: the test tells a crash meanwhile
        self.done.append(f"read {stream}")
        return super().read_stream(stream, from_version, to_version)

    def append(self, stream: str, *args: Any, **kwargs: Any) -> Any:
        self.done.append(f"append {stream}")
        return self.inner.append(stream, *args, **kwargs)


# Was: DEFECT: crashes, run ends and send outcomes waited for the whole first sweep of a start
def test_a_crash_told_during_a_long_first_listing_is_handled_between_two_chunks(
    lmdb_store: EventStore, clock: FakeClock
) -> None:
    """A supervisor with no index to start from (a first start on a log an older version
    wrote, or a damaged index) read every session stream before it handled anything it
    was told: a crash report waited 2 s at 100,000 sessions (a restart, a run's end, a
    send's outcome too). Now the listing is read LOOK_CHUNK streams per message the
    supervisor tells itself; the crash is decided after one chunk (47 ms there) and the
    sweep still finds every open run once the listing is read."""
    sessions = LOOK_CHUNK * 6
    _sessions(lmdb_store, sessions)
    _write(lmdb_store, clock, "zz-open", [_spawned()])  # listed last
    clock.advance(PAST_GHOST_S)
    ordered = Ordered(lmdb_store)
    crash = Crashed(actor="agent:s1", reason="Boom", restart=lambda: None, notify=False)
    with supervising(ordered, clock) as supervisor:
        assert ordered.reading.wait(WAIT)  # real-time: the supervisor's start reads
        supervisor.tell(crash)
        ordered.go_on.set()
        deadline = time.monotonic() + WAIT
        while lmdb_store.stream_version("runtime") == 0:  # real-time: told, not asked
            assert time.monotonic() < deadline, "the crash was never decided"
            time.sleep(0.005)
        _swept(supervisor)
        decided = ordered.done.index("append runtime")
        read_before = [step for step in ordered.done[:decided] if step.startswith("read session:")]
        assert len(read_before) <= LOOK_CHUNK
        assert _ghosts(lmdb_store) == {"session:zz-open"}
        records = lmdb_store.read_stream("runtime")
        assert [type(r.event) for r in records] == [SupervisorRestarted]


# -- an index that cannot be used -----------------------------------------------------------

_FLIP = """
import sys
import lmdb
env = lmdb.open(sys.argv[1], max_dbs=8)
with env.begin(write=True) as txn:
    snapshots = env.open_db(b"snapshots", txn=txn)
    prefix = b"runtime\\x00" + sys.argv[2].encode() + b"\\x00"
    cursor = txn.cursor(db=snapshots)
    assert cursor.set_range(prefix)
    for key, value in list(cursor.iternext()):
        if key.startswith(prefix):
            txn.put(key, value[:-1] + bytes([value[-1] ^ 0xFF]), db=snapshots)
env.close()
"""


@pytest.mark.parametrize("damage", ["flipped on disk", "saved undecodable"])
def test_a_damaged_index_falls_back_to_listing_every_stream(
    damage: str, store_dir: Path, lmdb_store: EventStore, clock: FakeClock
) -> None:
    _a_log_with_runs(lmdb_store, clock)
    with supervising(lmdb_store, clock) as supervisor:
        assert _swept(supervisor) == ()
    [position] = _index_positions(lmdb_store)
    if damage == "flipped on disk":
        args = (str(store_dir), INDEX_NAME)
        subprocess.run([sys.executable, "-c", _FLIP, *args], check=True, timeout=60)
    else:
        lmdb_store.put_snapshot(
            Snapshot(stream="runtime", name=INDEX_NAME, version=position, position=position,
                     data=b"\xc1not an index")
        )  # fmt: skip
    _write(lmdb_store, clock, "meanwhile", [_spawned()])
    clock.advance(PAST_GHOST_S)
    counting = Counting(lmdb_store)
    with supervising(counting, clock) as supervisor:
        _swept(supervisor)  # with its start's, under way (the listing is read in chunks)
        assert counting.listings == 1
        assert _ghosts(lmdb_store) == {"session:open", "session:meanwhile"}
    assert _index_positions(lmdb_store)[0] > position  # a good one saved again
