"""The execution timeout (seed 000's whole-turn backstop): a pure comparison of the turn's
start, the time and the limit, so replay re-derives every ``execution:aborted``."""

from __future__ import annotations

from stalwart.events import ExecutionAborted


def execution_deadline(started_at: float, limit_ms: int) -> float:
    """When a turn that started at ``started_at`` reaches the execution timeout."""
    return started_at + limit_ms / 1000


def decide_execution_timeout(
    turn_id: str, started_at: float, now: float, limit_ms: int
) -> ExecutionAborted | None:
    """``execution:aborted`` (``pipeline_timeout``) once ``now`` reached the deadline.

    The boundary is exact: at the deadline it fires, a moment before it does not. The
    comparison is on :func:`execution_deadline`, the same number the timer was armed at,
    so a timer that fires always finds the decision true.
    """
    if now < execution_deadline(started_at, limit_ms):
        return None
    return ExecutionAborted(
        reason="pipeline_timeout",
        turn_id=turn_id,
        limit_ms=limit_ms,
        elapsed_ms=round((now - started_at) * 1000),
    )
