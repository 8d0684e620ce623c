"""Sub-agent run events (a run is a session stream of its own with ``parent`` set)."""

from __future__ import annotations

from typing import ClassVar, Literal

from ._base import Event, Severity

TaskClass = Literal["formatting", "code", "research", "deep", "custom"]


class SubagentSpawned(Event, frozen=True, tag="subagent:spawned"):
    parent: str
    task: str
    task_class: TaskClass
    timeout_ms: int
    timeout_reason: str | None = None
    max_steps: int | None = None
    attempt: int = 1
    #: the config knob that bound ``timeout_ms`` (``class_timeouts_ms.code``,
    #: ``custom_timeout_ms``, ``max_run_timeout_ms``); empty in logs written before it
    timeout_knob: str = ""
    #: where the run's failure notice goes (a channel name and its conversation); empty in
    #: logs written before them (the supervisor then uses its default channel and parent)
    channel: str = ""
    conversation: str = ""
    #: the conversation's thread (the parent session's, unless the spawn named another
    #: conversation); None in logs written before it
    thread: str | None = None
    #: whether the run's result is announced to its parent (``rt.spawn(announce=...)``);
    #: None in logs written before it and for runs started outside a runtime: a
    #: completion whose announcement never happened is only owed when this is True
    announce: bool | None = None
    #: whether the run runs the host's own code (``rt.spawn(work=...)``) rather than a
    #: model; None in logs written before it and for runs started outside a runtime. A
    #: process that does not hold that code cannot respawn the run (it escalates)
    host_work: bool | None = None
    #: the run whose recovery ``split`` made this run's lineage (a subtask, or a later
    #: attempt of one): such a lineage is never split again. None otherwise, and in logs
    #: written before it
    split_from: str | None = None
    #: the id the run's recovery gives the run it starts next (a respawn; a split's
    #: subtasks are ``<id>-1``, ``<id>-2``, ...), drawn at the spawn so that a supervisor
    #: can tell from the log whether that run was started (one whose spawn a crash lost
    #: is started then). None in logs written before it: their next runs are not looked for
    next_run_id: str | None = None
    #: the idempotency key of the ``spawn_subagent`` call that spawned the run (the run's
    #: id is named after it), so that a call a crash cut short finds its run; None for
    #: every other spawn (``rt.spawn``, a recovery's next attempt) and in logs written
    #: before it
    call_key: str | None = None


class SubagentProgress(Event, frozen=True, tag="subagent:progress"):
    tokens: int
    step: int = 0
    severity: ClassVar[Severity] = "debug"


class SubagentArtifact(Event, frozen=True, tag="subagent:artifact"):
    path: str
    sha256: str
    size: int = 0
    description: str = ""
    #: the run's finished work product: a force-failed run with one is delivered, not redone
    final: bool = False


class SubagentCompleted(Event, frozen=True, tag="subagent:completed"):
    outcome: Literal["succeeded", "failed"] = "succeeded"
    result: str = ""


class SubagentWatchdogTimeout(Event, frozen=True, tag="subagent:watchdog_timeout"):
    deadline: float
    limit_ms: int
    knob: str
    elapsed_ms: int
    severity: ClassVar[Severity] = "warning"


class SubagentGhostSwept(Event, frozen=True, tag="subagent:ghost_swept"):
    started_at: float
    grace_ms: int
    elapsed_ms: int
    limit_ms: int = 0
    deadline: float = 0.0
    severity: ClassVar[Severity] = "error"


class SubagentGivenUp(Event, frozen=True, tag="subagent:given_up"):
    """The run's actor kept crashing and supervision gave up on it (``supervisor:gave_up``
    in the ``runtime`` stream): the supervisor ends the run as failed."""

    restarts: int
    #: the last crash's exception class (never its text)
    reason: str
    severity: ClassVar[Severity] = "error"


class SubagentSuspicious(Event, frozen=True, tag="subagent:suspicious"):
    tokens: int
    elapsed_ms: int
    expected_ms: int
    #: how long the token count had not grown, and the sweep interval it was compared with
    frozen_ms: int = 0
    interval_ms: int = 0
    severity: ClassVar[Severity] = "warning"


class SubagentRecoveryDecided(Event, frozen=True, tag="subagent:recovery_decided"):
    action: Literal["deliver", "respawn_continue", "respawn", "escalate", "split"]
    reason: str
    attempt: int = 1
    #: what the next attempt is told ("The last attempt completed steps 1-3 ...")
    context: str = ""
    steps_done: int = 0
    artifacts: tuple[str, ...] = ()
    #: ``split``: the smaller tasks the host's splitter gave, one new run each (empty
    #: for the other actions and in logs written before it)
    subtasks: tuple[str, ...] = ()
