"""What a running tool may know about its call: its id and its idempotency key.

A tool with side effects should tag them with :func:`current_call`'s
``idempotency_key``: after a crash the runtime asks the tool's ``reconcile`` check, with
the same key, whether the effect happened, instead of running the call again blindly.
"""

from __future__ import annotations

import contextvars

import msgspec

__all__ = ["CallContext", "current_call"]


class CallContext(msgspec.Struct, frozen=True, kw_only=True):
    """The call a tool runs for. ``idempotency_key`` is stable across crashes and
    retries of the same call (it is recorded on ``tool:started``)."""

    call_id: str
    tool: str
    idempotency_key: str | None = None


_CURRENT: contextvars.ContextVar[CallContext | None] = contextvars.ContextVar(
    "stalwart_tool_call", default=None
)


def current_call() -> CallContext | None:
    """The call the running tool serves (None outside a tool run)."""
    return _CURRENT.get()


def bind(context: CallContext | None) -> contextvars.Token[CallContext | None]:
    return _CURRENT.set(context)


def unbind(token: contextvars.Token[CallContext | None]) -> None:
    _CURRENT.reset(token)
