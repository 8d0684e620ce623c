"""The supervisor's view of one run: the run fold plus where its notice goes and how far
the notice got, and how far a success's completion announcement got, all read from the
run's stream (so a restarted supervisor resumes it); and its index of every run, saved
as a snapshot (:class:`RunIndex`) so that a restarted supervisor reads the log from where
the index was saved instead of every session stream."""

from __future__ import annotations

from typing import Literal, cast

import msgspec

from stalwart._logs import get_logger
from stalwart.events import (
    AnnouncementDelivered,
    AnnouncementFallbackDirect,
    AnnouncementQueued,
    AnnouncementResent,
    AnnouncementSendFailed,
    Event,
    RecordedEvent,
    SubagentRecoveryDecided,
    SubagentSpawned,
    TaskClass,
)
from stalwart.ids import new_id
from stalwart.state import (
    RUN,
    ApplyFolder,
    Notice,
    NoticeStage,
    RunState,
    batch_text,
    continued_task,
    decide_recovery,
    next_notice,
)
from stalwart.state import SUBSESSION_CHANNEL_PREFIX as _PRIVATE
from stalwart.store import EventStore, Snapshot

from ._restarts import RESTART_STREAM
from ._subagent import Spawn

__all__ = [
    "INDEX_NAME",
    "MAX_NOTICE_HOLD_MS",
    "RUN_WATCH",
    "UNSUCCESSFUL",
    "NoticeStage",
    "RunIndex",
    "RunWatch",
    "RunWatchAggregate",
    "completion_interrupted",
    "load_index",
    "next_run_ids",
    "notice_interrupted",
    "owed_completion",
    "recovery",
    "respawn",
    "save_index",
    "settled",
    "split_spawns",
]

log = get_logger(__name__)

#: How a run ends without success: it gets a failure notice and a recovery decision.
UNSUCCESSFUL = ("timed_out", "swept", "failed")

#: The longest a notice's direct send waits for the Retry-After its announce send's
#: receiver asked for (an hour, the dead-letter queue's default ``max_age_ms``): a longer
#: hint is the queue's to wait out, once the direct send fails too.
MAX_NOTICE_HOLD_MS = 3_600_000

#: How far a success's completion announcement got: none yet, queued (its send under
#: way, or cut short by a crash), ended (delivered, or failed and dead-lettered).
CompletionStage = Literal["none", "queued", "ended"]


class RunWatch(msgspec.Struct, frozen=True, kw_only=True):
    run: RunState
    channel: str = ""
    conversation: str = ""
    thread: str | None = None
    timeout_reason: str | None = None
    notice_id: str = ""
    notice_text: str = ""
    notice: NoticeStage = "none"
    #: when the notice reached its stage (``queued``: its announce send began;
    #: ``fallback``: its direct send was owed)
    notice_at: float | None = None
    #: how long after ``notice_at`` a ``fallback`` notice's direct send waits: the
    #: Retry-After the announce send's receiver asked for (capped at
    #: :data:`MAX_NOTICE_HOLD_MS`); 0 once the notice is sent again
    notice_hold_ms: int = 0
    #: ``subagent:spawned``'s ``announce`` (None: not recorded, nothing is owed)
    announce: bool | None = None
    completion_id: str = ""
    completion_text: str = ""
    #: the run whose stream records the batch's text ("": this one's; see
    #: ``AnnouncementQueued.text_run``)
    completion_text_run: str = ""
    completion_at: float | None = None
    completion: CompletionStage = "none"
    #: ``subagent:spawned``'s ``next_run_id`` (None in logs written before it)
    next_run_id: str | None = None
    #: when ``subagent:recovery_decided`` was recorded
    recovery_at: float | None = None

    @property
    def is_run(self) -> bool:
        return self.run.status != "new"


def _notice(state: RunWatch, record: RecordedEvent) -> RunWatch:
    notice = Notice(announcement_id=state.notice_id, text=state.notice_text, stage=state.notice)
    moved = next_notice(notice, record.event)
    if moved is notice:
        return state
    return msgspec.structs.replace(
        state,
        notice_id=moved.announcement_id,
        notice_text=moved.text,
        notice=moved.stage,
        notice_at=record.ts if moved.stage != notice.stage else state.notice_at,
        notice_hold_ms=_hold_ms(record.event) if moved.stage == "fallback" else 0,
    )


def _hold_ms(event: Event) -> int:
    """How long a notice's direct send waits after ``announcement:fallback_direct``."""
    hint = event.retry_after_ms if isinstance(event, AnnouncementFallbackDirect) else None
    return 0 if hint is None else max(0, min(hint, MAX_NOTICE_HOLD_MS))


def apply_watch(state: RunWatch, record: RecordedEvent) -> RunWatch:
    state = msgspec.structs.replace(state, run=RUN.apply(state.run, record))
    match record.event:
        case SubagentSpawned() as spawned:
            return msgspec.structs.replace(
                state,
                channel=spawned.channel,
                conversation=spawned.conversation,
                thread=spawned.thread,
                timeout_reason=spawned.timeout_reason,
                announce=spawned.announce,
                next_run_id=spawned.next_run_id,
            )
        case SubagentRecoveryDecided() if state.recovery_at is None:
            return msgspec.structs.replace(state, recovery_at=record.ts)
        case AnnouncementQueued(kind="completion") as queued if not queued.channel.startswith(
            _PRIVATE
        ):
            return msgspec.structs.replace(
                state,
                completion_id=queued.announcement_id,
                completion_text=queued.text,
                completion_text_run=queued.text_run or "",
                completion_at=record.ts,
                completion="queued",
            )
        case AnnouncementDelivered() | AnnouncementSendFailed() if (
            state.completion == "queued" and record.event.announcement_id == state.completion_id
        ):
            return msgspec.structs.replace(state, completion="ended")
        case AnnouncementResent() if record.event.announcement_id == state.notice_id:
            return msgspec.structs.replace(state, notice_at=record.ts, notice_hold_ms=0)
        case AnnouncementResent() if (
            state.completion == "queued" and record.event.announcement_id == state.completion_id
        ):
            return msgspec.structs.replace(state, completion_at=record.ts)
        case _:
            return _notice(state, record)


class RunWatchAggregate:
    """RUN plus the notice's channel, conversation and stage."""

    name = "supervisor_run_watch"
    #: 4: notice_at; 5: host_work; 6: next_run_id, recovery_at; 7: notice_hold_ms,
    #: completion_text_run
    version = 7
    state_type = RunWatch

    def initial(self, stream: str) -> RunWatch:
        return RunWatch(run=RUN.initial(stream))

    def apply(self, state: RunWatch, record: RecordedEvent) -> RunWatch:
        return apply_watch(state, record)

    def folder(self, state: RunWatch) -> ApplyFolder[RunWatch]:
        return ApplyFolder(apply_watch, state)


RUN_WATCH = RunWatchAggregate()


def settled(watch: RunWatch) -> bool:
    """Whether the supervisor has nothing left to decide for the run while its stream
    stays as it is: it ended, and its notice and recovery decision (a run that did not
    succeed) or its owed completion announcement (one that did) are in the log with
    their outcome."""
    run = watch.run
    if run.status in UNSUCCESSFUL:
        return watch.notice in ("delivered", "failed") and run.recovery is not None
    if run.status == "succeeded":
        return watch.announce is not True or watch.completion == "ended"
    return False


def recovery(
    watch: RunWatch,
    now: float,
    *,
    max_attempts: int,
    can_split: bool = False,
    can_respawn: bool = True,
) -> list[Event]:
    """:func:`~stalwart.state.decide_recovery` for a run that ended without success."""
    if watch.run.status not in UNSUCCESSFUL:
        return []
    return list(
        decide_recovery(
            watch.run, max_attempts=max_attempts, can_split=can_split, can_respawn=can_respawn
        )
    )


def owed_completion(watch: RunWatch, now: float, *, wait_s: float, channel: str) -> list[Event]:
    """A success announced to nobody ``wait_s`` after it ended: queue its announcement.

    The announcer sends a completion at most ``announce_max_wait_ms`` after it ends, and
    records it first (``announcement:queued``, kind ``completion``); one still unrecorded
    ``wait_s`` later was lost with the announcer (a crash of it or of its process). Only
    runs that recorded ``announce=True`` are owed one.
    """
    run = watch.run
    if run.status != "succeeded" or watch.announce is not True or watch.completion != "none":
        return []
    if run.ended_at is None or now < run.ended_at + wait_s:
        return []
    run_id = run.stream.removeprefix("session:")
    text = batch_text(((run_id, run.result),))
    return [
        AnnouncementQueued(
            announcement_id=new_id(), channel=watch.channel or channel, kind="completion",
            text=text,
        )
    ]  # fmt: skip


def completion_interrupted(watch: RunWatch, now: float, *, wait_s: float) -> list[Event]:
    """The ``announcement:resent`` of the run's completion when it was queued (or last
    resent) ``wait_s`` ago and its send never ended (every send is bounded, and its
    outcome recorded): a crash cut it short. Recorded before the send, it starts the wait
    again for every other supervisor."""
    if (
        watch.announce is True
        and watch.completion == "queued"
        and watch.completion_at is not None
        and now >= watch.completion_at + wait_s
    ):
        return [AnnouncementResent(announcement_id=watch.completion_id)]
    return []


def notice_interrupted(
    watch: RunWatch, now: float, *, wait_s: float, held: bool = True
) -> list[Event]:
    """The ``announcement:resent`` of the run's notice when it is queued (or fell back to
    a direct send) and its latest send began ``wait_s`` ago or more with no outcome:
    longer than a send can take, so no sender, in this process or another on the same
    log, still has it in flight. A direct send ``held`` for the receiver's Retry-After
    (``notice_hold_ms``) begins that much later. Recorded before the send, it starts the
    wait again for every other supervisor."""
    if watch.notice not in ("queued", "fallback"):
        return []
    hold_s = watch.notice_hold_ms / 1000 if held and watch.notice == "fallback" else 0.0
    if watch.notice_at is not None and now < watch.notice_at + hold_s + wait_s:
        return []
    return [AnnouncementResent(announcement_id=watch.notice_id)]


def next_run_ids(watch: RunWatch) -> tuple[str, ...]:
    """The ids of the runs the run's recovery decision starts, as its spawn named them
    (``next_run_id``): one for a respawn, one per subtask for a split (``<id>-1``, ...).
    () for a decision that starts none, and for a run whose spawn named none (a log
    written before it: those runs got ids of their own when started)."""
    decided, named = watch.run.recovery, watch.next_run_id
    if decided is None or not named:
        return ()
    if decided.action in ("respawn", "respawn_continue"):
        return (named,)
    if decided.action == "split":
        return tuple(f"{named}-{n}" for n in range(1, len(decided.subtasks) + 1))
    return ()


def respawn(watch: RunWatch, context: str) -> Spawn:
    """The next attempt of the run: same task (plus the continuation context), same limit;
    ``retry_of`` names the run, so the host's runtime runs its own work again (another
    run may have the same parent and task, and a work of its own). Its id is the one the
    run's spawn named (:func:`next_run_ids`), else a new one."""
    run = watch.run
    task = continued_task(run.task, context)
    custom = run.timeout_knob == "custom_timeout_ms"
    by_default = run.timeout_knob == "max_run_timeout_ms"
    return Spawn(
        run_id=watch.next_run_id or new_id(),
        parent=run.parent or "",
        task=task,
        task_class=None if by_default else cast(TaskClass, run.task_class),
        custom_timeout_ms=run.timeout_ms if custom else None,
        reason=watch.timeout_reason if custom else None,
        max_steps=run.max_steps,
        attempt=run.attempt + 1,
        channel=watch.channel,
        conversation=watch.conversation,
        thread=watch.thread,
        announce=watch.announce,
        split_from=run.split_from,
        retry_of=run.stream.removeprefix("session:"),
    )


def split_spawns(watch: RunWatch, subtasks: tuple[str, ...]) -> list[Spawn]:
    """One first attempt per subtask of a ``split``: same parent, same limit, same channel.
    Each is announced, whatever the split run asked: its handle has ended already (timed
    out or failed), so the announcement is the only way its result reaches anyone. Their
    ids are the ones :func:`next_run_ids` names for the recorded split, else new ones."""
    base = respawn(watch, "")
    named = next_run_ids(watch)
    if len(named) != len(subtasks):
        named = tuple(new_id() for _ in subtasks)
    return [
        msgspec.structs.replace(
            base,
            run_id=run_id,
            task=subtask,
            attempt=1,
            announce=True,
            split_from=watch.run.stream.removeprefix("session:"),
        )
        for run_id, subtask in zip(named, subtasks, strict=True)
    ]


# -- the index of every run, kept across restarts ------------------------------------------

#: The snapshot the run index is saved as (of the ``runtime`` stream, whose version it
#: does not follow: its version is the log position it covers).
INDEX_NAME = "supervisor_runs@v1"


class RunIndex(msgspec.Struct, frozen=True, kw_only=True):
    """What the sweeps learned of the log up to a position: every run, and nothing of the
    sessions that are no runs. Derived data, as any snapshot: without it a supervisor lists
    every stream and reads the first records of each session stream."""

    #: the runs to fold again from their start (those in play, and those set aside while a
    #: next run they name is not in the log: a process holding its code may start it), and
    #: the streams left alone (read again: reported again, or repaired meanwhile)
    reread: tuple[str, ...] = ()
    #: the runs set aside (nothing left to decide), each with the version it was folded at
    settled: dict[str, int] = {}
    #: the completion ids of the runs set aside
    batches: tuple[str, ...] = ()


def save_index(store: EventStore, index: RunIndex, position: int) -> None:
    """Save ``index`` as covering the log up to ``position`` (StoreError when refused)."""
    data = msgspec.msgpack.encode(index)
    snapshot = Snapshot(
        stream=RESTART_STREAM, name=INDEX_NAME, version=position, position=position, data=data
    )
    store.put_snapshot(snapshot)


def load_index(store: EventStore, head: int) -> tuple[int, RunIndex] | None:
    """The newest saved index that decodes and covers no more than the log holds (``head``),
    with the position it covers; None when there is none (list every stream then)."""
    for snapshot in store.snapshots(RESTART_STREAM, INDEX_NAME):
        if snapshot.position > head:  # not of this log as it is now
            log.warning("supervisor.index_unusable", position=snapshot.position, head=head)
            continue
        try:
            index = msgspec.msgpack.decode(snapshot.data, type=RunIndex)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            log.warning(
                "supervisor.index_unusable", position=snapshot.position, error=type(exc).__name__
            )
            continue
        return snapshot.position, index
    return None
