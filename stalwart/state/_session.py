"""The session fold: who the session is, where its conversation stands, what it waits for."""

from __future__ import annotations

from typing import Literal

import msgspec

from stalwart.events import (
    ExecutionAborted,
    MessageAppended,
    RecordedEvent,
    Role,
    SessionClosed,
    SessionCreated,
    SessionRequiresAction,
    ToolBlocked,
    ToolFailed,
    ToolStarted,
    TurnCompleted,
    TurnStarted,
    UserCustomToolResult,
    UserInterrupt,
    UserToolConfirmation,
)

SessionStatus = Literal["new", "idle", "running", "requires_action", "closed"]
EXCERPT_CHARS = 120


class LastMessage(msgspec.Struct, frozen=True, kw_only=True):
    message_id: str
    role: Role
    excerpt: str
    tool_calls: int = 0


class PendingRequest(msgspec.Struct, frozen=True, kw_only=True):
    request_id: str
    kind: Literal["approval", "custom_tool"]
    tool: str
    arguments: str


class SessionState(msgspec.Struct, frozen=True, kw_only=True):
    """A session as its events say it is."""

    stream: str
    version: int = 0
    status: SessionStatus = "new"
    agent: str = ""
    parent: str | None = None
    channel: str | None = None
    tenant: str | None = None
    title: str = ""
    created_at: float | None = None
    updated_at: float | None = None
    messages: int = 0
    user_messages: int = 0
    assistant_messages: int = 0
    tool_messages: int = 0
    last_message: LastMessage | None = None
    turns: int = 0
    current_turn: str | None = None
    last_turn_outcome: str | None = None
    tool_calls: int = 0
    tool_failures: int = 0
    tools_blocked: int = 0
    pending: PendingRequest | None = None
    closed_reason: str | None = None


_replace = msgspec.structs.replace


def _message(state: SessionState, event: MessageAppended, version: int, ts: float) -> SessionState:
    role = event.role
    return _replace(
        state,
        version=version,
        updated_at=ts,
        messages=state.messages + 1,
        user_messages=state.user_messages + (role == "user"),
        assistant_messages=state.assistant_messages + (role == "assistant"),
        tool_messages=state.tool_messages + (role == "tool"),
        last_message=LastMessage(
            message_id=event.message_id,
            role=role,
            excerpt=event.content[:EXCERPT_CHARS],
            tool_calls=len(event.tool_calls),
        ),
    )


def apply_session(state: SessionState, record: RecordedEvent) -> SessionState:
    """The session after ``record``; other events only move its version and time."""
    event = record.event
    version = record.version
    ts = record.ts
    match event:
        case MessageAppended():
            return _message(state, event, version, ts)
        case SessionCreated():
            return _replace(
                state,
                version=version,
                updated_at=ts,
                created_at=ts,
                status="idle",
                agent=event.agent,
                parent=event.parent,
                channel=event.channel,
                tenant=event.tenant,
                title=event.title,
            )
        case TurnStarted():
            return _replace(
                state,
                version=version,
                updated_at=ts,
                status="running",
                turns=state.turns + 1,
                current_turn=event.turn_id,
            )
        case TurnCompleted():
            return _replace(
                state,
                version=version,
                updated_at=ts,
                status="requires_action" if state.pending else "idle",
                current_turn=None,
                last_turn_outcome=event.outcome,
            )
        case ExecutionAborted():
            return _replace(
                state,
                version=version,
                updated_at=ts,
                status="idle",
                current_turn=None,
                last_turn_outcome="aborted",
            )
        case ToolStarted():
            return _replace(state, version=version, updated_at=ts, tool_calls=state.tool_calls + 1)
        case ToolFailed():
            return _replace(
                state, version=version, updated_at=ts, tool_failures=state.tool_failures + 1
            )
        case ToolBlocked():
            return _replace(
                state, version=version, updated_at=ts, tools_blocked=state.tools_blocked + 1
            )
        case SessionRequiresAction():
            pending = PendingRequest(
                request_id=event.request_id,
                kind=event.kind,
                tool=event.tool,
                arguments=event.arguments,
            )
            return _replace(
                state, version=version, updated_at=ts, status="requires_action", pending=pending
            )
        case UserToolConfirmation() | UserCustomToolResult():
            if state.pending is None or state.pending.request_id != event.request_id:
                return _replace(state, version=version, updated_at=ts)
            return _replace(state, version=version, updated_at=ts, status="idle", pending=None)
        case UserInterrupt():
            return _replace(
                state,
                version=version,
                updated_at=ts,
                status="idle",
                pending=None,
                current_turn=None,
            )
        case SessionClosed():
            return _replace(
                state, version=version, updated_at=ts, status="closed", closed_reason=event.reason
            )
        case _:
            return _replace(state, version=version, updated_at=ts)


class SessionAggregate:
    """The session fold as an :class:`Aggregate`."""

    name = "session"
    version = 1
    state_type = SessionState

    def initial(self, stream: str) -> SessionState:
        return SessionState(stream=stream)

    def apply(self, state: SessionState, record: RecordedEvent) -> SessionState:
        return apply_session(state, record)


SESSION = SessionAggregate()
