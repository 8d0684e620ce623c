"""The give-up notices of the ``runtime`` stream, and when a crash's cut-short send of
one is owed again: a pure fold and a pure decision.

When supervision gives up on a session's actor it appends ``supervisor:gave_up`` and,
in the same append, the static notice to the session's user (``announcement:queued``,
kind ``failure_notice``, id ``<crash_id>-notice``), then sends it; the send's outcome
(``announcement:delivered`` or ``announcement:send_failed``) ends it. A notice with no
outcome was cut short by a crash or a close (the process died mid-send). A supervisor's
sweep sends it again (``announcement:resent``, then the send) once a send could have
ended since it last began: ``announce_timeout_ms`` plus 5 s after its queueing or its
latest ``announcement:resent`` (:func:`~._deadletter.hold_ms`), and only while it was
queued at most :data:`RESEND_WITHIN_S` before (:func:`decide_notice_resends`).

The fold keeps only the notices still without an outcome: a notice whose last send
began more than :data:`RESEND_WITHIN_S` before a later record is forgotten (no send
lasts that long, and it is too old to send again), so it stays small on a runtime stream
that grows with every restart for as long as a deployment lives.
"""

from __future__ import annotations

from collections.abc import Iterable

import msgspec

from stalwart.events import (
    AnnouncementDelivered,
    AnnouncementQueued,
    AnnouncementResent,
    AnnouncementSendFailed,
    Event,
    RecordedEvent,
    SupervisorGaveUp,
)

from ._aggregate import FolderAggregate
from ._deadletter import hold_ms

__all__ = [
    "GIVE_UP_NOTICES",
    "RESEND_WITHIN_S",
    "GiveUpNotice",
    "GiveUpNotices",
    "GiveUpNoticesFolder",
    "decide_notice_resends",
    "notice_resend_due",
    "notice_resend_wait_s",
]

#: How long after it was queued an announcement whose send a crash cut short is sent
#: again (the dead-letter queue's default maximum age: older news is stale): a give-up
#: notice here, a session's reply or notice in its Agent.
RESEND_WITHIN_S = 3_600.0


class GiveUpNotice(msgspec.Struct, frozen=True, kw_only=True, gc=False):
    """A give-up notice with no outcome yet: the notice, whose actor and session it is
    about, when it was queued and when its latest send began (its queueing, or its
    latest ``announcement:resent``)."""

    notice: AnnouncementQueued
    actor: str
    session: str | None = None
    queued_at: float
    since: float


class GiveUpNotices(msgspec.Struct, frozen=True, kw_only=True, gc=False):
    """The ``runtime`` stream's give-up notices with no outcome, by announcement id, and
    the latest give-up whose notice may follow it (appended with it)."""

    unsent: dict[str, GiveUpNotice] = msgspec.field(default_factory=dict)
    gave_up: SupervisorGaveUp | None = None


#: the event types that move :class:`GiveUpNotices`
_MOVES: frozenset[type[Event]] = frozenset(
    {
        *(SupervisorGaveUp, AnnouncementQueued, AnnouncementResent),
        *(AnnouncementDelivered, AnnouncementSendFailed),
    }
)


class GiveUpNoticesFolder:
    """The fold of :class:`GiveUpNotices`; other events cost one lookup."""

    __slots__ = ("_gave_up", "_state", "_unsent")

    def __init__(self, state: GiveUpNotices) -> None:
        self._unsent = dict(state.unsent)
        self._gave_up = state.gave_up
        self._state: GiveUpNotices | None = state  # the frozen state, until the next change

    def add(self, record: RecordedEvent) -> None:
        event = record.event
        if type(event) not in _MOVES:
            return
        self._state = None
        match event:
            case SupervisorGaveUp() if event.crash_id:
                self._gave_up = event
            case AnnouncementQueued(kind="failure_notice"):
                self._queued(event, record.ts)
            case AnnouncementResent():
                unsent = self._unsent.get(event.announcement_id)
                if unsent is not None:
                    self._unsent[event.announcement_id] = msgspec.structs.replace(
                        unsent, since=record.ts
                    )
            case AnnouncementDelivered() | AnnouncementSendFailed():
                self._unsent.pop(event.announcement_id, None)
            case _:
                pass

    def _queued(self, notice: AnnouncementQueued, ts: float) -> None:
        gave_up = self._gave_up
        if gave_up is None or notice.announcement_id != f"{gave_up.crash_id}-notice":
            return  # not a give-up's notice
        self._gave_up = None
        self._forget_old(ts)
        self._unsent[notice.announcement_id] = GiveUpNotice(
            notice=notice, actor=gave_up.actor, session=gave_up.session, queued_at=ts, since=ts
        )

    def _forget_old(self, now: float) -> None:
        """Drop the notices whose last send began more than RESEND_WITHIN_S before
        ``now``: none is sent any more, and no send of one is still under way."""
        old = [key for key, n in self._unsent.items() if now - n.since > RESEND_WITHIN_S]
        for key in old:
            del self._unsent[key]

    def state(self) -> GiveUpNotices:
        if self._state is None:
            self._state = GiveUpNotices(unsent=dict(self._unsent), gave_up=self._gave_up)
        return self._state


#: :class:`GiveUpNotices` over the ``runtime`` stream
GIVE_UP_NOTICES = FolderAggregate(
    "give_up_notices", GiveUpNotices, GiveUpNoticesFolder, moves=_MOVES
)


def notice_resend_wait_s(announce_timeout_ms: int) -> float:
    """How long after a send of a notice began it may still be under way."""
    return hold_ms(announce_timeout_ms) / 1000


def decide_notice_resends(
    state: GiveUpNotices,
    now: float,
    *,
    announce_timeout_ms: int,
    in_flight: Iterable[str] = (),
) -> list[AnnouncementResent]:
    """The notices to send again at ``now``: no outcome, their latest send began at
    least ``announce_timeout_ms`` + 5 s before (it would have ended), queued at most
    :data:`RESEND_WITHIN_S` before, and not being sent by the deciding process
    (``in_flight``: its sends whose outcome it has not recorded yet)."""
    wait_s = notice_resend_wait_s(announce_timeout_ms)
    busy = frozenset(in_flight)
    return [
        AnnouncementResent(announcement_id=announcement_id)
        for announcement_id, unsent in state.unsent.items()
        if now - unsent.queued_at <= RESEND_WITHIN_S
        and now - unsent.since >= wait_s
        and announcement_id not in busy
    ]


def notice_resend_due(
    state: GiveUpNotices,
    *,
    announce_timeout_ms: int,
    sweep_ms: int,
    not_before: float = 0.0,
) -> float | None:
    """When the next resend falls due (None: none owed): the earliest moment a notice
    is owed again, no earlier than ``not_before`` (the latest process's start), of the
    notices still owed a sweep (every ``sweep_ms``) after it and before they are too old."""
    wait_s = notice_resend_wait_s(announce_timeout_ms)
    earliest: float | None = None
    for unsent in state.unsent.values():
        due = max(unsent.since + wait_s, not_before)
        if due + sweep_ms / 1000 > unsent.queued_at + RESEND_WITHIN_S:
            continue  # its sweep may come only once it is too old to send
        if earliest is None or due < earliest:
            earliest = due
    return earliest
