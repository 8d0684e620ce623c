"""Supervision of crashed actors: one_for_one restarts with intensity and backoff.

pykka has no supervision of its own: an actor whose ``on_receive`` raises on a told
message is stopped and its ``on_failure`` runs. A supervised Agent or SubAgent is given
an ``on_crash`` callback that tells the supervisor :class:`Crashed`; the supervisor asks
:func:`~stalwart.state.decide_restart` with the actor's earlier ``supervisor:restarted``
times from the ``runtime`` stream (:func:`~stalwart.state.restart_history`), appends the
decision there, and then acts: ``restart()`` after the backoff (a scheduler timer, so a
``FakeClock`` drives it), or, on ``supervisor:gave_up``, the static :data:`GAVE_UP_TEXT`
to the affected session's channel (``announcement:queued`` / ``delivered`` or
``send_failed`` in the ``runtime`` stream; a failed send goes to the dead-letter queue).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import msgspec
import structlog

from stalwart.config import SupervisionSettings
from stalwart.events import SupervisorGaveUp, SupervisorRestarted
from stalwart.state import decide_restart, restart_history
from stalwart.store import EventStore

__all__ = [
    "GAVE_UP_TEXT",
    "RESTART_STREAM",
    "Crashed",
    "RestartNoticeSent",
    "crashed",
    "decide_crash",
]

log = structlog.get_logger(__name__)

#: Where restart decisions go.
RESTART_STREAM = "runtime"
#: What the affected session reads when its actor kept crashing and was given up on.
GAVE_UP_TEXT = (
    "Sorry, something went wrong on our side and this conversation's agent had to be "
    "stopped. Please try again later."
)


@dataclass(frozen=True, kw_only=True)
class Crashed:
    """Told by a supervised actor's ``on_failure``: who crashed, why (the exception's
    class, never its text), where its session's user reads, and how to start it again."""

    actor: str
    reason: str
    restart: Callable[[], object]
    session: str | None = None
    channel: str = ""
    conversation: str = ""


class RestartNoticeSent(msgspec.Struct, frozen=True, kw_only=True):
    """The outcome of a give-up notice's send (``error_class`` None when delivered)."""

    announcement_id: str
    channel: str
    conversation: str
    error_class: str | None = None


def decide_crash(
    store: EventStore, crashed: Crashed, now: float, settings: SupervisionSettings
) -> SupervisorRestarted | SupervisorGaveUp:
    """The pure decision on the history read from the log."""
    history = restart_history(store.read_stream(RESTART_STREAM), crashed.actor)
    return decide_restart(
        crashed.actor,
        history,
        now,
        reason=crashed.reason,
        max_restarts=settings.max_restarts,
        within_ms=settings.within_ms,
        backoff_base_ms=settings.restart_backoff_base_ms,
        backoff_cap_ms=settings.restart_backoff_cap_ms,
        session=crashed.session,
    )


def crashed(on_crash: Callable[[str], object] | None, exc_info: tuple[object, ...]) -> None:
    """An actor's ``on_failure``: tell ``on_crash`` the exception's class (never raises)."""
    if on_crash is None:
        return
    kind = exc_info[0] if exc_info else None
    name = kind.__name__ if isinstance(kind, type) else "unknown"
    try:
        on_crash(name)
    except Exception:  # the actor is dying already: a broken callback is only logged
        log.exception("supervision.on_crash_failed", reason=name)
