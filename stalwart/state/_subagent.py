"""Sub-agent runs: the fold of a run's stream and the pure watchdog, ghost, heartbeat and
recovery decisions (seeds 000 and 002).

A run is a session stream of its own (``session:<id>``) whose ``subagent:spawned`` names
its ``parent``. Its timeouts combine the two seeds as follows:

* **Run limit** (seed 002, "every spawn has a timeout, no exceptions"): the spawn's own
  ``timeout_ms``, from its task class (``class_timeouts_ms``), a custom timeout with a
  stated reason (up to ``custom_max_ms``), or ``max_run_timeout_ms`` when it names neither
  (:func:`spawn_timeout`). Seed 000's ``maxRunTimeoutMs`` is thus the default run limit.
* **Watchdog** (seed 000): ``min(max_steps x per_step_timeout_ms, run limit)``, or the run
  limit when ``max_steps`` is unset; fires exactly at ``started_at + limit``, once.
* **Ghost sweep** (seed 000): a run still ``running`` at ``started_at + run limit +
  ghost_grace_ms`` is swept (the safety net when the watchdog itself never fired).
* **Heartbeat** (seed 002, detection only): see :func:`decide_suspicious`.

Times are unix seconds (events' ``ts``); durations are milliseconds (the knobs').
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Literal

import msgspec

from stalwart.errors import SpawnRefusedError
from stalwart.events import (
    Event,
    RecordedEvent,
    SubagentArtifact,
    SubagentCompleted,
    SubagentGhostSwept,
    SubagentGivenUp,
    SubagentProgress,
    SubagentRecoveryDecided,
    SubagentSpawned,
    SubagentSuspicious,
    SubagentWatchdogTimeout,
)

from ._aggregate import ApplyFolder

RunStatus = Literal["new", "running", "succeeded", "failed", "timed_out", "swept"]
RecoveryAction = Literal["deliver", "respawn_continue", "respawn", "escalate", "split"]

#: the knob that binds the watchdog when the step budget is the smaller limit
STEP_KNOB = "max_steps x per_step_timeout_ms"
_FORCE_FAILED = ("timed_out", "swept")
_ENDED = ("succeeded", "failed", *_FORCE_FAILED)


class Artifact(msgspec.Struct, frozen=True, kw_only=True, gc=False):
    path: str
    sha256: str
    final: bool = False


class Recovery(msgspec.Struct, frozen=True, kw_only=True, gc=False):
    action: RecoveryAction
    reason: str
    context: str = ""
    subtasks: tuple[str, ...] = ()


class RunState(msgspec.Struct, frozen=True, kw_only=True, gc=False):
    """A sub-agent run as its stream says it is; ``status`` is ``new`` until the spawn."""

    stream: str
    version: int = 0
    status: RunStatus = "new"
    parent: str | None = None
    task: str = ""
    task_class: str = ""
    timeout_ms: int = 0
    timeout_knob: str = ""
    max_steps: int | None = None
    attempt: int = 1
    started_at: float | None = None
    ended_at: float | None = None
    tokens: int = 0
    step: int = 0
    tokens_grew_at: float | None = None
    suspected_growth_at: float | None = None
    artifacts: tuple[Artifact, ...] = ()
    result: str = ""
    late_completion: bool = False
    recovery: Recovery | None = None
    #: ``subagent:spawned``'s ``host_work``: the run ran the host's own code
    host_work: bool | None = None
    #: ``subagent:spawned``'s ``split_from``: the lineage is a split's subtask
    split_from: str | None = None


# -- spawn --------------------------------------------------------------------------------


def spawn_timeout(
    task_class: str | None,
    custom_timeout_ms: int | None,
    reason: str | None,
    *,
    class_timeouts_ms: Mapping[str, int],
    custom_max_ms: int,
    default_ms: int,
) -> tuple[int, str]:
    """A spawn's mandatory timeout and the knob that bound it (seed 002, layer 1).

    A known task class gets its ``class_timeouts_ms`` entry; a custom timeout (``task_class``
    ``"custom"`` or None) needs an int (not a float, not a bool) with ``1 <=
    custom_timeout_ms <= custom_max_ms`` and a stated reason; a spawn naming neither gets
    ``default_ms`` (``max_run_timeout_ms``). Anything else raises
    :class:`SpawnRefusedError`: no spawn goes without a timeout.
    """
    if task_class is not None and task_class != "custom":
        if task_class not in class_timeouts_ms:
            allowed = ", ".join(repr(c) for c in (*sorted(class_timeouts_ms), "custom"))
            raise SpawnRefusedError(
                f"unknown task class {task_class!r}; allowed: {allowed}", field="task_class"
            )
        if custom_timeout_ms is not None:
            raise SpawnRefusedError(
                f"task class {task_class!r} has its own timeout; give a class or a custom "
                "timeout, not both",
                field="custom_timeout_ms",
            )
        return class_timeouts_ms[task_class], f"class_timeouts_ms.{task_class}"
    if custom_timeout_ms is None:
        if task_class == "custom":
            raise SpawnRefusedError(
                "a custom spawn needs custom_timeout_ms", field="custom_timeout_ms"
            )
        return default_ms, "max_run_timeout_ms"
    if isinstance(custom_timeout_ms, bool) or not isinstance(custom_timeout_ms, int):
        raise SpawnRefusedError(  # a float or a bool would pass the range check below
            "custom_timeout_ms must be an integer number of milliseconds, found "
            f"{type(custom_timeout_ms).__name__} {custom_timeout_ms!r}",
            field="custom_timeout_ms",
        )
    if not 1 <= custom_timeout_ms <= custom_max_ms:
        raise SpawnRefusedError(
            f"custom_timeout_ms must be between 1 and {custom_max_ms} (custom_max_ms), "
            f"found {custom_timeout_ms}",
            field="custom_timeout_ms",
        )
    if not reason or not reason.strip():
        raise SpawnRefusedError(
            "a custom timeout needs a stated reason, found none", field="reason"
        )
    return custom_timeout_ms, "custom_timeout_ms"


def _spawn_knob(event: SubagentSpawned) -> str:
    if event.timeout_knob:
        return event.timeout_knob
    if event.task_class == "custom":
        return "custom_timeout_ms"
    return f"class_timeouts_ms.{event.task_class}"


# -- the fold -----------------------------------------------------------------------------


def _spawned(state: RunState, event: SubagentSpawned, ts: float) -> RunState:
    return msgspec.structs.replace(
        state,
        status="running",
        parent=event.parent,
        task=event.task,
        task_class=event.task_class,
        timeout_ms=event.timeout_ms,
        timeout_knob=_spawn_knob(event),
        max_steps=event.max_steps,
        attempt=event.attempt,
        started_at=ts,
        tokens_grew_at=ts,
        host_work=event.host_work,
        split_from=event.split_from,
    )


def _progress(state: RunState, event: SubagentProgress, ts: float) -> RunState:
    grew = event.tokens > state.tokens
    return msgspec.structs.replace(
        state,
        tokens=max(state.tokens, event.tokens),
        step=max(state.step, event.step),
        tokens_grew_at=ts if grew else state.tokens_grew_at,
    )


def _completed(state: RunState, event: SubagentCompleted, ts: float) -> RunState:
    result = event.result if event.outcome == "succeeded" else state.result
    if state.status in _FORCE_FAILED:  # returned after the force-fail: the outcome stands
        return msgspec.structs.replace(state, late_completion=True, result=result)
    if state.status != "running":
        return state
    return msgspec.structs.replace(state, status=event.outcome, ended_at=ts, result=result)


def _force_failed(state: RunState, status: RunStatus, ts: float) -> RunState:
    if state.status != "running":
        return state
    return msgspec.structs.replace(state, status=status, ended_at=ts)


def apply_run(state: RunState, record: RecordedEvent) -> RunState:
    """The run after one more event of its stream; other events only move the version."""
    state = msgspec.structs.replace(state, version=record.version)
    event, ts = record.event, record.ts
    match event:
        case SubagentSpawned():
            return _spawned(state, event, ts)
        case SubagentProgress():
            return _progress(state, event, ts)
        case SubagentArtifact():
            found = Artifact(path=event.path, sha256=event.sha256, final=event.final)
            return msgspec.structs.replace(state, artifacts=(*state.artifacts, found))
        case SubagentCompleted():
            return _completed(state, event, ts)
        case SubagentWatchdogTimeout():
            return _force_failed(state, "timed_out", ts)
        case SubagentGhostSwept():
            return _force_failed(state, "swept", ts)
        case SubagentGivenUp():
            return _force_failed(state, "failed", ts)
        case SubagentSuspicious():
            return msgspec.structs.replace(state, suspected_growth_at=state.tokens_grew_at)
        case SubagentRecoveryDecided():
            decided = Recovery(
                action=event.action,
                reason=event.reason,
                context=event.context,
                subtasks=event.subtasks,
            )
            return msgspec.structs.replace(state, recovery=decided)
        case _:
            return state


# -- watchdog and ghost sweep -------------------------------------------------------------


def watchdog_limit(state: RunState, *, per_step_timeout_ms: int) -> tuple[int, str]:
    """The watchdog's limit in ms and the knob that binds it (seed 000).

    ``min(max_steps x per_step_timeout_ms, run limit)``, or the run limit (the spawn's
    own ``timeout_ms``) when ``max_steps`` is unset; the step budget binds only when it is
    strictly the smaller.
    """
    if state.max_steps is not None:
        steps_ms = state.max_steps * per_step_timeout_ms
        if steps_ms < state.timeout_ms:
            return steps_ms, STEP_KNOB
    return state.timeout_ms, state.timeout_knob


def watchdog_deadline(state: RunState, *, per_step_timeout_ms: int) -> float | None:
    """When the watchdog fires (unix seconds), or None when the run is not running."""
    if state.status != "running" or state.started_at is None:
        return None
    limit_ms, _ = watchdog_limit(state, per_step_timeout_ms=per_step_timeout_ms)
    return state.started_at + limit_ms / 1000


def decide_watchdog(state: RunState, now: float, *, per_step_timeout_ms: int) -> list[Event]:
    """``subagent:watchdog_timeout`` from the deadline on, while the run is running.

    Folding the event makes the run ``timed_out``, so it fires exactly once; a later
    ``subagent:completed`` does not change that outcome.
    """
    deadline = watchdog_deadline(state, per_step_timeout_ms=per_step_timeout_ms)
    if deadline is None or state.started_at is None or now < deadline:
        return []
    limit_ms, knob = watchdog_limit(state, per_step_timeout_ms=per_step_timeout_ms)
    return [
        SubagentWatchdogTimeout(
            deadline=deadline,
            limit_ms=limit_ms,
            knob=knob,
            elapsed_ms=round((now - state.started_at) * 1000),
        )
    ]


def ghost_deadline(state: RunState, *, ghost_grace_ms: int) -> float | None:
    """When a still-running run counts as a ghost: its run limit + ``ghost_grace_ms``."""
    if state.status != "running" or state.started_at is None:
        return None
    return state.started_at + (state.timeout_ms + ghost_grace_ms) / 1000


def decide_ghost(state: RunState, now: float, *, ghost_grace_ms: int) -> list[Event]:
    """``subagent:ghost_swept`` for a run still ``running`` at its ghost deadline (seed 000).

    It reads only the folded log, so it also catches runs a crashed process left running.
    """
    deadline = ghost_deadline(state, ghost_grace_ms=ghost_grace_ms)
    if deadline is None or state.started_at is None or now < deadline:
        return []
    return [
        SubagentGhostSwept(
            started_at=state.started_at,
            grace_ms=ghost_grace_ms,
            elapsed_ms=round((now - state.started_at) * 1000),
            limit_ms=state.timeout_ms,
            deadline=deadline,
        )
    ]


# -- heartbeat (detection only) -----------------------------------------------------------


def expected_ms(state: RunState, *, per_step_timeout_ms: int, expected_fraction: float) -> int:
    """How long the run is expected to take: the watchdog limit x ``expected_fraction``."""
    limit_ms, _ = watchdog_limit(state, per_step_timeout_ms=per_step_timeout_ms)
    return round(limit_ms * expected_fraction)


def suspicious_at(
    state: RunState,
    *,
    per_step_timeout_ms: int,
    expected_fraction: float,
    heartbeat_interval_ms: int,
) -> float | None:
    """The first moment the run would be suspicious if its tokens stay frozen, or None."""
    if state.status != "running" or state.started_at is None or state.tokens_grew_at is None:
        return None
    if state.suspected_growth_at == state.tokens_grew_at:
        return None  # this frozen episode was already reported
    expected = expected_ms(
        state, per_step_timeout_ms=per_step_timeout_ms, expected_fraction=expected_fraction
    )
    return max(
        state.started_at + expected / 1000, state.tokens_grew_at + heartbeat_interval_ms / 1000
    )


def decide_suspicious(
    state: RunState,
    now: float,
    *,
    per_step_timeout_ms: int,
    expected_fraction: float,
    heartbeat_interval_ms: int,
) -> list[Event]:
    """``subagent:suspicious`` for a long-running run whose tokens froze (seed 002, layer 2).

    Replayable without an event per sweep: "longer than expected" is ``now - started_at >=
    watchdog limit x expected_fraction``; "tokens not grown since the last sweep" is no
    token growth in the last ``heartbeat_interval_ms`` (the sweep's period) before ``now``.
    Reported once per frozen episode (again only after tokens grow and freeze anew).
    Tokens still climbing is healthy whatever the time. It never kills anything.
    """
    due = suspicious_at(
        state,
        per_step_timeout_ms=per_step_timeout_ms,
        expected_fraction=expected_fraction,
        heartbeat_interval_ms=heartbeat_interval_ms,
    )
    if due is None or now < due or state.started_at is None or state.tokens_grew_at is None:
        return []
    return [
        SubagentSuspicious(
            tokens=state.tokens,
            elapsed_ms=round((now - state.started_at) * 1000),
            expected_ms=expected_ms(
                state, per_step_timeout_ms=per_step_timeout_ms, expected_fraction=expected_fraction
            ),
            frozen_ms=round((now - state.tokens_grew_at) * 1000),
            interval_ms=heartbeat_interval_ms,
        )
    ]


# -- recovery protocol --------------------------------------------------------------------


#: How every continuation context begins; :func:`continued_task` puts it after the task
#: with a blank line between.
_CONTINUATION = "\n\nThe last attempt "


def continuation_context(state: RunState) -> str:
    """What the next attempt is told about the work the last one did (seed 002)."""
    saved = ", ".join(a.path for a in state.artifacts)
    if state.step and saved:
        return (
            f"The last attempt completed steps 1-{state.step} and saved {saved}. "
            f"Pick up from step {state.step + 1}."
        )
    if state.step:
        done = state.step
        return f"The last attempt completed steps 1-{done}. Pick up from step {done + 1}."
    return f"The last attempt saved {saved}. Continue from where it stopped."


def continued_task(task: str, context: str) -> str:
    """The next attempt's task: the run's task, then the continuation context (if any)."""
    return f"{task}\n\n{context}" if context else task


def asked_task(task: str) -> str:
    """A run's task as it was first asked: a later attempt's without the continuation
    contexts :func:`continued_task` put after it (they are told to the next attempt, not
    to the user: a failure notice quotes this)."""
    cut = task.find(_CONTINUATION)
    return task if cut < 0 else task[:cut]


def _recovery_action(
    state: RunState, *, max_attempts: int, can_split: bool, can_respawn: bool
) -> Recovery:
    if any(a.final for a in state.artifacts):
        return Recovery(action="deliver", reason="final_artifact")
    if state.result:
        return Recovery(action="deliver", reason="completed_result")
    if state.attempt >= max_attempts:
        # a split's subtask is not split again: a splitter that gives back its own task
        # would split for ever
        split = can_split and state.split_from is None
        action: RecoveryAction = "split" if split else "escalate"
        return Recovery(action=action, reason="attempts_exhausted")
    if state.host_work and not can_respawn:
        # the host's code is not in this process (a restart): a model must not stand in
        return Recovery(action="escalate", reason="work_unavailable")
    if state.artifacts or state.step:
        context = continuation_context(state)
        return Recovery(action="respawn_continue", reason="partial_work", context=context)
    return Recovery(action="respawn", reason="no_work")


def decide_recovery(
    state: RunState, *, max_attempts: int, can_split: bool = False, can_respawn: bool = True
) -> list[Event]:
    """``subagent:recovery_decided`` once for a run that ended without succeeding (seed 002).

    Check before re-spawning, resume rather than restart: a final artifact or a result
    (even one returned after a force-fail) is delivered; attempt ``>= max_attempts`` is
    escalated (or split when the caller has a splitter, unless the run is a split's
    subtask: ``split_from``); partial work (artifacts or steps)
    is re-spawned with continuation context; nothing done is re-spawned as it was. A
    run of the host's own code is escalated (``work_unavailable``) instead of re-spawned
    when the caller cannot run that code (``can_respawn`` False: a process started after
    the one that held it).
    """
    if state.status not in _ENDED or state.status == "succeeded" or state.recovery is not None:
        return []
    chosen = _recovery_action(
        state, max_attempts=max_attempts, can_split=can_split, can_respawn=can_respawn
    )
    return [
        SubagentRecoveryDecided(
            action=chosen.action,
            reason=chosen.reason,
            attempt=state.attempt,
            context=chosen.context,
            steps_done=state.step,
            artifacts=tuple(a.path for a in state.artifacts),
        )
    ]


class RunAggregate:
    """The sub-agent run fold, for session streams that hold a ``subagent:spawned``."""

    name = "subagent_run"
    # 2: host_work; 3: split_from (a snapshot of 2 may be of a fold before it, and would
    # read a split's subtask as a first run)
    version = 3
    state_type = RunState

    def initial(self, stream: str) -> RunState:
        return RunState(stream=stream)

    def apply(self, state: RunState, record: RecordedEvent) -> RunState:
        return apply_run(state, record)

    def folder(self, state: RunState) -> ApplyFolder[RunState]:
        return ApplyFolder(apply_run, state)


RUN = RunAggregate()
