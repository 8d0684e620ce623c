"""When a session next has work: the key of a store's work queue.

A store that offers a work queue (:class:`~stalwart.store.WorkQueue`) keeps, per session
stream, a time at which some worker should look at it. Two pure functions feed it:

- :func:`due_at`: the exact time from the folded state, the earliest ``now`` at which
  :func:`~stalwart.state.decide_lease` decides something (the lease's expiry while one is
  held, None while the session has no work or waits for a human);
- :func:`due_hint`: a time no later than that, from the events of one append alone, for
  appenders that did not fold the stream (a user message, a settlement): the time of a
  new activation, ``at`` for an event that may have made queued work runnable (a
  settlement, an expiry, a released lease, an answer, an interrupt), None for events
  that can only put the work off (a lease, a renewal, a pause) or do not touch it.

A hint may be early (a worker folds the stream and finds nothing to do yet), never late.
"""

from __future__ import annotations

from collections.abc import Iterable
from math import isfinite
from typing import cast

from stalwart.events import (
    ActivationAbandoned,
    ActivationAcked,
    ActivationBlocked,
    ActivationCancelled,
    ActivationReady,
    ActivationReleased,
    ActivationRequeued,
    Event,
    LeaseExpired,
    UserCustomToolResult,
    UserInterrupt,
    UserToolConfirmation,
)

from ._activation import ActivationsState

__all__ = ["due_at", "due_hint"]

_RELEASING = (
    ActivationAcked,
    ActivationBlocked,
    ActivationRequeued,
    ActivationAbandoned,
    ActivationCancelled,
    ActivationReleased,
    LeaseExpired,
    UserToolConfirmation,
    UserCustomToolResult,
    UserInterrupt,
)


def due_at(state: ActivationsState) -> float | None:
    """The earliest time a worker has something to decide for the session, or None.

    A run time that is not a number (a wake recorded with ``wake_at`` NaN by a build
    that took one) is never due: :func:`~stalwart.state.next_due` never picks it (every
    comparison with it is false), so it is left out, and no store is asked to keep it."""
    if state.lease is not None:
        return state.lease.expires_at
    if state.blocked_on is not None:
        return None
    times = [a.run_at for a in state.queue if a.kind == "wake" and isfinite(a.run_at)]
    ordered = next((a for a in state.queue if a.kind != "wake"), None)
    if ordered is not None and isfinite(ordered.run_at):
        times.append(ordered.run_at)
    return min(times, default=None)


def due_hint(events: Iterable[tuple[Event, float]]) -> float | None:
    """A time no later than the session's next due time after these ``(event, at)``
    appended (None: they cannot make work due sooner)."""
    hint: float | None = None
    kinds = _KINDS
    for event, at in events:
        kind = kinds.get(type(event))
        if kind is None:
            kind = kinds[type(event)] = _kind(event)
        if kind == _READY:
            wake_at = cast(ActivationReady, event).wake_at
            when = wake_at if wake_at is not None and isfinite(wake_at) else at
        elif kind == _RELEASES:
            when = at
        else:
            continue
        hint = when if hint is None else min(hint, when)
    return hint


_OTHER, _READY, _RELEASES = 0, 1, 2
#: event type -> what it means for the due time (every appended session event asks)
_KINDS: dict[type, int] = {}


def _kind(event: object) -> int:
    if isinstance(event, ActivationReady):
        return _READY
    return _RELEASES if isinstance(event, _RELEASING) else _OTHER
