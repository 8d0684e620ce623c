"""The session fold: who the session is, where its conversation stands, what it waits for."""

from __future__ import annotations

from typing import Any, Literal

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


class LastMessage(msgspec.Struct, frozen=True, kw_only=True, gc=False):
    message_id: str
    role: Role
    excerpt: str
    tool_calls: int = 0


class PendingRequest(msgspec.Struct, frozen=True, kw_only=True, gc=False):
    request_id: str
    kind: Literal["approval", "custom_tool"]
    tool: str
    arguments: str


class SessionState(msgspec.Struct, frozen=True, kw_only=True, gc=False):
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


_ROLE_COUNTER = {
    "user": "user_messages",
    "assistant": "assistant_messages",
    "tool": "tool_messages",
}


class SessionFolder:
    """The session fold. Its rules live here once; ``apply_session`` uses it for one event.

    The draft is a plain dict of the state's fields, so a replay mutates a few keys per
    event and builds the frozen :class:`SessionState` only when asked.
    """

    __slots__ = ("_draft", "_last")

    def __init__(self, state: SessionState) -> None:
        self._draft: dict[str, Any] = msgspec.structs.asdict(state)
        self._last: MessageAppended | None = None

    def add(self, record: RecordedEvent) -> None:
        draft = self._draft
        draft["version"] = record.version
        draft["updated_at"] = record.ts
        event = record.event
        match event:
            case MessageAppended():
                draft["messages"] += 1
                counter = _ROLE_COUNTER.get(event.role)
                if counter is not None:
                    draft[counter] += 1
                self._last = event
            case SessionCreated():
                draft.update(
                    created_at=record.ts,
                    status="idle",
                    agent=event.agent,
                    parent=event.parent,
                    channel=event.channel,
                    tenant=event.tenant,
                    title=event.title,
                )
            case TurnStarted():
                draft.update(status="running", turns=draft["turns"] + 1, current_turn=event.turn_id)
            case TurnCompleted():
                draft["status"] = "requires_action" if draft["pending"] else "idle"
                draft["current_turn"] = None
                draft["last_turn_outcome"] = event.outcome
            case ExecutionAborted():
                draft.update(status="idle", current_turn=None, last_turn_outcome="aborted")
            case ToolStarted():
                draft["tool_calls"] += 1
            case ToolFailed():
                draft["tool_failures"] += 1
            case ToolBlocked():
                draft["tools_blocked"] += 1
            case SessionRequiresAction():
                draft["status"] = "requires_action"
                draft["pending"] = PendingRequest(
                    request_id=event.request_id,
                    kind=event.kind,
                    tool=event.tool,
                    arguments=event.arguments,
                )
            case UserToolConfirmation() | UserCustomToolResult():
                pending = draft["pending"]
                if pending is not None and pending.request_id == event.request_id:
                    draft.update(status="idle", pending=None)
            case UserInterrupt():
                draft.update(status="idle", pending=None, current_turn=None)
            case SessionClosed():
                draft.update(status="closed", closed_reason=event.reason)
            case _:
                pass

    def state(self) -> SessionState:
        draft = self._draft
        last = self._last
        if last is not None:
            draft["last_message"] = LastMessage(
                message_id=last.message_id,
                role=last.role,
                excerpt=last.content[:EXCERPT_CHARS],
                tool_calls=len(last.tool_calls),
            )
            self._last = None
        return SessionState(**draft)


def apply_session(state: SessionState, record: RecordedEvent) -> SessionState:
    """The session after ``record``; events that do not concern it only move version and time."""
    folder = SessionFolder(state)
    folder.add(record)
    return folder.state()


class SessionAggregate:
    """The session fold as an :class:`Aggregate`."""

    name = "session"
    version = 1
    state_type = SessionState

    def initial(self, stream: str) -> SessionState:
        return SessionState(stream=stream)

    def apply(self, state: SessionState, record: RecordedEvent) -> SessionState:
        return apply_session(state, record)

    def folder(self, state: SessionState) -> SessionFolder:
        return SessionFolder(state)


SESSION = SessionAggregate()
