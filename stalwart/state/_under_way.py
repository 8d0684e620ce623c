"""What a session was doing as its log ends: the model calls and tool calls started in
its stream with no outcome yet.

A live process is waiting on them; after a crash they are what the crash cut (the next
process closes the turn, and a tool call it cannot reconcile fails as ``unreconciled``).
A pure scan of one session's stream, for the operator's ``status SESSION``; the session
fold itself does not carry it (replay of a whole log never needs it).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Literal

import msgspec

from stalwart.events import (
    ExecutionAborted,
    PromptCompleted,
    PromptFailed,
    PromptStarted,
    PromptTimeout,
    RecordedEvent,
    SessionClosed,
    ToolCompleted,
    ToolFailed,
    ToolStarted,
    TurnCompleted,
    TurnStarted,
    UserInterrupt,
)

__all__ = ["UnderWay", "under_way"]


class UnderWay(msgspec.Struct, frozen=True, kw_only=True):
    """One call started and not ended: a model call (``name`` is ``provider:model``) or a
    tool call (``name`` is the tool's)."""

    kind: Literal["model", "tool"]
    call_id: str
    name: str
    since: float
    #: the model call's attempt (1 for the first); 0 for a tool call
    attempt: int = 0


def under_way(records: Iterable[RecordedEvent]) -> tuple[UnderWay, ...]:
    """The calls of ``records`` (one session's stream, in order) still open at its end,
    oldest first. A turn that ends or starts, an interrupt or a close leaves none open:
    whatever a crash cut short before it is no longer under way."""
    open_calls: dict[str, UnderWay] = {}
    for record in records:
        match record.event:
            case PromptStarted(call_id=call_id, provider=provider, model=model, attempt=n):
                name = f"{provider}:{model}"
                open_calls[call_id] = UnderWay(
                    kind="model", call_id=call_id, name=name, since=record.ts, attempt=n
                )
            case ToolStarted(call_id=call_id, tool=tool):
                open_calls[call_id] = UnderWay(
                    kind="tool", call_id=call_id, name=tool, since=record.ts
                )
            case (
                PromptCompleted(call_id=call_id)
                | PromptFailed(call_id=call_id)
                | PromptTimeout(call_id=call_id)
                | ToolCompleted(call_id=call_id)
                | ToolFailed(call_id=call_id)
            ):
                open_calls.pop(call_id, None)
            case (
                TurnStarted()
                | TurnCompleted()
                | ExecutionAborted()
                | UserInterrupt()
                | SessionClosed()
            ):
                open_calls.clear()
            case _:
                pass
    return tuple(open_calls.values())
