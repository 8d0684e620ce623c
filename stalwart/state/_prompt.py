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


def retry_delay(
    attempt: int,
    status: int | None,
    retry_after_s: float | None,
    rate_limited_before: bool,
    jitter: float,
    *,
    max_retries: int,
    retry_base_ms: int,
    retry_cap_ms: int,
    max_retry_after_ms: int,
) -> float | None:
    """Seconds to wait before trying attempt ``attempt`` + 1 on the same model, or None to
    move down the model chain (seed 002's retry rules).

    A ``Retry-After`` longer than ``max_retry_after_ms`` goes down the chain. A 429 is
    retried once per model, after its ``Retry-After`` (none: down the chain). Any other
    retryable failure is retried ``max_retries`` times with full-jitter backoff: ``jitter``
    (uniform in [0, 1)) of ``min(cap, base x 2^(attempt-1))``, and never sooner than the
    server's ``Retry-After``.
    """
    if retry_after_s is not None and retry_after_s > max_retry_after_ms / 1000:
        return None
    if status == 429:
        if rate_limited_before or retry_after_s is None:
            return None
        return retry_after_s
    if attempt > max_retries:
        return None
    ceiling = min(retry_cap_ms, retry_base_ms * (1 << max(attempt - 1, 0))) / 1000
    return max(ceiling * jitter, retry_after_s or 0.0)
