"""The dead-letter queue: a fold of the ``deadletter`` stream and its pure retry policy.

Seed 000: an announcement that could not be delivered is queued
(``announcement:dead_lettered``), retried up to ``max_retries`` (5) times, expired after
``max_age_ms`` (1 h), and drained at once, every entry, on ``provider:recovered``. Every
drop is an event (``announcement:dead_letter_expired`` with its ``reason``), none silent.

An entry whose last failure was final (its ``error_class`` ends in :data:`FINAL`: the
channel said sending it again cannot succeed, a webhook's 400, 401, 403, 404 ...) is
:attr:`~DeadLetterEntry.refused`: not retried nor drained, it expires at once, reason
``rejected``. Logs written before final failures were marked have none, and keep their
retries.

A retry is a decision recorded before its send (``announcement:dead_letter_retried``,
reason ``backoff`` or ``drain``); its outcome follows in the same stream:
``announcement:send_failed`` with the ``entry_id`` (one more attempt) or
``announcement:dead_letter_delivered`` (the entry goes). Backoff is exponential and
deterministic (no jitter), so replay agrees: retry ``n + 1`` is due
``min(retry_cap_ms, retry_base_ms x 2**n)`` after the last attempt (or the enqueue), and
no sooner than the receiver asked with that failure (its Retry-After, recorded as
``retry_after_ms``; a hint past the entry's max age lets it expire then); a drain leaves
such an entry, and its conversation's later ones, to that time. Logs written before
hints were recorded have none, and keep their schedule.

A recorded retry holds its entry until its outcome, or for ``hold_ms`` (the send's own
limit and :data:`SEND_GRACE_MS`: its sender died), against every runtime but the one
that recorded it (its queue knows its own sends; a decider given no ``runtime`` holds
nothing): a queue of another runtime on the same store then neither retries nor drains
it meanwhile, so the user gets one send per attempt. A drain's send that waits behind
the one before it in its conversation begins only when that one ends: its hold counts
from then (the outcome, or the expiry, of the one before it).

In order (``ordered=True``, what the queue's actor asks for): the entries of one
conversation (:attr:`DeadLetterEntry.route`) keep the order they were queued in. A
``backoff`` retry of an entry waits, whatever its backoff, while an earlier entry of its
conversation is still queued (:func:`waiting_behind`): a later message never overtakes
an earlier one that is still to be retried. Those retries are a subset of the unordered
ones, which is what a log written before ordering holds, so both replay. A drain decides
every entry as before but those queued after an entry another runtime's retry holds
(its send may be under way there: they wait for its outcome); the actor sends those of
one conversation one after another, each once the one before it delivered (its own
send in flight included): after one that failed, the rest are not sent
(``announcement:send_failed`` with ``error_class`` :data:`HELD_BACK`, which ends the
retry but is no attempt: the entry keeps its attempts and its backoff).
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Iterator
from typing import Any, Literal

import msgspec

from stalwart.errors import FINAL_FAILURE
from stalwart.events import (
    AnnouncementDeadLetterDelivered,
    AnnouncementDeadLettered,
    AnnouncementDeadLetterExpired,
    AnnouncementDeadLetterRetried,
    AnnouncementSendFailed,
    Event,
    RecordedEvent,
)


class DeadLetterEntry(msgspec.Struct, frozen=True, kw_only=True, gc=False):
    entry_id: str
    announcement_id: str
    channel: str
    text: str
    reason: str
    enqueued_at: float
    attempts: int = 0
    last_attempt_at: float | None = None
    last_error: str | None = None
    conversation: str = ""
    thread: str | None = None
    kind: str = "reply"
    #: since when the send of the retry under way may be running (None: no send under
    #: way): its record, or, sent behind the one before it in its conversation, when that
    #: one's send ended (:meth:`DeadLetterFolder.add`); and which runtime sends it
    sending_since: float | None = None
    sending_runtime: str | None = None
    #: the entry's last failure (its last send's, else the one that queued it) was final
    #: (:func:`is_final`): sent again, it cannot be delivered
    refused: bool = False
    #: the receiver's Retry-After (ms) with that last failure: the next retry waits at
    #: least that long after it (None: no hint)
    retry_after_ms: int | None = None

    @property
    def route(self) -> tuple[str, str]:
        """The conversation the entry is delivered to, within which entries keep their order."""
        return (self.channel, self.conversation)


class DeadLetterState(msgspec.Struct, frozen=True, kw_only=True, gc=False):
    """The queue in enqueue order, and what left it."""

    stream: str = "deadletter"
    version: int = 0
    entries: tuple[DeadLetterEntry, ...] = ()
    delivered: int = 0
    expired: int = 0


class DeadLetterFolder:
    """The dead-letter fold as a mutable accumulator: the entries by id (in enqueue
    order), so that each event costs one lookup, not a pass over the queue (a drain of a
    backlog folds one retry, then one outcome, per entry)."""

    __slots__ = (
        "_delivered",
        "_entries",
        "_expired",
        "_frozen",
        "_index",
        "_stream",
        "_version",
    )

    def __init__(self, state: DeadLetterState) -> None:
        self._stream = state.stream
        self._version = state.version
        self._entries = {e.entry_id: e for e in state.entries}
        self._delivered = state.delivered
        self._expired = state.expired
        self._frozen: DeadLetterState | None = state
        self._index: _Index | None = None  # made when first asked, then kept up

    def entry(self, entry_id: str) -> DeadLetterEntry | None:
        """The queued entry ``entry_id`` (None: not in the queue)."""
        return self._entries.get(entry_id)

    def queued_of(self, announcement_id: str) -> list[DeadLetterEntry]:
        """The queued entries of the announcement, in enqueue order (no pass over the
        queue: a sender queues one entry after another, and a backlog of n would cost
        n squared)."""
        ids = self._indexed().announcements.get(announcement_id, {})
        return [self._entries[entry_id] for entry_id in ids]

    def first_in_route(self, route: tuple[str, str]) -> str | None:
        """The id of the entry of ``route`` queued first (:func:`waiting_behind` says the
        others wait for it), or None when none of it is queued."""
        return next(iter(self._indexed().routes.get(route, {})), None)

    def _indexed(self) -> _Index:
        if self._index is None:
            self._index = _Index(self._entries.values())
        return self._index

    def add(self, record: RecordedEvent) -> None:
        self._frozen = None
        self._version = record.version
        event = record.event
        match event:
            case AnnouncementDeadLettered():
                self._queue(_queued(event, record.ts))
            case AnnouncementDeadLetterRetried():
                self._sending(event, record.ts)
            case AnnouncementSendFailed():
                self._failed(event, record.ts)
            case AnnouncementDeadLetterDelivered():
                if self._drop(event.entry_id, record.ts):
                    self._delivered += 1
            case AnnouncementDeadLetterExpired():
                if self._drop(event.entry_id, record.ts):
                    self._expired += 1
            case _:
                pass

    def _queue(self, entry: DeadLetterEntry) -> None:
        if entry.entry_id in self._entries:  # an id queued twice keeps its place
            self._index = None
        elif self._index is not None:
            self._index.put(entry)
        self._entries[entry.entry_id] = entry

    def _drop(self, entry_id: str, ts: float) -> bool:
        """Take the entry out of the queue at ``ts``; False when it was not in it."""
        entry = self._entries.get(entry_id)
        if entry is None:
            return False
        self._ended(entry, ts)
        del self._entries[entry_id]
        if self._index is not None:
            self._index.drop(entry)
        return True

    def _ended(self, entry: DeadLetterEntry, ts: float) -> None:
        """The entry's send ended (or it left the queue) at ``ts``: a retry of the next
        entry of its conversation that the same runtime recorded meanwhile was sent behind
        it (a drain's), so that entry's send began only now."""
        if entry.sending_since is None:
            return
        ids = iter(self._indexed().routes.get(entry.route, {}))
        for entry_id in ids:  # the entry is near the front of its conversation: in order
            if entry_id == entry.entry_id:
                break
        following = next(ids, None)
        behind = None if following is None else self._entries[following]
        if behind is None or behind.sending_since is None or behind.sending_since >= ts:
            return
        if behind.sending_runtime == entry.sending_runtime:
            self._entries[behind.entry_id] = msgspec.structs.replace(behind, sending_since=ts)

    def _sending(self, event: AnnouncementDeadLetterRetried, ts: float) -> None:
        """The entry's retry is under way since ``ts``."""
        entry = self._entries.get(event.entry_id)
        if entry is not None:
            self._entries[event.entry_id] = msgspec.structs.replace(
                entry, sending_since=ts, sending_runtime=event.runtime
            )

    def _failed(self, event: AnnouncementSendFailed, ts: float) -> None:
        """One more attempt on the entry named (by ``entry_id``, else the announcement's);
        a retry :data:`HELD_BACK` only ends (no send was made)."""
        entry = self._named(event)
        if entry is not None and event.error_class == HELD_BACK:  # the next is held back too
            self._entries[entry.entry_id] = msgspec.structs.replace(
                entry, sending_since=None, sending_runtime=None
            )
        elif entry is not None:
            self._ended(entry, ts)
            self._entries[entry.entry_id] = msgspec.structs.replace(
                entry,
                attempts=entry.attempts + 1,
                last_attempt_at=ts,
                last_error=event.error_class,
                sending_since=None,
                sending_runtime=None,
                refused=is_final(event.error_class),
                retry_after_ms=event.retry_after_ms,
            )

    def _named(self, event: AnnouncementSendFailed) -> DeadLetterEntry | None:
        if event.entry_id is not None:
            return self._entries.get(event.entry_id)
        # a record of before entry ids: the first entry of the announcement
        found = (e for e in self._entries.values() if e.announcement_id == event.announcement_id)
        return next(found, None)

    def state(self) -> DeadLetterState:
        if self._frozen is None:
            self._frozen = DeadLetterState(
                stream=self._stream,
                version=self._version,
                entries=tuple(self._entries.values()),
                delivered=self._delivered,
                expired=self._expired,
            )
        return self._frozen


class _Index:
    """The queued entries' ids by conversation and by announcement, in enqueue order."""

    __slots__ = ("announcements", "routes")

    def __init__(self, entries: Iterable[DeadLetterEntry]) -> None:
        self.routes: dict[tuple[str, str], dict[str, None]] = {}
        self.announcements: dict[str, dict[str, None]] = {}
        for entry in entries:
            self.put(entry)

    def put(self, entry: DeadLetterEntry) -> None:
        self.routes.setdefault(entry.route, {})[entry.entry_id] = None
        self.announcements.setdefault(entry.announcement_id, {})[entry.entry_id] = None

    def drop(self, entry: DeadLetterEntry) -> None:
        _forget(self.routes, entry.route, entry.entry_id)
        _forget(self.announcements, entry.announcement_id, entry.entry_id)


def _forget(table: dict[Any, dict[str, None]], key: object, entry_id: str) -> None:
    ids = table[key]
    del ids[entry_id]
    if not ids:
        del table[key]


def _queued(event: AnnouncementDeadLettered, ts: float) -> DeadLetterEntry:
    return DeadLetterEntry(
        entry_id=event.entry_id,
        announcement_id=event.announcement_id,
        channel=event.channel,
        text=event.text,
        reason=event.reason,
        enqueued_at=ts,
        conversation=event.conversation,
        thread=event.thread,
        kind=event.kind,
        refused=is_final(event.reason),
        retry_after_ms=event.retry_after_ms,
    )


def apply_deadletter(state: DeadLetterState, record: RecordedEvent) -> DeadLetterState:
    """The queue after one more event of the ``deadletter`` stream (pure; a folder is
    faster for many)."""
    folder = DeadLetterFolder(state)
    folder.add(record)
    return folder.state()


#: The ``error_class`` of a drain's send not made: the send before it in its
#: conversation did not deliver (sent anyway, it would be read before that one).
HELD_BACK = "held_back"

#: The end of the ``error_class`` of a failure the channel says is final
#: (``stalwart.errors.FINAL_FAILURE``; ``stalwart.channels.send_within`` writes it).
FINAL = FINAL_FAILURE


def is_final(error_class: str | None) -> bool:
    """Whether a send that failed with ``error_class`` would fail the same way again."""
    return error_class is not None and error_class.endswith(FINAL)


#: how long past a send's own limit (``announce_timeout_ms``) a recorded retry with no
#: outcome still holds its entry; after that its sender is taken as dead
SEND_GRACE_MS = 5_000


def hold_ms(announce_timeout_ms: int) -> int:
    """How long a recorded retry holds its entry (see the module docstring)."""
    return announce_timeout_ms + SEND_GRACE_MS


def retry_at(
    entry: DeadLetterEntry,
    *,
    base_ms: int,
    cap_ms: int,
    hold_ms: int = 0,
    runtime: str | None = None,
) -> float:
    """When the entry's next retry is due: ``min(cap, base x 2**attempts)`` after the last,
    or the receiver's Retry-After with that failure when it is longer, and not while a
    retry another runtime recorded less than ``hold_ms`` before may be under way."""
    since = entry.enqueued_at if entry.last_attempt_at is None else entry.last_attempt_at
    wait_ms = min(cap_ms, base_ms << min(entry.attempts, 62))
    if entry.retry_after_ms is not None:
        wait_ms = max(wait_ms, entry.retry_after_ms)
    due = since + wait_ms / 1000
    held = _held_until(entry, hold_ms, runtime)
    return due if held is None else max(due, held)


def _held_until(entry: DeadLetterEntry, hold_ms: int, runtime: str | None) -> float | None:
    """Until when a recorded retry holds the entry against ``runtime`` (None: it does not:
    no retry under way, no hold asked for, ``runtime``'s own, which it knows of, or no
    ``runtime`` named, a queue that takes itself for the stream's only writer)."""
    if runtime is None or not hold_ms or entry.sending_since is None:
        return None
    if entry.sending_runtime == runtime:
        return None
    return entry.sending_since + hold_ms / 1000


def _retryable(state: DeadLetterState, max_retries: int) -> Iterator[DeadLetterEntry]:
    return (e for e in state.entries if e.attempts < max_retries and not e.refused)


def waiting_behind(state: DeadLetterState) -> frozenset[str]:
    """The ids of the entries queued after another entry of their conversation that is still
    in the queue: in order, they wait for it to be delivered or expired."""
    seen: set[tuple[str, str]] = set()
    behind: set[str] = set()
    for entry in state.entries:
        route = (entry.channel, entry.conversation)  # entry.route, without the call
        if route in seen:
            behind.add(entry.entry_id)
        else:
            seen.add(route)
    return frozenset(behind)


def _first_of_their_conversations(
    state: DeadLetterState, entries: list[DeadLetterEntry], ordered: bool
) -> list[DeadLetterEntry]:
    """``entries`` but, ``ordered``, those waiting behind an earlier entry (worked out only
    when there are some to look at: a drain in flight leaves none)."""
    if not ordered or not entries:
        return entries
    behind = waiting_behind(state)
    return [e for e in entries if e.entry_id not in behind]


def decide_retries(
    state: DeadLetterState,
    now: float,
    *,
    max_retries: int,
    base_ms: int,
    cap_ms: int,
    busy: Collection[str] = (),
    hold_ms: int = 0,
    runtime: str | None = None,
    ordered: bool = False,
) -> list[AnnouncementDeadLetterRetried]:
    """A ``backoff`` retry by ``runtime`` of each entry (not ``busy``: its send is in
    flight here, nor held by another runtime's retry under way; ``ordered``: nor waiting
    behind an earlier entry of its conversation) whose retry is due at ``now``, in
    enqueue order."""
    due = [
        e
        for e in _retryable(state, max_retries)
        if e.entry_id not in busy
        and now >= retry_at(e, base_ms=base_ms, cap_ms=cap_ms, hold_ms=hold_ms, runtime=runtime)
    ]
    return [
        AnnouncementDeadLetterRetried(entry_id=e.entry_id, attempt=e.attempts + 1, runtime=runtime)
        for e in _first_of_their_conversations(state, due, ordered)
    ]


def next_retry_at(
    state: DeadLetterState,
    *,
    max_retries: int,
    base_ms: int,
    cap_ms: int,
    hold_ms: int = 0,
    runtime: str | None = None,
    busy: Collection[str] = (),
    ordered: bool = False,
) -> float | None:
    """The earliest moment a retry by ``runtime`` falls due (of the entries not ``busy``
    nor, ``ordered``, waiting behind another), or None when none is left."""
    waiting = [e for e in _retryable(state, max_retries) if e.entry_id not in busy]
    return min(
        (
            retry_at(e, base_ms=base_ms, cap_ms=cap_ms, hold_ms=hold_ms, runtime=runtime)
            for e in _first_of_their_conversations(state, waiting, ordered)
        ),
        default=None,
    )


def expiry_at(state: DeadLetterState, *, max_age_ms: int, max_retries: int) -> float | None:
    """The earliest moment an entry is to expire: when it reaches ``max_age_ms``, at its
    last attempt once that spent ``max_retries`` or failed for good, or at once when the
    failure that queued it was final; None for an empty queue."""
    return min((_expires_at(e, max_age_ms, max_retries) for e in state.entries), default=None)


def _expires_at(entry: DeadLetterEntry, max_age_ms: int, max_retries: int) -> float:
    if entry.refused:
        return entry.enqueued_at if entry.last_attempt_at is None else entry.last_attempt_at
    if entry.attempts >= max_retries and entry.last_attempt_at is not None:
        return entry.last_attempt_at
    return entry.enqueued_at + max_age_ms / 1000


def decide_expiry(
    state: DeadLetterState, now: float, *, max_age_ms: int, max_retries: int
) -> list[Event]:
    """``announcement:dead_letter_expired`` for each entry past ``max_age_ms`` (reason
    ``max_age``), whose last failure was final (``rejected``) or with ``max_retries``
    attempts spent (``retries_exhausted``)."""
    expired: list[Event] = []
    for entry in state.entries:
        age_ms = round((now - entry.enqueued_at) * 1000)
        reason: Literal["max_age", "rejected", "retries_exhausted"]
        if now >= entry.enqueued_at + max_age_ms / 1000:
            reason = "max_age"
        elif entry.refused:
            reason = "rejected"
        elif entry.attempts >= max_retries:
            reason = "retries_exhausted"
        else:
            continue
        expired.append(
            AnnouncementDeadLetterExpired(
                entry_id=entry.entry_id,
                age_ms=age_ms,
                max_age_ms=max_age_ms,
                attempts=entry.attempts,
                reason=reason,
                max_retries=max_retries,
            )
        )
    return expired


def decide_drain(
    state: DeadLetterState,
    provider: str,
    *,
    busy: Collection[str] = (),
    now: float = 0.0,
    hold_ms: int = 0,
    runtime: str | None = None,
) -> list[AnnouncementDeadLetterRetried]:
    """What ``provider:recovered`` sends at once: a ``drain`` retry by ``runtime`` of
    every entry not ``busy`` nor :attr:`~DeadLetterEntry.refused` (it expires), in enqueue
    order, whatever its backoff (the queue's actor sends those of one conversation one
    after another, behind a send of it ``busy`` there); but not an entry held at ``now``
    by another runtime's retry under way, nor one whose receiver asked to wait past
    ``now`` (:func:`_asked_to_wait`), nor those queued after either in its conversation
    (sent now, they would be read before it: they wait for its outcome, then their own
    retry). ``busy`` is not in the log: replay gives none, and re-derives a superset."""
    waiting: set[tuple[str, str]] = set()
    drained: list[AnnouncementDeadLetterRetried] = []
    for e in state.entries:
        if e.entry_id in busy or e.refused:
            continue
        route = (e.channel, e.conversation)  # e.route, without the call
        if route in waiting or _held_at(e, now, hold_ms, runtime) or _asked_to_wait(e, now):
            waiting.add(route)
            continue
        drained.append(
            AnnouncementDeadLetterRetried(
                entry_id=e.entry_id,
                attempt=e.attempts + 1,
                reason="drain",
                provider=provider,
                runtime=runtime,
            )
        )
    return drained


def _held_at(entry: DeadLetterEntry, now: float, hold_ms: int, runtime: str | None) -> bool:
    """Whether another runtime's retry of the entry may still be under way at ``now``."""
    held = _held_until(entry, hold_ms, runtime)
    return held is not None and now < held


def held_ahead(
    state: DeadLetterState,
    entry: DeadLetterEntry,
    now: float,
    *,
    hold_ms: int,
    runtime: str | None,
) -> DeadLetterEntry | None:
    """The entry queued before ``entry`` in its conversation that another runtime's retry
    holds at ``now`` (what keeps a drain from sending ``entry``), or None."""
    for earlier in state.entries:
        if earlier.entry_id == entry.entry_id:
            return None
        if earlier.route == entry.route and _held_at(earlier, now, hold_ms, runtime):
            return earlier
    return None


def _asked_to_wait(entry: DeadLetterEntry, now: float) -> bool:
    """Whether the receiver's Retry-After with the entry's last failure runs past ``now``
    (never for an entry with no hint: every log written before hints were recorded)."""
    if entry.retry_after_ms is None:
        return False
    since = entry.enqueued_at if entry.last_attempt_at is None else entry.last_attempt_at
    return now < since + entry.retry_after_ms / 1000


class DeadLetterAggregate:
    """The dead-letter fold for the ``deadletter`` stream."""

    name = "deadletter"
    # 2: an entry's retry under way (sending_since); 3: refused; 4: retry_after_ms;
    # 5: sending_since of an entry sent behind another moves to when that one's send ended
    version = 5
    state_type = DeadLetterState

    def initial(self, stream: str) -> DeadLetterState:
        return DeadLetterState(stream=stream)

    def apply(self, state: DeadLetterState, record: RecordedEvent) -> DeadLetterState:
        return apply_deadletter(state, record)

    def folder(self, state: DeadLetterState) -> DeadLetterFolder:
        return DeadLetterFolder(state)


DEADLETTER = DeadLetterAggregate()
