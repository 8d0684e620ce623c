"""When a tool call must stop its session for a human (``session:requires_action``).

In a wake, before a step's calls run, the first call of a tool the host implements
(``custom_tool``: the host gives its output) or of a tool that needs confirmation
(``approval``) stops the session, unless the call was already answered. The request
carries the call as the model asked for it (name and arguments verbatim, so an allowed
call runs with exactly that input) and the running turn.

:data:`PAUSES` folds what replay needs to re-derive a request from its session stream:
the last assistant message's tool calls, which of them have a result, which were
answered, and the running turn.
"""

from __future__ import annotations

from typing import Literal

import msgspec

from stalwart.events import (
    Event,
    ExecutionAborted,
    MessageAppended,
    RecordedEvent,
    SessionRequiresAction,
    ToolCall,
    TurnCompleted,
    TurnStarted,
    UserCustomToolResult,
    UserInterrupt,
    UserToolConfirmation,
)

from ._aggregate import ApplyFolder

PauseKind = Literal["approval", "custom_tool"]


def pause_kind(*, custom: bool, needs_confirmation: bool) -> PauseKind | None:
    """Which answer a tool's call waits for: a host tool's output, an approval, or none."""
    if custom:
        return "custom_tool"
    if needs_confirmation:
        return "approval"
    return None


def decide_pause(
    call: ToolCall,
    kind: PauseKind | None,
    *,
    answered: bool,
    turn_id: str | None,
) -> SessionRequiresAction | None:
    """The request that stops the session before ``call`` runs, or None (its tool needs
    no human, or the call was answered already). Its ``request_id`` is left empty: the
    caller names the request (ids are made outside the pure decision)."""
    if kind is None or answered:
        return None
    return SessionRequiresAction(
        request_id="",
        kind=kind,
        tool=call.name,
        arguments=call.arguments,
        call_id=call.id,
        turn_id=turn_id,
    )


class PauseState(msgspec.Struct, frozen=True, kw_only=True, gc=False):
    """The last assistant message's calls, those with a result or an answer, the requests
    waiting (request id -> call id) and the running turn."""

    calls: tuple[ToolCall, ...] = ()
    results: frozenset[str] = frozenset()
    answered: frozenset[str] = frozenset()
    waiting: dict[str, str] = msgspec.field(default_factory=dict)
    turn_id: str | None = None

    def unanswered(self, call_id: str) -> ToolCall | None:
        """The last assistant message's call ``call_id`` when it has no result yet."""
        if call_id in self.results:
            return None
        return next((call for call in self.calls if call.id == call_id), None)


_MOVES: frozenset[type[Event]] = frozenset(
    {
        *(MessageAppended, SessionRequiresAction, UserToolConfirmation, UserCustomToolResult),
        *(UserInterrupt, TurnStarted, TurnCompleted, ExecutionAborted),
    }
)


def apply_pause(state: PauseState, record: RecordedEvent) -> PauseState:
    """The pause state after one more event of the session."""
    event = record.event
    if type(event) not in _MOVES:
        return state
    replace = msgspec.structs.replace
    match event:
        case MessageAppended(role="assistant"):
            # an answer is to its request, in its step: never to a later call of the same
            # id (providers may number calls per response, or send none)
            return replace(state, calls=event.tool_calls, results=frozenset(), answered=frozenset())
        case MessageAppended(role="tool") if event.tool_call_id is not None:
            return replace(state, results=state.results | {event.tool_call_id})
        case SessionRequiresAction() if event.call_id is not None:
            return replace(state, waiting={**state.waiting, event.request_id: event.call_id})
        case UserToolConfirmation() | UserCustomToolResult():
            waiting = dict(state.waiting)
            call_id = waiting.pop(event.request_id, None)
            if call_id is None:
                return state
            return replace(state, waiting=waiting, answered=state.answered | {call_id})
        case UserInterrupt():  # the open calls are closed: none of them asks again
            open_calls = {call.id for call in state.calls if call.id not in state.results}
            return replace(state, waiting={}, turn_id=None, answered=frozenset(open_calls))
        case TurnStarted():
            return replace(state, turn_id=event.turn_id)
        case TurnCompleted() | ExecutionAborted():
            return replace(state, turn_id=None)
        case _:
            return state


class PauseAggregate:
    """:class:`PauseState` over a session stream."""

    name = "pauses"
    version = 1
    state_type = PauseState
    moves = _MOVES

    def initial(self, stream: str) -> PauseState:
        return PauseState()

    def apply(self, state: PauseState, record: RecordedEvent) -> PauseState:
        return apply_pause(state, record)

    def folder(self, state: PauseState) -> ApplyFolder[PauseState]:
        return ApplyFolder(apply_pause, state)


PAUSES = PauseAggregate()
