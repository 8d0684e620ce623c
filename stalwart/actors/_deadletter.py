"""DeadLetter: the ``deadletter`` stream's writer in its process (seed 000's dead-letter
queue). Runtimes of other processes on the same store write it too: an append that finds
the stream moved on folds what they appended and appends again (a decision, such as an
expiry, is decided again first), so no entry is lost to a conflict. A follower thread
waits on the store's head and tells the queue when the stream moved past what it folded
(:class:`_Moved`): it takes in what the others appended and re-arms, so an entry queued by
a runtime that then stops for good is still retried and expired here.

An announcement or notice that could not be delivered is queued
(``announcement:dead_lettered``), retried up to ``max_retries`` times with deterministic
backoff, expired after ``max_age_ms``, once its retries are spent or at once when a
send's failure was final (``rejected:final``: a webhook's 401, say)
(``announcement:dead_letter_expired``: every drop is an event, none silent), and drained
at once, every entry, when a provider recovers. Each retry is a decision appended before
its send (``announcement:dead_letter_retried``, reason ``backoff`` or ``drain``) and its
outcome is recorded: ``announcement:dead_letter_delivered`` (the entry leaves the queue)
or ``announcement:send_failed`` with the ``entry_id`` (one more attempt).

The actor is a thin shell over the pure fold and policies of
:mod:`stalwart.state` (``DEADLETTER``, ``decide_expiry``, ``decide_retries``,
``next_retry_at``, ``expiry_at``, ``decide_drain``). For every message it receives, folds,
decides, appends, then acts:

* the state is only ever changed by folding what the store returned from an append, so
  the actor's state is the replay of its stream at every moment;
* decisions are appended with ``ts = clock.now()`` and computed from the state just
  before them at that same ``ts``, so replay re-derives them;
* a send starts only after what led to it is in the log, and runs on the
  :class:`~stalwart.actors.IoPortal`, bounded by ``announce_timeout_ms``; its outcome
  comes back as a :class:`RetrySent` message; the outcomes that came back together are
  appended in one batch before any other message is handled, then the queue is looked
  at once (a drain's cost grows with the backlog, not its square). At most one send
  per entry is in flight.

Restarts resume the queue: ``on_start`` folds the stream, expires what is due, starts the
retries that are due and arms the next deadline. A send in flight when the process died
left no outcome in the log, so it is sent again: delivery is at least once, and every
send of one announcement carries the same idempotency key (the announcement id) so that a
receiver can drop the duplicate.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future, InvalidStateError
from dataclasses import dataclass
from functools import partial
from types import TracebackType
from typing import Any, TypeVar

import msgspec
import pykka

from stalwart._logs import get_logger
from stalwart.channels import (
    Channel,
    MessageKind,
    OutboundMessage,
    RetryAfterNoted,
    channel_named,
    message_kind,
)
from stalwart.clock import Clock
from stalwart.config import DeadLetterSettings
from stalwart.errors import (
    ConcurrencyError,
    CorruptRecordError,
    StalwartError,
)
from stalwart.events import (
    AnnouncementDeadLetterDelivered,
    AnnouncementDeadLettered,
    AnnouncementDeadLetterRetried,
    AnnouncementSendFailed,
    Event,
    RecordedEvent,
)
from stalwart.ids import new_id
from stalwart.state import (
    DEADLETTER,
    Aggregate,
    DeadLetterState,
    decide_drain,
    decide_expiry,
    decide_retries,
    expiry_at,
    hold_ms,
    next_retry_at,
)
from stalwart.state._deadletter import HELD_BACK
from stalwart.store import (
    DEFAULT_SNAPSHOT_EVERY,
    EventStore,
    NewEvent,
    load_state,
    read_readable,
    save_snapshot,
    snapshot_name,
)

from ._follow import FOLLOW_SLICE_S, HeadFollower
from ._outage import StoreOutage
from ._portal import IoPortal
from ._scheduler import Scheduler
from ._send import send_by_clock
from ._supervised import Supervised

E = TypeVar("E", bound=Event)

__all__ = [
    "DEADLETTER_STREAM",
    "DeadLetterActor",
    "Drain",
    "Enqueue",
    "FoldSnapshots",
    "InFlight",
    "QueueState",
    "RetryDue",
    "RetrySent",
    "dead_letter",
    "entry_event",
]

log = get_logger(__name__)

DEADLETTER_STREAM = "deadletter"
#: How many times an append is tried again after another process appended first.
APPEND_TRIES = 20
#: How long a sender waits for the queue to record an entry before it records the failed
#: send that led to it (the entry is still recorded after: the Enqueue is in the mailbox).
ENQUEUE_WAIT_S = 5.0


# -- messages -----------------------------------------------------------------------------


class Enqueue(msgspec.Struct, frozen=True):
    """Queue an announcement that could not be delivered; ``ask`` replies with the new
    entry id once ``announcement:dead_lettered`` is in the log."""

    announcement_id: str
    channel: str
    conversation: str
    text: str
    reason: str
    thread: str | None = None
    #: what the message was (a failure notice is re-sent as one)
    kind: MessageKind = "reply"
    #: the receiver's Retry-After (ms) with the failed send (a sender that sent through
    #: :class:`~stalwart.channels._send.RetryAfterNoted`): the first retry waits for it
    retry_after_ms: int | None = None


def entry_event(enqueue: Enqueue) -> AnnouncementDeadLettered:
    """The ``announcement:dead_lettered`` that queues ``enqueue`` (a new entry id)."""
    return AnnouncementDeadLettered(
        entry_id=new_id(),
        announcement_id=enqueue.announcement_id,
        channel=enqueue.channel,
        text=enqueue.text,
        reason=enqueue.reason,
        conversation=enqueue.conversation,
        thread=enqueue.thread,
        kind=enqueue.kind,
        retry_after_ms=enqueue.retry_after_ms,
    )


def dead_letter(queue: pykka.ActorRef[Any] | None, enqueue: Enqueue) -> bool:
    """Give the queue a failed announcement and wait until its entry is in the log.

    Every sender (an Agent, the announcer, the supervisor) calls this *before* it appends
    the ``announcement:send_failed`` that led to it: a crash between the two then leaves
    a queued entry (and an announcement with no outcome, which the next start sends again:
    at least once), never a recorded failure that nobody will retry. Whether the entry is
    recorded, or will be (the queue is slow, or restarting and holds the message); False
    when there is no queue or it refused the entry (said in the log)."""
    if queue is None:
        return False
    try:
        queue.ask(enqueue, timeout=ENQUEUE_WAIT_S)
    except pykka.Timeout:  # still in the mailbox: recorded when the queue gets to it
        log.warning("deadletter.enqueue_slow", announcement_id=enqueue.announcement_id)
    except pykka.ActorDeadError:  # down: a restarting queue's LiveRef keeps the tell
        try:
            queue.tell(enqueue)
        except pykka.ActorDeadError:
            return False
    except Exception as exc:  # the queue could not record it (a store error): said
        log.error(
            "deadletter.enqueue_failed",
            announcement_id=enqueue.announcement_id,
            error_class=type(exc).__name__,
        )
        return False
    return True


class RetryDue(msgspec.Struct, frozen=True):
    """A deadline (retry or expiry) came: the scheduler fired at ``at``."""

    at: float


class RetrySent(msgspec.Struct, frozen=True):
    """The outcome of one send of entry ``entry_id``; ``error_class`` is content-free
    (a ChannelError's ``kind``, ``timeout``, ``unknown_channel``, ``cancelled``, ...)."""

    entry_id: str
    ok: bool
    error_class: str | None = None
    #: the receiver's Retry-After (ms) with the failure, if it sent one
    retry_after_ms: int | None = None


class Drain(msgspec.Struct, frozen=True):
    """``provider:recovered`` was decided for ``provider``: drain the queue now."""

    provider: str


class _Outcomes(msgspec.Struct, frozen=True):
    """Append the outcomes of the sends that ended, then look at the queue."""


class _Moved(msgspec.Struct, frozen=True):
    """Another writer (a runtime of another process) appended to the stream: take it in."""


class QueueState(msgspec.Struct, frozen=True):
    """Ask for the current :class:`~stalwart.state.DeadLetterState`."""


class InFlight(msgspec.Struct, frozen=True):
    """Ask for the ids of the entries whose send is in flight (a tuple, in the order the
    sends started)."""


@dataclass(frozen=True, slots=True)
class _InFlight:
    future: Future[str | None]
    announcement_id: str
    attempt: int  # the attempt this send is, counting from 1


# -- the send, on the portal's loop -------------------------------------------------------


def _outcome_event(message: RetrySent, sending: _InFlight) -> Event:
    """What the log records of one send's outcome."""
    if message.ok:
        return AnnouncementDeadLetterDelivered(entry_id=message.entry_id, attempts=sending.attempt)
    return AnnouncementSendFailed(
        announcement_id=sending.announcement_id,
        error_class=message.error_class or "unknown",
        entry_id=message.entry_id,
        retry_after_ms=message.retry_after_ms,
    )


def _outcome(entry_id: str, noted: RetryAfterNoted | None, future: Future[str | None]) -> RetrySent:
    if future.cancelled():
        return RetrySent(entry_id, ok=False, error_class="cancelled")
    exc = future.exception()
    error = type(exc).__name__ if exc is not None else future.result()
    if error is None:
        return RetrySent(entry_id, ok=True)
    hint = None if noted is None else noted.retry_after_ms
    return RetrySent(entry_id, ok=False, error_class=error, retry_after_ms=hint)


def _after(
    previous: Future[str | None], send: Callable[[], Future[str | None]]
) -> Future[str | None]:
    """The outcome of ``send()``, started once ``previous`` delivered; ``HELD_BACK``
    when it did not (a cancel of it: the sends are being released, and this one is
    cancelled too); cancelled before that, it never starts, and cancelled after, it
    cancels the send."""
    outcome: Future[str | None] = Future()

    def start(ended: Future[str | None]) -> None:
        if ended.cancelled():
            outcome.cancel()
        if outcome.done():  # cancelled
            return
        if ended.exception() is not None or ended.result() is not None:
            _copy(outcome, HELD_BACK)  # sent now, it would be read before the one that failed
            return
        try:
            sending = send()
        except Exception as exc:  # the portal stopped: the send fails, as a send would
            _copy(outcome, exc)
            return
        sending.add_done_callback(partial(_copied, outcome))
        outcome.add_done_callback(lambda done: sending.cancel() if done.cancelled() else None)

    previous.add_done_callback(start)
    return outcome


def _copied(outcome: Future[str | None], done: Future[str | None]) -> None:
    """Give ``outcome`` what ``done`` ended with."""
    if done.cancelled():
        outcome.cancel()
        return
    error = done.exception()
    _copy(outcome, error if error is not None else done.result())


def _copy(outcome: Future[str | None], result: str | BaseException | None) -> None:
    with contextlib.suppress(InvalidStateError):  # cancelled already
        if isinstance(result, BaseException):
            outcome.set_exception(result)
        else:
            outcome.set_result(result)


# -- the fold's snapshots, kept while the actor runs ---------------------------------------


class FoldSnapshots:
    """Saves the fold a long-lived actor keeps of its stream as it goes (the dead-letter
    queue's, a provider's health actor's): ``load_state`` saves one only as the actor
    starts, so without these the next start (a crash's restart, the next runtime on the
    log) would fold everything recorded since the previous start, longer after every
    long run. A snapshot is saved once ``snapshot_every`` records (the store's cadence;
    0: never) were folded past the last one, never past a record the actor could not
    read (a load that skipped one saves none either); one the store refuses is logged
    and tried again once another record is folded."""

    __slots__ = ("_aggregate", "_damaged", "_every", "_next", "_position", "_store", "_version")

    def __init__(self, store: EventStore, aggregate: Aggregate[Any]) -> None:
        self._store = store
        self._aggregate = aggregate
        self._every: int = getattr(store, "snapshot_every", DEFAULT_SNAPSHOT_EVERY)
        self._version = 0  # the last record folded, and where it is in the log
        self._position = 0
        self._next = self._every  # the version the next snapshot is due at
        self._damaged = False

    def loaded(self, version: int) -> None:
        """The actor loaded its state up to ``version`` (``load_state`` left the newest
        snapshot fewer than ``snapshot_every`` records behind it)."""
        self._version, self._position = version, 0
        self._next = version + self._every

    def folded(self, record: RecordedEvent) -> None:
        self._version, self._position = record.version, record.position

    def damaged(self) -> None:
        """A record of the stream could not be read: no snapshot from now on (a later load
        that does not skip must still meet the damage)."""
        self._damaged = True

    def keep(self, stream: str, state: object) -> None:
        """Save ``state`` (the fold up to the last record :meth:`folded`) when it is due."""
        if self._every <= 0 or self._damaged or self._position == 0:
            return
        if self._version < self._next:
            return
        name = snapshot_name(self._aggregate)
        if save_snapshot(self._store, stream, name, self._version, self._position, state):
            self._next = self._version + self._every
        else:  # a snapshot only saves time: the state is still right
            self._next = self._version + 1


# -- what other runtimes append -----------------------------------------------------------


# -- the actor ----------------------------------------------------------------------------


class DeadLetterActor(Supervised):
    """Owns the ``deadletter`` stream: queue, retry, expire, drain.

    Start with ``DeadLetterActor.start(store=..., clock=..., scheduler=..., portal=...,
    channels={name: channel}, settings=DeadLetterSettings())``. Messages:
    :class:`Enqueue` (replies with the entry id), :class:`Drain`,
    :class:`QueueState` (replies with the state), :class:`InFlight` (replies with the ids in
    flight); :class:`RetryDue` and :class:`RetrySent` are told by its own timer and sends.

    A store error or an append conflict (another writer on its stream) fails the actor;
    its supervisor restarts it, and the restart rebuilds everything from the log. A record
    of its stream that cannot be read is skipped (logged at ERROR): the rest of the queue
    is still delivered. While ``any_degraded()`` is true (a provider is degraded) the
    entries accumulate: no scheduled retry is spent, expiry still applies, and the drain
    on recovery sends them all (seed 000).
    ``on_crash(exception class name)`` is called once if the actor dies of an exception;
    the :class:`Enqueue` and :class:`Drain` told to it that it never handled are then
    handed, oldest first, to ``hand_over`` (the runtime's ref to whichever queue runs,
    which holds them for the restarted one ahead of what was told since), not dropped
    with it.
    """

    def __init__(
        self,
        *,
        store: EventStore,
        clock: Clock,
        scheduler: Scheduler,
        portal: IoPortal,
        channels: Mapping[str, Channel],
        settings: DeadLetterSettings | None = None,
        stream: str = DEADLETTER_STREAM,
        on_crash: Callable[[str], object] | None = None,
        any_degraded: Callable[[], bool] | None = None,
        runtime: str | None = None,
        hand_over: Callable[[list[Any]], object] | None = None,
    ) -> None:
        super().__init__()
        self._hand_over_to = hand_over
        #: the runtime instance this queue sends for (recorded with each retry)
        self._runtime = runtime
        self._on_crash = on_crash
        self._store = store
        self._clock = clock
        self._scheduler = scheduler
        self._portal = portal
        self._channels = dict(channels)
        self._settings = settings or DeadLetterSettings()
        self._stream = stream
        self._any_degraded = any_degraded
        self._state: DeadLetterState = DEADLETTER.initial(stream)
        self._folder = DEADLETTER.folder(self._state)
        self._snapshots = FoldSnapshots(store, DEADLETTER)
        #: the outcomes of sends that ended, not yet appended (see :meth:`_record_outcomes`)
        self._outcomes: list[tuple[RetrySent, _InFlight]] = []
        self._in_flight: dict[str, _InFlight] = {}
        self._timer_key = ("deadletter", self.actor_urn)
        #: when the timer is armed (None: not armed), and the version of the state it was
        #: armed on
        self._armed_at: float | None = None
        self._armed_version = -1
        #: a tick, a drain or outcomes the store failed are tried again a moment later
        self._outage = StoreOutage("deadletter", scheduler, clock, self._tell_self)
        #: follows what other runtimes append to the stream (started with the actor)
        self._follower: HeadFollower | None = None
        self._moved_pending = threading.Event()  # at most one _Moved in the mailbox

    def _tell_self(self, message: object) -> None:
        with contextlib.suppress(pykka.ActorDeadError):  # stopped meanwhile
            self.actor_ref.tell(message)

    # -- lifecycle ---------------------------------------------------------------------------

    def started(self) -> None:
        self._follower = HeadFollower(
            self._store,
            self._stream_moved,
            f"stalwart-deadletter-{self._stream}",
            part="deadletter",
            pace_s=FOLLOW_SLICE_S,  # a busy store: one look (a query) a slice
        )
        try:
            self._refold(load_state(self._store, self._stream, DEADLETTER))
            self._snapshots.loaded(self._state.version)
        except CorruptRecordError:  # fold it all again, past the records it cannot read
            self._snapshots.damaged()
            self._refold(DEADLETTER.initial(self._stream))
            self._catch_up()
        state = self._state
        log.info("deadletter.started", entries=len(state.entries), version=state.version)
        self._tick(self._clock.now())
        self._follower.start()

    def on_stop(self) -> None:
        try:  # a stop asked for records what already came back, so it is not sent again
            self._record_outcomes()
        except StalwartError as exc:  # the store went first: sent again at the next start
            log.warning("deadletter.outcomes_unrecorded", error_class=type(exc).__name__)
        self._release()

    def on_failure(
        self,
        exception_type: type[BaseException] | None,
        exception_value: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        from ._restarts import crashed  # noqa: PLC0415 (_restarts imports this module)

        self._release()
        self._hand_over(self.take_inbox())
        crashed(self._on_crash, (exception_type, exception_value, traceback))

    def _hand_over(self, told: list[Any]) -> None:
        """In ``on_failure``: the entries and drains told to this queue that it never
        handled (pykka would drop them: an entry held through a restart and flushed to
        a queue that died again would be lost), for its successor through ``hand_over``
        in one piece: ahead of what senders told meanwhile, in the order it was told."""
        kept = [message for message in told if isinstance(message, Enqueue | Drain)]
        if not kept:
            return
        if self._hand_over_to is None:
            log.error("deadletter.mail_dropped", count=len(kept))
            return
        log.warning("deadletter.mail_handed_over", count=len(kept))
        try:
            self._hand_over_to(kept)
        except pykka.ActorDeadError:  # no one holds it any more: said
            log.error("deadletter.mail_dropped", count=len(kept))

    def _release(self) -> None:
        """Stop following the stream; cancel the timer and the sends in flight; their
        outcomes reach no one."""
        if self._follower is not None:
            self._follower.stop()
        self._scheduler.cancel(self._timer_key)
        self._armed_at = None
        for sending in self._in_flight.values():
            sending.future.cancel()
        self._in_flight.clear()

    # -- messages ----------------------------------------------------------------------------

    def on_receive(self, message: Any) -> Any:
        match message:
            case _Moved():
                self._moved_pending.clear()
                return self._outage.run(message, self._take_in)
            case _Outcomes() | RetryDue() | Drain():
                # told by a timer, a send or a recovery: a store outage is waited out
                return self._outage.run(message, lambda: self._handle(message))
            case _:  # asked (the asker hears of a store error), or no store to meet
                return self._handle(message)

    def _handle(self, message: Any) -> Any:
        if not isinstance(message, RetrySent):
            self._record_outcomes()  # every other message sees the queue they leave
        match message:
            case _Outcomes():
                self._tick(self._clock.now())
            case Enqueue():
                return self._enqueue(message)
            case RetryDue():
                self._tick(self._clock.now())
            case RetrySent():
                self._sent(message)
            case Drain(provider=provider):
                self._drain(provider)
            case QueueState():
                return self._state
            case InFlight():
                return tuple(self._in_flight)
            case _:
                raise TypeError(f"DeadLetterActor does not understand {message!r}")
        return None

    def _enqueue(self, message: Enqueue) -> str:
        """Queue the announcement, unless an entry of it is already queued with retries
        left (a sender told again after a store error, or a resend that failed again):
        one entry per announcement, so it is delivered once."""
        self._catch_up()
        for queued in self._folder.queued_of(message.announcement_id):
            if queued.attempts < self._settings.max_retries and not queued.refused:
                log.info(
                    "deadletter.already_queued",
                    entry_id=queued.entry_id,
                    announcement_id=queued.announcement_id,
                )
                self._rearm()  # the entry may be another runtime's, just taken in
                return queued.entry_id
        event = entry_event(message)
        folded = self._state.version
        self._append([event], self._clock.now())
        log.warning(
            "deadletter.enqueued",
            entry_id=event.entry_id,
            announcement_id=event.announcement_id,
            channel=event.channel,
            reason=event.reason,
        )
        self._arm_for(event.entry_id, folded)
        return event.entry_id

    def _take_in(self) -> None:
        """Fold what other runtimes appended to the stream (entries they queued, retries
        they decided, outcomes) and re-arm: an entry queued by a runtime that stops for
        good is still retried and expired here."""
        self._record_outcomes()
        self._catch_up()
        self._rearm()

    def _rearm(self) -> None:
        """Re-arm when the state moved since the timer was armed (records of another
        runtime taken in)."""
        if self._armed_version != self._state.version:
            self._arm()

    def _sent(self, message: RetrySent) -> None:
        """A send ended: its outcome waits to be appended with the others that came back
        meanwhile (a drain's sends end together), then the queue is looked at once."""
        sending = self._in_flight.pop(message.entry_id, None)
        if sending is None:  # a stray RetrySent, not from a send of this actor
            return
        if not self._outcomes:
            self.actor_ref.tell(_Outcomes())  # behind the outcomes already in the mailbox
        self._outcomes.append((message, sending))

    def _record_outcomes(self) -> None:
        """Append the outcomes of the sends that ended, in one batch (the observations,
        even for an entry expired meanwhile)."""
        if not self._outcomes:
            return
        events = [_outcome_event(message, sending) for message, sending in self._outcomes]
        self._append(events, self._clock.now())
        for message, sending in self._outcomes:
            log.info(
                "deadletter.sent",
                entry_id=message.entry_id,
                ok=message.ok,
                error_class=message.error_class,
                retry_after_ms=message.retry_after_ms,
                attempt=sending.attempt,
            )
        self._outcomes.clear()

    def _drain(self, provider: str) -> None:
        """Send every entry now; within a conversation one after another, in the order
        they were queued (each once the send before it ended, :meth:`_send`)."""
        now = self._clock.now()
        self._expire(now)
        hold = hold_ms(self._settings.announce_timeout_ms)
        sent = self._retry(
            now,
            lambda: decide_drain(
                self._state,
                provider,
                busy=self._in_flight,
                now=now,
                hold_ms=hold,
                runtime=self._runtime,
            ),
        )
        log.info("deadletter.draining", provider=provider, entries=sent)
        self._arm()

    # -- fold, decide, append, then act ------------------------------------------------------

    def _tick(self, now: float) -> None:
        """Expire what is due at ``now``, start the retries that are due (none while a
        provider is degraded: they accumulate for the drain; none of an entry behind an
        earlier one of its conversation: it waits for that one), re-arm."""
        self._expire(now)
        settings = self._settings
        if self._held():
            log.info("deadletter.held", entries=len(self._state.entries))
            self._arm()
            return
        self._retry(
            now,
            lambda: decide_retries(
                self._state,
                now,
                max_retries=settings.max_retries,
                base_ms=settings.retry_base_ms,
                cap_ms=settings.retry_cap_ms,
                busy=self._in_flight,
                hold_ms=hold_ms(settings.announce_timeout_ms),
                runtime=self._runtime,
                ordered=True,
            ),
        )
        self._arm()

    def _retry(self, now: float, decide: Callable[[], list[AnnouncementDeadLetterRetried]]) -> int:
        """Append the retries ``decide`` gives, then start their sends: how many. The
        sends of one conversation go one after another, in the order the entries were
        queued, behind a send of it already in flight: sent together, the channel could
        deliver a later one first."""
        retries = self._decided(now, decide)
        if not retries:
            return 0
        last: dict[tuple[str, str], Future[str | None]] = {}
        for entry_id, sending in self._in_flight.items():
            queued = self._folder.entry(entry_id)
            if queued is not None:
                last[queued.route] = sending.future
        for retry in retries:
            entry = self._folder.entry(retry.entry_id)
            if entry is not None and retry.entry_id not in self._in_flight:
                last[entry.route] = self._send(retry.entry_id, after=last.get(entry.route))
        return len(retries)

    def _expire(self, now: float) -> None:
        expired = self._decided(
            now,
            lambda: decide_expiry(
                self._state,
                now,
                max_age_ms=self._settings.max_age_ms,
                max_retries=self._settings.max_retries,
            ),
        )
        if expired:
            log.warning("deadletter.expired", entries=len(expired))

    def _decided(self, now: float, decide: Callable[[], Sequence[E]]) -> Sequence[E]:
        """Append what ``decide`` gives on the current state (nothing when it gives none);
        on a conflict, fold what the other writer appended and decide again (it may have
        delivered or expired an entry). What was appended."""
        for attempt in range(APPEND_TRIES):
            decided = decide()
            if not decided:
                return decided
            try:
                self._append_once(decided, now)
            except ConcurrencyError:
                if attempt + 1 == APPEND_TRIES:
                    raise
                self._catch_up()
                continue
            return decided
        raise AssertionError("unreachable")  # the last try raises or returns

    def _append(self, events: Sequence[Event], now: float) -> None:
        """Append facts (an entry, a send's outcome) at ``now``. Another process's runtime
        on the same store writes the stream too: on a conflict, fold what it appended
        and append again (a fact holds whatever came before it)."""
        for attempt in range(APPEND_TRIES):
            try:
                self._append_once(events, now)
                return
            except ConcurrencyError:
                if attempt + 1 == APPEND_TRIES:
                    raise
                self._catch_up()

    def _append_once(self, events: Sequence[Event], now: float) -> None:
        """Append at ``now`` expecting the version folded so far, then fold the records."""
        records = self._store.append(
            self._stream,
            [NewEvent(event=event, ts=now) for event in events],
            expected_version=self._state.version,
        )
        for record in records:
            self._fold(record)
        self._state = self._folder.state()
        self._snapshots.keep(self._stream, self._state)

    def _catch_up(self) -> None:
        """Fold what other writers appended to the stream since this actor last looked,
        skipping a record that cannot be read (its entry, if it was one, is lost; the
        others are not)."""
        for record in read_readable(
            self._store, self._stream, self._state.version + 1, unreadable=self._skip
        ):
            self._fold(record)  # the state is frozen once: per record, n records cost n²
        self._state = self._folder.state()
        self._snapshots.keep(self._stream, self._state)

    def _fold(self, record: RecordedEvent) -> None:
        self._folder.add(record)
        self._snapshots.folded(record)

    def _skip(self, version: int, exc: CorruptRecordError) -> None:
        log.error(
            "deadletter.record_unreadable",
            stream=self._stream,
            version=version,
            position=exc.position,
        )
        self._snapshots.damaged()
        self._refold(msgspec.structs.replace(self._folder.state(), version=version))

    def _refold(self, state: DeadLetterState) -> None:
        """Go on folding from ``state``."""
        self._folder = DEADLETTER.folder(state)
        self._state = state

    def _held(self) -> bool:
        return self._any_degraded is not None and self._any_degraded()

    def _send(self, entry_id: str, after: Future[str | None] | None = None) -> Future[str | None]:
        """Start one send of the entry on the portal (once the send ``after`` ended, when
        given); its outcome's future."""
        entry = self._folder.entry(entry_id)
        if entry is None:
            raise KeyError(entry_id)
        message = OutboundMessage(
            conversation=entry.conversation,
            text=entry.text,
            thread=entry.thread,
            idempotency_key=entry.announcement_id,
            kind=message_kind(entry.kind),
        )
        timeout_s = self._settings.announce_timeout_ms / 1000
        channel = channel_named(self._channels, entry.channel)
        # the receiver's Retry-After with a failure is recorded with it: the next retry waits
        noted = None if channel is None else RetryAfterNoted(channel)
        send = partial(
            send_by_clock, self._portal, self._scheduler, self._clock, noted, message, timeout_s
        )
        future = send() if after is None else _after(after, send)
        self._in_flight[entry_id] = _InFlight(future, entry.announcement_id, entry.attempts + 1)
        future.add_done_callback(partial(self._settled, entry_id, noted))
        return future

    def _settled(
        self, entry_id: str, noted: RetryAfterNoted | None, future: Future[str | None]
    ) -> None:
        """Done-callback (the portal's thread): the outcome becomes a message."""
        with contextlib.suppress(pykka.ActorDeadError):  # stopped meanwhile
            self.actor_ref.tell(_outcome(entry_id, noted, future))

    def _arm(self) -> None:
        """One timer at the earliest retry (of entries not in flight, nor behind an
        earlier entry of their conversation) or expiry."""
        self._arm_at(self._deadline(self._state, ordered=True))

    def _arm_for(self, entry_id: str, folded: int) -> None:
        """Re-arm once ``entry_id`` was queued on the state at version ``folded``: when
        the timer was armed on that state and has not fired, only the new entry's own
        deadlines can be earlier (it is queued last, so it waits behind the others of its
        conversation, never they behind it). A pass over the whole queue for every entry
        queued made a backlog of n entries cost n squared to build (30,000: 50 ms an
        Enqueue, every sender waiting on it)."""
        entry = self._folder.entry(entry_id)
        armed = self._armed_at
        moved = self._armed_version != folded or self._state.version != folded + 1
        if entry is None or armed is None or moved:  # or another writer's records came
            self._arm()
            return
        if armed <= self._clock.now():  # fired: its RetryDue looks at the whole queue
            return
        behind = self._folder.first_in_route(entry.route) != entry_id
        alone = msgspec.structs.replace(self._state, entries=(entry,))
        own = self._deadline(alone, ordered=False, retries=not behind)
        if own is not None and own < armed:
            self._arm_at(own)
        self._armed_version = self._state.version

    def _deadline(
        self, state: DeadLetterState, *, ordered: bool, retries: bool = True
    ) -> float | None:
        """The earliest retry (``retries``) or expiry of ``state``'s entries."""
        settings = self._settings
        retry = None
        if retries:
            retry = next_retry_at(
                state,
                max_retries=settings.max_retries,
                base_ms=settings.retry_base_ms,
                cap_ms=settings.retry_cap_ms,
                hold_ms=hold_ms(settings.announce_timeout_ms),
                runtime=self._runtime,
                busy=self._in_flight,
                ordered=ordered,
            )
        if retry is not None and self._held():
            # no retry is spent while held; look again now and then in case a recovery's
            # drain never comes (a provider dropped from the config, say)
            retry = max(retry, self._clock.now() + settings.retry_base_ms / 1000)
        expiry = expiry_at(state, max_age_ms=settings.max_age_ms, max_retries=settings.max_retries)
        return min((at for at in (retry, expiry) if at is not None), default=None)

    def _arm_at(self, at: float | None) -> None:
        if at is None:
            self._scheduler.cancel(self._timer_key)
        else:
            self._scheduler.schedule(at, self._due, key=self._timer_key)
        self._armed_at = at
        self._armed_version = self._state.version

    def _stream_moved(self) -> None:
        """Follower callback (its thread), the store's head moved: wake the queue when its
        stream is past what it folded (another runtime appended to it; its own appends
        only move the head)."""
        if self._store.stream_version(self._stream) > self._state.version:
            self._wake()

    def _wake(self) -> None:
        """Follower callback (its thread): at most one :class:`_Moved` waits in the mailbox."""
        if self._moved_pending.is_set():
            return
        self._moved_pending.set()
        with contextlib.suppress(pykka.ActorDeadError):  # stopped meanwhile
            self.actor_ref.tell(_Moved())

    def _due(self, at: float) -> None:
        """Scheduler callback (its thread, or inside ``FakeClock.advance``)."""
        with contextlib.suppress(pykka.ActorDeadError):  # stopped meanwhile
            self.actor_ref.tell(RetryDue(at))
