"""The prompt deadline: a pure function of recorded activity, now, and the limits.

A primary call has a *stall budget* (``prompt_timeout_ms``) that restarts at every
recorded ``prompt:activity`` and a *makespan ceiling* (``prompt_timeout_ms x
stall_ceiling_multiplier``) that nothing restarts. A retry or fallback call has one
whole-call limit (``retry_prompt_timeout_ms``). Activity is recorded at most once per
``activity_interval_ms``, and only recorded activity restarts the budget, so replay
re-derives every abort from the log alone.
"""

from __future__ import annotations

from typing import Literal

import msgspec

from stalwart.events import PromptStarted, PromptTimeout

Limit = Literal["stall", "makespan", "retry_deadline"]

KNOBS: dict[Limit, str] = {
    "stall": "prompt_timeout_ms",
    "makespan": "prompt_timeout_ms x stall_ceiling_multiplier",
    "retry_deadline": "retry_prompt_timeout_ms",
}


class PromptWindow(msgspec.Struct, frozen=True, kw_only=True):
    """What a running call's deadline depends on."""

    call_id: str
    started_at: float
    last_activity_at: float
    deadline_kind: Literal["stall", "whole_call"]
    timeout_ms: int
    makespan_ms: int = 0


def window_started(event: PromptStarted, ts: float) -> PromptWindow:
    """The window a ``prompt:started`` event opens at ``ts``."""
    return PromptWindow(
        call_id=event.call_id,
        started_at=ts,
        last_activity_at=ts,
        deadline_kind=event.deadline_kind,
        timeout_ms=event.timeout_ms,
        makespan_ms=event.makespan_ms,
    )


def window_touched(window: PromptWindow, ts: float) -> PromptWindow:
    """The window after recorded activity at ``ts`` (time never moves it backwards)."""
    if ts <= window.last_activity_at:
        return window
    return msgspec.structs.replace(window, last_activity_at=ts)


def next_deadline(window: PromptWindow) -> tuple[float, Limit, int]:
    """The earliest moment a limit fires: (when, which limit, its length in ms)."""
    if window.deadline_kind == "whole_call":
        return window.started_at + window.timeout_ms / 1000, "retry_deadline", window.timeout_ms
    stall = window.last_activity_at + window.timeout_ms / 1000
    if window.makespan_ms:
        makespan = window.started_at + window.makespan_ms / 1000
        if makespan <= stall:
            return makespan, "makespan", window.makespan_ms
    return stall, "stall", window.timeout_ms


def decide_prompt_timeout(window: PromptWindow, now: float) -> PromptTimeout | None:
    """``execution:prompt_timeout`` when a limit has passed at ``now``, else None."""
    when, limit, limit_ms = next_deadline(window)
    if now < when:
        return None
    return PromptTimeout(
        call_id=window.call_id,
        limit=limit,
        knob=KNOBS[limit],
        limit_ms=limit_ms,
        elapsed_ms=round((now - window.started_at) * 1000),
    )
