"""What the Agent folds from its session stream, and its pure decisions.

:class:`AgentView` is the session fold (:data:`~stalwart.state.SESSION`) plus what the
loop needs from the log: the conversation (the stored messages the context engine takes,
and from them the neutral chat messages a request sends), the tool retry breaker's
counts, the wake's :class:`~stalwart.actors._agent_wake.WakeLedger` and the open model
calls (:data:`~stalwart.state.CALLS`). It is one fold so that one snapshot holds all of
it: an Agent started on a long session folds only what came after the snapshot. The
execution timeout is a pure comparison of the turn's start, the time and the limit, so
replay re-derives every ``execution:aborted``.
"""

from __future__ import annotations

import msgspec

from stalwart.context import ContextMessage, SessionMessages, answers_of, results_by_call
from stalwart.events import (
    ExecutionAborted,
    MessageAppended,
    RecordedEvent,
    TurnStarted,
)
from stalwart.providers import Message
from stalwart.state import (  # the execution timeout's pure decision lives in state
    CALLS,
    SESSION,
    CallsState,
    SessionFolder,
    SessionState,
    decide_execution_timeout,
    execution_deadline,
)
from stalwart.tools import ToolBreakerState, apply_tool_breaker

from ._agent_wake import LedgerState, WakeLedger

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
    """One session as its Agent sees it. ``messages`` are the stored messages (the context
    engine's :class:`~stalwart.context.ContextMessage`); ``turn_started_at`` is the
    running turn's start; ``ledger`` the wake's bookkeeping; ``calls`` the model calls
    still open."""

    session: SessionState
    messages: tuple[ContextMessage, ...] = ()
    tools: ToolBreakerState = msgspec.field(default_factory=ToolBreakerState)
    turn_started_at: float | None = None
    ledger: LedgerState
    calls: CallsState = msgspec.field(default_factory=CallsState)


def message_of(stored: MessageAppended | ContextMessage) -> Message:
    """The chat message a ``message:appended`` (or the stored message it made) records."""
    return Message(
        role=stored.role,
        content=stored.content,
        tool_calls=stored.tool_calls,
        tool_call_id=stored.tool_call_id,
    )


class AgentViewFolder:
    """The fold as an accumulator (the session part is the fast :class:`SessionFolder`).
    ``ledger``, ``context`` (the stored messages) and ``calls`` are its parts, folded
    with it; the Agent reads them in place."""

    __slots__ = (
        *("_messages", "_session", "_started_at", "_tools"),
        *("calls", "context", "ledger", "version"),
    )

    def __init__(self, view: AgentView) -> None:
        self._session = SessionFolder(view.session)
        self.context = SessionMessages(view.messages)
        #: the chat messages a request sends, made when first asked (an Agent behind the
        #: context engine sends what it assembles, and never asks)
        self._messages: list[Message] | None = None
        self._tools = view.tools
        self._started_at = view.turn_started_at
        self.ledger = WakeLedger(view.session.stream, view.ledger)
        self.calls = CALLS.folder(view.calls)
        self.version = view.session.version

    def add(self, record: RecordedEvent) -> None:
        self._session.add(record)
        self.version = record.version
        event = record.event
        if isinstance(event, MessageAppended):
            self.context.add(record)
            if self._messages is not None:
                self._messages.append(message_of(event))
        elif isinstance(event, TurnStarted):
            self._started_at = record.ts
        elif isinstance(event, ExecutionAborted):
            self._started_at = None
        self._tools = apply_tool_breaker(self._tools, record)
        self.ledger.add(record)
        self.calls.add(record)

    @property
    def messages(self) -> tuple[Message, ...]:
        if self._messages is None:
            self._messages = [message_of(stored) for stored in self.context.messages]
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
            messages=tuple(self.context.messages),
            tools=self._tools,
            turn_started_at=self._started_at if session.current_turn is not None else None,
            ledger=self.ledger.state(),
            calls=self.calls.state(),
        )


class AgentViewAggregate:
    """The Agent's fold as an :class:`~stalwart.state.Aggregate` (for ``load_state``).
    Version 2 added the ledger, the calls and the stored messages' ids, turns and times
    (a version 1 snapshot is not used: the first start folds the whole stream again).
    Version 3 keeps a call surfaced as ``unreconciled`` among the ledger's started calls
    until its result is in the conversation (so a step resumed twice never runs it).
    Version 4: the drafts fold (version 2) leaves a draft open when an older revision of
    it is committed. Version 5: the ledger keeps the queued message activations that
    carry a message the session was given before (``repeats``: a redelivery), which a
    wake neither records nor answers again."""

    name = "agent_view"
    version = 5
    state_type = AgentView

    def initial(self, stream: str) -> AgentView:
        return AgentView(session=SESSION.initial(stream), ledger=LedgerState.initial(stream))

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
    answered right after the assistant message that made it, in the calls' order, as
    providers insist. A result the log holds further on (a user message that arrived
    while the step waited for an approval is recorded before the step's results) is
    moved up to its call (each result answers the nearest call before it with its id:
    :func:`~stalwart.context.results_by_call`); a call left without a result by a
    stopped turn gets :data:`UNANSWERED_TOOL_TEXT`; a result whose call is not in the
    conversation is left out."""
    answers = results_by_call(messages)
    out: list[Message] = [Message(role="system", content=system_prompt)] if system_prompt else []
    for index, message in enumerate(messages):
        if message.role == "tool":
            continue  # placed after its call
        out.append(message)
        if message.role == "assistant":
            out.extend(_answers(messages, index, answers))
    return tuple(out)


def _answers(
    messages: tuple[Message, ...], index: int, answers: dict[tuple[int, str], int]
) -> list[Message]:
    """Each call's result of the assistant message at ``index``, or the text of one that
    has none; a call id repeated in one message is answered once."""
    calls = messages[index].tool_calls
    return [
        messages[answer]
        if answer is not None
        else Message(role="tool", content=UNANSWERED_TOOL_TEXT, tool_call_id=calls[place].id)
        for place, answer in answers_of(messages, index, answers)
    ]
