"""Runtime and supervisor events (stream ``runtime``)."""

from __future__ import annotations

from typing import Any, ClassVar

from ._base import Event, Severity


class RuntimeStarted(Event, frozen=True, tag="runtime:started"):
    """A runtime started; carries the config in force so replay can re-run decisions."""

    config: dict[str, Any]
    stalwart_version: str
    host: str = ""
    pid: int = 0
    #: this runtime instance's id (what its ``supervisor:*`` decisions record as
    #: ``runtime``); empty in logs written before it
    instance: str = ""


class RuntimeStopped(Event, frozen=True, tag="runtime:stopped"):
    reason: str = "shutdown"


class SupervisorRestarted(Event, frozen=True, tag="supervisor:restarted"):
    actor: str
    restarts: int
    backoff_ms: int
    reason: str
    window_ms: int = 0
    max_restarts: int = 0
    #: the runtime instance that decided (its restarts are counted apart from other
    #: processes' on the same store); empty in logs written before it
    runtime: str = ""
    #: the crash decided (a decision retried after a store error is not made twice)
    crash_id: str = ""
    severity: ClassVar[Severity] = "warning"


class SupervisorGaveUp(Event, frozen=True, tag="supervisor:gave_up"):
    actor: str
    restarts: int
    window_ms: int
    session: str | None = None
    max_restarts: int = 0
    reason: str = ""
    runtime: str = ""
    crash_id: str = ""
    severity: ClassVar[Severity] = "error"
