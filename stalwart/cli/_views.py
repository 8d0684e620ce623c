"""What the operator's views show, as plain dicts (the ``--json`` shapes): the overview
of every session and one session in full, built from the orchestrator projection; and
"now" for them, which the log can be ahead of.
"""

from __future__ import annotations

import math
from typing import Any

import msgspec

from stalwart.clock import SystemClock
from stalwart.errors import CorruptRecordError
from stalwart.state import (
    ActivationsState,
    Claim,
    OrchestratorFolder,
    OrchestratorState,
    SessionView,
    UnderWay,
    retry_posture,
    session_dead_letters,
    under_way,
)
from stalwart.store import EventStore, read_all_readable, read_readable

STATUSES = ("new", "idle", "running", "requires_action", "closed", "run")


def shown_status(view: SessionView) -> str:
    """The session's status; ``run`` for a sub-agent run's stream, whatever the turn a
    model-driven run keeps inside it says (a swept run's turn is never closed: it is not
    ``running``); ``replay`` shows the run's own state."""
    status = view.session.status
    return "run" if view.run else status


# -- time -------------------------------------------------------------------------------------


def now_for(state: OrchestratorState) -> float:
    """The time a view is shown at: the real time, or the log's newest event when that is
    later (a log written on a fake clock, or copied from a machine whose clock runs ahead)."""
    real = SystemClock().now()
    return real if state.newest_ts is None else max(real, state.newest_ts)


def fmt_rel(at: float | None, now: float) -> str:
    """``in 12s``, ``3m05s ago``, ``now``; ``-`` for no time."""
    if at is None:
        return "-"
    delta = at - now
    if not math.isfinite(delta):  # a time no store accepts now (an older record's)
        return str(at)
    seconds = round(abs(delta))
    if seconds == 0:
        return "now"
    if seconds < 60:
        span = f"{seconds}s"
    elif seconds < 3600:
        span = f"{seconds // 60}m{seconds % 60:02d}s"
    elif seconds < 86400:
        span = f"{seconds // 3600}h{seconds % 3600 // 60:02d}m"
    else:
        span = f"{seconds // 86400}d{seconds % 86400 // 3600:02d}h"
    return f"in {span}" if delta > 0 else f"{span} ago"


# -- the projection, read ---------------------------------------------------------------------


def session_stream(session: str) -> str:
    return session if session.startswith("session:") else f"session:{session}"


class Unreadable:
    """The records a view's read passed over (it shows what it could read): after the
    output, :meth:`check` says so in one line (exit 1)."""

    def __init__(self) -> None:
        self.errors: dict[int, CorruptRecordError] = {}
        self.last = 0  # the last position passed over

    def __call__(self, at: int, exc: CorruptRecordError) -> None:
        position = exc.position if exc.position > 0 else at
        self.errors.setdefault(position, exc)
        self.last = max(self.last, position, exc.through)  # a run of missing records: its end

    def check(self) -> None:
        if not self.errors:
            return
        first = min(self.errors)
        more = len(self.errors) - 1
        also = f" (and {more} more)" if more else ""
        raise CorruptRecordError(
            first,
            f"{self.errors[first].reason}{also}; what could be read is shown "
            "(`stalwart db check` reports the damage)",
        )


def fold_all(
    store: EventStore,
    folder: OrchestratorFolder | None = None,
    unreadable: Unreadable | None = None,
) -> OrchestratorFolder:
    """Fold what was appended since ``folder`` last looked (everything, for a new one),
    passing over records that cannot be read (``unreadable`` hears of each)."""
    folder = folder or OrchestratorFolder()
    unreadable = unreadable if unreadable is not None else Unreadable()
    start = max(folder.position, unreadable.last) + 1
    for record in read_all_readable(store, start, unreadable=unreadable):
        folder.add(record)
    return folder


def fold_session(
    store: EventStore, stream: str, unreadable: Unreadable | None = None
) -> tuple[OrchestratorState, tuple[UnderWay, ...]]:
    """The projection of one session's stream and the dead-letter stream (the rest of the
    log is not read), passing over records that cannot be read; its ``newest_ts`` is the
    later of theirs and the log's last record's (when that one can be read: another
    stream's damage is not this view's to report). With it, the session's calls still
    under way."""
    own = list(read_readable(store, stream, unreadable=unreadable))
    records = [*own, *read_readable(store, "deadletter", unreadable=unreadable)]
    folder = OrchestratorFolder()
    for record in sorted(records, key=lambda r: r.position):
        folder.add(record)
    state = folder.state()
    head = store.head()
    elsewhere = Unreadable()  # the head is read for its time only
    newest = (
        next(read_all_readable(store, head, head, unreadable=elsewhere), None) if head else None
    )
    if newest is not None and (state.newest_ts is None or newest.ts > state.newest_ts):
        state = msgspec.structs.replace(state, newest_ts=newest.ts)
    return state, under_way(own)


# -- views: the --json shapes -----------------------------------------------------------------


def _lease(activations: ActivationsState, now: float) -> dict[str, Any] | None:
    lease = activations.lease
    if lease is None:
        return None
    return {
        "activation_id": lease.activation_id,
        "owner": lease.owner,
        "epoch": lease.epoch,
        "leased_at": lease.leased_at,
        "expires_at": lease.expires_at,
        "expired": now >= lease.expires_at,
    }


def _pending(view: SessionView) -> dict[str, Any] | None:
    pending = view.session.pending
    if pending is None:
        return None
    return {
        "request_id": pending.request_id,
        "kind": pending.kind,
        "tool": pending.tool,
        "input": pending.arguments,
    }


def _outcome(activations: ActivationsState) -> dict[str, Any] | None:
    outcome = activations.last_outcome
    if outcome is None:
        return None
    return {
        "activation_id": outcome.activation_id,
        "status": outcome.status,
        "at": outcome.at,
        "error_class": outcome.error_class,
    }


def _retry(activations: ActivationsState) -> dict[str, Any]:
    posture = retry_posture(activations)
    return {
        "attempt": posture.attempt,
        "streak": posture.streak,
        "next_run_at": posture.next_run_at,
        "last_error": posture.last_error,
        "retrying": posture.retrying,
    }


def session_row(view: SessionView, now: float) -> dict[str, Any]:
    """One session of the overview."""
    activations = view.activations
    return {
        "session": view.stream,
        "status": shown_status(view),
        "agent": view.session.agent,
        "queued": activations.backlog,
        "lease": _lease(activations, now),
        "retry": _retry(activations),
        "last_outcome": _outcome(activations),
        "pending": _pending(view),
        "updated_at": view.session.updated_at,
    }


def _dead_letters(
    state: OrchestratorState, stream: str | None = None, total: int | None = None
) -> dict[str, Any]:
    """The dead letters of the whole log, or of ``stream`` (whose abandoned activations,
    ``total`` of them, are more than the newest kept when past ``ABANDONED_KEPT``)."""
    if stream is None:
        abandoned, entries = state.abandoned, state.deadletter.entries
        total = state.abandoned_total
    else:
        abandoned, entries = session_dead_letters(state, stream)
        total = len(abandoned) if total is None else max(total, len(abandoned))
    return {
        "announcements": [
            {
                "entry_id": e.entry_id,
                "announcement_id": e.announcement_id,
                "channel": e.channel,
                "conversation": e.conversation,
                "reason": e.reason,
                "attempts": e.attempts,
                "last_error": e.last_error,
                "enqueued_at": e.enqueued_at,
            }
            for e in entries
        ],
        "activations": [
            {
                "session": a.session,
                "activation_id": a.activation_id,
                "kind": a.kind,
                "attempts": a.attempts,
                "error_class": a.error_class,
                "retryable": a.retryable,
                "at": a.at,
            }
            for a in abandoned
        ],
        "activations_total": total,
    }


def _providers(state: OrchestratorState) -> list[dict[str, Any]]:
    return [
        {
            "provider": p.provider,
            "health": p.health.status,
            "degraded_at": p.health.degraded_at,
            "last_failure_at": p.health.last_failure_at,
            "breaker": p.breaker.status,
            "breaker_opened_at": p.breaker.opened_at,
        }
        for p in state.providers
    ]


def overview(state: OrchestratorState, now: float, limit: int | None = None) -> dict[str, Any]:
    """``status --json`` without a session: one object. With a ``limit``, the rows of the
    first ``limit`` sessions only (a view that shows no more; ``counts`` counts them all)."""
    counts = dict.fromkeys(STATUSES, 0)
    for view in state.sessions:
        shown = shown_status(view)
        counts[shown] = counts.get(shown, 0) + 1
    listed = state.sessions if limit is None else state.sessions[:limit]
    return {
        "now": now,
        "position": state.position,
        "counts": counts,
        "sessions": [session_row(view, now) for view in listed],
        "dead_letters": _dead_letters(state),
        "providers": _providers(state),
    }


def _ended(claim: Claim, activations: ActivationsState) -> str:
    """How a claim ended: as the fold says, ``holding`` for the live lease, else
    ``superseded`` (a later epoch took over with no settlement of this one: an
    interrupt)."""
    if claim.ended is not None:
        return claim.ended
    lease = activations.lease
    return "holding" if lease is not None and lease.epoch == claim.epoch else "superseded"


def session_detail(
    state: OrchestratorState,
    view: SessionView,
    now: float,
    calls: tuple[UnderWay, ...] = (),
) -> dict[str, Any]:
    """``status SESSION --json``: one session in full (``calls``: those under way)."""
    session, activations = view.session, view.activations
    return {
        "now": now,
        "session": view.stream,
        "status": shown_status(view),
        "agent": session.agent,
        "parent": session.parent,
        "turns": session.turns,
        "messages": session.messages,
        "updated_at": session.updated_at,
        "pending": _pending(view),
        "under_way": [
            {
                "kind": call.kind,
                "name": call.name,
                "call_id": call.call_id,
                "attempt": call.attempt or None,
                "since": call.since,
            }
            for call in calls
        ],
        "retry": _retry(activations),
        "backlog": [
            {
                "activation_id": a.activation_id,
                "kind": a.kind,
                "ready_at": a.ready_at,
                "run_at": a.run_at,
                "streak": a.streak,
                "last_error": a.last_error,
            }
            for a in activations.queue
        ],
        "lease": _lease(activations, now),
        "epoch": activations.epoch,
        "blocked_on": activations.blocked_on,
        "last_outcome": _outcome(activations),
        "history": [
            {
                "activation_id": c.activation_id,
                "owner": c.owner,
                "epoch": c.epoch,
                "at": c.at,
                "ended": _ended(c, activations),
            }
            for c in activations.history
        ],
        "counters": {
            "acked": activations.acked,
            "requeued": activations.requeued,
            "abandoned": activations.abandoned,
            "lease_expired": activations.expired,
        },
        "dead_letters": _dead_letters(state, view.stream, activations.abandoned),
        "drafts": [
            {
                "path": d.path,
                "status": d.status,
                "revision": d.revision,
                "size": d.size,
                "content_hash": d.content_hash,
                "updated_at": d.updated_at,
            }
            for d in sorted(
                (view.drafts.drafts.values() if view.drafts else ()), key=lambda d: d.path
            )
        ],
    }
