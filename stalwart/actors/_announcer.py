"""Announcer: the parent of every run the runtime spawns, and its completion batcher.

Every run's :class:`RunEnded` comes here. The announcer forwards it to the supervisor
(which settles a failure: notice, recovery), hands it to the host's ``on_ended`` callback
(which resolves the run's handle), and queues a successful run that asked to be announced
in its parent's batch. A batch is sent as one message on the runs' channel, in the
parent's conversation, ``debounce_ms`` after its latest completion, and never later than
``max_wait_ms`` after its first (seed 000: a steady stream of completions cannot starve
delivery). Each run in a batch gets ``announcement:queued`` (kind ``completion``, the
batch's id) in its stream before the send and ``announcement:delivered`` or
``announcement:send_failed`` after it; a failed send goes to the dead-letter queue. The
batch's text is recorded once, in the first run's ``announcement:queued``; the others
name that run (``text_run``) instead: a hundred runs of 20 KB write 2 MB, not 200 MB.

A run whose completion is already queued in its stream when its batch goes (the
supervisor's sweep announced it as owed: this announcer was late, or another process's
sweep found it first) is left out: ``announcement:queued`` is appended expecting the
version read, as the supervisor appends its own, so one of the two announces it. A run
whose stream holds a record that cannot be read is left out too (logged once as
``announcer.stream_unreadable``; the supervisor leaves that stream alone as well): the
batch's other runs are announced on time.

A send's outcome the store refuses for a moment is told again a second later (logged as
``announcer.record_deferred``), never lost with a crash: a completion queued with no
outcome would be sent again by the supervisor's sweep. What was told to the announcer
when it crashed is not dropped with it: a run's end still reaches the supervisor and
``on_ended`` (the run's handle resolves), and a send's outcome is still recorded.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Mapping
from concurrent.futures import Future
from functools import partial
from typing import Any

import msgspec
import pykka

from stalwart._logs import get_logger
from stalwart.channels import Channel, OutboundMessage, RetryAfterNoted, channel_named
from stalwart.clock import Clock
from stalwart.errors import (
    AppendInDoubtError,
    ConcurrencyError,
    CorruptRecordError,
    StoreError,
)
from stalwart.events import AnnouncementDelivered, AnnouncementQueued, AnnouncementSendFailed
from stalwart.events import Event as LogEvent
from stalwart.ids import new_id
from stalwart.state import SUBSESSION_CHANNEL_PREFIX, batch_text
from stalwart.store import EventStore, NewEvent

from ._deadletter import Enqueue, dead_letter
from ._portal import IoPortal
from ._restarts import DECISION_RETRY_S, crashed
from ._scheduler import Scheduler
from ._send import noting, retry_after_of, send_by_clock
from ._subagent import RunEnded
from ._supervised import Supervised

__all__ = ["Announcer", "Batch", "GetBatches", "Track", "Untrack"]

log = get_logger(__name__)

#: How many append conflicts in a row one run's ``announcement:queued`` folds and retries.
MAX_CONFLICTS = 64


class Track(msgspec.Struct, frozen=True, kw_only=True):
    """Where a run's completion goes; told before the run starts."""

    run_id: str
    parent: str
    channel: str
    conversation: str
    thread: str | None = None
    announce: bool = True


class Untrack(msgspec.Struct, frozen=True):
    """Forget a run that ended without its end coming here: the supervisor ended it
    (swept as a ghost, given up on), so its actor will never tell :class:`RunEnded`."""

    run_id: str


class GetBatches(msgspec.Struct, frozen=True):
    """Ask for the batches not sent yet: ``{parent: Batch}``."""


#: Where a completion goes: (channel, conversation, thread).
Route = tuple[str, str, str | None]


class Batch(msgspec.Struct, frozen=True, kw_only=True):
    """The completions waiting for one parent, and when they go. ``channel``,
    ``conversation`` and ``thread`` are the first run's; ``routes`` holds each run's
    (aligned with ``runs``): runs that asked for other addresses are sent apart, one
    message per address, at the batch's time."""

    channel: str
    conversation: str
    runs: tuple[tuple[str, str], ...]  # (run id, result)
    thread: str | None = None
    first_at: float
    due_at: float
    routes: tuple[Route, ...] = ()

    def by_route(self) -> list[Batch]:
        """One batch per address, in the order of their first runs."""
        routes = self.routes or ((self.channel, self.conversation, self.thread),) * len(self.runs)
        grouped: dict[Route, list[tuple[str, str]]] = {}
        for route, run in zip(routes, self.runs, strict=True):
            grouped.setdefault(route, []).append(run)
        return [
            Batch(
                channel=channel,
                conversation=conversation,
                thread=thread,
                runs=tuple(runs),
                first_at=self.first_at,
                due_at=self.due_at,
                routes=((channel, conversation, thread),) * len(runs),
            )
            for (channel, conversation, thread), runs in grouped.items()
        ]


class _Due(msgspec.Struct, frozen=True):
    parent: str
    at: float


class _Sent(msgspec.Struct, frozen=True):
    batch: Batch
    announcement_id: str
    error_class: str | None
    #: the receiver's Retry-After (ms) with the failure, if it sent one
    retry_after_ms: int | None = None
    #: a recording the store refused, told again: the failure is in the dead-letter queue
    #: already, and the first ``recorded`` runs hold the outcome (``in_doubt``: the run
    #: after them may too, when the store could not say whether its append went through)
    dead_lettered: bool = False
    recorded: int = 0
    in_doubt: bool = False


class Announcer(Supervised):
    """The runs' parent ref: forwards :class:`RunEnded`, batches completions per parent.

    Start with ``Announcer.start(store=..., clock=..., scheduler=..., portal=...,
    channels={name: channel}, supervisor=<ref>, on_ended=callable, dead_letters=<ref>,
    debounce_ms=500, max_wait_ms=5_000, send_timeout_ms=30_000)``. Tell it :class:`Track`
    before a run starts, and :class:`Untrack` when a run ends without its end coming
    here; ask :class:`GetBatches`. ``on_crash(exception class name)`` is called once if
    the actor dies of an exception.
    """

    def __init__(
        self,
        *,
        store: EventStore,
        clock: Clock,
        scheduler: Scheduler,
        portal: IoPortal,
        channels: Mapping[str, Channel],
        supervisor: pykka.ActorRef[Any] | None = None,
        on_ended: Callable[[RunEnded], object] | None = None,
        dead_letters: pykka.ActorRef[Any] | None = None,
        debounce_ms: int = 500,
        max_wait_ms: int = 5_000,
        send_timeout_ms: int = 30_000,
        on_crash: Callable[[str], object] | None = None,
    ) -> None:
        super().__init__()
        self._on_crash = on_crash
        self._store = store
        self._clock = clock
        self._scheduler = scheduler
        self._portal = portal
        self._channels = dict(channels)
        self._supervisor = supervisor
        self._on_ended = on_ended
        self._dead_letters = dead_letters
        self._debounce = debounce_ms / 1000
        self._max_wait = max_wait_ms / 1000
        self._send_s = send_timeout_ms / 1000
        self._tracked: dict[str, Track] = {}
        self._batches: dict[str, Batch] = {}
        self._unreadable: set[str] = set()  # run streams with a record that cannot be read

    def on_stop(self) -> None:
        for parent in self._batches:
            self._scheduler.cancel(("announcer", self.actor_urn, parent))

    def on_failure(self, *exc_info: object) -> None:
        self.on_stop()
        self._hand_over(self.take_inbox())
        crashed(self._on_crash, exc_info)

    def _hand_over(self, told: list[Any]) -> None:
        """In ``on_failure``: what was told to this actor that it will never handle (pykka
        would drop it). A run's end still reaches the supervisor and ``on_ended`` (the
        run's handle resolves; a success's completion is announced by the supervisor's
        sweep once owed, like the batches lost with this actor), and a batch's send
        outcome is still recorded when the store takes it. A later tell finds the actor
        dead: the runtime holds it for the restarted one; a send's outcome told later (a
        send under way at the crash, a recording told again) is handed over here too, on
        the teller's thread (:func:`_recordable_alone`)."""
        for message in told:
            try:
                if isinstance(message, RunEnded):
                    self._tracked.pop(message.run_id, None)
                    self._forward(message)
                    self._report(message)
                elif isinstance(message, _Sent):
                    self._sent(message)
            except Exception as exc:  # the crash's cause may still be there (the store)
                log.warning(
                    "announcer.hand_over_failed",
                    message=type(message).__name__,
                    error=type(exc).__name__,
                )

    def on_receive(self, message: Any) -> Any:
        match message:
            case Track(run_id=run_id):
                self._tracked[run_id] = message
            case Untrack(run_id=run_id):
                self._tracked.pop(run_id, None)
            case RunEnded():
                self._ended(message)
            case _Due(parent=parent, at=at):
                self._due(parent, at)
            case _Sent():
                self._sent(message)
            case GetBatches():
                return dict(self._batches)
            case _:
                raise TypeError(f"Announcer does not understand {message!r}")
        return None

    def _ended(self, ended: RunEnded) -> None:
        track = self._tracked.pop(ended.run_id, None)
        self._forward(ended)
        if ended.outcome == "succeeded" and track is not None and track.announce:
            self._add(track, ended)
        self._report(ended)

    def _forward(self, ended: RunEnded) -> None:
        """The run's end to the supervisor (which settles a failure)."""
        if self._supervisor is not None:
            with contextlib.suppress(pykka.ActorDeadError):
                self._supervisor.tell(ended)

    def _report(self, ended: RunEnded) -> None:
        """The run's end to the host's ``on_ended`` (which resolves the run's handle)."""
        if self._on_ended is not None:
            try:
                self._on_ended(ended)
            except Exception:  # the host's callback: logged, never ours to raise
                log.exception("announcer.on_ended_failed", run=ended.run_id)

    def _add(self, track: Track, ended: RunEnded) -> None:
        now = self._clock.now()
        known = self._batches.get(track.parent)
        first = known.first_at if known is not None else now
        runs = (*(known.runs if known is not None else ()), (ended.run_id, ended.result))
        route = (track.channel, track.conversation, track.thread)
        routes = (*(known.routes if known is not None else ()), route)
        head = known if known is not None else track
        due = min(now + self._debounce, first + self._max_wait)
        self._batches[track.parent] = Batch(
            channel=head.channel,
            conversation=head.conversation,
            thread=head.thread,
            runs=runs,
            first_at=first,
            due_at=due,
            routes=routes,
        )
        key = ("announcer", self.actor_urn, track.parent)
        self._scheduler.schedule(due, partial(self._fire, track.parent), key=key)

    def _due(self, parent: str, at: float) -> None:
        batch = self._batches.get(parent)
        if batch is None or at < batch.due_at:
            return  # sent already, or re-armed later by a newer completion
        del self._batches[parent]
        for part in batch.by_route():
            self._send(parent, part)

    def _send(self, parent: str, batch: Batch) -> None:
        """Send one address's part of a parent's batch: its runs whose completion is not
        queued in their stream already (the supervisor announced it as owed)."""
        versions = self._versions(parent, batch)
        runs = tuple(run for run in batch.runs if run[0] in versions)
        if not runs:
            return
        route = (batch.channel, batch.conversation, batch.thread)
        batch = msgspec.structs.replace(batch, runs=runs, routes=(route,) * len(runs))
        announcement_id = new_id()
        text = batch_text(batch.runs)
        queued = AnnouncementQueued(
            announcement_id=announcement_id, channel=batch.channel, kind="completion", text=text
        )
        holder: str | None = None  # the run whose record holds the text
        for run_id, _ in batch.runs:
            event = queued if holder is None else _naming(queued, holder)
            if self._queue(run_id, event, versions[run_id]) and holder is None:
                holder = run_id
        message = OutboundMessage(
            conversation=batch.conversation,
            thread=batch.thread,
            text=text,
            idempotency_key=announcement_id,
            kind="reply",
        )
        # the receiver's Retry-After goes with a failure
        noted = noting(channel_named(self._channels, batch.channel))
        future = send_by_clock(
            self._portal, self._scheduler, self._clock, noted, message, self._send_s
        )
        log.info("announcer.batch_sent", parent=parent, runs=len(batch.runs))
        future.add_done_callback(partial(self._send_done, batch, announcement_id, noted))

    def _sent(self, sent: _Sent) -> None:
        batch = sent.batch
        event: LogEvent
        if sent.error_class is None:
            event = AnnouncementDelivered(announcement_id=sent.announcement_id, path="announce")
        else:
            event = AnnouncementSendFailed(
                announcement_id=sent.announcement_id,
                error_class=sent.error_class,
                retry_after_ms=sent.retry_after_ms,
            )
        if sent.error_class is not None and not sent.dead_lettered:
            enqueue = Enqueue(  # the queue's entry first, then the failure
                announcement_id=sent.announcement_id,
                channel=batch.channel,
                conversation=batch.conversation,
                text=batch_text(batch.runs),
                reason=sent.error_class,
                thread=batch.thread,
                retry_after_ms=sent.retry_after_ms,  # its first retry waits for it
            )
            dead_letter(self._dead_letters, enqueue)
            sent = msgspec.structs.replace(sent, dead_lettered=True)
        self._record(sent, event)

    def _versions(self, parent: str, batch: Batch) -> dict[str, int]:
        """The batch's runs to announce, each with its stream's version: not one whose
        completion is queued in its stream already (the supervisor announced it as owed),
        nor one whose stream cannot be read (reported once and left alone, as the
        supervisor leaves it: one damaged stream never holds up the others' news)."""
        versions: dict[str, int] = {}
        elsewhere = 0
        for run_id, _ in batch.runs:
            try:
                version = self._look(run_id, 1)
            except CorruptRecordError as exc:
                self._leave_alone(run_id, exc)
                continue
            if version is None:
                elsewhere += 1
            else:
                versions[run_id] = version
        if elsewhere:
            log.info("announcer.announced_elsewhere", parent=parent, runs=elsewhere)
        return versions

    def _leave_alone(self, run_id: str, exc: CorruptRecordError) -> None:
        """Report, once, a run whose stream holds a record that cannot be read."""
        stream = f"session:{run_id}"
        if stream not in self._unreadable:
            self._unreadable.add(stream)
            log.error("announcer.stream_unreadable", stream=stream, position=exc.position)

    def _look(self, run_id: str, from_version: int) -> int | None:
        """The version of the run's stream, read from ``from_version`` on; None when what
        was read queues a completion of the run (a model-driven run's private answer to
        its own Agent is none)."""
        version = from_version - 1
        for record in self._store.read_stream(f"session:{run_id}", from_version):
            version = record.version
            if _queues_completion(record.event):
                return None
        return version

    def _queue(self, run_id: str, queued: AnnouncementQueued, version: int) -> bool:
        """Append the batch's ``announcement:queued`` to the run's stream expecting
        ``version``; on a conflict read what was added: a completion queued there meanwhile
        leaves the run to its sender (the batch's text still names it). True when it was
        appended."""
        stream = f"session:{run_id}"
        for attempt in range(1, MAX_CONFLICTS + 1):
            event = NewEvent(event=queued, ts=self._clock.now())
            try:
                self._store.append(stream, [event], expected_version=version)
            except ConcurrencyError:
                if attempt == MAX_CONFLICTS:
                    raise  # the actor fails; the supervisor's sweep announces what is owed
                try:
                    seen = self._look(run_id, version + 1)
                except CorruptRecordError as exc:  # written meanwhile, and damaged
                    self._leave_alone(run_id, exc)
                    return False
                if seen is None:
                    log.info("announcer.announced_elsewhere", run=run_id)
                    return False
                version = seen
                continue
            return True
        raise AssertionError("unreachable")

    def _record(self, sent: _Sent, event: LogEvent) -> None:
        """Append the outcome to each run's stream (the run has ended: its actor writes no
        more). A store error tells the rest again in a second, not fails the actor: the
        outcome lost with it would have the supervisor's sweep send a delivered batch
        again."""
        now = self._clock.now()
        runs = sent.batch.runs
        for index in range(sent.recorded, len(runs)):
            stream = f"session:{runs[index][0]}"
            doubt = index == sent.recorded and sent.in_doubt
            try:
                if not (doubt and self._holds(stream, event)):
                    self._store.append(stream, [NewEvent(event=event, ts=now)])
            except StoreError as exc:
                log.warning(
                    "announcer.record_deferred", runs=len(runs) - index, error=type(exc).__name__
                )
                in_doubt = doubt or isinstance(exc, AppendInDoubtError)
                again = msgspec.structs.replace(sent, recorded=index, in_doubt=in_doubt)
                self._scheduler.schedule(now + DECISION_RETRY_S, partial(self._again, again))
                return

    def _holds(self, stream: str, event: LogEvent) -> bool:
        """Whether ``stream`` holds ``event`` already (an append in doubt went through); a
        stream that cannot be read is left alone."""
        try:
            return any(record.event == event for record in self._store.read_stream(stream))
        except CorruptRecordError as exc:
            self._leave_alone(stream.removeprefix("session:"), exc)
            return True

    # -- callbacks (the scheduler's and the portal's threads) --------------------------------

    def _fire(self, parent: str, at: float) -> None:
        self._tell(_Due(parent, at))

    def _again(self, message: object, _at: float) -> None:
        self._tell(message)

    def _send_done(
        self,
        batch: Batch,
        announcement_id: str,
        noted: RetryAfterNoted | None,
        future: Future[str | None],
    ) -> None:
        if future.cancelled():
            error: str | None = "cancelled"
        else:
            exc = future.exception()
            error = type(exc).__name__ if exc is not None else future.result()
        self._tell(_Sent(batch, announcement_id, error, retry_after_of(noted, error)))

    def _tell(self, message: object) -> None:
        try:
            self.actor_ref.tell(message)
        except pykka.ActorDeadError:
            if isinstance(message, _Sent) and _recordable_alone(message):
                self._hand_over([message])  # a send's outcome outlives the actor


def _recordable_alone(sent: _Sent) -> bool:
    """Whether the outcome of a send that ended after this announcer stopped is recorded
    on the callback's thread (a restarted announcer never hears of it): a delivered batch,
    whose outcome left unrecorded would have the supervisor's sweep send it again, or a
    failure in the dead-letter queue already. A failure not queued yet, or a send the
    portal's stop cancelled, is left to the sweep, which sends the batch again."""
    return sent.error_class is None or sent.dead_lettered


def _naming(queued: AnnouncementQueued, holder: str) -> AnnouncementQueued:
    """The batch's record for a run after the first: no text, the run that holds it."""
    return msgspec.structs.replace(queued, text="", text_run=holder)


def _queues_completion(event: LogEvent) -> bool:
    """Whether ``event`` queues a run's completion announcement (a model-driven run's
    private answer to its own Agent, on ``subagent:<run>``, is none)."""
    return (
        isinstance(event, AnnouncementQueued)
        and event.kind == "completion"
        and not event.channel.startswith(SUBSESSION_CHANNEL_PREFIX)
    )
