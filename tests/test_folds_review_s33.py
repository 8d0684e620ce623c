"""Folds, snapshots and replay determinism (session 33 review): a run's snapshot of the
fold before ``split_from`` is not read as the run's state, and the operator's projection
folds a dead-letter backlog in time linear in its events."""

from __future__ import annotations

import time

import msgspec

from stalwart.events import (
    AnnouncementDeadLetterDelivered,
    AnnouncementDeadLettered,
    AnnouncementDeadLetterRetried,
    Event,
    RecordedEvent,
    SubagentProgress,
    SubagentSpawned,
    SubagentWatchdogTimeout,
)
from stalwart.state import (
    DEADLETTER,
    RUN,
    OrchestratorFolder,
    RunState,
    decide_recovery,
    fold,
)
from stalwart.store import EventStore, Snapshot, load_state

RUN_STREAM = "session:run-split-1"


def _split_subtask(store: EventStore) -> None:
    """A split's subtask on its last attempt, timed out after two steps."""
    events: list[Event] = [
        SubagentSpawned(
            parent="chat-1",
            task="format the second half",
            task_class="formatting",
            timeout_ms=120_000,
            attempt=3,
            split_from="run-split",
        ),
        SubagentProgress(tokens=120, step=1),
        SubagentProgress(tokens=260, step=2),
        SubagentWatchdogTimeout(deadline=0.0, limit_ms=120_000, knob="k", elapsed_ms=120_000),
    ]
    store.append(RUN_STREAM, events)


def _before_split_from(state: RunState) -> bytes:
    """``state`` as the run fold wrote it before it kept ``split_from`` (same name and
    version number, one field fewer)."""
    fields = msgspec.to_builtins(state)
    del fields["split_from"]
    return msgspec.msgpack.encode(fields)


# Was: DEFECT: RunState got split_from with no fold version bump: a v2 snapshot read it as None
def test_a_run_snapshot_of_the_fold_before_split_from_is_not_read(
    lmdb_store: EventStore,
) -> None:
    """A ``subagent_run@v2`` snapshot saved by the fold before ``split_from`` (the
    SubAgent's own loads save one every 500 events; ``stalwart replay`` reads them)
    decoded with ``split_from`` None: the split's subtask replayed as a first run, which
    the recovery policy would split again. The fold's version moved on, so that snapshot
    is passed over for the full fold."""
    _split_subtask(lmdb_store)
    full = load_state(lmdb_store, RUN_STREAM, RUN, use_snapshots=False, snapshot_every=0)
    assert full.split_from == "run-split"
    old = Snapshot(
        stream=RUN_STREAM,
        name="subagent_run@v2",
        version=full.version,
        position=lmdb_store.stream_version(RUN_STREAM),
        data=_before_split_from(full),
    )
    lmdb_store.put_snapshot(old)
    assert list(lmdb_store.snapshots(RUN_STREAM, "subagent_run@v2"))  # it is there to read

    replayed = load_state(lmdb_store, RUN_STREAM, RUN, snapshot_every=0)

    assert replayed == full
    [decided] = decide_recovery(replayed, max_attempts=3, can_split=True)
    assert decided.action == "escalate"  # a subtask is never split again


# -- the operator's projection over a dead-letter backlog ------------------------------------


def _deadletter_records(backlog: int, tail: int) -> tuple[list[RecordedEvent], list[RecordedEvent]]:
    """``backlog`` undelivered entries queued, then ``tail`` events on the queue (a retry
    and a delivery of each of its first entries)."""

    def recorded(position: int, event: Event) -> RecordedEvent:
        return RecordedEvent(
            position=position,
            stream="deadletter",
            version=position,
            ts=1_800_000_000.0 + position,
            id=f"e{position}",
            causation_id=None,
            correlation_id=None,
            schema=1,
            event=event,
        )

    queued = [
        recorded(
            n,
            AnnouncementDeadLettered(
                entry_id=f"d{n}",
                announcement_id=f"a{n}",
                channel="chat",
                text="your report is ready",
                reason="timeout",
                conversation=f"chat-{n}",
            ),
        )
        for n in range(1, backlog + 1)
    ]
    events: list[Event] = []
    for n in range(1, tail // 2 + 1):
        events.append(AnnouncementDeadLetterRetried(entry_id=f"d{n}", attempt=1))
        events.append(AnnouncementDeadLetterDelivered(entry_id=f"d{n}", attempts=1))
    later = [recorded(backlog + i, event) for i, event in enumerate(events, start=1)]
    return queued, later


def _seconds_to_fold(backlog: int, tail: int) -> float:
    """The least of three runs' seconds to fold ``tail`` events of a queue already holding
    ``backlog`` entries into the projection (the queue itself checked against its fold)."""
    queued, later = _deadletter_records(backlog, tail)
    best = float("inf")
    for _ in range(3):
        folder = OrchestratorFolder()
        for record in queued:
            folder.add(record)
        began = time.perf_counter()
        for record in later:
            folder.add(record)
        best = min(best, time.perf_counter() - began)
        assert folder.state().deadletter == fold(DEADLETTER, "deadletter", [*queued, *later])
    return best


# Was: DEFECT: the projection copied the whole dead-letter queue per event (quadratic)
def test_the_projection_folds_a_dead_letter_backlog_in_linear_time() -> None:
    """``stalwart status``, ``watch`` and ``session show`` fold the ``deadletter`` stream
    through the orchestrator. It copied the whole queue for every event of the stream, so
    a backlog of thousands of undelivered messages (a channel down for an hour) took
    minutes to show. An event now costs the same whatever the backlog: 1,000 events on
    a queue of 16,000 cost about what they cost on a queue of 1,000."""
    small = _seconds_to_fold(1_000, 1_000)
    large = _seconds_to_fold(16_000, 1_000)
    assert large < 4 * small + 0.02, (
        f"{small * 1e3:.1f} ms at 1,000, {large * 1e3:.1f} ms at 16,000"
    )
