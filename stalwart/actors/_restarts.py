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
The decision needs the store: while it is away (when actors die of it), the crash is
told again every :data:`DECISION_RETRY_S` until it can be decided; a decision whose
append was written after all is found by its ``crash_id``, not made twice.

The ``runtime`` stream grows with every start, restart and give-up for as long as a
deployment lives, so :class:`Restarts` folds it as it goes (the restarts of its runtime
instance still inside the window, and :data:`~stalwart.state.GIVE_UP_NOTICES`) and reads
only the records after the ones it folded. A give-up notice a crash cut short is sent
again as :func:`~stalwart.state.decide_notice_resends` decides, which replay re-derives.
A sub-agent run's actor given up on ends its run instead (``subagent:given_up``, then the
run's own failure notice and recovery decision, as for a run that timed out).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from concurrent.futures import Future
from dataclasses import dataclass, field, replace
from typing import Any

import msgspec
import pykka

from stalwart._logs import get_logger
from stalwart.channels import Channel, OutboundMessage, channel_named
from stalwart.clock import Clock
from stalwart.config import SupervisionSettings
from stalwart.errors import ConcurrencyError, StoreError
from stalwart.events import (
    AnnouncementDelivered,
    AnnouncementQueued,
    AnnouncementResent,
    AnnouncementSendFailed,
    Event,
    RecordedEvent,
    SessionCreated,
    SupervisorGaveUp,
    SupervisorRestarted,
)
from stalwart.ids import new_id
from stalwart.state import (
    RESEND_WITHIN_S,
    GiveUpNotice,
    GiveUpNotices,
    GiveUpNoticesFolder,
    decide_notice_resends,
    decide_restart,
    restart_history,
)
from stalwart.store import EventStore, NewEvent

from ._deadletter import Enqueue, dead_letter
from ._portal import IoPortal
from ._scheduler import Scheduler
from ._send import noting, retry_after_of, send_by_clock

__all__ = [
    "GAVE_UP_TEXT",
    "RESEND_WITHIN_S",
    "RESTART_STREAM",
    "Crashed",
    "RestartNoticeSent",
    "Restarts",
    "crashed",
    "decide_crash",
    "tell_later",
]

log = get_logger(__name__)

#: Where restart decisions go.
RESTART_STREAM = "runtime"
#: How long a crash (or an outcome the supervisor records) waits to be told again when
#: the store failed what it records.
DECISION_RETRY_S = 1.0
#: How many times a sweep decides the resends again when the ``runtime`` stream moved
#: between its read and the resend's append.
RESEND_ATTEMPTS = 3
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
    thread: str | None = None
    #: False for an actor no single session depends on (the runtime's infrastructure):
    #: a give-up is appended and logged, with no notice to send.
    notify: bool = True
    #: the run's stream when the actor runs a sub-agent run: a give-up ends the run as
    #: failed (its own notice names the task) instead of sending :data:`GAVE_UP_TEXT`
    run: str | None = None
    #: names the decision (``crash_id`` of ``supervisor:restarted`` / ``gave_up``)
    crash_id: str = field(default_factory=new_id)
    #: told again after a store error: its decision may be in the log already
    retry: bool = False


class RestartNoticeSent(msgspec.Struct, frozen=True, kw_only=True):
    """The outcome of a give-up notice's send (``error_class`` None when delivered)."""

    announcement_id: str
    channel: str
    conversation: str
    thread: str | None = None
    error_class: str | None = None
    #: the receiver's Retry-After (ms) with the failure, if it sent one
    retry_after_ms: int | None = None


def decide_crash(
    store: EventStore,
    crashed: Crashed,
    now: float,
    settings: SupervisionSettings,
    runtime: str = "",
) -> SupervisorRestarted | SupervisorGaveUp:
    """The pure decision on the runtime instance's history read from the log (all of the
    ``runtime`` stream: :class:`Restarts` folds it as it grows instead)."""
    history = restart_history(store.read_stream(RESTART_STREAM), crashed.actor, runtime)
    return _decide(crashed, history, now, settings, runtime)


def _decide(
    crashed: Crashed,
    history: tuple[float, ...],
    now: float,
    settings: SupervisionSettings,
    runtime: str,
) -> SupervisorRestarted | SupervisorGaveUp:
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
        runtime=runtime,
        crash_id=crashed.crash_id,
    )


def tell_later(
    scheduler: Scheduler,
    clock: Clock,
    tell: Callable[[Any], object],
    message: object,
    key: object = None,
) -> None:
    """Tell ``message`` again in :data:`DECISION_RETRY_S`: what it records met a store
    error. A dead recipient (its supervisor is being restarted) is tried again later."""

    def again(_at: float) -> None:
        try:
            tell(message)
        except pykka.ActorDeadError:
            tell_later(scheduler, clock, tell, message, key)

    scheduler.schedule(clock.now() + DECISION_RETRY_S, again, key=key)


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


class Restarts:
    """The supervisor's restart duty (its thread only): decide, append, then act."""

    def __init__(
        self,
        *,
        store: EventStore,
        clock: Clock,
        scheduler: Scheduler,
        portal: IoPortal,
        channels: Mapping[str, Channel],
        dead_letters: pykka.ActorRef[Any] | None,
        settings: SupervisionSettings,
        send_timeout_s: float,
        default_channel: str,
        tell: Callable[[object], None],
        key: str,
        runtime: str = "",
        end_run: Callable[[str, SupervisorGaveUp], object] | None = None,
        retry: Callable[[Crashed], object] | None = None,
    ) -> None:
        self._store = store
        self._clock = clock
        self._scheduler = scheduler
        self._portal = portal
        self._channels = channels
        self._dead_letters = dead_letters
        self._settings = settings
        self._send_s = send_timeout_s
        self._announce_ms = round(send_timeout_s * 1000)
        self._default_channel = default_channel
        self._tell = tell
        self._key = key
        self._runtime = runtime
        self._end_run = end_run
        #: how a crash whose decision failed on the store is told again (by default to
        #: ``tell``); ActorDeadError (its supervisor is being restarted) tries later
        self._retry = retry or tell
        #: the ``runtime`` stream folded up to its version ``_read_to``: the give-up
        #: notices with no outcome yet, and the restarts of this runtime instance by
        #: actor (those that may still count: see _forget_restarts)
        self._notices = GiveUpNoticesFolder(GiveUpNotices())
        self._restarted: dict[str, tuple[float, ...]] = {}
        self._read_to = 0
        #: the notices this process is sending (no outcome recorded yet)
        self._in_flight: set[str] = set()

    def crashed(self, crashed: Crashed) -> None:
        now = self._clock.now()
        try:
            decision, notice = self._recorded(crashed, now)
        except StoreError as exc:  # never lose the crash: a restart must still come
            log.warning(
                "supervision.decision_deferred", actor=crashed.actor, error=type(exc).__name__
            )
            self._defer(replace(crashed, retry=True))
            return
        if isinstance(decision, SupervisorRestarted):
            log.warning("supervision.restarting", actor=crashed.actor, ms=decision.backoff_ms)
            restart = crashed.restart
            self._scheduler.schedule(
                now + decision.backoff_ms / 1000,
                lambda _at: restart(),
                key=("restart", self._key, crashed.actor),
            )
            return
        log.error("supervision.gave_up", actor=crashed.actor, restarts=decision.restarts)
        if crashed.run is not None and self._end_run is not None:
            try:
                self._end_run(crashed.run, decision)
            except StoreError as exc:  # the run's end: decided again from the log, later
                log.warning(
                    "supervision.end_run_deferred", run=crashed.run, error=type(exc).__name__
                )
                self._defer(replace(crashed, retry=True))
        elif notice is not None:
            conversation = crashed.conversation or crashed.session or crashed.actor
            self._send(notice, conversation, crashed.thread)

    def _defer(self, crashed: Crashed) -> None:
        """Tell the crash again in :data:`DECISION_RETRY_S`."""
        key = ("restart-decision", self._key, crashed.crash_id)
        tell_later(self._scheduler, self._clock, self._retry, crashed, key)

    def _recorded(
        self, crashed: Crashed, now: float
    ) -> tuple[SupervisorRestarted | SupervisorGaveUp, AnnouncementQueued | None]:
        """The crash's decision and give-up notice (None: none to send), appended to the
        ``runtime`` stream, or found there when an earlier try's append was written."""
        notice = AnnouncementQueued(
            announcement_id=f"{crashed.crash_id}-notice",
            channel=crashed.channel or self._default_channel,
            kind="failure_notice",
            text=GAVE_UP_TEXT,
        )
        ends_run = crashed.run is not None and self._end_run is not None
        notifies = crashed.notify and not ends_run
        decision = self._found(crashed.crash_id) if crashed.retry else None
        if decision is None:
            decision = self._decision(crashed, now)
            gives_up = isinstance(decision, SupervisorGaveUp) and notifies
            events: list[Event] = [decision, notice] if gives_up else [decision]
            self._store.append(RESTART_STREAM, [NewEvent(event=e, ts=now) for e in events])
        return decision, notice if isinstance(decision, SupervisorGaveUp) and notifies else None

    def _decision(self, crashed: Crashed, now: float) -> SupervisorRestarted | SupervisorGaveUp:
        """:func:`decide_crash` on the folded history (only the records since the last
        decision are read)."""
        self._catch_up()
        self._forget_restarts(now)
        history = self._restarted.get(crashed.actor, ())
        return _decide(crashed, history, now, self._settings, self._runtime)

    def _forget_restarts(self, now: float) -> None:
        """Drop the restarts no decision at ``now`` or later counts (``within_ms`` or more
        before it), and the actors left with none: the fold stays as small as the window.
        (Only a clock set back by more than the window would count one of them again.)"""
        window_s = self._settings.within_ms / 1000
        kept = {
            actor: recent
            for actor, times in self._restarted.items()
            if (recent := tuple(ts for ts in times if ts > now or now - ts < window_s))
        }
        self._restarted = kept

    def _catch_up(self) -> None:
        """Fold what the ``runtime`` stream gained since the last pass."""
        for record in self._store.read_stream(RESTART_STREAM, self._read_to + 1):
            self._fold(record)

    def _fold(self, record: RecordedEvent) -> None:
        self._read_to = record.version
        self._notices.add(record)
        event = record.event
        if isinstance(event, SupervisorRestarted) and event.runtime == self._runtime:
            self._restarted[event.actor] = (*self._restarted.get(event.actor, ()), record.ts)

    def _found(self, crash_id: str) -> SupervisorRestarted | SupervisorGaveUp | None:
        """The decision of ``crash_id`` already in the ``runtime`` stream, if any (read in
        full: only a crash told again after a store error asks)."""
        for record in self._store.read_stream(RESTART_STREAM):
            event = record.event
            if isinstance(event, SupervisorRestarted | SupervisorGaveUp) and (
                event.crash_id == crash_id
            ):
                return event
        return None

    def _send(self, notice: AnnouncementQueued, conversation: str, thread: str | None) -> None:
        self._in_flight.add(notice.announcement_id)
        message = OutboundMessage(
            conversation=conversation,
            thread=thread,
            text=notice.text,
            idempotency_key=notice.announcement_id,
            kind="failure_notice",
        )
        # the receiver's Retry-After goes with a failure
        noted = noting(channel_named(self._channels, notice.channel))
        future = send_by_clock(
            self._portal, self._scheduler, self._clock, noted, message, self._send_s
        )

        def done(finished: Future[str | None]) -> None:
            if finished.cancelled():
                error: str | None = "cancelled"
            else:
                exc = finished.exception()
                error = type(exc).__name__ if exc is not None else finished.result()
            sent = RestartNoticeSent(
                announcement_id=notice.announcement_id,
                channel=notice.channel,
                conversation=conversation,
                thread=thread,
                error_class=error,
                retry_after_ms=retry_after_of(noted, error),
            )
            self._tell(sent)

        future.add_done_callback(done)

    def notice_sent(self, outcome: RestartNoticeSent) -> None:
        """Record the give-up notice's send (dead-lettered first when it failed), once: an
        outcome told again after a store error may be in the log already."""
        if self._outcome_recorded(outcome.announcement_id):
            self._in_flight.discard(outcome.announcement_id)
            return
        event: Event
        if outcome.error_class is None:
            event = AnnouncementDelivered(announcement_id=outcome.announcement_id, path="direct")
        else:
            event = AnnouncementSendFailed(
                announcement_id=outcome.announcement_id,
                error_class=outcome.error_class,
                retry_after_ms=outcome.retry_after_ms,
            )
        if outcome.error_class is not None:  # the queue's entry first, then the failure
            enqueue = Enqueue(
                announcement_id=outcome.announcement_id,
                channel=outcome.channel,
                conversation=outcome.conversation,
                text=GAVE_UP_TEXT,
                reason=outcome.error_class,
                thread=outcome.thread,
                kind="failure_notice",
                retry_after_ms=outcome.retry_after_ms,  # its first retry waits for it
            )
            dead_letter(self._dead_letters, enqueue)
        self._store.append(RESTART_STREAM, [NewEvent(event=event, ts=self._clock.now())])
        # in flight until its outcome is in the log: a sweep between the send's end and
        # this record must not take it for one a crash cut short
        self._in_flight.discard(outcome.announcement_id)

    def _outcome_recorded(self, announcement_id: str) -> bool:
        """Whether the notice's send has an outcome in the log: not while the fold holds
        it unsent (every send's first outcome); otherwise (an outcome told again after a
        store error) the stream is read to be sure."""
        self._catch_up()
        if announcement_id in self._notices.state().unsent:
            return False
        return any(
            isinstance(record.event, AnnouncementDelivered | AnnouncementSendFailed)
            and record.event.announcement_id == announcement_id
            for record in self._store.read_stream(RESTART_STREAM)
        )

    # -- notices a crash or a close cut short ---------------------------------------------

    def resend_cut_short(self) -> None:
        """Send again each give-up notice whose send never ended: queued (or last sent
        again) longer ago than a send can take and at most :data:`RESEND_WITHIN_S` ago,
        with no outcome in the ``runtime`` stream, and not being sent by this process.
        The process that queued it was killed or closed mid-send; no session's Agent
        says it (it is not in the session's stream), so without this the user would
        never hear. ``announcement:resent`` is appended first, expecting the stream's
        version: of two runtimes on one log, one sends; the other sees it and waits
        for that send as for the first. The same idempotency key is sent again. A stream
        that moved meanwhile is read and decided on again (at most
        :data:`RESEND_ATTEMPTS` times a sweep), not left to the next sweep: the resend is
        owed within a sweep's interval."""
        now = self._clock.now()
        for _ in range(RESEND_ATTEMPTS):
            self._catch_up()
            self._forget_restarts(now)
            owed = decide_notice_resends(
                self._notices.state(),
                now,
                announce_timeout_ms=self._announce_ms,
                in_flight=self._in_flight,
            )
            if self._resend(owed, now):
                return

    def _resend(self, owed: list[AnnouncementResent], now: float) -> bool:
        """Record and send each of ``owed`` again; False when the ``runtime`` stream moved
        since it was folded (another runtime, or a decision on another thread)."""
        for resent in owed:
            try:
                recorded = self._store.append(
                    RESTART_STREAM, [NewEvent(event=resent, ts=now)], expected_version=self._read_to
                )
            except ConcurrencyError:
                return False
            for record in recorded:
                self._fold(record)
            unsent = self._notices.state().unsent[resent.announcement_id]
            conversation, thread = self._address(unsent)
            log.warning("supervision.notice_resent", announcement=resent.announcement_id)
            self._send(unsent.notice, conversation, thread)
        return True

    def _address(self, unsent: GiveUpNotice) -> tuple[str, str | None]:
        """Where the notice goes: the session's recorded conversation and thread (its
        ``session:created``), as the crashed Agent's handle had them; else its id."""
        session = unsent.session
        if session is None:
            return unsent.actor, None
        first = next(iter(self._store.read_stream(f"session:{session}", 1, 1)), None)
        if first is not None and isinstance(first.event, SessionCreated):
            return first.event.conversation or session, first.event.thread
        return session, None
