"""Activations: the fold of a session's work queue and leases.

A session's activations live in its stream. :func:`apply_activations` folds them into
:class:`ActivationsState`: the unsettled activations in order, the live lease, the lease
epoch, what the session is blocked on, the last outcome and a short claim history. The
pure policies that decide on it are in :mod:`._activation_policy`.
"""

from __future__ import annotations

import msgspec

from stalwart.events import (
    ActivationAbandoned,
    ActivationAcked,
    ActivationBlocked,
    ActivationCancelled,
    ActivationLeased,
    ActivationLeaseLost,
    ActivationReady,
    ActivationReleased,
    ActivationRequeued,
    Event,
    LeaseExpired,
    LeaseRenewed,
    RecordedEvent,
    SessionRequiresAction,
    UserCustomToolResult,
    UserInterrupt,
    UserToolConfirmation,
)

from ._aggregate import ApplyFolder

__all__ = [
    "ACTIVATIONS",
    "MESSAGES_KEPT",
    "Activation",
    "ActivationOutcome",
    "ActivationsAggregate",
    "ActivationsState",
    "Claim",
    "Lease",
    "SeenMessage",
    "apply_activations",
    "remember_message",
]

HISTORY_KEPT = 20
#: how many of a session's newest user message ids are remembered (``RECENT_MESSAGES``):
#: a message sent again with one of them (a redelivered webhook) is not run again
MESSAGES_KEPT = 256


class Activation(msgspec.Struct, frozen=True, kw_only=True, gc=False):
    """An unsettled activation. ``streak`` counts its failures so far (requeues and
    expired leases); ``run_at`` is when it may run (its ``wake_at``, or a retry's time)."""

    activation_id: str
    kind: str
    ready_at: float
    run_at: float
    version: int
    message_id: str | None = None
    text: str = ""
    dedupe_key: str | None = None
    streak: int = 0
    last_error: str | None = None


class SeenMessage(msgspec.Struct, frozen=True, kw_only=True, gc=False):
    """A user message the session was given: its id and the activation that carries it."""

    message_id: str
    activation_id: str


def remember_message(recent: tuple[SeenMessage, ...], event: Event) -> tuple[SeenMessage, ...]:
    """The session's newest ``MESSAGES_KEPT`` user messages (oldest first) after one more
    event of its stream: an ``activation:ready`` of a message adds its id. Folded only
    where a message is recorded (``send_message``, the Agent), not into the activations
    every worker keeps for every session."""
    if isinstance(event, ActivationReady) and event.kind == "message" and event.message_id:
        seen = SeenMessage(message_id=event.message_id, activation_id=event.activation_id)
        return (*recent, seen)[-MESSAGES_KEPT:]
    return recent


class RecentMessages(msgspec.Struct, frozen=True, kw_only=True):
    """A session's newest user messages (:func:`remember_message`) at ``version``."""

    stream: str
    version: int = 0
    messages: tuple[SeenMessage, ...] = ()


def apply_recent_messages(state: RecentMessages, record: RecordedEvent) -> RecentMessages:
    return msgspec.structs.replace(
        state, version=record.version, messages=remember_message(state.messages, record.event)
    )


class RecentMessagesAggregate:
    """The recent-messages fold as an :class:`~stalwart.state.Aggregate` (snapshotted, so
    recording a message with an id does not read the whole session)."""

    name = "recent_messages"
    version = 1
    state_type = RecentMessages

    def initial(self, stream: str) -> RecentMessages:
        return RecentMessages(stream=stream)

    def apply(self, state: RecentMessages, record: RecordedEvent) -> RecentMessages:
        return apply_recent_messages(state, record)

    def folder(self, state: RecentMessages) -> ApplyFolder[RecentMessages]:
        return ApplyFolder(apply_recent_messages, state)


RECENT_MESSAGES = RecentMessagesAggregate()


class Lease(msgspec.Struct, frozen=True, kw_only=True, gc=False):
    activation_id: str
    owner: str
    epoch: int
    expires_at: float
    leased_at: float
    covers: tuple[str, ...] = ()


class ActivationOutcome(msgspec.Struct, frozen=True, kw_only=True, gc=False):
    activation_id: str
    status: str
    at: float
    error_class: str | None = None


class Claim(msgspec.Struct, frozen=True, kw_only=True, gc=False):
    """One entry of the claim history: who leased what, at which epoch, how it ended."""

    activation_id: str
    owner: str
    epoch: int
    at: float
    ended: str | None = None


class ActivationsState(msgspec.Struct, frozen=True, kw_only=True):
    stream: str
    version: int = 0
    epoch: int = 0
    queue: tuple[Activation, ...] = ()
    lease: Lease | None = None
    blocked_on: str | None = None
    last_outcome: ActivationOutcome | None = None
    history: tuple[Claim, ...] = ()
    acked: int = 0
    requeued: int = 0
    abandoned: int = 0
    expired: int = 0

    def find(self, activation_id: str) -> Activation | None:
        for activation in self.queue:
            if activation.activation_id == activation_id:
                return activation
        return None

    @property
    def backlog(self) -> int:
        return len(self.queue)


# -- the fold -------------------------------------------------------------------------------


def _settle(
    state: ActivationsState,
    activation_id: str,
    status: str,
    at: float,
    error_class: str | None = None,
    *,
    counter: str | None = None,
) -> ActivationsState:
    """Remove ``activation_id`` (and the messages its lease covers) from the queue."""
    lease = state.lease
    ids = {activation_id}
    history = state.history
    if lease is not None and lease.activation_id == activation_id:
        ids.update(lease.covers)
        if history:
            history = (*history[:-1], msgspec.structs.replace(history[-1], ended=status))
        lease = None
    outcome = ActivationOutcome(
        activation_id=activation_id, status=status, at=at, error_class=error_class
    )
    changes: dict[str, object] = {
        "queue": tuple(a for a in state.queue if a.activation_id not in ids),
        "lease": lease,
        "history": history,
        "last_outcome": outcome,
    }
    if counter is not None:
        changes[counter] = getattr(state, counter) + 1
    return msgspec.structs.replace(state, **changes)


#: The events that change the activations beyond their ``version`` (every other event
#: only moves it): what replay verification folds, since no decision reads the version.
ACTIVATION_EVENTS: frozenset[type] = frozenset(
    {
        *(ActivationReady, ActivationLeased, LeaseRenewed, LeaseExpired, ActivationAcked),
        *(ActivationBlocked, ActivationRequeued, ActivationAbandoned, ActivationCancelled),
        ActivationReleased,
        *(SessionRequiresAction, UserToolConfirmation, UserCustomToolResult, UserInterrupt),
    }
)


def apply_activations(state: ActivationsState, record: RecordedEvent) -> ActivationsState:
    """The activations after ``record`` (other events only move the version)."""
    event = record.event
    state = msgspec.structs.replace(state, version=record.version)
    match event:
        case ActivationReady():
            run_at = event.wake_at if event.wake_at is not None else record.ts
            activation = Activation(
                activation_id=event.activation_id,
                kind=event.kind,
                ready_at=record.ts,
                run_at=run_at,
                version=record.version,
                message_id=event.message_id,
                text=event.text,
                dedupe_key=event.dedupe_key,
            )
            return msgspec.structs.replace(state, queue=(*state.queue, activation))
        case ActivationLeased():
            lease = Lease(
                activation_id=event.activation_id,
                owner=event.owner,
                epoch=event.epoch,
                expires_at=event.expires_at,
                leased_at=record.ts,
                covers=event.covers,
            )
            claim = Claim(
                activation_id=event.activation_id,
                owner=event.owner,
                epoch=event.epoch,
                at=record.ts,
            )
            history = (*state.history, claim)[-HISTORY_KEPT:]
            epoch = max(state.epoch, event.epoch)
            return msgspec.structs.replace(state, lease=lease, epoch=epoch, history=history)
        case LeaseRenewed():
            held = state.lease
            if held is None or held.epoch != event.epoch:
                return state
            renewed = msgspec.structs.replace(held, expires_at=event.expires_at)
            return msgspec.structs.replace(state, lease=renewed)
        case ActivationAcked():
            return _settle(state, event.activation_id, "acked", record.ts, counter="acked")
        case ActivationBlocked():
            settled = _settle(state, event.activation_id, "blocked", record.ts)
            return msgspec.structs.replace(settled, blocked_on=event.request_id)
        case ActivationRequeued():
            return _requeued(state, event, record.ts)
        case ActivationAbandoned():
            error = event.error_class
            settled = _settle(
                state, event.activation_id, "abandoned", record.ts, error, counter="abandoned"
            )
            return msgspec.structs.replace(settled, epoch=max(settled.epoch, event.epoch))
        case ActivationCancelled():
            return _settle(state, event.activation_id, "cancelled", record.ts)
        case LeaseExpired():
            return expired_lease(state, event)
        case ActivationReleased():
            return _released(state, event)
        case ActivationLeaseLost():
            return state  # an observation of the old holder; the takeover already moved on
        case SessionRequiresAction():
            return msgspec.structs.replace(state, blocked_on=event.request_id)
        case UserToolConfirmation() | UserCustomToolResult():
            if state.blocked_on == event.request_id:
                return msgspec.structs.replace(state, blocked_on=None)
            return state
        case UserInterrupt():
            history = state.history
            if state.lease is not None and history and history[-1].ended is None:
                history = (*history[:-1], msgspec.structs.replace(history[-1], ended="interrupted"))
            return msgspec.structs.replace(
                state,
                blocked_on=None,
                lease=None,
                history=history,
                epoch=max(state.epoch, event.epoch),
            )
        case _:
            return state


def _requeued(state: ActivationsState, event: ActivationRequeued, at: float) -> ActivationsState:
    """The activation waits until ``run_at``; messages its lease covered stay queued
    behind it and are covered again by its next lease."""
    lease = state.lease
    queue = []
    for activation in state.queue:
        if activation.activation_id == event.activation_id:
            queue.append(
                msgspec.structs.replace(
                    activation,
                    run_at=event.run_at,
                    streak=event.streak,
                    last_error=event.error_class,
                )
            )
        else:
            queue.append(activation)
    history = state.history
    if lease is not None and history:
        history = (*history[:-1], msgspec.structs.replace(history[-1], ended="requeued"))
    outcome = ActivationOutcome(
        activation_id=event.activation_id, status="requeued", at=at, error_class=event.error_class
    )
    return msgspec.structs.replace(
        state,
        queue=tuple(queue),
        lease=None,
        history=history,
        last_outcome=outcome,
        requeued=state.requeued + 1,
    )


def _released(state: ActivationsState, event: ActivationReleased) -> ActivationsState:
    """The holder handed the lease back: the activation (and what its lease covered) is
    queued as it was, due again at once, its failure streak untouched. The epoch the
    release claimed is the stream's (the store raised it): the next lease takes the one
    after, and the holder's fence no longer holds."""
    state = msgspec.structs.replace(state, epoch=max(state.epoch, event.claimed))
    lease = state.lease
    if lease is None or lease.epoch != event.epoch:
        return state
    history = state.history
    if history:
        history = (*history[:-1], msgspec.structs.replace(history[-1], ended="released"))
    return msgspec.structs.replace(state, lease=None, history=history)


def expired_lease(state: ActivationsState, event: LeaseExpired) -> ActivationsState:
    """The state once ``event`` (a takeover's ``lease:expired``) is folded."""
    lease = state.lease
    if lease is None or lease.epoch != event.epoch:
        return state
    queue = tuple(
        msgspec.structs.replace(a, streak=event.streak, last_error="lease_expired")
        if a.activation_id == event.activation_id
        else a
        for a in state.queue
    )
    history = state.history
    if history:
        history = (*history[:-1], msgspec.structs.replace(history[-1], ended="expired"))
    return msgspec.structs.replace(
        state, queue=queue, lease=None, history=history, expired=state.expired + 1
    )


class ActivationsAggregate:
    """The activations fold as an :class:`~stalwart.state.Aggregate`."""

    name = "activations"
    version = 1
    state_type = ActivationsState

    def initial(self, stream: str) -> ActivationsState:
        return ActivationsState(stream=stream)

    def apply(self, state: ActivationsState, record: RecordedEvent) -> ActivationsState:
        return apply_activations(state, record)

    def folder(self, state: ActivationsState) -> ApplyFolder[ActivationsState]:
        return ApplyFolder(apply_activations, state)


ACTIVATIONS = ActivationsAggregate()
