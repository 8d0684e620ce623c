"""Supervision: the pure one_for_one restart decision (restart intensity and backoff).

Erlang/OTP's restart intensity with the issue's numbers: a child may be restarted at most
``max_restarts`` (3) times within ``within_ms`` (5 s); the crash that would make it one
more gives up (``supervisor:gave_up``). A restart counts while it is strictly less than
``within_ms`` old. Each restart waits ``min(backoff_cap_ms, backoff_base_ms x 2**n)``
where ``n`` is the number of restarts already in the window (defaults 100 ms and 1 s:
100, 200, 400 ms for the three allowed), so a calm period resets the backoff too.

The history is the ``ts`` of the child's earlier ``supervisor:restarted`` events in the
``runtime`` stream (:func:`restart_history`), so replay re-derives every decision.
"""

from __future__ import annotations

from collections.abc import Iterable

from stalwart.events import RecordedEvent, SupervisorGaveUp, SupervisorRestarted


def restart_history(
    records: Iterable[RecordedEvent], actor: str, runtime: str = ""
) -> tuple[float, ...]:
    """The times ``actor`` of the runtime instance ``runtime`` was restarted, oldest
    first, from the log (other processes on the store restart their own actors of the
    same names: those are not this one's)."""
    return tuple(
        r.ts
        for r in records
        if isinstance(r.event, SupervisorRestarted)
        and r.event.actor == actor
        and r.event.runtime == runtime
    )


def restart_backoff_ms(restarts_in_window: int, *, base_ms: int, cap_ms: int) -> int:
    """The wait before the next restart: ``min(cap, base x 2**restarts_in_window)``."""
    return min(cap_ms, base_ms << min(restarts_in_window, 62))


def decide_restart(
    actor: str,
    history_ts: tuple[float, ...],
    now: float,
    *,
    reason: str,
    max_restarts: int,
    within_ms: int,
    backoff_base_ms: int,
    backoff_cap_ms: int,
    session: str | None = None,
    runtime: str = "",
    crash_id: str = "",
) -> SupervisorRestarted | SupervisorGaveUp:
    """Restart ``actor`` after a crash at ``now``, or give up (one_for_one intensity);
    ``history_ts`` is that runtime instance's (``runtime``, recorded in the decision, as
    the ``crash_id`` that names the crash)."""
    recent = sum(1 for ts in history_ts if ts <= now and now - ts < within_ms / 1000)
    if recent >= max_restarts:
        return SupervisorGaveUp(
            actor=actor,
            restarts=recent,
            window_ms=within_ms,
            session=session,
            max_restarts=max_restarts,
            reason=reason,
            runtime=runtime,
            crash_id=crash_id,
        )
    return SupervisorRestarted(
        actor=actor,
        restarts=recent + 1,
        backoff_ms=restart_backoff_ms(recent, base_ms=backoff_base_ms, cap_ms=backoff_cap_ms),
        reason=reason,
        window_ms=within_ms,
        max_restarts=max_restarts,
        runtime=runtime,
        crash_id=crash_id,
    )
