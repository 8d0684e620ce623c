"""Supervisor review, session 32: what a long-lived supervisor keeps, and its start.

Real parts: an LMDB store in tmp_path, a FakeClock-driven Scheduler, a real IoPortal,
MemoryChannels, the supervisor and dead-letter actors of ``tests/test_supervisor.py``'s
tree. Runs a process finished earlier are written to the log as that process wrote them.
"""

from __future__ import annotations

import gc
import tracemalloc
from collections.abc import MutableMapping
from pathlib import Path
from typing import Any

import lmdb

from stalwart import store as store_module
from stalwart.actors import Sweep, SweepReport
from stalwart.clock import FakeClock
from stalwart.events import (
    AnnouncementDelivered,
    AnnouncementQueued,
    Event,
    SubagentCompleted,
    SubagentGhostSwept,
    SubagentRecoveryDecided,
    SubagentSpawned,
    SubagentWatchdogTimeout,
)
from stalwart.store import EventStore, NewEvent
from tests.test_supervisor import WAIT, grown, stream, until

#: how many finished runs the log holds, and how long each one's result is
FINISHED = 200
RESULT_CHARS = 40_000


def _spawned(**fields: object) -> SubagentSpawned:
    base: dict[str, object] = {
        "parent": "p1",
        "task": "summarise the report",
        "task_class": "formatting",
        "timeout_ms": 120_000,
        "channel": "chat",
        "conversation": "conv-1",
    }
    return SubagentSpawned(**(base | fields))  # type: ignore[arg-type]


def _write(store: EventStore, clock: FakeClock, run_id: str, events: list[Event]) -> None:
    store.append(f"session:{run_id}", [NewEvent(event=e, ts=clock.now()) for e in events])


def _finished_runs(store: EventStore, clock: FakeClock) -> None:
    """What a long-lived runtime leaves: runs that succeeded (each with a long result,
    announced and delivered), and one that timed out, was told and escalated."""
    for index in range(FINISHED):
        _write(
            store,
            clock,
            f"ok{index}",
            [
                _spawned(announce=True),
                SubagentCompleted(result=f"{index}:" + "x" * RESULT_CHARS),
                AnnouncementQueued(
                    announcement_id=f"c{index}", channel="chat", kind="completion", text="done"
                ),
                AnnouncementDelivered(announcement_id=f"c{index}", path="announce"),
            ],
        )
    _write(
        store,
        clock,
        "late",
        [
            _spawned(announce=True, attempt=2),
            SubagentWatchdogTimeout(
                deadline=clock.now(), limit_ms=120_000, knob="class_timeouts_ms", elapsed_ms=0
            ),
            AnnouncementQueued(
                announcement_id="n1", channel="chat", kind="failure_notice", text="notice"
            ),
            AnnouncementDelivered(announcement_id="n1", path="announce"),
            SubagentRecoveryDecided(action="escalate", reason="max_attempts", attempt=2),
        ],
    )


# -- what a long-lived supervisor keeps ---------------------------------------------------------


# Was: DEFECT: the supervisor held every run it ever folded (results too), each re-decided per sweep
def test_runs_with_nothing_left_to_decide_are_not_kept_in_memory(
    lmdb_store: EventStore, clock: FakeClock
) -> None:
    """A supervisor kept the fold of every run it had seen, results included, for the
    life of the process, and ran every decision on each of them at every sweep: memory
    and sweep time grew with every run ever finished (20,000 finished runs: 57 MB held,
    a sweep 80 ms, on this machine). Now a run with nothing left to decide is set aside
    (its stream's version kept, 2 MB and 40 ms there, the rest the store's stream list);
    ``GetRuns`` still answers every run, read back from the log, and a run set aside
    whose stream moves on is folded again."""
    _finished_runs(lmdb_store, clock)
    gc.collect()
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        with grown(lmdb_store, clock) as tree:
            report = tree.supervisor.ask(Sweep(), timeout=WAIT)
            assert report == SweepReport()
            gc.collect()
            held = tracemalloc.get_traced_memory()[0] - before
            tracemalloc.stop()
            # the results alone are FINISHED x RESULT_CHARS = 8 MB
            assert held < FINISHED * RESULT_CHARS / 4, held

            runs = tree.barrier()
            assert len(runs) == FINISHED + 1
            assert runs["session:ok7"].run.result.startswith("7:")
            assert runs["session:ok7"].completion == "ended"
            late = runs["session:late"]
            assert late.run.recovery is not None
            assert late.run.recovery.action == "escalate"
            assert not late.run.late_completion

            # the late run's own result comes in after all: folded again
            _write(lmdb_store, clock, "late", [SubagentCompleted(result="after all")])
            tree.supervisor.ask(Sweep(), timeout=WAIT)
            assert tree.barrier()["session:late"].run.late_completion
    finally:
        tracemalloc.stop()


# -- a damaged stream row -----------------------------------------------------------------------


def _damage_stream_row(store_dir: Path, stream: str) -> None:
    """Overwrite a stream's row in the ``streams`` sub-database from outside the store
    (damage on disk), the store closed."""
    env = lmdb.open(str(store_dir), max_dbs=8)
    try:
        db = env.open_db(b"streams")
        with env.begin(write=True) as txn:
            assert txn.get(stream.encode(), db=db) is not None
            txn.put(stream.encode(), b"\xc1", db=db)
    finally:
        env.close()


# Was: DEFECT: one damaged stream row made every sweep fail and the supervisor crash at start
def test_a_damaged_stream_row_leaves_the_other_runs_watched(
    store_dir: Path, clock: FakeClock, logs: list[MutableMapping[str, Any]]
) -> None:
    """The sweeps list the streams with ``store.streams()``, which raises at the first
    row it cannot read: with one damaged row every sweep failed (``sweep_failed``), and
    the supervisor's start, which sweeps, crashed, so it was restarted into the same
    crash and given up on, taking the restarts of every Agent with it. Now the damaged
    stream is reported once and left out; the other runs are still watched."""
    with store_module.open(store_dir, clock=clock) as store:
        _write(store, clock, "bad", [_spawned()])
        _write(store, clock, "r1", [_spawned()])  # a formatting run a dead process left
    _damage_stream_row(store_dir, "session:bad")
    clock.advance(241)  # past r1's limit (120 s) and the ghost grace (120 s)
    with store_module.open(store_dir, clock=clock) as store, grown(store, clock) as tree:
        tree.supervisor.ask(Sweep(), timeout=WAIT)  # alive, and sweeps again
        until(store, lambda: [e for e in stream(store, "r1") if isinstance(e, SubagentGhostSwept)])
        reported = [e for e in logs if e["event"] == "supervisor.stream_row_unreadable"]
        assert [e["stream"] for e in reported] == ["session:bad"]
