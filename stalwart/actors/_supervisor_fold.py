"""The supervisor's view of one run: the run fold plus where its notice goes and how far
the notice got, all read from the run's stream (so a restarted supervisor resumes it)."""

from __future__ import annotations

from typing import cast

import msgspec

from stalwart.events import (
    Event,
    RecordedEvent,
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
    decide_recovery,
    next_notice,
)

from ._subagent import Spawn

__all__ = [
    "RUN_WATCH",
    "UNSUCCESSFUL",
    "NoticeStage",
    "RunWatch",
    "RunWatchAggregate",
    "recovery",
    "respawn",
    "split_spawns",
]

#: How a run ends without success: it gets a failure notice and a recovery decision.
UNSUCCESSFUL = ("timed_out", "swept", "failed")


class RunWatch(msgspec.Struct, frozen=True, kw_only=True):
    run: RunState
    channel: str = ""
    conversation: str = ""
    timeout_reason: str | None = None
    notice_id: str = ""
    notice_text: str = ""
    notice: NoticeStage = "none"

    @property
    def is_run(self) -> bool:
        return self.run.status != "new"


def _notice(state: RunWatch, record: RecordedEvent) -> RunWatch:
    notice = Notice(announcement_id=state.notice_id, text=state.notice_text, stage=state.notice)
    moved = next_notice(notice, record.event)
    if moved is notice:
        return state
    return msgspec.structs.replace(
        state, notice_id=moved.announcement_id, notice_text=moved.text, notice=moved.stage
    )


def apply_watch(state: RunWatch, record: RecordedEvent) -> RunWatch:
    state = msgspec.structs.replace(state, run=RUN.apply(state.run, record))
    match record.event:
        case SubagentSpawned() as spawned:
            return msgspec.structs.replace(
                state,
                channel=spawned.channel,
                conversation=spawned.conversation,
                timeout_reason=spawned.timeout_reason,
            )
        case _:
            return _notice(state, record)


class RunWatchAggregate:
    """RUN plus the notice's channel, conversation and stage."""

    name = "supervisor_run_watch"
    version = 1
    state_type = RunWatch

    def initial(self, stream: str) -> RunWatch:
        return RunWatch(run=RUN.initial(stream))

    def apply(self, state: RunWatch, record: RecordedEvent) -> RunWatch:
        return apply_watch(state, record)

    def folder(self, state: RunWatch) -> ApplyFolder[RunWatch]:
        return ApplyFolder(apply_watch, state)


RUN_WATCH = RunWatchAggregate()


def recovery(
    watch: RunWatch, now: float, *, max_attempts: int, can_split: bool = False
) -> list[Event]:
    """:func:`~stalwart.state.decide_recovery` for a run that ended without success."""
    if watch.run.status not in UNSUCCESSFUL:
        return []
    return list(decide_recovery(watch.run, max_attempts=max_attempts, can_split=can_split))


def respawn(watch: RunWatch, context: str) -> Spawn:
    """The next attempt of the run: same task (plus the continuation context), same limit."""
    run = watch.run
    task = f"{run.task}\n\n{context}" if context else run.task
    custom = run.timeout_knob == "custom_timeout_ms"
    by_default = run.timeout_knob == "max_run_timeout_ms"
    return Spawn(
        run_id=new_id(),
        parent=run.parent or "",
        task=task,
        task_class=None if by_default else cast(TaskClass, run.task_class),
        custom_timeout_ms=run.timeout_ms if custom else None,
        reason=watch.timeout_reason if custom else None,
        max_steps=run.max_steps,
        attempt=run.attempt + 1,
        channel=watch.channel,
        conversation=watch.conversation,
    )


def split_spawns(watch: RunWatch, subtasks: tuple[str, ...]) -> list[Spawn]:
    """One first attempt per subtask of a ``split``: same parent, same limit, same channel."""
    base = respawn(watch, "")
    return [
        msgspec.structs.replace(base, run_id=new_id(), task=subtask, attempt=1)
        for subtask in subtasks
    ]
