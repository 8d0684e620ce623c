"""Supervisor review, session 34: the sweeps at scale (work that grew with every session).

Real parts: an LMDB store in tmp_path (read through :class:`Counting`, which only counts
what the supervisor asks of the real store), a FakeClock-driven Scheduler, a real
IoPortal, MemoryChannels, and real child processes that append to, or damage, the log
while the supervisor runs. Sweeps are asked for (``Sweep``), never waited for.
"""

from __future__ import annotations

import gc
import subprocess
import sys
import tracemalloc
from collections import Counter
from collections.abc import MutableMapping
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, cast

import pykka

from stalwart.actors import Sweep, SweepReport
from stalwart.clock import FakeClock
from stalwart.events import (
    AnnouncementDelivered,
    AnnouncementQueued,
    AnnouncementResent,
    MessageAppended,
    SessionCreated,
    SubagentCompleted,
    SubagentGhostSwept,
)
from stalwart.store import EventStore, read_all_readable
from tests._support_s35 import supervising
from tests.test_supervisor import OWED_S, WAIT, delivered, grown, of, stream
from tests.test_supervisor_review_s32 import _spawned, _write

#: past a formatting run's limit (120 s) and the ghost grace (120 s)
PAST_GHOST_S = 241


class Counting:
    """The real store, and what the supervisor asked of it: stream listings, reads of each
    stream, and where each read of the log began."""

    def __init__(self, inner: EventStore) -> None:
        self.inner = inner
        self.listings = 0
        self.reads: Counter[str] = Counter()
        self.log_reads: list[int] = []

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def forget(self) -> None:
        self.listings, self.reads, self.log_reads = 0, Counter(), []

    def streams(self) -> Any:
        self.listings += 1
        return self.inner.streams()

    def stream_rows(self) -> Any:
        self.listings += 1
        return self.inner.stream_rows()  # type: ignore[attr-defined]

    def read_stream(self, stream: str, from_version: int = 1, to_version: int | None = None) -> Any:
        self.reads[stream] += 1
        return self.inner.read_stream(stream, from_version, to_version)

    def read_all(self, from_position: int = 1, to_position: int | None = None) -> Any:
        self.log_reads.append(from_position)
        return self.inner.read_all(from_position, to_position)


def _sessions(store: EventStore, count: int, first: int = 0) -> None:
    """``count`` agent sessions (no runs), two records each, appended side by side."""

    def one(index: int) -> None:
        store.append(
            f"session:chat-{index}",
            [SessionCreated(), MessageAppended(message_id="m1", role="user", content="hello")],
        )

    with ThreadPoolExecutor(16) as pool:
        list(pool.map(one, range(first, first + count)))


def _more(store: EventStore, sessions: range) -> None:
    for index in sessions:
        store.append(
            f"session:chat-{index}", [MessageAppended(message_id="m2", role="user", content="more")]
        )


def _swept(supervisor: pykka.ActorRef[Any]) -> tuple[str, ...]:
    """What a sweep asked for now swept (a sweep the clock's advance started may have
    swept before it: see :func:`_ghosts`)."""
    report = supervisor.ask(Sweep(), timeout=WAIT)
    assert isinstance(report, SweepReport)
    return report.swept


def _ghosts(store: EventStore) -> set[str]:
    """The runs the log says were swept as ghosts."""
    records = read_all_readable(store)  # past a record damaged on purpose
    return {r.stream for r in records if isinstance(r.event, SubagentGhostSwept)}


def _sessions_read(store: Counting) -> set[str]:
    return {name for name in store.reads if name.startswith("session:")}


def _in_another_process(code: str, *args: str) -> None:
    subprocess.run([sys.executable, "-c", code, *args], check=True, timeout=60)


_APPEND_RUN = """
import sys
from stalwart import store
from stalwart.events import SubagentSpawned
from stalwart.store import NewEvent
spawned = SubagentSpawned(parent="p1", task="left behind", task_class="formatting",
                          timeout_ms=120_000, channel="chat", conversation="conv-1")
with store.open(sys.argv[1]) as log:
    log.append(sys.argv[2], [NewEvent(event=spawned, ts=float(sys.argv[3]))], expected_version=0)
"""

_DAMAGE = """
import sys
import lmdb
env = lmdb.open(sys.argv[1], max_dbs=8)
with env.begin(write=True) as txn:
    log = env.open_db(b"log", txn=txn)
    txn.put(int(sys.argv[2]).to_bytes(8, "big"), b"\\xc1garbage", db=log)
env.close()
"""


# -- what a sweep reads ---------------------------------------------------------------------


# Was: DEFECT: every sweep listed every stream's row (0.23 s a sweep at 100,000 streams)
def test_a_sweep_reads_what_was_appended_since_the_last_not_every_stream(
    lmdb_store: EventStore, clock: FakeClock
) -> None:
    """Each ghost and heartbeat sweep listed every stream of the log (``store.streams()``)
    and compared each session's version with what it had folded, although only streams
    appended to since the previous sweep can have moved: a sweep took 22 ms at 10,000
    streams and 244 ms at 100,000, on this machine, whatever had changed. Now a sweep
    reads the log from where the previous one stopped (0.4 ms and 0.5 ms there, with 100
    appends between sweeps); a session that is no run is not read at all, moved or not,
    and neither is a run whose stream did not move."""
    _sessions(lmdb_store, 300)
    _write(lmdb_store, clock, "r1", [_spawned()])
    counting = Counting(lmdb_store)
    with supervising(counting, clock) as supervisor:
        assert _swept(supervisor) == ()
        head = lmdb_store.head()
        counting.forget()
        _more(lmdb_store, range(0, 300, 10))  # 30 sessions move, the run does not

        assert _swept(supervisor) == ()
        assert counting.listings == 0
        assert _sessions_read(counting) == set()
        assert counting.log_reads == [head + 1]

        _write(lmdb_store, clock, "r1", [SubagentCompleted(result="done")])
        counting.forget()
        assert _swept(supervisor) == ()
        assert counting.listings == 0
        assert _sessions_read(counting) == {"session:r1"}  # the run that moved, only


# Was: DEFECT: the supervisor kept an entry for every session stream it ever saw that is no run
def test_sessions_that_are_no_runs_cost_the_supervisor_no_memory(
    lmdb_store: EventStore, clock: FakeClock
) -> None:
    """The supervisor remembered every session stream that is not a run (``_not_runs``)
    so as not to read it again at the next sweep: about 110 bytes held for the life of
    the process per session ever seen (11 MB at 100,000 sessions). Now a sweep reads
    only what was appended since the last one, and a session that is no run is told by
    its first record there, so nothing is kept for it (0.27 MB held at 100,000)."""
    sessions = 3_000
    _sessions(lmdb_store, sessions)
    with supervising(lmdb_store, clock) as supervisor:  # what a first start imports
        assert _swept(supervisor) == ()
    _more(lmdb_store, range(sessions))  # (what the store keeps of its appends: before)
    gc.collect()
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        with supervising(lmdb_store, clock) as supervisor:
            assert _swept(supervisor) == ()
            gc.collect()
            held = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    assert held < sessions * 50, held  # 128 bytes a session before, 19 now


# -- what the sweeps still find ---------------------------------------------------------------


def test_a_run_another_process_appends_between_sweeps_is_swept(
    store_dir: Path, lmdb_store: EventStore, clock: FakeClock
) -> None:
    _sessions(lmdb_store, 50)
    counting = Counting(lmdb_store)
    with supervising(counting, clock) as supervisor:
        assert _swept(supervisor) == ()
        _in_another_process(_APPEND_RUN, str(store_dir), "session:elsewhere", str(clock.now()))
        _more(lmdb_store, range(5))
        assert _swept(supervisor) == ()  # found, running, not due yet
        clock.advance(PAST_GHOST_S)
        _swept(supervisor)
        assert _ghosts(lmdb_store) == {"session:elsewhere"}
        assert counting.listings == 1  # the first sweep's, only


def test_a_restarted_supervisor_finds_every_open_run(
    lmdb_store: EventStore, clock: FakeClock
) -> None:
    _sessions(lmdb_store, 50)
    _write(lmdb_store, clock, "seen", [_spawned()])
    counting = Counting(lmdb_store)
    with supervising(counting, clock) as supervisor:
        assert _swept(supervisor) == ()
    _write(lmdb_store, clock, "unseen", [_spawned()])  # while no supervisor runs
    _more(lmdb_store, range(5))
    clock.advance(PAST_GHOST_S)
    with supervising(counting, clock) as supervisor:
        assert _swept(supervisor) == ()  # its start swept them
        assert _ghosts(lmdb_store) == {"session:seen", "session:unseen"}


def test_a_run_set_aside_is_decided_on_again_when_its_stream_moves(
    lmdb_store: EventStore, clock: FakeClock
) -> None:
    """A run with nothing left to decide is set aside with its version only; when its
    stream moves on (here a completion queued again that no send ever ended), the sweep
    that reads the append folds it again and decides: the completion is sent again."""
    done = [
        _spawned(announce=True),
        SubagentCompleted(result="42 invoices"),
        AnnouncementQueued(announcement_id="c1", channel="chat", kind="completion", text="42"),
        AnnouncementDelivered(announcement_id="c1", path="announce"),
    ]
    _write(lmdb_store, clock, "done", done)
    counting = Counting(lmdb_store)
    with grown(cast(EventStore, counting), clock) as tree:
        tree.supervisor.ask(Sweep(), timeout=WAIT)
        counting.forget()
        tree.supervisor.ask(Sweep(), timeout=WAIT)
        assert counting.reads["session:done"] == 0  # set aside, not read again

        again = AnnouncementQueued(
            announcement_id="c2", channel="chat", kind="completion", text="42 again"
        )
        _write(lmdb_store, clock, "done", [again])
        clock.advance(OWED_S)
        tree.supervisor.ask(Sweep(), timeout=WAIT)
        [message] = delivered(tree.portal, tree.chat, 1)
        assert (message.text, message.idempotency_key) == ("42 again", "c2")
        assert of(stream(lmdb_store, "done"), AnnouncementResent) == [
            AnnouncementResent(announcement_id="c2")
        ]


def test_a_record_that_cannot_be_read_since_the_last_sweep_leaves_no_run_unseen(
    store_dir: Path,
    lmdb_store: EventStore,
    clock: FakeClock,
    logs: list[MutableMapping[str, Any]],
) -> None:
    """The log read from the last sweep's head stops at a record that cannot be read,
    whose stream it cannot name: that sweep lists the streams' rows instead (those that
    moved since are read), so a run that began after the damage is still found; it is
    reported once and the sweeps after it read the log again."""
    _sessions(lmdb_store, 20)
    counting = Counting(lmdb_store)
    with supervising(counting, clock) as supervisor:
        assert _swept(supervisor) == ()
        [damaged] = lmdb_store.append(
            "session:chat-3", [MessageAppended(message_id="m2", role="user", content="more")]
        )
        _write(lmdb_store, clock, "after", [_spawned()])
        _in_another_process(_DAMAGE, str(store_dir), str(damaged.position))
        counting.forget()
        assert _swept(supervisor) == ()
        assert counting.listings == 1
        clock.advance(PAST_GHOST_S)
        _swept(supervisor)
        assert _ghosts(lmdb_store) == {"session:after"}
        assert counting.listings == 1
        reported = [e for e in logs if e["event"] == "supervisor.log_record_unreadable"]
        assert [e["position"] for e in reported] == [damaged.position]
