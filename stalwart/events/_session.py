"""Session events (stream ``session:<id>``): the conversation and its turns."""

from __future__ import annotations

from typing import Any, ClassVar, Literal

import msgspec

from ._base import Event, Severity

Role = Literal["system", "user", "assistant", "tool"]


class ToolCall(msgspec.Struct, frozen=True, kw_only=True, gc=False):
    """A tool call as the model asked for it; ``arguments`` is the JSON text verbatim."""

    id: str
    name: str
    arguments: str = "{}"


class ToolSpec(msgspec.Struct, frozen=True, kw_only=True):
    """A tool as a model request declares it: a name, what it does, a JSON schema."""

    name: str
    description: str = ""
    parameters: dict[str, Any] = msgspec.field(default_factory=lambda: {"type": "object"})


class SessionCreated(Event, frozen=True, tag="session:created"):
    agent: str = "default"
    parent: str | None = None
    channel: str | None = None
    tenant: str | None = None
    title: str = ""
    #: where the session's replies go in its channel (``rt.session(conversation=,
    #: thread=)``), so a later process answers in the same place; None: the session id
    conversation: str | None = None
    thread: str | None = None


class MessageAppended(Event, frozen=True, tag="message:appended"):
    """One message of the conversation, stored verbatim."""

    message_id: str
    role: Role
    content: str = ""
    tool_calls: tuple[ToolCall, ...] = ()
    tool_call_id: str | None = None
    name: str | None = None
    turn_id: str | None = None


class TurnStarted(Event, frozen=True, tag="turn:started"):
    turn_id: str
    trigger: str = "user"


class TurnCompleted(Event, frozen=True, tag="turn:completed"):
    """A turn ended. ``interrupted``: closed on restart after a crash left it running;
    ``deferred``: no model call was made (the provider is degraded). ``reason`` names the
    rule that ended a turn that was not answered (``max_steps``, ``pipeline_timeout``,
    ``all_models_failed``, ``context_overflow``, ``provider_degraded``, ``restart``) and
    ``steps`` how many model calls it made."""

    turn_id: str
    outcome: Literal["answered", "failed", "aborted", "paused", "interrupted", "deferred"] = (
        "answered"
    )
    reason: str | None = None
    steps: int = 0


class ToolStarted(Event, frozen=True, tag="tool:started"):
    call_id: str
    tool: str
    arguments: str = "{}"
    idempotency_key: str | None = None
    turn_id: str | None = None


class ToolCompleted(Event, frozen=True, tag="tool:completed"):
    """A call's result. ``reconciled``: a crash cut the call short and the tool's own
    check found its effect had happened (``output`` is what the check reported)."""

    call_id: str
    tool: str
    output: str = ""
    duration_ms: int = 0
    reconciled: bool = False


class ToolFailed(Event, frozen=True, tag="tool:failed"):
    call_id: str
    tool: str
    error_class: str
    retryable: bool = False
    timed_out: bool = False
    severity: ClassVar[Severity] = "warning"


class SessionRequiresAction(Event, frozen=True, tag="session:requires_action"):
    """The session stops until a human answers: ``approval`` of a tool that needs
    confirmation, or the output of a ``custom_tool`` the host implements. ``call_id`` is
    the model's tool call the answer resolves; ``arguments`` its input, stored verbatim so
    an allowed call runs with exactly this input."""

    request_id: str
    kind: Literal["approval", "custom_tool"]
    tool: str
    arguments: str = "{}"
    call_id: str | None = None
    turn_id: str | None = None


class ToolBlocked(Event, frozen=True, tag="tool:blocked"):
    """The tool retry breaker refused a call: ``rule`` fired at ``failures >= threshold``.

    ``arguments`` is the call's canonical arguments (what the ``same_call`` rule compares)
    and ``pattern`` the error class an ``error_pattern`` block counted, so replay re-runs
    the decision from the event alone.
    """

    call_id: str
    tool: str
    rule: Literal["same_call", "same_tool", "error_pattern"]
    failures: int
    threshold: int
    arguments: str = "{}"
    pattern: str | None = None
    severity: ClassVar[Severity] = "warning"


class SessionClosed(Event, frozen=True, tag="session:closed"):
    reason: str = "closed"
    details: dict[str, Any] = msgspec.field(default_factory=dict)
