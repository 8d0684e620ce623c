"""The dead-letter queue: a fold of the ``deadletter`` stream and its pure retry policy.

Seed 000: an announcement that could not be delivered is queued
(``announcement:dead_lettered``), retried up to ``max_retries`` (5) times, expired after
``max_age_ms`` (1 h), and drained at once, every entry, on ``provider:recovered``. Every
drop is an event (``announcement:dead_letter_expired`` with its ``reason``), none silent.

A retry is a decision recorded before its send (``announcement:dead_letter_retried``,
reason ``backoff`` or ``drain``); its outcome follows in the same stream:
``announcement:send_failed`` with the ``entry_id`` (one more attempt) or
``announcement:dead_letter_delivered`` (the entry goes). Backoff is exponential and
deterministic (no jitter), so replay agrees: retry ``n + 1`` is due
``min(retry_cap_ms, retry_base_ms x 2**n)`` after the last attempt (or the enqueue).

A recorded retry holds its entry until its outcome, or for ``hold_ms`` (the send's own
limit and :data:`SEND_GRACE_MS`: its sender died), against every runtime but the one
that recorded it (its queue knows its own sends; a decider given no ``runtime`` holds
nothing): a queue of another runtime on the same store then neither retries nor drains
it meanwhile, so the user gets one send per attempt.
"""

from __future__ import annotations

from collections.abc import Collection, Iterator
from typing import Literal

import msgspec

from stalwart.events import (
    AnnouncementDeadLetterDelivered,
    AnnouncementDeadLettered,
    AnnouncementDeadLetterExpired,
    AnnouncementDeadLetterRetried,
    AnnouncementSendFailed,
    Event,
    RecordedEvent,
)

from ._aggregate import ApplyFolder


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
    #: when the retry under way was recorded (None: no send under way), and by which runtime
    sending_since: float | None = None
    sending_runtime: str | None = None


class DeadLetterState(msgspec.Struct, frozen=True, kw_only=True, gc=False):
    """The queue in enqueue order, and what left it."""

    stream: str = "deadletter"
    version: int = 0
    entries: tuple[DeadLetterEntry, ...] = ()
    delivered: int = 0
    expired: int = 0


def _failed(state: DeadLetterState, event: AnnouncementSendFailed, ts: float) -> DeadLetterState:
    """One more attempt on the entry named (by ``entry_id``, else the announcement's)."""
    for index, entry in enumerate(state.entries):
        if (event.entry_id is not None and entry.entry_id == event.entry_id) or (
            event.entry_id is None and entry.announcement_id == event.announcement_id
        ):
            tried = msgspec.structs.replace(
                entry,
                attempts=entry.attempts + 1,
                last_attempt_at=ts,
                last_error=event.error_class,
                sending_since=None,
                sending_runtime=None,
            )
            entries = (*state.entries[:index], tried, *state.entries[index + 1 :])
            return msgspec.structs.replace(state, entries=entries)
    return state


def _sending(
    state: DeadLetterState, event: AnnouncementDeadLetterRetried, ts: float
) -> DeadLetterState:
    """The entry's retry is under way since ``ts``."""
    for index, entry in enumerate(state.entries):
        if entry.entry_id == event.entry_id:
            sending = msgspec.structs.replace(
                entry, sending_since=ts, sending_runtime=event.runtime
            )
            entries = (*state.entries[:index], sending, *state.entries[index + 1 :])
            return msgspec.structs.replace(state, entries=entries)
    return state


def _without(state: DeadLetterState, entry_id: str) -> tuple[DeadLetterEntry, ...] | None:
    kept = tuple(e for e in state.entries if e.entry_id != entry_id)
    return None if len(kept) == len(state.entries) else kept


def apply_deadletter(state: DeadLetterState, record: RecordedEvent) -> DeadLetterState:
    """The queue after one more event of the ``deadletter`` stream."""
    state = msgspec.structs.replace(state, version=record.version)
    event = record.event
    replace = msgspec.structs.replace
    match event:
        case AnnouncementDeadLettered():
            entry = DeadLetterEntry(
                entry_id=event.entry_id,
                announcement_id=event.announcement_id,
                channel=event.channel,
                text=event.text,
                reason=event.reason,
                enqueued_at=record.ts,
                conversation=event.conversation,
                thread=event.thread,
                kind=event.kind,
            )
            return replace(state, entries=(*state.entries, entry))
        case AnnouncementDeadLetterRetried():
            return _sending(state, event, record.ts)
        case AnnouncementSendFailed():
            return _failed(state, event, record.ts)
        case AnnouncementDeadLetterDelivered():
            kept = _without(state, event.entry_id)
            if kept is None:
                return state
            return replace(state, entries=kept, delivered=state.delivered + 1)
        case AnnouncementDeadLetterExpired():
            kept = _without(state, event.entry_id)
            if kept is None:
                return state
            return replace(state, entries=kept, expired=state.expired + 1)
        case _:
            return state


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
    and not while a retry another runtime recorded less than ``hold_ms`` before may be
    under way."""
    since = entry.enqueued_at if entry.last_attempt_at is None else entry.last_attempt_at
    due = since + min(cap_ms, base_ms << min(entry.attempts, 62)) / 1000
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
    return (e for e in state.entries if e.attempts < max_retries)


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
) -> list[AnnouncementDeadLetterRetried]:
    """A ``backoff`` retry by ``runtime`` of each entry (not ``busy``: its send is in
    flight here, nor held by another runtime's retry under way) whose retry is due at
    ``now``, in enqueue order."""
    return [
        AnnouncementDeadLetterRetried(entry_id=e.entry_id, attempt=e.attempts + 1, runtime=runtime)
        for e in _retryable(state, max_retries)
        if e.entry_id not in busy
        and now >= retry_at(e, base_ms=base_ms, cap_ms=cap_ms, hold_ms=hold_ms, runtime=runtime)
    ]


def next_retry_at(
    state: DeadLetterState,
    *,
    max_retries: int,
    base_ms: int,
    cap_ms: int,
    hold_ms: int = 0,
    runtime: str | None = None,
) -> float | None:
    """The earliest moment a retry by ``runtime`` falls due, or None when none is left."""
    return min(
        (
            retry_at(e, base_ms=base_ms, cap_ms=cap_ms, hold_ms=hold_ms, runtime=runtime)
            for e in _retryable(state, max_retries)
        ),
        default=None,
    )


def expiry_at(state: DeadLetterState, *, max_age_ms: int, max_retries: int) -> float | None:
    """The earliest moment an entry is to expire: when it reaches ``max_age_ms``, or at its
    last attempt once that spent ``max_retries``; None for an empty queue."""
    return min(
        (
            e.last_attempt_at
            if e.attempts >= max_retries and e.last_attempt_at is not None
            else e.enqueued_at + max_age_ms / 1000
            for e in state.entries
        ),
        default=None,
    )


def decide_expiry(
    state: DeadLetterState, now: float, *, max_age_ms: int, max_retries: int
) -> list[Event]:
    """``announcement:dead_letter_expired`` for each entry past ``max_age_ms`` (reason
    ``max_age``) or with ``max_retries`` attempts spent (``retries_exhausted``)."""
    expired: list[Event] = []
    for entry in state.entries:
        age_ms = round((now - entry.enqueued_at) * 1000)
        reason: Literal["max_age", "retries_exhausted"]
        if now >= entry.enqueued_at + max_age_ms / 1000:
            reason = "max_age"
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
    every entry not ``busy`` nor held at ``now`` by another runtime's retry under way, in
    enqueue order, whatever its backoff."""
    return [
        AnnouncementDeadLetterRetried(
            entry_id=e.entry_id,
            attempt=e.attempts + 1,
            reason="drain",
            provider=provider,
            runtime=runtime,
        )
        for e in state.entries
        if e.entry_id not in busy and now >= (_held_until(e, hold_ms, runtime) or now)
    ]


class DeadLetterAggregate:
    """The dead-letter fold for the ``deadletter`` stream."""

    name = "deadletter"
    version = 2  # 2: an entry's retry under way (sending_since)
    state_type = DeadLetterState

    def initial(self, stream: str) -> DeadLetterState:
        return DeadLetterState(stream=stream)

    def apply(self, state: DeadLetterState, record: RecordedEvent) -> DeadLetterState:
        return apply_deadletter(state, record)

    def folder(self, state: DeadLetterState) -> ApplyFolder[DeadLetterState]:
        return ApplyFolder(apply_deadletter, state)


DEADLETTER = DeadLetterAggregate()
