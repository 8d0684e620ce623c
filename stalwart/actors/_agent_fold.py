"""What the Agent folds from its session stream, and its pure decisions.

:class:`AgentView` is the session fold (:data:`~stalwart.state.SESSION`) plus the two
things the loop needs from the log: the conversation as neutral chat messages (what the
next request sends) and the tool retry breaker's counts. The execution timeout is a pure
comparison of the turn's start, the time and the limit, so replay re-derives every
``execution:aborted``.
"""

from __future__ import annotations

import msgspec

from stalwart.events import (
    ExecutionAborted,
    MessageAppended,
    RecordedEvent,
    ToolCall,
    TurnStarted,
)
from stalwart.providers import Message
from stalwart.state import (  # the execution timeout's pure decision lives in state
    SESSION,
    SessionFolder,
    SessionState,
    decide_execution_timeout,
    execution_deadline,
)
from stalwart.tools import ToolBreakerState, apply_tool_breaker

__all__ = [
    "AGENT_VIEW",
    "UNANSWERED_TOOL_TEXT",
    "AgentView",
    "AgentViewAggregate",
    "AgentViewFolder",
    "decide_execution_timeout",
    "execution_deadline",
    "request_messages",
]

#: What the model reads for a tool call of an earlier turn that has no result in the log
#: (the turn was aborted, or the process stopped, while it ran).
UNANSWERED_TOOL_TEXT = "The call did not finish: the turn it belonged to was stopped."


class AgentView(msgspec.Struct, frozen=True, kw_only=True):
    """One session as its Agent sees it. ``turn_started_at`` is the running turn's start."""

    session: SessionState
    messages: tuple[Message, ...] = ()
    tools: ToolBreakerState = msgspec.field(default_factory=ToolBreakerState)
    turn_started_at: float | None = None


def message_of(event: MessageAppended) -> Message:
    """The chat message a ``message:appended`` records."""
    return Message(
        role=event.role,
        content=event.content,
        tool_calls=event.tool_calls,
        tool_call_id=event.tool_call_id,
    )


class AgentViewFolder:
    """The fold as an accumulator (the session part is the fast :class:`SessionFolder`)."""

    __slots__ = ("_messages", "_session", "_started_at", "_tools", "version")

    def __init__(self, view: AgentView) -> None:
        self._session = SessionFolder(view.session)
        self._messages = list(view.messages)
        self._tools = view.tools
        self._started_at = view.turn_started_at
        self.version = view.session.version

    def add(self, record: RecordedEvent) -> None:
        self._session.add(record)
        self.version = record.version
        event = record.event
        if isinstance(event, MessageAppended):
            self._messages.append(message_of(event))
        elif isinstance(event, TurnStarted):
            self._started_at = record.ts
        elif isinstance(event, ExecutionAborted):
            self._started_at = None
        self._tools = apply_tool_breaker(self._tools, record)

    @property
    def messages(self) -> tuple[Message, ...]:
        return tuple(self._messages)

    @property
    def tools(self) -> ToolBreakerState:
        return self._tools

    def session(self) -> SessionState:
        """The session part alone (no copy of the conversation)."""
        return self._session.state()

    def state(self) -> AgentView:
        session = self._session.state()
        return AgentView(
            session=session,
            messages=tuple(self._messages),
            tools=self._tools,
            turn_started_at=self._started_at if session.current_turn is not None else None,
        )


class AgentViewAggregate:
    """The Agent's fold as an :class:`~stalwart.state.Aggregate` (for ``load_state``)."""

    name = "agent_view"
    version = 1
    state_type = AgentView

    def initial(self, stream: str) -> AgentView:
        return AgentView(session=SESSION.initial(stream))

    def apply(self, state: AgentView, record: RecordedEvent) -> AgentView:
        folder = AgentViewFolder(state)
        folder.add(record)
        return folder.state()

    def folder(self, state: AgentView) -> AgentViewFolder:
        return AgentViewFolder(state)


AGENT_VIEW = AgentViewAggregate()


def request_messages(
    messages: tuple[Message, ...], system_prompt: str | None = None
) -> tuple[Message, ...]:
    """The messages of the next request: the log's conversation, with every tool call
    answered (a call left without a result by a stopped turn gets
    :data:`UNANSWERED_TOOL_TEXT`, since providers reject a call with no result)."""
    out: list[Message] = [Message(role="system", content=system_prompt)] if system_prompt else []
    open_calls: list[ToolCall] = []
    for message in messages:
        if message.role == "tool":
            open_calls = [c for c in open_calls if c.id != message.tool_call_id]
        else:
            out.extend(_unanswered(open_calls))
            open_calls = list(message.tool_calls) if message.role == "assistant" else []
        out.append(message)
    out.extend(_unanswered(open_calls))
    return tuple(out)


def _unanswered(calls: list[ToolCall]) -> list[Message]:
    return [Message(role="tool", content=UNANSWERED_TOOL_TEXT, tool_call_id=c.id) for c in calls]
