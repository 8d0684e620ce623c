"""The session fold: who the session is, where its conversation stands, what it waits for."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Literal

import msgspec

from stalwart.events import (
    Event,
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


# -- the rules: one function per event type the session fold concerns ---------------------
# Each takes the draft (a dict of the state's fields), the record and its event.


def _message(draft: dict[str, Any], record: RecordedEvent, event: MessageAppended) -> None:
    # kept as the event until _frozen makes a LastMessage: none is built per message
    draft["messages"] += 1
    counter = _ROLE_COUNTER.get(event.role)
    if counter is not None:
        draft[counter] += 1
    draft["last_message"] = event


def _created(draft: dict[str, Any], record: RecordedEvent, event: SessionCreated) -> None:
    draft.update(
        created_at=record.ts,
        status="idle",
        agent=event.agent,
        parent=event.parent,
        channel=event.channel,
        tenant=event.tenant,
        title=event.title,
    )


def _turn_started(draft: dict[str, Any], record: RecordedEvent, event: TurnStarted) -> None:
    draft["status"] = "running"
    draft["turns"] += 1
    draft["current_turn"] = event.turn_id


def _turn_completed(draft: dict[str, Any], record: RecordedEvent, event: TurnCompleted) -> None:
    draft["status"] = "requires_action" if draft["pending"] else "idle"
    draft["current_turn"] = None
    draft["last_turn_outcome"] = event.outcome


def _aborted(draft: dict[str, Any], record: RecordedEvent, event: ExecutionAborted) -> None:
    draft.update(status="idle", current_turn=None, last_turn_outcome="aborted")


def _tool_started(draft: dict[str, Any], record: RecordedEvent, event: ToolStarted) -> None:
    draft["tool_calls"] += 1


def _tool_failed(draft: dict[str, Any], record: RecordedEvent, event: ToolFailed) -> None:
    draft["tool_failures"] += 1


def _tool_blocked(draft: dict[str, Any], record: RecordedEvent, event: ToolBlocked) -> None:
    draft["tools_blocked"] += 1


def _requires_action(
    draft: dict[str, Any], record: RecordedEvent, event: SessionRequiresAction
) -> None:
    draft["status"] = "requires_action"
    draft["pending"] = PendingRequest(
        request_id=event.request_id,
        kind=event.kind,
        tool=event.tool,
        arguments=event.arguments,
    )


def _answered(
    draft: dict[str, Any],
    record: RecordedEvent,
    event: UserToolConfirmation | UserCustomToolResult,
) -> None:
    pending = draft["pending"]
    if pending is not None and pending.request_id == event.request_id:
        draft.update(status="idle", pending=None)


def _interrupted(draft: dict[str, Any], record: RecordedEvent, event: UserInterrupt) -> None:
    draft.update(status="idle", pending=None, current_turn=None)


def _closed(draft: dict[str, Any], record: RecordedEvent, event: SessionClosed) -> None:
    draft.update(status="closed", closed_reason=event.reason)


def _fold_into(draft: dict[str, Any], record: RecordedEvent) -> None:
    """Fold one record into ``draft``: the reference dispatch, by ``match``."""
    draft["version"] = record.version
    draft["updated_at"] = record.ts
    event = record.event
    match event:
        case MessageAppended():
            _message(draft, record, event)
        case SessionCreated():
            _created(draft, record, event)
        case TurnStarted():
            _turn_started(draft, record, event)
        case TurnCompleted():
            _turn_completed(draft, record, event)
        case ExecutionAborted():
            _aborted(draft, record, event)
        case ToolStarted():
            _tool_started(draft, record, event)
        case ToolFailed():
            _tool_failed(draft, record, event)
        case ToolBlocked():
            _tool_blocked(draft, record, event)
        case SessionRequiresAction():
            _requires_action(draft, record, event)
        case UserToolConfirmation() | UserCustomToolResult():
            _answered(draft, record, event)
        case UserInterrupt():
            _interrupted(draft, record, event)
        case SessionClosed():
            _closed(draft, record, event)
        case _:
            pass  # the session ignores the other events but for version and time


_Rule = Callable[[dict[str, Any], RecordedEvent, Any], None]

#: The folder's dispatch: the rule of each type ``_fold_into`` has a case for.
_RULES: dict[type[Event], _Rule] = {
    MessageAppended: _message,
    SessionCreated: _created,
    TurnStarted: _turn_started,
    TurnCompleted: _turn_completed,
    ExecutionAborted: _aborted,
    ToolStarted: _tool_started,
    ToolFailed: _tool_failed,
    ToolBlocked: _tool_blocked,
    SessionRequiresAction: _requires_action,
    UserToolConfirmation: _answered,
    UserCustomToolResult: _answered,
    UserInterrupt: _interrupted,
    SessionClosed: _closed,
}
# every type met so far -> its rule, or None when the session ignores it
_DISPATCH: dict[type[Event], _Rule | None] = dict(_RULES)


def _rule_of(cls: type[Event]) -> _Rule | None:
    """The rule ``match`` would pick for ``cls``: its own, or its nearest handled base's."""
    for base in cls.__mro__:
        rule = _RULES.get(base)
        if rule is not None:
            return rule
    return None


def _frozen(draft: dict[str, Any]) -> SessionState:
    last = draft["last_message"]
    if isinstance(last, MessageAppended):
        draft["last_message"] = LastMessage(
            message_id=last.message_id,
            role=last.role,
            excerpt=last.content[:EXCERPT_CHARS],
            tool_calls=len(last.tool_calls),
        )
    return SessionState(**draft)


class SessionFolder:
    """The session fold as an accumulator, equal to :func:`apply_session` event by event.

    The draft is a plain dict of the state's fields, so a replay mutates a few keys per
    event and builds the frozen :class:`SessionState` only when asked. Events the fold
    does not concern (half of a busy log: prompts, tool results) cost a dict lookup;
    the others go straight to their rule, without ``match``'s class checks in turn.
    """

    __slots__ = ("_draft",)

    def __init__(self, state: SessionState) -> None:
        self._draft: dict[str, Any] = msgspec.structs.asdict(state)

    def add(self, record: RecordedEvent) -> None:
        draft = self._draft
        draft["version"] = record.version
        draft["updated_at"] = record.ts
        event = record.event
        cls = type(event)
        try:
            rule = _DISPATCH[cls]
        except KeyError:
            rule = _DISPATCH[cls] = _rule_of(cls)
        if rule is not None:
            rule(draft, record, event)

    def add_all(self, records: Sequence[RecordedEvent]) -> None:
        """``add`` each record in turn, in one loop (no rule reads version or time, so
        they are set once, from the last record)."""
        if not records:
            return
        draft = self._draft
        dispatch = _DISPATCH
        for record in records:
            event = record.event
            cls = type(event)
            try:
                rule = dispatch[cls]
            except KeyError:
                rule = dispatch[cls] = _rule_of(cls)
            if rule is not None:
                rule(draft, record, event)
        last = records[-1]
        draft["version"] = last.version
        draft["updated_at"] = last.ts

    def state(self) -> SessionState:
        return _frozen(self._draft)


def apply_session(state: SessionState, record: RecordedEvent) -> SessionState:
    """The session after ``record``; events that do not concern it only move version and time."""
    draft = msgspec.structs.asdict(state)
    _fold_into(draft, record)
    return _frozen(draft)


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
