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


class SubagentProgress(Event, frozen=True, tag="subagent:progress"):
    tokens: int
    step: int = 0
    severity: ClassVar[Severity] = "debug"


class SubagentArtifact(Event, frozen=True, tag="subagent:artifact"):
    path: str
    sha256: str
    size: int = 0
    description: str = ""


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
    severity: ClassVar[Severity] = "error"


class SubagentSuspicious(Event, frozen=True, tag="subagent:suspicious"):
    tokens: int
    elapsed_ms: int
    expected_ms: int
    severity: ClassVar[Severity] = "warning"


class SubagentRecoveryDecided(Event, frozen=True, tag="subagent:recovery_decided"):
    action: Literal["deliver", "respawn_continue", "respawn", "escalate", "split"]
    reason: str
    attempt: int = 1
